//! Typed errors: every bad value a user can hand this crate ends here, never in a panic.

use std::path::PathBuf;

/// An invalid [`FeedForwardConfig`](crate::FeedForwardConfig), or a config text that cannot be
/// parsed into one.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A size that must be positive is zero.
    #[error("`{field}` must be at least 1, got 0")]
    ZeroSize {
        /// The field's name (`d_model`, `d_ff`, `multiple_of`).
        field: &'static str,
    },
    /// A size beyond what one machine can hold: the limits are
    /// [`MAX_DIM`](crate::MAX_DIM) per dimension and
    /// [`MAX_MATRIX`](crate::MAX_MATRIX) elements per weight matrix.
    #[error("`{field}` = {value} is too large (at most {max})")]
    TooLarge {
        /// The field's name (`d_model`, `d_ff`, `d_model · d_ff`).
        field: &'static str,
        /// The value as given (saturated at `u128::MAX`).
        value: u128,
        /// The largest accepted value.
        max: u128,
    },
    /// The initializer's parameters cannot describe a distribution (a `Uniform` with
    /// `min ≥ max`, a negative or NaN standard deviation, a gain that is not positive …).
    #[error("invalid `initializer`: {0}")]
    Initializer(String),
    /// The dropout probability is not a finite number in `[0, 1)`.
    #[error("`dropout` must be a probability in [0, 1), got {0}")]
    Dropout(f64),
    /// `bias_gate` is set on an ungated network, which has no gate projection.
    #[error("`bias_gate = true` needs `gated = true`: an ungated network has no gate projection")]
    GateBiasWithoutGating,
    /// `fused_gate_up` is set on an ungated network, which has no gate to fuse.
    #[error(
        "`fused_gate_up = true` needs `gated = true`: an ungated network has no gate projection"
    )]
    FusedWithoutGating,
    /// `fused_gate_up` with a bias on one of the fused projections but not the other.
    #[error(
        "`fused_gate_up = true` needs `bias_gate` and `bias_up` equal: one fused projection has one bias"
    )]
    FusedBiasMismatch,
    /// An activation name that is neither a canonical name nor a known alias.
    #[error("unknown activation `{name}`; known: {known}")]
    UnknownActivation {
        /// The name as written.
        name: String,
        /// Every accepted spelling, comma separated.
        known: String,
    },
    /// An unknown preset name.
    #[error("unknown preset `{name}`; known: {known}")]
    UnknownPreset {
        /// The name as written.
        name: String,
        /// Every accepted name, comma separated.
        known: String,
    },
    /// A field of a [`MoeConfig`](crate::MoeConfig) that is out of range or inconsistent with
    /// another (`top_k` above `n_experts`, `n_group` not dividing `n_experts`, a capacity factor
    /// that is not a positive number …).
    #[error("`{field}`: {message}")]
    Moe {
        /// The field's name.
        field: &'static str,
        /// What is wrong with it.
        message: String,
    },
    /// The text is not a valid TOML or JSON config (syntax, a missing `d_model`, a misspelt key …).
    #[error("invalid {format} config: {message}")]
    Parse {
        /// `TOML` or `JSON`.
        format: &'static str,
        /// The parser's message, with its line and column where it gives them.
        message: String,
    },
}

/// An error from loading or saving weights.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The module's config is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The file is not a readable safetensors file (truncated, bad header, overlapping data …).
    #[error("{path}: not a valid safetensors file: {reason}")]
    Corrupt {
        /// The file (or `<bytes>` for an in-memory buffer).
        path: PathBuf,
        /// What the safetensors parser reported.
        reason: String,
    },
    /// A tensor the module needs is not in the file.
    #[error("missing tensor `{key}`{hint}")]
    MissingTensor {
        /// The tensor's name.
        key: String,
        /// Extra context, such as the file being gated while the module is not.
        hint: String,
    },
    /// The file holds a tensor the module has no place for.
    #[error("unexpected tensor `{key}`{hint}")]
    UnexpectedTensor {
        /// The tensor's name.
        key: String,
        /// Extra context, such as the file being gated while the module is not.
        hint: String,
    },
    /// A tensor has the wrong shape.
    #[error("tensor `{key}` has shape {actual:?}, expected {expected:?}")]
    Shape {
        /// The tensor's name.
        key: String,
        /// The shape the module needs (PyTorch layout).
        expected: Vec<usize>,
        /// The shape in the file.
        actual: Vec<usize>,
    },
    /// A tensor has a dtype that cannot hold weights (integers, booleans, 8-bit floats …).
    #[error("tensor `{key}` has dtype {dtype}; weights must be F32, F64, F16 or BF16")]
    DType {
        /// The tensor's name.
        key: String,
        /// The dtype in the file.
        dtype: String,
    },
    /// A Hugging Face `config.json` key that is missing or holds an unusable value.
    #[error("{}: `{field}`: {message}", path.display())]
    HfConfig {
        /// The config file.
        path: PathBuf,
        /// The key.
        field: String,
        /// What is wrong with it.
        message: String,
    },
    /// A layer index past the model's last layer.
    #[error("layer {layer} is out of range: the model has {layers} layers (0..{layers})")]
    LayerOutOfRange {
        /// The index asked for.
        layer: usize,
        /// The model's number of layers.
        layers: usize,
    },
    /// A naming scheme that cannot hold this network, or no FFN of a known scheme found.
    #[error("{0}")]
    Scheme(String),
    /// The file's `ffn.activation` metadata names an activation this version does not know.
    #[error("metadata `ffn.activation` = `{0}` is not a known activation")]
    Metadata(String),
}

/// `text` fit for a one-line message: control characters escaped (`\n`, `\u{1b}`) and at most
/// `max_chars` characters kept, the rest counted (`… (9999 more characters)`). Names from files
/// and configs pass through it before they are printed.
pub fn printable(text: &str, max_chars: usize) -> String {
    let mut out = String::new();
    let mut chars = text.chars();
    for c in chars.by_ref().take(max_chars) {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    let rest = chars.count();
    if rest > 0 {
        out.push_str(&format!("… ({rest} more characters)"));
    }
    out
}

/// [`printable`] at 200 characters: a key or value quoted in an error.
pub(crate) fn clip(text: &str) -> String {
    printable(text, 200)
}
