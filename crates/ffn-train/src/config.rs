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

    /// Checks every value ([`TaskConfig::validate`], [`ModelConfig::validate`],
    /// [`TrainSettings::validate`]), the pairing of task and model, and the FFNs.
    pub fn validate(&self) -> Result<()> {
        self.task.validate()?;
        self.model.validate()?;
        match (&self.model, self.task.is_language()) {
            (ModelConfig::Transformer(_) | ModelConfig::Window(_), true) => {}
            (ModelConfig::Ffn(_), false) => {}
            (_, true) => {
                return fail(
                    "a language task needs model.kind = \"transformer\" or \"window\"".to_string(),
                );
            }
            (_, false) => {
                return fail("a regression task needs model.kind = \"ffn\"".to_string());
            }
        }
        self.ffn()?;
        self.moe()?;
        if let (TaskConfig::Teacher(t), ModelConfig::Ffn(m)) = (&self.task, &self.model)
            && let Some(spec) = &t.teacher
        {
            spec.resolve(m.d_model, "task.teacher")?;
        }
        self.train.validate()
    }

    /// An estimate, in bytes, of the memory training this config takes: the parameters with
    /// their gradients and AdamW's two moments (4 copies), one step's activations, the
    /// validation batches and the Markov source's tables. It errs high for small models (each
    /// layer's activations counted generously) and is meant to refuse configs that cannot fit,
    /// not to plan to the byte. Saturating: it cannot overflow, whatever the config.
    pub fn memory_estimate(&self) -> u128 {
        self.memory_estimate_with(self.train.eval_batches)
    }

    /// [`memory_estimate`](Self::memory_estimate) with `eval_batches` validation batches.
    pub fn memory_estimate_with(&self, eval_batches: usize) -> u128 {
        let n = |v: usize| v as u128;
        let (d_ff, ffn_params) = self
            .ffn()
            .map_or((0, 0), |f| (n(f.d_ff), n(f.num_params())));
        // A mixture: every expert's parameters, and `top_k` experts' activations per token.
        let (d_ff, ffn_params) = match self.moe() {
            Ok(Some(moe)) => (d_ff.saturating_mul(n(moe.top_k)), n(moe.num_params())),
            _ => (d_ff, ffn_params),
        };
        let t = &self.train;
        let batch = n(t.batch_size);
        // f32 values per token of an FFN's step: four d_ff-wide ones; in bf16 the kept `h` is
        // bf16 (half of one of them).
        let ffn_values = match t.precision {
            Precision::F32 => d_ff.saturating_mul(4),
            Precision::Bf16 => d_ff.saturating_mul(7) / 2,
        };
        let (vocab, seq_len, source) = match &self.task {
            TaskConfig::Markov(m) => {
                let contexts = markov_contexts(m.vocab_size, m.order).map_or(u128::MAX, n);
                // probs, cdf (f64 per context and symbol), π and its cdf.
                let tables = contexts.saturating_mul(n(m.vocab_size) * 16 + 16);
                (n(m.vocab_size), n(m.seq_len), tables)
            }
            // Up to 256 bytes or distinct characters (the corpus itself is checked on loading).
            TaskConfig::Text(x) => (256, n(x.seq_len), 0),
            TaskConfig::Teacher(_) | TaskConfig::Sine(_) => (0, 1, 0),
        };
        // (parameters, f32 values kept per example of a step, f32 per validation example)
        let (params, per_example, per_valid) = match &self.model {
            ModelConfig::Transformer(m) => {
                let d = n(m.d_model);
                let layer = d
                    .saturating_mul(d)
                    .saturating_mul(4)
                    .saturating_add(ffn_params)
                    .saturating_add(d.saturating_mul(8));
                let params = n(m.n_layers)
                    .saturating_mul(layer)
                    .saturating_add(vocab.saturating_mul(d).saturating_mul(2))
                    .saturating_add(seq_len.saturating_mul(d));
                // Per token and layer: the block's d_model-wide tensors, the FFN's d_ff-wide
                // ones, and a row of attention scores per head; the logits on top.
                let per_token = n(m.n_layers)
                    .saturating_mul(
                        d.saturating_mul(20)
                            .saturating_add(ffn_values)
                            .saturating_add(n(m.n_heads).saturating_mul(seq_len).saturating_mul(2)),
                    )
                    .saturating_add(vocab.saturating_mul(4));
                (params, per_token.saturating_mul(seq_len), seq_len + 1)
            }
            ModelConfig::Window(m) => {
                let d = n(m.d_model);
                let embed = n(m.window).saturating_mul(n(m.d_embed));
                let params = vocab
                    .saturating_mul(n(m.d_embed))
                    .saturating_add(embed.saturating_mul(d))
                    .saturating_add(ffn_params)
                    .saturating_add(d.saturating_mul(vocab));
                let per_token = embed
                    .saturating_add(d.saturating_mul(4))
                    .saturating_add(ffn_values)
                    .saturating_add(vocab.saturating_mul(4));
                (params, per_token.saturating_mul(seq_len), seq_len + 1)
            }
            ModelConfig::Ffn(m) => {
                let d = n(m.d_model);
                let teacher = match &self.task {
                    TaskConfig::Teacher(x) => x
                        .teacher
                        .as_ref()
                        .and_then(|spec| spec.resolve(m.d_model, "task.teacher").ok())
                        .map_or(ffn_params, |f| n(f.num_params())),
                    _ => d.saturating_mul(d),
                };
                let per_example = d.saturating_mul(6).saturating_add(ffn_values);
                (
                    ffn_params.saturating_add(teacher),
                    per_example,
                    d.saturating_mul(2),
                )
            }
        };
        // In bf16 every weight matrix (the FFNs', attention's, the head's) also has a bf16 copy,
        // half an f32 each, during a step: counted over all parameters, erring high.
        let copies = match t.precision {
            Precision::F32 => 0,
            Precision::Bf16 => params / 2,
        };
        let f32s = params
            .saturating_mul(4)
            .saturating_add(copies)
            .saturating_add(batch.saturating_mul(per_example))
            .saturating_add(
                n(eval_batches)
                    .saturating_mul(batch)
                    .saturating_mul(per_valid),
            );
        f32s.saturating_mul(4).saturating_add(source)
    }

    /// Refuses a config whose [`memory_estimate_with`](Self::memory_estimate_with) exceeds
    /// the memory this machine has available (Linux's `MemAvailable`; elsewhere no check).
    pub fn check_memory(&self, eval_batches: usize) -> Result<()> {
        let need = self.memory_estimate_with(eval_batches);
        match available_memory() {
            Some(available) if need > u128::from(available) => Err(Error::Config(format!(
                "this config needs about {} of memory (estimate: parameters, gradients, \
                 optimiser state, one step's activations, validation data), more than the {} \
                 available; reduce the model, train.batch_size, the sequence length or \
                 train.eval_batches",
                bytes(need),
                bytes(u128::from(available))
            ))),
            _ => Ok(()),
        }
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

/// Memory available to a new process, in bytes (`MemAvailable` of `/proc/meminfo`).
fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

fn fail(message: String) -> Result<()> {
    Err(Error::Config(message))
}

/// A size: at least 1 and at most [`MAX_SIZE`] (the memory estimate decides combinations).
fn positive(name: &str, value: usize) -> Result<()> {
    if value == 0 {
        fail(format!("{name} must be at least 1"))
    } else if value > MAX_SIZE {
        fail(format!(
            "{name} = {value} is too large (at most {MAX_SIZE})"
        ))
    } else {
        Ok(())
    }
}

/// A count of steps: at least 1 (no memory depends on it).
fn count(name: &str, value: usize) -> Result<()> {
    if value == 0 {
        fail(format!("{name} must be at least 1"))
    } else {
        Ok(())
    }
}

/// A probability in `[0, 1)`.
fn probability(name: &str, value: f64) -> Result<()> {
    if value.is_finite() && (0.0..1.0).contains(&value) {
        Ok(())
    } else {
        fail(format!("{name} must be in [0, 1), got {value}"))
    }
}

/// A finite value `≥ 0`.
fn non_negative(name: &str, value: f64) -> Result<()> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        fail(format!("{name} must be ≥ 0, got {value}"))
    }
}

impl TaskConfig {
    /// Whether the best achievable loss is known exactly (every task but a text file).
    pub fn optimal_loss_known(&self) -> bool {
        !matches!(self, TaskConfig::Text(_))
    }

    /// Whether the task is language modelling (else regression).
    pub fn is_language(&self) -> bool {
        matches!(self, TaskConfig::Markov(_) | TaskConfig::Text(_))
    }

    /// Checks the task's values.
    pub fn validate(&self) -> Result<()> {
        match self {
            TaskConfig::Markov(m) => m.validate(),
            TaskConfig::Text(t) => t.validate(),
            TaskConfig::Teacher(t) => t.validate(),
            TaskConfig::Sine(s) => s.validate(),
        }
    }
}

impl MarkovConfig {
    /// Checks the chain's sizes, and that it is ergodic.
    pub fn validate(&self) -> Result<()> {
        let alphabet = MARKOV_ALPHABET.len();
        if !(2..=alphabet).contains(&self.vocab_size) {
            return fail(format!(
                "task.vocab_size must be in 2..={alphabet}, got {}",
                self.vocab_size
            ));
        }
        positive("task.order", self.order)?;
        if markov_contexts(self.vocab_size, self.order).is_none() {
            return fail(format!(
                "task.vocab_size^task.order = {}^{} contexts is too many (at most 2^20)",
                self.vocab_size, self.order
            ));
        }
        if !(1..=self.vocab_size).contains(&self.support) {
            return fail(format!(
                "task.support must be in 1..=vocab_size ({}), got {}",
                self.vocab_size, self.support
            ));
        }
        probability("task.smoothing", self.smoothing)?;
        if self.smoothing == 0.0 && self.support < self.vocab_size {
            return fail(
                "task.smoothing must be positive when support < vocab_size, so that the chain is ergodic"
                    .to_string(),
            );
        }
        positive("task.seq_len", self.seq_len)
    }
}

impl TextConfig {
    /// Checks the split and the sequence length (the file is checked when it is read).
    pub fn validate(&self) -> Result<()> {
        if !(self.valid_fraction > 0.0 && self.valid_fraction < 1.0) {
            return fail(format!(
                "task.valid_fraction must be in (0, 1), got {}",
                self.valid_fraction
            ));
        }
        positive("task.seq_len", self.seq_len)
    }
}

impl TeacherConfig {
    /// Checks the noise and the teacher's gain (its FFN is checked with the model's `d_model`).
    pub fn validate(&self) -> Result<()> {
        non_negative("task.noise", self.noise)?;
        if !(self.teacher_gain.is_finite() && self.teacher_gain > 0.0) {
            return fail(format!(
                "task.teacher_gain must be > 0, got {}",
                self.teacher_gain
            ));
        }
        Ok(())
    }
}

impl SineConfig {
    /// Checks the noise and the frequency.
    pub fn validate(&self) -> Result<()> {
        non_negative("task.noise", self.noise)?;
        non_negative("task.frequency", self.frequency)
    }
}

impl ModelConfig {
    /// Checks the network's sizes (its FFN is resolved by [`TrainConfig::ffn`]).
    pub fn validate(&self) -> Result<()> {
        match self {
            ModelConfig::Transformer(m) => {
                positive("model.d_model", m.d_model)?;
                positive("model.n_layers", m.n_layers)?;
                positive("model.n_heads", m.n_heads)?;
                if m.d_model % m.n_heads != 0 {
                    return fail(format!(
                        "model.d_model ({}) must be a multiple of model.n_heads ({})",
                        m.d_model, m.n_heads
                    ));
                }
                probability("model.attention_dropout", m.attention_dropout)
            }
            ModelConfig::Window(m) => {
                positive("model.window", m.window)?;
                positive("model.d_embed", m.d_embed)?;
                positive("model.d_model", m.d_model)
            }
            ModelConfig::Ffn(m) => positive("model.d_model", m.d_model),
        }
    }
}

impl TrainSettings {
    /// Checks the schedule, the optimiser's values and the sizes.
    pub fn validate(&self) -> Result<()> {
        count("train.steps", self.steps)?;
        positive("train.batch_size", self.batch_size)?;
        count("train.eval_every", self.eval_every)?;
        positive("train.eval_batches", self.eval_batches)?;
        count("train.log_every", self.log_every)?;
        count("train.checkpoint_every", self.checkpoint_every)?;
        count("train.keep_checkpoints", self.keep_checkpoints)?;
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return fail(format!("train.lr must be > 0, got {}", self.lr));
        }
        if !(self.min_lr.is_finite() && self.min_lr >= 0.0 && self.min_lr <= self.lr) {
            return fail(format!(
                "train.min_lr must be in [0, lr = {}], got {}",
                self.lr, self.min_lr
            ));
        }
        probability("train.beta1", self.beta1)?;
        probability("train.beta2", self.beta2)?;
        non_negative("train.weight_decay", self.weight_decay)?;
        non_negative("train.grad_clip", self.grad_clip)?;
        if self.shards > MAX_SIZE {
            return fail(format!(
                "train.shards = {} is too large (at most {MAX_SIZE})",
                self.shards
            ));
        }
        Ok(())
    }
}

/// Bytes as a person reads them: `3.2 GiB`.
pub fn bytes(b: u128) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut value = b as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < units.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{b} B")
    } else {
        format!("{value:.1} {}", units[unit])
    }
}

/// A TOML error on one line: `line L, column C: message` when it has a position in `text`.
pub(crate) fn toml_error(text: &str, e: &toml::de::Error) -> String {
    let message = e.message().trim().replace('\n', " ");
    match e.span() {
        Some(span) if span.start <= text.len() => {
            let before = &text[..span.start];
            let line = before.matches('\n').count() + 1;
            let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
            format!("line {line}, column {column}: {message}")
        }
        _ => message,
    }
}

/// A table (a config file with its `--set` overrides applied) as `T`. The table has lost the
/// file's positions, so an error names the key instead: `train.precision: unknown variant
/// \`fp8\`, expected one of \`f32\`, \`bf16\`, \`bfloat16\``.
pub(crate) fn from_table<T: serde::de::DeserializeOwned>(table: toml::Table) -> Result<T> {
    serde_path_to_error::deserialize(table).map_err(|e| {
        let path = e.path().to_string();
        let message = e.inner().message().trim().replace('\n', " ");
        Error::Config(if path == "." {
            message
        } else {
            format!("{path}: {message}")
        })
    })
}

/// Applies `a.b.c=value` to a TOML table. The value is read as TOML (`500`, `0.1`, `true`,
/// `"x"`, `{ preset = "GEGLU" }`) and otherwise taken as a string (`GEGLU`).
pub fn apply_override(table: &mut toml::Table, assignment: &str) -> Result<()> {
    let (key, value) = assignment
        .split_once('=')
        .ok_or_else(|| Error::Override(format!("`{assignment}`: expected key=value")))?;
    let (key, value) = (key.trim(), value.trim());
    let value: toml::Value = toml::from_str::<toml::Table>(&format!("v = {value}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(value.to_string()));
    let parts: Vec<&str> = key.split('.').collect();
    if parts.iter().any(|p| p.is_empty()) {
        return Err(Error::Override(format!(
            "`{assignment}`: empty key segment"
        )));
    }
    let (last, path) = parts.split_last().expect("split yields one part");
    let mut current = table;
    for (i, part) in path.iter().enumerate() {
        let entry = current
            .entry(part.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        current = entry.as_table_mut().ok_or_else(|| {
            Error::Override(format!(
                "`{assignment}`: `{}` is not a table",
                parts[..=i].join(".")
            ))
        })?;
    }
    current.insert(last.to_string(), value);
    Ok(())
}
