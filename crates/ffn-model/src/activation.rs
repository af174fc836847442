//! # Activations
//!
//! The nonlinearity `φ` of the feed-forward network, applied element-wise to the hidden
//! pre-activations. In a gated network (Shazeer 2020) it is applied to the `gate` projection
//! only, and the product with the linear `up` projection carries the rest:
//! `h = φ(x W_gate) ⊙ (x W_up)`. With `φ = σ` that is Dauphin et al.'s GLU, with the identity
//! the Bilinear layer, with ReLU, GELU and Swish the ReGLU, GEGLU and SwiGLU variants.
//!
//! One activation also changes the `up` side: OpenAI's clamped SwiGLU of gpt-oss,
//! [`Activation::SwigluOai`], computes `h = φ(g) ⊙ (clamp(u, −7, 7) + 1)`; every other
//! activation leaves `u` as it is ([`Activation::glu`]).
//!
//! Names follow PyTorch and Hugging Face `transformers`; the spellings `transformers` uses in
//! its `hidden_act` config key are accepted as aliases (see [`Activation::from_str`]).

use std::f64::consts::{FRAC_1_SQRT_2, FRAC_2_SQRT_PI};
use std::fmt;
use std::str::FromStr;

use burn::module::{
    Content, Devices, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper, ModuleVisitor,
    Param, ParamId,
};
use burn::tensor::{Device, Int, Tensor, TensorData, activation};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::ConfigError;

/// The element-wise activation function `φ`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Activation {
    /// `ReLU(x) = max(0, x)` (Nair & Hinton 2010); the original Transformer's choice.
    Relu,
    /// Exact GELU, `GELU(x) = x Φ(x) = x · ½ (1 + erf(x / √2))` (Hendrycks & Gimpel 2016);
    /// BERT's `gelu` and PyTorch's `nn.GELU()`.
    Gelu,
    /// The tanh approximation of GELU,
    /// `x · ½ (1 + tanh(√(2/π) (x + 0.044715 x³)))`; GPT-2's `gelu_new`, PyTorch's
    /// `nn.GELU(approximate="tanh")`, T5 v1.1's gated-gelu.
    GeluTanh,
    /// SiLU, or Swish with β = 1: `SiLU(x) = x σ(x)` (Ramachandran et al. 2017); LLaMA's choice.
    Silu,
    /// The logistic sigmoid `σ(x) = 1 / (1 + e⁻ˣ)`; gated, it is the original GLU.
    Sigmoid,
    /// The identity `φ(x) = x`; gated, it is the Bilinear layer, ungated a linear network.
    Identity,
    /// Squared ReLU, `ReLU(x)²` (So et al. 2021, Primer).
    Relu2,
    /// The hyperbolic tangent.
    Tanh,
    /// OpenAI's clamped SwiGLU (gpt-oss, 2025): with `g' = min(g, 7)`,
    /// `φ(g) = g' σ(1.702 g')`, a Swish with `β = 1.702` (GELU's sigmoid approximation) whose
    /// input is clipped from above; gated, the `up` side is clipped too and shifted by one,
    /// `h = φ(g) ⊙ (clamp(u, −7, 7) + 1)` (see [`Activation::glu`]). Ungated, `h = φ(a)`.
    /// The constants are [`Activation::OAI_ALPHA`] and [`Activation::OAI_LIMIT`], gpt-oss's
    /// `swiglu_alpha` and `swiglu_limit`.
    SwigluOai,
    /// GELU's sigmoid approximation, `x σ(1.702 x)` (Hendrycks & Gimpel 2016); CLIP's
    /// `quick_gelu`.
    QuickGelu,
}

impl Activation {
    /// `α` of [`Activation::SwigluOai`]: `φ(g) = g' σ(α g')`.
    pub const OAI_ALPHA: f64 = 1.702;
    /// The clip of [`Activation::SwigluOai`]: `g' = min(g, limit)`, `clamp(u, −limit, limit)`.
    pub const OAI_LIMIT: f64 = 7.0;
    /// `α` of [`Activation::QuickGelu`], `x σ(α x)`: 1.702, as CLIP has it.
    pub const QUICK_GELU_ALPHA: f64 = 1.702;

    /// Every activation, in the order of their persisted codes.
    pub const ALL: [Activation; 10] = [
        Activation::Relu,
        Activation::Gelu,
        Activation::GeluTanh,
        Activation::Silu,
        Activation::Sigmoid,
        Activation::Identity,
        Activation::Relu2,
        Activation::Tanh,
        Activation::SwigluOai,
        Activation::QuickGelu,
    ];

    /// Alternative spellings accepted when parsing, mostly `transformers`' `hidden_act` names,
    /// each with the activation it means.
    pub const ALIASES: [(&'static str, Activation); 15] = [
        ("gelu_exact", Activation::Gelu),
        ("gelu_python", Activation::Gelu),
        ("gelu_new", Activation::GeluTanh),
        ("gelu_fast", Activation::GeluTanh),
        ("gelu_accurate", Activation::GeluTanh),
        ("gelu_pytorch_tanh", Activation::GeluTanh),
        ("swish", Activation::Silu),
        ("linear", Activation::Identity),
        ("none", Activation::Identity),
        ("squared_relu", Activation::Relu2),
        ("relu_squared", Activation::Relu2),
        ("logistic", Activation::Sigmoid),
        ("swish1", Activation::Silu),
        ("swigluoai", Activation::SwigluOai),
        ("gpt_oss", Activation::SwigluOai),
    ];

    /// The canonical name, as written to configs and file metadata.
    pub const fn name(self) -> &'static str {
        match self {
            Activation::Relu => "relu",
            Activation::Gelu => "gelu",
            Activation::GeluTanh => "gelu_tanh",
            Activation::Silu => "silu",
            Activation::Sigmoid => "sigmoid",
            Activation::Identity => "identity",
            Activation::Relu2 => "relu2",
            Activation::Tanh => "tanh",
            Activation::SwigluOai => "swiglu_oai",
            Activation::QuickGelu => "quick_gelu",
        }
    }

    /// Every accepted spelling (canonical names, then aliases), comma separated.
    pub fn known_names() -> String {
        let canonical = Self::ALL.iter().map(|a| a.name());
        let aliases = Self::ALIASES.iter().map(|(alias, _)| *alias);
        canonical.chain(aliases).collect::<Vec<_>>().join(", ")
    }

    /// The stable code this activation is persisted as in burn records (its index in
    /// [`Activation::ALL`]).
    pub(crate) fn code(self) -> i64 {
        Self::ALL.iter().position(|a| *a == self).expect("in ALL") as i64
    }

    pub(crate) fn from_code(code: i64) -> Option<Self> {
        usize::try_from(code)
            .ok()
            .and_then(|i| Self::ALL.get(i).copied())
    }

    /// Applies `φ` element-wise.
    ///
    /// The two GELUs are written out from their definitions rather than taken from burn's
    /// `gelu` and `gelu_approximate`: burn's fused `gelu` op differentiates, on every backend
    /// but Flex (NdArray, wgpu, …), as if it were the tanh approximation (gradients off by up
    /// to 3e-4 relative), and both fused forms ran slower on Flex than these compositions
    /// (BENCHMARKS.md). Autodiff differentiates the compositions exactly.
    pub fn forward<const D: usize>(self, x: Tensor<D>) -> Tensor<D> {
        match self {
            Activation::Relu => activation::relu(x),
            // GELU(x) = x · ½ (1 + erf(x / √2)),   GELU'(x) = Φ(x) + x φ_N(x) (by autodiff)
            Activation::Gelu => {
                let cdf = (x.clone() * FRAC_1_SQRT_2).erf().add_scalar(1.0);
                x.mul_scalar(0.5) * cdf
            }
            // ½ x (1 + tanh(u)) = x σ(2u), with u = √(2/π) (x + 0.044715 x³), since
            // ½ (1 + tanh(u)) = σ(2u): one sigmoid instead of tanh, no cancellation.
            Activation::GeluTanh => {
                const TWO_SQRT_2_OVER_PI: f64 = 2.0 * FRAC_2_SQRT_PI * FRAC_1_SQRT_2;
                let two_u = (x.clone() * x.clone())
                    .mul_scalar(0.044715 * TWO_SQRT_2_OVER_PI)
                    .add_scalar(TWO_SQRT_2_OVER_PI)
                    * x.clone();
                x * activation::sigmoid(two_u)
            }
            Activation::Silu => activation::silu(x),
            Activation::Sigmoid => activation::sigmoid(x),
            Activation::Identity => x,
            Activation::Relu2 => {
                let r = activation::relu(x);
                r.clone() * r
            }
            Activation::Tanh => activation::tanh(x),
            // g' σ(α g'),  g' = min(g, limit)
            Activation::SwigluOai => {
                let clipped = x.clamp_max(Self::OAI_LIMIT);
                clipped.clone() * activation::sigmoid(clipped.mul_scalar(Self::OAI_ALPHA))
            }
            // x σ(1.702 x)
            Activation::QuickGelu => {
                x.clone() * activation::sigmoid(x.mul_scalar(Self::QUICK_GELU_ALPHA))
            }
        }
    }

    /// The `up` side of a gated unit, `ψ(u)`: `clamp(u, −7, 7) + 1` for
    /// [`Activation::SwigluOai`], `u` itself for every other activation.
    pub fn up<const D: usize>(self, u: Tensor<D>) -> Tensor<D> {
        match self {
            Activation::SwigluOai => u.clamp(-Self::OAI_LIMIT, Self::OAI_LIMIT).add_scalar(1.0),
            _ => u,
        }
    }

    /// The gated unit, `h = φ(g) ⊙ ψ(u)` (`ψ`: [`up`](Self::up)), element-wise.
    ///
    /// ```
    /// use burn::tensor::{Device, Tensor};
    /// use ffn_model::Activation;
    ///
    /// let device = Device::flex();
    /// let g = Tensor::<1>::from_floats([1.0, 9.0], &device);
    /// let u = Tensor::<1>::from_floats([2.0, -9.0], &device);
    /// let h: Vec<f32> = Activation::SwigluOai.glu(g, u).into_data().to_vec().unwrap();
    /// let swish = |g: f32| g / (1.0 + (-1.702 * g).exp());
    /// // (2 + 1)·φ(1), and (−7 + 1)·φ(7): both sides clipped at 7.
    /// assert!((h[0] - 3.0 * swish(1.0)).abs() < 1e-6);
    /// assert!((h[1] + 6.0 * swish(7.0)).abs() < 1e-5);
    /// ```
    pub fn glu<const D: usize>(self, g: Tensor<D>, u: Tensor<D>) -> Tensor<D> {
        self.forward(g) * self.up(u)
    }
}

impl fmt::Display for Activation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Activation {
    type Err = ConfigError;

    /// Parses a canonical name or an alias, ignoring ASCII case and treating `-` as `_`.
    fn from_str(name: &str) -> Result<Self, ConfigError> {
        let normal = crate::normal_name(name);
        Self::ALL
            .iter()
            .map(|a| (a.name(), *a))
            .chain(Self::ALIASES)
            .find(|(spelling, _)| *spelling == normal)
            .map(|(_, a)| a)
            .ok_or_else(|| ConfigError::UnknownActivation {
                name: name.to_string(),
                known: Self::known_names(),
            })
    }
}

impl Serialize for Activation {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for Activation {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = String::deserialize(deserializer)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}

/// The activation as module state: the [`Activation`] the forward pass uses, mirrored by a
/// one-element integer tensor holding its code, so that it travels with the weights.
///
/// burn records hold tensors only, so a plain `#[module(skip)]` field (burn's own
/// `PositionWiseFeedForward`) comes back from a file as whatever the loading module was built
/// with. This one is recorded under the key `activation`; loading a record (or a file written
/// from one) adopts the activation it was saved with.
#[derive(Debug, Clone)]
pub(crate) struct ActivationState {
    pub(crate) activation: Activation,
    code: Param<Tensor<1, Int>>,
}

impl ActivationState {
    pub(crate) fn new(activation: Activation, device: &Device) -> Self {
        let code = Tensor::from_data(TensorData::from([activation.code()]), device);
        Self {
            activation,
            code: Param::initialized(ParamId::new(), code),
        }
    }

    /// Rebuilds the state around a (possibly replaced) code tensor. A code this version does not
    /// know (a hand-edited record) keeps the current activation.
    fn with_code(activation: Activation, code: Param<Tensor<1, Int>>) -> Self {
        let stored = code.val().into_data().iter::<i64>().next();
        let activation = stored.and_then(Activation::from_code).unwrap_or(activation);
        Self { activation, code }
    }

    /// Replaces the activation, keeping the code tensor's id and device.
    pub(crate) fn set(self, activation: Activation) -> Self {
        let device = self.code.lazy_device();
        let id = self.code.id;
        let code = Tensor::from_data(TensorData::from([activation.code()]), &device);
        Self {
            activation,
            code: Param::initialized(id, code),
        }
    }
}

impl Module for ActivationState {
    fn collect_devices(&self, devices: Devices) -> Devices {
        Module::collect_devices(&self.code, devices)
    }

    fn fork(self, device: &Device) -> Self {
        Self {
            activation: self.activation,
            code: Module::fork(self.code, device),
        }
    }

    fn to_device(self, device: &Device) -> Self {
        Self {
            activation: self.activation,
            code: Module::to_device(self.code, device),
        }
    }

    fn train(self) -> Self {
        Self {
            activation: self.activation,
            code: Module::train(self.code),
        }
    }

    fn valid(&self) -> Self {
        Self {
            activation: self.activation,
            code: Module::valid(&self.code),
        }
    }

    fn materialize(self) -> Self {
        self
    }

    fn visit<V: ModuleVisitor>(&self, visitor: &mut V) {
        Module::visit(&self.code, visitor)
    }

    fn map<M: ModuleMapper>(self, mapper: &mut M) -> Self {
        Self::with_code(self.activation, Module::map(self.code, mapper))
    }
}

impl ModuleDisplayDefault for ActivationState {
    fn content(&self, content: Content) -> Option<Content> {
        content.add_formatted(&self.activation.name()).optional()
    }
}

impl ModuleDisplay for ActivationState {}
