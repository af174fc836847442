//! A sweep's config file: its variants (presets, or named FFNs of one's own), tasks, seeds
//! and learning rates.

use std::path::PathBuf;

use ffn_model::Variant;
use serde::{Deserialize, Serialize};

use crate::config::TrainConfig;
use crate::error::{Error, Result};

/// A sweep config file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SweepConfig {
    /// The variants compared: presets at parameter parity, or named FFNs of your own.
    pub variants: Vec<SweepVariant>,
    /// The seeds: each is one paired replicate.
    pub seeds: Vec<u64>,
    /// The learning-rate grid (default: each task's own `train.lr`).
    #[serde(default)]
    pub lrs: Vec<f64>,
    /// The variant the others are tested against (a preset's name, any spelling, or a named
    /// variant's).
    #[serde(default = "default_baseline")]
    pub baseline: String,
    /// More paired tests, `[variant, against]` (`[["MoE-8x86", "SwiGLU-688"]]`), corrected
    /// for multiple testing with those against the baseline.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pairs: Vec<[String; 2]>,
    /// The tasks.
    pub tasks: Vec<SweepTask>,
}

fn default_baseline() -> String {
    Variant::FfnRelu.name().into()
}

/// A variant of a sweep: a preset at parameter parity, or an FFN of your own under a name.
///
/// ```toml
/// variants = [
///     "FFN_SwiGLU",                                               # d_ff = 8/3 · d_model
///     { name = "SwiGLU-688", preset = "SwiGLU", d_ff = 688 },     # another width
///     { name = "MoE-8x86", preset = "SwiGLU", d_ff = 86, moe = { n_experts = 8, top_k = 2 } },
/// ]
/// ```
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum SweepVariant {
    /// A preset, at parameter parity ([`Variant::d_ff`]).
    Preset(Variant),
    /// A named FFN.
    Custom(CustomVariant),
}

/// A named variant: a preset's activation and gating, its own width, optionally a sparse
/// mixture of those FFNs as experts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CustomVariant {
    /// Its name in the results (letters, digits, `-`, `_`; not a preset's name).
    pub name: String,
    /// The activation and gating.
    pub preset: Variant,
    /// The hidden width (default: the preset's at parameter parity); of each expert with `moe`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub d_ff: Option<usize>,
    /// A mixture of experts: the table of `model.ffn.moe` (`{ n_experts = 8, top_k = 2 }`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<toml::Table>,
    /// The FFNs' matrix products' precision, `train.precision` (default: the task's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<ffn_model::Precision>,
}

impl SweepVariant {
    /// Its name in the results: the preset's (`FFN_SwiGLU`) or the given one.
    pub fn name(&self) -> &str {
        match self {
            Self::Preset(v) => v.name(),
            Self::Custom(c) => &c.name,
        }
    }

    /// Whether `name` names this variant (a preset in any spelling `Variant` parses).
    pub(super) fn is(&self, name: &str) -> bool {
        match self {
            Self::Preset(v) => name.parse::<Variant>().is_ok_and(|n| n == *v),
            Self::Custom(c) => c.name == name,
        }
    }

    /// The overrides that make a task's config this variant.
    pub(super) fn overrides(&self) -> Vec<String> {
        match self {
            Self::Preset(v) => vec![format!("model.ffn.preset=\"{}\"", v.name())],
            Self::Custom(c) => {
                let mut set = vec![format!("model.ffn.preset=\"{}\"", c.preset.name())];
                if let Some(d_ff) = c.d_ff {
                    set.push(format!("model.ffn.d_ff={d_ff}"));
                }
                if let Some(moe) = &c.moe {
                    set.push(format!("model.ffn.moe={}", toml::Value::Table(moe.clone())));
                }
                if let Some(precision) = c.precision {
                    let name = match precision {
                        ffn_model::Precision::F32 => "f32",
                        ffn_model::Precision::Bf16 => "bf16",
                    };
                    set.push(format!("train.precision=\"{name}\""));
                }
                set
            }
        }
    }

    /// The variant must decide the FFN's width, activation, gating and sparsity.
    pub(super) fn check_parity(&self, config: &TrainConfig, task: &str) -> Result<()> {
        let ffn = config.ffn()?;
        let (preset, d_ff, sparse) = match self {
            Self::Preset(v) => (*v, None, false),
            Self::Custom(c) => (c.preset, c.d_ff, c.moe.is_some()),
        };
        let wanted = ffn_model::FeedForwardConfig::preset(preset, ffn.d_model);
        let wanted = (d_ff.unwrap_or(wanted.d_ff), wanted.activation, wanted.gated);
        if (ffn.d_ff, ffn.activation, ffn.gated) != wanted || config.moe()?.is_some() != sparse {
            return Err(Error::Config(format!(
                "task `{task}`: its model.ffn sets d_ff, multiple_of, activation, gated or moe, \
                 which would override the {} variant and break parameter parity: remove them",
                self.name()
            )));
        }
        Ok(())
    }
}

impl<'de> Deserialize<'de> for SweepVariant {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error as _;
        match toml::Value::deserialize(deserializer)? {
            toml::Value::String(name) => name.parse().map(Self::Preset).map_err(D::Error::custom),
            table @ toml::Value::Table(_) => {
                table
                    .try_into()
                    .map(Self::Custom)
                    .map_err(|e: toml::de::Error| {
                        D::Error::custom(format!("a named variant: {}", e.message()))
                    })
            }
            other => Err(D::Error::custom(format!(
                "a variant is a preset's name or a table {{ name, preset, d_ff, moe, precision }}, \
                 not `{other}`"
            ))),
        }
    }
}

/// A name for files and results: 1 to 64 letters, digits, `-` or `_`.
pub(super) fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// One task of a sweep: a run config and overrides.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SweepTask {
    /// Its name in the results (letters, digits, `-`, `_`).
    pub name: String,
    /// The run config, relative to the sweep file.
    pub config: PathBuf,
    /// Overrides, as `ffn-train train --set`.
    #[serde(default)]
    pub set: Vec<String>,
    /// This task's learning-rate grid (default: the sweep's).
    #[serde(default)]
    pub lrs: Vec<f64>,
}
