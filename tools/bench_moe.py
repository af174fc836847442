#!/usr/bin/env python3
"""The MoE benchmark side by side: ffn's `Moe` and dense FFN (`cargo bench --bench moe`)
against the `transformers` Mixtral sparse block (each experts implementation that runs) and a
dense PyTorch SwiGLU of the same active width, forward and backward with the input gradient
(`L = Σ y ⊙ g`), the same thread count on both sides, taking turns shape by shape for two
rounds and keeping each row's faster round. Prints one table with times and ratios.

    pip install torch transformers
    python3 tools/bench_moe.py                       # d_model 512 and 1024, 8 experts, top-2
    python3 tools/bench_moe.py --shapes 512:1365:2048  # d_model:d_ff:tokens (any d_ff)
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def median(repeats, f):
    for _ in range(2):
        f()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def torch_rows(d_model, d_ff, experts, top_k, tokens, repeats):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    torch.manual_seed(0)
    x = torch.randn(1, tokens, d_model, requires_grad=True)
    g = torch.randn(1, tokens, d_model)

    def fwd_bwd(f):
        def run():
            x.grad = None
            y = f(x)
            (y * g).sum().backward()
            x.grad.sum().item()
        return run

    rows = {}
    for implementation in ["grouped_mm", "eager"]:
        cfg = MixtralConfig(hidden_size=d_model, intermediate_size=d_ff, num_local_experts=experts,
                            num_experts_per_tok=top_k)
        cfg._experts_implementation = implementation
        block = MixtralSparseMoeBlock(cfg)
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.02)
        try:
            rows[f"transformers-{implementation}"] = median(repeats, fwd_bwd(block)) * 1e3
        except Exception as e:  # grouped_mm refuses some shapes on the CPU
            print(f"transformers {implementation} failed: {str(e).splitlines()[0]}", file=sys.stderr)
    w_gate, w_up = (torch.randn(top_k * d_ff, d_model) * 0.02 for _ in range(2))
    w_down = torch.randn(d_model, top_k * d_ff) * 0.02
    for w in (w_gate, w_up, w_down):
        w.requires_grad_(True)
    rows["torch-dense"] = median(repeats, fwd_bwd(
        lambda x: F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down))) * 1e3
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="512:1368:2048,1024:2736:2048",
                        help="d_model:expert d_ff:tokens, comma separated")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads))
    torch.set_num_threads(args.threads)
    cargo = ["cargo", "bench", "--bench", "moe"]
    subprocess.run(cargo + ["--no-run"], cwd=root, env=env, check=True)
    best = {}
    for _ in range(args.rounds):
        for shape in args.shapes.split(","):
            d_model, d_ff, tokens = map(int, shape.split(":"))
            with tempfile.NamedTemporaryFile(suffix=".jsonl") as rows:
                subprocess.run(cargo + ["--", "--d-model", str(d_model), "--d-ff", str(d_ff),
                                        "--experts", str(args.experts), "--top-k", str(args.top_k),
                                        "--tokens", str(tokens), "--repeats", str(args.repeats),
                                        "--json", rows.name],
                               cwd=root, env=env, check=True, stdout=sys.stderr)
                ours = {r["impl"]: r["ms"] for r in map(json.loads, open(rows.name))}
            theirs = torch_rows(d_model, d_ff, args.experts, args.top_k, tokens, args.repeats)
            for name, ms in {**ours, **theirs}.items():
                key = (shape, name)
                best[key] = min(best.get(key, float("inf")), ms)
    print(f"\n{args.experts} experts, top-{args.top_k}, SwiGLU experts, fwd+bwd with the input "
          f"gradient, {args.threads} threads, median of {args.repeats}, best of {args.rounds} "
          "rounds taken in turn\n")
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
