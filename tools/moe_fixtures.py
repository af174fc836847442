#!/usr/bin/env python3
"""Tiny mixture-of-experts models for ffn-model's MoE loading tests, made locally by
`transformers` (nothing is downloaded).

For each model type it builds a randomly initialised two-layer model from a small config,
saves it with `save_pretrained` into crates/ffn-test-support/data/hf/<name>/, and records for
layer 1's sparse block (in float64, train mode off, experts_implementation="eager"), for a fixed
input x of shape [2, 5, hidden] and the loss L = Σ y ⊙ g:

    x, g, y                     the input, the loss weights, the block's output
    router_logits               the router's logits, [10, n_experts]
    dx                          ∂L/∂x
    d_router                    ∂L/∂(router weight), [n_experts, hidden] (PyTorch layout)
    d_gate, d_up, d_down        ∂L/∂ of expert 1's gate/up/down weights (PyTorch layout)

into <name>/moe_io.safetensors. Types: mixtral (softmax, top-2 renormalised), qwen2_moe
(softmax, top-2 not renormalised, a shared expert gated by σ), qwen3_moe (softmax, top-2
renormalised), olmoe (softmax, top-2 not renormalised), granitemoe (softmax of the top-2
logits, experts packed as input_linear/output_linear), qwen3_next (as qwen2_moe, renormalised;
its attention layers all full attention here), deepseek_v2 (softmax, 4 groups of 2 scored by
their best, top-2 groups, top-2 not renormalised, routed scaling 2.5, a shared expert; layer 0
dense), deepseek_v3 (sigmoid scores, 4 groups of 2, top-2 groups, a non-zero
e_score_correction_bias, routed scaling 2.5, a shared expert; layer 0 dense), gpt_oss (a biased
router, softmax of the top-2 logits, biased experts packed [E, hidden, 2f] with gate and up
interleaved, the clamped SwiGLU; its experts drawn wide enough to cross the clips), llama4_text
(sigmoid top-1 that scales the expert's input, experts packed [E, hidden, 2f], an ungated shared
expert; layer 0 dense, of its own width intermediate_size_mlp), dbrx (its FFN's fields in
ffn_config, experts as rows of w1/v1/w2, top-2 renormalised by their 1-norm), llama4 (the
multimodal model Llama 4 is released as: fields in text_config, a vision tower beside it); and
seven families the reader was not written against: qwen3_5_moe (multimodal, Qwen2-MoE's
block), glm4_moe, dots1 and exaone_moe (DeepSeek-V3's routing; EXAONE keeps the selection bias
beside the router), minimax (Mixtral's), flex_olmo (OLMoE's), jamba (softmax top-2 not
renormalised, with no field to say so); and, added later: ernie4_5_moe (softmax scores chosen
with the `moe_statics` selection bias, shared experts), hunyuan_v1_moe (`gate.wg`, an ungated
`shared_mlp`), minimax_m2 (sigmoid with a selection bias, no groups), lfm2_moe (sigmoid,
`expert_bias`, no activation field), afmoe (`router.gate`, sigmoid, `expert_bias`,
`route_scale`, shared experts), cohere2_moe (softmax of the top-k logits, shared experts
summed), granitemoeshared, glm4_moe_lite, phimoe (SparseMixer routing, named by its type);
and one the reader refuses: jetmoe (an output bias on the mixture).

    pip install torch transformers safetensors && python3 tools/moe_fixtures.py [NAME ...]
"""

import pathlib
import shutil

import torch
import transformers
from safetensors.torch import save_file

OUT = pathlib.Path(__file__).resolve().parent.parent / "crates/ffn-test-support/data/hf"
HIDDEN, EXPERT = 16, 12


def models():
    common = dict(vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, max_position_embeddings=32)
    return {
        "mixtral": (transformers.MixtralForCausalLM, transformers.MixtralConfig(
            **common, intermediate_size=EXPERT, num_local_experts=4, num_experts_per_tok=2)),
        "qwen2_moe": (transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig(
            **common, intermediate_size=20, moe_intermediate_size=EXPERT, num_experts=6,
            num_experts_per_tok=2, norm_topk_prob=False, shared_expert_intermediate_size=20)),
        "qwen3_moe": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
            **common, intermediate_size=20, moe_intermediate_size=EXPERT, num_experts=4,
            num_experts_per_tok=2, norm_topk_prob=True, head_dim=8)),
        "olmoe": (transformers.OlmoeForCausalLM, transformers.OlmoeConfig(
            **common, intermediate_size=EXPERT, num_experts=4, num_experts_per_tok=2,
            norm_topk_prob=False)),
        "granitemoe": (transformers.GraniteMoeForCausalLM, transformers.GraniteMoeConfig(
            **common, intermediate_size=EXPERT, num_local_experts=4, num_experts_per_tok=2)),
        "qwen3_next": (transformers.Qwen3NextForCausalLM, transformers.Qwen3NextConfig(
            **common, intermediate_size=20, moe_intermediate_size=EXPERT, num_experts=4,
            num_experts_per_tok=2, norm_topk_prob=True, shared_expert_intermediate_size=20,
            head_dim=8, layer_types=["full_attention", "full_attention"], decoder_sparse_step=1,
            mlp_only_layers=[])),
        "deepseek_v2": (transformers.DeepseekV2ForCausalLM, transformers.DeepseekV2Config(
            **common, intermediate_size=20, moe_intermediate_size=EXPERT, n_routed_experts=8,
            num_experts_per_tok=2, n_group=4, topk_group=2, topk_method="group_limited_greedy",
            n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=False,
            first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=8)),
        "deepseek_v3": (transformers.DeepseekV3ForCausalLM, transformers.DeepseekV3Config(
            **common, intermediate_size=20, moe_intermediate_size=EXPERT, n_routed_experts=8,
            num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
            q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
            v_head_dim=8)),
        "gpt_oss": (transformers.GptOssForCausalLM, transformers.GptOssConfig(
            **common, intermediate_size=EXPERT, num_local_experts=4, num_experts_per_tok=2,
            head_dim=8, layer_types=["sliding_attention", "full_attention"], sliding_window=8)),
        "dbrx": (transformers.DbrxForCausalLM, transformers.DbrxConfig(
            d_model=HIDDEN, n_heads=2, n_layers=2, max_seq_len=32, vocab_size=64,
            attn_config=dict(kv_n_heads=2, rope_theta=10000.0),
            ffn_config=dict(ffn_hidden_size=EXPERT, moe_num_experts=4, moe_top_k=2))),
        "llama4_text": (transformers.Llama4ForCausalLM, transformers.Llama4TextConfig(
            **common, intermediate_size=EXPERT, intermediate_size_mlp=20, num_local_experts=4,
            num_experts_per_tok=1, head_dim=8, interleave_moe_layer_step=2,
            no_rope_layers=[1, 1], attention_chunk_size=8)),
        # Llama 4 as released: the multimodal model, its language model's fields in
        # `text_config`, a vision tower with more layers (and FFNs of another width) beside it.
        "llama4": (transformers.Llama4ForConditionalGeneration, transformers.Llama4Config(
            text_config=dict(
                **common, intermediate_size=EXPERT, intermediate_size_mlp=20,
                num_local_experts=4, num_experts_per_tok=1, head_dim=8,
                interleave_moe_layer_step=2, no_rope_layers=[1, 1], attention_chunk_size=8),
            vision_config=dict(
                hidden_size=HIDDEN, num_hidden_layers=3, num_attention_heads=2,
                intermediate_size=24, image_size=16, patch_size=8, vision_output_dim=HIDDEN,
                projector_input_dim=HIDDEN, projector_output_dim=HIDDEN))),
        # Families the reader was not written against (loaded by their keys and fields alone).
        "qwen3_5_moe": (transformers.Qwen3_5MoeForConditionalGeneration, transformers.Qwen3_5MoeConfig(
            text_config=dict(
                **common, moe_intermediate_size=EXPERT, shared_expert_intermediate_size=20,
                num_experts=4, num_experts_per_tok=2, head_dim=8,
                layer_types=["full_attention", "full_attention"]),
            vision_config=dict(depth=3, hidden_size=HIDDEN, intermediate_size=24, num_heads=2,
                               patch_size=8, out_hidden_size=HIDDEN))),
        "glm4_moe": (transformers.Glm4MoeForCausalLM, transformers.Glm4MoeConfig(
            **common, intermediate_size=20, moe_intermediate_size=EXPERT, n_routed_experts=8,
            num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1, head_dim=8)),
        "minimax": (transformers.MiniMaxForCausalLM, transformers.MiniMaxConfig(
            **common, intermediate_size=EXPERT, num_local_experts=4, num_experts_per_tok=2,
            head_dim=8, layer_types=["full_attention", "full_attention"])),
        "flex_olmo": (transformers.FlexOlmoForCausalLM, transformers.FlexOlmoConfig(
            **common, intermediate_size=EXPERT, num_experts=4, num_experts_per_tok=2, pad_token_id=0)),
        "dots1": (transformers.Dots1ForCausalLM, transformers.Dots1Config(
            **common, intermediate_size=20, moe_intermediate_size=EXPERT, n_routed_experts=8,
            num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1, head_dim=8,
            layer_types=["full_attention", "full_attention"])),
        "exaone_moe": (transformers.ExaoneMoeForCausalLM, transformers.ExaoneMoeConfig(
            **common, intermediate_size=20, moe_intermediate_size=EXPERT, num_experts=8,
            num_experts_per_tok=2, n_group=4, topk_group=2, num_shared_experts=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1, head_dim=8)),
        "ernie4_5_moe": (transformers.Ernie4_5_MoeForCausalLM, transformers.Ernie4_5_MoeConfig(
            **common, intermediate_size=20, moe_intermediate_size=EXPERT, moe_num_experts=4,
            moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_interval=1)),
        "hunyuan_v1_moe": (transformers.HunYuanMoEV1ForCausalLM, transformers.HunYuanMoEV1Config(
            **common, intermediate_size=EXPERT, num_experts=4, moe_topk=2, head_dim=8)),
        # SparseMixer's band 2ε wide enough (ε = 0.3, Phi-3.5-MoE's is 0.01) that a weight's
        # softmax takes several logits, so that the router has a gradient.
        "phimoe": (transformers.PhimoeForCausalLM, transformers.PhimoeConfig(
            **common, intermediate_size=EXPERT, num_local_experts=4, num_experts_per_tok=2,
            router_jitter_noise=0.3)),
        "jetmoe": (transformers.JetMoeForCausalLM, transformers.JetMoeConfig(
            vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=2, num_key_value_heads=2,
            kv_channels=8, intermediate_size=EXPERT, num_local_experts=4, num_experts_per_tok=2,
            max_position_embeddings=32)),
        "granitemoeshared": (transformers.GraniteMoeSharedForCausalLM, transformers.GraniteMoeSharedConfig(
            **common, intermediate_size=EXPERT, num_local_experts=4, num_experts_per_tok=2,
            shared_intermediate_size=20)),
        "minimax_m2": (transformers.MiniMaxM2ForCausalLM, transformers.MiniMaxM2Config(
            **common, intermediate_size=EXPERT, num_local_experts=4, num_experts_per_tok=2,
            head_dim=8)),
        "lfm2_moe": (transformers.Lfm2MoeForCausalLM, transformers.Lfm2MoeConfig(
            **{k: v for k, v in common.items()}, intermediate_size=20, moe_intermediate_size=EXPERT,
            num_experts=4, num_experts_per_tok=2, num_dense_layers=1, use_expert_bias=True,
            layer_types=["full_attention", "full_attention"])),
        "afmoe": (transformers.AfmoeForCausalLM, transformers.AfmoeConfig(
            **common, intermediate_size=20, moe_intermediate_size=EXPERT, num_experts=4,
            num_experts_per_tok=2, num_shared_experts=1, num_dense_layers=1, head_dim=8,
            route_scale=2.5, layer_types=["full_attention", "full_attention"])),
        "cohere2_moe": (transformers.Cohere2MoeForCausalLM, transformers.Cohere2MoeConfig(
            **common, intermediate_size=EXPERT, num_experts=4, num_experts_per_tok=2,
            num_shared_experts=1, head_dim=8, shared_expert_combination_strategy="sum")),
        "glm4_moe_lite": (transformers.Glm4MoeLiteForCausalLM, transformers.Glm4MoeLiteConfig(
            **common, intermediate_size=20, moe_intermediate_size=EXPERT, n_routed_experts=8,
            num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=8, q_lora_rank=None,
            qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
            mlp_layer_types=["dense", "sparse"])),
        "jamba": (transformers.JambaForCausalLM, transformers.JambaConfig(
            **common, intermediate_size=EXPERT, num_experts=4, num_experts_per_tok=2,
            expert_layer_period=1, expert_layer_offset=0, attn_layer_period=1, attn_layer_offset=0,
            use_mamba_kernels=False)),
    }


# Experts drawn wider than the rest, so that gpt-oss's clamped SwiGLU crosses its clips at ±7
# (pre-activations of standard deviation about 6 instead of 1.2).
EXPERT_STD = {"gpt_oss": 1.5}


def sparse_block(model, i):
    """Layer `i`'s sparse block: in the language model's layers (not a multimodal model's
    vision tower), its `mlp`, `block_sparse_moe`, `feed_forward` or `ffn`."""
    layers = next(m for n, m in model.named_modules()
                  if n.endswith(("layers", "blocks")) and "vision" not in n and "visual" not in n)
    return next(getattr(layers[i], a) for a in ("mlp", "block_sparse_moe", "feed_forward", "ffn")
                if hasattr(layers[i], a))


def main(only):
    for name, (cls, config) in models().items():
        if only and name not in only:
            continue
        torch.manual_seed(0)
        model = cls._from_config(config, experts_implementation="eager").eval()
        with torch.no_grad():
            for n, p in model.named_parameters():
                wide = ".experts.gate_up_proj" in n and not n.endswith("_bias")
                p.normal_(0.0, EXPERT_STD.get(name, 0.3) if wide else 0.3)
            for n, b in model.named_buffers():
                if n.endswith("e_score_correction_bias"):
                    b.copy_(torch.randn_like(b) * 0.1)
        folder = OUT / name
        shutil.rmtree(folder, ignore_errors=True)
        model.save_pretrained(folder)
        (folder / "generation_config.json").unlink(missing_ok=True)  # not read, not committed
        block = sparse_block(model, 1).double()
        router = block.gate if hasattr(block, "gate") else block.router
        # DBRX's, JetMoE's, HunYuan's and AFMoE's routers hold their Linear.
        router = next(m for m in router.modules() if isinstance(m, torch.nn.Linear)) \
            if not isinstance(router, torch.nn.Linear) and not hasattr(router, "weight") else router
        x = torch.randn(2, 5, HIDDEN, dtype=torch.float64, requires_grad=True)
        g = torch.randn(2, 5, HIDDEN, dtype=torch.float64)
        y = block(x)
        y = y[0] if isinstance(y, tuple) else y  # gpt-oss and Llama 4 return the scores too
        y = y.reshape(x.shape)  # Llama 4 returns [tokens, hidden]
        (y * g).sum().backward()
        logits = torch.nn.functional.linear(x.reshape(-1, HIDDEN), router.weight,
                                            getattr(router, "bias", None))
        if hasattr(block, "experts") and hasattr(block.experts, "mlp"):
            # DBRX: w1, v1, w2 each [E·f, hidden]; w2's block is down's transpose.
            mlp = block.experts.mlp
            rows = lambda w: w.grad.view(mlp.w1.shape[0] // EXPERT, EXPERT, HIDDEN)[1]  # noqa: E731
            grad, grad_down = torch.cat([rows(mlp.w1), rows(mlp.v1)]), rows(mlp.w2).T
        elif hasattr(block, "input_linear"):
            # JetMoE: input_linear [E, 2f, hidden] (gate then up), output_linear [E, hidden, f].
            grad, grad_down = block.input_linear.weight.grad[1], block.output_linear.weight.grad[1]
        else:
            gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
            if gate_up.shape[1] == HIDDEN:
                # [E, hidden, 2f], [E, f, hidden] (gpt-oss, Llama 4): to PyTorch's Linear layout.
                grad, grad_down = gate_up.grad[1].T, down.grad[1].T
            else:
                grad, grad_down = gate_up.grad[1], down.grad[1]
        f = grad.shape[0] // 2
        # gpt-oss interleaves gate and up (gate the even rows); the others stack them.
        d_gate, d_up = (grad[0::2], grad[1::2]) if name == "gpt_oss" else (grad[:f], grad[f:])
        golden = {
            "x": x, "g": g, "y": y, "router_logits": logits, "dx": x.grad,
            "d_router": router.weight.grad,
            "d_gate": d_gate, "d_up": d_up, "d_down": grad_down,
        }
        save_file({k: v.detach().contiguous().double() for k, v in golden.items()},
                  folder / "moe_io.safetensors")
        print(name, sorted(p.name for p in folder.iterdir()))


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
