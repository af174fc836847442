//! The FFN benchmark: every Shazeer variant at two transformer shapes, on every CPU backend
//! compiled in, timing three things:
//!
//! - `forward`: `y = FFN(x)` without autodiff;
//! - `fwd+bwd`: `L = Σ y²`, `∇L` (autodiff);
//! - `step`: `fwd+bwd` plus one AdamW update.
//!
//! FLOPs are counted as in `FeedForwardConfig::flops_per_token` (2 per multiply-add of the
//! matrix products): the forward's, and 3× that for `fwd+bwd` and `step`.
//!
//! ```text
//! cargo bench --bench ffn                            # the table
//! cargo bench --bench ffn -- --json rows.jsonl       # also one JSON object per row
//! cargo bench --bench ffn -- --repeats 3 --variants SwiGLU,FFN_GELU
//! python3 tools/bench_compare.py                     # side by side with PyTorch, ratios
//! ```

use std::io::Write;
use std::time::Instant;

use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Distribution, Tensor};
use ffn::model::{FeedForward, FeedForwardConfig, Variant};

/// `(d_model, tokens)`: BERT-base-like at 2048 tokens, Transformer-base-like at 4096.
const SHAPES: [(usize, usize); 2] = [(512, 4096), (768, 2048)];

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

/// Median seconds of `repeats` runs of `f`, after 2 warm-up runs.
fn median(repeats: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..2 {
        f();
    }
    let mut times: Vec<f64> = (0..repeats)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn loss(ffn: &FeedForward, x: Tensor<2>) -> Tensor<1> {
    let y = ffn.forward(x);
    (y.clone() * y).sum()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let repeats: usize = value("--repeats").map_or(5, |v| v.parse().expect("--repeats N"));
    let variants: Vec<Variant> = match value("--variants") {
        Some(list) => list
            .split(',')
            .map(|v| v.parse().expect("a variant name"))
            .collect(),
        None => Variant::ALL.to_vec(),
    };
    let mut json = value("--json").map(|p| std::fs::File::create(p).expect("--json FILE"));
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "FFN benchmark: median of {repeats}, {threads} threads, GFLOP/s of the matrix products"
    );
    println!(
        "{:<8} {:<13} {:>7} {:>6} {:>6} {:<8} {:>9} {:>11} {:>8}",
        "backend", "variant", "d_model", "d_ff", "tokens", "mode", "ms", "tokens/s", "GFLOP/s"
    );
    for (backend, device) in backends() {
        for &(d_model, tokens) in &SHAPES {
            for &variant in &variants {
                let config = FeedForwardConfig::preset(variant, d_model);
                let flops = (config.flops_per_token() * tokens as u64) as f64;
                let autodiff = device.clone().autodiff();
                device.seed(0);

                let plain = config.init(&device);
                let x =
                    Tensor::<2>::random([tokens, d_model], Distribution::Normal(0.0, 1.0), &device);
                let forward = median(repeats, || {
                    let _: f32 = plain.forward(x.clone()).sum().into_scalar();
                });

                let ffn = config.init(&autodiff);
                let xa = Tensor::<2>::random(
                    [tokens, d_model],
                    Distribution::Normal(0.0, 1.0),
                    &autodiff,
                );
                let backward = median(repeats, || {
                    let grads = loss(&ffn, xa.clone()).backward();
                    let _: f32 = ffn
                        .down()
                        .weight
                        .val()
                        .grad(&grads)
                        .expect("a gradient")
                        .sum()
                        .into_scalar();
                });

                let mut model = Some(config.init(&autodiff));
                let mut optim = AdamWConfig::new().init();
                let step = median(repeats, || {
                    let m = model.take().expect("the model");
                    let grads = GradientsParams::from_grads(loss(&m, xa.clone()).backward(), &m);
                    let m = optim.step(1e-4, m, grads);
                    let _: f32 = m.down().weight.val().sum().into_scalar();
                    model = Some(m);
                });

                for (mode, seconds, factor) in [
                    ("forward", forward, 1.0),
                    ("fwd+bwd", backward, 3.0),
                    ("step", step, 3.0),
                ] {
                    let gflops = factor * flops / seconds / 1e9;
                    println!(
                        "{backend:<8} {:<13} {d_model:>7} {:>6} {tokens:>6} {mode:<8} {:>9.1} {:>11.0} {gflops:>8.1}",
                        variant.name(),
                        config.d_ff,
                        seconds * 1e3,
                        tokens as f64 / seconds,
                    );
                    if let Some(file) = json.as_mut() {
                        writeln!(
                            file,
                            r#"{{"impl":"ffn-{backend}","variant":"{}","d_model":{d_model},"d_ff":{},"tokens":{tokens},"mode":"{mode}","ms":{},"threads":{threads}}}"#,
                            variant.name(),
                            config.d_ff,
                            seconds * 1e3
                        )
                        .expect("write --json");
                    }
                }
            }
        }
    }
}
