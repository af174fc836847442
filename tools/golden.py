#!/usr/bin/env python3
"""Golden files for ffn-model's numerical tests, computed by PyTorch.

For every activation x gating x bias pattern it builds the reference network

    ungated: y = down(act(up(x)))
    gated:   y = down(act(gate(x)) * up(x))

as PyTorch modules (nn.Linear, torch.nn.functional), feeds it inputs of rank 2, 3 and 4, and
records the weights, the inputs, the outputs, and the gradients of L = sum(y**2) with respect
to the input and to every weight and bias. Everything is computed in float64 from values that
are exactly representable in float32, so the Rust tests can check an f32 module at ~1e-5 and an
f64 module at ~1e-12 against the same files.

One file per activation, crates/ffn-model/tests/data/golden_<activation>.safetensors, keys

    <case>/<param>                     weights, PyTorch layout ([out, in])
    <case>/r<rank>/x, /y, /dx          input, output, dL/dx
    <case>/r<rank>/grad/<param>        dL/d<param>

with <case> = "<plain|gated>_b<up><gate><down>" (bias flags as 0/1) and <param> one of
up.weight, up.bias, gate.weight, gate.bias, down.weight, down.bias.

Usage (nothing else to install):  pip install torch safetensors && python3 tools/golden.py
"""

import itertools
import pathlib

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

D_MODEL, D_FF = 5, 7
SHAPES = {2: (3, D_MODEL), 3: (2, 3, D_MODEL), 4: (2, 2, 2, D_MODEL)}
OUT = pathlib.Path(__file__).resolve().parent.parent / "crates/ffn-model/tests/data"

ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "identity": lambda x: x,
    "relu2": lambda x: F.relu(x) ** 2,
    "tanh": torch.tanh,
}


class FeedForward(torch.nn.Module):
    def __init__(self, act, gated, bias_up, bias_gate, bias_down):
        super().__init__()
        self.act = act
        self.up = torch.nn.Linear(D_MODEL, D_FF, bias=bias_up, dtype=torch.float64)
        self.gate = (
            torch.nn.Linear(D_MODEL, D_FF, bias=bias_gate, dtype=torch.float64) if gated else None
        )
        self.down = torch.nn.Linear(D_FF, D_MODEL, bias=bias_down, dtype=torch.float64)

    def forward(self, x):
        if self.gate is not None:
            h = self.act(self.gate(x)) * self.up(x)
        else:
            h = self.act(self.up(x))
        return self.down(h)


def f32_exact(t):
    """Rounds to the nearest float32, kept as float64."""
    return t.float().double()


def cases():
    for gated in (False, True):
        for bias_up, bias_gate, bias_down in itertools.product((False, True), repeat=3):
            if bias_gate and not gated:
                continue
            name = f"{'gated' if gated else 'plain'}_b{int(bias_up)}{int(bias_gate)}{int(bias_down)}"
            yield name, gated, bias_up, bias_gate, bias_down


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(20200212)  # Shazeer's arXiv date
    for act_name, act in ACTIVATIONS.items():
        tensors = {}
        for case, gated, bias_up, bias_gate, bias_down in cases():
            net = FeedForward(act, gated, bias_up, bias_gate, bias_down)
            with torch.no_grad():
                for pname, p in net.named_parameters():
                    # Wider than nn.Linear's default so pre-activations reach the nonlinear parts.
                    bound = 1.5 / (p.shape[-1] if p.dim() == 2 else D_MODEL) ** 0.5
                    p.copy_(f32_exact((torch.rand(p.shape, generator=generator, dtype=torch.float64) * 2 - 1) * bound))
                    tensors[f"{case}/{pname}"] = p.detach().clone()
            for rank, shape in SHAPES.items():
                x = f32_exact(torch.randn(shape, generator=generator, dtype=torch.float64) * 1.5)
                x.requires_grad_(True)
                net.zero_grad()
                y = net(x)
                (y**2).sum().backward()
                tensors[f"{case}/r{rank}/x"] = x.detach().clone()
                tensors[f"{case}/r{rank}/y"] = y.detach().clone()
                tensors[f"{case}/r{rank}/dx"] = x.grad.detach().clone()
                for pname, p in net.named_parameters():
                    tensors[f"{case}/r{rank}/grad/{pname}"] = p.grad.detach().clone()
        path = OUT / f"golden_{act_name}.safetensors"
        save_file(
            {k: v.contiguous() for k, v in tensors.items()},
            str(path),
            metadata={"torch": torch.__version__, "activation": act_name, "d_model": str(D_MODEL), "d_ff": str(D_FF)},
        )
        print(f"wrote {path.relative_to(OUT.parent.parent.parent.parent)} ({path.stat().st_size} bytes, {len(tensors)} tensors)")


if __name__ == "__main__":
    main()
