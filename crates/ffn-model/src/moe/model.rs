//! # The sparse mixture-of-experts layer
//!
//! A mixture of experts replaces the one feed-forward network of a transformer block by `E`
//! of them, the experts, of which each token uses only `k` (Shazeer et al. 2017; Switch,
//! Fedus et al. 2021; Mixtral, Jiang et al. 2024): parameters grow `E/k`-fold at the cost of
//! `k` networks per token. A linear router scores the experts for each token `x`:
//!
//! ```text
//! z = x W_r (+ b_r)                       router logits, [E]
//! p = softmax(z)   or   p = σ(z)          scores (Mixtral, Qwen / DeepSeek-V3)
//! S = top_k(p + b_sel)                    the token's experts (router.rs; b_sel: selection bias)
//! w_e = p_e / Σ_{e'∈S} p_e'  (normalize_top_k, else w_e = p_e),  then · routed_scaling
//! y = Σ_{e∈S} w_e FFN_e(x)  +  σ(x w_s) · FFN_shared(x)            (shared part optional)
//! ```
//!
//! or, with `weight_input` (Llama 4), the weight scales the expert's input instead:
//! `y = Σ_{e∈S} FFN_e(w_e x) + …`.
//!
//! The routed sum is computed sparsely: the token–expert pairs are grouped by expert, each
//! expert runs once on its block of tokens (`experts.rs`), and the weighted outputs are added
//! back to their tokens. Gradients reach the router through the weights `w_e` (the choice
//! itself is not differentiable), and the experts through their blocks.
//!
//! **Auxiliary losses**, returned with the output for the training loop to add:
//!
//! ```text
//! load balancing (Switch, as Mixtral computes it):  L_b = E · Σ_e f_e P_e
//!     f_e = (pairs that chose e before capacity) / T,   P_e = mean_t p̂_te
//!     (p̂ = p for softmax, p / Σ_e p_e for sigmoid); Σ_e f_e = k, so L_b = k when balanced
//! router z-loss (ST-MoE):                           L_z = mean_t (log Σ_e exp z_te)²
//! ```
//!
//! **Auxiliary-loss-free balancing** (DeepSeek-V3): a selection bias `b_sel` shifts which
//! experts are chosen, never their weights, and after each step moves against the load:
//! `b_sel ← b_sel + rate · sign(mean load − load_e)` ([`Moe::update_selection_bias`]).

use burn::module::{Flag, Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::{sigmoid, softmax};
use burn::tensor::{Distribution, IndexingUpdateOp, Int, Tensor, TensorData};

use super::experts::{Stacked, experts, experts_composed};
use super::router::{RouteSpec, Routing, route};
use crate::activation::ActivationState;
use crate::op::Spec;
use crate::{Activation, FeedForward, FeedForwardConfig, MoeConfig, Scoring};

/// A sparse mixture of [`FeedForward`] experts behind a router: build it with
/// [`MoeConfig::init`].
///
/// Parameters (burn layout, `[d_input, d_output]` per expert): `router` `d_model → E`; the
/// experts stacked, `w_gate` and `w_up` `[E, d_model, d_ff]`, `w_down` `[E, d_ff, d_model]`,
/// biases `[E, d_ff]` / `[E, d_model]`; the shared experts as one [`FeedForward`] `shared`,
/// its gate `shared_gate` `d_model → 1`; the selection bias `[E]` (not trained by gradients).
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// use ffn_model::{FeedForwardConfig, MoeConfig, Variant};
///
/// let device = Device::flex();
/// let expert = FeedForwardConfig::preset(Variant::SwiGlu, 64);
/// let moe = MoeConfig::new(expert, 8, 2).init(&device);
///
/// let out = moe.forward(Tensor::<3>::ones([2, 10, 64], &device));
/// assert_eq!(out.output.dims(), [2, 10, 64]);
/// assert_eq!(out.tokens_per_expert.iter().sum::<usize>(), 2 * 10 * 2); // dropless
/// let aux = out.aux_loss; // add it to the training loss
/// # let _ = aux;
/// ```
#[derive(Module, Debug)]
pub struct Moe {
    /// `W_r`, `b_r`: `d_model → n_experts`.
    pub(crate) router: Linear,
    /// `b_sel`, `[E]`: the selection bias (DeepSeek-V3's `e_score_correction_bias`).
    pub(crate) selection_bias: Option<Param<Tensor<1>>>,
    /// `W_gate`, `[E, d_model, d_ff]` (gated experts).
    pub(crate) w_gate: Option<Param<Tensor<3>>>,
    /// `W_up`, `[E, d_model, d_ff]`.
    pub(crate) w_up: Param<Tensor<3>>,
    /// `W_down`, `[E, d_ff, d_model]`.
    pub(crate) w_down: Param<Tensor<3>>,
    /// `b_gate`, `[E, d_ff]`.
    pub(crate) b_gate: Option<Param<Tensor<2>>>,
    /// `b_up`, `[E, d_ff]`.
    pub(crate) b_up: Option<Param<Tensor<2>>>,
    /// `b_down`, `[E, d_model]`.
    pub(crate) b_down: Option<Param<Tensor<2>>>,
    /// The shared experts, as one network.
    pub(crate) shared: Option<FeedForward>,
    /// `w_s`: `d_model → 1`, the shared experts' gate.
    pub(crate) shared_gate: Option<Linear>,
    /// `φ` of the experts, recorded with the weights.
    activation: ActivationState,
    /// Whether to behave as in training (router jitter). Cleared by burn's `valid()`.
    training: Param<Flag>,
    #[module(skip)]
    config: MoeConfig,
}

/// What [`Moe::forward`] returns: the output, the auxiliary losses and the routing statistics.
#[derive(Debug, Clone)]
pub struct MoeOutput<const D: usize> {
    /// The layer's output, shaped like the input.
    pub output: Tensor<D>,
    /// The router logits `z`, `[tokens, n_experts]` (tokens: the input's leading dimensions
    /// flattened).
    pub router_logits: Tensor<2>,
    /// `L_b = E · Σ_e f_e P_e`, `[1]`.
    pub load_balancing_loss: Tensor<1>,
    /// `L_z = mean_t (logsumexp_e z_te)²`, `[1]`.
    pub z_loss: Tensor<1>,
    /// `load_balancing_coef · L_b + z_loss_coef · L_z`: what the training loop adds to its loss.
    pub aux_loss: Tensor<1>,
    /// Token–expert pairs each expert computed (after capacity).
    pub tokens_per_expert: Vec<usize>,
    /// The fraction of the `tokens · top_k` pairs that capacity dropped (0 when dropless).
    pub dropped_fraction: f64,
}

impl Moe {
    /// Built by [`MoeConfig::try_init`] from a validated config.
    pub(crate) fn new(config: &MoeConfig, device: &burn::tensor::Device) -> Self {
        let expert = &config.expert;
        let (e, d, f) = (config.n_experts, expert.d_model, expert.d_ff);
        let init = &expert.initializer;
        // Each expert as `nn.Linear` would draw it: fan-in `d` for gate/up, `f` for down.
        let w = |shape: [usize; 3], fan_in| init.init_with(shape, Some(fan_in), None, device);
        let b = |n: usize, fan_in, on: bool| {
            on.then(|| init.init_with([e, n], Some(fan_in), None, device))
        };
        let router = LinearConfig::new(d, e)
            .with_bias(config.router_bias)
            .with_initializer(init.clone())
            .init(device);
        let selection_bias = config
            .selection_bias
            .then(|| Param::from_tensor(Tensor::zeros([e], device)).set_require_grad(false));
        let shared = config.shared_config().map(|c| c.init(device));
        let shared_gate = config.shared_expert_gate.then(|| {
            LinearConfig::new(d, 1)
                .with_bias(false)
                .with_initializer(init.clone())
                .init(device)
        });
        Self {
            router,
            selection_bias,
            w_gate: expert.gated.then(|| w([e, d, f], d)),
            w_up: w([e, d, f], d),
            w_down: w([e, f, d], f),
            b_gate: b(f, d, expert.bias_gate),
            b_up: b(f, d, expert.bias_up),
            b_down: b(d, f, expert.bias_down),
            shared,
            shared_gate,
            activation: ActivationState::new(expert.activation, device),
            training: Param::from_bool(true),
            config: config.clone(),
        }
    }

    /// Applies the layer to the last dimension of `x`: `[..., d_model] → [..., d_model]`, with
    /// the auxiliary losses and routing statistics of this batch (all its tokens together).
    ///
    /// # Panics
    ///
    /// If the last dimension of `x` is not `d_model` (as burn's own layers do).
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> MoeOutput<D> {
        let op = crate::op::supported(&x.device());
        self.forward_with(x, op)
    }

    /// [`forward`](Self::forward) with the experts composed from burn's tensor ops and
    /// differentiated by autodiff: the reference the grouped op is tested against, and the
    /// path on backends without it.
    ///
    /// # Panics
    ///
    /// If the last dimension of `x` is not `d_model`.
    pub fn forward_composed<const D: usize>(&self, x: Tensor<D>) -> MoeOutput<D> {
        self.forward_with(x, false)
    }

    fn forward_with<const D: usize>(&self, x: Tensor<D>, op: bool) -> MoeOutput<D> {
        let shape = x.dims();
        let d = self.d_model();
        assert!(
            D >= 1 && shape[D - 1] == d,
            "Moe: the input's last dimension must be d_model = {d}, got shape {shape:?}"
        );
        let device = x.device();
        let (e, k) = (self.n_experts(), self.config.top_k);
        let tokens = shape[..D - 1].iter().product::<usize>();
        if tokens == 0 {
            return self.empty(shape, &device, x.dtype());
        }
        let x2: Tensor<2> = x.reshape([tokens, d]);

        // z = x W_r (+ b_r), on the jittered input in training (Switch).
        let jitter = self.config.jitter;
        let sparse_mixer = self.config.scoring == Scoring::SparseMixer;
        let router_input = if jitter > 0.0
            && !sparse_mixer
            && self.training.is_enabled()
            && device.is_autodiff()
        {
            let noise = Tensor::<2>::random(
                [tokens, d],
                Distribution::Uniform(1.0 - jitter, 1.0 + jitter),
                &device,
            );
            x2.clone() * noise.cast(x2.dtype())
        } else {
            x2.clone()
        };
        let logits = self.router.forward(router_input);
        let scores = match self.config.scoring {
            Scoring::Softmax | Scoring::SparseMixer => softmax(logits.clone(), 1),
            Scoring::Sigmoid => sigmoid(logits.clone()),
        };

        let routing = self.route(&scores, tokens);
        let weights = self.weights(&logits, &scores, &routing, tokens);
        let mut output = self.routed(&x2, weights, &routing, op);
        if let Some(shared) = &self.shared {
            let y = if op {
                shared.forward(x2.clone())
            } else {
                shared.forward_composed(x2.clone())
            };
            output = output
                + match &self.shared_gate {
                    Some(gate) => y * sigmoid(gate.forward(x2)),
                    None => y,
                };
        }

        let (load_balancing_loss, z_loss) = self.losses(&logits, scores, &routing, tokens);
        let aux_loss = load_balancing_loss.clone() * self.config.load_balancing_coef
            + z_loss.clone() * self.config.z_loss_coef;
        let pairs = tokens * k;
        MoeOutput {
            output: output.reshape(shape),
            router_logits: logits,
            load_balancing_loss,
            z_loss,
            aux_loss,
            dropped_fraction: if pairs == 0 {
                0.0
            } else {
                routing.dropped() as f64 / pairs as f64
            },
            tokens_per_expert: {
                debug_assert_eq!(routing.groups.len(), e);
                routing.groups
            },
        }
    }

    /// The output for a batch without tokens: empty tensors, zero losses.
    fn empty<const D: usize>(
        &self,
        shape: [usize; D],
        device: &burn::tensor::Device,
        dtype: burn::tensor::DType,
    ) -> MoeOutput<D> {
        let zero = || Tensor::<1>::zeros([1], device).cast(dtype);
        MoeOutput {
            output: Tensor::<D>::zeros(shape, device).cast(dtype),
            router_logits: Tensor::<2>::zeros([0, self.n_experts()], device).cast(dtype),
            load_balancing_loss: zero(),
            z_loss: zero(),
            aux_loss: zero(),
            tokens_per_expert: vec![0; self.n_experts()],
            dropped_fraction: 0.0,
        }
    }

    /// Chooses each token's experts from a host copy of the scores (`router.rs`).
    fn route(&self, scores: &Tensor<2>, tokens: usize) -> Routing {
        let host = |t: Tensor<1>| -> Vec<f32> { t.into_data().iter::<f32>().collect() };
        let p = host(scores.clone().detach().reshape([-1]));
        let bias = self.selection_bias.as_ref().map(|b| host(b.val()));
        let spec = RouteSpec {
            n_experts: self.n_experts(),
            top_k: self.config.top_k,
            n_group: self.config.n_group,
            topk_group: self.config.topk_group,
            group_score_top: self.config.group_score_top,
            capacity: self.config.capacity(tokens),
        };
        route(&p, bias.as_deref(), tokens, spec)
    }

    /// The routing weights of each token's `k` experts, `[T, k]`: `w = p_S (/ Σ p_S) ·
    /// routed_scaling`, or SparseMixer's (see [`Scoring::SparseMixer`]) times `routed_scaling`.
    fn weights(
        &self,
        logits: &Tensor<2>,
        scores: &Tensor<2>,
        routing: &Routing,
        tokens: usize,
    ) -> Tensor<2> {
        let device = logits.device();
        let k = self.config.top_k;
        let selected: Vec<i64> = routing.selected.iter().map(|&e| e as i64).collect();
        let selected =
            Tensor::<1, Int>::from_data(TensorData::new(selected, [tokens * k]), &device);
        let mut weights = if self.config.scoring == Scoring::SparseMixer {
            // softmax over each slot's band B_s: z + 0 inside it, z + (−∞) outside, [T, k, E].
            let e = self.n_experts();
            let z: Vec<f64> = logits.clone().detach().into_data().iter::<f64>().collect();
            let band = 2.0 * self.config.jitter;
            let mut mask = vec![0f32; tokens * k * e];
            for t in 0..tokens {
                let z = &z[t * e..(t + 1) * e];
                let chosen = &routing.selected[t * k..(t + 1) * k];
                for (s, &expert) in chosen.iter().enumerate() {
                    let top = z[expert];
                    let row = &mut mask[(t * k + s) * e..(t * k + s + 1) * e];
                    for (j, m) in row.iter_mut().enumerate() {
                        // As PhiMoE computes it: a NaN ratio (0 / 0) is inside the band.
                        let outside = (top - z[j]) / z[j].abs().max(top) > band;
                        if outside || chosen[..s].contains(&j) {
                            *m = f32::NEG_INFINITY;
                        }
                    }
                }
            }
            let mask = Tensor::<3>::from_data(TensorData::new(mask, [tokens, k, e]), &device)
                .cast(logits.dtype());
            let banded = logits.clone().unsqueeze_dim::<3>(1).repeat_dim(1, k) + mask;
            softmax(banded, 2)
                .gather(2, selected.reshape([tokens, k, 1]))
                .reshape([tokens, k])
        } else {
            scores.clone().gather(1, selected.reshape([tokens, k]))
        };
        if self.config.normalize_top_k {
            // + 1e-20 (as DeepSeek-V3): sigmoid scores can all underflow to 0.
            weights = weights.clone() / (weights.sum_dim(1) + 1e-20);
        }
        if self.config.routed_scaling != 1.0 {
            weights = weights * self.config.routed_scaling;
        }
        weights
    }

    /// `Σ_{e∈S} w_e FFN_e(x)` for every token: gather the pairs' inputs expert by expert, run
    /// the experts, scale by the routing weights (`[T, k]`), add back to the tokens.
    fn routed(&self, x: &Tensor<2>, weights: Tensor<2>, routing: &Routing, op: bool) -> Tensor<2> {
        let device = x.device();
        let [tokens, d] = x.dims();
        let k = self.config.top_k;
        let zeros = Tensor::<2>::zeros([tokens, d], &device).cast(x.dtype());
        if routing.tokens.is_empty() {
            return zeros;
        }
        let index = |v: &[usize]| {
            let v: Vec<i64> = v.iter().map(|&i| i as i64).collect();
            let n = v.len();
            Tensor::<1, Int>::from_data(TensorData::new(v, [n]), &device)
        };
        let token_index = index(&routing.tokens);
        let x_sorted = x.clone().select(0, token_index.clone());
        let spec = Spec {
            activation: self.activation(),
            gated: self.w_gate.is_some(),
            memory: self.config.expert.memory,
            precision: self.config.expert.precision,
        };
        let stacked = Stacked {
            w_gate: self.w_gate.as_ref().map(|p| p.val()),
            w_up: self.w_up.val(),
            w_down: self.w_down.val(),
            b_gate: self.b_gate.as_ref().map(|p| p.val()),
            b_up: self.b_up.as_ref().map(|p| p.val()),
            b_down: self.b_down.as_ref().map(|p| p.val()),
        };
        let pair_weights = weights
            .reshape([tokens * k])
            .select(0, index(&routing.slots))
            .unsqueeze_dim::<2>(1);
        // w_e FFN_e(x), or FFN_e(w_e x) (Llama 4).
        let (x_sorted, output_weights) = if self.config.weight_input {
            (x_sorted * pair_weights, None)
        } else {
            (x_sorted, Some(pair_weights))
        };
        let y_sorted = if op {
            experts(x_sorted, stacked, &routing.groups, spec)
        } else {
            experts_composed(x_sorted, stacked, &routing.groups, spec)
        };
        let y_sorted = match output_weights {
            Some(w) => y_sorted * w,
            None => y_sorted,
        };
        zeros.select_assign(0, token_index, y_sorted, IndexingUpdateOp::Add)
    }

    /// `(L_b, L_z)`; see the module docs.
    fn losses(
        &self,
        logits: &Tensor<2>,
        scores: Tensor<2>,
        routing: &Routing,
        tokens: usize,
    ) -> (Tensor<1>, Tensor<1>) {
        let device = logits.device();
        let e = self.n_experts();
        let probabilities = match self.config.scoring {
            Scoring::Softmax | Scoring::SparseMixer => scores,
            Scoring::Sigmoid => scores.clone() / scores.sum_dim(1),
        };
        let p_mean = probabilities.mean_dim(0); // [1, E]
        let f: Vec<f32> = routing
            .chosen
            .iter()
            .map(|&n| n as f32 / tokens as f32)
            .collect();
        let f = Tensor::<2>::from_data(TensorData::new(f, [1, e]), &device).cast(logits.dtype());
        let load_balancing = (p_mean * f).sum() * e as f64;

        let max = logits.clone().detach().max_dim(1);
        let lse = (logits.clone() - max.clone()).exp().sum_dim(1).log() + max;
        let z_loss = lse.powi_scalar(2).mean();
        (load_balancing, z_loss)
    }

    /// The auxiliary-loss-free balancing update (DeepSeek-V3): each expert's selection bias
    /// moves by `bias_update_rate` towards balance, `b_e ← b_e + rate · sign(mean − load_e)`,
    /// where `load` is [`MoeOutput::tokens_per_expert`] (of one step, or summed over several).
    /// Without a selection bias (`selection_bias = false`) the layer is returned unchanged.
    ///
    /// # Panics
    ///
    /// If `load` does not have one entry per expert.
    pub fn update_selection_bias(mut self, load: &[usize]) -> Self {
        assert_eq!(
            load.len(),
            self.n_experts(),
            "update_selection_bias: one load per expert"
        );
        let Some(bias) = self.selection_bias.take() else {
            return self;
        };
        let mean = load.iter().sum::<usize>() as f64 / load.len() as f64;
        let rate = self.config.bias_update_rate;
        let step: Vec<f32> = load
            .iter()
            .map(|&n| {
                let gap = mean - n as f64;
                (rate
                    * if gap > 0.0 {
                        1.0
                    } else if gap < 0.0 {
                        -1.0
                    } else {
                        0.0
                    }) as f32
            })
            .collect();
        let id = bias.id;
        let value = bias.val();
        let step = Tensor::<1>::from_data(TensorData::new(step, [load.len()]), &value.device())
            .cast(value.dtype());
        let updated = (value + step).detach();
        self.selection_bias = Some(Param::initialized(id, updated).set_require_grad(false));
        self
    }

    /// The selection bias `b_sel` (`None` unless `selection_bias`).
    pub fn selection_bias(&self) -> Option<Tensor<1>> {
        self.selection_bias.as_ref().map(|b| b.val())
    }

    /// Expert `e` as a stand-alone [`FeedForward`] (a copy of its weights).
    ///
    /// # Panics
    ///
    /// If `e ≥ n_experts`.
    pub fn expert(&self, e: usize) -> FeedForward {
        assert!(e < self.n_experts(), "expert {e} of {}", self.n_experts());
        let mat = |p: &Param<Tensor<3>>| p.val().narrow(0, e, 1).squeeze_dim::<2>(0).detach();
        let vec = |p: &Option<Param<Tensor<2>>>| {
            p.as_ref()
                .map(|p| Param::from_tensor(p.val().narrow(0, e, 1).squeeze_dim::<1>(0).detach()))
        };
        let mut ffn = self.expert_config().init(&self.w_up.lazy_device());
        let (gate, up, down) = ffn.parts_mut();
        if let (Some(gate), Some(w)) = (gate, &self.w_gate) {
            gate.weight = Param::from_tensor(mat(w));
            gate.bias = vec(&self.b_gate);
        }
        up.weight = Param::from_tensor(mat(&self.w_up));
        up.bias = vec(&self.b_up);
        down.weight = Param::from_tensor(mat(&self.w_down));
        down.bias = vec(&self.b_down);
        ffn
    }

    /// The experts' `W_gate`, `[n_experts, d_model, d_ff]` (gated experts only).
    pub fn w_gate(&self) -> Option<&Param<Tensor<3>>> {
        self.w_gate.as_ref()
    }

    /// The experts' `W_up`, `[n_experts, d_model, d_ff]`.
    pub fn w_up(&self) -> &Param<Tensor<3>> {
        &self.w_up
    }

    /// The experts' `W_down`, `[n_experts, d_ff, d_model]`.
    pub fn w_down(&self) -> &Param<Tensor<3>> {
        &self.w_down
    }

    /// The experts' `b_gate`, `[n_experts, d_ff]`.
    pub fn b_gate(&self) -> Option<&Param<Tensor<2>>> {
        self.b_gate.as_ref()
    }

    /// The experts' `b_up`, `[n_experts, d_ff]`.
    pub fn b_up(&self) -> Option<&Param<Tensor<2>>> {
        self.b_up.as_ref()
    }

    /// The experts' `b_down`, `[n_experts, d_model]`.
    pub fn b_down(&self) -> Option<&Param<Tensor<2>>> {
        self.b_down.as_ref()
    }

    /// The router, `d_model → n_experts`.
    pub fn router(&self) -> &Linear {
        &self.router
    }

    /// The shared experts, held as one network.
    pub fn shared(&self) -> Option<&FeedForward> {
        self.shared.as_ref()
    }

    /// The shared experts' gate, `d_model → 1`.
    pub fn shared_gate(&self) -> Option<&Linear> {
        self.shared_gate.as_ref()
    }

    /// The config this layer was built from, with the activation it holds now.
    pub fn config(&self) -> MoeConfig {
        let mut config = self.config.clone();
        config.expert.activation = self.activation();
        config
    }

    /// The config of each routed expert.
    pub fn expert_config(&self) -> FeedForwardConfig {
        self.config().expert
    }

    /// Width of the input and output.
    pub fn d_model(&self) -> usize {
        self.w_up.lazy_shape().dims::<3>()[1]
    }

    /// Width of each routed expert's hidden layer.
    pub fn d_ff(&self) -> usize {
        self.w_up.lazy_shape().dims::<3>()[2]
    }

    /// The number of routed experts.
    pub fn n_experts(&self) -> usize {
        self.w_up.lazy_shape().dims::<3>()[0]
    }

    /// Experts per token.
    pub fn top_k(&self) -> usize {
        self.config.top_k
    }

    /// The experts' activation `φ`.
    pub fn activation(&self) -> Activation {
        self.activation.activation
    }

    /// The number of parameters (burn's [`Module::num_params`], here without the trait in
    /// scope), the selection bias included.
    pub fn num_params(&self) -> usize {
        Module::num_params(self)
    }
}
