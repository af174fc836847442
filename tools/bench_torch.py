#!/usr/bin/env python3
"""The PyTorch side of benches/ffn.rs: the same FFNs, shapes and three timings, with the same
thread count, one JSON object per row on stdout.

    python3 tools/bench_torch.py [--threads N] [--repeats N] [--variants SwiGLU,FFN_GELU]
                                 [--modes forward,fwd+bwd,fwd+bwd-w,step,block]
                                 [--precision f32,bf16]

--precision bf16 times each row again under `torch.autocast("cpu", dtype=torch.bfloat16)`
(impl "pytorch-autocast"), the one line a PyTorch user writes for mixed precision.
    python3 tools/bench_torch.py --memory [--threads N] [--variants ...]

--memory: the peak memory of three AdamW steps above the resident set before them, each
configuration in a fresh process, measured as benches/ffn.rs --memory does (Linux).
"""

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = [(512, 4096), (768, 2048)]
VARIANTS = {  # name: (activation, gated)
    "FFN_ReLU": (F.relu, False),
    "FFN_GELU": (F.gelu, False),
    "FFN_Swish": (F.silu, False),
    "FFN_GLU": (torch.sigmoid, True),
    "FFN_Bilinear": (lambda x: x, True),
    "FFN_ReGLU": (F.relu, True),
    "FFN_GEGLU": (F.gelu, True),
    "FFN_SwiGLU": (F.silu, True),
}


class FeedForward(torch.nn.Module):
    """y = down(act(gate(x)) * up(x)) or down(act(up(x))), no biases (Shazeer 2020)."""

    def __init__(self, d_model, d_ff, act, gated):
        super().__init__()
        self.act = act
        self.up = torch.nn.Linear(d_model, d_ff, bias=False)
        self.gate = torch.nn.Linear(d_model, d_ff, bias=False) if gated else None
        self.down = torch.nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x):
        h = self.act(self.gate(x)) * self.up(x) if self.gate is not None else self.act(self.up(x))
        return self.down(h)


def d_ff(name, d_model):
    """Parameter parity, as ffn-model's presets: 4·d_model, or round(8·d_model/3) gated."""
    return (8 * d_model + 1) // 3 if VARIANTS[name][1] else 4 * d_model


def median(repeats, f):
    for _ in range(2):
        f()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def keep_freed_memory(plain=False):
    """The glibc settings of ffn_model::keep_freed_memory (lib.rs), in this process: freed
    memory stays mapped for reuse, as the timed ffn side runs. `plain`: leave glibc's defaults.
    Returns the setting's name for the table's header."""
    if plain:
        return "glibc defaults"
    import ctypes
    libc = ctypes.CDLL("libc.so.6")
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
    libc.mallopt(M_MMAP_THRESHOLD, 256 << 20)
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
    libc.mallopt(M_TOP_PAD, 64 << 20)
    return "freed memory kept (ffn_model::keep_freed_memory)"


def status_mib(field):
    """A field of /proc/self/status in MiB."""
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def step_memory(model, x, g):
    """Three AdamW steps of `model` (`L = Σ model(x) ⊙ g`, the input's gradient taken): the
    peak resident memory above the resident set before them and the peak itself, in MiB (as
    benches/common's `step_memory`)."""
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    before = status_mib("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    for _ in range(3):
        optim.zero_grad(set_to_none=True)
        x.grad = None
        (model(x) * g).sum().backward()
        x.grad.sum().item()
        optim.step()
        sum(p.sum().item() for p in model.parameters())
    peak = status_mib("VmHWM:")
    return peak - before, peak


def memory_child(name, d_model, tokens):
    """In a fresh process: one JSON row, the peak memory of three AdamW steps."""
    act, gated = VARIANTS[name]
    torch.manual_seed(0)
    model = FeedForward(d_model, d_ff(name, d_model), act, gated)
    x = torch.randn(tokens, d_model, requires_grad=True)
    g = torch.randn(tokens, d_model)
    step, peak = step_memory(model, x, g)
    print(json.dumps({"impl": "pytorch", "setup": "save", "variant": name, "d_model": d_model,
                      "d_ff": d_ff(name, d_model), "tokens": tokens, "mode": "memory",
                      "step_mib": round(step, 1), "peak_rss_mib": round(peak, 1)}))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--modes", default="forward,fwd+bwd,fwd+bwd-w,step,block")
    parser.add_argument("--precision", default="f32", help="f32, bf16 (autocast) or both")
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--plain-allocator", action="store_true",
                        help="time with glibc's default allocator settings")
    parser.add_argument("--memory-child", nargs=3, metavar=("VARIANT", "D_MODEL", "TOKENS"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_child:
        name, d_model, tokens = args.memory_child
        memory_child(name, int(d_model), int(tokens))
        return
    if args.memory:
        for d_model, tokens in SHAPES:
            for name in args.variants.split(","):
                name = name if name.startswith("FFN_") else "FFN_" + name
                out = subprocess.run([sys.executable, __file__, "--threads", str(args.threads),
                                      "--memory-child", name, str(d_model), str(tokens)],
                                     check=True, capture_output=True, text=True)
                print(out.stdout.strip(), flush=True)
        return
    keep_freed_memory(args.plain_allocator)
    torch.manual_seed(0)
    modes = args.modes.split(",")
    for d_model, tokens in SHAPES:
        for name in args.variants.split(","):
            name = name if name.startswith("FFN_") else "FFN_" + name
            act, gated = VARIANTS[name]
            model = FeedForward(d_model, d_ff(name, d_model), act, gated)
            norm = torch.nn.LayerNorm(d_model)
            x = torch.randn(tokens, d_model)
            g = torch.randn(tokens, d_model)
            x_grad = x.clone().requires_grad_(True)

            def forward():
                with torch.no_grad():
                    model(x).sum().item()

            def backward(inp):
                def run():
                    model.zero_grad(set_to_none=True)
                    inp.grad = None
                    (model(inp) * g).sum().backward()
                    total = model.down.weight.grad.sum()
                    if inp.grad is not None:
                        total = total + inp.grad.sum()
                    total.item()
                return run

            optim = torch.optim.AdamW(model.parameters(), lr=1e-4)

            def step():
                optim.zero_grad(set_to_none=True)
                x_grad.grad = None
                (model(x_grad) * g).sum().backward()
                x_grad.grad.sum().item()
                optim.step()
                model.down.weight.sum().item()

            def block():
                model.zero_grad(set_to_none=True)
                norm.zero_grad(set_to_none=True)
                x_grad.grad = None
                y = x_grad + model(norm(x_grad))
                (y * g).sum().backward()
                x_grad.grad.sum().item()

            timed = {"forward": forward, "fwd+bwd": backward(x_grad), "fwd+bwd-w": backward(x),
                     "step": step, "block": block}
            for mode in [m for m in timed if m in modes]:
                for precision in args.precision.split(","):
                    bf16 = {"f32": False, "bf16": True}[precision]
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                        ms = median(args.repeats, timed[mode]) * 1e3
                    print(json.dumps({"impl": "pytorch-autocast" if bf16 else "pytorch",
                                      "variant": name, "d_model": d_model,
                                      "d_ff": d_ff(name, d_model), "tokens": tokens,
                                      "mode": mode, "ms": ms, "threads": args.threads}),
                          flush=True)


if __name__ == "__main__":
    main()
