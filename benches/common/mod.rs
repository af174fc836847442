//! What both benchmarks measure with: a median of timed runs, the peak memory of training
//! steps (in a child process each), and the allocator the timings run with.

use std::time::Instant;

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Distribution, Tensor};

/// The precisions named by `--precision` in `args` (`f32`, `bf16`, comma separated): f32 when
/// the flag is absent.
pub fn precisions(args: &[String]) -> Vec<ffn::model::Precision> {
    use ffn::model::Precision;
    let Some(i) = args.iter().position(|a| a == "--precision") else {
        return vec![Precision::F32];
    };
    let list = args.get(i + 1).expect("--precision f32, bf16 or f32,bf16");
    list.split(',')
        .map(|p| match p {
            "f32" => Precision::F32,
            "bf16" => Precision::Bf16,
            other => panic!("--precision: f32 or bf16, not {other}"),
        })
        .collect()
}

/// Median seconds of `repeats` runs of `f`, after 2 warm-up runs.
pub fn median(repeats: usize, mut f: impl FnMut()) -> f64 {
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

/// A field of `/proc/self/status` in MiB (Linux): `VmRSS:` the resident set, `VmHWM:` its
/// high-water mark (reset by writing `5` to `/proc/self/clear_refs`).
pub fn status_mib(field: &str) -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status (Linux)");
    let line = status
        .lines()
        .find(|l| l.starts_with(field))
        .unwrap_or_else(|| panic!("{field} in /proc/self/status"));
    let kib: f64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib / 1024.0
}

/// The allocator the timings run with: `ffn_model::keep_freed_memory` (as `ffn-train` runs),
/// unless `--plain-allocator` asks for glibc's defaults. The comparison scripts give PyTorch the
/// same setting. Returns its name for the table's header.
pub fn allocator(args: &[String]) -> &'static str {
    if args.iter().any(|a| a == "--plain-allocator") {
        "glibc defaults"
    } else {
        ffn::model::keep_freed_memory();
        "freed memory kept (ffn_model::keep_freed_memory)"
    }
}

/// Three AdamW steps of `model` (`L = Σ forward(x) ⊙ g` for `x`, `g` of `[tokens, d_model]`,
/// the input's gradient taken); returns the peak resident memory above the resident set before
/// them and the peak itself, in MiB. `probe` reads every weight: they are drawn before the measurement (burn
/// initialises parameters lazily), and each step waits for its update.
pub fn step_memory<M: Module>(
    mut model: M,
    forward: impl Fn(&M, Tensor<2>) -> Tensor<2>,
    probe: impl Fn(&M) -> f32,
    [tokens, d_model]: [usize; 2],
    device: &Device,
) -> (f64, f64) {
    let normal = || Tensor::<2>::random([tokens, d_model], Distribution::Normal(0.0, 1.0), device);
    let (x, g) = (normal().require_grad(), normal());
    let _: f32 = (x.clone().sum() + g.clone().sum()).into_scalar();
    probe(&model);
    let mut optim = AdamWConfig::new().init();
    let before = status_mib("VmRSS:");
    std::fs::write("/proc/self/clear_refs", "5").expect("reset the RSS high-water mark");
    for _ in 0..3 {
        let grads = (forward(&model, x.clone()) * g.clone()).sum().backward();
        let _: f32 = x.grad(&grads).expect("dx").sum().into_scalar();
        let grads = GradientsParams::from_grads(grads, &model);
        model = optim.step(1e-4, model, grads);
        probe(&model);
    }
    let peak = status_mib("VmHWM:");
    (peak - before, peak)
}

/// Runs this benchmark again with `args` (a `--memory-child` invocation) in a fresh process;
/// returns the JSON line it printed, as text and parsed.
pub fn memory_child_row(args: &[String]) -> (String, serde_json::Value) {
    let me = std::env::current_exe().expect("this benchmark's path");
    let out = std::process::Command::new(me)
        .args(args)
        .output()
        .expect("run the memory child");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = String::from_utf8(out.stdout).expect("UTF-8");
    let row = serde_json::from_str(line.trim()).expect("JSON");
    (line, row)
}
