//! # Naming schemes
//!
//! Every codebase names the three projections of the FFN its own way, and some store them
//! differently. A [`Scheme`] says, for the `gate`, `up` and `down` projections, under which key
//! each is stored and how:
//!
//! | scheme | gate | up | down | storage |
//! |---|---|---|---|---|
//! | `native` | `gate` | `up` | `down` | `nn.Linear`, `[out, in]` |
//! | `labml` | `layer1` | `linear_v` (gated) / `layer1` | `layer2` | `nn.Linear` |
//! | `bert` | – | `intermediate.dense` | `output.dense` | `nn.Linear` |
//! | `t5` | `wi_0` | `wi_1` (gated) / `wi` | `wo` | `nn.Linear` |
//! | `llama` (Hugging Face) | `gate_proj` | `up_proj` | `down_proj` | `nn.Linear` |
//! | `meta_llama` | `w1` | `w3` (gated) / `w1` | `w2` | `nn.Linear` |
//! | `gpt2` | – | `c_fc` | `c_proj` | `Conv1D`, `[in, out]` |
//! | `w12` (xformers) | `w12`, first half | `w12`, second half | `w3` | packed `[2·d_ff, in]` |
//! | `gate_up_proj` (vLLM, Phi-3) | `gate_up_proj`, first half | second half | `down_proj` | packed |
//! | `fc` (Phi, OPT) | – | `fc1` | `fc2` | `nn.Linear` |
//! | `neox` (GPT-NeoX, Falcon, BLOOM) | – | `dense_h_to_4h` | `dense_4h_to_h` | `nn.Linear` |
//! | `gptj` | – | `fc_in` | `fc_out` | `nn.Linear` |
//! | `bigcode` (GPT-BigCode, StarCoder2) | – | `c_fc` | `c_proj` | `nn.Linear` (not GPT-2's `Conv1D`) |
//! | `distilbert` | – | `lin1` | `lin2` | `nn.Linear` |
//! | `modernbert` | `Wi`, first half | `Wi`, second half | `Wo` | packed |
//!
//! In the packed layouts the gate's rows come first, as xformers' `SwiGLU` (`x1, x2 =
//! w12(x).chunk(2)`, `silu(x1) * x2`) and vLLM's `SiluAndMul` read them. Loading splits them;
//! saving packs them again.

use std::collections::{BTreeSet, HashSet};
use std::fmt;
use std::str::FromStr;

use crate::Error;

/// A projection of the FFN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    Gate,
    Up,
    Down,
}

impl Role {
    pub(crate) fn native(self) -> &'static str {
        match self {
            Role::Gate => "gate",
            Role::Up => "up",
            Role::Down => "down",
        }
    }
}

/// How one projection is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Slot {
    /// `name.weight` `[out, in]`, `name.bias` `[out]` (PyTorch's `nn.Linear`).
    Linear(&'static str),
    /// `name.weight` `[in, out]`, `name.bias` `[out]` (GPT-2's `Conv1D`).
    Conv1d(&'static str),
    /// Half `h` (0: first rows) of a packed `name.weight` `[2·out, in]` and `name.bias`.
    Half(&'static str, usize),
}

impl Slot {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Slot::Linear(n) | Slot::Conv1d(n) | Slot::Half(n, _) => n,
        }
    }
}

/// A naming scheme of FFN weights (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Scheme {
    /// This crate's names: `up`, `gate`, `down`.
    Native,
    /// labml's annotated `FeedForward`: `layer1`, `linear_v`, `layer2`.
    Labml,
    /// Hugging Face BERT: `intermediate.dense`, `output.dense`.
    Bert,
    /// Hugging Face T5: `wi`, `wo`, or `wi_0`, `wi_1`, `wo`.
    T5,
    /// Hugging Face LLaMA: `gate_proj`, `up_proj`, `down_proj`.
    Llama,
    /// Meta's LLaMA: `w1`, `w3`, `w2`.
    MetaLlama,
    /// GPT-2: `c_fc`, `c_proj`, stored `[in, out]`.
    Gpt2,
    /// xformers: `w12` packing gate and up, `w3`.
    W12,
    /// vLLM and Phi-3: `gate_up_proj` packing gate and up, `down_proj`.
    GateUpProj,
    /// Phi and OPT: `fc1`, `fc2`.
    Fc,
    /// GPT-NeoX, Falcon and BLOOM: `dense_h_to_4h`, `dense_4h_to_h`.
    NeoX,
    /// GPT-J: `fc_in`, `fc_out`.
    GptJ,
    /// GPT-BigCode and StarCoder2: `c_fc`, `c_proj` as `nn.Linear`, `[out, in]`.
    BigCode,
    /// DistilBERT: `lin1`, `lin2`.
    DistilBert,
    /// ModernBERT: `Wi` packing the activated half and the linear half, `Wo`.
    ModernBert,
}

impl Scheme {
    /// Every scheme.
    pub const ALL: [Scheme; 15] = [
        Scheme::Native,
        Scheme::Labml,
        Scheme::Bert,
        Scheme::T5,
        Scheme::Llama,
        Scheme::MetaLlama,
        Scheme::Gpt2,
        Scheme::W12,
        Scheme::GateUpProj,
        Scheme::Fc,
        Scheme::NeoX,
        Scheme::GptJ,
        Scheme::BigCode,
        Scheme::DistilBert,
        Scheme::ModernBert,
    ];

    /// The scheme's name.
    pub const fn name(self) -> &'static str {
        match self {
            Scheme::Native => "native",
            Scheme::Labml => "labml",
            Scheme::Bert => "bert",
            Scheme::T5 => "t5",
            Scheme::Llama => "llama",
            Scheme::MetaLlama => "meta_llama",
            Scheme::Gpt2 => "gpt2",
            Scheme::W12 => "w12",
            Scheme::GateUpProj => "gate_up_proj",
            Scheme::Fc => "fc",
            Scheme::NeoX => "neox",
            Scheme::GptJ => "gptj",
            Scheme::BigCode => "bigcode",
            Scheme::DistilBert => "distilbert",
            Scheme::ModernBert => "modernbert",
        }
    }

    /// Where `role` is stored in a gated or ungated network, or `None` if the network has no
    /// such projection; an error if the scheme cannot store this network.
    pub(crate) fn slot(self, role: Role, gated: bool) -> Result<Option<Slot>, Error> {
        use Role::*;
        use Slot::*;
        if role == Gate && !gated {
            return Ok(None);
        }
        let slot = match (self, role, gated) {
            (Scheme::Native, r, _) => Linear(r.native()),
            (Scheme::Labml, Gate, _) => Linear("layer1"),
            (Scheme::Labml, Up, true) => Linear("linear_v"),
            (Scheme::Labml, Up, false) => Linear("layer1"),
            (Scheme::Labml, Down, _) => Linear("layer2"),
            (
                Scheme::Bert
                | Scheme::Gpt2
                | Scheme::Fc
                | Scheme::NeoX
                | Scheme::GptJ
                | Scheme::BigCode
                | Scheme::DistilBert,
                _,
                true,
            ) => {
                return Err(Error::Scheme(format!(
                    "the {} scheme has no gate: it cannot hold a gated network",
                    self.name()
                )));
            }
            (Scheme::Bert, Up, false) => Linear("intermediate.dense"),
            (Scheme::Bert, _, false) => Linear("output.dense"),
            (Scheme::Gpt2, Up, false) => Conv1d("c_fc"),
            (Scheme::Gpt2, _, false) => Conv1d("c_proj"),
            (Scheme::T5, Gate, _) => Linear("wi_0"),
            (Scheme::T5, Up, true) => Linear("wi_1"),
            (Scheme::T5, Up, false) => Linear("wi"),
            (Scheme::T5, Down, _) => Linear("wo"),
            (Scheme::Llama, Gate, _) => Linear("gate_proj"),
            (Scheme::Llama, Up, _) => Linear("up_proj"),
            (Scheme::Llama, Down, _) => Linear("down_proj"),
            (Scheme::MetaLlama, Gate, _) => Linear("w1"),
            (Scheme::MetaLlama, Up, true) => Linear("w3"),
            (Scheme::MetaLlama, Up, false) => Linear("w1"),
            (Scheme::MetaLlama, Down, _) => Linear("w2"),
            (Scheme::Fc, Up, false) => Linear("fc1"),
            (Scheme::Fc, _, false) => Linear("fc2"),
            (Scheme::NeoX, Up, false) => Linear("dense_h_to_4h"),
            (Scheme::NeoX, _, false) => Linear("dense_4h_to_h"),
            (Scheme::GptJ, Up, false) => Linear("fc_in"),
            (Scheme::GptJ, _, false) => Linear("fc_out"),
            (Scheme::BigCode, Up, false) => Linear("c_fc"),
            (Scheme::BigCode, _, false) => Linear("c_proj"),
            (Scheme::DistilBert, Up, false) => Linear("lin1"),
            (Scheme::DistilBert, _, false) => Linear("lin2"),
            (Scheme::W12 | Scheme::GateUpProj | Scheme::ModernBert, _, false) => {
                return Err(Error::Scheme(format!(
                    "the {} scheme packs gate and up: it cannot hold an ungated network",
                    self.name()
                )));
            }
            (Scheme::W12, Gate, true) => Half("w12", 0),
            (Scheme::W12, Up, true) => Half("w12", 1),
            (Scheme::W12, Down, true) => Linear("w3"),
            (Scheme::GateUpProj, Gate, true) => Half("gate_up_proj", 0),
            (Scheme::GateUpProj, Up, true) => Half("gate_up_proj", 1),
            (Scheme::GateUpProj, Down, true) => Linear("down_proj"),
            (Scheme::ModernBert, Gate, true) => Half("Wi", 0),
            (Scheme::ModernBert, Up, true) => Half("Wi", 1),
            (Scheme::ModernBert, Down, true) => Linear("Wo"),
        };
        Ok(Some(slot))
    }

    /// Every key stem the scheme uses, gated or not (`wi`, `wi_0`, `wi_1`, `wo` for T5).
    pub(crate) fn stems(self) -> Vec<&'static str> {
        let mut stems = Vec::new();
        for gated in [false, true] {
            for role in [Role::Gate, Role::Up, Role::Down] {
                if let Ok(Some(slot)) = self.slot(role, gated)
                    && !stems.contains(&slot.name())
                {
                    stems.push(slot.name());
                }
            }
        }
        stems
    }

    /// Whether `key` is one of this scheme's tensors under `prefix`: `{prefix}{stem}.…` for
    /// one of its [stems](Self::stems).
    pub(crate) fn owns(self, key: &str, prefix: &str) -> bool {
        key.strip_prefix(prefix).is_some_and(|rest| {
            self.stems()
                .iter()
                .any(|stem| rest.strip_prefix(stem).is_some_and(|r| r.starts_with('.')))
        })
    }

    /// The scheme of the FFN weights under `prefix` among `keys`, and whether it is gated.
    pub fn detect<'a>(
        keys: impl IntoIterator<Item = &'a str>,
        prefix: &str,
    ) -> Result<(Scheme, bool), Error> {
        let keys: Vec<&str> = keys
            .into_iter()
            .filter_map(|k| k.strip_prefix(prefix))
            .collect();
        let set: HashSet<&str> = keys.iter().copied().collect();
        Self::detect_by(|stem| set.contains(format!("{stem}.weight").as_str())).ok_or_else(|| {
            let sample: Vec<&str> = keys.iter().take(8).copied().collect();
            Error::Scheme(format!(
                "no FFN weights of a known scheme under the prefix `{prefix}` (keys: {}{})",
                sample.join(", "),
                if keys.len() > 8 { ", …" } else { "" }
            ))
        })
    }

    /// The scheme, and whether gated, of the weights that `has(stem)` says are there
    /// (`{stem}.weight` under one prefix): each test a lookup, so that a reader can try every
    /// prefix of a large file against a set of its keys.
    pub(crate) fn detect_by(has: impl Fn(&str) -> bool) -> Option<(Scheme, bool)> {
        Some(if has("gate_up_proj") {
            (Scheme::GateUpProj, true)
        } else if has("w12") {
            (Scheme::W12, true)
        } else if has("up_proj") {
            (Scheme::Llama, has("gate_proj"))
        } else if has("wi_0") || has("wi") {
            (Scheme::T5, has("wi_0"))
        } else if has("Wi") && has("Wo") {
            (Scheme::ModernBert, true)
        } else if has("c_fc") {
            // `Conv1D` or `nn.Linear`: the keys alone cannot tell (see `HfModel`).
            (Scheme::Gpt2, false)
        } else if has("fc1") && has("fc2") {
            (Scheme::Fc, false)
        } else if has("dense_h_to_4h") {
            (Scheme::NeoX, false)
        } else if has("fc_in") {
            (Scheme::GptJ, false)
        } else if has("lin1") && has("lin2") {
            (Scheme::DistilBert, false)
        } else if has("intermediate.dense") {
            (Scheme::Bert, false)
        } else if has("layer1") && has("layer2") {
            (Scheme::Labml, has("linear_v"))
        } else if has("w1") && has("w2") {
            (Scheme::MetaLlama, has("w3"))
        } else if has("up") && has("down") {
            (Scheme::Native, has("gate"))
        } else {
            return None;
        })
    }

    /// Every prefix of `keys` under which the weights of a known scheme lie, in key order,
    /// with its scheme and whether it is gated: the candidates are whatever precedes a
    /// scheme's `{stem}.weight`, each tested by set lookups (linear in the number of keys).
    pub(crate) fn find_all(keys: &HashSet<&str>) -> Vec<(String, Scheme, bool)> {
        let mut suffixes: Vec<String> = Self::ALL
            .iter()
            .flat_map(|s| s.stems())
            .map(|stem| format!("{stem}.weight"))
            .collect();
        suffixes.sort();
        suffixes.dedup();
        let mut prefixes = BTreeSet::new();
        for key in keys {
            for suffix in &suffixes {
                if let Some(prefix) = key.strip_suffix(suffix.as_str())
                    && (prefix.is_empty() || prefix.ends_with('.'))
                {
                    prefixes.insert(prefix);
                }
            }
        }
        prefixes
            .into_iter()
            .filter_map(|prefix| {
                let has = |stem: &str| keys.contains(format!("{prefix}{stem}.weight").as_str());
                let (scheme, gated) = Self::detect_by(has)?;
                Some((prefix.to_string(), scheme, gated))
            })
            .collect()
    }
}

/// GPT-2's `c_fc`/`c_proj` (`Conv1D`, `[in, out]`) and GPT-BigCode's (`nn.Linear`,
/// `[out, in]`) have the same keys, which [`Scheme::detect`] reads as [`Scheme::Gpt2`]: the
/// shape of `c_fc.weight` against `d_model` tells them apart, except where `d_ff = d_model`
/// (`None`).
pub(crate) fn c_fc_layout(up_shape: &[usize], d_model: usize) -> Option<Scheme> {
    match up_shape {
        [rows, cols] if rows != cols && *cols == d_model => Some(Scheme::BigCode),
        [rows, cols] if rows != cols && *rows == d_model => Some(Scheme::Gpt2),
        _ => None,
    }
}

impl fmt::Display for Scheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Scheme {
    type Err = Error;

    fn from_str(name: &str) -> Result<Self, Error> {
        let normal = crate::normal_name(name);
        Self::ALL
            .into_iter()
            .find(|s| s.name() == normal)
            .ok_or_else(|| {
                Error::Scheme(format!(
                    "unknown scheme `{name}`; known: {}",
                    Self::ALL.map(Scheme::name).join(", ")
                ))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key belongs to a scheme under a prefix when a whole stem follows the prefix.
    #[test]
    fn owns_whole_stems_under_the_prefix_only() {
        let prefix = "model.layers.0.mlp.";
        let llama = Scheme::Llama;
        assert!(llama.owns("model.layers.0.mlp.up_proj.weight", prefix));
        assert!(llama.owns("model.layers.0.mlp.gate_proj.bias", prefix));
        assert!(!llama.owns("model.layers.0.mlp.gate_up_proj.weight", prefix));
        assert!(!llama.owns("model.layers.0.mlp.up_projx.weight", prefix));
        assert!(!llama.owns("model.layers.1.mlp.up_proj.weight", prefix));
        assert!(!llama.owns("up_proj.weight", prefix));
        assert!(llama.owns("up_proj.weight", ""));
        // T5's gated and ungated stems both count.
        assert!(Scheme::T5.owns("wi.weight", ""));
        assert!(Scheme::T5.owns("wi_1.weight", ""));
        assert!(!Scheme::T5.owns("wi_2.weight", ""));
    }
}
