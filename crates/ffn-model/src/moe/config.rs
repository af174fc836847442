//! # The configuration of a mixture of experts
//!
//! [`MoeConfig`] is plain serde data, like [`FeedForwardConfig`]: its `expert` table is the
//! config of every routed expert, and every other field but `n_experts` and `top_k` has a
//! default. A Mixtral-style layer in TOML:
//!
//! ```toml
//! n_experts = 8
//! top_k = 2
//!
//! [expert]
//! d_model = 512
//! d_ff = 1368
//! activation = "silu"
//! gated = true
//! ```
//!
//! and a DeepSeek-V3-style one adds `scoring = "sigmoid"`, `n_group`, `topk_group`,
//! `selection_bias = true`, `routed_scaling` and `n_shared_experts`; a Llama-4-style one
//! `scoring = "sigmoid"`, `normalize_top_k = false`, `weight_input = true` and one shared
//! expert.

use serde::{Deserialize, Serialize};

use crate::config::{MAX_MATRIX, parse_json, parse_toml};
use crate::{ConfigError, FeedForwardConfig};

/// How the router turns its logits `z = x W_r` into expert scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scoring {
    /// `p = softmax(z)` over the experts (Switch, Mixtral, Qwen-MoE, OLMoE).
    #[default]
    Softmax,
    /// `p = σ(z)`, each expert scored on its own (DeepSeek-V3).
    Sigmoid,
    /// SparseMixer (PhiMoE; Liu et al. 2024), as it routes at inference: the experts are the
    /// top k by `z`, and slot `s`'s weight is a softmax over only the logits near its expert's,
    ///
    /// `w_s = softmax_{j ∈ B_s}(z)_{e_s}`, `B_s = { j ∉ {e_1, …, e_{s−1}} : (z_{e_s} − z_j) / max(|z_j|, z_{e_s}) ≤ 2ε }`,
    ///
    /// with `ε` the config's [`jitter`](MoeConfig::jitter) (PhiMoE's `router_jitter_noise`),
    /// which then jitters nothing. The weights are not renormalised (`normalize_top_k = false`);
    /// the balancing loss takes `p = softmax(z)`. Training uses the same deterministic routing:
    /// SparseMixer's sampled experts and their gradient estimator are not implemented.
    SparseMixer,
}

/// The configuration of a [`Moe`](crate::Moe) layer: `n_experts` routed experts, each a
/// [`FeedForward`](crate::FeedForward) of the config `expert`, of which each token uses
/// `top_k`, plus optional always-on shared experts.
///
/// ```
/// use ffn_model::{Activation, FeedForwardConfig, MoeConfig};
///
/// // Mixtral's block at d_model 512: 8 SwiGLU experts, 2 per token.
/// let expert = FeedForwardConfig::new(512, 1368)
///     .with_activation(Activation::Silu)
///     .with_gated(true);
/// let config = MoeConfig::new(expert, 8, 2);
/// assert!(config.validate().is_ok());
/// assert_eq!(config.num_params(), 8 * 3 * 512 * 1368 + 512 * 8); // experts + router
/// assert_eq!(config.active_params(), 2 * 3 * 512 * 1368 + 512 * 8);
///
/// let toml = config.to_toml();
/// assert_eq!(MoeConfig::from_toml(&toml).unwrap(), config);
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoeConfig {
    /// Every routed expert: `d_model`, `d_ff`, activation, gating, biases, memory mode.
    /// Dropout and `fused_gate_up` are not available in experts.
    pub expert: FeedForwardConfig,
    /// The number of routed experts, `E`.
    pub n_experts: usize,
    /// Experts per token, `k` (`1 ≤ k ≤ E`).
    pub top_k: usize,
    /// Softmax (default) or sigmoid scores, or SparseMixer's banded softmax weights.
    #[serde(default)]
    pub scoring: Scoring,
    /// Renormalise the `k` selected scores to sum to 1 (Mixtral, Qwen3-MoE, DeepSeek-V3; not
    /// Qwen2-MoE). On by default.
    #[serde(default = "yes")]
    pub normalize_top_k: bool,
    /// Apply each routing weight to its expert's input instead of its output (Llama 4):
    /// `y = Σ_{e∈S} FFN_e(w_e x)` rather than `Σ_{e∈S} w_e FFN_e(x)`. Off by default.
    #[serde(default)]
    pub weight_input: bool,
    /// A factor on the routing weights after normalisation (DeepSeek-V3's
    /// `routed_scaling_factor`, 2.5); 1 by default.
    #[serde(default = "one")]
    pub routed_scaling: f64,
    /// A bias on the router's linear layer.
    #[serde(default)]
    pub router_bias: bool,
    /// Group-limited routing (DeepSeek-V3): the experts form `n_group` equal groups, and each
    /// token picks its experts from its `topk_group` best groups only. 1 (the default) is off.
    #[serde(default = "one_usize")]
    pub n_group: usize,
    /// Groups a token may use, `1 ≤ topk_group ≤ n_group`.
    #[serde(default = "one_usize")]
    pub topk_group: usize,
    /// A group's score is the sum of its `group_score_top` best selection scores: 2 for
    /// DeepSeek-V3 (the default), 1 (the best one) for DeepSeek-V2's `group_limited_greedy`.
    #[serde(default = "two_usize")]
    pub group_score_top: usize,
    /// A per-expert bias added to the scores for choosing experts, never for weighting them
    /// (DeepSeek-V3's `e_score_correction_bias`). It is not trained by gradients: see
    /// [`Moe::update_selection_bias`](crate::Moe::update_selection_bias).
    #[serde(default)]
    pub selection_bias: bool,
    /// The step of the auxiliary-loss-free balancing update of the selection bias,
    /// `b ← b + rate · sign(mean load − load)` (DeepSeek-V3: 0.001).
    #[serde(default = "bias_update_rate")]
    pub bias_update_rate: f64,
    /// Multiplicative jitter on the router's input in training, `x ⊙ U(1 − ε, 1 + ε)` (Switch);
    /// 0 (the default) is off. With [`Scoring::SparseMixer`] it is instead the width `ε` of
    /// the band of logits each weight's softmax takes, and the input is not jittered.
    #[serde(default)]
    pub jitter: f64,
    /// Always-on shared experts (DeepSeek, Qwen2-MoE); 0 by default.
    #[serde(default)]
    pub n_shared_experts: usize,
    /// `d_ff` of each shared expert; the routed experts' `d_ff` when unset. The shared experts
    /// are held as one network of width `n_shared_experts · shared_d_ff` (which computes their
    /// sum).
    #[serde(default)]
    pub shared_d_ff: Option<usize>,
    /// Scale the shared experts' output by `σ(x w_s)` (Qwen2-MoE's `shared_expert_gate`).
    #[serde(default)]
    pub shared_expert_gate: bool,
    /// Expert capacity: with `c`, each expert takes at most `⌈c · T · k / E⌉` of a batch's `T`
    /// tokens (Switch); the rest get nothing from it. Unset (the default): dropless.
    #[serde(default)]
    pub capacity_factor: Option<f64>,
    /// The weight of the load-balancing loss in [`MoeOutput::aux_loss`](crate::MoeOutput)
    /// (Switch: 0.01; Mixtral's `router_aux_loss_coef`: 0.02).
    #[serde(default = "load_balancing_coef")]
    pub load_balancing_coef: f64,
    /// The weight of the router z-loss (ST-MoE: 0.001); 0 by default.
    #[serde(default)]
    pub z_loss_coef: f64,
}

fn yes() -> bool {
    true
}

fn one() -> f64 {
    1.0
}

fn one_usize() -> usize {
    1
}

fn bias_update_rate() -> f64 {
    0.001
}

fn two_usize() -> usize {
    2
}

fn load_balancing_coef() -> f64 {
    0.01
}

/// The most routed experts a layer may have (DeepSeek-V3 has 256).
pub const MAX_EXPERTS: usize = 1 << 16;

impl burn::config::Config for MoeConfig {}

impl MoeConfig {
    /// `n_experts` experts of the config `expert`, `top_k` per token, every other field at
    /// its default: softmax scores renormalised over the top `k`, no groups, no shared experts,
    /// dropless, load-balancing weight 0.01.
    pub fn new(expert: FeedForwardConfig, n_experts: usize, top_k: usize) -> Self {
        Self {
            expert,
            n_experts,
            top_k,
            scoring: Scoring::Softmax,
            normalize_top_k: true,
            weight_input: false,
            routed_scaling: 1.0,
            router_bias: false,
            n_group: 1,
            topk_group: 1,
            group_score_top: 2,
            selection_bias: false,
            bias_update_rate: bias_update_rate(),
            jitter: 0.0,
            n_shared_experts: 0,
            shared_d_ff: None,
            shared_expert_gate: false,
            capacity_factor: None,
            load_balancing_coef: load_balancing_coef(),
            z_loss_coef: 0.0,
        }
    }

    /// Sets the scoring function.
    pub fn with_scoring(mut self, scoring: Scoring) -> Self {
        self.scoring = scoring;
        self
    }

    /// Sets whether the selected scores are renormalised.
    pub fn with_normalize_top_k(mut self, normalize: bool) -> Self {
        self.normalize_top_k = normalize;
        self
    }

    /// Sets whether the routing weights scale the experts' inputs (Llama 4) rather than their
    /// outputs.
    pub fn with_weight_input(mut self, on: bool) -> Self {
        self.weight_input = on;
        self
    }

    /// Sets the factor on the routing weights.
    pub fn with_routed_scaling(mut self, scaling: f64) -> Self {
        self.routed_scaling = scaling;
        self
    }

    /// Sets the router's bias.
    pub fn with_router_bias(mut self, bias: bool) -> Self {
        self.router_bias = bias;
        self
    }

    /// Sets group-limited routing: `n_group` groups, `topk_group` of them per token.
    pub fn with_groups(mut self, n_group: usize, topk_group: usize) -> Self {
        self.n_group = n_group;
        self.topk_group = topk_group;
        self
    }

    /// Sets how many of a group's best selection scores make its score (see
    /// [`group_score_top`](Self::group_score_top)).
    pub fn with_group_score_top(mut self, top: usize) -> Self {
        self.group_score_top = top;
        self
    }

    /// Sets the selection bias (and the step of its balancing update).
    pub fn with_selection_bias(mut self, on: bool, update_rate: f64) -> Self {
        self.selection_bias = on;
        self.bias_update_rate = update_rate;
        self
    }

    /// Sets the router's input jitter.
    pub fn with_jitter(mut self, jitter: f64) -> Self {
        self.jitter = jitter;
        self
    }

    /// Sets the shared experts: `n` of width `d_ff` (the routed experts' when `None`), gated by
    /// `σ(x w_s)` when `gate`.
    pub fn with_shared_experts(mut self, n: usize, d_ff: Option<usize>, gate: bool) -> Self {
        self.n_shared_experts = n;
        self.shared_d_ff = d_ff;
        self.shared_expert_gate = gate;
        self
    }

    /// Sets the capacity factor (`None`: dropless).
    pub fn with_capacity_factor(mut self, factor: Option<f64>) -> Self {
        self.capacity_factor = factor;
        self
    }

    /// Sets the weights of the load-balancing loss and the z-loss.
    pub fn with_loss_coefs(mut self, load_balancing: f64, z_loss: f64) -> Self {
        self.load_balancing_coef = load_balancing;
        self.z_loss_coef = z_loss;
        self
    }

    /// Width of the input and output.
    pub fn d_model(&self) -> usize {
        self.expert.d_model
    }

    /// The config of the shared experts held as one network (`None` without shared experts).
    pub fn shared_config(&self) -> Option<FeedForwardConfig> {
        (self.n_shared_experts > 0).then(|| {
            let mut shared = self.expert.clone();
            let d_ff = self.shared_d_ff.unwrap_or(self.expert.d_ff);
            shared.d_ff = d_ff.saturating_mul(self.n_shared_experts);
            shared
        })
    }

    /// The most tokens an expert takes from a batch of `tokens`: `⌈c · tokens · k / E⌉` with a
    /// capacity factor `c`, `None` when dropless.
    pub fn capacity(&self, tokens: usize) -> Option<usize> {
        self.capacity_factor.map(|c| {
            let slots = c * tokens as f64 * self.top_k as f64 / self.n_experts as f64;
            slots.ceil() as usize
        })
    }

    /// Checks every field; the first problem found is returned.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.expert.validate()?;
        let invalid =
            |field: &'static str, message: String| Err(ConfigError::Moe { field, message });
        if self.expert.dropout != 0.0 {
            return invalid(
                "expert.dropout",
                "dropout inside experts is not supported; set it to 0".into(),
            );
        }
        if self.expert.fused_gate_up {
            return invalid(
                "expert.fused_gate_up",
                "experts hold `gate` and `up` stacked per expert; set it to false".into(),
            );
        }
        for (field, value) in [
            ("n_experts", self.n_experts),
            ("top_k", self.top_k),
            ("n_group", self.n_group),
            ("topk_group", self.topk_group),
            ("group_score_top", self.group_score_top),
        ] {
            if value == 0 {
                return Err(ConfigError::ZeroSize { field });
            }
        }
        if self.n_experts > MAX_EXPERTS {
            return Err(ConfigError::TooLarge {
                field: "n_experts",
                value: self.n_experts as u128,
                max: MAX_EXPERTS as u128,
            });
        }
        let total = self.n_experts as u128 * self.expert.d_model as u128 * self.expert.d_ff as u128;
        if total > MAX_MATRIX as u128 {
            return Err(ConfigError::TooLarge {
                field: "n_experts · d_model · d_ff",
                value: total,
                max: MAX_MATRIX as u128,
            });
        }
        if self.top_k > self.n_experts {
            return invalid(
                "top_k",
                format!(
                    "{} is more than the {} experts (1 ≤ top_k ≤ n_experts)",
                    self.top_k, self.n_experts
                ),
            );
        }
        if !self.n_experts.is_multiple_of(self.n_group) {
            return invalid(
                "n_group",
                format!(
                    "{} groups do not divide the {} experts evenly",
                    self.n_group, self.n_experts
                ),
            );
        }
        if self.topk_group > self.n_group {
            return invalid(
                "topk_group",
                format!(
                    "{} is more than the {} groups (1 ≤ topk_group ≤ n_group)",
                    self.topk_group, self.n_group
                ),
            );
        }
        let reachable = self.topk_group * (self.n_experts / self.n_group);
        if self.top_k > reachable {
            return invalid(
                "top_k",
                format!(
                    "{} experts cannot be chosen from {} groups of {} experts",
                    self.top_k,
                    self.topk_group,
                    self.n_experts / self.n_group
                ),
            );
        }
        let finite = |field: &'static str, value: f64, positive: bool| {
            let ok = value.is_finite() && if positive { value > 0.0 } else { value >= 0.0 };
            if ok {
                Ok(())
            } else {
                let want = if positive { "> 0" } else { "≥ 0" };
                invalid(
                    field,
                    format!("must be a finite number {want}, got {value}"),
                )
            }
        };
        finite("routed_scaling", self.routed_scaling, true)?;
        finite("bias_update_rate", self.bias_update_rate, false)?;
        finite("load_balancing_coef", self.load_balancing_coef, false)?;
        finite("z_loss_coef", self.z_loss_coef, false)?;
        if let Some(c) = self.capacity_factor {
            finite("capacity_factor", c, true)?;
        }
        if !(self.jitter.is_finite() && (0.0..1.0).contains(&self.jitter)) {
            return invalid("jitter", format!("must be in [0, 1), got {}", self.jitter));
        }
        if self.scoring == Scoring::SparseMixer {
            // Its weights are its own: no renormalising, bias, groups or input weighting.
            for (field, set) in [
                ("normalize_top_k", self.normalize_top_k),
                ("selection_bias", self.selection_bias),
                ("n_group", self.n_group > 1),
                ("weight_input", self.weight_input),
            ] {
                if set {
                    return invalid(
                        field,
                        "is not available with `scoring = \"sparse_mixer\"`".into(),
                    );
                }
            }
        }
        if self.n_shared_experts == 0 && (self.shared_d_ff.is_some() || self.shared_expert_gate) {
            return invalid(
                "n_shared_experts",
                "`shared_d_ff` and `shared_expert_gate` need at least one shared expert".into(),
            );
        }
        if self.shared_d_ff == Some(0) {
            return Err(ConfigError::ZeroSize {
                field: "shared_d_ff",
            });
        }
        if let Some(shared) = self.shared_config() {
            shared.validate()?;
        }
        Ok(())
    }

    /// The number of parameters: every routed expert, the router, the shared experts and their
    /// gate, and the selection bias (`n_experts` values, not trained by gradients).
    pub fn num_params(&self) -> usize {
        self.routed_params(self.n_experts)
    }

    /// The parameters one token uses: `top_k` routed experts, the router, the shared experts
    /// and their gate (and the selection bias).
    pub fn active_params(&self) -> usize {
        self.routed_params(self.top_k)
    }

    fn routed_params(&self, experts: usize) -> usize {
        let d = self.expert.d_model;
        let router = d
            .saturating_mul(self.n_experts)
            .saturating_add(if self.router_bias { self.n_experts } else { 0 });
        let shared = self.shared_config().map_or(0, |c| c.num_params())
            + if self.shared_expert_gate { d } else { 0 }
            + if self.selection_bias {
                self.n_experts
            } else {
                0
            };
        experts
            .saturating_mul(self.expert.num_params())
            .saturating_add(router)
            .saturating_add(shared)
    }

    /// Builds the layer on `device`.
    ///
    /// # Panics
    ///
    /// If the config is invalid (see [`validate`](Self::validate)); use
    /// [`try_init`](Self::try_init) to get the error instead.
    pub fn init(&self, device: &burn::tensor::Device) -> crate::Moe {
        self.try_init(device)
            .unwrap_or_else(|err| panic!("invalid MoeConfig: {err}"))
    }

    /// Builds the layer on `device`, or says why the config is invalid.
    pub fn try_init(&self, device: &burn::tensor::Device) -> Result<crate::Moe, ConfigError> {
        self.validate()?;
        Ok(crate::Moe::new(self, device))
    }

    /// Parses and validates a TOML config.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let config: Self = parse_toml(text, &["expert", "activation"])?;
        config.validate()?;
        Ok(config)
    }

    /// Parses and validates a JSON config.
    pub fn from_json(text: &str) -> Result<Self, ConfigError> {
        let config: Self = parse_json(text, &["expert", "activation"])?;
        config.validate()?;
        Ok(config)
    }

    /// The config as TOML, every field written out.
    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("a MoeConfig is representable in TOML")
    }

    /// The config as pretty-printed JSON, every field written out.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a MoeConfig is representable in JSON")
    }
}
