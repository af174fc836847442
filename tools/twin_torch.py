#!/usr/bin/env python3
"""A PyTorch twin of an ffn-train language-model run: the same network, shapes, optimizer and
clipping, timed over the same number of training steps. It reads the resolved configs a run
folder holds (`config.toml`, `ffn.toml`), so it matches whatever `ffn-train train` was given.

    python3 tools/twin_torch.py RUN_FOLDER [--threads 2] [--steps N] [--attention sdpa|manual]

Prints one JSON object: training tokens/s (steps after two warm-up steps) and the cores kept busy
(process CPU time / wall time over those steps). `tools/twin_compare.py` runs both sides in turn.

The networks (ffn-train's `model.rs`):
- transformer: token + position embeddings, `n_layers` pre-norm blocks
  `x += Attention(LN(x))`, `x += FFN(LN(x))` (causal multi-head attention with biased q/k/v/o
  projections, burn's `MultiHeadAttention`), a final LayerNorm and a biased linear head;
- dropout where the config has it: the FFN's (on the hidden layer or its output) and the
  attention weights';
- window: the embeddings of the last `window` tokens (a padding row before the start),
  concatenated, a linear projection, `x += FFN(LN(x))`, a linear head.
The loss is the mean next-token cross-entropy; AdamW (beta1, beta2, weight decay) with global
gradient-norm clipping. A run with `train.precision = "bf16"` has its forward pass and loss run
under `torch.autocast("cpu", dtype=torch.bfloat16)`, the one line a PyTorch user writes: autocast
takes every linear layer to bf16 (ffn rounds the FFNs' products only), and keeps the
parameters, the softmax, the norms and the loss in f32. The token stream is uniform noise: the work per step does not depend on it.
"""

import argparse
import json
import os
import sys
import time
import tomllib

import torch
import torch.nn.functional as F

ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "identity": lambda x: x,
    "relu2": lambda x: F.relu(x).square(),
    "tanh": torch.tanh,
    # gpt-oss: a Swish with α = 1.702 on the gate clipped at 7; the up side clipped to ±7, + 1.
    "swiglu_oai": lambda x: x.clamp(max=7.0) * torch.sigmoid(1.702 * x.clamp(max=7.0)),
}
# The up side of a gated unit, ψ(u): the identity but for swiglu_oai.
UP = {"swiglu_oai": lambda u: u.clamp(-7.0, 7.0) + 1}


class FeedForward(torch.nn.Module):
    """`down(φ(gate(x)) ⊙ ψ(up(x)))` gated, `down(φ(up(x)))` otherwise, as in ffn.toml."""

    def __init__(self, c):
        super().__init__()
        d, d_ff = c["d_model"], c["d_ff"]
        self.act = ACTIVATIONS[c["activation"]]
        self.psi = UP.get(c["activation"], lambda u: u)
        self.gated, self.fused = c["gated"], c["gated"] and c.get("fused_gate_up", False)
        if self.fused:
            self.gate_up = torch.nn.Linear(d, 2 * d_ff, bias=c["bias_up"])
        else:
            self.up = torch.nn.Linear(d, d_ff, bias=c["bias_up"])
            if self.gated:
                self.gate = torch.nn.Linear(d, d_ff, bias=c["bias_gate"])
        self.down = torch.nn.Linear(d_ff, d, bias=c["bias_down"])
        self.dropout = torch.nn.Dropout(c.get("dropout", 0.0))
        self.at_output = c.get("dropout_at", "hidden") == "output"

    def forward(self, x):
        if self.fused:
            g, u = self.gate_up(x).chunk(2, dim=-1)
            h = self.act(g) * self.psi(u)
        elif self.gated:
            h = self.act(self.gate(x)) * self.psi(self.up(x))
        else:
            h = self.act(self.up(x))
        if self.at_output:
            return self.dropout(self.down(h))
        return self.down(self.dropout(h))


class Attention(torch.nn.Module):
    def __init__(self, d, heads, manual, dropout):
        super().__init__()
        self.heads, self.manual, self.p = heads, manual, dropout
        self.query, self.key, self.value, self.output = (torch.nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, t, d = x.shape
        split = lambda p: p(x).view(b, t, self.heads, d // self.heads).transpose(1, 2)
        q, k, v = split(self.query), split(self.key), split(self.value)
        if self.manual:
            scores = q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5
            causal = torch.ones(t, t, dtype=torch.bool).triu(1)
            weights = scores.masked_fill(causal, float("-inf")).softmax(-1)
            a = F.dropout(weights, self.p, self.training) @ v
        else:
            p = self.p if self.training else 0.0
            a = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.output(a.transpose(1, 2).reshape(b, t, d))


class Block(torch.nn.Module):
    def __init__(self, m, ffn, manual):
        super().__init__()
        d = m["d_model"]
        self.norm_attention = torch.nn.LayerNorm(d)
        self.attention = Attention(d, m["n_heads"], manual, m.get("attention_dropout", 0.0))
        self.norm_ffn = torch.nn.LayerNorm(d)
        self.ffn = FeedForward(ffn)

    def forward(self, x):
        x = x + self.attention(self.norm_attention(x))
        return x + self.ffn(self.norm_ffn(x))


class TransformerLm(torch.nn.Module):
    def __init__(self, m, ffn, vocab, seq, manual):
        super().__init__()
        d = m["d_model"]
        self.token_embedding = torch.nn.Embedding(vocab, d)
        self.position_embedding = torch.nn.Embedding(seq, d)
        self.blocks = torch.nn.ModuleList(Block(m, ffn, manual) for _ in range(m["n_layers"]))
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.token_embedding(tokens) + self.position_embedding.weight[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class WindowLm(torch.nn.Module):
    def __init__(self, m, ffn, vocab):
        super().__init__()
        self.window = m["window"]
        self.embedding = torch.nn.Embedding(vocab + 1, m["d_embed"])
        self.input = torch.nn.Linear(m["window"] * m["d_embed"], m["d_model"])
        self.norm = torch.nn.LayerNorm(m["d_model"])
        self.ffn = FeedForward(ffn)
        self.head = torch.nn.Linear(m["d_model"], vocab)

    def forward(self, tokens):
        b, t = tokens.shape
        pad = self.embedding.num_embeddings - 1
        padded = F.pad(tokens, (self.window - 1, 0), value=pad)
        e = self.embedding(padded)  # [b, t + w − 1, d_embed]
        x = self.input(torch.cat([e[:, j : j + t] for j in range(self.window)], dim=-1))
        x = x + self.ffn(self.norm(x))
        return self.head(x)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="an ffn-train run folder (config.toml, ffn.toml)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, help="default: the run's train.steps")
    p.add_argument("--attention", choices=["sdpa", "manual"], default="sdpa")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    with open(os.path.join(a.run, "config.toml"), "rb") as f:
        config = tomllib.load(f)
    with open(os.path.join(a.run, "ffn.toml"), "rb") as f:
        ffn = tomllib.load(f)
    task, m, t = config["task"], config["model"], config["train"]
    if task.get("kind") not in ("markov", "text"):
        sys.exit(f"twin_torch: language-model runs only (task.kind = {task.get('kind')!r})")
    if "moe" in m.get("ffn", {}):
        sys.exit("twin_torch: runs with model.ffn.moe have no twin (tools/bench_moe.py compares "
                 "the MoE layer with transformers)")
    vocab = task.get("vocab_size") or len(json.load(open(os.path.join(a.run, "vocab.json"))))
    seq, batch = task["seq_len"], t["batch_size"]
    if m["kind"] == "transformer":
        model = TransformerLm(m, ffn, vocab, seq, a.attention == "manual")
    elif m["kind"] == "window":
        model = WindowLm(m, ffn, vocab)
    else:
        sys.exit(f"twin_torch: no twin for model.kind = {m['kind']!r}")
    optim = torch.optim.AdamW(
        model.parameters(),
        lr=t["lr"],
        betas=(t.get("beta1", 0.9), t.get("beta2", 0.99)),
        weight_decay=t.get("weight_decay", 0.0),
    )
    steps = a.steps or t["steps"]
    precision = t.get("precision", "f32")
    bf16 = {"f32": False, "bf16": True, "bfloat16": True}[precision]

    def step():
        tokens = torch.randint(0, vocab, (batch, seq + 1))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.get("grad_clip", 1.0))
        optim.step()
        return loss.item()

    for _ in range(2):
        step()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(steps):
        step()
    wall = time.perf_counter() - wall
    cpu = time.process_time() - cpu
    print(
        json.dumps(
            {
                "side": "pytorch",
                "torch": torch.__version__,
                "threads": a.threads,
                "attention": a.attention,
                "precision": "bf16 (torch.autocast)" if bf16 else "f32",
                "steps": steps,
                "tokens_per_s": steps * batch * seq / wall,
                "cores_busy": cpu / wall,
            }
        )
    )


if __name__ == "__main__":
    main()
