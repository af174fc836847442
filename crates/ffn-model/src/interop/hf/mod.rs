//! # Hugging Face model folders
//!
//! A folder written by `save_pretrained`: `config.json` and `model.safetensors`, or several
//! shards listed by `model.safetensors.index.json`. [`HfModel`] finds each layer's FFN by its
//! tensor names and reads the rest from the config's fields, whatever the `model_type`:
//!
//! - **Where**: every prefix under which the weights of a known [`Scheme`] lie
//!   (`model.layers.3.mlp.`, `encoder.block.3.layer.1.DenseReluDense.`,
//!   `model.decoder.layers.3.`); its layer is the prefix's first number. Experts are not
//!   dense FFNs (see [`HfModel::load_moe_layer`]). Of several stacks (encoder and decoder, a
//!   language model and a vision tower), those whose sizes contradict the config are left out,
//!   then the one with the most layers wins, an encoder on a tie. A multimodal model's
//!   `text_config` fields are read as the model's own.
//! - **Layout**: the scheme of the keys (split or packed gate and up, the stems); `Conv1D` or
//!   `nn.Linear` for `c_fc`/`c_proj` from the weight's shape against `d_model`.
//! - **Sizes, gating, biases**: from the tensors (`d_model`, `d_ff`, whether a gate and each
//!   bias are there).
//! - **Activation**: the first of `mlp_hidden_act` (Nemotron-H), `hidden_activation`, `hidden_act`, `activation_function`,
//!   `activation`, `feed_forward_proj` (T5's `gated-gelu` is the tanh GELU, as
//!   `transformers` maps it to `gelu_new`). **Dropout**: `hidden_dropout_prob`,
//!   `resid_pdrop`, `hidden_dropout` (on the output), `dropout_rate` (T5, on the hidden
//!   layer). **Layers**: `num_hidden_layers`, `num_layers`, `n_layer`, `n_layers`.
//!
//! What only a family's code says sits in two small tables: the activation of BLOOM and MPT
//! (their configs name none) and GPT-2's `Conv1D` where the shapes cannot tell (`d_ff =
//! d_model`).
//!
//! | family (`model_type`) | FFN of layer i | scheme | activation field |
//! |---|---|---|---|
//! | `bert`, `roberta`, `deberta-v2` | `…encoder.layer.i.{intermediate,output}.dense` | `bert` | `hidden_act` |
//! | `distilbert` | `distilbert.transformer.layer.i.ffn.{lin1,lin2}` | `distilbert` | `activation` |
//! | `modernbert` | `model.layers.i.mlp.{Wi,Wo}`, `Wi` packed | `modernbert` | `hidden_activation` |
//! | `t5` | `encoder.block.i.layer.1.DenseReluDense.{wi,wi_0,wi_1,wo}` | `t5` | `feed_forward_proj` |
//! | `llama`, `mistral`, `qwen2`, `qwen3`, `olmo2`, `gemma` | `model.layers.i.mlp.{gate,up,down}_proj` | `llama` | `hidden_act` |
//! | `gemma2`, `gemma3_text` | the same | `llama` | `hidden_activation` |
//! | `nemotron` (squared ReLU, ungated) | `model.layers.i.mlp.{up,down}_proj` | `llama` | `hidden_act` |
//! | `phi3` | `model.layers.i.mlp.{gate_up_proj,down_proj}` | `gate_up_proj` | `hidden_act` |
//! | `phi` | `model.layers.i.mlp.{fc1,fc2}` | `fc` | `hidden_act` |
//! | `opt` | `model.decoder.layers.i.{fc1,fc2}` | `fc` | `activation_function` |
//! | `gpt2` | `transformer.h.i.mlp.{c_fc,c_proj}`, `Conv1D` | `gpt2` | `activation_function` |
//! | `gpt_bigcode`, `starcoder2` | `….mlp.{c_fc,c_proj}`, `nn.Linear` | `bigcode` | `activation_function`, `hidden_act` |
//! | `gptj` | `transformer.h.i.mlp.{fc_in,fc_out}` | `gptj` | `activation_function` |
//! | `gpt_neox`, `falcon`, `bloom` | `….mlp.{dense_h_to_4h,dense_4h_to_h}` | `neox` | `hidden_act`, `activation`, none (tanh GELU) |
//! | `mixtral`, `qwen2_moe`, `qwen3_moe`, `deepseek_v3` | dense layers as `llama`; sparse layers: [`HfModel::load_moe_layer`] | | see [`HfModel::moe_config`] |

pub mod moe;
mod moe_weights;

use std::path::{Path, PathBuf};

use burn::tensor::Device;
use serde_json::{Map, Value};

use crate::files;
use crate::interop::safetensors::{TensorFile, TensorFiles};
use crate::{Activation, DropoutAt, Error, FeedForward, FeedForwardConfig, Scheme};

/// A Hugging Face model folder.
pub struct HfModel {
    folder: PathBuf,
    model_type: String,
    /// `config.json`'s fields, with those of its `text_config` (a multimodal model's language
    /// model: Llama 4, Gemma 3, …) laid over them, and those of an `ffn_config` (DBRX) added.
    pub(crate) config: Map<String, Value>,
    /// The fields that came from a nested object, and its name (errors name them so).
    nested_fields: std::collections::HashMap<String, &'static str>,
    pub(crate) files: TensorFiles,
    /// The dense FFNs found by their keys, in layer order (see [`HfModel::layer_prefix`]).
    dense: Vec<DenseFfn>,
}

/// A dense FFN found in the checkpoint: where, in which layer, in which scheme.
#[derive(Debug, Clone)]
struct DenseFfn {
    prefix: String,
    layer: usize,
    scheme: Scheme,
    gated: bool,
}

/// The model types whose checkpoints have been checked against `transformers` (any other
/// loads too when its keys and fields follow one of their patterns).
pub const MODEL_TYPES: [&str; 29] = [
    "bert",
    "roberta",
    "deberta-v2",
    "distilbert",
    "modernbert",
    "t5",
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "olmo2",
    "gemma",
    "gemma2",
    "gemma3_text",
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
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v3",
];

/// The fields of `config.json` that hold each quantity, in the order they are read: between
/// them they cover every family above.
const D_MODEL_FIELDS: [&str; 4] = ["hidden_size", "d_model", "n_embd", "dim"];
const D_FF_FIELDS: [&str; 7] = [
    // Llama 4's dense layers (its `intermediate_size` is the experts' width).
    "intermediate_size_mlp",
    "intermediate_size",
    "d_ff",
    "n_inner",
    "ffn_dim",
    "hidden_dim",
    "ffn_hidden_size",
];
const LAYER_FIELDS: [&str; 4] = ["num_hidden_layers", "num_layers", "n_layer", "n_layers"];
/// `hidden_activation` first: Gemma 2 and 3 and ModernBERT read it, and Gemma 1 leaves it null.
/// Nemotron-H names its MLPs' (`mlp_hidden_act`) beside its Mamba layers'. DBRX's `ffn_act_fn`
/// is an object, `{"name": "silu"}`.
const ACTIVATION_FIELDS: [&str; 7] = [
    "mlp_hidden_act",
    "hidden_activation",
    "hidden_act",
    "activation_function",
    "activation",
    "feed_forward_proj",
    "ffn_act_fn",
];
/// Dropout fields and where the layer applies them.
const DROPOUT_FIELDS: [(&str, DropoutAt); 4] = [
    ("hidden_dropout_prob", DropoutAt::Output),
    ("resid_pdrop", DropoutAt::Output),
    ("hidden_dropout", DropoutAt::Output),
    ("dropout_rate", DropoutAt::Hidden),
];

/// What only a family's own code says, where its config and keys cannot: the activation of
/// a family whose config names none (BLOOM's `bloom_gelu` is the tanh form, MPT's `nn.GELU()`
/// the exact one, LFM2's and LFM2-MoE's SwiGLU its `F.silu`), and the families
/// whose `c_fc`/`c_proj` are GPT-2's `Conv1D` when the shapes cannot tell (`d_ff = d_model`).
const DEFAULT_ACTIVATION: [(&str, Activation); 4] = [
    ("bloom", Activation::GeluTanh),
    ("mpt", Activation::Gelu),
    ("lfm2", Activation::Silu),
    ("lfm2_moe", Activation::Silu),
];
const CONV1D_TYPES: [&str; 1] = ["gpt2"];

impl HfModel {
    /// Opens a folder: reads `config.json` and the headers of the weight files.
    pub fn open(folder: impl AsRef<Path>) -> Result<Self, Error> {
        let folder = folder.as_ref().to_path_buf();
        let config_path = folder.join("config.json");
        let text =
            files::read_text(&config_path, files::MAX_CONFIG_FILE).map_err(|source| Error::Io {
                path: config_path.clone(),
                source,
            })?;
        let mut config: Map<String, Value> =
            serde_json::from_str(&text).map_err(|e| Error::HfConfig {
                path: config_path.clone(),
                field: "config.json".into(),
                message: format!("not a JSON object: {e}"),
            })?;
        let model_type = config
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| Error::HfConfig {
                path: config_path.clone(),
                field: "model_type".into(),
                message: "missing".into(),
            })?
            .to_string();
        // A multimodal model describes its language model in `text_config`: its fields are the
        // ones that size the FFNs. DBRX keeps its FFN's in `ffn_config`, which fills in what
        // the top level does not say. The top level keeps its `model_type`.
        let mut nested_fields = std::collections::HashMap::new();
        for (object, over) in [("text_config", true), ("ffn_config", false)] {
            let Some(Value::Object(fields)) = config.get(object).cloned() else {
                continue;
            };
            for (key, value) in fields {
                let taken = config.get(&key).is_some_and(|v| !v.is_null());
                if key != "model_type" && (over || !taken) {
                    nested_fields.insert(key.clone(), object);
                    config.insert(key, value);
                }
            }
        }
        let index = folder.join("model.safetensors.index.json");
        let files = if index.exists() {
            let text =
                files::read_text(&index, files::MAX_CONFIG_FILE).map_err(|source| Error::Io {
                    path: index.clone(),
                    source,
                })?;
            let value: Value = serde_json::from_str(&text).map_err(|e| Error::Corrupt {
                path: index.clone(),
                reason: e.to_string(),
            })?;
            let map = value
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| Error::Corrupt {
                    path: index.clone(),
                    reason: "no `weight_map` object".into(),
                })?;
            let mut shards: Vec<&str> = Vec::new();
            for (key, shard) in map {
                let shard = shard.as_str().ok_or_else(|| Error::Corrupt {
                    path: index.clone(),
                    reason: format!(
                        "`weight_map` gives `{}` a shard that is not a string",
                        crate::error::clip(key)
                    ),
                })?;
                // A shard is a plain file name inside the folder: never a path that leaves it.
                let mut parts = Path::new(shard).components();
                let plain = matches!(
                    (parts.next(), parts.next()),
                    (Some(std::path::Component::Normal(_)), None)
                ) && !shard.contains(['/', '\\', '\0']);
                if !plain {
                    return Err(Error::Corrupt {
                        path: index.clone(),
                        reason: format!(
                            "shard `{}` is not a plain file name in the model folder",
                            crate::error::clip(shard)
                        ),
                    });
                }
                shards.push(shard);
            }
            shards.sort_unstable();
            shards.dedup();
            let files = shards
                .into_iter()
                .map(|shard| TensorFile::open(&folder.join(shard)))
                .collect::<Result<Vec<_>, _>>()?;
            TensorFiles::many(files)?
        } else {
            TensorFiles::single(TensorFile::open(&folder.join("model.safetensors"))?)
        };
        let mut model = Self {
            folder,
            model_type,
            config,
            nested_fields,
            files,
            dense: Vec::new(),
        };
        model.dense = model.find_dense();
        Ok(model)
    }

    /// Every dense FFN in the checkpoint, found by its keys alone: a prefix under which the
    /// weights of a known [`Scheme`] lie (`model.layers.3.mlp.`, `encoder.block.3.layer.1.
    /// DenseReluDense.`, `model.decoder.layers.3.`). Its layer is the prefix's first number.
    /// Experts are not dense FFNs: prefixes with an `experts` or `shared_expert(s)` part are
    /// left to [`HfModel::load_moe_layer`]. When several stacks hold FFNs (an encoder and a
    /// decoder, a language model and a vision tower), those whose sizes contradict the config
    /// are left out, and the layers are those of the stack with the most, an encoder on a tie.
    fn find_dense(&self) -> Vec<DenseFfn> {
        let keys: std::collections::HashSet<&str> = self.files.keys().collect();
        let mut found: Vec<(String, DenseFfn)> = Vec::new();
        for (prefix, scheme, gated) in Scheme::find_all(&keys) {
            let expert = prefix
                .split('.')
                .any(|p| p.starts_with("expert") || p.starts_with("shared_expert"));
            let Some(layer) = layer_of(&prefix).filter(|_| !expert) else {
                continue;
            };
            let scheme = self.orientation(scheme, &prefix);
            found.push((
                at_layer(&prefix, "{}"),
                DenseFfn {
                    prefix,
                    layer,
                    scheme,
                    gated,
                },
            ));
        }
        // Each stack's layer count, and whether its sizes fit the config's (read from its
        // first FFN, once per stack).
        let mut stacks: std::collections::BTreeMap<&str, (usize, bool)> = Default::default();
        for (stack, ffn) in &found {
            stacks
                .entry(stack.as_str())
                .or_insert_with(|| (0, self.found_config(ffn).is_ok()))
                .0 += 1;
        }
        // A stack whose sizes contradict the config's belongs to another model in the file (a
        // multimodal model's vision tower): left out, unless every stack does (then the error
        // comes from the config's own stack, when its FFN is read).
        if stacks.values().any(|&(_, fits)| fits) {
            stacks.retain(|_, &mut (_, fits)| fits);
        }
        let encoder = |s: &str| s.split('.').any(|p| p == "encoder");
        // The most layers, then an encoder, then the shortest name, then the first in order.
        let Some(chosen) = stacks
            .iter()
            .rev()
            .max_by_key(|(s, (n, _))| (*n, encoder(s), std::cmp::Reverse(s.len())))
            .map(|(s, _)| s.to_string())
        else {
            return Vec::new();
        };
        let mut dense: Vec<DenseFfn> = found
            .into_iter()
            .filter(|(s, _)| *s == chosen)
            .map(|(_, f)| f)
            .collect();
        dense.sort_by_key(|f| f.layer);
        dense
    }

    /// GPT-2's `c_fc`/`c_proj` are `Conv1D`, `[in, out]`; GPT-BigCode's and StarCoder2's are
    /// `nn.Linear`, `[out, in]`. The up weight's shape against `d_model` tells them apart;
    /// where it cannot (`d_ff = d_model`, or no `d_model` field), the model type does.
    fn orientation(&self, scheme: Scheme, prefix: &str) -> Scheme {
        if scheme != Scheme::Gpt2 {
            return scheme;
        }
        let shape = self
            .files
            .info(&format!("{prefix}c_fc.weight"))
            .map(|i| i.shape.clone())
            .unwrap_or_default();
        let d_model = self
            .first_field(&D_MODEL_FIELDS)
            .and_then(|f| self.config.get(f)?.as_u64())
            .map(|n| n as usize);
        match d_model.and_then(|d| crate::interop::scheme::c_fc_layout(&shape, d)) {
            Some(scheme) => scheme,
            None if CONV1D_TYPES.contains(&self.model_type.as_str()) => Scheme::Gpt2,
            None => Scheme::BigCode,
        }
    }

    /// The folder.
    pub fn folder(&self) -> &Path {
        &self.folder
    }

    /// `config.json`'s `model_type`.
    pub fn model_type(&self) -> &str {
        &self.model_type
    }

    /// The naming scheme of the model's dense FFN weights, found from their keys (a model
    /// whose layers are all sparse: `llama`'s, as its shared and dense-layer names are).
    pub fn scheme(&self) -> Scheme {
        self.dense.first().map_or(Scheme::Llama, |f| f.scheme)
    }

    pub(crate) fn error(&self, field: &str, message: impl Into<String>) -> Error {
        let field = match self.nested_fields.get(field) {
            Some(object) => format!("{object}.{field}"),
            None => field.to_string(),
        };
        Error::HfConfig {
            path: self.folder.join("config.json"),
            field,
            message: message.into(),
        }
    }

    /// A size or count: an integer in `1..=MAX_DIM`.
    pub(crate) fn size(&self, field: &str) -> Result<usize, Error> {
        self.integer(field, 1)
    }

    /// A layer index or a count that may be zero: an integer in `0..=MAX_DIM`.
    pub(crate) fn index(&self, field: &str) -> Result<usize, Error> {
        self.integer(field, 0)
    }

    fn integer(&self, field: &str, low: u64) -> Result<usize, Error> {
        match self.config.get(field) {
            Some(v) => v
                .as_u64()
                .filter(|&n| (low..=crate::MAX_DIM as u64).contains(&n))
                .map(|n| n as usize)
                .ok_or_else(|| {
                    self.error(
                        field,
                        format!(
                            "must be an integer from {low} to {}, got {}",
                            crate::MAX_DIM,
                            crate::error::clip(&v.to_string())
                        ),
                    )
                }),
            None => Err(self.error(field, "missing")),
        }
    }

    pub(crate) fn string(&self, field: &str, default: &str) -> Result<String, Error> {
        match self.config.get(field) {
            None | Some(Value::Null) => Ok(default.to_string()),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(v) => Err(self.error(field, format!("must be a string, got {v}"))),
        }
    }

    pub(crate) fn number(&self, field: &str, default: f64) -> Result<f64, Error> {
        match self.config.get(field) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| self.error(field, format!("must be a number, got {v}"))),
        }
    }

    pub(crate) fn activation(&self, field: &str, name: &str) -> Result<Activation, Error> {
        name.parse()
            .map_err(|e: crate::ConfigError| self.error(field, e.to_string()))
    }

    /// The first of `fields` that the config has (not null), if any.
    pub(crate) fn first_field(&self, fields: &[&'static str]) -> Option<&'static str> {
        fields
            .iter()
            .find(|f| self.config.get(**f).is_some_and(|v| !v.is_null()))
            .copied()
    }

    /// The number of layers: `num_hidden_layers`, `num_layers`, `n_layer` or `n_layers`, else
    /// (BART's `encoder_layers`, say) one past the last layer with a dense FFN.
    pub fn num_layers(&self) -> Result<usize, Error> {
        match (self.first_field(&LAYER_FIELDS), self.dense.last()) {
            (Some(field), _) => self.size(field),
            (None, Some(last)) => Ok(last.layer + 1),
            (None, None) => Err(self.error(
                LAYER_FIELDS[0],
                format!("missing (nor any of {})", LAYER_FIELDS[1..].join(", ")),
            )),
        }
    }

    /// The activation: the first of the activation fields the config has, T5's `gated-ACT`
    /// form read as `ACT` (with `gated-gelu` the tanh form, as `transformers` maps it), else
    /// the family's own default.
    fn ffn_activation(&self) -> Result<Activation, Error> {
        let Some(field) = self.first_field(&ACTIVATION_FIELDS) else {
            return DEFAULT_ACTIVATION
                .iter()
                .find(|(t, _)| *t == self.model_type)
                .map(|(_, a)| *a)
                .ok_or_else(|| {
                    self.error(
                        "hidden_act",
                        format!(
                            "missing: no activation field ({}) in config.json",
                            ACTIVATION_FIELDS.join(", ")
                        ),
                    )
                });
        };
        let name = match self.config.get(field) {
            Some(Value::Object(spec)) => match spec.get("name") {
                Some(Value::String(name)) => name.clone(),
                _ => return Err(self.error(field, "an object without a string `name`")),
            },
            _ => self.string(field, "")?,
        };
        let name = if field == "feed_forward_proj" {
            match name.split_once('-') {
                Some(("gated", "gelu")) => "gelu_new".to_string(),
                Some(("gated", act)) => act.to_string(),
                None => name,
                _ => {
                    return Err(
                        self.error(field, format!("`{name}` is neither `ACT` nor `gated-ACT`"))
                    );
                }
            }
        } else {
            name
        };
        self.activation(field, &name)
    }

    /// The FFN's config: sizes, gating and biases from the first dense FFN's tensors, the
    /// activation and dropout from `config.json`. A model whose layers are all sparse takes
    /// the sizes from `config.json` (`hidden_size`, `intermediate_size`, …), gated, with
    /// `mlp_bias`.
    pub fn ffn_config(&self) -> Result<FeedForwardConfig, Error> {
        self.no_step_ffn_lacks()?;
        let activation = self.ffn_activation()?;
        let config = match self.dense.first() {
            Some(ffn) => self.found_config(ffn)?,
            None => {
                let d_model = match self.first_field(&D_MODEL_FIELDS) {
                    Some(field) => self.size(field)?,
                    None => return Err(self.error(D_MODEL_FIELDS[0], "missing")),
                };
                let d_ff = match self.first_field(&D_FF_FIELDS) {
                    Some(field) => self.size(field)?,
                    None => d_model.saturating_mul(4),
                };
                let bias = match self.config.get("mlp_bias") {
                    None | Some(Value::Null) => false,
                    Some(Value::Bool(b)) => *b,
                    Some(v) => {
                        return Err(self.error("mlp_bias", format!("must be a boolean, got {v}")));
                    }
                };
                FeedForwardConfig::new(d_model, d_ff)
                    .with_gated(true)
                    .with_bias_up(bias)
                    .with_bias_gate(bias)
                    .with_bias_down(bias)
            }
        };
        let mut config = config.with_activation(activation);
        let fields = DROPOUT_FIELDS.map(|(field, _)| field);
        if let Some((field, at)) = self
            .first_field(&fields)
            .and_then(|f| DROPOUT_FIELDS.iter().find(|(g, _)| *g == f))
        {
            config = config
                .with_dropout(self.number(field, 0.0)?)
                .with_dropout_at(*at);
        }
        config
            .validate()
            .map_err(|e| self.error("config.json", e.to_string()))?;
        Ok(config)
    }

    /// The config fields that add a step to the FFN's function which ffn's layer has no form
    /// for, refused unless they leave it out: Falcon-H1's `mlp_multipliers` (its gate's
    /// pre-activation and its output scaled: `[1, 1]` leaves them), Gemma 3n's
    /// `activation_sparsity_pattern` (a Gaussian top-k of the gate's outputs in each layer
    /// whose entry is not 0).
    fn no_step_ffn_lacks(&self) -> Result<(), Error> {
        for (field, neutral, step) in [
            (
                "mlp_multipliers",
                1.0,
                "ffn's FFN does not scale its gate's pre-activation or its output",
            ),
            (
                "activation_sparsity_pattern",
                0.0,
                "ffn's FFN has no top-k sparsity of its activations",
            ),
        ] {
            match self.config.get(field) {
                None | Some(Value::Null) => {}
                Some(Value::Array(items)) if items.iter().all(|v| v.as_f64() == Some(neutral)) => {}
                Some(v) => return Err(self.error(field, format!("is {v}: {step}"))),
            }
        }
        Ok(())
    }

    /// The sizes, gating and biases of a dense FFN, read from its tensors.
    fn found_config(&self, ffn: &DenseFfn) -> Result<FeedForwardConfig, Error> {
        use crate::interop::scheme::{Role, Slot};
        let slot = |role| ffn.scheme.slot(role, ffn.gated).ok().flatten();
        let up = slot(Role::Up).expect("a detected scheme has an up projection");
        let key = format!("{}{}.weight", ffn.prefix, up.name());
        let shape = self.files.info(&key).map(|i| i.shape.clone());
        let (d_model, d_ff) = match (up, shape.as_deref()) {
            (Slot::Linear(_), Some([out, inp])) => (*inp, *out),
            (Slot::Conv1d(_), Some([inp, out])) => (*inp, *out),
            (Slot::Half(..), Some([out, inp])) if out % 2 == 0 => (*inp, out / 2),
            _ => {
                let expected = match up {
                    Slot::Half(..) => "[2·d_ff, d_model]",
                    Slot::Conv1d(_) => "[d_model, d_ff]",
                    Slot::Linear(_) => "[d_ff, d_model]",
                };
                return Err(Error::Scheme(format!(
                    "tensor `{}` has shape {:?}: a {} up projection is {expected}",
                    crate::error::clip(&key),
                    shape.unwrap_or_default(),
                    ffn.scheme
                )));
            }
        };
        // The config's sizes, where it states them, must be the tensors'.
        for (fields, size, width) in [
            (&D_MODEL_FIELDS[..], d_model, false),
            (&D_FF_FIELDS[..], d_ff, true),
        ] {
            if let Some(field) = self.first_field(fields) {
                let stated = self.size(field)?;
                // LFM2's adjustment applies to the stated width only, even where d_model = d_ff.
                let stated = if width {
                    self.auto_adjusted_d_ff(stated)?
                } else {
                    stated
                };
                if stated != size {
                    return Err(self.error(
                        field,
                        format!(
                            "is {stated}, but the FFN weight `{}` has {size}",
                            crate::error::clip(&key)
                        ),
                    ));
                }
            }
        }
        let bias = |role| {
            slot(role).is_some_and(|s: Slot| {
                self.files
                    .info(&format!("{}{}.bias", ffn.prefix, s.name()))
                    .is_some()
            })
        };
        Ok(FeedForwardConfig::new(d_model, d_ff)
            .with_gated(ffn.gated)
            .with_bias_gate(bias(Role::Gate))
            .with_bias_up(bias(Role::Up))
            .with_bias_down(bias(Role::Down)))
    }

    /// LFM2's `block_auto_adjust_ff_dim`: its FFNs are `⌊2·d_ff/3⌋` wide, and with a
    /// `block_ffn_dim_multiplier` that times it, rounded up to a multiple of
    /// `block_multiple_of` (the sizing of Llama's reference SwiGLU, as `transformers` does it).
    /// Without the field, `d_ff` as stated.
    fn auto_adjusted_d_ff(&self, d_ff: usize) -> Result<usize, Error> {
        let field = "block_auto_adjust_ff_dim";
        match self.config.get(field) {
            None | Some(Value::Null | Value::Bool(false)) => return Ok(d_ff),
            Some(Value::Bool(true)) => {}
            Some(v) => return Err(self.error(field, format!("must be a boolean, got {v}"))),
        }
        let two_thirds = 2 * d_ff / 3;
        if self.first_field(&["block_ffn_dim_multiplier"]).is_none() {
            return Ok(two_thirds);
        }
        let multiplier = self.number("block_ffn_dim_multiplier", 1.0)?;
        let multiple = self.size("block_multiple_of")?.max(1);
        let scaled = multiplier * two_thirds as f64;
        if !(scaled.is_finite() && scaled >= 0.0 && scaled < usize::MAX as f64 / 2.0) {
            return Err(self.error(
                "block_ffn_dim_multiplier",
                format!("{multiplier} gives no FFN width"),
            ));
        }
        Ok((scaled as usize).div_ceil(multiple) * multiple)
    }

    /// The key prefix of layer `layer`'s dense FFN, as this folder's keys have it (found by
    /// the keys alone: see the module docs).
    pub fn layer_prefix(&self, layer: usize) -> Result<String, Error> {
        let layers = self.num_layers()?;
        if layer >= layers {
            return Err(Error::LayerOutOfRange { layer, layers });
        }
        self.dense
            .iter()
            .find(|f| f.layer == layer)
            .map(|f| f.prefix.clone())
            .ok_or_else(|| Error::MissingTensor {
                key: match self.dense.first() {
                    Some(f) => at_layer(&f.prefix, &layer.to_string()),
                    None => format!("…{layer}.…"),
                },
                hint: format!(
                    " (no dense FFN of a known scheme for layer {layer}: schemes {})",
                    Scheme::ALL.map(Scheme::name).join(", ")
                ),
            })
    }

    /// Where layer `layer`'s FFN is, and in which scheme. A layer in range that the search
    /// did not find (a tensor missing, say) is looked for where the other layers have theirs,
    /// so that loading names the tensor that is not there.
    fn layer_ffn(&self, layer: usize) -> Result<(String, Scheme), Error> {
        match self.layer_prefix(layer) {
            Ok(prefix) => {
                let scheme = self.dense.iter().find(|f| f.layer == layer);
                Ok((prefix, scheme.map_or(self.scheme(), |f| f.scheme)))
            }
            Err(Error::MissingTensor { .. }) if !self.dense.is_empty() => {
                let like = &self.dense[0];
                Ok((at_layer(&like.prefix, &layer.to_string()), like.scheme))
            }
            Err(e) => Err(e),
        }
    }

    /// Builds the FFN of `config.json` on `device` and loads layer `layer`'s weights into it.
    pub fn load_layer(&mut self, layer: usize, device: &Device) -> Result<FeedForward, Error> {
        let config = self.ffn_config()?;
        let (prefix, scheme) = self.layer_ffn(layer)?;
        // An FFN module of its own (`…mlp.`, not a whole layer as BERT's or OPT's prefix is)
        // holds its projections only: another tensor there (BitNet's `ffn_sub_norm`) belongs
        // to a step of its function that ffn would leave out.
        let own_module = prefix
            .trim_end_matches('.')
            .rsplit('.')
            .next()
            .is_some_and(|last| !last.is_empty() && last.parse::<usize>().is_err());
        if own_module
            && let Some(key) = self
                .files
                .keys()
                .find(|k| k.starts_with(prefix.as_str()) && !scheme.owns(k, &prefix))
        {
            return Err(Error::UnexpectedTensor {
                key: key.to_string(),
                hint: format!(
                    " (the FFN module `{prefix}` has only its {scheme} projections in ffn: \
                     what this tensor computes is not part of the layer)"
                ),
            });
        }
        config
            .try_init(device)?
            .load_from(&mut self.files, scheme, &prefix)
    }

    /// Every tensor of the model: key, dtype, shape.
    pub fn tensors(&self) -> Vec<(String, String, Vec<usize>)> {
        self.files.list()
    }
}

/// A layer's number in a key prefix: its first part that is a number (`model.layers.3.mlp.`,
/// `encoder.block.3.layer.1.DenseReluDense.`).
pub(crate) fn layer_of(prefix: &str) -> Option<usize> {
    prefix.split('.').find_map(|part| part.parse().ok())
}

/// `prefix` with its layer number (see [`layer_of`]) replaced by `to`.
pub(crate) fn at_layer(prefix: &str, to: &str) -> String {
    let mut done = false;
    let parts: Vec<&str> = prefix
        .split('.')
        .map(|part| {
            if !done && part.parse::<usize>().is_ok() {
                done = true;
                to
            } else {
                part
            }
        })
        .collect();
    parts.join(".")
}
