#!/usr/bin/env python3
"""The time floor of an FFN's forward and backward pass with the input gradient: its matrix
products alone, nothing else, at the benchmark's shapes (benches/ffn.rs, tools/bench_torch.py).

Each product is timed single-threaded through OpenBLAS's `cblas_sgemm` (the library the FFN op
loads) and through PyTorch's `@` (MKL); the floor for T threads is the single-threaded time over T
(perfect scaling, no element-wise work, no memory traffic beyond the products'). No FFN, in
either framework, runs faster than its products at the best GEMM speed available: the floor
bounds any ratio. With `--threads T` the products are also timed with the libraries' own
threading.

    python3 tools/gemm_floor.py [--threads 2] [--repeats 7]

The floor is taken with the fastest kernels the machine has: OpenBLAS runs once as it detects
the CPU (or as `OPENBLAS_CORETYPE` says) and once under each core type of its own that the CPU
can run (`SkylakeX` and `Cooperlake` where it has AVX-512, `Haswell`), each in a fresh process
(the variable is read when the library loads), and the fastest is kept per shape and named.

Prints one Markdown table: per shape, the products' GFLOP, their time single-threaded (the
fastest OpenBLAS kernels, named, and MKL), the floor for T threads, and the libraries' own
T-thread time.
"""

import argparse
import ctypes
import json
import os
import subprocess
import sys

import torch

from bench_torch import SHAPES, median  # the benchmark's shapes and timing

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112


def products(tokens, d_model, d_ff, gated):
    """The products of fwd+bwd with dx as (a, a transposed, b, b transposed, output shape):
    forward up (gate), down; backward dH, dW_down, dW_up (dW_gate), dX (one per projection)."""
    x, dy = torch.randn(tokens, d_model), torch.randn(tokens, d_model)
    w_up, w_down = torch.randn(d_model, d_ff), torch.randn(d_ff, d_model)
    h = torch.randn(tokens, d_ff)
    ps = [(x, False, w_up, False, (tokens, d_ff)), (h, False, w_down, False, (tokens, d_model)),
          (dy, False, w_down, True, (tokens, d_ff)), (h, True, dy, False, (d_ff, d_model)),
          (x, True, h, False, (d_model, d_ff)), (h, False, w_up, True, (tokens, d_model))]
    if gated:
        w_gate = torch.randn(d_model, d_ff)
        ps += [(x, False, w_gate, False, (tokens, d_ff)), (x, True, h, False, (d_model, d_ff)),
               (h, False, w_gate, True, (tokens, d_model))]
    return ps


def flops(ps):
    return sum(2 * m * n * (a.shape[0] if ta else a.shape[1]) for a, ta, _, _, (m, n) in ps)


def openblas(lib, ps):
    outs = [torch.empty(shape) for *_, shape in ps]

    def run():
        for (a, ta, b, tb, (m, n)), c in zip(ps, outs):
            k = a.shape[0] if ta else a.shape[1]
            lib.cblas_sgemm(ROW_MAJOR, TRANS if ta else NO_TRANS, TRANS if tb else NO_TRANS,
                            m, n, k, ctypes.c_float(1.0), ctypes.c_void_p(a.data_ptr()),
                            a.shape[1], ctypes.c_void_p(b.data_ptr()), b.shape[1],
                            ctypes.c_float(0.0), ctypes.c_void_p(c.data_ptr()), n)
    return run


def pytorch(ps):
    def run():
        for a, ta, b, tb, _ in ps:
            (a.t() if ta else a) @ (b.t() if tb else b)
    return run


def core_types():
    """OpenBLAS core types to try: as the environment has it (None), then each the CPU runs."""
    flags = open("/proc/cpuinfo").read().split()
    kinds = [None, "Haswell"] if "avx2" in flags else [None]
    if "avx512f" in flags:
        kinds += ["SkylakeX"] + (["Cooperlake"] if "avx512_bf16" in flags else [])
    return kinds


def child(threads, repeats):
    """One JSON line per shape: its products' times under this process's OpenBLAS kernels."""
    lib = ctypes.CDLL("libopenblas.so.0")
    lib.openblas_get_corename.restype = ctypes.c_char_p
    core = lib.openblas_get_corename().decode()
    for d_model, tokens in SHAPES:
        for gated in (False, True):
            d_ff = (8 * d_model + 1) // 3 if gated else 4 * d_model
            ps = products(tokens, d_model, d_ff, gated)
            ms = {}
            for t in (1, threads):
                lib.openblas_set_num_threads(t)
                torch.set_num_threads(t)
                ms[f"openblas{t}"] = median(repeats, openblas(lib, ps)) * 1e3
                ms[f"mkl{t}"] = median(repeats, pytorch(ps)) * 1e3
            print(json.dumps({"shape": [d_model, d_ff, tokens], "gflop": flops(ps) / 1e9,
                              "core": core, **ms}), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.threads, args.repeats)
    t = args.threads
    rows = {}
    for kind in core_types():
        env = dict(os.environ, **({"OPENBLAS_CORETYPE": kind} if kind else {}))
        out = subprocess.run([sys.executable, __file__, "--child", "--threads", str(t),
                              "--repeats", str(args.repeats)], env=env, check=True,
                             capture_output=True, text=True).stdout
        for row in map(json.loads, out.splitlines()):
            key = tuple(row["shape"])
            best = rows.setdefault(key, dict(row, mkl_t=row[f"mkl{t}"]))
            best["mkl1"] = min(best["mkl1"], row["mkl1"])
            best["mkl_t"] = min(best["mkl_t"], row[f"mkl{t}"])
            if row["openblas1"] <= best["openblas1"]:
                best.update(openblas1=row["openblas1"], core=row["core"])
            best[f"openblas{t}_best"] = min(best.get(f"openblas{t}_best", float("inf")),
                                            row[f"openblas{t}"])
    print(f"| d_model | d_ff | tokens | GFLOP | OpenBLAS 1 thread ms (kernels) | MKL 1 thread ms | "
          f"floor for {t} threads ms | OpenBLAS {t} threads ms | MKL {t} threads ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (d_model, d_ff, tokens), r in rows.items():
        floor = min(r["openblas1"], r["mkl1"]) / t
        print(f"| {d_model} | {d_ff} | {tokens} | {r['gflop']:.1f} | {r['openblas1']:.1f} "
              f"({r['core']}) | {r['mkl1']:.1f} | **{floor:.1f}** | "
              f"{r[f'openblas{t}_best']:.1f} | {r['mkl_t']:.1f} |")


if __name__ == "__main__":
    main()
