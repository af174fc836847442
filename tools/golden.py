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

One file per activation, crates/ffn-test-support/data/golden_<activation>.safetensors, keys

    <case>/<param>                     weights, PyTorch layout ([out, in])
    <case>/r<rank>/x, /y, /dx          input, output, dL/dx
    <case>/r<rank>/grad/<param>        dL/d<param>

with <case> = "<plain|gated>_b<up><gate><down>" (bias flags as 0/1) and <param> one of
up.weight, up.bias, gate.weight, gate.bias, down.weight, down.bias.

Mixed precision (`precision = "bf16"`): one more file per activation,
crates/ffn-test-support/data/golden_bf16_<activation>.safetensors, with the same cases and keys
for the weights and inputs, and two references for each rank:

    <case>/r<rank>/recipe/y, /dx, /grad/<param>     ffn's recipe, emulated in float64
    <case>/r<rank>/autocast/y, /dx, /grad/<param>   PyTorch under torch.autocast("cpu", bfloat16)

The recipe: every product's operands rounded to bfloat16 (x, the weights, h; in the backward
pass dy and d(pre)), the products and everything else in float64 (ffn sums in f32), the biases'
gradients summed from the unrounded dy and d(pre). Inputs are redrawn until no value the recipe
rounds (h, dy, d(pre)) lies within 1/200 of a bfloat16 spacing of a rounding midpoint, so that
f32 arithmetic cannot round one to the other neighbour: ffn's bf16 module must then match the
recipe as closely as its f32 module matches the f32 goldens. Autocast rounds more (the products'
outputs, the activations' outputs, every gradient), so ffn matches it only within bfloat16's
precision; for ReLU, whose derivative jumps at 0, inputs are also redrawn until no
pre-activation lies within 0.05 of 0, where autocast's rounding could flip the jump.

Usage (nothing else to install):  pip install torch safetensors && python3 tools/golden.py
"""

import itertools
import pathlib

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

D_MODEL, D_FF = 5, 7
SHAPES = {2: (3, D_MODEL), 3: (2, 3, D_MODEL), 4: (2, 2, 2, D_MODEL)}
OUT = pathlib.Path(__file__).resolve().parent.parent / "crates/ffn-test-support/data"

ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "identity": lambda x: x,
    "relu2": lambda x: F.relu(x) ** 2,
    "tanh": torch.tanh,
    # gpt-oss's clamped SwiGLU: φ(g) = g' σ(1.702 g'), g' = min(g, 7) ...
    "swiglu_oai": lambda x: x.clamp(max=7.0) * torch.sigmoid(1.702 * x.clamp(max=7.0)),
    # CLIP's quick_gelu, as transformers' QuickGELUActivation computes it.
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}
# ... whose gated unit also clips and shifts the up side: h = φ(g) ⊙ ψ(u), ψ(u) = clamp(u, ±7) + 1.
# Every other activation has ψ(u) = u.
UP = {"swiglu_oai": lambda u: u.clamp(-7.0, 7.0) + 1}
# Inputs are drawn N(0, 1.5²), times this factor: large enough for swiglu_oai's pre-activations
# to cross its clips at ±7 (some do in every case), so that the clipped branches are checked.
INPUT_SCALE = {"swiglu_oai": 6.0}
# Where a function's derivative jumps (ReLU at 0, the clips at ±7): inputs are redrawn, for bf16,
# until no pre-activation lies within 0.05 of one, where autocast's rounding could flip the jump.
KINKS = {"relu": (0.0,), "swiglu_oai": (-7.0, 7.0)}


class FeedForward(torch.nn.Module):
    def __init__(self, act, gated, bias_up, bias_gate, bias_down, psi=lambda u: u):
        super().__init__()
        self.act, self.psi = act, psi
        self.up = torch.nn.Linear(D_MODEL, D_FF, bias=bias_up, dtype=torch.float64)
        self.gate = (
            torch.nn.Linear(D_MODEL, D_FF, bias=bias_gate, dtype=torch.float64) if gated else None
        )
        self.down = torch.nn.Linear(D_FF, D_MODEL, bias=bias_down, dtype=torch.float64)

    def forward(self, x):
        if self.gate is not None:
            h = self.act(self.gate(x)) * self.psi(self.up(x))
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


def draw_weights(net, generator, case, tensors):
    """Draws `net`'s parameters (exact in f32) and records them under `<case>/<param>`."""
    with torch.no_grad():
        for pname, p in net.named_parameters():
            # Wider than nn.Linear's default so pre-activations reach the nonlinear parts.
            bound = 1.5 / (p.shape[-1] if p.dim() == 2 else D_MODEL) ** 0.5
            p.copy_(f32_exact((torch.rand(p.shape, generator=generator, dtype=torch.float64) * 2 - 1) * bound))
            tensors[f"{case}/{pname}"] = p.detach().clone()


def bf16(t):
    """Rounds to the nearest bfloat16 (through float32, as ffn rounds its f32 values), kept as
    float64."""
    return t.float().bfloat16().double()


def near_midpoint(t, margin=5e-3):
    """Whether any value of `t` (float64) lies within `margin` bfloat16 spacings of a midpoint
    between two bfloat16 numbers."""
    a = t.detach().abs().float()
    lo_bits = a.view(torch.int32) & ~0xFFFF
    lo = lo_bits.view(torch.float32).double()
    hi = (lo_bits + 0x10000).view(torch.float32).double()
    frac = (t.detach().abs() - lo) / (hi - lo)
    return bool(((frac - 0.5).abs() < margin).any())


ROUNDED = []  # the computed values the recipe rounded in the last pass (for near_midpoint)
PRE = []  # the pre-activations of the last pass


class Bf16Linear(torch.autograd.Function):
    """`x Wᵀ + b` as ffn computes it in bf16: operands rounded, products and sums exact(ish)."""

    @staticmethod
    def forward(ctx, x, w, b, x_computed):
        if x_computed:
            ROUNDED.append(x)
        xr, wr = bf16(x), bf16(w)
        ctx.save_for_backward(xr, wr)
        ctx.has_bias = b is not None
        y = xr @ wr.T
        return y + b if b is not None else y

    @staticmethod
    def backward(ctx, dy):
        xr, wr = ctx.saved_tensors
        ROUNDED.append(dy)
        dyr = bf16(dy)
        dx = dyr @ wr
        dw = dyr.reshape(-1, dyr.shape[-1]).T @ xr.reshape(-1, xr.shape[-1])
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias else None
        return dx, dw, db, None


def recipe_forward(net, x):
    """`net`'s function with ffn's bf16 recipe (float64 parameters, exact in f32)."""
    lin = lambda layer, t, computed: Bf16Linear.apply(t, layer.weight, layer.bias, computed)
    if net.gate is not None:
        PRE.append(lin(net.gate, x, False))
        PRE.append(lin(net.up, x, False))
        h = net.act(PRE[-2]) * net.psi(PRE[-1])
    else:
        PRE.append(lin(net.up, x, False))
        h = net.act(PRE[-1])
    return lin(net.down, h, True)


def gradients(net, x, y, prefix, tensors):
    """Backpropagates L = Σ y² and records y, dL/dx and every parameter's gradient."""
    net.zero_grad()
    x.grad = None
    (y.double() ** 2).sum().backward()
    tensors[f"{prefix}/y"] = y.detach().double().clone()
    tensors[f"{prefix}/dx"] = x.grad.detach().double().clone()
    for pname, p in net.named_parameters():
        tensors[f"{prefix}/grad/{pname}"] = p.grad.detach().double().clone()


def bf16_references(act_name, act, generator):
    """The golden_bf16 file's tensors: weights, inputs, and both references per rank."""
    tensors = {}
    for case, gated, bias_up, bias_gate, bias_down in cases():
        psi = UP.get(act_name, lambda u: u)
        net = FeedForward(act, gated, bias_up, bias_gate, bias_down, psi)
        draw_weights(net, generator, case, tensors)
        net32 = FeedForward(act, gated, bias_up, bias_gate, bias_down, psi).float()
        net32.load_state_dict({k: v.float() for k, v in net.state_dict().items()})
        for rank, shape in SHAPES.items():
            for _ in range(1000):
                scale = 1.5 * INPUT_SCALE.get(act_name, 1.0)
                x = f32_exact(torch.randn(shape, generator=generator, dtype=torch.float64) * scale)
                x.requires_grad_(True)
                ROUNDED.clear()
                PRE.clear()
                y = recipe_forward(net, x)
                gradients(net, x, y, f"{case}/r{rank}/recipe", tensors)
                # φ's input (PRE[0]); for swiglu_oai ψ's too.
                pres = PRE if act_name in UP else PRE[:1]
                kink = any(bool(((p.detach() - at).abs() < 0.05).any())
                           for p in pres for at in KINKS.get(act_name, ()))
                if not kink and not any(near_midpoint(t) for t in ROUNDED):
                    break
            else:
                raise RuntimeError(f"{act_name} {case} r{rank}: no input clear of the midpoints")
            tensors[f"{case}/r{rank}/x"] = x.detach().clone()
            x32 = x.detach().float().requires_grad_(True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = net32(x32)
            gradients(net32, x32, y, f"{case}/r{rank}/autocast", tensors)
    return tensors


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(20200212)  # Shazeer's arXiv date
    for act_name, act in ACTIVATIONS.items():
        tensors = {}
        for case, gated, bias_up, bias_gate, bias_down in cases():
            net = FeedForward(act, gated, bias_up, bias_gate, bias_down, UP.get(act_name, lambda u: u))
            draw_weights(net, generator, case, tensors)
            for rank, shape in SHAPES.items():
                scale = 1.5 * INPUT_SCALE.get(act_name, 1.0)
                x = f32_exact(torch.randn(shape, generator=generator, dtype=torch.float64) * scale)
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

    # bf16: its own generator, so that the f32 files above stay as they were.
    generator = torch.Generator().manual_seed(20200213)
    for act_name, act in ACTIVATIONS.items():
        tensors = bf16_references(act_name, act, generator)
        path = OUT / f"golden_bf16_{act_name}.safetensors"
        save_file(
            {k: v.contiguous() for k, v in tensors.items()},
            str(path),
            metadata={"torch": torch.__version__, "activation": act_name, "d_model": str(D_MODEL),
                      "d_ff": str(D_FF), "precision": "bf16"},
        )
        print(f"wrote {path.relative_to(OUT.parent.parent.parent.parent)} ({path.stat().st_size} bytes, {len(tensors)} tensors)")


if __name__ == "__main__":
    main()
