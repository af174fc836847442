//! # The sparse layers of Hugging Face MoE checkpoints
//!
//! A sparse block is found by its keys: a router (`{prefix}gate.weight`, `router.weight`, or
//! `router.layer.weight`) with experts beside it (`{prefix}experts.…`, or packed); its layer
//! is the prefix's first number. [`HfModel::moe_config`] reads the layer's shape and routing
//! from `config.json` and the keys (a `shared_expert.` and its `shared_expert_gate`;
//! `shared_experts.`; an `e_score_correction_bias`, which means DeepSeek-V3's sigmoid routing),
//! [`HfModel::moe_layers`] says which layers are sparse, [`HfModel::load_moe_layer`] loads one
//! (router, experts, shared experts; `moe_weights.rs`), and
//! [`Moe::save_safetensors_as`](crate::Moe::save_safetensors_as) writes one back in a
//! [`MoeScheme`]'s names:
//!
//! | `model_type` | layer `i` | experts | config keys |
//! |---|---|---|---|
//! | `mixtral` | `model.layers.i.block_sparse_moe.` | `experts.{e}.w1/w3/w2` | `num_local_experts`, `num_experts_per_tok`, `intermediate_size`, `router_jitter_noise` |
//! | `qwen2_moe` | `model.layers.i.mlp.` | `experts.{e}.{gate,up,down}_proj`, `shared_expert.*`, `shared_expert_gate` | `num_experts`, `moe_intermediate_size`, `norm_topk_prob`, `shared_expert_intermediate_size` |
//! | `qwen3_moe` | `model.layers.i.mlp.` | `experts.{e}.{gate,up,down}_proj` | `num_experts` (or `num_local_experts`), `moe_intermediate_size`, `norm_topk_prob` |
//! | `olmoe` | `model.layers.i.mlp.` | `experts.{e}.{gate,up,down}_proj` | `num_experts`, `intermediate_size`, `norm_topk_prob` (false: the top k not renormalised) |
//! | `qwen3_next` | `model.layers.i.mlp.` | as `qwen2_moe` | as `qwen2_moe` (found by the same keys: no code of its own) |
//! | `deepseek_v2` | `model.layers.i.mlp.` | as `deepseek_v3`, without the bias | `n_routed_experts`, `moe_intermediate_size`, `topk_method` (`greedy`, `group_limited_greedy`: groups scored by their best), `n_shared_experts`, `routed_scaling_factor` |
//! | `granitemoe` | `model.layers.i.block_sparse_moe.` | `router.layer.weight`; packed `input_linear.weight`, `output_linear.weight` | `num_local_experts`, `intermediate_size` (softmax of the top-k logits) |
//! | `deepseek_v3` | `model.layers.i.mlp.` | `experts.{e}.{gate,up,down}_proj`, `shared_experts.*`, `gate.e_score_correction_bias` | `n_routed_experts`, `moe_intermediate_size`, `n_group`, `topk_group`, `n_shared_experts`, `routed_scaling_factor`, `norm_topk_prob` |
//! | `dbrx` | `transformer.blocks.i.ffn.` | `router.layer.weight`; `experts.mlp.w1`, `v1`, `w2`, each `[E·d_ff, d_model]` | in `ffn_config`: `moe_num_experts`, `moe_top_k`, `ffn_hidden_size`, `ffn_act_fn` (`{"name": …}`), `moe_normalize_expert_weights` (1: renormalised) |
//! | `gpt_oss` | `model.layers.i.mlp.` | `router.weight`, `router.bias`; packed `experts.gate_up_proj` `[E, d_model, 2·d_ff]` (gate and up interleaved) and `experts.down_proj` `[E, d_ff, d_model]`, with `_bias` `[E, 2·d_ff]`, `[E, d_model]` | `num_local_experts`, `intermediate_size`, `swiglu_limit` (the clamped SwiGLU, [`Activation::SwigluOai`]) (softmax of the top-k logits) |
//! | `ernie4_5_moe` | `model.layers.i.mlp.` | `experts.{e}.{gate,up,down}_proj`, `shared_experts.*`, `moe_statics.e_score_correction_bias` `[1, E]` | `moe_num_experts`, `moe_k`, `moe_intermediate_size`, `moe_num_shared_experts` (softmax scores chosen with the bias: named in `SOFTMAX_SELECTION`) |
//! | `hunyuan_v1_moe` | `model.layers.i.mlp.` | `gate.wg.weight`; `experts.{e}.{gate,up,down}_proj`, `shared_mlp.*` | `num_experts`, `moe_topk`, `intermediate_size` |
//! | `minimax_m2` | `model.layers.i.block_sparse_moe.` | `experts.{e}.w1/w3/w2`, `e_score_correction_bias` | `num_local_experts`, `intermediate_size`, `scoring_func` |
//! | `lfm2_moe` | `model.layers.i.feed_forward.` | `experts.{e}.w1/w3/w2`, `expert_bias` | `num_experts`, `moe_intermediate_size`, `norm_topk_prob`, `routed_scaling_factor` (SiLU: named in the dense reader's defaults) |
//! | `afmoe` | `model.layers.i.mlp.` | `router.gate.weight`; `experts.{e}.{gate,up,down}_proj`, `shared_experts.*`, `expert_bias` | `num_experts`, `moe_intermediate_size`, `num_shared_experts`, `route_scale` |
//! | `phimoe` | `model.layers.i.block_sparse_moe.` | as `mixtral` | `router_jitter_noise` (SparseMixer's `ε`: named in `SPARSE_MIXER`) |
//! | `llama4_text`, `llama4` | `model.layers.i.feed_forward.` | `router.weight`; packed `experts.gate_up_proj` `[E, d_model, 2·d_ff]` (gate half first), `experts.down_proj` `[E, d_ff, d_model]`; `shared_expert.*` | `num_local_experts`, `intermediate_size` (the dense layers': `intermediate_size_mlp`), `moe_layers` (sigmoid top-k scaling the expert's input: the one routing no field states) |
//!
//! Families no row names load by the same keys and fields (tested against `transformers`:
//! Qwen3.5-MoE, GLM-4-MoE and -Lite, dots.llm1, EXAONE-MoE, MiniMax, FlexOlmo, Jamba,
//! GraniteMoeShared, Cohere2-MoE; the rows from `ernie4_5_moe` to `phimoe` were found the same
//! way, and have rows for their schemes or the one table entry they need): a
//! selection bias where any of them keeps it (`SELECTION_BIAS`), the scoring function a field
//! names (`SCORING_FIELDS`), the routers and shared experts of `ROUTERS` and `SHARED`.
//! PhiMoE's SparseMixer routing, which no field states, is named in `SPARSE_MIXER`. What the
//! layer cannot compute is refused by the field or tensor that shows it.
//!
//! Every type also accepts the packed layout that `transformers` holds in memory (and some
//! exports write): `experts.gate_up_proj` `[E, 2·d_ff, d_model]` and `experts.down_proj`
//! `[E, d_model, d_ff]`, or both transposed (gpt-oss's and Llama 4's layout; the two shapes
//! together tell which, since `d_model` cannot be both `d_ff` and `2·d_ff`). All use `hidden_act`, `hidden_size` and `router_aux_loss_coef`. The
//! dense layers of these models (DeepSeek's first `first_k_dense_replace`, Qwen's
//! `mlp_only_layers`) load with [`HfModel::load_layer`].

use serde_json::Value;

use crate::{Activation, Error, HfModel, MoeConfig, Scoring};

/// The names and layout of a sparse block in a Hugging Face checkpoint, as
/// [`Moe::save_safetensors_as`](crate::Moe::save_safetensors_as) writes them (and [`HfModel::moe_scheme`] finds them): the
/// counterpart of [`Scheme`](crate::Scheme) for [`Moe`](crate::Moe).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MoeScheme {
    /// Mixtral: `gate.weight`, `experts.{e}.w1/w3/w2`.
    Mixtral,
    /// Qwen2-MoE and Qwen3-Next: `experts.{e}.{gate,up,down}_proj`, one `shared_expert.*` and
    /// its `shared_expert_gate`.
    Qwen2Moe,
    /// Qwen3-MoE and OLMoE: `experts.{e}.{gate,up,down}_proj`, nothing else.
    Qwen3Moe,
    /// DeepSeek-V2: as Qwen3-MoE, plus ungated `shared_experts.*`.
    DeepseekV2,
    /// DeepSeek-V3: as DeepSeek-V2, plus `gate.e_score_correction_bias`.
    DeepseekV3,
    /// GraniteMoE: `router.layer.weight`, the experts packed as `input_linear.weight`
    /// `[E, 2·d_ff, d_model]` (gate rows first) and `output_linear.weight` `[E, d_model, d_ff]`.
    GraniteMoe,
    /// DBRX: `router.layer.weight`; the experts' rows stacked as `experts.mlp.w1` (gate) and
    /// `experts.mlp.v1` (up), each `[E·d_ff, d_model]`, and `experts.mlp.w2` (down,
    /// `[E·d_ff, d_model]`: each expert's `[d_ff, d_model]` as its product takes it).
    Dbrx,
    /// gpt-oss: `router.weight` and `router.bias`; the experts packed as `experts.gate_up_proj`
    /// `[E, d_model, 2·d_ff]` (gate and up interleaved, gate first) and `experts.down_proj`
    /// `[E, d_ff, d_model]`, each with a `_bias`.
    GptOss,
    /// Llama 4: `router.weight`; the experts packed as `experts.gate_up_proj`
    /// `[E, d_model, 2·d_ff]` (the gate half first) and `experts.down_proj` `[E, d_ff, d_model]`;
    /// one ungated `shared_expert.*`.
    Llama4,
    /// ERNIE 4.5 MoE: `gate.weight`, `experts.{e}.{gate,up,down}_proj`, ungated
    /// `shared_experts.*`, and the selection bias as `moe_statics.e_score_correction_bias`
    /// `[1, E]`.
    Ernie45Moe,
    /// HunYuan-MoE: `gate.wg.weight`, `experts.{e}.{gate,up,down}_proj`, one ungated
    /// `shared_mlp.*`.
    HunyuanMoe,
    /// MiniMax-M2: `gate.weight`, `experts.{e}.w1/w3/w2`, the selection bias
    /// `e_score_correction_bias` beside the router.
    MinimaxM2,
    /// LFM2-MoE: `gate.weight`, `experts.{e}.w1/w3/w2`, the selection bias `expert_bias`.
    Lfm2Moe,
    /// AFMoE: `router.gate.weight`, `experts.{e}.{gate,up,down}_proj`, ungated
    /// `shared_experts.*`, the selection bias `expert_bias`.
    Afmoe,
}

/// The names a sparse block's router has (`{prefix}…`), and those of its experts when they
/// are packed: `([gate; up] [E, 2·d_ff, d_model], down [E, d_model, d_ff])`. `transformers`
/// holds every type packed as `experts.gate_up_proj` in memory (and some exports write it);
/// GraniteMoE's files are packed as `input_linear`/`output_linear`.
/// HunYuan-MoE's router is `gate.wg`, AFMoE's `router.gate`.
const ROUTERS: [&str; 5] = [
    "gate.weight",
    "router.layer.weight",
    "router.weight",
    "gate.wg.weight",
    "router.gate.weight",
];
/// Where a block keeps DeepSeek-V3's selection bias: on its router (DeepSeek-V3, GLM-4-MoE,
/// dots.llm1) or beside it (EXAONE-MoE, MiniMax-M2), in ERNIE 4.5's `moe_statics` (`[1, E]`),
/// or as LFM2-MoE's and AFMoE's `expert_bias`.
pub(super) const SELECTION_BIAS: [&str; 4] = [
    "gate.e_score_correction_bias",
    "e_score_correction_bias",
    "moe_statics.e_score_correction_bias",
    "expert_bias",
];
/// The fields that name the router's scoring function (DeepSeek-V3 and MiniMax-M2's
/// `scoring_func`, AFMoE's `score_func`, Cohere2-MoE's `expert_selection_fn`): `softmax` or
/// `sigmoid`. Without one, a selection bias means sigmoid scores (DeepSeek-V3), except for the
/// types of [`SOFTMAX_SELECTION`].
const SCORING_FIELDS: [&str; 3] = ["scoring_func", "score_func", "expert_selection_fn"];
/// The model types that choose by softmax scores plus a selection bias with no field to say
/// so: ERNIE 4.5's `moe_statics`.
const SOFTMAX_SELECTION: [&str; 1] = ["ernie4_5_moe"];
/// The model types that route with SparseMixer ([`Scoring::SparseMixer`]), which no field
/// states: PhiMoE (its `router_jitter_noise` the band's `ε`).
const SPARSE_MIXER: [&str; 1] = ["phimoe"];
/// Where a block keeps its shared experts: Qwen2-MoE's and Llama 4's one `shared_expert`,
/// HunYuan-MoE's one `shared_mlp`, or DeepSeek's `shared_experts` (`n_shared_experts` of the
/// experts' width, stored as one MLP).
pub(super) const SHARED: [&str; 3] = ["shared_expert.", "shared_mlp.", "shared_experts."];
/// The model types whose routing no config field states: Llama 4's sigmoid top-k, whose weight
/// scales the expert's input ([`MoeConfig::weight_input`]), not renormalised.
const INPUT_WEIGHTED: [&str; 2] = ["llama4_text", "llama4"];
/// The model types that leave the top-k weights as they are with no `norm_topk_prob` field to
/// say so (a config without one renormalises, as Mixtral does).
const UNNORMALISED: [&str; 1] = ["jamba"];
pub(super) const PACKED: [(&str, &str); 2] = [
    ("experts.gate_up_proj", "experts.down_proj"),
    ("input_linear.weight", "output_linear.weight"),
];

impl MoeScheme {
    /// Every scheme.
    pub const ALL: [MoeScheme; 14] = [
        MoeScheme::Mixtral,
        MoeScheme::Qwen2Moe,
        MoeScheme::Qwen3Moe,
        MoeScheme::DeepseekV2,
        MoeScheme::DeepseekV3,
        MoeScheme::GraniteMoe,
        MoeScheme::Dbrx,
        MoeScheme::GptOss,
        MoeScheme::Llama4,
        MoeScheme::Ernie45Moe,
        MoeScheme::HunyuanMoe,
        MoeScheme::MinimaxM2,
        MoeScheme::Lfm2Moe,
        MoeScheme::Afmoe,
    ];

    /// The scheme's name: the `model_type` it is named after.
    pub const fn name(self) -> &'static str {
        match self {
            MoeScheme::Mixtral => "mixtral",
            MoeScheme::Qwen2Moe => "qwen2_moe",
            MoeScheme::Qwen3Moe => "qwen3_moe",
            MoeScheme::DeepseekV2 => "deepseek_v2",
            MoeScheme::DeepseekV3 => "deepseek_v3",
            MoeScheme::GraniteMoe => "granitemoe",
            MoeScheme::Dbrx => "dbrx",
            MoeScheme::GptOss => "gpt_oss",
            MoeScheme::Llama4 => "llama4",
            MoeScheme::Ernie45Moe => "ernie4_5_moe",
            MoeScheme::HunyuanMoe => "hunyuan_v1_moe",
            MoeScheme::MinimaxM2 => "minimax_m2",
            MoeScheme::Lfm2Moe => "lfm2_moe",
            MoeScheme::Afmoe => "afmoe",
        }
    }
}

impl std::fmt::Display for MoeScheme {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for MoeScheme {
    type Err = Error;

    /// A scheme's name, or a `model_type` that writes it (`olmoe`: Qwen3-MoE's names;
    /// `qwen3_next`: Qwen2-MoE's; `llama4_text`: Llama 4's).
    fn from_str(name: &str) -> Result<Self, Error> {
        let normal = crate::normal_name(name);
        match normal.as_str() {
            "olmoe" => return Ok(MoeScheme::Qwen3Moe),
            "qwen3_next" => return Ok(MoeScheme::Qwen2Moe),
            "llama4_text" => return Ok(MoeScheme::Llama4),
            _ => {}
        }
        Self::ALL
            .into_iter()
            .find(|s| s.name() == normal)
            .ok_or_else(|| {
                Error::Scheme(format!(
                    "unknown MoE scheme `{name}`; known: {}, olmoe, qwen3_next, llama4_text",
                    Self::ALL.map(MoeScheme::name).join(", ")
                ))
            })
    }
}

impl HfModel {
    /// The sparse blocks of the checkpoint, found by their keys: a prefix with a router (one of
    /// `ROUTERS`) and experts beside it (`{prefix}experts.…`, or packed), and its layer (the
    /// prefix's first number), in layer order.
    fn sparse_blocks(&self) -> Vec<(usize, String)> {
        // The prefixes with experts beside them, collected in one pass over the keys.
        let with_experts: std::collections::HashSet<&str> = self
            .files
            .keys()
            .filter_map(|k| {
                let (cut, _) = k
                    .match_indices("experts.")
                    .find(|&(i, _)| i == 0 || k[..i].ends_with('.'))?;
                Some(&k[..cut])
            })
            .collect();
        let mut blocks: Vec<(usize, String)> = self
            .files
            .keys()
            // Every router name a key ends with (AFMoE's `router.gate.weight` also ends with
            // `gate.weight`): the prefixes without experts are dropped below.
            .flat_map(|key| ROUTERS.iter().filter_map(|r| key.strip_suffix(r)))
            .filter(|p| p.is_empty() || p.ends_with('.'))
            .filter(|p| {
                with_experts.contains(p)
                    || PACKED
                        .iter()
                        .any(|(gate_up, _)| self.files.info(&format!("{p}{gate_up}")).is_some())
            })
            .filter_map(|p| Some((super::layer_of(p)?, p.to_string())))
            .collect();
        blocks.sort();
        blocks.dedup();
        blocks
    }

    /// Whether the experts are gpt-oss's: a `swiglu_limit` field means OpenAI's clamped SwiGLU
    /// ([`Activation::SwigluOai`]), whose packed `gate_up_proj` interleaves gate and up. ffn's
    /// activation has gpt-oss's constants; another `swiglu_limit` or `swiglu_alpha` is refused.
    fn clamped_swiglu(&self) -> Result<bool, Error> {
        if self.first_field(&["swiglu_limit"]).is_none() {
            return Ok(false);
        }
        for (field, ours) in [
            ("swiglu_limit", Activation::OAI_LIMIT),
            ("swiglu_alpha", Activation::OAI_ALPHA),
        ] {
            let stated = self.number(field, ours)?;
            if stated != ours {
                return Err(self.error(
                    field,
                    format!("is {stated}; ffn's clamped SwiGLU (swiglu_oai) has {ours}"),
                ));
            }
        }
        Ok(true)
    }

    /// The names of the block's per-expert projections: Mixtral's `w1`/`w3`/`w2` or
    /// `{gate,up,down}_proj`.
    pub(super) fn expert_names(&self, prefix: &str) -> [&'static str; 3] {
        if self
            .files
            .info(&format!("{prefix}experts.0.w1.weight"))
            .is_some()
        {
            ["w1", "w3", "w2"]
        } else {
            ["gate_proj", "up_proj", "down_proj"]
        }
    }

    /// The key of the router of the block at `prefix`.
    pub(super) fn router_key(&self, prefix: &str) -> String {
        let key = |r: &str| format!("{prefix}{r}");
        ROUTERS
            .iter()
            .map(|r| key(r))
            .find(|k| self.files.info(k).is_some())
            .unwrap_or_else(|| key(ROUTERS[0]))
    }

    /// The [`MoeConfig`] of the model's sparse layers: the experts' and router's shapes from
    /// `config.json`, the routing from its fields (`norm_topk_prob`, `router_jitter_noise`,
    /// `routed_scaling_factor`, `topk_method` with `n_group`/`topk_group`) and from the keys
    /// (a shared expert and its gate, `shared_experts`, DeepSeek-V3's
    /// `e_score_correction_bias`, which means sigmoid scores; biases; gpt-oss's
    /// `swiglu_limit`). Which layers it is for: [`moe_layers`](Self::moe_layers); the others
    /// load with [`load_layer`](Self::load_layer).
    pub fn moe_config(&self) -> Result<MoeConfig, Error> {
        let kind = self.model_type();
        let Some((_, prefix)) = self.sparse_blocks().into_iter().next() else {
            return Err(self.error(
                "model_type",
                format!(
                    "`{kind}` has no mixture-of-experts layers (no router `gate.weight` with \
                     `experts` beside it)"
                ),
            ));
        };
        let has = |suffix: &str| self.files.info(&format!("{prefix}{suffix}")).is_some();
        let has_any = |stem: &str| {
            let stem = format!("{prefix}{stem}");
            self.files.keys().any(|k| k.starts_with(&stem))
        };
        let mut expert = self.ffn_config()?;
        let first =
            |fields: &[&'static str]| self.size(self.first_field(fields).unwrap_or(fields[0]));
        expert.d_ff = first(&[
            "moe_intermediate_size",
            "intermediate_size",
            "ffn_hidden_size",
        ])?;
        if self.clamped_swiglu()? {
            expert = expert
                .with_activation(Activation::SwigluOai)
                .with_gated(true);
        }
        // The experts' biases are what the file holds (packed, or expert 0's).
        let names = self.expert_names(&prefix);
        let bias = |packed: &str, name: &str| has(packed) || has(&format!("experts.0.{name}.bias"));
        let packed_bias = bias("experts.gate_up_proj_bias", names[0]);
        expert = expert
            .with_bias_gate(packed_bias)
            .with_bias_up(packed_bias || has(&format!("experts.0.{}.bias", names[1])))
            .with_bias_down(bias("experts.down_proj_bias", names[2]));
        let router_bias = self
            .files
            .info(&bias_key(&self.router_key(&prefix)))
            .is_some();
        let n_experts = first(&[
            "num_local_experts",
            "num_experts",
            "n_routed_experts",
            "moe_num_experts",
        ])?;
        let top_k_field = self
            .first_field(&["num_experts_per_tok", "moe_top_k", "moe_k", "moe_topk"])
            .unwrap_or("num_experts_per_tok");
        let top_k = self.size(top_k_field)?;
        if top_k > n_experts {
            return Err(self.error(
                top_k_field,
                format!("{top_k} is more than the {n_experts} experts"),
            ));
        }
        let boolean = |field: &str, default: bool| match self.config.get(field) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(self.error(field, format!("must be a boolean, got {v}"))),
        };
        // Mixtral's config has no `norm_topk_prob`: it renormalises the top k. DBRX divides
        // the top k by their p-norm (`moe_normalize_expert_weights`): p = 1 renormalises them
        // (they are positive), null leaves them.
        let normalize = match self.config.get("moe_normalize_expert_weights") {
            None => boolean("norm_topk_prob", !UNNORMALISED.contains(&kind))?,
            Some(Value::Null) => false,
            Some(p) if p.as_f64() == Some(1.0) => true,
            Some(p) => {
                return Err(self.error(
                    "moe_normalize_expert_weights",
                    format!("a {p}-norm of the top-k weights is not supported (1 or null)"),
                ));
            }
        };
        let coef = self
            .first_field(&["router_aux_loss_coef", "moe_loss_weight"])
            .map_or(Ok(0.001), |f| self.number(f, 0.001))?;
        let jitter = self
            .first_field(&["router_jitter_noise", "moe_jitter_eps"])
            .map_or(Ok(0.0), |f| self.number(f, 0.0))?;
        let mut config = MoeConfig::new(expert, n_experts, top_k)
            .with_router_bias(router_bias)
            .with_loss_coefs(coef, 0.0)
            .with_jitter(jitter)
            .with_normalize_top_k(normalize);
        let scaling = self
            .first_field(&["routed_scaling_factor", "route_scale"])
            .map_or(Ok(1.0), |f| self.number(f, 1.0))?;
        config = config.with_routed_scaling(scaling);
        // Cohere2-MoE may average the routed and shared outputs instead of adding them.
        let combination = self.string("shared_expert_combination_strategy", "sum")?;
        if combination != "sum" {
            return Err(self.error(
                "shared_expert_combination_strategy",
                format!(
                    "`{combination}`: ffn adds the shared experts' output to the routed \
                     experts' (`sum`)"
                ),
            ));
        }
        if let Some(shared) = SHARED[..2].iter().find(|s| has_any(s)) {
            // Qwen2-MoE and Qwen3-Next: one shared expert of its own width, gated by σ(x·w);
            // Llama 4 and HunYuan-MoE: ungated, and no field states its width (its up
            // projection's rows do).
            let width = match self.first_field(&["shared_expert_intermediate_size"]) {
                Some(field) => self.size(field)?,
                None => {
                    let key = format!("{prefix}{shared}up_proj.weight");
                    match self.files.info(&key).map(|i| i.shape.as_slice()) {
                        Some([rows, _]) => *rows,
                        _ => {
                            return Err(self.error(
                                "shared_expert_intermediate_size",
                                format!("missing, and no 2-D `{key}` to read it from"),
                            ));
                        }
                    }
                }
            };
            config = config.with_shared_experts(1, Some(width), has("shared_expert_gate.weight"));
        } else if has_any("shared_experts.") {
            // DeepSeek, ERNIE 4.5, AFMoE: `n_shared_experts` ungated shared experts of the
            // experts' width.
            let count = first(&[
                "n_shared_experts",
                "num_shared_experts",
                "moe_num_shared_experts",
            ])?;
            config = config.with_shared_experts(count, None, false);
        }
        if SPARSE_MIXER.contains(&kind) {
            config = config
                .with_scoring(Scoring::SparseMixer)
                .with_normalize_top_k(false);
        }
        if INPUT_WEIGHTED.contains(&kind) {
            config = config
                .with_scoring(Scoring::Sigmoid)
                .with_normalize_top_k(false)
                .with_weight_input(true);
        }
        let selection_bias = SELECTION_BIAS.iter().any(|key| has(key));
        let method = self.string("topk_method", "")?;
        let scoring_field = self.first_field(&SCORING_FIELDS);
        let scoring = match scoring_field {
            Some(field) => match self.string(field, "")?.as_str() {
                "softmax" => Some(Scoring::Softmax),
                "sigmoid" => Some(Scoring::Sigmoid),
                other => {
                    return Err(self.error(
                        field,
                        format!("`{other}` is not a scoring ffn's router has (softmax, sigmoid)"),
                    ));
                }
            },
            None => None,
        };
        if let Some(scoring) = scoring {
            config = config.with_scoring(scoring);
            // Cohere2-MoE's softmax is over the top-k logits: the top k renormalised.
            if scoring == Scoring::Softmax && scoring_field == Some("expert_selection_fn") {
                config = config.with_normalize_top_k(true);
            }
        }
        if selection_bias {
            // DeepSeek-V3's auxiliary-loss-free routing (`noaux_tc`): sigmoid scores (unless a
            // field or the type says softmax: ERNIE 4.5), a selection bias, and where
            // `n_group` is stated, groups scored by their two best.
            let softmax = SOFTMAX_SELECTION.contains(&kind);
            config = config
                .with_scoring(scoring.unwrap_or(if softmax {
                    Scoring::Softmax
                } else {
                    Scoring::Sigmoid
                }))
                .with_selection_bias(true, 0.001);
            if self.first_field(&["n_group"]).is_some() {
                config = config.with_groups(self.size("n_group")?, self.size("topk_group")?);
            }
        } else if method == "group_limited_greedy" {
            // DeepSeek-V2: softmax scores, groups scored by their best.
            config = config
                .with_groups(self.size("n_group")?, self.size("topk_group")?)
                .with_group_score_top(1);
        } else if !matches!(method.as_str(), "" | "greedy") {
            return Err(self.error(
                "topk_method",
                format!(
                    "`{method}` is not a routing this reader knows (greedy, \
                     group_limited_greedy, or noaux_tc with an e_score_correction_bias)"
                ),
            ));
        }
        config.validate().map_err(|e| {
            let field = match &e {
                crate::ConfigError::Moe { field, .. } => field.to_string(),
                _ => "config.json".into(),
            };
            self.error(&field, e.to_string())
        })?;
        Ok(config)
    }

    /// The scheme the sparse blocks are stored in, from their keys and routing: DBRX's
    /// `experts.mlp`, HunYuan's `gate.wg`, AFMoE's `router.gate`, ERNIE 4.5's `moe_statics`,
    /// `w1` experts with LFM2-MoE's `expert_bias` or MiniMax-M2's `e_score_correction_bias`,
    /// GraniteMoE's `router.layer`, a biased router or the clamped SwiGLU (gpt-oss), input-weighted routing
    /// (Llama 4), `w1` experts (Mixtral), a gated `shared_expert` (Qwen2-MoE), an
    /// `e_score_correction_bias` (DeepSeek-V3), `shared_experts` (DeepSeek-V2), else
    /// Qwen3-MoE's names.
    pub fn moe_scheme(&self) -> Result<MoeScheme, Error> {
        let config = self.moe_config()?;
        let (_, prefix) = self
            .sparse_blocks()
            .into_iter()
            .next()
            .expect("moe_config found one");
        let has = |suffix: &str| self.files.info(&format!("{prefix}{suffix}")).is_some();
        Ok(if has("experts.mlp.w1") {
            MoeScheme::Dbrx
        } else if has("gate.wg.weight") {
            MoeScheme::HunyuanMoe
        } else if has("router.gate.weight") {
            MoeScheme::Afmoe
        } else if has("moe_statics.e_score_correction_bias") {
            MoeScheme::Ernie45Moe
        } else if has("experts.0.w1.weight") && has("expert_bias") {
            MoeScheme::Lfm2Moe
        } else if has("experts.0.w1.weight") && has("e_score_correction_bias") {
            MoeScheme::MinimaxM2
        } else if has("router.layer.weight") {
            MoeScheme::GraniteMoe
        } else if config.router_bias || config.expert.activation == Activation::SwigluOai {
            MoeScheme::GptOss
        } else if config.weight_input {
            MoeScheme::Llama4
        } else if has("experts.0.w1.weight") {
            MoeScheme::Mixtral
        } else if config.shared_expert_gate {
            MoeScheme::Qwen2Moe
        } else if config.selection_bias {
            MoeScheme::DeepseekV3
        } else if config.n_shared_experts > 0 && !has("shared_expert.up_proj.weight") {
            MoeScheme::DeepseekV2
        } else {
            MoeScheme::Qwen3Moe
        })
    }

    /// The layers whose FFN is a sparse block, found by their keys (a router with experts
    /// beside it), in order; empty for a dense model. Where `config.json` says which layers
    /// are sparse, the file must agree, or the error names the field: `moe_layers` (Llama 4),
    /// `first_k_dense_replace` with `moe_layer_freq` (DeepSeek), `interleave_moe_layer_step`
    /// (Llama 4), `expert_layer_period` with `expert_layer_offset` (Jamba), `decoder_sparse_step`
    /// with `mlp_only_layers` (Qwen-MoE, Qwen3-Next). The other
    /// layers are dense and load with [`load_layer`](Self::load_layer).
    pub fn moe_layers(&self) -> Result<Vec<usize>, Error> {
        let found: Vec<usize> = self.sparse_blocks().into_iter().map(|(l, _)| l).collect();
        if found.is_empty() {
            return Ok(found);
        }
        let layers = self.num_layers()?;
        let list = |field: &str| -> Result<Vec<usize>, Error> {
            match self.config.get(field) {
                None | Some(Value::Null) => Ok(Vec::new()),
                Some(Value::Array(items)) => items
                    .iter()
                    .map(|v| {
                        v.as_u64()
                            .and_then(|n| usize::try_from(n).ok())
                            .ok_or_else(|| self.error(field, format!("holds {v}, not a layer")))
                    })
                    .collect(),
                Some(v) => Err(self.error(field, format!("must be a list of layers, got {v}"))),
            }
        };
        let step = |field: &str| -> Result<usize, Error> {
            let n = self.size(field)?;
            if n == 0 {
                return Err(self.error(field, "must be at least 1"));
            }
            Ok(n)
        };
        let (field, stated): (&str, Vec<usize>) = if self.first_field(&["moe_layers"]).is_some() {
            let mut stated = list("moe_layers")?;
            stated.sort_unstable();
            stated.dedup();
            ("moe_layers", stated)
        } else if self.first_field(&["first_k_dense_replace"]).is_some() {
            let first = self.index("first_k_dense_replace")?;
            let every = match self.first_field(&["moe_layer_freq"]) {
                Some(field) => step(field)?,
                None => 1,
            };
            let sparse = (first..layers).filter(|i| i % every == 0).collect();
            ("first_k_dense_replace", sparse)
        } else if self.first_field(&["interleave_moe_layer_step"]).is_some() {
            let every = step("interleave_moe_layer_step")?;
            let sparse = (0..layers).filter(|i| (i + 1) % every == 0).collect();
            ("interleave_moe_layer_step", sparse)
        } else if self.first_field(&["expert_layer_period"]).is_some() {
            let every = step("expert_layer_period")?;
            let offset = self.index("expert_layer_offset")?;
            let sparse = (0..layers).filter(|i| i % every == offset).collect();
            ("expert_layer_period", sparse)
        } else if self.first_field(&["decoder_sparse_step"]).is_some() {
            let every = step("decoder_sparse_step")?;
            let dense = list("mlp_only_layers")?;
            let sparse = (0..layers)
                .filter(|i| (i + 1) % every == 0 && !dense.contains(i))
                .collect();
            ("decoder_sparse_step", sparse)
        } else {
            return Ok(found);
        };
        if stated != found {
            let show = |layers: &[usize]| {
                let shown: Vec<String> = layers.iter().take(16).map(usize::to_string).collect();
                let more = if layers.len() > 16 { ", …" } else { "" };
                format!("[{}{more}]", shown.join(", "))
            };
            return Err(self.error(
                field,
                format!(
                    "makes layers {} sparse, but the file's routers are in layers {}",
                    show(&stated),
                    show(&found)
                ),
            ));
        }
        Ok(found)
    }

    /// The key prefix of layer `layer`'s sparse block (its router is `{prefix}gate.weight`); an
    /// error for a dense layer or a model without sparse layers.
    pub fn moe_layer_prefix(&self, layer: usize) -> Result<String, Error> {
        self.moe_config()?;
        let layers = self.num_layers()?;
        if layer >= layers {
            return Err(Error::LayerOutOfRange { layer, layers });
        }
        let blocks = self.sparse_blocks();
        blocks
            .iter()
            .find(|(l, _)| *l == layer)
            .map(|(_, p)| p.clone())
            .ok_or_else(|| Error::MissingTensor {
                key: format!(
                    "{}gate.weight",
                    super::at_layer(&blocks[0].1, &layer.to_string())
                ),
                hint: format!(
                    " (layer {layer} has no router: a dense layer loads with `load_layer`)"
                ),
            })
    }
}

/// The bias beside a weight: `….weight` → `….bias`.
pub(super) fn bias_key(weight: &str) -> String {
    format!("{}bias", weight.strip_suffix("weight").unwrap_or(weight))
}
