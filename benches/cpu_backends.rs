//! Which CPU backend should be the default? The same FFN training step (forward + backward of
//! `L = Σ y²`) on every CPU backend compiled in, side by side in one run.
//!
//! ```text
//! cargo bench --bench cpu_backends --features ndarray
//! ```
//!
//! Shapes: d_model 512, 4096 tokens; FFN_GELU (d_ff 2048) and SwiGLU (d_ff 1365). FLOPs are
//! counted as in `FeedForwardConfig::flops_per_token`, times 3 for forward + backward.

use std::time::Instant;

use burn::tensor::{Device, Distribution, Tensor};
use ffn::model::{FeedForwardConfig, Variant};

const TOKENS: usize = 4096;
const D_MODEL: usize = 512;
const REPEATS: usize = 7;

#[allow(deprecated)] // Device::ndarray: burn-ndarray is deprecated upstream, measured here.
fn backends() -> Vec<(&'static str, Device)> {
    [
        #[cfg(feature = "flex")]
        ("flex", Device::flex()),
        #[cfg(feature = "ndarray")]
        ("ndarray", Device::ndarray()),
    ]
    .into_iter()
    .collect()
}

/// Median seconds of one forward + backward step.
fn time_step(config: &FeedForwardConfig, device: &Device) -> f64 {
    let device = device.clone().autodiff();
    let ffn = config.init(&device);
    let x = Tensor::<2>::random([TOKENS, D_MODEL], Distribution::Normal(0.0, 1.0), &device);
    let mut times = Vec::new();
    for i in 0..REPEATS + 1 {
        let start = Instant::now();
        let y = ffn.forward(x.clone());
        let grads = (y.clone() * y).sum().backward();
        let g = ffn.up().weight.val().grad(&grads).unwrap();
        let _ = g.sum().into_scalar::<f32>();
        if i > 0 {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn main() {
    let backends = backends();
    println!(
        "forward+backward, {TOKENS} tokens, d_model {D_MODEL}, median of {REPEATS}, {} threads",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    for variant in [Variant::FfnGelu, Variant::SwiGlu] {
        let config = FeedForwardConfig::preset(variant, D_MODEL);
        let flops = 3.0 * (config.flops_per_token() * TOKENS as u64) as f64;
        let mut first = None;
        for (name, device) in &backends {
            let seconds = time_step(&config, device);
            let base = *first.get_or_insert(seconds);
            println!(
                "{:<11} d_ff {:>4} {name:<8} {:>8.1} ms {:>7.1} GFLOP/s   time vs {}: {:.2}x",
                variant.name(),
                config.d_ff,
                seconds * 1e3,
                flops / seconds / 1e9,
                backends[0].0,
                seconds / base
            );
        }
    }
}
