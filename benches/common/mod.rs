//! What both benchmarks measure with: a median of timed runs, and the resident memory.

use std::time::Instant;

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
