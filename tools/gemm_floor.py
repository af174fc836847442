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

Prints one Markdown table: per shape, the products' GFLOP, their time single-threaded (each
library), the floor for T threads, and the libraries' own T-thread time.
"""

import argparse
import ctypes

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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    lib = ctypes.CDLL("libopenblas.so.0")
    t = args.threads
    print(f"| d_model | d_ff | tokens | GFLOP | OpenBLAS 1 thread ms | MKL 1 thread ms | floor "
          f"for {t} threads ms | OpenBLAS {t} threads ms | MKL {t} threads ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for d_model, tokens in SHAPES:
        for gated in (False, True):
            d_ff = (8 * d_model + 1) // 3 if gated else 4 * d_model
            ps = products(tokens, d_model, d_ff, gated)
            ms = {}
            for threads in (1, t):
                lib.openblas_set_num_threads(threads)
                torch.set_num_threads(threads)
                ms["openblas", threads] = median(args.repeats, openblas(lib, ps)) * 1e3
                ms["mkl", threads] = median(args.repeats, pytorch(ps)) * 1e3
            floor = min(ms["openblas", 1], ms["mkl", 1]) / t
            print(f"| {d_model} | {d_ff} | {tokens} | {flops(ps) / 1e9:.1f} | "
                  f"{ms['openblas', 1]:.1f} | {ms['mkl', 1]:.1f} | **{floor:.1f}** | "
                  f"{ms['openblas', t]:.1f} | {ms['mkl', t]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
