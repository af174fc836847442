//! What both benchmarks measure with: a median of timed runs, the peak memory of training
//! steps (in a child process each), and the allocator the timings run with.

use std::time::Instant;

#[allow(dead_code)] // `enable` and `report` are the train benchmark's
pub mod sites;

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

/// Every allocation of the benchmark goes through the system allocator, counted: the bytes
/// live now and their high-water mark. The peak of live bytes is what the tensors themselves
/// need, whatever the allocator then keeps mapped (the resident set's peak also counts pages
/// that glibc holds after a free, and differs from run to run with its thresholds).
pub struct Counting;

static LIVE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static HIGH: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; the counters are atomics.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded.
        let p = unsafe { std::alloc::System.alloc(layout) };
        if !p.is_null() {
            grew(p, layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded.
        let p = unsafe { std::alloc::System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(p, layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: the caller's contract, forwarded.
        sites::freed(p as usize, layout.size());
        unsafe { std::alloc::System.dealloc(p, layout) };
        LIVE.fetch_sub(layout.size(), std::sync::atomic::Ordering::Relaxed);
    }

    unsafe fn realloc(&self, p: *mut u8, layout: std::alloc::Layout, size: usize) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded.
        let q = unsafe { std::alloc::System.realloc(p, layout, size) };
        if !q.is_null() {
            sites::freed(p as usize, layout.size());
            LIVE.fetch_sub(layout.size(), std::sync::atomic::Ordering::Relaxed);
            grew(q, size);
        }
        q
    }
}

fn grew(p: *mut u8, bytes: usize) {
    use std::sync::atomic::Ordering::Relaxed;
    let live = LIVE.fetch_add(bytes, Relaxed) + bytes;
    let high = HIGH.fetch_max(live, Relaxed);
    sites::made(p as usize, bytes, live >= high);
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The peak memory of training steps, MiB.
pub struct StepPeak {
    /// The resident set's peak above the resident set before the steps.
    pub rss: f64,
    /// The resident set's peak itself.
    pub rss_total: f64,
    /// The peak of live allocated bytes above those live before the steps.
    pub allocated: f64,
}

/// Three AdamW steps of `model` (`L = Σ forward(x) ⊙ g` for `x`, `g` of `[tokens, d_model]`,
/// the input's gradient taken) and their peak memory. Every parameter is read first: they are
/// drawn before the measurement (burn initialises parameters lazily), and each step waits for
/// its update.
pub fn step_memory<M: Module>(
    mut model: M,
    forward: impl Fn(&M, Tensor<2>) -> Tensor<2>,
    [tokens, d_model]: [usize; 2],
    device: &Device,
) -> StepPeak {
    let normal = || Tensor::<2>::random([tokens, d_model], Distribution::Normal(0.0, 1.0), device);
    let (x, g) = (normal().require_grad(), normal());
    let _: f32 = (x.clone().sum() + g.clone().sum()).into_scalar();
    read_every_parameter(&model);
    let mut optim = AdamWConfig::new().init();
    let before = status_mib("VmRSS:");
    std::fs::write("/proc/self/clear_refs", "5").expect("reset the RSS high-water mark");
    let ((), allocated) = peak_allocated(|| {
        for _ in 0..3 {
            let grads = (forward(&model, x.clone()) * g.clone()).sum().backward();
            let _: f32 = x.grad(&grads).expect("dx").sum().into_scalar();
            let grads = GradientsParams::from_grads(grads, &model);
            model = optim.step(1e-4, model, grads);
            read_every_parameter(&model);
        }
    });
    let peak = status_mib("VmHWM:");
    StepPeak {
        rss: peak - before,
        rss_total: peak,
        allocated,
    }
}

/// Runs `work` and returns its result with the peak of live allocations while it ran, above
/// those live when it started, in MiB.
pub fn peak_allocated<T>(work: impl FnOnce() -> T) -> (T, f64) {
    use std::sync::atomic::Ordering::Relaxed;
    let live_before = LIVE.load(Relaxed);
    HIGH.store(live_before, Relaxed);
    let out = work();
    let bytes = HIGH.load(Relaxed).saturating_sub(live_before);
    (out, bytes as f64 / (1 << 20) as f64)
}

/// Reads every float parameter of `model`, which draws those not yet drawn (burn initialises
/// parameters lazily, on first use) and waits for any update still running.
fn read_every_parameter<M: Module>(model: &M) {
    struct Read;
    impl burn::module::ModuleVisitor for Read {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
            let _: f32 = param.val().sum().into_scalar();
        }
    }
    model.visit(&mut Read);
}

/// Runs this benchmark again with `args` (a `--memory-child` invocation) in a fresh process;
/// returns the JSON line it printed last, as text and parsed.
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
    let stdout = String::from_utf8(out.stdout).expect("UTF-8");
    // The JSON object is the last line (what the measured work prints comes before it).
    let line = format!("{}\n", stdout.trim_end().lines().last().unwrap_or_default());
    let row = serde_json::from_str(line.trim()).expect("JSON");
    (line, row)
}
