//! # Presets
//!
//! The eight feed-forward layers compared by Shazeer, "GLU Variants Improve Transformer"
//! (2020), and the configurations of three reference implementations.
//!
//! Shazeer keeps the parameter count fixed across variants: an ungated layer has two
//! `d_model × d_ff` matrices, a gated one three, so gated variants shrink `d_ff` by 2/3:
//!
//! ```text
//! ungated: d_ff = 4 · d_model             params = 2 · d_model · d_ff = 8 · d_model²
//! gated:   d_ff = round(2/3 · 4 · d_model) params = 3 · d_model · d_ff ≈ 8 · d_model²
//! ```
//!
//! (`d_model = 768`: 3072 and 2048, the paper's sizes.) LLaMA further rounds the gated `d_ff`
//! up to a multiple of 256 or so, to keep matrix shapes friendly to the hardware:
//! [`FeedForwardConfig::preset_multiple_of`]. As in the paper, the presets have no biases and no
//! dropout.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::{Activation, ConfigError, DropoutAt, FeedForwardConfig};

/// A feed-forward variant of Shazeer (2020), Table 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Variant {
    /// `FFN_ReLU(x) = max(0, xW₁) W₂`: the original Transformer's layer.
    FfnRelu,
    /// `FFN_GELU(x) = GELU(xW₁) W₂`.
    FfnGelu,
    /// `FFN_Swish(x) = Swish₁(xW₁) W₂`.
    FfnSwish,
    /// `FFN_GLU(x) = (σ(xW) ⊗ xV) W₂` (Dauphin et al. 2017).
    Glu,
    /// `FFN_Bilinear(x) = (xW ⊗ xV) W₂`.
    Bilinear,
    /// `FFN_ReGLU(x) = (max(0, xW) ⊗ xV) W₂`.
    ReGlu,
    /// `FFN_GEGLU(x) = (GELU(xW) ⊗ xV) W₂`.
    GeGlu,
    /// `FFN_SwiGLU(x) = (Swish₁(xW) ⊗ xV) W₂`: PaLM's and LLaMA's layer.
    SwiGlu,
}

impl Variant {
    /// All eight, in the paper's order.
    pub const ALL: [Variant; 8] = [
        Variant::FfnRelu,
        Variant::FfnGelu,
        Variant::FfnSwish,
        Variant::Glu,
        Variant::Bilinear,
        Variant::ReGlu,
        Variant::GeGlu,
        Variant::SwiGlu,
    ];

    /// The paper's name (`FFN_ReLU`, …, `FFN_SwiGLU`).
    pub const fn name(self) -> &'static str {
        match self {
            Variant::FfnRelu => "FFN_ReLU",
            Variant::FfnGelu => "FFN_GELU",
            Variant::FfnSwish => "FFN_Swish",
            Variant::Glu => "FFN_GLU",
            Variant::Bilinear => "FFN_Bilinear",
            Variant::ReGlu => "FFN_ReGLU",
            Variant::GeGlu => "FFN_GEGLU",
            Variant::SwiGlu => "FFN_SwiGLU",
        }
    }

    /// The activation `φ` (applied to the gate when gated). Shazeer's Swish has β = 1: SiLU.
    pub const fn activation(self) -> Activation {
        match self {
            Variant::FfnRelu | Variant::ReGlu => Activation::Relu,
            Variant::FfnGelu | Variant::GeGlu => Activation::Gelu,
            Variant::FfnSwish | Variant::SwiGlu => Activation::Silu,
            Variant::Glu => Activation::Sigmoid,
            Variant::Bilinear => Activation::Identity,
        }
    }

    /// Whether the variant is gated.
    pub const fn gated(self) -> bool {
        !matches!(
            self,
            Variant::FfnRelu | Variant::FfnGelu | Variant::FfnSwish
        )
    }

    /// The hidden width at parameter parity with an ungated `d_ff = 4 · d_model`:
    /// `4 · d_model` ungated, `round(8 · d_model / 3)` gated.
    pub const fn d_ff(self, d_model: usize) -> usize {
        // Saturating: an absurd `d_model` gives an absurd `d_ff`, which `validate` refuses,
        // rather than a wrapped small one.
        if self.gated() {
            d_model.saturating_mul(8).saturating_add(1) / 3
        } else {
            d_model.saturating_mul(4)
        }
    }
}

impl fmt::Display for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Variant {
    type Err = ConfigError;

    /// Parses the paper's names, ignoring case, `-` versus `_`, and the `FFN_` prefix:
    /// `FFN_SwiGLU`, `swiglu` and `ffn-swiglu` are the same variant.
    fn from_str(name: &str) -> Result<Self, ConfigError> {
        let normal = |s: &str| {
            let s = crate::normal_name(s);
            s.strip_prefix("ffn_").map(str::to_string).unwrap_or(s)
        };
        let wanted = normal(name);
        Self::ALL
            .into_iter()
            .find(|v| normal(v.name()) == wanted)
            .ok_or_else(|| ConfigError::UnknownPreset {
                name: name.to_string(),
                known: Self::ALL.map(Variant::name).join(", "),
            })
    }
}

impl Serialize for Variant {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for Variant {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = String::deserialize(deserializer)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}

impl FeedForwardConfig {
    /// A Shazeer (2020) variant at parameter parity (see [`Variant::d_ff`]); no biases, no
    /// dropout.
    ///
    /// ```
    /// use ffn_model::{FeedForwardConfig, Variant};
    ///
    /// let relu = FeedForwardConfig::preset(Variant::FfnRelu, 768);
    /// let swiglu = FeedForwardConfig::preset(Variant::SwiGlu, 768);
    /// assert_eq!((relu.d_ff, swiglu.d_ff), (3072, 2048));
    /// assert_eq!(relu.num_params(), swiglu.num_params());
    /// ```
    pub fn preset(variant: Variant, d_model: usize) -> Self {
        FeedForwardConfig::new(d_model, variant.d_ff(d_model))
            .with_activation(variant.activation())
            .with_gated(variant.gated())
    }

    /// [`preset`](Self::preset) with `d_ff` rounded up to a multiple of `multiple_of`, as
    /// LLaMA does (`d_model = 4096`, `multiple_of = 256`: `d_ff = 11008`).
    pub fn preset_multiple_of(
        variant: Variant,
        d_model: usize,
        multiple_of: usize,
    ) -> Result<Self, ConfigError> {
        if multiple_of == 0 {
            return Err(ConfigError::ZeroSize {
                field: "multiple_of",
            });
        }
        let mut config = Self::preset(variant, d_model);
        config.d_ff = config
            .d_ff
            .div_ceil(multiple_of)
            .saturating_mul(multiple_of);
        Ok(config)
    }

    /// BERT's layer (Devlin et al. 2019; `BertIntermediate` + `BertOutput`): exact GELU,
    /// `d_ff = 4 · d_model`, biases on both projections, dropout 0.1 on the output.
    pub fn bert(d_model: usize) -> Self {
        FeedForwardConfig::new(d_model, 4 * d_model)
            .with_activation(Activation::Gelu)
            .with_bias_up(true)
            .with_bias_down(true)
            .with_dropout(0.1)
            .with_dropout_at(DropoutAt::Output)
    }

    /// "Attention Is All You Need" (Vaswani et al. 2017, §3.3 and §5.4):
    /// `FFN(x) = max(0, xW₁ + b₁) W₂ + b₂` with `d_ff = 4 · d_model` (512 → 2048) and residual
    /// dropout 0.1 on the sub-layer's output.
    pub fn vaswani(d_model: usize) -> Self {
        FeedForwardConfig::new(d_model, 4 * d_model)
            .with_activation(Activation::Relu)
            .with_bias_up(true)
            .with_bias_down(true)
            .with_dropout(0.1)
            .with_dropout_at(DropoutAt::Output)
    }

    /// The defaults of labml's annotated `FeedForward(d_model, d_ff)`: ReLU, ungated, biases
    /// on both projections, dropout 0.1 on the hidden layer.
    pub fn labml(d_model: usize, d_ff: usize) -> Self {
        FeedForwardConfig::new(d_model, d_ff)
            .with_activation(Activation::Relu)
            .with_bias_up(true)
            .with_bias_down(true)
            .with_dropout(0.1)
            .with_dropout_at(DropoutAt::Hidden)
    }
}
