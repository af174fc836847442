//! The FFN benchmark: every Shazeer variant at two transformer shapes, on every CPU backend
//! compiled in, timing three things:
//!
//! - `forward`: `y = FFN(x)` without autodiff;
//! - `fwd+bwd`: `L = Σ y²`, `∇L` (autodiff);
//! - `step`: `fwd+bwd` plus one AdamW update.
//!
//! FLOPs are counted as in `FeedForwardConfig::flops_per_token` (2 per multiply-add of the
//! matrix products): the forward's, and 3× that for `fwd+bwd` and `step`. Gated variants also
//! run with the fused `[W_gate | W_up]` projection (backend `<name>-fused`).
//!
//! `--memory` measures instead the peak memory of training steps, each configuration in a
//! fresh process: the resident set's high-water mark over three AdamW steps (from
//! `/proc/self/status`, reset through `/proc/self/clear_refs`) minus the resident set just
//! before them, with the model, its input and the optimizer built. `tools/bench_torch.py
//! --memory` does the same for PyTorch. Configurations: plain, fused, and with burn's gradient
//! checkpointing.
//!
//! ```text
//! cargo bench --bench ffn                            # the table
//! cargo bench --bench ffn -- --json rows.jsonl       # also one JSON object per row
//! cargo bench --bench ffn -- --repeats 3 --variants SwiGLU,FFN_GELU
//! cargo bench --bench ffn -- --memory                # peak memory of a training step
//! cargo bench --bench ffn --features wgpu -- --backends wgpu   # on the GPU
//! python3 tools/bench_compare.py                     # side by side with PyTorch, ratios
//! python3 tools/bench_compare.py --memory            # the same for memory
//! ```

use std::io::Write;
use std::time::Instant;

use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Distribution, Tensor};
use ffn::model::{FeedForward, FeedForwardConfig, Variant};

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

/// The training-step setups whose memory is measured: `(name, fused, gradient checkpointing)`.
const MEMORY_SETUPS: [(&str, bool, bool); 3] = [
    ("plain", false, false),
    ("fused", true, false),
    ("checkpointing", false, true),
];

/// A field of `/proc/self/status` in MiB (Linux).
fn status_mib(field: &str) -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status (Linux)");
    let line = status
        .lines()
        .find(|l| l.starts_with(field))
        .unwrap_or_else(|| panic!("{field} in /proc/self/status"));
    let kib: f64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib / 1024.0
}

/// In a fresh process: the peak memory of three AdamW steps of one configuration, as one
/// JSON object on stdout.
fn memory_child(backend: &str, variant: Variant, d_model: usize, tokens: usize, setup: &str) {
    let (_, fused, checkpointing) = *MEMORY_SETUPS
        .iter()
        .find(|s| s.0 == setup)
        .expect("a setup name");
    let device = backends(Some(&[backend.to_string()]))
        .pop()
        .expect("a compiled backend")
        .1;
    let mut autodiff = device.autodiff();
    if checkpointing {
        autodiff = autodiff.gradient_checkpointing();
    }
    autodiff.seed(0);
    let config = FeedForwardConfig::preset(variant, d_model).with_fused_gate_up(fused);
    let mut model = config.init(&autodiff);
    let x = Tensor::<2>::random([tokens, d_model], Distribution::Normal(0.0, 1.0), &autodiff);
    let _: f32 = x.clone().sum().into_scalar();
    let _: f32 = model.down().weight.val().sum().into_scalar(); // weights drawn
    let mut optim = AdamWConfig::new().init();
    let before = status_mib("VmRSS:");
    std::fs::write("/proc/self/clear_refs", "5").expect("reset the RSS high-water mark");
    for _ in 0..3 {
        let grads = GradientsParams::from_grads(loss(&model, x.clone()).backward(), &model);
        model = optim.step(1e-4, model, grads);
        let _: f32 = model.down().weight.val().sum().into_scalar();
    }
    let peak = status_mib("VmHWM:");
    println!(
        r#"{{"impl":"ffn-{backend}","setup":"{setup}","variant":"{}","d_model":{d_model},"d_ff":{},"tokens":{tokens},"mode":"memory","step_mib":{:.1},"peak_rss_mib":{peak:.1}}}"#,
        variant.name(),
        config.d_ff,
        peak - before,
    );
}

/// Runs [`memory_child`] for every backend, variant and setup, each in its own process.
fn memory(wanted: Option<&[String]>, variants: &[Variant], json: &mut Option<std::fs::File>) {
    let me = std::env::current_exe().expect("this benchmark's path");
    println!("Peak memory of three AdamW steps above the resident set before them (MiB)");
    println!(
        "{:<8} {:<13} {:>7} {:>6} {:>6} {:>14} {:>9}",
        "backend", "variant", "d_model", "d_ff", "tokens", "setup", "step MiB"
    );
    // Resident memory is host memory: a GPU's is not measured here.
    for (backend, _) in backends(wanted).into_iter().filter(|(b, _)| *b != "wgpu") {
        for &(d_model, tokens) in &SHAPES {
            for &variant in variants {
                for (setup, fused, _) in MEMORY_SETUPS {
                    if fused && !variant.gated() {
                        continue;
                    }
                    let out = std::process::Command::new(&me)
                        .args(["--memory-child", backend, variant.name(), setup])
                        .args([d_model.to_string(), tokens.to_string()])
                        .output()
                        .expect("run the memory child");
                    assert!(
                        out.status.success(),
                        "{}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                    let line = String::from_utf8(out.stdout).expect("UTF-8");
                    let row: serde_json::Value = serde_json::from_str(line.trim()).expect("JSON");
                    println!(
                        "{backend:<8} {:<13} {d_model:>7} {:>6} {tokens:>6} {setup:>14} {:>9.1}",
                        variant.name(),
                        row["d_ff"],
                        row["step_mib"].as_f64().unwrap(),
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
    if args.iter().any(|a| a == "--memory") {
        memory(wanted.as_deref(), &variants, &mut json);
        return;
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "FFN benchmark: median of {repeats}, {threads} threads, GFLOP/s of the matrix products"
    );
    println!(
        "{:<13} {:<13} {:>7} {:>6} {:>6} {:<8} {:>9} {:>11} {:>8}",
        "backend", "variant", "d_model", "d_ff", "tokens", "mode", "ms", "tokens/s", "GFLOP/s"
    );
    for (backend, device) in backends(wanted.as_deref()) {
        for &(d_model, tokens) in &SHAPES {
            for (&variant, fused) in variants
                .iter()
                .flat_map(|v| [(v, false), (v, true)])
                .filter(|(v, fused)| v.gated() || !fused)
            {
                let config = FeedForwardConfig::preset(variant, d_model).with_fused_gate_up(fused);
                let label = if fused {
                    format!("{backend}-fused")
                } else {
                    backend.to_string()
                };
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
                        "{label:<13} {:<13} {d_model:>7} {:>6} {tokens:>6} {mode:<8} {:>9.1} {:>11.0} {gflops:>8.1}",
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
