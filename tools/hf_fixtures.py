#!/usr/bin/env python3
"""Tiny Hugging Face models for ffn-model's loading tests, made locally by `transformers`.

For each model type it builds a randomly initialised model from a small config (nothing is
downloaded), saves it with `save_pretrained` into crates/ffn-test-support/data/hf/<name>/, and
records, for a fixed input x of shape [2, 3, hidden], the output of each layer's own FFN
submodule in eval mode:

    bert         BertForMaskedLM          layer.output.dense(layer.intermediate(x))
    t5-relu      T5ForConditionalGeneration  encoder.block[i].layer[1].DenseReluDense(x)
    t5-gated     (feed_forward_proj = "gated-gelu")
    llama        LlamaForCausalLM         model.layers[i].mlp(x)
    llama-sharded  the same, saved in several shards with an index file
    llama-bf16   the same, saved in bfloat16 (outputs computed from the bf16 weights in f32)
    gpt2         GPT2LMHeadModel          transformer.h[i].mlp(x)
    qwen3, olmo2, gemma, gemma2, gemma3, nemotron, phi, phi3, starcoder2, modernbert
                 model.layers[i].mlp(x)
    gemma3_mm    Gemma3ForConditionalGeneration (fields in text_config, a vision tower beside)
                 model.language_model.layers[i].mlp(x)
    mistral, qwen2, granite, cohere, cohere2, olmo, olmo3, exaone4, smollm3, arcee, apertus,
    ministral, seed_oss, helium, glm4, hunyuan_v1_dense, ernie4_5, bitnet, doge, jais2,
    minicpm3, vaultgemma, youtu, cwm
                 model.layers[i].mlp(x) (apertus's xIELU and bitnet's ffn_sub_norm: refused)
    lfm2         model.layers[i].feed_forward(x)
    clip_text, siglip_text, vit, electra, whisper (encoder), mt5   the layer's FFN
    nemotron_h   model.layers[i].mixer(x); falcon_h1 model.layers[i].feed_forward(x) and gemma3n
                 model.layers[i].mlp(x) (refused: mlp_multipliers, activation_sparsity_pattern)
    gpt_neox, falcon, gptj, gpt_bigcode     the layer's mlp(x)
    bloom, opt, deberta_v2, distilbert      the FFN's two projections and activation as the
                 layer runs them (without its residual, norm or dropout)

into <name>/ffn_io.safetensors (x, y.0, y.1). The Rust tests load each folder and compare.

    pip install torch transformers safetensors && python3 tools/hf_fixtures.py [NAME ...]

With --check-export DIR it instead checks the files `cargo run --example hf_export -- DIR` wrote
(layer 1 of every dense and MoE fixture, `<name>.layer1.safetensors`, in the model's own names):
each replaces that layer's tensors in a copy of the checkpoint, `from_pretrained` must load the
copy with no key missing, unexpected or mismatched, and the layer's output must match both the
fixture's and the one Rust stored, within 1e-5.
"""

import argparse
import json
import pathlib
import shutil

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

OUT = pathlib.Path(__file__).resolve().parent.parent / "crates/ffn-test-support/data/hf"
HIDDEN, INTER = 16, 40


def models():
    common = dict(vocab_size=64)
    bert = transformers.BertConfig(
        **common, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=INTER, max_position_embeddings=32, hidden_act="gelu",
    )
    t5 = dict(**common, d_model=HIDDEN, d_kv=8, d_ff=INTER, num_layers=2, num_heads=2,
              decoder_start_token_id=0)
    llama = transformers.LlamaConfig(
        **common, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
    )
    gpt2 = transformers.GPT2Config(**common, n_embd=HIDDEN, n_layer=2, n_head=2, n_positions=32)
    # Decoders with llama's attention arguments.
    dec = dict(**common, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    mlp = lambda m, i: m.model.layers[i].mlp  # noqa: E731
    two = lambda up, act, down: lambda x: down(act(up(x)))  # noqa: E731
    return {
        "bert": (transformers.BertForMaskedLM, bert,
                 lambda m, i: lambda x: m.bert.encoder.layer[i].output.dense(m.bert.encoder.layer[i].intermediate(x))),
        "t5-relu": (transformers.T5ForConditionalGeneration, transformers.T5Config(**t5, feed_forward_proj="relu"),
                    lambda m, i: m.encoder.block[i].layer[1].DenseReluDense),
        "t5-gated": (transformers.T5ForConditionalGeneration, transformers.T5Config(**t5, feed_forward_proj="gated-gelu"),
                     lambda m, i: m.encoder.block[i].layer[1].DenseReluDense),
        "llama": (transformers.LlamaForCausalLM, llama, lambda m, i: m.model.layers[i].mlp),
        "gpt2": (transformers.GPT2LMHeadModel, gpt2, lambda m, i: m.transformer.h[i].mlp),
        # Families read by the generic reader: each FFN as transformers runs it.
        "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**dec, head_dim=8), mlp),
        "olmo2": (transformers.Olmo2ForCausalLM, transformers.Olmo2Config(**dec), mlp),
        "gemma": (transformers.GemmaForCausalLM,
                  transformers.GemmaConfig(**dec, head_dim=8, hidden_act="gelu_pytorch_tanh"), mlp),
        "gemma2": (transformers.Gemma2ForCausalLM,
                   transformers.Gemma2Config(**dec, head_dim=8, hidden_activation="gelu_pytorch_tanh"), mlp),
        "gemma3": (transformers.Gemma3ForCausalLM,
                   transformers.Gemma3TextConfig(**dec, head_dim=8, hidden_activation="gelu_pytorch_tanh"), mlp),
        # Gemma 3 as its 4B and larger checkpoints are released: the multimodal model, the
        # language model's fields in `text_config`, a SigLIP vision tower (more layers, FFNs of
        # another width) beside it.
        "gemma3_mm": (transformers.Gemma3ForConditionalGeneration,
                      transformers.Gemma3Config(
                          text_config=dict(**dec, head_dim=8, hidden_activation="gelu_pytorch_tanh"),
                          vision_config=dict(hidden_size=HIDDEN, intermediate_size=24,
                                             num_hidden_layers=3, num_attention_heads=2,
                                             image_size=16, patch_size=8),
                          mm_tokens_per_image=4),
                      lambda m, i: m.model.language_model.layers[i].mlp),
        "nemotron": (transformers.NemotronForCausalLM,
                     transformers.NemotronConfig(**dec, head_dim=8, hidden_act="relu2"), mlp),
        "phi": (transformers.PhiForCausalLM, transformers.PhiConfig(**dec, hidden_act="gelu_new"), mlp),
        "phi3": (transformers.Phi3ForCausalLM, transformers.Phi3Config(**dec, pad_token_id=0), mlp),
        "starcoder2": (transformers.Starcoder2ForCausalLM,
                       transformers.Starcoder2Config(**dec, hidden_act="gelu_pytorch_tanh"), mlp),
        "gpt_neox": (transformers.GPTNeoXForCausalLM,
                     transformers.GPTNeoXConfig(**common, hidden_size=HIDDEN, intermediate_size=INTER,
                                                num_hidden_layers=2, num_attention_heads=2,
                                                max_position_embeddings=32),
                     lambda m, i: m.gpt_neox.layers[i].mlp),
        "falcon": (transformers.FalconForCausalLM,
                   transformers.FalconConfig(**common, hidden_size=HIDDEN, num_hidden_layers=2,
                                             num_attention_heads=2, ffn_hidden_size=INTER),
                   lambda m, i: m.transformer.h[i].mlp),
        "bloom": (transformers.BloomForCausalLM,
                  transformers.BloomConfig(**common, hidden_size=HIDDEN, n_layer=2, n_head=2),
                  lambda m, i: two(m.transformer.h[i].mlp.dense_h_to_4h, m.transformer.h[i].mlp.gelu_impl,
                                   m.transformer.h[i].mlp.dense_4h_to_h)),
        "opt": (transformers.OPTForCausalLM,
                transformers.OPTConfig(**common, hidden_size=HIDDEN, ffn_dim=INTER, num_hidden_layers=2,
                                       num_attention_heads=2, word_embed_proj_dim=HIDDEN,
                                       max_position_embeddings=32),
                lambda m, i: two(m.model.decoder.layers[i].fc1, m.model.decoder.layers[i].activation_fn,
                                 m.model.decoder.layers[i].fc2)),
        "gptj": (transformers.GPTJForCausalLM,
                 transformers.GPTJConfig(**common, n_embd=HIDDEN, n_inner=INTER, n_layer=2, n_head=2,
                                         rotary_dim=4, n_positions=32),
                 lambda m, i: m.transformer.h[i].mlp),
        "gpt_bigcode": (transformers.GPTBigCodeForCausalLM,
                        transformers.GPTBigCodeConfig(**common, n_embd=HIDDEN, n_inner=INTER, n_layer=2,
                                                      n_head=2, n_positions=32),
                        lambda m, i: m.transformer.h[i].mlp),
        "distilbert": (transformers.DistilBertForMaskedLM,
                       transformers.DistilBertConfig(**common, dim=HIDDEN, hidden_dim=INTER, n_layers=2,
                                                     n_heads=2, max_position_embeddings=32),
                       lambda m, i: m.distilbert.transformer.layer[i].ffn),
        "deberta_v2": (transformers.DebertaV2ForMaskedLM,
                       transformers.DebertaV2Config(**common, hidden_size=HIDDEN, intermediate_size=INTER,
                                                    num_hidden_layers=2, num_attention_heads=2,
                                                    max_position_embeddings=32),
                       lambda m, i: lambda x: m.deberta.encoder.layer[i].output.dense(
                           m.deberta.encoder.layer[i].intermediate(x))),
        "modernbert": (transformers.ModernBertForMaskedLM,
                       transformers.ModernBertConfig(**common, hidden_size=HIDDEN, intermediate_size=INTER,
                                                     num_hidden_layers=2, num_attention_heads=2,
                                                     max_position_embeddings=32, pad_token_id=0,
                                                     bos_token_id=1, eos_token_id=2, cls_token_id=1,
                                                     sep_token_id=2, mask_token_id=3),
                       mlp),
        # Families no table of the reader names: they load by their patterns alone.
        "stablelm": (transformers.StableLmForCausalLM, transformers.StableLmConfig(**dec), mlp),
        "glm": (transformers.GlmForCausalLM, transformers.GlmConfig(**dec, head_dim=8, pad_token_id=0), mlp),
        "persimmon": (transformers.PersimmonForCausalLM,
                      transformers.PersimmonConfig(**common, hidden_size=HIDDEN, intermediate_size=INTER,
                                                   num_hidden_layers=2, num_attention_heads=2,
                                                   max_position_embeddings=32),
                      mlp),
        "gpt_neo": (transformers.GPTNeoForCausalLM,
                    transformers.GPTNeoConfig(**common, hidden_size=HIDDEN, intermediate_size=INTER,
                                              num_layers=2, num_heads=2, attention_types=[[["global"], 2]],
                                              max_position_embeddings=32),
                    lambda m, i: m.transformer.h[i].mlp),
        "codegen": (transformers.CodeGenForCausalLM,
                    transformers.CodeGenConfig(**common, n_embd=HIDDEN, n_inner=INTER, n_layer=2, n_head=2,
                                               rotary_dim=4, n_positions=32),
                    lambda m, i: m.transformer.h[i].mlp),
        "xlm-roberta": (transformers.XLMRobertaForMaskedLM,
                        transformers.XLMRobertaConfig(**common, hidden_size=HIDDEN, intermediate_size=INTER,
                                                      num_hidden_layers=2, num_attention_heads=2,
                                                      max_position_embeddings=40),
                        lambda m, i: lambda x: m.roberta.encoder.layer[i].output.dense(
                            m.roberta.encoder.layer[i].intermediate(x))),
        "bart": (transformers.BartForConditionalGeneration,
                 transformers.BartConfig(**common, d_model=HIDDEN, encoder_ffn_dim=INTER, decoder_ffn_dim=INTER,
                                         encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                                         decoder_attention_heads=2, max_position_embeddings=32),
                 lambda m, i: two(m.model.encoder.layers[i].fc1, m.model.encoder.layers[i].activation_fn,
                                  m.model.encoder.layers[i].fc2)),
        # Families the reader was not written against (loaded by their keys and fields alone).
        "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig(**dec, head_dim=8), mlp),
        "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**dec), mlp),
        "granite": (transformers.GraniteForCausalLM, transformers.GraniteConfig(**dec), mlp),
        "cohere": (transformers.CohereForCausalLM, transformers.CohereConfig(**dec), mlp),
        "cohere2": (transformers.Cohere2ForCausalLM, transformers.Cohere2Config(**dec, head_dim=8), mlp),
        "olmo": (transformers.OlmoForCausalLM, transformers.OlmoConfig(**dec), mlp),
        "olmo3": (transformers.Olmo3ForCausalLM, transformers.Olmo3Config(**dec), mlp),
        "exaone4": (transformers.Exaone4ForCausalLM, transformers.Exaone4Config(**dec, head_dim=8), mlp),
        "smollm3": (transformers.SmolLM3ForCausalLM, transformers.SmolLM3Config(**dec, pad_token_id=0), mlp),
        "arcee": (transformers.ArceeForCausalLM, transformers.ArceeConfig(**dec), mlp),
        "apertus": (transformers.ApertusForCausalLM, transformers.ApertusConfig(**dec), mlp),
        "ministral": (transformers.MinistralForCausalLM, transformers.MinistralConfig(**dec, head_dim=8), mlp),
        "seed_oss": (transformers.SeedOssForCausalLM, transformers.SeedOssConfig(**dec, head_dim=8), mlp),
        "helium": (transformers.HeliumForCausalLM, transformers.HeliumConfig(**dec, head_dim=8), mlp),
        "glm4": (transformers.Glm4ForCausalLM, transformers.Glm4Config(**dec, head_dim=8, pad_token_id=0), mlp),
        "hunyuan_v1_dense": (transformers.HunYuanDenseV1ForCausalLM,
                             transformers.HunYuanDenseV1Config(**dec, head_dim=8), mlp),
        "ernie4_5": (transformers.Ernie4_5ForCausalLM, transformers.Ernie4_5Config(**dec, head_dim=8), mlp),
        "lfm2": (transformers.Lfm2ForCausalLM, transformers.Lfm2Config(**dec, layer_types=["full_attention"] * 2, block_multiple_of=8),
                 lambda m, i: m.model.layers[i].feed_forward),
        "bitnet": (transformers.BitNetForCausalLM, transformers.BitNetConfig(**dec), mlp),
        "doge": (transformers.DogeForCausalLM, transformers.DogeConfig(**dec), mlp),
        "jais2": (transformers.Jais2ForCausalLM, transformers.Jais2Config(**dec), mlp),
        "minicpm3": (transformers.MiniCPM3ForCausalLM, transformers.MiniCPM3Config(**dec, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=8), mlp),
        "vaultgemma": (transformers.VaultGemmaForCausalLM, transformers.VaultGemmaConfig(**dec, head_dim=8), mlp),
        "youtu": (transformers.YoutuForCausalLM, transformers.YoutuConfig(**dec, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=8), mlp),
        "cwm": (transformers.CwmForCausalLM, transformers.CwmConfig(**dec, head_dim=8), mlp),
        # Encoders: CLIP's text tower (quick_gelu), SigLIP's (the tanh GELU), ViT, ELECTRA (BERT's
        # names), Whisper's encoder (BART's), mT5 (T5's gated-gelu).
        "clip_text": (transformers.CLIPTextModel, transformers.CLIPTextConfig(
            vocab_size=64, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=32), lambda m, i: m.encoder.layers[i].mlp),
        "siglip_text": (transformers.SiglipTextModel, transformers.SiglipTextConfig(
            vocab_size=64, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=32), lambda m, i: m.encoder.layers[i].mlp),
        "vit": (transformers.ViTModel, transformers.ViTConfig(
            hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, intermediate_size=INTER,
            image_size=16, patch_size=8), lambda m, i: m.layers[i].mlp),
        "electra": (transformers.ElectraForMaskedLM, transformers.ElectraConfig(
            **common, hidden_size=HIDDEN, embedding_size=HIDDEN, num_hidden_layers=2,
            num_attention_heads=2, intermediate_size=INTER, max_position_embeddings=32),
            lambda m, i: lambda x: m.electra.encoder.layer[i].output.dense(
                m.electra.encoder.layer[i].intermediate(x))),
        "whisper": (transformers.WhisperModel, transformers.WhisperConfig(
            **common, d_model=HIDDEN, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=INTER, decoder_ffn_dim=INTER, num_mel_bins=8,
            max_source_positions=16, max_target_positions=16, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, decoder_start_token_id=1),
            lambda m, i: two(m.encoder.layers[i].fc1, m.encoder.layers[i].activation_fn,
                             m.encoder.layers[i].fc2)),
        "mt5": (transformers.MT5ForConditionalGeneration, transformers.MT5Config(**t5),
                lambda m, i: m.encoder.block[i].layer[1].DenseReluDense),
        # Hybrids with Mamba layers: Nemotron-H's MLP layers (ReLU², its `mlp_hidden_act`) are
        # its `mixer`; Falcon-H1 scales its gate's pre-activation and its output
        # (`mlp_multipliers`, refused); Gemma 3n sparsifies its activations (refused).
        "nemotron_h": (transformers.NemotronHForCausalLM, transformers.NemotronHConfig(
            vocab_size=64, hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=2,
            num_key_value_heads=2, layers_block_type=["mlp", "mlp"], mamba_num_heads=2,
            mamba_head_dim=8, head_dim=8, n_groups=1, ssm_state_size=8, chunk_size=8),
            lambda m, i: m.model.layers[i].mixer),
        "falcon_h1": (transformers.FalconH1ForCausalLM, transformers.FalconH1Config(
            **dec, head_dim=8, mlp_multipliers=[0.5, 2.0], mamba_d_ssm=16, mamba_n_heads=2,
            mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=8),
            lambda m, i: m.model.layers[i].feed_forward),
        "gemma3n": (transformers.Gemma3nForCausalLM, transformers.Gemma3nTextConfig(
            **dec, head_dim=8, activation_sparsity_pattern=[0.95, 0.0],
            layer_types=["full_attention"] * 2, num_kv_shared_layers=0,
            hidden_size_per_layer_input=8, vocab_size_per_layer_input=64, laurel_rank=4), mlp),
        "mpt": (transformers.MptForCausalLM,
                transformers.MptConfig(**common, d_model=HIDDEN, n_layers=2, n_heads=2, expansion_ratio=2,
                                       max_seq_len=32),
                lambda m, i: lambda x: m.transformer.blocks[i].ffn.down_proj(
                    m.transformer.blocks[i].ffn.act(m.transformer.blocks[i].ffn.up_proj(x)))),
    }


def ffn_module(name, model, i):
    """The module whose state dict an exported file must match (BERT's FFN is two modules)."""
    if name == "bert":
        layer = model.bert.encoder.layer[i]
        module = torch.nn.Module()
        module.intermediate = torch.nn.Module()
        module.intermediate.dense = layer.intermediate.dense
        module.output = torch.nn.Module()
        module.output.dense = layer.output.dense
        return module
    return models()[name.replace("-sharded", "").replace("-bf16", "")][2](model, i)


def make(only=None):
    for name, (cls, config, ffn) in models().items():
        if only and name not in only:
            continue
        variants = [(name, None)]
        if name == "llama":
            variants += [("llama-sharded", "shards"), ("llama-bf16", "bf16")]
        for folder_name, variant in variants:
            torch.manual_seed(1234)
            model = cls(config).eval()
            with torch.no_grad():
                for p in model.parameters():  # visible biases and larger weights than init
                    p.normal_(0.0, 0.3)
            folder = OUT / folder_name
            if folder.exists():  # only this model's folder: the MoE fixtures live beside it
                shutil.rmtree(folder)
            if variant == "bf16":
                model = model.to(torch.bfloat16)
                model.save_pretrained(folder)
                model = model.to(torch.float32)
            elif variant == "shards":
                model.save_pretrained(folder, max_shard_size="20KB")
            else:
                model.save_pretrained(folder)
            x = torch.randn(2, 3, HIDDEN, generator=torch.Generator().manual_seed(7))
            io = {"x": x}
            with torch.no_grad():
                for i in range(2):
                    io[f"y.{i}"] = ffn(model, i)(x).contiguous()
            save_file(io, str(folder / "ffn_io.safetensors"),
                      metadata={"transformers": transformers.__version__, "torch": torch.__version__})
            for junk in folder.glob("generation_config.json"):
                junk.unlink()
            size = sum(f.stat().st_size for f in folder.iterdir())
            print(f"{folder_name}: {size} bytes, {sorted(f.name for f in folder.iterdir())}")


def check_export(directory):
    """Loads each checkpoint with layer 1 replaced by the file Rust exported (see
    examples/hf_export.rs) and compares that layer's output with the one Rust stored and the
    fixture's own."""
    import sys
    import tempfile

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import moe_fixtures

    dense, sparse = models(), moe_fixtures.models()
    directory = pathlib.Path(directory)
    worst = {}
    for exported in sorted(directory.glob("*.layer1.safetensors")):
        name = exported.name.removesuffix(".layer1.safetensors")
        output = safe_open(str(directory / f"{name}.layer1.output.safetensors"), "pt")
        prefix, rust = output.metadata()["prefix"], output.get_tensor("y")
        ours = load_file(str(exported))
        assert ours and all(k.startswith(prefix) for k in ours), (name, sorted(ours))
        # The checkpoint without every tensor of the modules ffn wrote (a module is a key less
        # its last part: `…fc1`, `…mlp.experts`), then with ffn's file in their place: a
        # parameter ffn left out of a module is then missing.
        module = lambda key: key.rsplit(".", 1)[0]  # noqa: E731
        written = {module(k) for k in ours}
        state = {k: v for k, v in load_file(str(OUT / name / "model.safetensors")).items()
                 if module(k) not in written}
        state.update(ours)
        kind = name.replace("-bf16", "")  # llama-bf16: llama's model, saved in bfloat16
        cls = (dense[kind] if kind in dense else sparse[kind])[0]
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copy(OUT / name / "config.json", tmp)
            save_file(state, str(pathlib.Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
            model, info = cls.from_pretrained(tmp, output_loading_info=True, dtype=torch.float32)
        problems = {k: v for k, v in info.items() if v and k != "error_msgs"}
        assert not problems and not info.get("error_msgs"), (name, info)
        model.eval()
        with torch.no_grad():
            if kind in dense:
                io = load_file(str(OUT / name / "ffn_io.safetensors"))
                x, reference = io["x"], io["y.1"]
                y = dense[kind][2](model, 1)(x)
            else:
                io = load_file(str(OUT / name / "moe_io.safetensors"))
                x, reference = io["x"].float(), io["y"].float()
                y = moe_fixtures.sparse_block(model, 1)(x)
                y = (y[0] if isinstance(y, tuple) else y).reshape(x.shape)
        # Relative to the output's scale (gpt-oss's wide experts give outputs in the tens).
        scale = max(1.0, reference.abs().max().item())
        worst[name] = max((y - reference).abs().max().item(), (y - rust).abs().max().item()) / scale
        print(f"{name}: from_pretrained ok ({len(ours)} tensors under `{prefix}`), "
              f"max |output - reference| / scale = {worst[name]:.2e}")
    assert worst, f"no exports in {directory}"
    assert all(v < 1e-5 for v in worst.values()), worst


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--check-export", metavar="DIR")
    parser.add_argument("models", nargs="*", help="only these (default: all)")
    args = parser.parse_args()
    if args.check_export:
        check_export(args.check_export)
    else:
        make(args.models)
