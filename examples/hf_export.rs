//! Round trip through PyTorch: loads layer 1 of each `transformers` fixture, writes its FFN back
//! in the model's own naming (no prefix) with the output of the loaded FFN beside it, for
//! `tools/hf_fixtures.py --check-export DIR` to load into the model's FFN submodule with
//! `strict=True` and compare.
//!
//! ```text
//! cargo run --example hf_export -- /tmp/ffn-export
//! python3 tools/hf_fixtures.py --check-export /tmp/ffn-export
//! ```

use std::path::PathBuf;

use burn::tensor::{Device, Tensor, TensorData};
use ffn_model::HfModel;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = PathBuf::from(std::env::args().nth(1).ok_or("usage: hf_export DIR")?);
    std::fs::create_dir_all(&out)?;
    let fixtures =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("crates/ffn-test-support/data/hf");
    let device = Device::flex();
    for name in ["bert", "t5-relu", "t5-gated", "llama", "gpt2"] {
        let mut model = HfModel::open(fixtures.join(name))?;
        let ffn = model.load_layer(1, &device)?;
        ffn.save_safetensors_as(
            out.join(format!("{name}.layer1.safetensors")),
            model.scheme(),
            "",
        )?;

        let io = std::fs::read(fixtures.join(name).join("ffn_io.safetensors"))?;
        let io = safetensors::SafeTensors::deserialize(&io)?;
        let x = io.tensor("x")?;
        let values: Vec<f32> = x
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let x = Tensor::<3>::from_data(TensorData::new(values, x.shape().to_vec()), &device);
        let y = ffn.forward(x).into_data();
        let bytes: Vec<u8> = y.iter::<f32>().flat_map(f32::to_le_bytes).collect();
        let view = safetensors::tensor::TensorView::new(
            safetensors::Dtype::F32,
            y.shape().to_vec(),
            &bytes,
        )?;
        std::fs::write(
            out.join(format!("{name}.layer1.output.safetensors")),
            safetensors::serialize([("y", view)], None)?,
        )?;
        println!(
            "{name}: {} scheme, wrote {}",
            model.scheme(),
            out.join(format!("{name}.layer1.safetensors")).display()
        );
    }
    Ok(())
}
