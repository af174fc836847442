//! # Run configuration
//!
//! A run is described by one TOML file (see `configs/`): the seed, the `[task]` (what data, with
//! which known optimum), the `[model]` (which network, with which FFN) and the `[train]`
//! settings (optimiser, schedule, evaluation and checkpoints). Every key has a default but the
//! task and model kinds, a misspelt key is an error, and `--set key=value` overrides any key
//! from the command line (`--set train.steps=500 --set model.ffn.preset=GEGLU`).

use std::path::{Path, PathBuf};

use burn::nn::Initializer;
use burn::tensor::Device;
use ffn_model::{Activation, DropoutAt, FeedForwardConfig, Memory, Precision, Variant};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

pub mod memory;
mod overrides;
mod validate;

pub use overrides::apply_override;
pub(crate) use overrides::{from_table, toml_error};

/// Everything a run needs, as read from its TOML file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// The seed of every random stream of the run (see [`crate::rng`]).
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// The data and its known optimum.
    pub task: TaskConfig,
    /// The network trained on it.
    pub model: ModelConfig,
    /// Optimiser, schedule, evaluation and checkpoints.
    #[serde(default)]
    pub train: TrainSettings,
}

fn default_seed() -> u64 {
    1
}

/// The task: where batches come from, and the best loss any model can reach on them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TaskConfig {
    /// Language modelling on a random sparse order-k Markov chain (exact entropy rate).
    Markov(MarkovConfig),
    /// Language modelling on a text file the user points at (no known optimum).
    Text(TextConfig),
    /// Regression on a frozen random teacher FFN plus Gaussian noise (optimal MSE = σ²).
    Teacher(TeacherConfig),
    /// Regression on a smooth multi-output map `y = sin(A x + b)` plus noise (optimal MSE = σ²).
    Sine(SineConfig),
}

/// See [`crate::data::MarkovSource`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MarkovConfig {
    /// Number of symbols `V` (at most 62: they print as `a`–`z`, `A`–`Z`, `0`–`9`).
    pub vocab_size: usize,
    /// Order `k`: the next symbol depends on the last `k`.
    pub order: usize,
    /// Symbols with large probability after each context.
    pub support: usize,
    /// Probability mass spread uniformly over all symbols, keeping the chain ergodic.
    pub smoothing: f64,
    /// Tokens per training sequence.
    pub seq_len: usize,
}

impl Default for MarkovConfig {
    fn default() -> Self {
        Self {
            vocab_size: 16,
            order: 2,
            support: 3,
            smoothing: 0.02,
            seq_len: 64,
        }
    }
}

/// Tokenisation of a text file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[serde(rename_all = "snake_case")]
pub enum TextLevel {
    /// One token per byte (256 symbols): any file.
    #[default]
    Byte,
    /// One token per Unicode character present in the file: UTF-8 files only.
    Char,
}

/// See [`crate::data::TextCorpus`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TextConfig {
    /// The file.
    pub path: PathBuf,
    /// Bytes or characters.
    #[serde(default)]
    pub level: TextLevel,
    /// The last part of the file held out for validation.
    #[serde(default = "default_valid_fraction")]
    pub valid_fraction: f64,
    /// Tokens per training sequence.
    #[serde(default = "default_seq_len")]
    pub seq_len: usize,
}

fn default_valid_fraction() -> f64 {
    0.1
}

impl Default for TextConfig {
    /// No file (`path` empty: set it), bytes, the defaults of a TOML `[task]` table.
    fn default() -> Self {
        Self {
            path: PathBuf::new(),
            level: TextLevel::default(),
            valid_fraction: default_valid_fraction(),
            seq_len: default_seq_len(),
        }
    }
}

fn default_seq_len() -> usize {
    64
}

/// See [`crate::data::Regression`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TeacherConfig {
    /// Standard deviation σ of the label noise.
    pub noise: f64,
    /// The teacher's FFN (default: the student's), at the student's `d_model`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub teacher: Option<FfnSpec>,
    /// Scale of the teacher's weights: `N(0, gain²/fan_in)`, so outputs are of order one.
    pub teacher_gain: f64,
}

impl Default for TeacherConfig {
    fn default() -> Self {
        Self {
            noise: 0.2,
            teacher: None,
            teacher_gain: 1.0,
        }
    }
}

/// See [`crate::data::Regression`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SineConfig {
    /// Standard deviation σ of the label noise.
    pub noise: f64,
    /// Scale of `A`: the map's frequency.
    pub frequency: f64,
}

impl Default for SineConfig {
    fn default() -> Self {
        Self {
            noise: 0.2,
            frequency: 1.0,
        }
    }
}

/// The network.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ModelConfig {
    /// A decoder-only transformer (language tasks).
    Transformer(TransformerConfig),
    /// An FFN over a fixed window of previous tokens (language tasks).
    Window(WindowConfig),
    /// A bare FFN, `d_model → d_model` (regression tasks).
    Ffn(FfnModelConfig),
}

/// See [`crate::model::TransformerLm`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TransformerConfig {
    /// Residual width.
    pub d_model: usize,
    /// Blocks.
    pub n_layers: usize,
    /// Attention heads per block.
    pub n_heads: usize,
    /// Dropout on the attention weights.
    pub attention_dropout: f64,
    /// The FFN of every block.
    pub ffn: FfnSpec,
}

impl Default for TransformerConfig {
    fn default() -> Self {
        Self {
            d_model: 64,
            n_layers: 2,
            n_heads: 4,
            attention_dropout: 0.0,
            ffn: FfnSpec::default(),
        }
    }
}

/// See [`crate::model::WindowLm`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WindowConfig {
    /// Previous tokens seen (including the current one).
    pub window: usize,
    /// Embedding width per token.
    pub d_embed: usize,
    /// Width of the FFN's input and output.
    pub d_model: usize,
    /// The FFN.
    pub ffn: FfnSpec,
}

impl Default for WindowConfig {
    fn default() -> Self {
        Self {
            window: 4,
            d_embed: 16,
            d_model: 64,
            ffn: FfnSpec::default(),
        }
    }
}

/// A bare FFN for regression.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FfnModelConfig {
    /// Input and output width.
    pub d_model: usize,
    /// The FFN.
    pub ffn: FfnSpec,
}

impl Default for FfnModelConfig {
    fn default() -> Self {
        Self {
            d_model: 16,
            ffn: FfnSpec::default(),
        }
    }
}

/// An FFN given relative to the `d_model` of the model that holds it: a preset, and/or explicit
/// fields of [`FeedForwardConfig`] that override it.
///
/// ```toml
/// ffn = { preset = "SwiGLU" }                          # d_ff = round(8/3 · d_model)
/// ffn = { preset = "SwiGLU", multiple_of = 64 }        # rounded up, LLaMA style
/// ffn = { d_ff = 256, activation = "gelu_new", bias = true, dropout = 0.1 }
/// ```
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FfnSpec {
    /// A Shazeer (2020) variant at parameter parity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preset: Option<Variant>,
    /// Round `d_ff` up to a multiple of this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub multiple_of: Option<usize>,
    /// Hidden width (default: the preset's, else `4 · d_model`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub d_ff: Option<usize>,
    /// Activation (default: the preset's, else GELU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activation: Option<Activation>,
    /// Gating (default: the preset's, else off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gated: Option<bool>,
    /// Compute `gate` and `up` as one fused `d_model → 2·d_ff` product (default off; gated only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fused_gate_up: Option<bool>,
    /// Biases on every projection there is (default off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bias: Option<bool>,
    /// Bias of `up` (overrides `bias`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bias_up: Option<bool>,
    /// Bias of `gate` (overrides `bias`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bias_gate: Option<bool>,
    /// Bias of `down` (overrides `bias`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bias_down: Option<bool>,
    /// Dropout probability (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dropout: Option<f64>,
    /// Where dropout applies (default: the hidden layer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dropout_at: Option<DropoutAt>,
    /// Weight initialisation (default: PyTorch's `nn.Linear`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initializer: Option<Initializer>,
    /// What the backward pass keeps: `"save"` (default) or `"recompute"` (less memory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<Memory>,
    /// A sparse mixture of experts in place of the FFN: the fields of a
    /// [`MoeConfig`](ffn_model::MoeConfig) but `expert`, which is the FFN this table describes
    /// (`moe = { n_experts = 8, top_k = 2 }`, or any other field: `capacity_factor`,
    /// `n_shared_experts`, `scoring`, `load_balancing_coef` …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<serde_json::Value>,
}

impl FfnSpec {
    /// The spec of a preset.
    pub fn preset(variant: Variant) -> Self {
        Self {
            preset: Some(variant),
            ..Self::default()
        }
    }

    /// The [`FeedForwardConfig`] this spec means at `d_model`; `context` names the table in
    /// errors (`model.ffn`).
    pub fn resolve(&self, d_model: usize, context: &str) -> Result<FeedForwardConfig> {
        let ffn_error = |source| Error::Ffn {
            context: context.to_string(),
            source,
        };
        let mut config = match self.preset {
            Some(variant) => FeedForwardConfig::preset(variant, d_model),
            None => FeedForwardConfig::new(d_model, d_model.saturating_mul(4)),
        };
        match (self.d_ff, self.multiple_of) {
            (Some(_), Some(_)) => {
                return Err(Error::Config(format!(
                    "{context}: give `d_ff` or `multiple_of`, not both"
                )));
            }
            (Some(d_ff), None) => config.d_ff = d_ff,
            (None, Some(0)) => {
                return Err(ffn_error(ffn_model::ConfigError::ZeroSize {
                    field: "multiple_of",
                }));
            }
            (None, Some(multiple)) => {
                config.d_ff = config.d_ff.div_ceil(multiple).saturating_mul(multiple);
            }
            (None, None) => {}
        }
        if let Some(activation) = self.activation {
            config.activation = activation;
        }
        if let Some(gated) = self.gated {
            config.gated = gated;
        }
        config.fused_gate_up = self.fused_gate_up.unwrap_or(config.fused_gate_up);
        if let Some(bias) = self.bias {
            config.bias_up = bias;
            config.bias_gate = bias && config.gated;
            config.bias_down = bias;
        }
        config.bias_up = self.bias_up.unwrap_or(config.bias_up);
        config.bias_gate = self.bias_gate.unwrap_or(config.bias_gate);
        config.bias_down = self.bias_down.unwrap_or(config.bias_down);
        config.dropout = self.dropout.unwrap_or(config.dropout);
        config.dropout_at = self.dropout_at.unwrap_or(config.dropout_at);
        config.memory = self.memory.unwrap_or(config.memory);
        if let Some(initializer) = &self.initializer {
            config.initializer = initializer.clone();
        }
        config.validate().map_err(ffn_error)?;
        Ok(config)
    }
}

/// Optimiser, schedule, evaluation and checkpoints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainSettings {
    /// Optimiser steps.
    pub steps: usize,
    /// Sequences (language) or samples (regression) per step.
    pub batch_size: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Learning rate at the end of the cosine decay.
    pub min_lr: f64,
    /// Steps of linear warm-up from 0 to `lr` (cut short if `steps` is smaller).
    pub warmup_steps: usize,
    /// AdamW's decoupled weight decay.
    pub weight_decay: f64,
    /// AdamW's β₁.
    pub beta1: f64,
    /// AdamW's β₂.
    pub beta2: f64,
    /// Clip the global gradient norm to this (0: no clipping).
    pub grad_clip: f64,
    /// Evaluate every this many steps (and at the last).
    pub eval_every: usize,
    /// Validation batches per evaluation.
    pub eval_batches: usize,
    /// Record the training loss every this many steps.
    pub log_every: usize,
    /// Write a checkpoint every this many steps (and at the last).
    pub checkpoint_every: usize,
    /// Checkpoints kept: older ones are deleted.
    pub keep_checkpoints: usize,
    /// burn's gradient checkpointing: recompute memory-bound activations (the FFN's `φ`, …)
    /// in the backward pass instead of keeping them, for less memory at some compute.
    pub gradient_checkpointing: bool,
    /// Data parallelism on a CPU: each batch is cut into this many shards whose forward and
    /// backward passes run at once on rayon's threads, and their gradients are summed (the
    /// batch's mean gradient, up to the order of float additions). 0: one shard per rayon
    /// thread on a CPU device, 1 on a GPU. With dropout each shard draws the FFNs' masks from
    /// its own seeded stream; with attention dropout (burn's, from the device's one random
    /// stream) the shards' forward passes run one after another, in shard order, and only their
    /// backward passes at once: either way a run stays reproducible.
    pub shards: usize,
    /// The number format of the model's matrix products: `"f32"` (default) or `"bf16"` (bf16
    /// operands, f32 sums: [`ffn_model::Precision`]). Parameters, gradients and AdamW's state
    /// stay f32. It applies to the FFNs, dense or a mixture's experts (the teacher of a
    /// teacher-student task excepted; a mixture's router stays f32), to attention's
    /// projections and products and to the head; softmax, norms and the loss compute in f32.
    pub precision: Precision,
}

impl TrainSettings {
    /// `device` as training uses it: with gradient checkpointing when configured.
    pub fn device(&self, device: &Device) -> Device {
        if self.gradient_checkpointing && device.is_autodiff() {
            device.clone().gradient_checkpointing()
        } else {
            device.clone()
        }
    }
}

impl Default for TrainSettings {
    fn default() -> Self {
        Self {
            steps: 1000,
            batch_size: 32,
            lr: 3e-3,
            min_lr: 3e-4,
            warmup_steps: 50,
            weight_decay: 0.01,
            beta1: 0.9,
            beta2: 0.99,
            grad_clip: 1.0,
            eval_every: 100,
            eval_batches: 8,
            log_every: 10,
            checkpoint_every: 250,
            keep_checkpoints: 3,
            gradient_checkpointing: false,
            shards: 0,
            precision: Precision::F32,
        }
    }
}

impl TrainConfig {
    /// Reads a TOML config file and applies `--set key=value` overrides.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Self> {
        Self::load_with(path, None, overrides)
    }

    /// [`load`](Self::load), with the file's `[task]` replaced by `task` if given (before the
    /// overrides, which may then refine it: `--text FILE --set task.seq_len=32`).
    pub fn load_with(path: &Path, task: Option<TaskConfig>, overrides: &[String]) -> Result<Self> {
        let text = ffn_model::files::read_text(path, ffn_model::files::MAX_CONFIG_FILE)
            .map_err(Error::io(path))?;
        Self::from_toml_with(&text, task, overrides)
            .map_err(|e| Error::Config(format!("{}: {e}", path.display())))
    }

    /// Parses TOML, applies overrides, validates.
    pub fn from_toml(text: &str, overrides: &[String]) -> Result<Self> {
        Self::from_toml_with(text, None, overrides)
    }

    /// [`from_toml`](Self::from_toml), with the `[task]` replaced by `task` if given.
    pub fn from_toml_with(
        text: &str,
        task: Option<TaskConfig>,
        overrides: &[String],
    ) -> Result<Self> {
        let mut table: toml::Table =
            toml::from_str(text).map_err(|e| Error::Config(toml_error(text, &e)))?;
        if let Some(task) = task {
            let value = toml::Value::try_from(task)
                .map_err(|e| Error::Config(format!("the task cannot be written as TOML: {e}")))?;
            table.insert("task".into(), value);
        }
        for assignment in overrides {
            apply_override(&mut table, assignment)?;
        }
        let config = from_table::<Self>(table)?;
        config.validate()?;
        Ok(config)
    }

    /// The config as TOML, every default written out.
    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("a TrainConfig is representable in TOML")
    }

    /// The model's FFN, resolved.
    pub fn ffn(&self) -> Result<FeedForwardConfig> {
        let (spec, d_model) = match &self.model {
            ModelConfig::Transformer(m) => (&m.ffn, m.d_model),
            ModelConfig::Window(m) => (&m.ffn, m.d_model),
            ModelConfig::Ffn(m) => (&m.ffn, m.d_model),
        };
        let config = spec.resolve(d_model, "model.ffn")?;
        Ok(config.with_precision(self.train.precision))
    }

    /// The sparse mixture of experts of `model.ffn.moe`, its experts the resolved FFN
    /// ([`ffn`](Self::ffn)); `None` for a dense FFN.
    pub fn moe(&self) -> Result<Option<ffn_model::MoeConfig>> {
        let spec = match &self.model {
            ModelConfig::Transformer(m) => &m.ffn,
            ModelConfig::Window(m) => &m.ffn,
            ModelConfig::Ffn(m) => &m.ffn,
        };
        let Some(moe) = &spec.moe else {
            return Ok(None);
        };
        let fail = |message: String| {
            Err(Error::Ffn {
                context: "model.ffn.moe".into(),
                source: ffn_model::ConfigError::Parse {
                    format: "TOML",
                    message,
                },
            })
        };
        let Some(table) = moe.as_object() else {
            return fail("must be a table of MoeConfig fields".into());
        };
        if table.contains_key("expert") {
            return fail(
                "`expert` is not a field here: the experts are the FFN of `model.ffn`".into(),
            );
        }
        let mut table = table.clone();
        let expert = serde_json::to_value(self.ffn()?).expect("a FeedForwardConfig serialises");
        table.insert("expert".into(), expert);
        ffn_model::MoeConfig::from_json(&serde_json::Value::Object(table).to_string())
            .map(Some)
            .map_err(|source| Error::Ffn {
                context: "model.ffn.moe".into(),
                source,
            })
    }

    /// The model's FFN parameters, every layer's: `(total, active)`, where `active` are those
    /// a token uses (a mixture's `top_k` routed experts, its router and shared experts; all of
    /// a dense FFN's).
    pub fn ffn_params(&self) -> Result<(usize, usize)> {
        let layers = match &self.model {
            ModelConfig::Transformer(m) => m.n_layers,
            _ => 1,
        };
        let (total, active) = match self.moe()? {
            Some(moe) => (moe.num_params(), moe.active_params()),
            None => {
                let n = self.ffn()?.num_params();
                (n, n)
            }
        };
        Ok((total.saturating_mul(layers), active.saturating_mul(layers)))
    }

    /// Whether training draws random numbers in the forward pass (any dropout).
    pub fn uses_dropout(&self) -> bool {
        let attention = match &self.model {
            ModelConfig::Transformer(m) => m.attention_dropout > 0.0,
            _ => false,
        };
        attention || self.ffn().is_ok_and(|f| f.dropout > 0.0)
    }
}

/// The symbols a Markov chain's tokens print as.
pub const MARKOV_ALPHABET: &str = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";

/// The largest size or count a config accepts for a dimension, a batch or a sequence
/// (2²⁴); the memory estimate then judges the whole.
pub const MAX_SIZE: usize = ffn_model::MAX_DIM;

/// `vocab_size^order`, the Markov source's contexts, when at most 2²⁰.
pub(crate) fn markov_contexts(vocab_size: usize, order: usize) -> Option<usize> {
    let contexts = vocab_size.checked_pow(u32::try_from(order).ok()?)?;
    (contexts <= 1 << 20).then_some(contexts)
}
