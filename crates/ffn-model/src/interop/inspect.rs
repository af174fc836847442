//! # Finding FFNs in a weight file
//!
//! [`open`] reads a safetensors file's header (checked as when loading) and lists its metadata,
//! its tensors and the feed-forward networks among them: it looks through the keys for the
//! weights of FFNs in any [`Scheme`], and infers each one's
//! [`FeedForwardConfig`] from the shapes: `d_model` and `d_ff` from the `up` projection,
//! gating and biases from which tensors exist. The activation is not in the weights: it comes
//! from the file's `ffn.activation` metadata when present, else from the scheme's usual choice.

use std::path::Path;

use crate::interop::safetensors::{TensorFile, TensorFiles};
use crate::interop::scheme::{Role, Slot};
use crate::{Activation, Error, FeedForwardConfig, Scheme};

/// What a safetensors file holds.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Contents {
    /// The header's metadata, in key order.
    pub metadata: Vec<(String, String)>,
    /// Every tensor's key, dtype name (`F32`, `BF16`, …) and shape, in key order.
    pub tensors: Vec<(String, String, Vec<usize>)>,
    /// The FFNs among the tensors, in key order.
    pub ffns: Vec<FoundFfn>,
}

/// The [`Contents`] of the safetensors file at `path`. Only the header is read.
///
/// # Errors
///
/// [`Error::Io`] if the file cannot be read (or is not a regular file), [`Error::Corrupt`] if
/// its header is not a valid safetensors header.
///
/// ```
/// use ffn_model::{FeedForwardConfig, Scheme};
///
/// let device = burn::tensor::Device::default();
/// let ffn = FeedForwardConfig::new(4, 8).with_gated(true).init(&device);
/// let path = std::env::temp_dir().join(format!("inspect-doc-{}.safetensors", std::process::id()));
/// ffn.save_safetensors_as(&path, Scheme::Llama, "model.layers.0.mlp.")?;
/// let contents = ffn_model::interop::inspect::open(&path)?;
/// assert_eq!(contents.ffns[0].prefix, "model.layers.0.mlp.");
/// assert_eq!(contents.ffns[0].config.d_ff, 8);
/// assert_eq!(contents.tensors.len(), 3);
/// # std::fs::remove_file(&path)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn open(path: &Path) -> Result<Contents, Error> {
    Ok(contents(TensorFile::open(path)?))
}

/// The [`Contents`] of a safetensors file in memory (see [`open`]).
pub fn from_bytes(bytes: &[u8]) -> Result<Contents, Error> {
    Ok(contents(TensorFile::from_bytes(bytes)?))
}

fn contents(file: TensorFile) -> Contents {
    let mut metadata: Vec<(String, String)> = file
        .metadata()
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    metadata.sort();
    let files = TensorFiles::single(file);
    Contents {
        metadata,
        tensors: files.list(),
        ffns: find_ffns(&files),
    }
}

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
        Scheme::Gpt2 | Scheme::GptJ | Scheme::BigCode => Activation::GeluTanh,
        Scheme::T5 if gated => Activation::GeluTanh,
        Scheme::T5 | Scheme::Labml => Activation::Relu,
        Scheme::Bert | Scheme::Native | Scheme::Fc | Scheme::NeoX | Scheme::DistilBert => {
            Activation::Gelu
        }
        Scheme::ModernBert => Activation::Gelu,
    }
}

/// Every FFN in `files`, in key order.
fn find_ffns(files: &TensorFiles) -> Vec<FoundFfn> {
    let keys: std::collections::HashSet<&str> = files.keys().collect();
    let from_file = files
        .metadata("ffn.activation")
        .and_then(|name| name.parse::<Activation>().ok());
    Scheme::find_all(&keys)
        .into_iter()
        .filter_map(|(prefix, scheme, gated)| {
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
