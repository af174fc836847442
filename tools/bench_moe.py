#!/usr/bin/env python3
"""The MoE benchmark side by side: ffn's `Moe` and dense FFN (`cargo bench --bench moe`)
against the `transformers` Mixtral sparse block (each experts implementation that runs) and a
dense PyTorch SwiGLU of the same active width, forward and backward with the input gradient
(`L = Σ y ⊙ g`), the same thread count on both sides, taking turns shape by shape for two
rounds and keeping each row's faster round. Prints one table with times and ratios.

    pip install torch transformers
    python3 tools/bench_moe.py                       # d_model 512 and 1024, 8 experts, top-2
    python3 tools/bench_moe.py --shapes 512:1365:2048  # d_model:d_ff:tokens (any d_ff)
    python3 tools/bench_moe.py --memory              # peak memory of a training step
    python3 tools/bench_moe.py --precision bf16      # ffn in bf16, PyTorch under autocast

Timings run with freed memory kept mapped on both sides (ffn_model::keep_freed_memory, as
ffn-train runs, and the same glibc settings for PyTorch); --plain-allocator: glibc's defaults.

--precision bf16: ffn's layers with `precision = "bf16"` (the experts' products), PyTorch's
forward under `torch.autocast("cpu", dtype=torch.bfloat16)` (its backward follows autocast's
casts).

--memory: the peak memory of three AdamW steps (the input gradient taken) above the resident
set before them, each layer in a fresh process, measured as `cargo bench --bench moe --
--memory` does (Linux's VmHWM, reset through /proc/self/clear_refs).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_torch import keep_freed_memory, median, step_memory  # the same readings


TORCH_IMPLS = ["transformers-grouped_mm", "transformers-eager", "torch-dense"]


def torch_layer(name, d_model, d_ff, experts, top_k):
    """The transformers Mixtral block with one experts implementation, or the dense SwiGLU of
    the same active width, as a module."""
    if name == "torch-dense":
        return DenseSwiGLU(d_model, top_k * d_ff)
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=d_model, intermediate_size=d_ff, num_local_experts=experts,
                        num_experts_per_tok=top_k)
    cfg._experts_implementation = name.removeprefix("transformers-")
    block = MixtralSparseMoeBlock(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return block


class DenseSwiGLU(torch.nn.Module):
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.w_gate, self.w_up = (torch.nn.Parameter(torch.randn(d_ff, d_model) * 0.02)
                                  for _ in range(2))
        self.w_down = torch.nn.Parameter(torch.randn(d_model, d_ff) * 0.02)

    def forward(self, x):
        return F.linear(F.silu(F.linear(x, self.w_gate)) * F.linear(x, self.w_up), self.w_down)


def memory_child(name, d_model, d_ff, experts, top_k, tokens):
    """In a fresh process: one JSON row, the peak memory of three AdamW steps."""
    torch.manual_seed(0)
    layer = torch_layer(name, d_model, d_ff, experts, top_k)
    x = torch.randn(1, tokens, d_model, requires_grad=True)
    g = torch.randn(1, tokens, d_model)
    step, _ = step_memory(layer, x, g)
    print(json.dumps({"impl": name, "d_model": d_model, "d_ff": d_ff, "experts": experts,
                      "top_k": top_k, "tokens": tokens,
                      "step_mib": round(step, 1)}))


def torch_rows(d_model, d_ff, experts, top_k, tokens, repeats, precision="f32"):
    torch.manual_seed(0)
    x = torch.randn(1, tokens, d_model, requires_grad=True)
    g = torch.randn(1, tokens, d_model)

    def fwd_bwd(f):
        def run():
            x.grad = None
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                y = f(x)
            (y.float() * g).sum().backward()
            x.grad.sum().item()
        return run

    rows = {}
    for name in TORCH_IMPLS:
        layer = torch_layer(name, d_model, d_ff, experts, top_k)
        try:
            rows[name] = median(repeats, fwd_bwd(layer)) * 1e3
        except Exception as e:  # grouped_mm refuses some shapes on the CPU
            print(f"{name} failed: {str(e).splitlines()[0]}", file=sys.stderr)
    return rows


def memory(args, root, env):
    """Peak memory of a training step: each layer in a fresh process, one table."""
    cargo = ["cargo", "bench", "--bench", "moe"]
    subprocess.run(cargo + ["--no-run"], cwd=root, env=env, check=True)
    names = ["ffn-moe", "ffn-dense"] + TORCH_IMPLS
    print(f"\nPeak memory of three AdamW steps above the resident set before them (MiB), "
          f"{args.experts} experts, top-{args.top_k}, SwiGLU experts, the input gradient taken; "
          "each layer in a fresh process\n")
    print("| d_model | expert d_ff | tokens | " + " | ".join(f"{n} MiB" for n in names)
          + " | ffn-moe / transformers best |")
    print("|" + "---|" * (len(names) + 4))
    for shape in args.shapes.split(","):
        d_model, d_ff, tokens = map(int, shape.split(":"))
        mib = {}
        with tempfile.NamedTemporaryFile(suffix=".jsonl") as rows:
            subprocess.run(cargo + ["--", "--memory", "--d-model", str(d_model), "--d-ff",
                                    str(d_ff), "--experts", str(args.experts), "--top-k",
                                    str(args.top_k), "--tokens", str(tokens), "--json", rows.name],
                           cwd=root, env=env, check=True, stdout=sys.stderr)
            mib.update({r["impl"]: r["step_mib"] for r in map(json.loads, open(rows.name))})
        for name in TORCH_IMPLS:
            out = subprocess.run([sys.executable, __file__, "--threads", str(args.threads),
                                  "--memory-child", name, str(d_model), str(d_ff),
                                  str(args.experts), str(args.top_k), str(tokens)],
                                 env=env, capture_output=True, text=True)
            if out.returncode == 0:
                mib[name] = json.loads(out.stdout.strip().splitlines()[-1])["step_mib"]
            else:
                print(f"{name} failed: {out.stderr.strip().splitlines()[-1]}", file=sys.stderr)
        cells = [f"{mib[n]:.1f}" if n in mib else "fails" for n in names]
        hf = [mib[n] for n in TORCH_IMPLS if n.startswith("transformers") and n in mib]
        ratio = f"{mib['ffn-moe'] / min(hf):.2f}" if hf else "-"
        print(f"| {d_model} | {d_ff} | {tokens} | " + " | ".join(cells) + f" | {ratio} |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="512:1368:2048,1024:2736:2048",
                        help="d_model:expert d_ff:tokens, comma separated")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--precision", default="f32", choices=["f32", "bf16"],
                        help="bf16: ffn in bf16, PyTorch under autocast (timings only)")
    parser.add_argument("--plain-allocator", action="store_true",
                        help="time both sides with glibc's default allocator settings (default: "
                             "both keep freed memory mapped, as ffn-train runs)")
    parser.add_argument("--memory-child", nargs=6,
                        metavar=("IMPL", "D_MODEL", "D_FF", "EXPERTS", "TOP_K", "TOKENS"))
    args = parser.parse_args()
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads))
    torch.set_num_threads(args.threads)
    if args.memory_child:
        name, *numbers = args.memory_child
        return memory_child(name, *map(int, numbers))
    if args.memory:
        return memory(args, root, env)
    allocator = keep_freed_memory(args.plain_allocator)
    cargo = ["cargo", "bench", "--bench", "moe"]
    subprocess.run(cargo + ["--no-run"], cwd=root, env=env, check=True)
    plain = ["--plain-allocator"] if args.plain_allocator else []
    best = {}
    for _ in range(args.rounds):
        for shape in args.shapes.split(","):
            d_model, d_ff, tokens = map(int, shape.split(":"))
            with tempfile.NamedTemporaryFile(suffix=".jsonl") as rows:
                subprocess.run(cargo + ["--", "--d-model", str(d_model), "--d-ff", str(d_ff),
                                        "--experts", str(args.experts), "--top-k", str(args.top_k),
                                        "--tokens", str(tokens), "--repeats", str(args.repeats),
                                        "--json", rows.name, "--precision", args.precision]
                               + plain,
                               cwd=root, env=env, check=True, stdout=sys.stderr)
                ours = {r["impl"]: r["ms"] for r in map(json.loads, open(rows.name))}
            theirs = torch_rows(d_model, d_ff, args.experts, args.top_k, tokens, args.repeats,
                                args.precision)
            for name, ms in {**ours, **theirs}.items():
                key = (shape, name)
                best[key] = min(best.get(key, float("inf")), ms)
    print(f"\n{args.experts} experts, top-{args.top_k}, SwiGLU experts, {args.precision}"
          f"{' (PyTorch: autocast)' if args.precision == 'bf16' else ''}, fwd+bwd with the input "
          f"gradient, {args.threads} threads, median of {args.repeats}, best of {args.rounds} "
          f"rounds taken in turn; allocator on both sides: {allocator}\n")
    names = ["ffn-moe", "ffn-dense", "transformers-grouped_mm", "transformers-eager", "torch-dense"]
    print("| d_model | expert d_ff | tokens | " + " | ".join(f"{n} ms" for n in names)
          + " | moe / dense (ffn) | transformers best / ffn-moe |")
    print("|" + "---|" * (len(names) + 5))
    for shape in args.shapes.split(","):
        d_model, d_ff, tokens = shape.split(":")
        ms = {n: best.get((shape, n)) for n in names}
        cells = [f"{ms[n]:.1f}" if ms[n] is not None else "fails" for n in names]
        hf = [ms[n] for n in names if n.startswith("transformers") and ms[n] is not None]
        speedup = f"{min(hf) / ms['ffn-moe']:.2f}×" if hf else "-"
        print(f"| {d_model} | {d_ff} | {tokens} | " + " | ".join(cells)
              + f" | {ms['ffn-moe'] / ms['ffn-dense']:.2f}× | {speedup} |")


if __name__ == "__main__":
    main()
