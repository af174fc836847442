//! The FFN benchmark: every Shazeer variant at two transformer shapes, on every CPU backend
//! compiled in, timing three things:
//!
//! - `forward`: `y = FFN(x)` without autodiff;
//! - `fwd+bwd`: `L = Σ y ⊙ g` for a fixed random `g`, and every gradient, the input's
//!   included: what an FFN inside a network computes in training;
//! - `fwd+bwd-w`: the same with an input that needs no gradient (weights only);
//! - `step`: `fwd+bwd` plus one AdamW update;
//! - `block`: a pre-norm residual block, `y = x + FFN(LayerNorm(x))`, forward and backward with
//!   the input's gradient.
//!
//! FLOPs are counted as in `FeedForwardConfig::flops_per_token` (2 per multiply-add of the
//! matrix products): the forward's, 3× that with the input gradient, and 2.5× (gated 7/3×)
//! without it. Each backend runs the FFN op (`<backend>`), the same network composed from
//! burn's ops and differentiated by autodiff (`<backend>-composed`, `--paths op,composed`), and
//! gated variants also with the fused `[W_gate | W_up]` projection (`<backend>-fused`).
//!
//! `--memory` measures instead the peak memory of training steps, each configuration in a
//! fresh process: the resident set's high-water mark over three AdamW steps with the input
//! gradient (from `/proc/self/status`, reset through `/proc/self/clear_refs`) minus the
//! resident set just before them, with the model, its input and the optimizer built.
//! `tools/bench_torch.py --memory` does the same for PyTorch. Configurations: `memory = "save"`
//! and `"recompute"`, unfused and fused.
//!
//! Timings run with freed memory kept mapped (`ffn_model::keep_freed_memory`, as `ffn-train`
//! runs; `--plain-allocator`: glibc's defaults); `tools/bench_torch.py` gives PyTorch the same.
//! Memory is measured with glibc's defaults on both sides.
//!
//! ```text
//! cargo bench --bench ffn                            # the table
//! cargo bench --bench ffn -- --json rows.jsonl       # also one JSON object per row
//! cargo bench --bench ffn -- --repeats 3 --variants SwiGLU,FFN_GELU --modes fwd+bwd,block
//! cargo bench --bench ffn -- --memory                # peak memory of a training step
//! cargo bench --bench ffn -- --memory --precision f32,bf16   # ... in each precision
//! cargo bench --bench ffn -- --memory-mode recompute  # times with memory = "recompute"
//! cargo bench --bench ffn -- --precision f32,bf16     # each row in f32, then in bf16 (`-bf16`)
//! cargo bench --bench ffn -- --plain-allocator       # times with glibc's default allocator
//! cargo bench --bench ffn --features wgpu -- --backends wgpu   # on the GPU
//! python3 tools/bench_compare.py                     # side by side with PyTorch, ratios
//! python3 tools/bench_compare.py --memory            # the same for memory
//! ```

use std::io::Write;

use burn::nn::{LayerNorm, LayerNormConfig};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Distribution, Tensor};
use ffn::model::{FeedForward, FeedForwardConfig, Memory, Precision, Variant};

mod common;
use common::{median, memory_child_row, step_memory};

/// `(d_model, tokens)`: BERT-base-like at 2048 tokens, Transformer-base-like at 4096.
const SHAPES: [(usize, usize); 2] = [(512, 4096), (768, 2048)];

/// Builds a backend's device, `None` when it cannot be had.
type MakeDevice = fn() -> Option<Device>;

/// Every compiled backend (or those named by `--backends a,b`), in preference order. wgpu is
/// left out, with a message, when no adapter can be initialised.
#[allow(deprecated)] // Device::ndarray: burn-ndarray is deprecated upstream, measured here.
fn backends(wanted: Option<&[String]>) -> Vec<(&'static str, Device)> {
    let compiled: Vec<(&'static str, MakeDevice)> = vec![
        #[cfg(feature = "flex")]
        ("flex", || Some(Device::flex())),
        #[cfg(feature = "ndarray")]
        ("ndarray", || Some(Device::ndarray())),
        #[cfg(feature = "wgpu")]
        ("wgpu", || {
            ffn::wgpu().map_err(|e| eprintln!("wgpu skipped: {e}")).ok()
        }),
    ];
    compiled
        .into_iter()
        .filter(|(name, _)| wanted.is_none_or(|w| w.iter().any(|n| n == name)))
        .filter_map(|(name, device)| Some((name, device()?)))
        .collect()
}

/// The FFN computed through the op or composed from burn's ops.
#[derive(Clone, Copy, PartialEq)]
enum Path {
    Op,
    Composed,
}

fn forward(ffn: &FeedForward, x: Tensor<2>, path: Path) -> Tensor<2> {
    match path {
        Path::Op => ffn.forward(x),
        Path::Composed => ffn.forward_composed(x),
    }
}

/// `L = Σ y ⊙ g`: its gradient with respect to `y` is `g`, as from the rest of a network.
fn loss(ffn: &FeedForward, x: Tensor<2>, g: &Tensor<2>, path: Path) -> Tensor<1> {
    (forward(ffn, x, path) * g.clone()).sum()
}

/// The training-step setups whose memory is measured: `(name, fused, memory)`.
const MEMORY_SETUPS: [(&str, bool, Memory); 4] = [
    ("save", false, Memory::Save),
    ("recompute", false, Memory::Recompute),
    ("fused", true, Memory::Save),
    ("fused-recompute", true, Memory::Recompute),
];

/// Every timed mode, in table order.
const MODES: [&str; 5] = ["forward", "fwd+bwd", "fwd+bwd-w", "step", "block"];

/// In a fresh process: the peak memory of three AdamW steps of one configuration (a setup
/// name, `-bf16` at its end for bf16), as one JSON object on stdout.
fn memory_child(backend: &str, variant: Variant, d_model: usize, tokens: usize, setup: &str) {
    let (base, precision) = match setup.strip_suffix("-bf16") {
        Some(base) => (base, Precision::Bf16),
        None => (setup, Precision::F32),
    };
    let (_, fused, memory) = *MEMORY_SETUPS
        .iter()
        .find(|s| s.0 == base)
        .expect("a setup name");
    let device = backends(Some(&[backend.to_string()]))
        .pop()
        .expect("a compiled backend")
        .1;
    let autodiff = device.autodiff();
    autodiff.seed(0);
    let config = FeedForwardConfig::preset(variant, d_model)
        .with_fused_gate_up(fused)
        .with_memory(memory)
        .with_precision(precision);
    let peak = step_memory(
        config.init(&autodiff),
        |model, x| forward(model, x, Path::Op),
        [tokens, d_model],
        &autodiff,
    );
    println!(
        r#"{{"impl":"ffn-{backend}","setup":"{setup}","variant":"{}","d_model":{d_model},"d_ff":{},"tokens":{tokens},"mode":"memory","step_mib":{:.1},"peak_rss_mib":{:.1},"allocated_mib":{:.1}}}"#,
        variant.name(),
        config.d_ff,
        peak.rss,
        peak.rss_total,
        peak.allocated,
    );
}

/// Runs [`memory_child`] for every backend, variant, setup and precision, each in its own
/// process.
fn memory(
    wanted: Option<&[String]>,
    variants: &[Variant],
    precisions: &[Precision],
    json: &mut Option<std::fs::File>,
) {
    println!(
        "Peak memory of three AdamW steps, MiB: the resident set's above the set before them \
         (step), and the live allocations' above those before them (allocated)"
    );
    println!(
        "{:<8} {:<13} {:>7} {:>6} {:>6} {:>20} {:>9} {:>9}",
        "backend", "variant", "d_model", "d_ff", "tokens", "setup", "step", "allocated"
    );
    // Resident memory is host memory: a GPU's is not measured here.
    for (backend, _) in backends(wanted).into_iter().filter(|(b, _)| *b != "wgpu") {
        for &(d_model, tokens) in &SHAPES {
            for &variant in variants {
                let setups = MEMORY_SETUPS.iter().flat_map(|&(setup, fused, _)| {
                    precisions.iter().map(move |&p| match p {
                        Precision::F32 => (setup.to_string(), fused),
                        Precision::Bf16 => (format!("{setup}-bf16"), fused),
                    })
                });
                for (setup, fused) in setups {
                    if fused && !variant.gated() {
                        continue;
                    }
                    let (line, row) = memory_child_row(&[
                        "--memory-child".into(),
                        backend.into(),
                        variant.name().into(),
                        setup.clone(),
                        d_model.to_string(),
                        tokens.to_string(),
                    ]);
                    println!(
                        "{backend:<8} {:<13} {d_model:>7} {:>6} {tokens:>6} {setup:>20} {:>9.1} {:>9.1}",
                        variant.name(),
                        row["d_ff"],
                        row["step_mib"].as_f64().unwrap(),
                        row["allocated_mib"].as_f64().unwrap(),
                    );
                    if let Some(file) = json.as_mut() {
                        write!(file, "{line}").expect("write --json");
                    }
                }
            }
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--memory-child") {
        let arg = |k: usize| args[i + k].as_str();
        let variant: Variant = arg(2).parse().expect("a variant");
        let number = |k: usize| arg(k).parse::<usize>().expect("a size");
        memory_child(arg(1), variant, number(4), number(5), arg(3));
        return;
    }
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
    let wanted: Option<Vec<String>> =
        value("--backends").map(|list| list.split(',').map(str::to_string).collect());
    let mut json = value("--json").map(|p| std::fs::File::create(p).expect("--json FILE"));
    let precisions = common::precisions(&args);
    if args.iter().any(|a| a == "--memory") {
        memory(wanted.as_deref(), &variants, &precisions, &mut json);
        return;
    }
    let modes: Vec<String> = value("--modes").map_or(MODES.map(String::from).to_vec(), |list| {
        list.split(',').map(str::to_string).collect()
    });
    let paths: Vec<Path> = value("--paths").map_or(vec![Path::Op, Path::Composed], |list| {
        list.split(',')
            .map(|p| match p {
                "op" => Path::Op,
                "composed" => Path::Composed,
                other => panic!("--paths: op or composed, not {other}"),
            })
            .collect()
    });
    let memory = match value("--memory-mode").as_deref() {
        None | Some("save") => Memory::Save,
        Some("recompute") => Memory::Recompute,
        Some(other) => panic!("--memory-mode: save or recompute, not {other}"),
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let allocator = common::allocator(&args);
    println!(
        "FFN benchmark: median of {repeats}, {threads} threads, GFLOP/s of the matrix products; allocator: {allocator}; matrix products: {}",
        ffn::model::cpu_kernels()
    );
    println!(
        "{:<16} {:<13} {:>7} {:>6} {:>6} {:<9} {:>9} {:>11} {:>8}",
        "backend", "variant", "d_model", "d_ff", "tokens", "mode", "ms", "tokens/s", "GFLOP/s"
    );
    for (backend, device) in backends(wanted.as_deref()) {
        for &(d_model, tokens) in &SHAPES {
            for &variant in &variants {
                let setups = [(Path::Op, false), (Path::Op, true), (Path::Composed, false)];
                for (path, fused) in setups
                    .into_iter()
                    .filter(|(p, f)| paths.contains(p) && (variant.gated() || !f))
                {
                    for &precision in &precisions {
                        let label = match (path, fused) {
                            (Path::Op, false) => backend.to_string(),
                            (Path::Op, true) => format!("{backend}-fused"),
                            (Path::Composed, _) => format!("{backend}-composed"),
                        } + if precision == Precision::Bf16 {
                            "-bf16"
                        } else {
                            ""
                        };
                        let config = FeedForwardConfig::preset(variant, d_model)
                            .with_fused_gate_up(fused)
                            .with_memory(memory)
                            .with_precision(precision);
                        let rows = run(&config, &device, tokens, path, repeats, &modes);
                        let flops = (config.flops_per_token() * tokens as u64) as f64;
                        for (mode, seconds) in rows {
                            let factor = match mode {
                                "forward" => 1.0,
                                "fwd+bwd-w" if variant.gated() => 7.0 / 3.0,
                                "fwd+bwd-w" => 2.5,
                                _ => 3.0,
                            };
                            let gflops = factor * flops / seconds / 1e9;
                            println!(
                                "{label:<16} {:<13} {d_model:>7} {:>6} {tokens:>6} {mode:<9} {:>9.1} {:>11.0} {gflops:>8.1}",
                                variant.name(),
                                config.d_ff,
                                seconds * 1e3,
                                tokens as f64 / seconds,
                            );
                            if let Some(file) = json.as_mut() {
                                writeln!(
                                file,
                                r#"{{"impl":"ffn-{label}","variant":"{}","d_model":{d_model},"d_ff":{},"tokens":{tokens},"mode":"{mode}","ms":{},"threads":{threads}}}"#,
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
    }
}

/// Times each of `modes` for one configuration: `(mode, median seconds)`.
fn run(
    config: &FeedForwardConfig,
    device: &Device,
    tokens: usize,
    path: Path,
    repeats: usize,
    modes: &[String],
) -> Vec<(&'static str, f64)> {
    let d_model = config.d_model;
    let autodiff = device.clone().autodiff();
    device.seed(0);
    let normal = |device: &Device| {
        Tensor::<2>::random([tokens, d_model], Distribution::Normal(0.0, 1.0), device)
    };
    let plain = config.init(device);
    let ffn = config.init(&autodiff);
    let (x, xa, g) = (normal(device), normal(&autodiff), normal(&autodiff));
    let x_grad = xa.clone().require_grad();
    let norm: LayerNorm = LayerNormConfig::new(d_model).init(&autodiff);
    let mut model = Some(config.init(&autodiff));
    let mut optim = AdamWConfig::new().init();

    let mut rows = vec![];
    for &mode in MODES.iter().filter(|m| modes.iter().any(|w| w == *m)) {
        let seconds = match mode {
            "forward" => median(repeats, || {
                let _: f32 = forward(&plain, x.clone(), path).sum().into_scalar();
            }),
            "fwd+bwd" | "fwd+bwd-w" => {
                let input = if mode == "fwd+bwd" { &x_grad } else { &xa };
                median(repeats, || {
                    let grads = loss(&ffn, input.clone(), &g, path).backward();
                    let dw = ffn.down().weight.val().grad(&grads).expect("dW_down");
                    let mut sum = dw.sum();
                    if let Some(dx) = input.grad(&grads) {
                        sum = sum + dx.sum();
                    }
                    let _: f32 = sum.into_scalar();
                })
            }
            "step" => median(repeats, || {
                let m = model.take().expect("the model");
                let grads = loss(&m, x_grad.clone(), &g, path).backward();
                let _: f32 = x_grad.grad(&grads).expect("dx").sum().into_scalar();
                let grads = GradientsParams::from_grads(grads, &m);
                let m = optim.step(1e-4, m, grads);
                let _: f32 = m.down().weight.val().sum().into_scalar();
                model = Some(m);
            }),
            "block" => median(repeats, || {
                // y = x + FFN(LayerNorm(x))
                let y = x_grad.clone() + forward(&ffn, norm.forward(x_grad.clone()), path);
                let grads = (y * g.clone()).sum().backward();
                let _: f32 = x_grad.grad(&grads).expect("dx").sum().into_scalar();
            }),
            _ => unreachable!(),
        };
        rows.push((mode, seconds));
    }
    rows
}
