//! # Hugging Face model folders
//!
//! A folder written by `save_pretrained`: `config.json` and `model.safetensors`, or several
//! shards listed by `model.safetensors.index.json`. [`HfModel`] reads the model type and its
//! config keys, builds the matching [`FeedForwardConfig`], and loads the FFN of any layer:
//!
//! | `model_type` | FFN of layer i | config keys |
//! |---|---|---|
//! | `bert`, `roberta` | `[bert.]encoder.layer.i.{intermediate,output}.dense` | `hidden_size`, `intermediate_size`, `hidden_act`, `hidden_dropout_prob` |
//! | `t5` | `encoder.block.i.layer.1.DenseReluDense.{wi,wi_0,wi_1,wo}` | `d_model`, `d_ff`, `feed_forward_proj`, `dropout_rate` |
//! | `llama`, `mistral`, `qwen2` | `model.layers.i.mlp.{gate,up,down}_proj` | `hidden_size`, `intermediate_size`, `hidden_act`, `mlp_bias` |
//! | `gpt2` | `transformer.h.i.mlp.{c_fc,c_proj}` | `n_embd`, `n_inner`, `activation_function`, `resid_pdrop` |
//! | `mixtral`, `qwen2_moe`, `qwen3_moe`, `deepseek_v3` | dense layers as `llama`; sparse layers: [`HfModel::load_moe_layer`] | see [`HfModel::moe_config`] |
//!
//! T5's `feed_forward_proj = "gated-gelu"` means the tanh GELU (`transformers` maps it to
//! `gelu_new`), as T5 v1.1 was trained.

use std::path::{Path, PathBuf};

use burn::tensor::Device;
use serde_json::{Map, Value};

use crate::files;
use crate::safetensors::{TensorFile, TensorFiles};
use crate::{Activation, DropoutAt, Error, FeedForward, FeedForwardConfig, Scheme};

/// A Hugging Face model folder.
pub struct HfModel {
    folder: PathBuf,
    model_type: String,
    pub(crate) config: Map<String, Value>,
    pub(crate) files: TensorFiles,
}

/// The model types understood.
pub const MODEL_TYPES: [&str; 11] = [
    "bert",
    "roberta",
    "t5",
    "llama",
    "mistral",
    "qwen2",
    "gpt2",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v3",
];

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
        let config: Map<String, Value> =
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
        if !MODEL_TYPES.contains(&model_type.as_str()) {
            return Err(Error::HfConfig {
                path: config_path,
                field: "model_type".into(),
                message: format!(
                    "`{model_type}` is not supported; supported: {}",
                    MODEL_TYPES.join(", ")
                ),
            });
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
        Ok(Self {
            folder,
            model_type,
            config,
            files,
        })
    }

    /// The folder.
    pub fn folder(&self) -> &Path {
        &self.folder
    }

    /// `config.json`'s `model_type`.
    pub fn model_type(&self) -> &str {
        &self.model_type
    }

    /// The naming scheme of the model's FFN weights.
    pub fn scheme(&self) -> Scheme {
        match self.model_type.as_str() {
            "bert" | "roberta" => Scheme::Bert,
            "t5" => Scheme::T5,
            "gpt2" => Scheme::Gpt2,
            _ => Scheme::Llama,
        }
    }

    pub(crate) fn error(&self, field: &str, message: impl Into<String>) -> Error {
        Error::HfConfig {
            path: self.folder.join("config.json"),
            field: field.to_string(),
            message: message.into(),
        }
    }

    /// A size or count: an integer in `1..=MAX_DIM`.
    pub(crate) fn size(&self, field: &str) -> Result<usize, Error> {
        match self.config.get(field) {
            Some(v) => v
                .as_u64()
                .filter(|&n| (1..=crate::MAX_DIM as u64).contains(&n))
                .map(|n| n as usize)
                .ok_or_else(|| {
                    self.error(
                        field,
                        format!(
                            "must be an integer from 1 to {}, got {}",
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

    /// The number of layers (`num_hidden_layers`, `num_layers` or `n_layer`).
    pub fn num_layers(&self) -> Result<usize, Error> {
        match self.model_type.as_str() {
            "t5" => self.size("num_layers"),
            "gpt2" => self.size("n_layer"),
            _ => self.size("num_hidden_layers"),
        }
    }

    /// The FFN's config, from `config.json`.
    pub fn ffn_config(&self) -> Result<FeedForwardConfig, Error> {
        let config = match self.model_type.as_str() {
            "bert" | "roberta" => {
                let act = self.string("hidden_act", "gelu")?;
                FeedForwardConfig::new(self.size("hidden_size")?, self.size("intermediate_size")?)
                    .with_activation(self.activation("hidden_act", &act)?)
                    .with_bias_up(true)
                    .with_bias_down(true)
                    .with_dropout(self.number("hidden_dropout_prob", 0.1)?)
                    .with_dropout_at(DropoutAt::Output)
            }
            "t5" => {
                let proj = self.string("feed_forward_proj", "relu")?;
                let (gated, act) = match proj.split_once('-') {
                    Some(("gated", act)) => (true, act),
                    None => (false, proj.as_str()),
                    _ => {
                        return Err(self.error(
                            "feed_forward_proj",
                            format!("`{proj}` is neither `ACT` nor `gated-ACT`"),
                        ));
                    }
                };
                // transformers: "gated-gelu" runs `gelu_new`, the tanh approximation.
                let act = if proj == "gated-gelu" {
                    "gelu_new"
                } else {
                    act
                };
                FeedForwardConfig::new(self.size("d_model")?, self.size("d_ff")?)
                    .with_activation(self.activation("feed_forward_proj", act)?)
                    .with_gated(gated)
                    .with_dropout(self.number("dropout_rate", 0.1)?)
                    .with_dropout_at(DropoutAt::Hidden)
            }
            "gpt2" => {
                let d_model = self.size("n_embd")?;
                let d_ff = match self.config.get("n_inner") {
                    None | Some(Value::Null) => d_model.saturating_mul(4),
                    Some(_) => self.size("n_inner")?,
                };
                let act = self.string("activation_function", "gelu_new")?;
                FeedForwardConfig::new(d_model, d_ff)
                    .with_activation(self.activation("activation_function", &act)?)
                    .with_bias_up(true)
                    .with_bias_down(true)
                    .with_dropout(self.number("resid_pdrop", 0.1)?)
                    .with_dropout_at(DropoutAt::Output)
            }
            _ => {
                let act = self.string("hidden_act", "silu")?;
                let bias = match self.config.get("mlp_bias") {
                    None | Some(Value::Null) => false,
                    Some(Value::Bool(b)) => *b,
                    Some(v) => {
                        return Err(self.error("mlp_bias", format!("must be a boolean, got {v}")));
                    }
                };
                FeedForwardConfig::new(self.size("hidden_size")?, self.size("intermediate_size")?)
                    .with_activation(self.activation("hidden_act", &act)?)
                    .with_gated(true)
                    .with_bias_up(bias)
                    .with_bias_gate(bias)
                    .with_bias_down(bias)
            }
        };
        config
            .validate()
            .map_err(|e| self.error("config.json", e.to_string()))?;
        Ok(config)
    }

    /// The key prefix of layer `layer`'s FFN, as this folder's keys have it.
    pub fn layer_prefix(&self, layer: usize) -> Result<String, Error> {
        let layers = self.num_layers()?;
        if layer >= layers {
            return Err(Error::LayerOutOfRange { layer, layers });
        }
        let candidates: Vec<String> = match self.model_type.as_str() {
            "bert" | "roberta" => ["bert.", "roberta.", ""]
                .iter()
                .map(|p| format!("{p}encoder.layer.{layer}."))
                .collect(),
            "t5" => vec![format!("encoder.block.{layer}.layer.1.DenseReluDense.")],
            "gpt2" => ["transformer.", ""]
                .iter()
                .map(|p| format!("{p}h.{layer}.mlp."))
                .collect(),
            _ => ["model.", ""]
                .iter()
                .map(|p| format!("{p}layers.{layer}.mlp."))
                .collect(),
        };
        let scheme = self.scheme();
        candidates
            .iter()
            .find(|prefix| self.files.keys().any(|key| scheme.owns(key, prefix)))
            .cloned()
            .ok_or_else(|| Error::MissingTensor {
                key: format!("{}…", candidates[0]),
                hint: format!(" (no {} FFN weights for layer {layer})", scheme.name()),
            })
    }

    /// Builds the FFN of `config.json` on `device` and loads layer `layer`'s weights into it.
    pub fn load_layer(&mut self, layer: usize, device: &Device) -> Result<FeedForward, Error> {
        let config = self.ffn_config()?;
        let prefix = self.layer_prefix(layer)?;
        let scheme = self.scheme();
        config
            .try_init(device)?
            .load_from(&mut self.files, scheme, &prefix)
    }

    /// Every tensor of the model: key, dtype, shape.
    pub fn tensors(&self) -> Vec<(String, String, Vec<usize>)> {
        self.files.list()
    }
}
