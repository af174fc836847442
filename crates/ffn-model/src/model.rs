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

use burn::module::{Content, DisplaySettings, Module, ModuleDisplay, Param, ParamId};
use burn::nn::{Dropout, DropoutConfig, Linear, LinearConfig};
use burn::tensor::{Device, Tensor};

use crate::activation::ActivationState;
use crate::dropout;
use crate::op::{self, Spec};
use crate::{Activation, ConfigError, DropoutAt, FeedForwardConfig, Memory, Precision};

impl FeedForwardConfig {
    /// Builds the module on `device`.
    ///
    /// # Panics
    ///
    /// If the config is invalid (see [`validate`](Self::validate)); use
    /// [`try_init`](Self::try_init) to get the error instead.
    pub fn init(&self, device: &Device) -> FeedForward {
        self.try_init(device)
            .unwrap_or_else(|err| panic!("invalid FeedForwardConfig: {err}"))
    }

    /// Builds the module on `device`, or says why the config is invalid.
    pub fn try_init(&self, device: &Device) -> Result<FeedForward, ConfigError> {
        self.validate()?;
        Ok(FeedForward::new(self, device))
    }
}

/// The position-wise feed-forward network, every variant: build it with
/// [`FeedForwardConfig::init`].
///
/// Parameters (burn layout, `[d_input, d_output]`; PyTorch files hold the transpose):
/// `up` `d_model → d_ff`, `gate` `d_model → d_ff` (gated only), `down` `d_ff → d_model`;
/// a fused gated network holds `gate_up` `d_model → 2·d_ff` instead of `gate` and `up`.
/// The activation is recorded with them (as the integer tensor `activation`), so saving and
/// loading with burn's records restores it.
///
/// # Weight files
///
/// [`load_safetensors`](Self::load_safetensors) and [`save_safetensors`](Self::save_safetensors)
/// use the names and layout a PyTorch module with the same attributes would (`nn.Linear`
/// stores `[out_features, in_features]`, the transpose of burn's `[d_input, d_output]`):
///
/// | key           | shape             |
/// |---------------|-------------------|
/// | `up.weight`   | `[d_ff, d_model]` |
/// | `up.bias`     | `[d_ff]`          |
/// | `gate.weight` | `[d_ff, d_model]` |
/// | `gate.bias`   | `[d_ff]`          |
/// | `down.weight` | `[d_model, d_ff]` |
/// | `down.bias`   | `[d_model]`       |
///
/// or, with the `_as` methods, any other [`Scheme`](crate::Scheme) (Hugging Face BERT, T5,
/// LLaMA, GPT-2, Meta's LLaMA, labml, the packed `w12` and `gate_up_proj` layouts) under a key
/// prefix such as `model.layers.3.mlp.`. Loading is strict: the file must hold exactly the
/// tensors the module has, with these shapes; F32 and F64 are read as they are, F16 and BF16
/// widened exactly, other dtypes refused, each as a typed [`Error`](crate::Error) naming the
/// key. Files written here carry the header metadata `ffn.activation` (and `format = pt`);
/// loading such a file adopts its activation, as burn records do.
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
    /// `W_gate`, `b_gate`: the activated projection of a gated network (unfused).
    gate: Option<Linear>,
    /// `W_up`, `b_up`: the activated projection (ungated) or the linear partner (gated, unfused).
    up: Option<Linear>,
    /// `[W_gate | W_up]`, `[b_gate | b_up]`: both projections of a gated network as one,
    /// `d_model → 2·d_ff` (with [`FeedForwardConfig::fused_gate_up`]).
    gate_up: Option<Linear>,
    /// `W_down`, `b_down`: back to `d_model`.
    down: Linear,
    dropout: Dropout,
    #[module(skip)]
    dropout_at: DropoutAt,
    #[module(skip)]
    pub(crate) memory: Memory,
    #[module(skip)]
    pub(crate) precision: Precision,
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
        let gate = config
            .gated
            .then(|| linear(config.d_model, config.d_ff, config.bias_gate));
        let up = linear(config.d_model, config.d_ff, config.bias_up);
        let (gate, up, gate_up) = match gate {
            Some(gate) if config.fused_gate_up => (None, None, Some(fuse_lazily(gate, up))),
            gate => (gate, Some(up), None),
        };
        Self {
            gate,
            up,
            gate_up,
            down: linear(config.d_ff, config.d_model, config.bias_down),
            dropout: DropoutConfig::new(config.dropout).init(),
            dropout_at: config.dropout_at,
            memory: config.memory,
            precision: config.precision,
            activation: ActivationState::new(config.activation, device),
        }
    }

    /// Applies the network to the last dimension of `x`: `[..., d_model] → [..., d_model]`.
    ///
    /// Dropout is active only on an autodiff device while the module is in training mode.
    ///
    /// On a backend this build has the FFN op for (`op/`; the crate's backend features), the
    /// network runs as that one operation with its own backward pass (hidden-layer dropout
    /// included: its mask is an input of the op); elsewhere as
    /// [`forward_composed`](Self::forward_composed). Both compute the same function and
    /// gradients, and draw the same dropout masks.
    ///
    /// # Panics
    ///
    /// If the last dimension of `x` is not `d_model` (as burn's own layers do).
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        self.check_input(&x);
        // burn's `reshape` reads a 0 as "keep this dimension": an empty input stays composed.
        let empty = x.dims().contains(&0);
        if empty || !op::supported(&x.device()) {
            return self.forward_composed(x);
        }
        let shape = x.dims();
        let x = x.reshape([-1, self.d_model() as i32]);
        // Dropout on h: its mask is an input of the op.
        let mask = match self.dropout_at {
            DropoutAt::Hidden => self.dropout_mask::<2, 2>(&x, [x.dims()[0], self.d_ff()]),
            DropoutAt::Output => None,
        };
        let (w_gate, w_up, b_gate, b_up) = match (&self.gate_up, &self.gate, &self.up) {
            (Some(gate_up), _, _) => (None, gate_up, None, &gate_up.bias),
            (None, gate, Some(up)) => (
                gate.as_ref().map(|g| g.weight.val()),
                up,
                gate.as_ref().and_then(|g| g.bias.as_ref().map(|b| b.val())),
                &up.bias,
            ),
            (None, _, None) => unreachable!("an unfused network has `up`"),
        };
        let spec = Spec {
            activation: self.activation(),
            gated: self.is_gated(),
            memory: self.memory,
            precision: self.precision,
        };
        let y = op::feed_forward(
            x,
            w_gate,
            w_up.weight.val(),
            self.down.weight.val(),
            b_gate,
            b_up.as_ref().map(|b| b.val()),
            self.down.bias.as_ref().map(|b| b.val()),
            mask,
            spec,
        );
        let y = y.reshape(shape);
        match self.dropout_at {
            DropoutAt::Hidden => y,
            DropoutAt::Output => self.drop(y),
        }
    }

    /// [`forward`](Self::forward) composed from burn's tensor ops and differentiated by
    /// autodiff: the reference the FFN op is tested against, and the path on backends without
    /// the op.
    ///
    /// # Panics
    ///
    /// If the last dimension of `x` is not `d_model`.
    pub fn forward_composed<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        self.check_input(&x);
        let phi = self.activation.activation;

        // h = φ(x W_gate + b_gate) ⊙ ψ(x W_up + b_up)   (gated; ψ the identity but for
        //                                                 SwigluOai, Activation::up)
        // h = φ(x W_up + b_up)                            (ungated)
        let h = match (&self.gate_up, &self.gate, &self.up) {
            // [g | u] = x [W_gate | W_up] + [b_gate | b_up]: one product, then two views.
            (Some(gate_up), _, _) => {
                let d_ff = self.d_ff();
                let gu = self.linear(gate_up, x);
                phi.glu(
                    gu.clone().narrow(D - 1, 0, d_ff),
                    gu.narrow(D - 1, d_ff, d_ff),
                )
            }
            (None, Some(gate), Some(up)) => {
                phi.glu(self.linear(gate, x.clone()), self.linear(up, x))
            }
            (None, None, Some(up)) => phi.forward(self.linear(up, x)),
            (None, _, None) => unreachable!("an unfused network has `up`"),
        };
        let h = match self.dropout_at {
            DropoutAt::Hidden => self.drop(h),
            DropoutAt::Output => h,
        };

        // y = h W_down + b_down
        let y = self.linear(&self.down, h);
        match self.dropout_at {
            DropoutAt::Hidden => y,
            DropoutAt::Output => self.drop(y),
        }
    }

    /// `x W + b` in this network's precision: in bf16 (f32 networks, on a device that rounds,
    /// see [`Precision`]) `bf16(x) bf16(W) + b`, the rounding transparent to the gradient (a
    /// straight-through `t + (bf16(t) − t)`, with the difference detached: exact in f32).
    fn linear<const D: usize>(&self, layer: &Linear, x: Tensor<D>) -> Tensor<D> {
        let dtype = self.precision.operands_on(&x.device());
        if x.dtype() != burn::tensor::DType::F32 || dtype == burn::tensor::DType::F32 {
            return layer.forward(x);
        }
        let weight = op::straight_through(layer.weight.val(), dtype);
        let bias = layer.bias.as_ref().map(|b| b.val());
        burn::tensor::module::linear(op::straight_through(x, dtype), weight, bias)
    }

    /// Dropout's mask `m / (1 − p)` for a tensor of `shape` on `x`'s device, where dropout is
    /// active (as burn's `Dropout::forward` decides: in training, on an autodiff device, with
    /// `p > 0`): from the device's random stream, or from this thread's seeded one inside
    /// [`dropout::with_seed`](crate::dropout::with_seed).
    fn dropout_mask<const D: usize, const E: usize>(
        &self,
        x: &Tensor<E>,
        shape: [usize; D],
    ) -> Option<Tensor<D>> {
        let p = self.dropout.prob;
        let active = p > 0.0 && self.dropout.training.is_enabled() && x.device().is_autodiff();
        active.then(|| dropout::mask(shape.into(), &x.device(), x.dtype(), p))
    }

    /// `t ⊙ mask`: dropout of `t` where it is active.
    fn drop<const D: usize>(&self, t: Tensor<D>) -> Tensor<D> {
        match self.dropout_mask(&t, t.dims()) {
            Some(mask) => t * mask,
            None => t,
        }
    }

    fn check_input<const D: usize>(&self, x: &Tensor<D>) {
        let shape = x.dims();
        assert!(
            D >= 1 && shape[D - 1] == self.d_model(),
            "FeedForward: the input's last dimension must be d_model = {}, got shape {shape:?}",
            self.d_model(),
        );
    }

    /// This network with `W_gate` and `W_up` as one projection `[W_gate | W_up]` whose weight
    /// and bias have the ids `ids` (those of the fused module a file was loaded into, so an
    /// optimizer's state still applies); unchanged if ungated or already fused.
    pub(crate) fn fused(mut self, ids: (ParamId, Option<ParamId>)) -> Self {
        let (Some(gate), Some(up)) = (self.gate.take(), self.up.take()) else {
            return self;
        };
        let weight = Tensor::cat(vec![gate.weight.val(), up.weight.val()], 1);
        let bias = match (gate.bias, up.bias) {
            (Some(g), Some(u)) => Some(Tensor::cat(vec![g.val(), u.val()], 0)),
            _ => None,
        };
        self.gate_up = Some(Linear {
            weight: trainable(weight, Some(ids.0)),
            bias: bias.map(|b| trainable(b, ids.1)),
        });
        self
    }

    /// This network with separate `W_gate` and `W_up` (unchanged if not fused).
    pub(crate) fn unfused(mut self) -> Self {
        let Some(gate_up) = self.gate_up.take() else {
            return self;
        };
        let d_ff = self.d_ff();
        let (weight, bias) = (gate_up.weight.val(), gate_up.bias.map(|b| b.val()));
        let half = |i: usize| Linear {
            weight: trainable(weight.clone().narrow(1, i * d_ff, d_ff), None),
            bias: bias
                .clone()
                .map(|b| trainable(b.narrow(0, i * d_ff, d_ff), None)),
        };
        self.gate = Some(half(0));
        self.up = Some(half(1));
        self
    }

    /// Width of the input and output.
    pub fn d_model(&self) -> usize {
        self.down.weight.lazy_shape().dims::<2>()[1]
    }

    /// Width of the hidden layer.
    pub fn d_ff(&self) -> usize {
        self.down.weight.lazy_shape().dims::<2>()[0]
    }

    /// The activation `φ`.
    pub fn activation(&self) -> Activation {
        self.activation.activation
    }

    /// Whether the hidden layer is gated.
    pub fn is_gated(&self) -> bool {
        self.gate.is_some() || self.gate_up.is_some()
    }

    /// Whether `W_gate` and `W_up` are held as one projection.
    pub fn is_fused(&self) -> bool {
        self.gate_up.is_some()
    }

    /// The `up` projection (`d_model → d_ff`); `None` when fused (see [`gate_up`](Self::gate_up)).
    pub fn up(&self) -> Option<&Linear> {
        self.up.as_ref()
    }

    /// The `gate` projection (`d_model → d_ff`) of a gated, unfused network.
    pub fn gate(&self) -> Option<&Linear> {
        self.gate.as_ref()
    }

    /// The fused `[W_gate | W_up]` projection (`d_model → 2·d_ff`) of a fused network.
    pub fn gate_up(&self) -> Option<&Linear> {
        self.gate_up.as_ref()
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
            .with_fused_gate_up(self.is_fused())
            .with_bias_up(self.bias_up())
            .with_bias_gate(self.bias_gate())
            .with_bias_down(self.down.bias.is_some())
            .with_dropout(self.dropout.prob)
            .with_dropout_at(self.dropout_at)
            .with_memory(self.memory)
            .with_precision(self.precision)
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

    fn bias_up(&self) -> bool {
        [&self.up, &self.gate_up]
            .iter()
            .any(|l| l.as_ref().is_some_and(|l| l.bias.is_some()))
    }

    fn bias_gate(&self) -> bool {
        [&self.gate, &self.gate_up]
            .iter()
            .any(|l| l.as_ref().is_some_and(|l| l.bias.is_some()))
    }

    /// The unfused projections, for loading: `(gate, up, down)`.
    pub(crate) fn parts_mut(&mut self) -> (Option<&mut Linear>, &mut Linear, &mut Linear) {
        let up = self.up.as_mut().expect("an unfused network has `up`");
        (self.gate.as_mut(), up, &mut self.down)
    }

    /// The ids of the fused projection's weight and bias, if fused.
    pub(crate) fn gate_up_ids(&self) -> Option<(ParamId, Option<ParamId>)> {
        let gate_up = self.gate_up.as_ref()?;
        Some((gate_up.weight.id, gate_up.bias.as_ref().map(|b| b.id)))
    }

    pub(crate) fn set_activation(mut self, activation: Activation) -> Self {
        self.activation = self.activation.set(activation);
        self
    }
}

/// `[gate | up]` as one projection whose parameters are drawn when first used (as burn's own
/// are), by drawing `gate`'s and then `up`'s: a fused network starts from the same weights as
/// the unfused one from the same seed, and the device RNG is used in the same order.
fn fuse_lazily(gate: Linear, up: Linear) -> Linear {
    fn join<const D: usize>(halves: [Param<Tensor<D>>; 2]) -> Param<Tensor<D>> {
        let mut shape = halves[0].lazy_shape();
        shape[D - 1] *= 2;
        let device = halves[0].lazy_device();
        let init = move |_: &Device, require_grad: bool| {
            let joined = Tensor::cat(halves.map(|p| p.val()).to_vec(), D - 1).detach();
            burn::module::Parameter::set_require_grad(joined, require_grad)
        };
        Param::uninitialized(ParamId::new(), init, device, true, shape)
    }
    Linear {
        weight: join([gate.weight, up.weight]),
        bias: gate.bias.zip(up.bias).map(|(g, u)| join([g, u])),
    }
}

/// A new trainable parameter holding `value` (detached from any graph it was computed in),
/// with the id `id` or a fresh one.
fn trainable<const D: usize>(value: Tensor<D>, id: Option<ParamId>) -> Param<Tensor<D>> {
    let mut param = Param::from_tensor(value.detach());
    if let Some(id) = id {
        param.id = id;
    }
    param
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
            .add("fused_gate_up", &self.is_fused())
            .add("bias_up", &self.bias_up())
            .add("bias_gate", &self.bias_gate())
            .add("bias_down", &self.down.bias.is_some())
            .add("dropout", &self.dropout.prob)
            .add("dropout_at", dropout_at)
            .optional()
    }
}
