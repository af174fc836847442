//! The peak memory of `ffn-train`'s training steps for a config, in f32 and in bf16
//! (`train.precision`): each precision in a fresh process, `--steps` steps (3 by default:
//! AdamW's moments are made in the first), no checkpoint and no evaluation before the last
//! step. The measure is the peak of live allocations while the run trains, above those live
//! when it starts (the data, the model and its parameters are made before), every allocation
//! counted by the benchmark's allocator: what the tensors need, whatever the allocator keeps
//! mapped. The run's final evaluation is inside it, and needs less.
//!
//! ```text
//! cargo bench --bench train -- configs/gpt.toml
//! cargo bench --bench train -- configs/gpt.toml --steps 1
//! ```

use ffn::train::TrainConfig;

#[allow(dead_code)] // the FFN benchmarks' helpers, not all used here
mod common;
use common::{memory_child_row, peak_allocated};

/// In a fresh process: `steps` steps of `config` in `precision`, the peak as one JSON object.
fn child(config: &str, precision: &str, steps: &str) {
    let overrides = [
        format!("train.precision={precision}"),
        format!("train.steps={steps}"),
        format!("train.eval_every={steps}"),
        format!("train.checkpoint_every={steps}"),
    ];
    let config = TrainConfig::load(config.as_ref(), &overrides).expect("the config");
    let device = ffn::train::backend::device(None).expect("the default device");
    let run = std::env::temp_dir().join(format!("ffn-bench-train-{}", std::process::id()));
    let trainer = ffn::train::Trainer::start(config, &run, &device).expect("a run");
    let progress = ffn::train::metrics::Progress::auto(0);
    let (summary, peak) = peak_allocated(|| trainer.run(&progress));
    summary.expect("the run");
    std::fs::remove_dir_all(&run).expect("remove the run's folder");
    println!(r#"{{"precision":"{precision}","steps":{steps},"peak_mib":{peak:.1}}}"#);
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(i) = args.iter().position(|a| a == "--child") {
        return child(&args[i + 1], &args[i + 2], &args[i + 3]);
    }
    let value = |flag: &str| {
        let i = args.iter().position(|a| a == flag)?;
        args.get(i + 1).cloned()
    };
    let steps = value("--steps").unwrap_or_else(|| "3".into());
    let config = args
        .iter()
        .find(|a| a.ends_with(".toml"))
        .cloned()
        .unwrap_or_else(|| "configs/gpt.toml".into());
    println!(
        "Peak memory of {steps} training steps of {config}: live allocations above those when \
         training starts, MiB"
    );
    println!("{:<9} {:>9} {:>9}", "precision", "peak", "/ f32");
    let mut f32_peak = None;
    for precision in ["f32", "bf16"] {
        let (_, row) = memory_child_row(&[
            "--child".into(),
            config.clone(),
            precision.into(),
            steps.clone(),
        ]);
        let peak = row["peak_mib"].as_f64().expect("peak_mib");
        let base = *f32_peak.get_or_insert(peak);
        println!("{precision:<9} {peak:>9.1} {:>8.2}×", peak / base);
    }
}
