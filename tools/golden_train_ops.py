#!/usr/bin/env python3
"""Golden files for ffn-train's ops (attention.rs, loss.rs), computed by PyTorch.

- Causal attention: for `q, k, v: [batch, T, heads·dₕ]` (the projections, heads side by side in
  the last dimension), `O = softmax(QKᵀ/√dₕ + causal mask) V` per head through
  `F.scaled_dot_product_attention(is_causal=True)`, and the gradients of `L = Σ O ⊙ g`.
  Cases `attention/<name>/{q,k,v,g,o,dq,dk,dv}`; shapes that do and do not fill the kernels'
  tiles (4 rows × 16 columns).
- Cross-entropy: `F.cross_entropy(z, t)` (mean) of logits `z: [N, V]` and its gradient
  `cross_entropy/{logits,targets,loss,dlogits}` (targets int64).

Inputs are float32 values, everything is computed in float64, so the tests check the ops in f32
(~1e-5) and f64 (~1e-12) against the same file: crates/ffn-test-support/data/golden_ops.safetensors.

Usage: pip install torch safetensors && python3 tools/golden_train_ops.py
"""

import pathlib

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

OUT = pathlib.Path(__file__).resolve().parent.parent / "crates/ffn-test-support/data"
ATTENTION = {  # name: (batch, T, heads, dₕ)
    "small": (2, 5, 3, 4),
    "tiles": (2, 20, 2, 16),
    "one": (1, 1, 1, 3),
}


def f32_normal(*shape, scale=1.0):
    return (torch.randn(*shape) * scale).to(torch.float32).to(torch.float64)


def main():
    torch.manual_seed(0)
    tensors = {}
    for name, (b, t, h, dh) in ATTENTION.items():
        q, k, v, g = (f32_normal(b, t, h * dh) for _ in range(4))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        split = lambda x: x.view(b, t, h, dh).transpose(1, 2)
        o = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
        o = o.transpose(1, 2).reshape(b, t, h * dh)
        (o * g).sum().backward()
        for key, x in dict(q=q, k=k, v=v, g=g, o=o, dq=q.grad, dk=k.grad, dv=v.grad).items():
            tensors[f"attention/{name}/{key}"] = x.detach().contiguous()
    z = f32_normal(9, 6, scale=3.0).requires_grad_()
    targets = torch.tensor([0, 5, 2, 2, 1, 3, 0, 4, 5], dtype=torch.int64)
    loss = F.cross_entropy(z, targets)
    loss.backward()
    tensors.update(
        {
            "cross_entropy/logits": z.detach(),
            "cross_entropy/targets": targets,
            "cross_entropy/loss": loss.detach().reshape(1),
            "cross_entropy/dlogits": z.grad,
        }
    )
    OUT.mkdir(parents=True, exist_ok=True)
    save_file(tensors, OUT / "golden_ops.safetensors")
    print(f"wrote {OUT / 'golden_ops.safetensors'} ({len(tensors)} tensors)")


if __name__ == "__main__":
    main()
