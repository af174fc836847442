//! # The sparse layers of Hugging Face MoE checkpoints
//!
//! A sparse block is found by its keys: a router (`{prefix}gate.weight`, `router.weight`, or
//! `router.layer.weight`) with experts beside it (`{prefix}experts.…`, or packed) (the layer is the prefix's first number). [`HfModel::moe_config`] reads the
//! layer's shape and routing from `config.json` and the keys (a `shared_expert.` and its
//! `shared_expert_gate`; `shared_experts.`; an `e_score_correction_bias`, which means
//! DeepSeek-V3's sigmoid routing), [`HfModel::load_moe_layer`] loads one sparse layer (router,
//! experts, shared experts), and [`Moe::save_safetensors_as`] writes one back in a
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
//! | `llama4_text`, `llama4` | `model.layers.i.feed_forward.` | `router.weight`; packed `experts.gate_up_proj` `[E, d_model, 2·d_ff]` (gate half first), `experts.down_proj` `[E, d_ff, d_model]`; `shared_expert.*` | `num_local_experts`, `intermediate_size` (the dense layers': `intermediate_size_mlp`), `moe_layers` (sigmoid top-k scaling the expert's input: the one routing no field states) |
//!
//! Every type also accepts the packed layout that `transformers` holds in memory (and some
//! exports write): `experts.gate_up_proj` `[E, 2·d_ff, d_model]` and `experts.down_proj`
//! `[E, d_model, d_ff]`, or both transposed (gpt-oss's and Llama 4's layout; the two shapes
//! together tell which, since `d_model` cannot be both `d_ff` and `2·d_ff`). All use `hidden_act`, `hidden_size` and `router_aux_loss_coef`. The
//! dense layers of these models (DeepSeek's first `first_k_dense_replace`, Qwen's
//! `mlp_only_layers`) load with [`HfModel::load_layer`].

use std::path::Path;

use burn::tensor::{Device, Tensor, TensorData};
use serde_json::Value;

use crate::interop::host::{HostTensor, to_host, to_pytorch, transpose};
use crate::interop::safetensors::{TensorFiles, serialize};
use crate::interop::weights::load_param;
use crate::{Activation, Error, HfModel, Moe, MoeConfig, Scheme, Scoring};

/// The names and layout of a sparse block in a Hugging Face checkpoint, as
/// [`Moe::save_safetensors_as`] writes them (and [`HfModel::moe_scheme`] finds them): the
/// counterpart of [`Scheme`] for [`Moe`].
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
}

/// The names a sparse block's router has (`{prefix}…`), and those of its experts when they
/// are packed: `([gate; up] [E, 2·d_ff, d_model], down [E, d_model, d_ff])`. `transformers`
/// holds every type packed as `experts.gate_up_proj` in memory (and some exports write it);
/// GraniteMoE's files are packed as `input_linear`/`output_linear`.
const ROUTERS: [&str; 3] = ["gate.weight", "router.layer.weight", "router.weight"];
/// Where a block keeps DeepSeek-V3's selection bias: on its router (DeepSeek-V3, GLM-4-MoE,
/// dots.llm1) or beside it (EXAONE-MoE).
const SELECTION_BIAS: [&str; 2] = ["gate.e_score_correction_bias", "e_score_correction_bias"];
/// The model types whose routing no config field states: Llama 4's sigmoid top-k, whose weight
/// scales the expert's input ([`MoeConfig::weight_input`]), not renormalised.
const INPUT_WEIGHTED: [&str; 2] = ["llama4_text", "llama4"];
/// The model types that leave the top-k weights as they are with no `norm_topk_prob` field to
/// say so (a config without one renormalises, as Mixtral does).
const UNNORMALISED: [&str; 1] = ["jamba"];
const PACKED: [(&str, &str); 2] = [
    ("experts.gate_up_proj", "experts.down_proj"),
    ("input_linear.weight", "output_linear.weight"),
];

impl MoeScheme {
    /// Every scheme.
    pub const ALL: [MoeScheme; 9] = [
        MoeScheme::Mixtral,
        MoeScheme::Qwen2Moe,
        MoeScheme::Qwen3Moe,
        MoeScheme::DeepseekV2,
        MoeScheme::DeepseekV3,
        MoeScheme::GraniteMoe,
        MoeScheme::Dbrx,
        MoeScheme::GptOss,
        MoeScheme::Llama4,
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
            .filter_map(|key| ROUTERS.iter().find_map(|r| key.strip_suffix(r)))
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
    fn expert_names(&self, prefix: &str) -> [&'static str; 3] {
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
    fn router_key(&self, prefix: &str) -> String {
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
    /// `e_score_correction_bias`, which means sigmoid scores).
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
            .first_field(&["num_experts_per_tok", "moe_top_k"])
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
        config = config.with_routed_scaling(self.number("routed_scaling_factor", 1.0)?);
        if has_any("shared_expert.") {
            // Qwen2-MoE and Qwen3-Next: one shared expert of its own width, gated by σ(x·w);
            // Llama 4: ungated, and no field states its width (its up projection's rows do).
            let width = match self.first_field(&["shared_expert_intermediate_size"]) {
                Some(field) => self.size(field)?,
                None => {
                    let key = format!("{prefix}shared_expert.up_proj.weight");
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
            // DeepSeek: `n_shared_experts` ungated shared experts of the experts' width.
            let count = first(&["n_shared_experts", "num_shared_experts"])?;
            config = config.with_shared_experts(count, None, false);
        }
        if INPUT_WEIGHTED.contains(&kind) {
            config = config
                .with_scoring(Scoring::Sigmoid)
                .with_normalize_top_k(false)
                .with_weight_input(true);
        }
        let selection_bias = SELECTION_BIAS.iter().any(|key| has(key));
        let method = self.string("topk_method", "")?;
        if selection_bias {
            // DeepSeek-V3's auxiliary-loss-free routing (`noaux_tc`): sigmoid scores, a
            // selection bias, groups scored by their two best.
            config = config
                .with_scoring(Scoring::Sigmoid)
                .with_selection_bias(true, 0.001)
                .with_groups(self.size("n_group")?, self.size("topk_group")?);
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

    /// The scheme the sparse blocks are stored in, from their keys and routing: GraniteMoE's
    /// `router.layer`, a biased router or the clamped SwiGLU (gpt-oss), input-weighted routing
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

    /// Builds the layer of [`moe_config`](Self::moe_config) on `device` and loads the router,
    /// experts and shared experts of layer `layer` into it. Every expert `0..n_experts` must be
    /// there with the config's shapes, and nothing else under the block's prefix.
    pub fn load_moe_layer(&mut self, layer: usize, device: &Device) -> Result<Moe, Error> {
        let config = self.moe_config()?;
        let prefix = self.moe_layer_prefix(layer)?;
        // Every tensor is read (and its shape checked against config.json) before the layer
        // is built: a config whose sizes disagree with the file allocates nothing.
        let (e_count, d, f) = (config.n_experts, config.d_model(), config.expert.d_ff);
        let router_key = self.router_key(&prefix);
        let names_of = self.expert_names(&prefix);
        let mut reader = Reader {
            files: &mut self.files,
            used: Vec::new(),
        };

        let router = reader.take(&router_key, &[e_count, d])?;
        let router_bias = if config.router_bias {
            Some(reader.take(&bias_key(&router_key), &[e_count])?)
        } else {
            None
        };
        let bias = if config.selection_bias {
            let key = SELECTION_BIAS
                .iter()
                .map(|key| format!("{prefix}{key}"))
                .find(|key| reader.files.info(key).is_some())
                .expect("moe_config found it");
            Some(reader.take(&key, &[e_count])?)
        } else {
            None
        };
        let expert = &config.expert;
        let interleaved = expert.activation == Activation::SwigluOai;
        let packed = PACKED
            .iter()
            .map(|(gate_up, down)| (format!("{prefix}{gate_up}"), format!("{prefix}{down}")))
            .find(|(gate_up, _)| reader.files.info(gate_up).is_some());
        // [gate, up, down] stacked in burn's layout: [E, d, f], [E, d, f], [E, f, d]; and the
        // biases [E, f], [E, f], [E, d].
        let mut stacked = [Vec::new(), Vec::new(), Vec::new()];
        let mut biases: [Option<Vec<f64>>; 3] = Default::default();
        let dbrx = ["w1", "v1", "w2"].map(|n| format!("{prefix}experts.mlp.{n}"));
        if reader.files.info(&dbrx[0]).is_some() {
            // DBRX: each [E·f, d], expert e's rows e·f..(e + 1)·f; gate (w1) and up (v1) in
            // Linear's layout, down (w2) as the product takes it ([f, d], burn's layout).
            for (i, key) in dbrx.iter().enumerate() {
                let rows = values(&reader.take(key, &[e_count * f, d])?);
                for e in 0..e_count {
                    let block = TensorData::new(rows[e * f * d..(e + 1) * f * d].to_vec(), [f, d]);
                    if i == 2 {
                        stacked[i].extend(values(&block));
                    } else {
                        stacked[i].extend(values(&transpose(&block, f, d)));
                    }
                }
            }
        } else if let Some((packed, down)) = packed {
            // PyTorch's Linear layout, or both transposed (gpt-oss, Llama 4): the last two
            // dimensions of `gate_up` tell which, or where d = 2f those of `down` (d = f and
            // d = 2f cannot both hold). The full shapes are checked as the tensors are read.
            let ends_with = |key: &str, tail: [usize; 2]| {
                reader
                    .files
                    .info(key)
                    .is_some_and(|i| i.shape.len() == 3 && i.shape[1..] == tail)
            };
            let transposed = if d != 2 * f {
                ends_with(&packed, [d, 2 * f])
            } else {
                ends_with(&down, [f, d])
            };
            let (gate_up_shape, down_shape) = if transposed {
                ([e_count, d, 2 * f], [e_count, f, d])
            } else {
                ([e_count, 2 * f, d], [e_count, d, f])
            };
            let gate_up = values(&reader.take(&packed, &gate_up_shape)?);
            let down_values = values(&reader.take(&down, &down_shape)?);
            // Where unit c of the gate (half 0) or of up (half 1) lies along the packed axis:
            // interleaved (gpt-oss: gate, up, gate, up, …) or in halves.
            let at = |half: usize, c: usize| {
                if interleaved {
                    2 * c + half
                } else {
                    half * f + c
                }
            };
            for e in 0..e_count {
                for (half, out) in stacked.iter_mut().take(2).enumerate() {
                    for i in 0..d {
                        out.extend((0..f).map(|c| {
                            let j = at(half, c);
                            if transposed {
                                gate_up[(e * d + i) * 2 * f + j]
                            } else {
                                gate_up[(e * 2 * f + j) * d + i]
                            }
                        }));
                    }
                }
                for c in 0..f {
                    stacked[2].extend((0..d).map(|i| {
                        if transposed {
                            down_values[(e * f + c) * d + i]
                        } else {
                            down_values[(e * d + i) * f + c]
                        }
                    }));
                }
            }
            if expert.bias_gate {
                let b = values(&reader.take(&format!("{packed}_bias"), &[e_count, 2 * f])?);
                for (half, out) in biases.iter_mut().take(2).enumerate() {
                    let units = (0..e_count).flat_map(|e| (0..f).map(move |c| (e, c)));
                    *out = Some(units.map(|(e, c)| b[e * 2 * f + at(half, c)]).collect());
                }
            }
            if expert.bias_down {
                biases[2] = Some(values(
                    &reader.take(&format!("{down}_bias"), &[e_count, d])?,
                ));
            }
        } else {
            let layout = [
                (expert.bias_gate, [f, d]),
                (expert.bias_up, [f, d]),
                (expert.bias_down, [d, f]),
            ];
            for e in 0..e_count {
                for (i, (name, (has_bias, shape))) in names_of.iter().zip(layout).enumerate() {
                    let key = format!("{prefix}experts.{e}.{name}");
                    let w = reader.take(&format!("{key}.weight"), &shape)?;
                    stacked[i].extend(values(&transpose(&w, shape[0], shape[1])));
                    if has_bias {
                        let b = reader.take(&format!("{key}.bias"), &shape[..1])?;
                        biases[i].get_or_insert_with(Vec::new).extend(values(&b));
                    }
                }
            }
        }

        let (shared_prefix, shared_gate) = if config.n_shared_experts == 0 {
            (None, None)
        } else if config.shared_expert_gate {
            (
                Some(format!("{prefix}shared_expert.")),
                Some(reader.take(&format!("{prefix}shared_expert_gate.weight"), &[1, d])?),
            )
        } else if config.shared_d_ff.is_some() {
            (Some(format!("{prefix}shared_expert.")), None)
        } else {
            (Some(format!("{prefix}shared_experts.")), None)
        };
        let Reader { files, used } = reader;
        // Anything else under the prefix (an extra expert, a bias the layer does not have) is
        // an error, except the shared experts' own keys, which their loader checks.
        let unexpected = files.keys().find(|key| {
            key.starts_with(&prefix)
                && !used.iter().any(|u| u == key)
                && !shared_prefix
                    .as_ref()
                    .is_some_and(|p| key.starts_with(p.as_str()))
        });
        if let Some(key) = unexpected {
            let biased = [
                expert.bias_gate,
                expert.bias_up,
                expert.bias_down,
                config.router_bias,
            ];
            let biases = if biased.iter().any(|b| *b) {
                "the biases config.json and the file's other keys imply"
            } else {
                "no biases"
            };
            return Err(Error::UnexpectedTensor {
                key: key.to_string(),
                hint: format!(" (the layer has {e_count} experts of [{f}, {d}] and {biases})"),
            });
        }
        let mut moe = config.try_init(device)?;
        if let (Some(p), Some(shared)) = (&shared_prefix, moe.shared.take()) {
            moe.shared = Some(shared.load_from(files, Scheme::Llama, p)?);
        }
        let [gate, up, down] = stacked;
        let [b_gate, b_up, b_down] = biases;
        Ok(moe.load_parts(Parts {
            router: transpose(&router, e_count, d),
            router_bias,
            selection_bias: bias,
            w_gate: TensorData::new(gate, [e_count, d, f]),
            w_up: TensorData::new(up, [e_count, d, f]),
            w_down: TensorData::new(down, [e_count, f, d]),
            b_gate: b_gate.map(|b| TensorData::new(b, [e_count, f])),
            b_up: b_up.map(|b| TensorData::new(b, [e_count, f])),
            b_down: b_down.map(|b| TensorData::new(b, [e_count, d])),
            shared_gate: shared_gate.map(|g| transpose(&g, 1, d)),
        }))
    }
}

impl Moe {
    /// The bytes of a safetensors file holding this layer under `prefix` (such as
    /// `model.layers.3.mlp.`) in the names and layout of `scheme`, as `save_pretrained`
    /// writes them: the router (and its bias), the experts per expert or packed (and their
    /// biases), the shared experts and their gate, DeepSeek-V3's `e_score_correction_bias`.
    ///
    /// # Errors
    ///
    /// [`Error::Scheme`] for a layer the scheme cannot hold: ungated experts; biases in the
    /// experts or the router (gpt-oss's only, which needs all four); shared experts where the
    /// scheme has none or of another form; a missing selection bias for DeepSeek-V3.
    pub fn to_safetensors_bytes_as(
        &self,
        scheme: MoeScheme,
        prefix: &str,
    ) -> Result<Vec<u8>, Error> {
        let refuse = |what: &str| {
            Err(Error::Scheme(format!(
                "a `{scheme}` MoE layer cannot hold this layer: {what}"
            )))
        };
        let Some(w_gate) = &self.w_gate else {
            return refuse("its experts are ungated");
        };
        let gpt_oss = scheme == MoeScheme::GptOss;
        let biases = [
            self.b_gate.is_some(),
            self.b_up.is_some(),
            self.b_down.is_some(),
            self.router.bias.is_some(),
        ];
        if gpt_oss && biases.contains(&false) {
            return refuse("gpt-oss's router and experts have biases, and this layer's not all");
        }
        if !gpt_oss && biases.contains(&true) {
            return refuse("its experts or its router have biases");
        }
        let deepseek = matches!(scheme, MoeScheme::DeepseekV2 | MoeScheme::DeepseekV3);
        if self.selection_bias.is_some() != (scheme == MoeScheme::DeepseekV3) {
            return refuse("the selection bias is DeepSeek-V3's only, and it needs one");
        }
        // (shared experts, their gate) the scheme holds.
        let shared_form = match scheme {
            MoeScheme::Qwen2Moe => (true, true),
            MoeScheme::DeepseekV2 | MoeScheme::DeepseekV3 => (self.shared.is_some(), false),
            MoeScheme::Llama4 => (true, false),
            MoeScheme::Mixtral
            | MoeScheme::Qwen3Moe
            | MoeScheme::GraniteMoe
            | MoeScheme::Dbrx
            | MoeScheme::GptOss => (false, false),
        };
        if (self.shared.is_some(), self.shared_gate.is_some()) != shared_form {
            return refuse("its shared experts (or their gate) differ from the type's");
        }
        let mut tensors: Vec<(String, HostTensor)> = Vec::new();
        let mut put =
            |name: &str, tensor: HostTensor| tensors.push((format!("{prefix}{name}"), tensor));
        let router = match scheme {
            MoeScheme::GraniteMoe | MoeScheme::Dbrx => "router.layer.weight",
            MoeScheme::GptOss | MoeScheme::Llama4 => "router.weight",
            _ => "gate.weight",
        };
        put(router, to_pytorch(self.router.weight.val()));
        if let Some(bias) = &self.router.bias {
            put(&bias_key(router), to_pytorch(bias.val()));
        }
        if let Some(bias) = &self.selection_bias {
            put("gate.e_score_correction_bias", to_pytorch(bias.val()));
        }
        let [gate, up, down] = [w_gate, &self.w_up, &self.w_down].map(|p| p.val());
        match scheme {
            MoeScheme::Dbrx => {
                // [E·d_ff, d_model] each: gate and up in Linear's layout, down as it is.
                let e = self.n_experts();
                let (d, f) = (self.d_model(), self.d_ff());
                let rows = |t: Tensor<3>| to_host(t.reshape([e * f, d]));
                put("experts.mlp.w1", rows(gate.swap_dims(1, 2)));
                put("experts.mlp.v1", rows(up.swap_dims(1, 2)));
                put("experts.mlp.w2", rows(down));
            }
            MoeScheme::GraniteMoe => {
                // PyTorch's layout: [E, 2·d_ff, d_model] (gate rows first), [E, d_model, d_ff].
                let [gate, up, down] = [gate, up, down].map(|t| t.swap_dims(1, 2));
                put(
                    "input_linear.weight",
                    to_pytorch(Tensor::cat(vec![gate, up], 1)),
                );
                put("output_linear.weight", to_pytorch(down));
            }
            MoeScheme::GptOss | MoeScheme::Llama4 => {
                // burn's own layout: [E, d_model, 2·d_ff], [E, d_ff, d_model]; gpt-oss
                // interleaves gate and up along the last axis, Llama 4 stacks the halves.
                let pack = |gate: Tensor<3>, up: Tensor<3>| -> Tensor<3> {
                    let [e, rows, f] = gate.dims();
                    if gpt_oss {
                        Tensor::stack::<4>(vec![gate, up], 3).reshape([e, rows, 2 * f])
                    } else {
                        Tensor::cat(vec![gate, up], 2)
                    }
                };
                put("experts.gate_up_proj", to_pytorch(pack(gate, up)));
                put("experts.down_proj", to_pytorch(down));
                if let (Some(b_gate), Some(b_up), Some(b_down)) =
                    (&self.b_gate, &self.b_up, &self.b_down)
                {
                    let packed = pack(b_gate.val().unsqueeze_dim(1), b_up.val().unsqueeze_dim(1));
                    // 2-D, but not weights: [E, 2·d_ff] and [E, d_model] as they are.
                    put(
                        "experts.gate_up_proj_bias",
                        to_host(packed.squeeze_dim::<2>(1)),
                    );
                    put("experts.down_proj_bias", to_host(b_down.val()));
                }
            }
            _ => {
                let names = match scheme {
                    MoeScheme::Mixtral => ["w1", "w3", "w2"],
                    _ => ["gate_proj", "up_proj", "down_proj"],
                };
                for e in 0..self.n_experts() {
                    for (name, param) in names.iter().zip([&gate, &up, &down]) {
                        let matrix = param.clone().narrow(0, e, 1).squeeze_dim::<2>(0);
                        put(&format!("experts.{e}.{name}.weight"), to_pytorch(matrix));
                    }
                }
            }
        }
        if let Some(shared) = &self.shared {
            let Some(gate) = shared.gate().filter(|_| !shared.is_fused()) else {
                return refuse("its shared experts are not an unfused gated network");
            };
            if [shared.gate(), shared.up()]
                .iter()
                .flatten()
                .any(|l| l.bias.is_some())
                || shared.down().bias.is_some()
            {
                return refuse("its shared experts have biases");
            }
            let up = shared.up().expect("unfused");
            let stem = if deepseek {
                "shared_experts"
            } else {
                "shared_expert"
            };
            for (name, linear) in [
                ("gate_proj", gate),
                ("up_proj", up),
                ("down_proj", shared.down()),
            ] {
                put(
                    &format!("{stem}.{name}.weight"),
                    to_pytorch(linear.weight.val()),
                );
            }
        }
        if let Some(gate) = &self.shared_gate {
            put("shared_expert_gate.weight", to_pytorch(gate.weight.val()));
        }
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(serialize(&tensors, &[]))
    }

    /// Writes [`to_safetensors_bytes_as`](Self::to_safetensors_bytes_as) to `path`
    /// atomically (a temporary file beside it, then a rename): a failure leaves an earlier
    /// file intact.
    pub fn save_safetensors_as(
        &self,
        path: impl AsRef<Path>,
        scheme: MoeScheme,
        prefix: &str,
    ) -> Result<(), Error> {
        let path = path.as_ref();
        let bytes = self.to_safetensors_bytes_as(scheme, prefix)?;
        crate::files::write_atomically(path, &bytes).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })
    }
}

/// Loaded values in burn's layout.
pub(crate) struct Parts {
    router: TensorData,
    router_bias: Option<TensorData>,
    selection_bias: Option<TensorData>,
    w_gate: TensorData,
    w_up: TensorData,
    w_down: TensorData,
    b_gate: Option<TensorData>,
    b_up: Option<TensorData>,
    b_down: Option<TensorData>,
    shared_gate: Option<TensorData>,
}

impl Moe {
    fn load_parts(mut self, parts: Parts) -> Self {
        self.router.weight = load_param(&self.router.weight, parts.router);
        if let (Some(param), Some(b)) = (self.router.bias.as_mut(), parts.router_bias) {
            *param = load_param(param, b);
        }
        for (param, b) in [
            (self.b_gate.as_mut(), parts.b_gate),
            (self.b_up.as_mut(), parts.b_up),
            (self.b_down.as_mut(), parts.b_down),
        ] {
            if let (Some(param), Some(b)) = (param, b) {
                *param = load_param(param, b);
            }
        }
        if let (Some(param), Some(bias)) = (self.selection_bias.as_mut(), parts.selection_bias) {
            *param = load_param(param, bias);
        }
        if let Some(param) = self.w_gate.as_mut() {
            *param = load_param(param, parts.w_gate);
        }
        self.w_up = load_param(&self.w_up, parts.w_up);
        self.w_down = load_param(&self.w_down, parts.w_down);
        if let (Some(gate), Some(w)) = (self.shared_gate.as_mut(), parts.shared_gate) {
            gate.weight = load_param(&gate.weight, w);
        }
        self
    }
}

/// The bias beside a weight: `….weight` → `….bias`.
fn bias_key(weight: &str) -> String {
    format!("{}bias", weight.strip_suffix("weight").unwrap_or(weight))
}

fn values(data: &TensorData) -> Vec<f64> {
    data.iter::<f64>().collect()
}

/// Reads tensors by key, checking shapes and noting the keys used.
struct Reader<'a> {
    files: &'a mut TensorFiles,
    used: Vec<String>,
}

impl Reader<'_> {
    fn take(&mut self, key: &str, shape: &[usize]) -> Result<TensorData, Error> {
        let info = self.files.info(key).ok_or_else(|| Error::MissingTensor {
            key: key.to_string(),
            hint: String::new(),
        })?;
        if info.shape != shape {
            return Err(Error::Shape {
                key: key.to_string(),
                expected: shape.to_vec(),
                actual: info.shape.clone(),
            });
        }
        let data = self.files.read_float(key)?;
        self.used.push(key.to_string());
        Ok(data)
    }
}
