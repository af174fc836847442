//! The mixture-of-experts benchmark: a [`Moe`] layer against the dense [`FeedForward`] with
//! the same active parameters (`d_ff = top_k · expert d_ff`), forward and backward with the
//! input's gradient (`L = Σ y ⊙ g`), on one backend. `tools/bench_moe.py` runs it side by side
//! with the `transformers` Mixtral block and a dense PyTorch SwiGLU, and prints the ratios.
//!
//!
//! Timings run with freed memory kept mapped (`ffn_model::keep_freed_memory`, as `ffn-train`
//! runs; `--plain-allocator`: glibc's defaults), and `tools/bench_moe.py` gives PyTorch the
//! same; memory is measured with glibc's defaults on both sides.
//!
//! `--memory` measures instead the peak memory of a training step: each layer in a fresh
//! process, the resident set's high-water mark over three AdamW steps with the input gradient
//! (from `/proc/self/status`, reset through `/proc/self/clear_refs`) minus the resident set
//! before them (Linux); `tools/bench_moe.py --memory` does the same for the transformers block.
//!
//! ```text
//! cargo bench --bench moe -- --d-model 512 --d-ff 1368 --experts 8 --top-k 2 --tokens 2048
//! cargo bench --bench moe -- --memory          # peak memory of a training step
//! cargo bench --bench moe -- --plain-allocator # times with glibc's default allocator
//! cargo bench --bench moe -- --precision bf16  # both layers in bf16 (the experts' products)
//! python3 tools/bench_moe.py                   # both shapes of the issue, with transformers
//! python3 tools/bench_moe.py --memory          # the same for memory
//! python3 tools/bench_moe.py --precision bf16  # bf16 against transformers under autocast
//! ```

use std::io::Write;

use burn::tensor::{Device, Distribution, Tensor};
use ffn::model::{Activation, FeedForwardConfig, MoeConfig, Precision};

mod common;
use common::{median, memory_child_row, step_memory};

/// The layer's shape.
#[derive(Clone, Copy)]
struct Shape {
    d_model: usize,
    d_ff: usize,
    experts: usize,
    top_k: usize,
    tokens: usize,
    precision: Precision,
}

impl Shape {
    /// An expert (or, `top_k` times as wide, the dense FFN of the same active parameters).
    fn swiglu(&self, d_ff: usize) -> FeedForwardConfig {
        FeedForwardConfig::new(self.d_model, d_ff)
            .with_activation(Activation::Silu)
            .with_gated(true)
            .with_precision(self.precision)
    }

    fn moe(&self) -> MoeConfig {
        MoeConfig::new(self.swiglu(self.d_ff), self.experts, self.top_k)
    }

    fn json(&self, name: &str, field: &str, value: f64) -> String {
        let Self {
            d_model,
            d_ff,
            experts,
            top_k,
            tokens,
            ..
        } = self;
        format!(
            r#"{{"impl":"{name}","d_model":{d_model},"d_ff":{d_ff},"experts":{experts},"top_k":{top_k},"tokens":{tokens},"{field}":{value:.1}}}"#
        )
    }
}

/// In a fresh process: the peak memory of three training steps of `name` (`ffn-moe` or
/// `ffn-dense`), as one JSON object on stdout.
fn memory_child(name: &str, shape: Shape) {
    let device = Device::flex().autodiff();
    device.seed(0);
    let peak = match name {
        "ffn-moe" => step_memory(
            shape.moe().init(&device),
            |m, x| m.forward(x).output,
            [shape.tokens, shape.d_model],
            &device,
        ),
        "ffn-dense" => step_memory(
            shape.swiglu(shape.top_k * shape.d_ff).init(&device),
            |m, x| m.forward(x),
            [shape.tokens, shape.d_model],
            &device,
        ),
        other => panic!("--memory-child: ffn-moe or ffn-dense, not {other}"),
    };
    // The allocations' peak goes in the same object (after the resident set's).
    let line = shape.json(name, "step_mib", peak.rss);
    println!(
        "{},\"peak_rss_mib\":{:.1},\"allocated_mib\":{:.1}}}",
        line.trim_end_matches('}'),
        peak.rss_total,
        peak.allocated
    );
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
    let [precision] = common::precisions(&args)[..] else {
        panic!("--precision: one of f32, bf16");
    };
    let shape = Shape {
        d_model,
        d_ff,
        experts,
        top_k,
        tokens,
        precision,
    };
    let json = args
        .iter()
        .position(|a| a == "--json")
        .map(|i| args[i + 1].clone());
    if let Some(i) = args.iter().position(|a| a == "--memory-child") {
        return memory_child(&args[i + 1], shape);
    }
    let mut file = json.map(|p| std::fs::File::create(p).expect("--json FILE"));
    if args.iter().any(|a| a == "--memory") {
        println!(
            "d_model {d_model}, {experts} experts of d_ff {d_ff}, top-{top_k}, {tokens} tokens: \
             peak memory of three AdamW steps above the resident set before them"
        );
        for name in ["ffn-moe", "ffn-dense"] {
            let mut child = args[1..].to_vec();
            child.extend(["--memory-child".to_string(), name.to_string()]);
            let (line, row) = memory_child_row(&child);
            println!(
                "{name:<10} {:>9.1} MiB resident, {:>9.1} MiB allocated",
                row["step_mib"].as_f64().unwrap(),
                row["allocated_mib"].as_f64().unwrap()
            );
            if let Some(file) = file.as_mut() {
                write!(file, "{line}").expect("write --json");
            }
        }
        return;
    }

    let allocator = common::allocator(&args);
    let device = Device::flex().autodiff();
    device.seed(0);
    let moe = shape.moe().init(&device);
    let dense = shape.swiglu(top_k * d_ff).init(&device);
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
    let suffix = match precision {
        Precision::F32 => "",
        Precision::Bf16 => "-bf16",
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "d_model {d_model}, {experts} experts of d_ff {d_ff}, top-{top_k}, {tokens} tokens, fwd+bwd with dx, \
         median of {repeats}, {threads} threads; allocator: {allocator}; matrix products: {}",
        ffn::model::cpu_kernels()
    );
    for (name, seconds) in rows {
        println!(
            "{:<15} {:>9.1} ms",
            format!("{name}{suffix}"),
            seconds * 1e3
        );
        if let Some(file) = file.as_mut() {
            writeln!(file, "{}", shape.json(name, "ms", seconds * 1e3)).expect("write --json");
        }
    }
}
