//! The mixture-of-experts benchmark: a [`Moe`] layer against the dense [`FeedForward`] with
//! the same active parameters (`d_ff = top_k · expert d_ff`), forward and backward with the
//! input's gradient (`L = Σ y ⊙ g`), on one backend. `tools/bench_moe.py` runs it side by side
//! with the `transformers` Mixtral block and a dense PyTorch SwiGLU, and prints the ratios.
//!
//! ```text
//! cargo bench --bench moe -- --d-model 512 --d-ff 1368 --experts 8 --top-k 2 --tokens 2048
//! python3 tools/bench_moe.py        # both shapes of the issue, with transformers
//! ```

use std::io::Write;
use std::time::Instant;

use burn::tensor::{Device, Distribution, Tensor};
use ffn::model::{Activation, FeedForwardConfig, MoeConfig};

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

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let value = |flag: &str, default: usize| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .map_or(default, |v| v.parse().expect("a number"))
    };
    let (d_model, d_ff) = (value("--d-model", 512), value("--d-ff", 1368));
    let (experts, top_k) = (value("--experts", 8), value("--top-k", 2));
    let (tokens, repeats) = (value("--tokens", 2048), value("--repeats", 5));
    let json = args
        .iter()
        .position(|a| a == "--json")
        .map(|i| args[i + 1].clone());

    let device = Device::flex().autodiff();
    device.seed(0);
    let swiglu = |d_ff| {
        FeedForwardConfig::new(d_model, d_ff)
            .with_activation(Activation::Silu)
            .with_gated(true)
    };
    let moe = MoeConfig::new(swiglu(d_ff), experts, top_k).init(&device);
    let dense = swiglu(top_k * d_ff).init(&device);
    let normal = || Tensor::<2>::random([tokens, d_model], Distribution::Normal(0.0, 1.0), &device);
    let (x, g) = (normal().require_grad(), normal());

    let time = |f: &dyn Fn(Tensor<2>) -> Tensor<2>| {
        median(repeats, || {
            let grads = (f(x.clone()) * g.clone()).sum().backward();
            let _: f32 = x.grad(&grads).expect("dx").sum().into_scalar();
        })
    };
    let rows = [
        ("ffn-moe", time(&|x| moe.forward(x).output)),
        ("ffn-dense", time(&|x| dense.forward(x))),
    ];
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "d_model {d_model}, {experts} experts of d_ff {d_ff}, top-{top_k}, {tokens} tokens, fwd+bwd with dx, \
         median of {repeats}, {threads} threads; BLAS: {}",
        ffn::model::blas_library().unwrap_or("none")
    );
    let mut file = json.map(|p| std::fs::File::create(p).expect("--json FILE"));
    for (name, seconds) in rows {
        println!("{name:<10} {:>9.1} ms", seconds * 1e3);
        if let Some(file) = file.as_mut() {
            writeln!(
                file,
                r#"{{"impl":"{name}","d_model":{d_model},"d_ff":{d_ff},"experts":{experts},"top_k":{top_k},"tokens":{tokens},"ms":{}}}"#,
                seconds * 1e3
            )
            .expect("write --json");
        }
    }
}
