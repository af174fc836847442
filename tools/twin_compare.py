#!/usr/bin/env python3
"""ffn-train against its PyTorch twin (tools/twin_torch.py), runs taken in turn, same threads.

    python3 tools/twin_compare.py [--configs default,configs/window.toml,configs/text.toml] [--steps 300]
                                  [--rounds 2] [--threads 2] [--binary target/release/ffn-train]
                                  [--precision f32,bf16]

--precision runs each config in each precision (`--set train.precision=...`); the twin of a bf16
run trains under torch.autocast (see tools/twin_torch.py).

For each config and round: `ffn-train train` (evaluation and checkpoints only at the end), then
the twin on that run's resolved config. ffn's tokens/s is its summary's (training steps only);
cores busy is the process's CPU time over its wall time. The twin runs with the glibc settings
that `ffn-train` makes for itself (`keep_freed_memory` in `main.rs`: freed memory stays mapped),
given as `MALLOC_*_` environment variables, so that neither side pays page faults the other
does not (`--plain-allocator` leaves the twin's allocator alone). Prints a Markdown table: per
config the best round of each side (the machine is shared and noisy), the ratio
ffn / PyTorch (above 1: ffn is faster), and the cores each kept busy. Build first:
`cargo build --release -p ffn-train`.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def cpu_name():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def cpu_flags():
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            flags = line.split(":", 1)[1].split()
            return " ".join(f for f in ["avx2", "fma", "avx512f", "avx512_bf16"] if f in flags)
    return "?"


def timed(cmd, env):
    """Runs cmd; returns (stdout, wall seconds)."""
    start = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    out, err = p.communicate()
    wall = time.perf_counter() - start
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{err}")
    return out, wall


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="default,configs/window.toml,configs/text.toml")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--binary", default="target/release/ffn-train")
    p.add_argument("--plain-allocator", action="store_true")
    p.add_argument("--precision", default="f32", help="f32, bf16 or both (f32,bf16)")
    a = p.parse_args()
    env = dict(os.environ, RAYON_NUM_THREADS=str(a.threads), OMP_NUM_THREADS=str(a.threads))
    twin_env = dict(env)
    if not a.plain_allocator:  # the mallopt calls of ffn-train's keep_freed_memory (main.rs)
        twin_env.update(
            MALLOC_MMAP_THRESHOLD_=str(256 << 20),
            MALLOC_TRIM_THRESHOLD_=str(1 << 30),
            MALLOC_TOP_PAD_=str(64 << 20),
        )
    rows = {}
    with tempfile.TemporaryDirectory() as scratch:
        for r in range(a.rounds):
            for config, precision in [(c, p) for c in a.configs.split(",")
                                      for p in a.precision.split(",")]:
                run = os.path.join(scratch, f"{os.path.basename(config)}-{precision}-{r}")
                cmd = [a.binary, "train", "--run", run, "--set", f"train.precision={precision}"]
                if config != "default":
                    cmd += ["--config", config]
                for key in ["steps", "eval_every", "checkpoint_every", "log_every"]:
                    value = 10 if key == "log_every" else a.steps
                    cmd += ["--set", f"train.{key}={value}"]
                before = os.times()
                _, wall = timed(cmd, env)
                after = os.times()
                cpu = (after.children_user - before.children_user) + (
                    after.children_system - before.children_system
                )
                summary = json.load(open(os.path.join(run, "summary.json")))
                ffn = (summary["tokens_per_s"], cpu / wall)
                twin = [sys.executable, os.path.join(HERE, "twin_torch.py"), run,
                        "--threads", str(a.threads), "--steps", str(a.steps)]
                out, _ = timed(twin, twin_env)
                torch = json.loads(out.strip().splitlines()[-1])
                label = f"{config} ({precision})"
                rows.setdefault(label, []).append((ffn, (torch["tokens_per_s"], torch["cores_busy"])))
                print(
                    f"round {r + 1} {label}: ffn {ffn[0]:,.0f} tok/s ({ffn[1]:.2f} cores), "
                    f"PyTorch {torch['tokens_per_s']:,.0f} tok/s ({torch['cores_busy']:.2f} cores)",
                    file=sys.stderr,
                )
    allocator = "plain" if a.plain_allocator else "the same glibc settings"
    print(f"\n{cpu_name()} ({cpu_flags()}), {a.threads} threads each, {a.steps} steps, "
          f"best of {a.rounds} rounds taken in turn; the twin's allocator: {allocator}\n")
    print("| config | ffn tokens/s | cores busy | PyTorch tokens/s | cores busy | ffn / PyTorch |")
    print("|---|---|---|---|---|---|")
    for config, results in rows.items():
        ffn = max(r[0] for r in results)
        torch = max(r[1] for r in results)
        print(f"| {config} | {ffn[0]:,.0f} | {ffn[1]:.2f} | {torch[0]:,.0f} | {torch[1]:.2f} | "
              f"{ffn[0] / torch[0]:.2f}× |")


if __name__ == "__main__":
    main()
