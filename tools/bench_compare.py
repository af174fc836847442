#!/usr/bin/env python3
"""One command, one session: runs benches/ffn.rs and tools/bench_torch.py with the same thread
count, taking turns variant by variant for --rounds rounds (each row keeps its fastest round on
each side), and prints the ratio ffn/PyTorch of throughput per row (above 1:
ffn is faster), as a Markdown table.

    python3 tools/bench_compare.py [--features ndarray] [--repeats 5] [--rounds 2] [--variants ...]
                                   [--modes fwd+bwd,block] [--paths op,composed]
                                   [--precision f32,bf16]
    python3 tools/bench_compare.py --memory [--features ndarray] [--variants ...]

Timings run with freed memory kept mapped on both sides (ffn_model::keep_freed_memory, as
ffn-train runs, and the same glibc settings for PyTorch); --plain-allocator: glibc's defaults on
both sides.

--precision bf16 compares ffn's `precision = "bf16"` rows with PyTorch under
`torch.autocast("cpu", dtype=torch.bfloat16)`, and (with f32 too) each bf16 row with ffn's own f32
row. Each table ends with the geometric mean of its ratios.

--memory compares the peak memory of a training step instead (both sides: three AdamW steps,
resident-set high-water mark above the resident set before them, a fresh process each).

Needs `pip install torch`.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(here)


MODES = ["forward", "fwd+bwd", "fwd+bwd-w", "step", "block", "memory"]
VARIANTS = ["FFN_ReLU", "FFN_GELU", "FFN_Swish", "FFN_GLU", "FFN_Bilinear", "FFN_ReGLU",
            "FFN_GEGLU", "FFN_SwiGLU"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--features", default="")
    parser.add_argument("--repeats", default="5")
    parser.add_argument("--rounds", type=int, default=2,
                        help="interleaved rounds; each row keeps its fastest round (both sides)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--modes", default="forward,fwd+bwd,fwd+bwd-w,step,block")
    parser.add_argument("--paths", default="op,composed", help="ffn paths: op, composed")
    parser.add_argument("--precision", default="f32", help="f32, bf16 or both (f32,bf16)")
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--plain-allocator", action="store_true",
                        help="time both sides with glibc's default allocator settings (default: "
                             "both keep freed memory mapped, as ffn-train runs)")
    args = parser.parse_args()
    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads))
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
        rows_path = f.name
    cargo = ["cargo", "bench", "--bench", "ffn"]
    if args.features:
        cargo += ["--features", args.features]
    subprocess.run(cargo + ["--no-run"], cwd=root, env=env, check=True)
    cargo += ["--", "--json", rows_path, "--repeats", args.repeats, "--modes", args.modes,
              "--paths", args.paths, "--precision", args.precision]
    torch_cmd = [sys.executable, os.path.join(here, "bench_torch.py"), "--threads", str(args.threads),
                 "--repeats", args.repeats, "--modes", args.modes, "--precision", args.precision]
    if args.memory:
        cargo.append("--memory")
        torch_cmd.append("--memory")
    elif args.plain_allocator:
        cargo.append("--plain-allocator")
        torch_cmd.append("--plain-allocator")
    # ffn and PyTorch take turns, variant by variant, for `rounds` rounds: a slow spell of a
    # shared machine then hits both sides of a row, and the fastest round of each is kept.
    ours, theirs = [], []
    for _ in range(args.rounds):
        for variant in args.variants.split(","):
            subprocess.run(cargo + ["--variants", variant], cwd=root, env=env, check=True,
                           stdout=sys.stderr)
            ours += [json.loads(line) for line in open(rows_path)]
            out = subprocess.run(torch_cmd + ["--variants", variant], check=True,
                                 capture_output=True, text=True, env=env).stdout
            theirs += [json.loads(line) for line in out.splitlines()]
    key = lambda r: (r["variant"], r["d_model"], r["tokens"], r["mode"])
    ours, theirs = fastest(ours, key), fastest(theirs, key)
    if args.memory:
        memory_table(ours, theirs, key)
        return
    print(f"\n{args.threads} threads, median of {args.repeats}, best of {args.rounds} interleaved "
          "rounds; ratio = PyTorch time / ffn time "
          "(throughput ffn/PyTorch, above 1: ffn is faster)")
    print(f"matrix products: {kernels()}")
    for torch_impl, bf16 in (("pytorch", False), ("pytorch-autocast", True)):
        rows = [r for r in theirs if r["impl"] == torch_impl]
        impls = sorted({r["impl"] for r in ours if r["impl"].endswith("-bf16") == bf16})
        if rows and impls:
            ratio_table(f"\n{torch_impl}\n", rows, ours, impls, key, lambda r, o: r["ms"] / o["ms"])
    # bf16 against ffn's own f32, per ffn implementation.
    f32_rows = {(r["impl"], key(r)): r for r in ours if not r["impl"].endswith("-bf16")}
    pairs = [(r, f32_rows.get((r["impl"][:-5], key(r)))) for r in ours if r["impl"].endswith("-bf16")]
    pairs = [(b, f) for b, f in pairs if f]
    if pairs:
        print("\nbf16 / f32, ffn's own (f32 time / bf16 time, above 1: bf16 is faster)\n")
        print("| impl | variant | d_model | tokens | mode | f32 ms | bf16 ms | ratio |")
        print("|---|---|---|---|---|---|---|---|")
        for b, f in pairs:
            print(f"| {f['impl']} | {b['variant']} | {b['d_model']} | {b['tokens']} | {b['mode']} | "
                  f"{f['ms']:.1f} | {b['ms']:.1f} | {f['ms'] / b['ms']:.2f}× |")
        print(f"| geometric mean | | | | | | | {geomean([f['ms'] / b['ms'] for b, f in pairs]):.2f}× |")
    impls = sorted({r["impl"] for r in ours})
    # Fused against unfused, per backend: throughput ratio (above 1: fusing pays).
    fused = [i for i in impls if i.endswith("-fused")]
    if fused:
        print("\nfused / unfused throughput (above 1: fusing pays)\n")
        print("| variant | d_model | tokens | mode | " + " | ".join(fused) + " |")
        print("|" + "---|" * (4 + len(fused)))
        for r in (r for r in theirs if r["impl"] == "pytorch"):
            cells = []
            for i in fused:
                f = next((o for o in ours if o["impl"] == i and key(o) == key(r)), None)
                u = next((o for o in ours if o["impl"] == i[:-6] and key(o) == key(r)), None)
                cells.append(f"{u['ms'] / f['ms']:.2f}×" if f and u else "-")
            if any(c != "-" for c in cells):
                print(f"| {r['variant']} | {r['d_model']} | {r['tokens']} | {r['mode']} | "
                      + " | ".join(cells) + " |")


def geomean(values):
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def kernels():
    """The CPU, its family and model, and the flags that decide the kernels (/proc/cpuinfo)."""
    fields = {}
    for line in open("/proc/cpuinfo"):
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
        if key.strip() == "flags":
            break
    flags = [f for f in fields.get("flags", "").split()
             if f in ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_bf16")]
    return (f"CPU {fields.get('model name', '?')} (family {fields.get('cpu family', '?')}, model "
            f"{fields.get('model', '?')}), {' '.join(flags)} (ffn's own report heads its output)")


def ratio_table(title, theirs, ours, impls, key, ratio):
    """PyTorch's rows with each ffn implementation's time and ratio, and their geometric mean."""
    print(title)
    header = "| variant | d_model | d_ff | tokens | mode | PyTorch ms | " + " | ".join(
        f"{i} ms | {i} ratio" for i in impls) + " |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    ratios = {i: [] for i in impls}
    for r in theirs:
        cells = []
        for i in impls:
            mine = next((o for o in ours if o["impl"] == i and key(o) == key(r)), None)
            if mine:
                ratios[i].append(ratio(r, mine))
            cells.append(f"{mine['ms']:.1f} | {ratio(r, mine):.2f}×" if mine else "- | -")
        print(f"| {r['variant']} | {r['d_model']} | {r['d_ff']} | {r['tokens']} | {r['mode']} | "
              f"{r['ms']:.1f} | " + " | ".join(cells) + " |")
    print("| geometric mean | | | | | | " + " | ".join(
        f"| {geomean(ratios[i]):.2f}×" for i in impls) + " |")


def fastest(rows, key):
    """One row per (impl, setup, shape, mode): the one with the least time (or memory)."""
    best = {}
    for r in rows:
        k = (r["impl"], r.get("setup"), key(r))
        value = r.get("ms", r.get("step_mib"))
        if k not in best or value < best[k].get("ms", best[k].get("step_mib")):
            best[k] = r
    # PyTorch's rows in its own order (shapes, then variants), for the table.
    return sorted(best.values(), key=lambda r: (r["d_model"], VARIANTS.index(r["variant"])
                                                if r["variant"] in VARIANTS else 0,
                                                MODES.index(r["mode"])))


def memory_table(ours, theirs, key):
    """Peak step memory, MiB, PyTorch and every ffn setup, with the ratio PyTorch/ffn."""
    setups = sorted({(r["impl"], r["setup"]) for r in ours})
    print("\nPeak memory of three AdamW steps above the resident set before them, MiB; "
          "ratio = PyTorch / ffn (above 1: ffn needs less)\n")
    header = "| variant | d_model | d_ff | tokens | PyTorch MiB | " + " | ".join(
        f"{i} {s} MiB | ratio" for i, s in setups) + " |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for r in theirs:
        cells = []
        for i, s in setups:
            mine = next((o for o in ours if (o["impl"], o["setup"]) == (i, s)
                         and key(o) == key(r)), None)
            cells.append(f"{mine['step_mib']:.1f} | {r['step_mib'] / mine['step_mib']:.2f}×"
                         if mine else "- | -")
        print(f"| {r['variant']} | {r['d_model']} | {r['d_ff']} | {r['tokens']} | "
              f"{r['step_mib']:.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
