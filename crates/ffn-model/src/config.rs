//! # The configuration
//!
//! [`FeedForwardConfig`] is plain serde data: every field but `d_model` and `d_ff` has a default,
//! so a TOML file can be as short as
//!
//! ```toml
//! d_model = 512
//! d_ff = 1365
//! activation = "silu"
//! gated = true
//! ```
//!
//! and a misspelt key is an error rather than silently ignored.

use burn::nn::Initializer;
use serde::{Deserialize, Serialize};

use crate::{Activation, ConfigError, Memory, Precision};

/// Where dropout is applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DropoutAt {
    /// On the hidden activations `h`, before the down projection (labml, the Annotated
    /// Transformer, T5).
    #[default]
    Hidden,
    /// On the output `y` (BERT's `BertOutput`; the Transformer's residual dropout).
    Output,
}

/// The configuration of a [`FeedForward`](crate::FeedForward) network.
///
/// Ungated: `y = down(φ(up(x)))`. Gated: `y = down(φ(gate(x)) ⊙ up(x))`, the LLaMA/T5
/// convention: the activated projection is `gate`, its linear partner `up`.
///
/// Defaults: GELU (exact), ungated, no biases, no dropout (at the hidden layer when set), and
/// PyTorch's `nn.Linear` initialisation `U(-1/√fan_in, 1/√fan_in)`.
///
/// ```
/// use ffn_model::{Activation, FeedForwardConfig};
///
/// let config = FeedForwardConfig::new(512, 1365)
///     .with_activation(Activation::Silu)
///     .with_gated(true);
/// assert!(config.validate().is_ok());
/// assert_eq!(config.num_params(), 3 * 512 * 1365);
///
/// let toml = config.to_toml();
/// assert_eq!(FeedForwardConfig::from_toml(&toml).unwrap(), config);
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FeedForwardConfig {
    /// Width of the input and output, `d_model`.
    pub d_model: usize,
    /// Width of the hidden layer, `d_ff`.
    pub d_ff: usize,
    /// The nonlinearity `φ`.
    #[serde(default = "default_activation")]
    pub activation: Activation,
    /// Gate the hidden layer: `h = φ(gate(x)) ⊙ up(x)` (Shazeer 2020).
    #[serde(default)]
    pub gated: bool,
    /// Hold `W_gate` and `W_up` of a gated network as one `d_model → 2·d_ff` projection
    /// `[W_gate | W_up]` and compute both with one matrix product (the xformers `w12` / vLLM
    /// `gate_up_proj` layout). The function, the parameter count and the safetensors files are
    /// those of the unfused network; only the memory layout and the kernels differ. Needs
    /// `gated` and `bias_gate == bias_up`. Off by default: on Flex it has not run faster than
    /// the unfused network (BENCHMARKS.md has the figures).
    #[serde(default)]
    pub fused_gate_up: bool,
    /// Bias on the `up` projection.
    #[serde(default)]
    pub bias_up: bool,
    /// Bias on the `gate` projection (gated networks only).
    #[serde(default)]
    pub bias_gate: bool,
    /// Bias on the `down` projection.
    #[serde(default)]
    pub bias_down: bool,
    /// Dropout probability, in `[0, 1)`. Applied only while training on an autodiff device.
    #[serde(default)]
    pub dropout: f64,
    /// Where dropout is applied.
    #[serde(default)]
    pub dropout_at: DropoutAt,
    /// Initialisation of every weight and bias (burn's [`Initializer`]).
    #[serde(default = "default_initializer")]
    pub initializer: Initializer,
    /// What training keeps for the backward pass: `"save"` (the default) keeps the hidden
    /// activations, `"recompute"` recomputes them in the backward pass from the
    /// pre-activations (less memory, one element-wise pass more). Results are identical.
    #[serde(default)]
    pub memory: Memory,
    /// The number format of the matrix products: `"f32"` (the default) or `"bf16"` (bf16
    /// operands, f32 sums; everything else f32: see [`Precision`]).
    #[serde(default)]
    pub precision: Precision,
}

fn default_activation() -> Activation {
    Activation::Gelu
}

/// PyTorch's `nn.Linear` default: Kaiming-uniform with gain `1/√3`, i.e. `U(-1/√fan_in, 1/√fan_in)`
/// for weights and biases alike.
/// The largest `d_model` or `d_ff` a config accepts (2²⁴ = 16,777,216; the largest FFNs in use
/// are below 2¹⁸).
pub const MAX_DIM: usize = 1 << 24;

/// The most elements one weight matrix may have, `d_model · d_ff ≤ 2³³` (32 GiB of `f32`).
pub const MAX_MATRIX: usize = 1 << 33;

/// Checks that `initializer` describes a distribution burn can draw from, so that `init` cannot
/// panic on it: finite parameters, `min < max`, a standard deviation `≥ 0`, a gain `> 0`.
fn validate_initializer(initializer: &Initializer) -> Result<(), ConfigError> {
    let fail = |message: String| Err(ConfigError::Initializer(message));
    let finite = |name: &str, v: f64| {
        if v.is_finite() {
            Ok(())
        } else {
            fail(format!("{name} must be a finite number, got {v}"))
        }
    };
    let gain = |g: f64| {
        if g.is_finite() && g > 0.0 {
            Ok(())
        } else {
            fail(format!("gain must be a finite number > 0, got {g}"))
        }
    };
    match *initializer {
        Initializer::Constant { value } => finite("value", value),
        Initializer::Ones | Initializer::Zeros => Ok(()),
        Initializer::Uniform { min, max } => {
            finite("min", min)?;
            finite("max", max)?;
            if min < max {
                Ok(())
            } else {
                fail(format!("Uniform needs min < max, got min {min}, max {max}"))
            }
        }
        Initializer::Normal { mean, std } => {
            finite("mean", mean)?;
            if std.is_finite() && std >= 0.0 {
                Ok(())
            } else {
                fail(format!("Normal needs a finite std ≥ 0, got {std}"))
            }
        }
        Initializer::KaimingUniform { gain: g, .. }
        | Initializer::KaimingNormal { gain: g, .. }
        | Initializer::XavierUniform { gain: g }
        | Initializer::XavierNormal { gain: g }
        | Initializer::Orthogonal { gain: g } => gain(g),
    }
}

fn default_initializer() -> Initializer {
    Initializer::KaimingUniform {
        gain: 1.0 / 3f64.sqrt(),
        fan_out_only: false,
    }
}

impl burn::config::Config for FeedForwardConfig {}

impl FeedForwardConfig {
    /// An ungated GELU network without biases or dropout; adjust with the `with_*` methods.
    pub fn new(d_model: usize, d_ff: usize) -> Self {
        Self {
            d_model,
            d_ff,
            activation: default_activation(),
            gated: false,
            fused_gate_up: false,
            bias_up: false,
            bias_gate: false,
            bias_down: false,
            dropout: 0.0,
            dropout_at: DropoutAt::Hidden,
            initializer: default_initializer(),
            memory: Memory::Save,
            precision: Precision::F32,
        }
    }

    /// Sets the activation.
    pub fn with_activation(mut self, activation: Activation) -> Self {
        self.activation = activation;
        self
    }

    /// Sets the fused `[W_gate | W_up]` projection (see [`fused_gate_up`](Self::fused_gate_up)).
    pub fn with_fused_gate_up(mut self, fused: bool) -> Self {
        self.fused_gate_up = fused;
        self
    }

    /// Sets gating.
    pub fn with_gated(mut self, gated: bool) -> Self {
        self.gated = gated;
        self
    }

    /// Sets the bias of the `up` projection.
    pub fn with_bias_up(mut self, bias: bool) -> Self {
        self.bias_up = bias;
        self
    }

    /// Sets the bias of the `gate` projection.
    pub fn with_bias_gate(mut self, bias: bool) -> Self {
        self.bias_gate = bias;
        self
    }

    /// Sets the bias of the `down` projection.
    pub fn with_bias_down(mut self, bias: bool) -> Self {
        self.bias_down = bias;
        self
    }

    /// Sets the dropout probability.
    pub fn with_dropout(mut self, dropout: f64) -> Self {
        self.dropout = dropout;
        self
    }

    /// Sets where dropout is applied.
    pub fn with_dropout_at(mut self, dropout_at: DropoutAt) -> Self {
        self.dropout_at = dropout_at;
        self
    }

    /// Sets what the backward pass keeps (see [`memory`](Self::memory)).
    pub fn with_memory(mut self, memory: Memory) -> Self {
        self.memory = memory;
        self
    }

    /// Sets the number format of the matrix products (see [`precision`](Self::precision)).
    pub fn with_precision(mut self, precision: Precision) -> Self {
        self.precision = precision;
        self
    }

    /// Sets the initializer.
    pub fn with_initializer(mut self, initializer: Initializer) -> Self {
        self.initializer = initializer;
        self
    }

    /// Checks every field; the first problem found is returned.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.d_model == 0 {
            return Err(ConfigError::ZeroSize { field: "d_model" });
        }
        if self.d_ff == 0 {
            return Err(ConfigError::ZeroSize { field: "d_ff" });
        }
        for (field, value) in [("d_model", self.d_model), ("d_ff", self.d_ff)] {
            if value > MAX_DIM {
                return Err(ConfigError::TooLarge {
                    field,
                    value: value as u128,
                    max: MAX_DIM as u128,
                });
            }
        }
        let matrix = self.d_model as u128 * self.d_ff as u128;
        if matrix > MAX_MATRIX as u128 {
            return Err(ConfigError::TooLarge {
                field: "d_model · d_ff",
                value: matrix,
                max: MAX_MATRIX as u128,
            });
        }
        validate_initializer(&self.initializer)?;
        if !(self.dropout.is_finite() && (0.0..1.0).contains(&self.dropout)) {
            return Err(ConfigError::Dropout(self.dropout));
        }
        if self.bias_gate && !self.gated {
            return Err(ConfigError::GateBiasWithoutGating);
        }
        if self.fused_gate_up && !self.gated {
            return Err(ConfigError::FusedWithoutGating);
        }
        if self.fused_gate_up && self.bias_gate != self.bias_up {
            return Err(ConfigError::FusedBiasMismatch);
        }
        Ok(())
    }

    /// The number of projections: `up` and `down`, plus `gate` when gated.
    fn num_projections(&self) -> usize {
        if self.gated { 3 } else { 2 }
    }

    /// The number of trainable parameters:
    /// `(2 or 3) · d_model · d_ff` weights plus `d_ff` per bias on `up` and `gate` and
    /// `d_model` for a bias on `down`.
    pub fn num_params(&self) -> usize {
        // Saturating, so that an unvalidated config cannot wrap (a valid one never saturates).
        let weights = self
            .num_projections()
            .saturating_mul(self.d_model)
            .saturating_mul(self.d_ff);
        let biases = (usize::from(self.bias_up) + usize::from(self.bias_gate))
            .saturating_mul(self.d_ff)
            .saturating_add(usize::from(self.bias_down) * self.d_model);
        weights.saturating_add(biases)
    }

    /// Forward FLOPs per token of the matrix products, counting a multiply-add as 2:
    /// `2 · d_model · d_ff` per projection, so `4 · d_model · d_ff` ungated and
    /// `6 · d_model · d_ff` gated. Biases, `φ`, the gating product and dropout (`O(d_ff)` each)
    /// are not counted. A training step (forward and backward) costs three times this.
    pub fn flops_per_token(&self) -> u64 {
        (self.num_projections() as u64)
            .saturating_mul(self.d_model as u64)
            .saturating_mul(self.d_ff as u64)
            .saturating_mul(2)
    }

    /// Parses and validates a TOML config.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let config: Self = parse_toml(text, &["activation"])?;
        config.validate()?;
        Ok(config)
    }

    /// Parses and validates a JSON config.
    pub fn from_json(text: &str) -> Result<Self, ConfigError> {
        let config: Self = parse_json(text, &["activation"])?;
        config.validate()?;
        Ok(config)
    }

    /// The config as TOML, every field written out.
    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("a FeedForwardConfig is representable in TOML")
    }

    /// The config as pretty-printed JSON, every field written out.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a FeedForwardConfig is representable in JSON")
    }
}

/// Parses TOML text into `T`, the activation name at the key path `activation` checked first
/// (an unknown name is then its typed error, not serde's text).
pub(crate) fn parse_toml<T: serde::de::DeserializeOwned>(
    text: &str,
    activation: &[&str],
) -> Result<T, ConfigError> {
    let table: toml::Table = toml::from_str(text).map_err(|e| parse_error("TOML", e))?;
    let mut at = table.get(activation[0]);
    for key in &activation[1..] {
        at = at.and_then(|v| v.get(key));
    }
    check_activation(at.and_then(|v| v.as_str()))?;
    table.try_into().map_err(|e| parse_error("TOML", e))
}

/// [`parse_toml`] for JSON text.
pub(crate) fn parse_json<T: serde::de::DeserializeOwned>(
    text: &str,
    activation: &[&str],
) -> Result<T, ConfigError> {
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| parse_error("JSON", e))?;
    let at = activation.iter().try_fold(&value, |v, key| v.get(key));
    check_activation(at.and_then(|v| v.as_str()))?;
    serde_json::from_value(value).map_err(|e| parse_error("JSON", e))
}

/// Turns an unknown activation name into its typed error before serde turns it into text.
fn check_activation(name: Option<&str>) -> Result<(), ConfigError> {
    name.map_or(Ok(()), |name| name.parse::<Activation>().map(drop))
}

fn parse_error(format: &'static str, err: impl std::fmt::Display) -> ConfigError {
    ConfigError::Parse {
        format,
        message: err.to_string().trim().to_string(),
    }
}
