//! # The position-wise feed-forward network
//!
//! Every position (token) of a sequence goes through the same two-layer network, independently:
//! it widens the representation from `d_model` to `d_ff`, applies a nonlinearity, and projects
//! back (Vaswani et al. 2017, §3.3):
//!
//! ```text
//! FFN(x) = φ(x W_up + b_up) W_down + b_down
//! ```
//!
//! Shazeer (2020) replaces the first layer by a gated linear unit (Dauphin et al. 2017): the
//! component-wise product of two projections of `x`, one of them passed through `φ`:
//!
//! ```text
//! FFN_gated(x) = (φ(x W_gate + b_gate) ⊙ (x W_up + b_up)) W_down + b_down
//! ```
//!
//! `x` can have any rank: the network acts on its last dimension, so `[tokens, d_model]`,
//! `[batch, seq, d_model]` and `[batch, heads, seq, d_model]` inputs all work.

use burn::module::{Content, DisplaySettings, Module, ModuleDisplay};
use burn::nn::{Dropout, DropoutConfig, Linear, LinearConfig};
use burn::tensor::{Device, Tensor};

use crate::activation::ActivationState;
use crate::{Activation, DropoutAt, FeedForwardConfig};

/// The position-wise feed-forward network, every variant: build it with
/// [`FeedForwardConfig::init`].
///
/// Parameters (burn layout, `[d_input, d_output]`; PyTorch files hold the transpose):
/// `up` `d_model → d_ff`, `gate` `d_model → d_ff` (gated only), `down` `d_ff → d_model`.
/// The activation is recorded with them (as the integer tensor `activation`), so saving and
/// loading with burn's records restores it.
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// use ffn_model::{FeedForwardConfig, Variant};
///
/// let device = Device::flex();
/// let ffn = FeedForwardConfig::preset(Variant::SwiGlu, 64).init(&device);
/// let x = Tensor::<3>::ones([2, 10, 64], &device);
/// assert_eq!(ffn.forward(x).dims(), [2, 10, 64]);
/// ```
#[derive(Module, Debug)]
#[module(custom_display)]
pub struct FeedForward {
    /// `W_gate`, `b_gate`: the activated projection of a gated network.
    gate: Option<Linear>,
    /// `W_up`, `b_up`: the activated projection (ungated) or the linear partner (gated).
    up: Linear,
    /// `W_down`, `b_down`: back to `d_model`.
    down: Linear,
    dropout: Dropout,
    #[module(skip)]
    dropout_at: DropoutAt,
    /// `φ`, recorded with the weights.
    activation: ActivationState,
}

impl FeedForward {
    /// Built by [`FeedForwardConfig::try_init`] from a validated config.
    pub(crate) fn new(config: &FeedForwardConfig, device: &Device) -> Self {
        let linear = |d_input, d_output, bias| {
            LinearConfig::new(d_input, d_output)
                .with_bias(bias)
                .with_initializer(config.initializer.clone())
                .init(device)
        };
        Self {
            gate: config
                .gated
                .then(|| linear(config.d_model, config.d_ff, config.bias_gate)),
            up: linear(config.d_model, config.d_ff, config.bias_up),
            down: linear(config.d_ff, config.d_model, config.bias_down),
            dropout: DropoutConfig::new(config.dropout).init(),
            dropout_at: config.dropout_at,
            activation: ActivationState::new(config.activation, device),
        }
    }

    /// Applies the network to the last dimension of `x`: `[..., d_model] → [..., d_model]`.
    ///
    /// Dropout is active only on an autodiff device while the module is in training mode.
    ///
    /// # Panics
    ///
    /// If the last dimension of `x` is not `d_model` (as burn's own layers do).
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let shape = x.dims();
        assert!(
            D >= 1 && shape[D - 1] == self.d_model(),
            "FeedForward: the input's last dimension must be d_model = {}, got shape {shape:?}",
            self.d_model(),
        );
        let phi = self.activation.activation;

        // h = φ(x W_gate + b_gate) ⊙ (x W_up + b_up)   (gated)
        // h = φ(x W_up + b_up)                         (ungated)
        let h = match &self.gate {
            Some(gate) => phi.forward(gate.forward(x.clone())) * self.up.forward(x),
            None => phi.forward(self.up.forward(x)),
        };
        let h = match self.dropout_at {
            DropoutAt::Hidden => self.dropout.forward(h),
            DropoutAt::Output => h,
        };

        // y = h W_down + b_down
        let y = self.down.forward(h);
        match self.dropout_at {
            DropoutAt::Hidden => y,
            DropoutAt::Output => self.dropout.forward(y),
        }
    }

    /// Width of the input and output.
    pub fn d_model(&self) -> usize {
        self.up.weight.lazy_shape().dims::<2>()[0]
    }

    /// Width of the hidden layer.
    pub fn d_ff(&self) -> usize {
        self.up.weight.lazy_shape().dims::<2>()[1]
    }

    /// The activation `φ`.
    pub fn activation(&self) -> Activation {
        self.activation.activation
    }

    /// Whether the hidden layer is gated.
    pub fn is_gated(&self) -> bool {
        self.gate.is_some()
    }

    /// The `up` projection (`d_model → d_ff`).
    pub fn up(&self) -> &Linear {
        &self.up
    }

    /// The `gate` projection (`d_model → d_ff`) of a gated network.
    pub fn gate(&self) -> Option<&Linear> {
        self.gate.as_ref()
    }

    /// The `down` projection (`d_ff → d_model`).
    pub fn down(&self) -> &Linear {
        &self.down
    }

    /// The config this module is an instance of (its initializer is the default: a module
    /// does not remember how its weights were drawn).
    pub fn config(&self) -> FeedForwardConfig {
        FeedForwardConfig::new(self.d_model(), self.d_ff())
            .with_activation(self.activation())
            .with_gated(self.is_gated())
            .with_bias_up(self.up.bias.is_some())
            .with_bias_gate(self.gate.as_ref().is_some_and(|g| g.bias.is_some()))
            .with_bias_down(self.down.bias.is_some())
            .with_dropout(self.dropout.prob)
            .with_dropout_at(self.dropout_at)
    }

    /// The number of trainable parameters (burn's [`Module::num_params`], here without the
    /// trait in scope).
    pub fn num_params(&self) -> usize {
        Module::num_params(self)
    }

    /// Forward FLOPs per token of the matrix products (see
    /// [`FeedForwardConfig::flops_per_token`]).
    pub fn flops_per_token(&self) -> u64 {
        self.config().flops_per_token()
    }

    pub(crate) fn parts_mut(&mut self) -> (Option<&mut Linear>, &mut Linear, &mut Linear) {
        (self.gate.as_mut(), &mut self.up, &mut self.down)
    }

    pub(crate) fn set_activation(mut self, activation: Activation) -> Self {
        self.activation = self.activation.set(activation);
        self
    }
}

impl ModuleDisplay for FeedForward {
    fn custom_settings(&self) -> Option<DisplaySettings> {
        DisplaySettings::new()
            .with_new_line_after_attribute(false)
            .optional()
    }

    fn custom_content(&self, content: Content) -> Option<Content> {
        let dropout_at = match self.dropout_at {
            DropoutAt::Hidden => "hidden",
            DropoutAt::Output => "output",
        };
        content
            .add("d_model", &self.d_model())
            .add("d_ff", &self.d_ff())
            .add("activation", self.activation().name())
            .add("gated", &self.is_gated())
            .add("bias_up", &self.up.bias.is_some())
            .add(
                "bias_gate",
                &self.gate.as_ref().is_some_and(|g| g.bias.is_some()),
            )
            .add("bias_down", &self.down.bias.is_some())
            .add("dropout", &self.dropout.prob)
            .add("dropout_at", dropout_at)
            .optional()
    }
}
