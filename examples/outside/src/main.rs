//! `ffn-model` from outside the workspace: a config from TOML, a few AdamW steps, a safetensors
//! round trip. Exits non-zero when something is off.
//!
//! ```text
//! cargo run --release --manifest-path examples/outside/Cargo.toml
//! ```

use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Distribution, Tensor};
use ffn_model::FeedForwardConfig;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let device = Device::flex().autodiff();
    device.seed(1);
    let config = FeedForwardConfig::from_toml(
        "d_model = 16\nd_ff = 32\nactivation = \"silu\"\ngated = true\n",
    )?;
    let mut ffn = config.try_init(&device)?;

    // Learn y = 0.5 x: the loss must fall.
    let x = Tensor::<3>::random([4, 8, 16], Distribution::Normal(0.0, 1.0), &device);
    let y = x.clone() * 0.5;
    let loss =
        |ffn: &ffn_model::FeedForward| (ffn.forward(x.clone()) - y.clone()).powi_scalar(2).mean();
    let first: f64 = loss(&ffn).into_scalar();
    let mut optim = AdamWConfig::new().init();
    for _ in 0..100 {
        let grads = GradientsParams::from_grads(loss(&ffn).backward(), &ffn);
        ffn = optim.step(1e-2, ffn, grads);
    }
    let last: f64 = loss(&ffn).into_scalar();
    println!("gated SiLU FFN 16→32→16: MSE {first:.4} → {last:.4} after 100 AdamW steps");
    if !(last < first / 4.0) {
        return Err(format!("the loss did not fall enough: {first} -> {last}").into());
    }

    // PyTorch-layout weights, and back.
    let path = std::env::temp_dir().join(format!("ffn-outside-{}.safetensors", std::process::id()));
    ffn.save_safetensors(&path)?;
    let loaded = config.init(&device).load_safetensors(&path)?;
    std::fs::remove_file(&path)?;
    let difference: f64 = (loaded.forward(x.clone()) - ffn.forward(x))
        .abs()
        .max()
        .into_scalar();
    println!("safetensors round trip: max difference {difference}");
    if difference != 0.0 {
        return Err("the reloaded FFN computes another function".into());
    }
    println!("ffn-model works from outside the workspace");
    Ok(())
}
