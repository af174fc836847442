//! Round trip through PyTorch: loads layer 1 of every `transformers` fixture (the dense FFN of
//! each folder with an `ffn_io.safetensors`, the sparse block of each with a
//! `moe_io.safetensors`), writes it back in the model's own names under its own prefix, with
//! the output of the loaded layer beside it. `tools/hf_fixtures.py --check-export DIR` then
//! puts each file in place of that layer's tensors in a copy of the checkpoint, loads the copy
//! with `from_pretrained` (no key missing, unexpected or mismatched), and compares the layer's
//! output with the one Rust stored.
//!
//! ```text
//! cargo run --example hf_export -- /tmp/ffn-export
//! python3 tools/hf_fixtures.py --check-export /tmp/ffn-export
//! ```

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use burn::tensor::{DType, Device, Tensor, TensorData};
use ffn_model::HfModel;

/// The loaded layer, or `None` with a line saying why the reader refused it.
fn unless_refused<T>(name: &str, loaded: Result<T, ffn_model::Error>) -> Option<T> {
    loaded
        .inspect_err(|e| println!("{name}: left out (refused: {e})"))
        .ok()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = PathBuf::from(std::env::args().nth(1).ok_or("usage: hf_export DIR")?);
    std::fs::create_dir_all(&out)?;
    let fixtures =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("crates/ffn-test-support/data/hf");
    let device = Device::flex();
    let mut folders: Vec<PathBuf> = std::fs::read_dir(&fixtures)?
        .map(|entry| entry.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    folders.sort();
    for folder in folders {
        let name = folder.file_name().and_then(|n| n.to_str()).unwrap_or("?");
        // One checkpoint per model: the sharded and bfloat16 copies of llama are left out.
        if !folder.join("model.safetensors").is_file() {
            continue;
        }
        let mut model = HfModel::open(&folder)?;
        let weights = out.join(format!("{name}.layer1.safetensors"));
        let (prefix, y) = if folder.join("moe_io.safetensors").is_file() {
            // A family whose block ffn has no form for (JetMoE) is refused: left out.
            let loaded = model
                .moe_layer_prefix(1)
                .and_then(|prefix| Ok((prefix, model.load_moe_layer(1, &device)?)));
            let Some((prefix, moe)) = unless_refused(name, loaded) else {
                continue;
            };
            let scheme = model.moe_scheme()?;
            if let Err(e) = moe.save_safetensors_as(&weights, scheme, &prefix) {
                // The closest scheme cannot hold it (LFM2-MoE's selection bias in Mixtral's names).
                println!("{name}: left out (no MoeScheme writes its names: {e})");
                continue;
            }
            // A family no scheme writes (Jamba's `router.weight`, EXAONE-MoE's bias beside its
            // router) loads, but is written in another family's names: left out.
            let keys = |path: &Path| -> Result<Vec<String>, Box<dyn std::error::Error>> {
                let bytes = std::fs::read(path)?;
                let file = safetensors::SafeTensors::deserialize(&bytes)?;
                let mut keys: Vec<String> = file
                    .names()
                    .into_iter()
                    .filter(|k| k.starts_with(&prefix))
                    .map(str::to_string)
                    .collect();
                keys.sort();
                Ok(keys)
            };
            if keys(&weights)? != keys(&folder.join("model.safetensors"))? {
                std::fs::remove_file(&weights)?;
                println!("{name}: left out (no MoeScheme writes its names; `{scheme}` is closest)");
                continue;
            }
            let x = input(&folder.join("moe_io.safetensors"), &device)?;
            (prefix, moe.forward(x).output)
        } else if folder.join("ffn_io.safetensors").is_file() {
            // So is a family whose FFN has a step ffn's lacks (BitNet, Apertus).
            let loaded = model
                .layer_prefix(1)
                .and_then(|prefix| Ok((prefix, model.load_layer(1, &device)?)));
            let Some((prefix, ffn)) = unless_refused(name, loaded) else {
                continue;
            };
            ffn.save_safetensors_as(&weights, model.scheme(), &prefix)?;
            let x = input(&folder.join("ffn_io.safetensors"), &device)?;
            (prefix, ffn.forward(x))
        } else {
            continue;
        };
        let y = y.into_data();
        let bytes: Vec<u8> = y.iter::<f32>().flat_map(f32::to_le_bytes).collect();
        let view = safetensors::tensor::TensorView::new(
            safetensors::Dtype::F32,
            y.shape().to_vec(),
            &bytes,
        )?;
        let metadata = HashMap::from([("prefix".to_string(), prefix.clone())]);
        std::fs::write(
            out.join(format!("{name}.layer1.output.safetensors")),
            safetensors::serialize([("y", view)], Some(metadata))?,
        )?;
        println!("{name}: layer 1 (`{prefix}`) → {}", weights.display());
    }
    Ok(())
}

/// The input `x` of a fixture's `*_io.safetensors` (f32 or f64), as an f32 tensor.
fn input(path: &Path, device: &Device) -> Result<Tensor<3>, Box<dyn std::error::Error>> {
    let bytes = std::fs::read(path)?;
    let file = safetensors::SafeTensors::deserialize(&bytes)?;
    let x = file.tensor("x")?;
    let values: Vec<f64> = match x.dtype() {
        safetensors::Dtype::F64 => x
            .data()
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect(),
        _ => x
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")) as f64)
            .collect(),
    };
    let data = TensorData::new(values, x.shape().to_vec());
    Ok(Tensor::<3>::from_data(data, (device, DType::F32)))
}
