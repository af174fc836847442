//! `ffn-model` inside your own burn module: a residual pre-norm transformer sub-block,
//! `x + FFN(LayerNorm(x))`, written as someone importing the crate would write it.
//!
//! ```text
//! cargo run --example library
//! ```
//!
//! Depend on `ffn-model` (it enables no backend) and pick a backend through burn's features in
//! your own crate.

use burn::module::Module;
use burn::nn::{LayerNorm, LayerNormConfig};
use burn::tensor::{Device, Distribution, Tensor};
use ffn_model::{ConfigError, FeedForward, FeedForwardConfig, Variant};
use serde::{Deserialize, Serialize};

/// Your block's config: it embeds the FFN's, so one TOML file describes both.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct ResidualFfnConfig {
    d_model: usize,
    ffn: FeedForwardConfig,
}

impl ResidualFfnConfig {
    fn init(&self, device: &Device) -> Result<ResidualFfn, ConfigError> {
        Ok(ResidualFfn {
            norm: LayerNormConfig::new(self.d_model).init(device),
            ffn: self.ffn.try_init(device)?,
        })
    }
}

/// `y = x + FFN(LayerNorm(x))`.
#[derive(Module, Debug)]
struct ResidualFfn {
    norm: LayerNorm,
    ffn: FeedForward,
}

impl ResidualFfn {
    fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        x.clone() + self.ffn.forward(self.norm.forward(x))
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    #[cfg(any(feature = "flex", feature = "ndarray"))]
    let device = ffn::cpu();
    // A build with a GPU backend only: burn's default device is that GPU.
    #[cfg(not(any(feature = "flex", feature = "ndarray")))]
    let device = Device::default();
    let config = ResidualFfnConfig {
        d_model: 64,
        ffn: FeedForwardConfig::preset(Variant::GeGlu, 64).with_dropout(0.1),
    };
    let block = config.init(&device)?;
    println!("{block}");

    let x = Tensor::<3>::random([2, 10, 64], Distribution::Normal(0.0, 1.0), &device);
    let y = block.forward(x.clone());
    println!("[2, 10, 64] -> {:?}", y.dims());

    // burn's own record format keeps the FFN's activation with its weights.
    let dir = std::env::temp_dir().join("ffn-library-example");
    std::fs::create_dir_all(&dir)?;
    block.clone().save_file(dir.join("block.bpk"))?;
    let reloaded = config.init(&device)?.load_file(dir.join("block.bpk"));
    let diff: f32 = (reloaded.forward(x.clone()) - y.clone())
        .abs()
        .max()
        .into_scalar();
    println!("reloaded from burn record: max difference {diff}");

    // The FFN alone, in PyTorch layout and names (up.weight [d_ff, d_model], ...).
    block.ffn.save_safetensors(dir.join("ffn.safetensors"))?;
    let ffn = config
        .ffn
        .init(&device)
        .load_safetensors(dir.join("ffn.safetensors"))?;
    println!("FFN reloaded from safetensors: {}", ffn.activation());

    // Bad input is a typed error, not a panic.
    let bad = FeedForwardConfig::new(64, 0);
    println!("invalid config: {}", bad.try_init(&device).unwrap_err());
    Ok(())
}
