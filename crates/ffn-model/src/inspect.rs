//! # Finding FFNs in a weight file
//!
//! [`find_ffns`] looks through the keys of a safetensors file (or a sharded model) for the
//! weights of feed-forward networks in any [`Scheme`], and infers each one's
//! [`FeedForwardConfig`] from the shapes: `d_model` and `d_ff` from the `up` projection,
//! gating and biases from which tensors exist. The activation is not in the weights: it comes
//! from the file's `ffn.activation` metadata when present, else from the scheme's usual choice.

use std::collections::BTreeSet;

use crate::reader::TensorFiles;
use crate::scheme::{Role, Slot};
use crate::{Activation, FeedForwardConfig, Scheme};

/// An FFN found in a weight file.
#[derive(Debug, Clone, PartialEq)]
pub struct FoundFfn {
    /// The key prefix of its tensors (`model.layers.3.mlp.`).
    pub prefix: String,
    /// Their naming scheme.
    pub scheme: Scheme,
    /// The config that loads them (activation: see `activation_from_file`).
    pub config: FeedForwardConfig,
    /// Whether the activation was read from the file's metadata rather than assumed from the
    /// scheme.
    pub activation_from_file: bool,
}

/// The activation a scheme's models usually use.
fn usual_activation(scheme: Scheme, gated: bool) -> Activation {
    match scheme {
        Scheme::Llama | Scheme::MetaLlama | Scheme::W12 | Scheme::GateUpProj => Activation::Silu,
        Scheme::Gpt2 => Activation::GeluTanh,
        Scheme::T5 if gated => Activation::GeluTanh,
        Scheme::T5 | Scheme::Labml => Activation::Relu,
        Scheme::Bert | Scheme::Native => Activation::Gelu,
    }
}

/// Every FFN in `files`, in key order.
pub fn find_ffns(files: &TensorFiles) -> Vec<FoundFfn> {
    // Candidate prefixes: whatever precedes a scheme's weight name.
    let mut prefixes = BTreeSet::new();
    for key in files.keys() {
        for scheme in Scheme::ALL {
            for stem in scheme.stems() {
                if let Some(prefix) = key.strip_suffix(&format!("{stem}.weight"))
                    && (prefix.is_empty() || prefix.ends_with('.'))
                {
                    prefixes.insert(prefix.to_string());
                }
            }
        }
    }
    let from_file = files
        .metadata("ffn.activation")
        .and_then(|name| name.parse::<Activation>().ok());
    prefixes
        .into_iter()
        .filter_map(|prefix| {
            let (scheme, gated) = Scheme::detect(files.keys(), &prefix).ok()?;
            let up = scheme.slot(Role::Up, gated).ok()??;
            let info = files.info(&format!("{prefix}{}.weight", up.name()))?;
            // Only weights that could load: a float dtype, and a shape that gives sizes ≥ 1
            // (a packed `[W_gate; W_up]` has an even number of rows).
            if !matches!(info.dtype.as_str(), "F32" | "F64" | "F16" | "BF16") {
                return None;
            }
            let (d_model, d_ff) = match (up, info.shape.as_slice()) {
                (Slot::Linear(_), [out, inp]) => (*inp, *out),
                (Slot::Conv1d(_), [inp, out]) => (*inp, *out),
                (Slot::Half(..), [out2, inp]) if out2 % 2 == 0 => (*inp, out2 / 2),
                _ => return None,
            };
            let has_bias = |role| {
                scheme
                    .slot(role, gated)
                    .ok()
                    .flatten()
                    .is_some_and(|slot: Slot| {
                        files
                            .info(&format!("{prefix}{}.bias", slot.name()))
                            .is_some()
                    })
            };
            let config = FeedForwardConfig::new(d_model, d_ff)
                .with_gated(gated)
                .with_activation(from_file.unwrap_or(usual_activation(scheme, gated)))
                .with_bias_up(has_bias(Role::Up))
                .with_bias_gate(has_bias(Role::Gate))
                .with_bias_down(has_bias(Role::Down));
            config.validate().ok()?;
            Some(FoundFfn {
                prefix,
                scheme,
                config,
                activation_from_file: from_file.is_some(),
            })
        })
        .collect()
}
