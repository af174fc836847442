//! The peak memory of `ffn-train`'s training steps for a config, in f32 and in bf16
//! (`train.precision`): each precision in a fresh process, `--steps` steps (3 by default:
//! AdamW's moments are made in the first), no checkpoint and no evaluation before the last
//! step. The measure is the peak of live allocations while the run trains, above those live
//! when it starts (the data, the model and its parameters are made before), every allocation
//! counted by the benchmark's allocator: what the tensors need, whatever the allocator keeps
//! mapped. The run's final evaluation is inside it, and needs less.
//!
//! With `--sites`, each precision also lists where the allocations live at its peak were made
//! (those of 256 KiB or more, grouped by the first frames of ffn's code in their call stacks).
//!
//! ```text
//! cargo bench --bench train -- configs/gpt.toml
//! cargo bench --bench train -- configs/gpt.toml --steps 1
//! cargo bench --bench train -- configs/gpt.toml --sites
//! ```

use ffn::train::TrainConfig;

#[allow(dead_code)] // the FFN benchmarks' helpers, not all used here
mod common;
use common::{memory_child_row, peak_allocated, sites};

/// In a fresh process: `steps` steps of `config` in `precision`, the peak as one JSON object
/// (with where its memory was made, when `sites`).
fn child(config: &str, precision: &str, steps: &str, sites: bool) {
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
    if sites {
        sites::enable();
    }
    let (summary, peak) = peak_allocated(|| trainer.run(&progress));
    summary.expect("the run");
    std::fs::remove_dir_all(&run).expect("remove the run's folder");
    let row = serde_json::json!({
        "precision": precision,
        "steps": steps.parse::<u64>().expect("--steps: a number"),
        "peak_mib": (peak * 10.0).round() / 10.0,
        "sites": if sites { sites::report() } else { String::new() },
    });
    println!("{row}");
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let sites = args.iter().any(|a| a == "--sites");
    if let Some(i) = args.iter().position(|a| a == "--child") {
        return child(&args[i + 1], &args[i + 2], &args[i + 3], sites);
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
        let mut child = vec![
            "--child".into(),
            config.clone(),
            precision.into(),
            steps.clone(),
        ];
        if sites {
            child.push("--sites".into());
        }
        let (_, row) = memory_child_row(&child);
        let peak = row["peak_mib"].as_f64().expect("peak_mib");
        let base = *f32_peak.get_or_insert(peak);
        println!("{precision:<9} {peak:>9.1} {:>8.2}×", peak / base);
        print!("{}", row["sites"].as_str().unwrap_or_default());
    }
}
