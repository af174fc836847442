//! Real checkpoints: tiny models made by `transformers` itself (`tools/hf_fixtures.py`: BERT,
//! T5 with `relu` and `gated-gelu`, LLaMA, also sharded and in bfloat16, GPT-2). Each layer's
//! FFN loaded here must reproduce the output of the model's own FFN submodule, and files
//! exported in the model's naming must hold exactly the tensors `transformers` saved.
//!
//! Tolerance: 1e-5 absolute on outputs of order one (f32 throughout).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::tensor::{Tensor, TensorData};
use ffn_model::{Activation, Error, FeedForwardConfig, HfModel, Scheme};
use ffn_test_support::{Scratch, data_file, device, scratch};
use safetensors::SafeTensors;

const TOLERANCE: f32 = 1e-5;

fn folder(name: &str) -> PathBuf {
    data_file(&format!("hf/{name}"))
}

/// `x` and the reference outputs `y.0`, `y.1` of a fixture.
fn io(name: &str) -> BTreeMap<String, TensorData> {
    let bytes = std::fs::read(folder(name).join("ffn_io.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    file.tensors()
        .into_iter()
        .map(|(k, v)| {
            let values: Vec<f32> = v
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            (k, TensorData::new(values, v.shape().to_vec()))
        })
        .collect()
}

fn max_abs_diff(a: &TensorData, b: &TensorData) -> f32 {
    a.iter::<f32>()
        .zip(b.iter::<f32>())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn every_model_type_reproduces_transformers() {
    let expected: [(&str, Activation, bool, usize, Scheme); 26] = [
        ("bert", Activation::Gelu, false, 40, Scheme::Bert),
        ("deberta_v2", Activation::Gelu, false, 40, Scheme::Bert),
        (
            "distilbert",
            Activation::Gelu,
            false,
            40,
            Scheme::DistilBert,
        ),
        ("modernbert", Activation::Gelu, true, 40, Scheme::ModernBert),
        ("qwen3", Activation::Silu, true, 40, Scheme::Llama),
        ("olmo2", Activation::Silu, true, 40, Scheme::Llama),
        ("gemma", Activation::GeluTanh, true, 40, Scheme::Llama),
        ("gemma2", Activation::GeluTanh, true, 40, Scheme::Llama),
        ("gemma3", Activation::GeluTanh, true, 40, Scheme::Llama),
        ("gemma3_mm", Activation::GeluTanh, true, 40, Scheme::Llama),
        ("nemotron", Activation::Relu2, false, 40, Scheme::Llama),
        ("phi", Activation::GeluTanh, false, 40, Scheme::Fc),
        ("phi3", Activation::Silu, true, 40, Scheme::GateUpProj),
        (
            "starcoder2",
            Activation::GeluTanh,
            false,
            40,
            Scheme::BigCode,
        ),
        (
            "gpt_bigcode",
            Activation::GeluTanh,
            false,
            40,
            Scheme::BigCode,
        ),
        ("gptj", Activation::GeluTanh, false, 40, Scheme::GptJ),
        ("gpt_neox", Activation::Gelu, false, 40, Scheme::NeoX),
        ("falcon", Activation::Gelu, false, 40, Scheme::NeoX),
        ("bloom", Activation::GeluTanh, false, 64, Scheme::NeoX),
        ("opt", Activation::Relu, false, 40, Scheme::Fc),
        ("t5-relu", Activation::Relu, false, 40, Scheme::T5),
        ("t5-gated", Activation::GeluTanh, true, 40, Scheme::T5),
        ("llama", Activation::Silu, true, 40, Scheme::Llama),
        ("llama-sharded", Activation::Silu, true, 40, Scheme::Llama),
        ("llama-bf16", Activation::Silu, true, 40, Scheme::Llama),
        ("gpt2", Activation::GeluTanh, false, 64, Scheme::Gpt2),
    ];
    let report: Vec<String> = expected
        .into_iter()
        .map(|(name, activation, gated, d_ff, scheme)| {
            let worst = reproduces(name, activation, gated, d_ff, scheme);
            format!("{name:>14}: largest |ffn - transformers| = {worst:.1e}")
        })
        .collect();
    println!("{}", report.join("\n"));
}

/// Loads both layers of fixture `name`, checks what the reader found, and returns the largest
/// difference from `transformers`' FFN outputs (asserted within the tolerance). Inference: no
/// autodiff, so the configs' dropout is off, as in the reference's eval mode.
fn reproduces(name: &str, activation: Activation, gated: bool, d_ff: usize, scheme: Scheme) -> f32 {
    let device = burn::tensor::Device::flex();
    let mut model = HfModel::open(folder(name)).unwrap();
    assert_eq!(model.scheme(), scheme, "{name}");
    assert_eq!(model.num_layers().unwrap(), 2);
    let config = model.ffn_config().unwrap();
    assert_eq!(
        (config.d_model, config.d_ff, config.activation, config.gated),
        (16, d_ff, activation, gated),
        "{name}"
    );
    let io = io(name);
    let mut worst = 0.0f32;
    for layer in 0..2 {
        let ffn = model.load_layer(layer, &device).unwrap();
        let x = Tensor::<3>::from_data(io["x"].clone(), &device);
        let y = ffn.forward(x).into_data();
        let diff = max_abs_diff(&y, &io[&format!("y.{layer}")]);
        assert!(diff <= TOLERANCE, "{name} layer {layer}: {diff:e}");
        worst = worst.max(diff);
    }
    worst
}

/// Families that no table of the reader names (and that it was not written against): each
/// loads by its key names and config fields alone and matches `transformers`. (MPT's config
/// names no activation: its exact GELU is the one table entry it needs.)
#[test]
fn families_the_reader_was_not_written_for_load_by_their_patterns() {
    for (name, activation, gated, d_ff, scheme) in [
        ("stablelm", Activation::Silu, true, 40, Scheme::Llama),
        ("glm", Activation::Silu, true, 40, Scheme::GateUpProj),
        ("persimmon", Activation::Relu2, false, 40, Scheme::NeoX),
        ("gpt_neo", Activation::GeluTanh, false, 40, Scheme::BigCode),
        ("codegen", Activation::GeluTanh, false, 40, Scheme::GptJ),
        ("xlm-roberta", Activation::Gelu, false, 40, Scheme::Bert),
        ("bart", Activation::Gelu, false, 40, Scheme::Fc),
        ("mpt", Activation::Gelu, false, 64, Scheme::Llama),
        // LFM2 states `intermediate_size` 40 and `block_auto_adjust_ff_dim`: ⌊2·40/3⌋ = 26,
        // rounded up to its `block_multiple_of` 8.
        ("lfm2", Activation::Silu, true, 32, Scheme::MetaLlama),
        ("glm4", Activation::Silu, true, 40, Scheme::GateUpProj),
        ("arcee", Activation::Relu2, false, 40, Scheme::Llama),
        ("jais2", Activation::Relu2, false, 40, Scheme::Llama),
        ("vaultgemma", Activation::GeluTanh, true, 40, Scheme::Llama),
        // Encoders: CLIP's quick_gelu, SigLIP's and mT5's tanh GELU.
        ("clip_text", Activation::QuickGelu, false, 40, Scheme::Fc),
        ("siglip_text", Activation::GeluTanh, false, 40, Scheme::Fc),
        ("vit", Activation::Gelu, false, 40, Scheme::Bert),
        ("electra", Activation::Gelu, false, 40, Scheme::Bert),
        ("whisper", Activation::Gelu, false, 40, Scheme::Fc),
        ("mt5", Activation::GeluTanh, true, 40, Scheme::T5),
        // Nemotron-H: its MLP layers are `mixer`s, their activation its `mlp_hidden_act`.
        ("nemotron_h", Activation::Relu2, false, 40, Scheme::Llama),
    ] {
        reproduces(name, activation, gated, d_ff, scheme);
    }
    // Llama's SwiGLU under other names and fields.
    for name in [
        "mistral",
        "ministral",
        "qwen2",
        "granite",
        "cohere",
        "cohere2",
        "olmo",
        "olmo3",
        "exaone4",
        "smollm3",
        "seed_oss",
        "helium",
        "hunyuan_v1_dense",
        "ernie4_5",
        "doge",
        "minicpm3",
        "youtu",
        "cwm",
    ] {
        reproduces(name, Activation::Silu, true, 40, Scheme::Llama);
    }
}

/// Families whose FFN computes a step ffn's layer has no form for are refused with the
/// tensor or field that shows it, never loaded as a layer computing another function:
/// BitNet's `ffn_sub_norm` (an RMSNorm between the hidden layer and `down_proj`), Apertus's
/// xIELU activation (with parameters of its own), Falcon-H1's `mlp_multipliers` (its gate's
/// pre-activation and its output scaled; `[1, 1]` loads), Gemma 3n's
/// `activation_sparsity_pattern` (a top-k of its activations). So is any tensor beside the
/// projections
/// in an FFN's own module; a layer's other tensors (BERT's and OPT's FFNs are parts of the
/// layer's module) are not the FFN's.
#[test]
fn ffn_steps_ffn_lacks_are_refused() {
    let device = burn::tensor::Device::flex();
    let mut bitnet = HfModel::open(folder("bitnet")).unwrap();
    for layer in 0..2 {
        let result = bitnet.load_layer(layer, &device).map(drop);
        let expected = format!("model.layers.{layer}.mlp.ffn_sub_norm.weight");
        assert!(
            matches!(&result, Err(Error::UnexpectedTensor { key, .. }) if *key == expected),
            "{result:?}"
        );
    }
    let apertus = HfModel::open(folder("apertus")).unwrap();
    let result = apertus.ffn_config().map(drop);
    assert!(
        matches!(&result, Err(Error::HfConfig { field, message, .. })
            if field == "hidden_act" && message.contains("xielu")),
        "{result:?}"
    );
    for (name, field) in [
        ("falcon_h1", "mlp_multipliers"),
        ("gemma3n", "activation_sparsity_pattern"),
    ] {
        let mut model = HfModel::open(folder(name)).unwrap();
        let result = model.load_layer(0, &device).map(drop);
        assert!(
            matches!(&result, Err(Error::HfConfig { field: f, .. }) if f == field),
            "{name}: {result:?}"
        );
    }
    // With neutral values the same files load: Falcon-H1's FFN is then Llama's.
    let neutral = altered(
        "falcon_h1",
        "neutral",
        |c| c["mlp_multipliers"] = serde_json::json!([1.0, 1.0]),
        &[],
        None,
    );
    let mut model = HfModel::open(&neutral).unwrap();
    assert_eq!(model.load_layer(1, &device).unwrap().d_ff(), 40);
    // The llama fixture with a norm added inside its `mlp.`: refused; added to the layer
    // beside `mlp.`: not the FFN's.
    for (key, refused) in [
        ("model.layers.1.mlp.sub_norm.weight", true),
        ("model.layers.1.mlp_norm.weight", false),
    ] {
        let dir = scratch("hf-llama-extra-norm");
        let source = folder("llama");
        std::fs::copy(source.join("config.json"), dir.join("config.json")).unwrap();
        let bytes = std::fs::read(source.join("model.safetensors")).unwrap();
        let file = SafeTensors::deserialize(&bytes).unwrap();
        let ones: Vec<u8> = [1.0f32; 40].iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut views: Vec<(String, safetensors::tensor::TensorView)> = file.tensors();
        let norm = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![40], &ones);
        views.push((key.to_string(), norm.unwrap()));
        let written = safetensors::serialize(views, None).unwrap();
        std::fs::write(dir.join("model.safetensors"), written).unwrap();
        let mut model = HfModel::open(&dir).unwrap();
        let result = model.load_layer(1, &device).map(drop);
        if refused {
            assert!(
                matches!(&result, Err(Error::UnexpectedTensor { key: k, .. }) if k == key),
                "{key}: {result:?}"
            );
        } else {
            assert!(result.is_ok(), "{key}: {result:?}");
        }
    }
}

/// A model type that no table names loads when its keys and fields follow a known pattern:
/// the llama fixture under another name, and Phi-3's packed layout under another.
#[test]
fn an_unknown_model_type_with_known_patterns_loads() {
    let device = burn::tensor::Device::flex();
    for (name, renamed) in [("llama", "my_llama"), ("phi3", "phi3_renamed")] {
        let dir = altered(
            name,
            "renamed",
            |c| c["model_type"] = renamed.into(),
            &[],
            None,
        );
        let mut model = HfModel::open(&dir).unwrap();
        assert_eq!(model.model_type(), renamed);
        let io = io(name);
        for layer in 0..2 {
            let ffn = model.load_layer(layer, &device).unwrap();
            let y = ffn
                .forward(Tensor::<3>::from_data(io["x"].clone(), &device))
                .into_data();
            let diff = max_abs_diff(&y, &io[&format!("y.{layer}")]);
            assert!(diff <= TOLERANCE, "{renamed} layer {layer}: {diff:e}");
        }
    }
}

/// The prefix of each fixture's layer 1, as `transformers` wrote it.
fn layer1_prefix(name: &str) -> &'static str {
    match name {
        "bert" => "bert.encoder.layer.1.",
        "deberta_v2" => "deberta.encoder.layer.1.",
        "distilbert" => "distilbert.transformer.layer.1.ffn.",
        "t5-relu" | "t5-gated" => "encoder.block.1.layer.1.DenseReluDense.",
        "gpt2" | "gpt_bigcode" | "gptj" | "falcon" | "bloom" => "transformer.h.1.mlp.",
        "gpt_neox" => "gpt_neox.layers.1.mlp.",
        "opt" => "model.decoder.layers.1.",
        "gemma3_mm" => "language_model.model.layers.1.mlp.",
        _ => "model.layers.1.mlp.",
    }
}

/// Every fixture of a dense model.
const DENSE: [&str; 24] = [
    "bert",
    "deberta_v2",
    "distilbert",
    "modernbert",
    "t5-relu",
    "t5-gated",
    "llama",
    "qwen3",
    "olmo2",
    "gemma",
    "gemma2",
    "gemma3",
    "gemma3_mm",
    "nemotron",
    "phi",
    "phi3",
    "starcoder2",
    "gpt2",
    "gpt_bigcode",
    "gptj",
    "gpt_neox",
    "falcon",
    "bloom",
    "opt",
];

/// Exported in the model's own naming, the FFN file holds exactly the tensors (names, shapes,
/// bits) that `transformers` saved for that layer: `load_state_dict(strict=True)` of the
/// submodule accepts it and computes the same function. (`examples/hf_export.rs` with
/// `tools/hf_fixtures.py --check-export` runs that check in PyTorch.)
#[test]
fn exported_files_hold_exactly_what_transformers_saved() {
    let device = device();
    for name in DENSE {
        let mut model = HfModel::open(folder(name)).unwrap();
        assert_eq!(
            model.layer_prefix(1).unwrap(),
            layer1_prefix(name),
            "{name}"
        );
        let ffn = model.load_layer(1, &device).unwrap();
        let prefix = layer1_prefix(name);
        let exported = ffn.to_safetensors_bytes_as(model.scheme(), prefix).unwrap();
        let exported = SafeTensors::deserialize(&exported).unwrap();
        let original = std::fs::read(folder(name).join("model.safetensors")).unwrap();
        let original = SafeTensors::deserialize(&original).unwrap();
        let stems = match name {
            "bert" | "deberta_v2" => vec!["intermediate.dense.", "output.dense."],
            "opt" => vec!["fc1.", "fc2."],
            _ => vec![""],
        };
        let mut wanted: Vec<String> = original
            .names()
            .into_iter()
            .filter(|k| k.starts_with(prefix) && !k.contains(".attention."))
            .filter(|k| stems.iter().any(|s| k[prefix.len()..].starts_with(s)))
            .map(str::to_string)
            .collect();
        wanted.sort();
        let mut got: Vec<String> = exported.names().into_iter().map(str::to_string).collect();
        got.sort();
        assert_eq!(got, wanted, "{name}");
        for key in &got {
            let (a, b) = (exported.tensor(key).unwrap(), original.tensor(key).unwrap());
            assert_eq!(a.shape(), b.shape(), "{name} {key}");
            assert_eq!(a.dtype(), b.dtype(), "{name} {key}");
            assert!(a.data() == b.data(), "{name} {key}: the values differ");
        }
    }
}

#[test]
fn every_scheme_round_trips_and_is_detected() {
    let device = device();
    let gated = FeedForwardConfig::new(6, 10)
        .with_gated(true)
        .with_activation(Activation::Silu)
        .with_bias_up(true)
        .with_bias_gate(true)
        .with_bias_down(true);
    let ungated = FeedForwardConfig::new(6, 10)
        .with_activation(Activation::Gelu)
        .with_bias_up(true)
        .with_bias_down(true);
    let x = Tensor::<3>::ones([1, 2, 6], &device) * 0.5;
    let dir = scratch("schemes");
    for config in [gated, ungated] {
        let ffn = config.init(&device);
        let expected = ffn.forward(x.clone()).into_data();
        for scheme in Scheme::ALL {
            let holds = if config.gated {
                !matches!(
                    scheme,
                    Scheme::Bert
                        | Scheme::Gpt2
                        | Scheme::Fc
                        | Scheme::NeoX
                        | Scheme::GptJ
                        | Scheme::BigCode
                        | Scheme::DistilBert
                )
            } else {
                !matches!(
                    scheme,
                    Scheme::W12 | Scheme::GateUpProj | Scheme::ModernBert
                )
            };
            let bytes = ffn.to_safetensors_bytes_as(scheme, "blocks.0.ffn.");
            if !holds {
                assert!(matches!(bytes, Err(Error::Scheme(_))), "{scheme}");
                continue;
            }
            let path = dir.join(format!("{scheme}-{}.safetensors", config.gated));
            std::fs::write(&path, bytes.unwrap()).unwrap();
            let names: Vec<String> = {
                let b = std::fs::read(&path).unwrap();
                SafeTensors::deserialize(&b)
                    .unwrap()
                    .names()
                    .into_iter()
                    .map(str::to_string)
                    .collect()
            };
            let detected =
                Scheme::detect(names.iter().map(String::as_str), "blocks.0.ffn.").unwrap();
            // GPT-BigCode's keys are GPT-2's: the loader tells them apart by shape.
            let by_keys = if scheme == Scheme::BigCode {
                Scheme::Gpt2
            } else {
                scheme
            };
            assert_eq!(detected, (by_keys, config.gated), "{scheme}");
            let loaded = config
                .init(&device)
                .load_safetensors_as(&path, None, "blocks.0.ffn.")
                .unwrap();
            assert_eq!(loaded.forward(x.clone()).into_data(), expected, "{scheme}");
        }
    }
}

#[test]
fn packed_layouts_put_the_gate_first() {
    let device = device();
    let ffn = FeedForwardConfig::new(3, 4).with_gated(true).init(&device);
    let native = ffn.to_safetensors_bytes();
    let native = SafeTensors::deserialize(&native).unwrap();
    for (scheme, key) in [
        (Scheme::W12, "w12.weight"),
        (Scheme::GateUpProj, "gate_up_proj.weight"),
    ] {
        let packed = ffn.to_safetensors_bytes_as(scheme, "").unwrap();
        let packed = SafeTensors::deserialize(&packed).unwrap();
        let view = packed.tensor(key).unwrap();
        assert_eq!(view.shape(), [8, 3]);
        let gate = native.tensor("gate.weight").unwrap();
        let up = native.tensor("up.weight").unwrap();
        assert_eq!(
            &view.data()[..48],
            gate.data(),
            "{scheme}: first half is the gate"
        );
        assert_eq!(&view.data()[48..], up.data(), "{scheme}: second half is up");
    }
    // One bias of a packed pair cannot be written.
    let one_bias = FeedForwardConfig::new(3, 4)
        .with_gated(true)
        .with_bias_up(true)
        .init(&device);
    assert!(matches!(
        one_bias.to_safetensors_bytes_as(Scheme::W12, ""),
        Err(Error::Scheme(_))
    ));
}

/// A copy of fixture `name` in a scratch folder, with `edit_config` applied to its config
/// and `edit` to each tensor (name, dtype, shape, bytes), which it drops by returning false.
fn edited(
    name: &str,
    tag: &str,
    edit_config: impl Fn(&mut serde_json::Value),
    edit: impl Fn(&str, &mut safetensors::Dtype, &mut Vec<usize>, &mut Vec<u8>) -> bool,
) -> Scratch {
    let dir = scratch(&format!("hf-{name}-{tag}"));
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(folder(name).join("config.json")).unwrap())
            .unwrap();
    edit_config(&mut config);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let bytes = std::fs::read(folder(name).join("model.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = file
        .tensors()
        .into_iter()
        .filter_map(|(k, v)| {
            let (mut dtype, mut shape, mut data) =
                (v.dtype(), v.shape().to_vec(), v.data().to_vec());
            edit(&k, &mut dtype, &mut shape, &mut data).then_some((k, dtype, shape, data))
        })
        .collect();
    let views = kept.iter().map(|(k, d, s, b)| {
        (
            k.clone(),
            safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
        )
    });
    std::fs::write(
        dir.join("model.safetensors"),
        safetensors::serialize(views, None).unwrap(),
    )
    .unwrap();
    dir
}

/// Fixture `name` with `edit_config` applied, the tensors `drop` left out, and `int_key`
/// (if any) relabelled as I32.
fn altered(
    name: &str,
    tag: &str,
    edit_config: impl Fn(&mut serde_json::Value),
    drop: &[&str],
    int_key: Option<&str>,
) -> Scratch {
    edited(name, tag, edit_config, |k, dtype, _, _| {
        if Some(k) == int_key {
            *dtype = safetensors::Dtype::I32;
        }
        !drop.contains(&k)
    })
}

/// Fixture `name` whose tensor `key` keeps only its first `rows` rows.
fn truncated(name: &str, tag: &str, key: &str, rows: usize) -> Scratch {
    edited(
        name,
        tag,
        |_| {},
        |k, _, shape, data| {
            if k == key {
                data.truncate(data.len() / shape[0] * rows);
                shape[0] = rows;
            }
            true
        },
    )
}

/// The packed layouts of the generic reader: a packed `[gate; up]` with an odd number of rows
/// has no halves, and a layer whose packed tensor is narrower than another layer's does not
/// load into the model's FFN; both are typed errors naming the tensor.
#[test]
fn packed_tensors_that_do_not_split_are_refused() {
    let device = device();
    for (name, key) in [
        ("phi3", "model.layers.0.mlp.gate_up_proj.weight"),
        ("modernbert", "model.layers.0.mlp.Wi.weight"),
    ] {
        let odd = truncated(name, "odd", key, 79);
        let err = HfModel::open(&odd).unwrap().ffn_config().unwrap_err();
        assert!(
            matches!(&err, Error::Scheme(m) if m.contains(key)),
            "{name}: {err}"
        );
        let narrower = truncated(name, "narrow", &key.replace(".0.", ".1."), 78);
        let mut model = HfModel::open(&narrower).unwrap();
        model.load_layer(0, &device).unwrap();
        let err = model.load_layer(1, &device).unwrap_err();
        assert!(
            matches!(&err, Error::Shape { key: k, .. } if *k == key.replace(".0.", ".1.")),
            "{name}: {err}"
        );
    }
    // An activation the crate does not know, in Gemma 2's field.
    let act = altered(
        "gemma2",
        "act",
        |c| c["hidden_activation"] = "gelu_foo".into(),
        &[],
        None,
    );
    let err = HfModel::open(&act).unwrap().ffn_config().unwrap_err();
    assert!(
        matches!(&err, Error::HfConfig { field, .. } if field == "hidden_activation"),
        "{err}"
    );
}

#[test]
fn bad_folders_give_typed_errors_naming_the_key_or_field() {
    let device = device();
    let keep = |_: &mut serde_json::Value| {};

    let mut model = HfModel::open(folder("llama")).unwrap();
    let err = model.load_layer(2, &device).unwrap_err();
    assert!(
        matches!(
            err,
            Error::LayerOutOfRange {
                layer: 2,
                layers: 2
            }
        ),
        "{err}"
    );

    // Keys of no known scheme: the layer's error names where it looked.
    let unknown = altered(
        "llama",
        "unknown",
        |c| c["model_type"] = "whisper".into(),
        &[
            "model.layers.0.mlp.up_proj.weight",
            "model.layers.0.mlp.down_proj.weight",
            "model.layers.1.mlp.up_proj.weight",
            "model.layers.1.mlp.down_proj.weight",
        ],
        None,
    );
    let err = HfModel::open(&unknown)
        .unwrap()
        .load_layer(0, &device)
        .unwrap_err();
    assert!(
        matches!(&err, Error::MissingTensor { .. }) && err.to_string().contains("layer 0"),
        "{err}"
    );

    let no_act = altered(
        "llama",
        "no-act",
        |c| {
            c.as_object_mut().unwrap().remove("hidden_act");
        },
        &[],
        None,
    );
    let err = HfModel::open(&no_act).unwrap().ffn_config().unwrap_err();
    assert!(
        matches!(&err, Error::HfConfig { field, .. } if field == "hidden_act"),
        "{err}"
    );
    assert!(err.to_string().contains("activation_function"), "{err}");

    let act = altered(
        "bert",
        "act",
        |c| c["hidden_act"] = "gleu".into(),
        &[],
        None,
    );
    let err = HfModel::open(&act).unwrap().ffn_config().unwrap_err();
    assert!(
        matches!(&err, Error::HfConfig { field, .. } if field == "hidden_act"),
        "{err}"
    );
    assert!(
        err.to_string().contains("gleu") && err.to_string().contains("gelu_tanh"),
        "{err}"
    );

    let proj = altered(
        "t5-gated",
        "proj",
        |c| c["feed_forward_proj"] = "gated-foo".into(),
        &[],
        None,
    );
    let err = HfModel::open(&proj).unwrap().ffn_config().unwrap_err();
    assert!(
        matches!(&err, Error::HfConfig { field, .. } if field == "feed_forward_proj"),
        "{err}"
    );

    // Sizes come from the tensors: a config without them still loads.
    let size = altered(
        "llama",
        "size",
        |c| {
            c.as_object_mut().unwrap().remove("intermediate_size");
        },
        &[],
        None,
    );
    let config = HfModel::open(&size).unwrap().ffn_config().unwrap();
    assert_eq!((config.d_model, config.d_ff), (16, 40));

    let missing = altered(
        "llama",
        "missing",
        keep,
        &["model.layers.1.mlp.up_proj.weight"],
        None,
    );
    let mut model = HfModel::open(&missing).unwrap();
    model.load_layer(0, &device).unwrap();
    let err = model.load_layer(1, &device).unwrap_err();
    assert!(
        matches!(&err, Error::MissingTensor { key, .. } if key == "model.layers.1.mlp.up_proj.weight"),
        "{err}"
    );

    let shape = altered(
        "llama",
        "shape",
        |c| c["intermediate_size"] = 41.into(),
        &[],
        None,
    );
    // A config whose sizes are not its tensors': the field, and the tensor it contradicts.
    let err = HfModel::open(&shape)
        .unwrap()
        .load_layer(0, &device)
        .unwrap_err();
    assert!(
        matches!(&err, Error::HfConfig { field, .. } if field == "intermediate_size")
            && err
                .to_string()
                .contains("model.layers.0.mlp.up_proj.weight"),
        "{err}"
    );

    let dtype = altered(
        "gpt2",
        "dtype",
        keep,
        &[],
        Some("transformer.h.0.mlp.c_fc.bias"),
    );
    let err = HfModel::open(&dtype)
        .unwrap()
        .load_layer(0, &device)
        .unwrap_err();
    assert!(
        matches!(&err, Error::DType { key, dtype } if key == "transformer.h.0.mlp.c_fc.bias" && dtype == "I32"),
        "{err}"
    );

    let err = HfModel::open(Path::new("/nonexistent")).err().unwrap();
    assert!(matches!(err, Error::Io { .. }), "{err}");
}

#[test]
fn ffns_are_found_in_any_file() {
    let find_ffns = |path: PathBuf| ffn_model::interop::inspect::open(&path).unwrap().ffns;

    let t5 = find_ffns(folder("t5-gated").join("model.safetensors"));
    let prefixes: Vec<&str> = t5.iter().map(|f| f.prefix.as_str()).collect();
    assert_eq!(
        prefixes,
        [
            "decoder.block.0.layer.2.DenseReluDense.",
            "decoder.block.1.layer.2.DenseReluDense.",
            "encoder.block.0.layer.1.DenseReluDense.",
            "encoder.block.1.layer.1.DenseReluDense.",
        ]
    );
    let t5_config = HfModel::open(folder("t5-gated"))
        .unwrap()
        .ffn_config()
        .unwrap();
    for f in &t5 {
        assert_eq!(f.scheme, Scheme::T5);
        assert_eq!(
            f.config,
            t5_config
                .clone()
                .with_dropout(0.0)
                .with_dropout_at(Default::default())
        );
        assert!(!f.activation_from_file);
    }
    for (name, scheme, bias) in [
        ("bert", Scheme::Bert, true),
        ("gpt2", Scheme::Gpt2, true),
        ("llama", Scheme::Llama, false),
    ] {
        let found = find_ffns(folder(name).join("model.safetensors"));
        assert_eq!(found.len(), 2, "{name}: {found:?}");
        let config = HfModel::open(folder(name)).unwrap().ffn_config().unwrap();
        for f in found {
            assert_eq!(f.scheme, scheme);
            assert_eq!(
                (f.config.d_model, f.config.d_ff, f.config.gated),
                (config.d_model, config.d_ff, config.gated)
            );
            assert_eq!(
                (f.config.bias_up, f.config.bias_down),
                (bias, bias),
                "{name}"
            );
            assert_eq!(f.config.activation, config.activation, "{name}");
        }
    }
    // Files written here carry their activation.
    let device = device();
    let ffn = FeedForwardConfig::new(4, 8)
        .with_gated(true)
        .with_activation(Activation::Relu2)
        .init(&device);
    let dir = scratch("find");
    let path = dir.join("ffn.safetensors");
    ffn.save_safetensors_as(&path, Scheme::W12, "mlp.").unwrap();
    let found = find_ffns(path);
    assert_eq!(found.len(), 1);
    assert_eq!(
        (found[0].prefix.as_str(), found[0].scheme),
        ("mlp.", Scheme::W12)
    );
    assert_eq!(found[0].config, ffn.config());
    assert!(found[0].activation_from_file);
}

/// A multimodal checkpoint (Gemma 3 as released from 4B up): the language model's fields are
/// read from `text_config` and its FFNs chosen over the vision tower's, which has more layers;
/// an error in a `text_config` field names it so.
#[test]
fn multimodal_models_load_their_language_model() {
    let model = HfModel::open(folder("gemma3_mm")).unwrap();
    assert_eq!(model.model_type(), "gemma3");
    assert_eq!(model.num_layers().unwrap(), 2);
    assert_eq!(
        model.layer_prefix(0).unwrap(),
        "language_model.model.layers.0.mlp."
    );
    let config = model.ffn_config().unwrap();
    assert_eq!((config.d_model, config.d_ff), (16, 40));
    assert_eq!(config.activation, Activation::GeluTanh);

    let broken = edited(
        "gemma3_mm",
        "text-field",
        |c| c["text_config"]["hidden_activation"] = "swoosh".into(),
        |_, _, _, _| true,
    );
    let result = HfModel::open(&*broken).and_then(|m| m.ffn_config());
    assert!(
        matches!(&result, Err(Error::HfConfig { field, .. }) if field == "text_config.hidden_activation"),
        "{result:?}"
    );
}
