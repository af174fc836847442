//! # `ffn-train inspect`
//!
//! What a safetensors file or a Hugging Face model folder holds, as the command prints it: the
//! FFNs found in a file (their scheme, shapes, biases and activation) or a folder's layers
//! (dense or sparse, with their configs from `config.json`), then the tensors. Names from the
//! file are printed escaped and bounded ([`ffn_model::printable`]).

use std::io::Write;
use std::path::Path;

use crate::error::{Error, Result};

/// Writes the report on `path` to `out`: the first 40 tensors, or all with `all`.
pub fn inspect(path: &Path, all: bool, out: &mut dyn Write) -> Result<()> {
    // A line of the report; an error writing it (a closed pipe) ends the command.
    macro_rules! line {
        ($($arg:tt)*) => {
            writeln!(out, $($arg)*).map_err(Error::io(Path::new("stdout")))?
        };
    }
    let files = if path.is_dir() {
        let model = ffn_model::HfModel::open(path)?;
        let layers = model.num_layers()?;
        line!(
            "{}: Hugging Face `{}` model, {layers} layers, FFN scheme `{}`",
            path.display(),
            model.model_type(),
            model.scheme()
        );
        // Sparse layers (a router under the block's prefix, where config.json agrees) and
        // dense ones.
        let moe = model.moe_config().ok();
        let sparse_layers = match moe {
            Some(_) => model.moe_layers()?,
            None => Vec::new(),
        };
        let sparse: Vec<Option<String>> = (0..layers)
            .map(|layer| {
                sparse_layers
                    .contains(&layer)
                    .then(|| model.moe_layer_prefix(layer).ok())
                    .flatten()
            })
            .collect();
        if sparse.iter().any(Option::is_none) {
            let what = if moe.is_some() {
                "dense layers"
            } else {
                "every layer"
            };
            line!(
                "FFN config (from config.json and the tensors), {what}:\n{}",
                model.ffn_config()?.to_toml()
            );
        }
        if let Some(moe) = &moe {
            line!(
                "MoE config (from config.json), sparse layers: {} experts of d_ff {}, top-{}, \
                 {:?} scores{}{}{}, {} shared expert(s)\n{}",
                moe.n_experts,
                moe.expert.d_ff,
                moe.top_k,
                moe.scoring,
                if moe.normalize_top_k {
                    ", renormalised"
                } else {
                    ""
                },
                if moe.weight_input {
                    ", weighting the experts' inputs"
                } else {
                    ""
                },
                if moe.n_group > 1 {
                    format!(", {} of {} groups", moe.topk_group, moe.n_group)
                } else {
                    String::new()
                },
                moe.n_shared_experts,
                moe.to_toml()
            );
        }
        for (layer, sparse) in sparse.iter().enumerate() {
            match sparse {
                Some(prefix) => line!(
                    "layer {layer}: sparse (MoE), prefix `{}`",
                    ffn_model::printable(prefix, 200)
                ),
                None => line!(
                    "layer {layer}: prefix `{}`",
                    ffn_model::printable(&model.layer_prefix(layer)?, 200)
                ),
            }
        }
        model.tensors()
    } else {
        let contents = ffn_model::interop::inspect::open(path)?;
        let metadata: Vec<String> = contents
            .metadata
            .iter()
            .map(|(k, v)| {
                format!(
                    "{}: {}",
                    ffn_model::printable(k, 200),
                    ffn_model::printable(v, 200)
                )
            })
            .collect();
        line!(
            "{}: safetensors file, {} tensors, metadata {{{}}}",
            path.display(),
            contents.tensors.len(),
            metadata.join(", ")
        );
        let found = &contents.ffns;
        line!("FFNs found: {}", found.len());
        for f in found {
            let c = &f.config;
            line!(
                "  `{}`: {} scheme, {}, d_model {}, d_ff {}, biases up/gate/down {}/{}/{}, activation {} ({})",
                ffn_model::printable(&f.prefix, 200),
                f.scheme,
                if c.gated { "gated" } else { "ungated" },
                c.d_model,
                c.d_ff,
                c.bias_up,
                c.bias_gate,
                c.bias_down,
                c.activation,
                if f.activation_from_file {
                    "from the file"
                } else {
                    "assumed: usual for the scheme"
                },
            );
        }
        if let Some(first) = found.first() {
            line!(
                "FeedForwardConfig of `{}`:\n{}",
                ffn_model::printable(&first.prefix, 200),
                first.config.to_toml()
            );
        }
        contents.tensors
    };
    let shown = if all {
        files.len()
    } else {
        files.len().min(40)
    };
    line!("tensors ({}):", files.len());
    for (key, dtype, shape) in &files[..shown] {
        // Names from the file: control characters escaped, length bounded.
        let (key, dtype) = (
            ffn_model::printable(key, 200),
            ffn_model::printable(dtype, 20),
        );
        line!("  {key:<60} {dtype:<5} {shape:?}");
    }
    if shown < files.len() {
        line!("  … {} more (--all lists them)", files.len() - shown);
    }
    Ok(())
}
