//! `ffn-train sweep` end to end: every output file of a tiny grid, its statistics recomputed
//! from its own results, a sweep stopped half-way and continued, and the configs it refuses.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{assert_error, ffn_train, scratch, stderr, stdout};
use serde_json::Value;

/// A language task: a 1-layer transformer on a small Markov chain (no dropout: a sweep's runs
/// are compared seed by seed).
const LM: &str = r#"
seed = 1
[task]
kind = "markov"
vocab_size = 6
order = 2
support = 2
seq_len = 12
[model]
kind = "transformer"
d_model = 16
n_layers = 1
n_heads = 2
ffn = { preset = "SwiGLU" }
[train]
steps = 20
batch_size = 8
lr = 1e-2
min_lr = 1e-3
warmup_steps = 2
eval_every = 10
eval_batches = 2
log_every = 5
checkpoint_every = 10
"#;

/// A teacher-student task with a ReLU teacher.
const TEACHER: &str = r#"
seed = 1
[task]
kind = "teacher"
noise = 0.1
teacher = { preset = "FFN_ReLU" }
[model]
kind = "ffn"
d_model = 8
ffn = { preset = "FFN_ReLU" }
[train]
steps = 20
batch_size = 32
lr = 1e-2
warmup_steps = 2
eval_every = 10
eval_batches = 2
log_every = 5
checkpoint_every = 10
"#;

/// Two tasks × two variants × two learning rates × two seeds: 16 cells.
const SWEEP: &str = r#"
variants = ["FFN_ReLU", "FFN_SwiGLU"]
seeds = [1, 2]
lrs = [3e-3, 1e-2]

[[tasks]]
name = "lm"
config = "lm.toml"

[[tasks]]
name = "teacher"
config = "teacher.toml"
set = ["train.steps=30"]
"#;

fn write_sweep(dir: &Path, sweep: &str) {
    std::fs::write(dir.join("lm.toml"), LM).unwrap();
    std::fs::write(dir.join("teacher.toml"), TEACHER).unwrap();
    std::fs::write(dir.join("tiny.toml"), sweep).unwrap();
}

/// Runs the sweep `sweep` in `dir` (with `lm.toml` and `teacher.toml` beside it) into `o/`, and
/// returns its `results.jsonl` rows and its `summary.json`.
fn run_sweep(dir: &Path, sweep: &str) -> (Vec<Value>, Value) {
    write_sweep(dir, sweep);
    let out = ffn_train(&["sweep", "--config", "tiny.toml", "--out", "o"], dir);
    assert!(out.status.success(), "{}", stderr(&out));
    let summary = std::fs::read_to_string(dir.join("o/summary.json")).unwrap();
    (
        lines(&dir.join("o/results.jsonl")),
        serde_json::from_str(&summary).unwrap(),
    )
}

fn lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// `results.jsonl` without the fields that time a run (they differ from one run to another).
fn untimed(path: &Path) -> Vec<Value> {
    lines(path)
        .into_iter()
        .map(|mut v| {
            let o = v.as_object_mut().unwrap();
            o.remove("tokens_per_s").unwrap();
            o.remove("wall_time_s").unwrap();
            v
        })
        .collect()
}

#[test]
fn a_tiny_sweep_writes_every_file_and_its_statistics_follow_from_its_results() {
    let dir = scratch("sweep-files");
    write_sweep(&dir, SWEEP);
    let out = ffn_train(
        &[
            "sweep",
            "--config",
            "tiny.toml",
            "--out",
            "out",
            "--jobs",
            "2",
            "--threads",
            "1",
        ],
        &dir,
    );
    assert!(out.status.success(), "{}\n{}", stdout(&out), stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("16 cells (0 done)"), "{text}");
    assert!(text.contains("[16/16]"), "{text}");
    let folder = dir.join("out");

    // results.jsonl: one record per cell, in grid order (task, variant, lr, seed).
    let results = lines(&folder.join("results.jsonl"));
    assert_eq!(results.len(), 16);
    let mut expected = Vec::new();
    for task in ["lm", "teacher"] {
        for variant in ["FFN_ReLU", "FFN_SwiGLU"] {
            for lr in [3e-3, 1e-2] {
                for seed in [1, 2] {
                    expected.push((task, variant, lr, seed));
                }
            }
        }
    }
    for (r, (task, variant, lr, seed)) in results.iter().zip(&expected) {
        assert_eq!(r["task"], *task);
        assert_eq!(r["variant"], *variant);
        assert_eq!(r["lr"].as_f64().unwrap(), *lr);
        assert_eq!(r["seed"].as_u64().unwrap(), *seed);
        assert_eq!(r["status"], "completed");
        assert_eq!(r["steps"], if *task == "lm" { 20 } else { 30 });
        for key in ["final_gap", "best_gap", "tokens_per_s", "wall_time_s"] {
            assert!(r[key].as_f64().unwrap().is_finite(), "{key}: {r}");
        }
        assert!(r["best_gap"].as_f64().unwrap() <= r["final_gap"].as_f64().unwrap());
        assert!(r["params"].as_u64().unwrap() > 0);
    }
    // Parameter parity: both variants of a task have the same FFN parameters, ±1 %.
    let ffn = |i: usize| results[i]["ffn_params"].as_f64().unwrap();
    assert!(
        (ffn(0) - ffn(4)).abs() / ffn(0) < 0.01,
        "{} {}",
        ffn(0),
        ffn(4)
    );
    // Paired seeds: the same seed sees the same task, whatever the variant (the optimum of a
    // Markov chain is a property of its seed).
    assert_eq!(results[0]["optimal_loss"], results[4]["optimal_loss"]);
    assert_ne!(results[0]["optimal_loss"], results[1]["optimal_loss"]);

    // summary.json, recomputed from results.jsonl: the chosen LR has the lowest mean gap, and
    // the statistics are those of the two seeds at it.
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(folder.join("summary.json")).unwrap())
            .unwrap();
    let entries = summary["variants"].as_array().unwrap();
    assert_eq!(entries.len(), 4);
    for e in entries {
        let of = |lr: f64| -> Vec<f64> {
            results
                .iter()
                .filter(|r| r["task"] == e["task"] && r["variant"] == e["variant"])
                .filter(|r| r["lr"].as_f64().unwrap() == lr)
                .map(|r| r["final_gap"].as_f64().unwrap())
                .collect()
        };
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let (a, b) = (of(3e-3), of(1e-2));
        let best = if mean(&a) <= mean(&b) { a } else { b };
        let lr = e["lr"].as_f64().unwrap();
        assert_eq!(of(lr), best, "{e}");
        let m = mean(&best);
        // Two values: std = |a − b|/√2, stderr = |a − b|/2, t_{0.975,1} = 12.7062.
        let spread = (best[0] - best[1]).abs();
        let close = |key: &str, want: f64| {
            let got = e[key].as_f64().unwrap();
            assert!(
                (got - want).abs() <= 1e-9 + 1e-6 * want.abs(),
                "{key}: {got} vs {want}"
            );
        };
        close("mean_gap", m);
        close("std_gap", spread / 2f64.sqrt());
        close("stderr_gap", spread / 2.0);
        close("ci95_low", m - 12.706_204_736_174_7 * spread / 2.0);
        close("ci95_high", m + 12.706_204_736_174_7 * spread / 2.0);
        assert_eq!(e["n"], 2);
        assert!(e["tokens_per_s"].as_f64().unwrap() > 0.0);
        assert!(e["rank"].as_u64().unwrap() >= 1);
    }
    let comparisons = summary["comparisons"].as_array().unwrap();
    assert_eq!(comparisons.len(), 2, "one per task: SwiGLU against ReLU");
    for c in comparisons {
        assert_eq!(c["variant"], "FFN_SwiGLU");
        assert_eq!(c["baseline"], "FFN_ReLU");
        assert_eq!(c["n"], 2);
        let p = c["p"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&p));
        // One comparison per task: Holm changes nothing.
        assert_eq!(c["p_holm"], c["p"]);
    }

    let report = std::fs::read_to_string(folder.join("report.md")).unwrap();
    for needle in [
        "## Task `lm`",
        "## Task `teacher`",
        "| rank | variant |",
        "Against FFN_ReLU (paired by seed",
        "Mean final gap at each learning rate",
        "## Mean rank over tasks",
        "paired t-test",
    ] {
        assert!(report.contains(needle), "`{needle}` not in:\n{report}");
    }
    for plot in ["gaps.svg", "curves.svg"] {
        let svg = std::fs::read_to_string(folder.join(plot)).unwrap();
        assert!(
            svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"),
            "{plot}"
        );
        // One panel per task inside the outer picture.
        assert_eq!(svg.matches("<svg").count(), 3, "{plot}");
        assert!(svg.contains("FFN_SwiGLU"), "{plot}");
    }
    let curves = std::fs::read_to_string(folder.join("curves.svg")).unwrap();
    assert_eq!(
        curves.matches("<polyline").count(),
        4,
        "a line per task and variant"
    );

    // Every cell is a run folder with its config, result and log beside it.
    let cell = folder.join("cells/lm/FFN_SwiGLU/seed-2_lr-1e-2");
    assert!(cell.join("summary.json").is_file());
    assert!(cell.with_extension("toml").is_file());
    assert!(cell.with_extension("json").is_file());
    assert!(cell.with_extension("log").is_file());

    // Run again: nothing is trained, the same results are written.
    let again = ffn_train(&["sweep", "--config", "tiny.toml", "--out", "out"], &dir);
    assert!(again.status.success(), "{}", stderr(&again));
    assert!(stdout(&again).contains("16 cells (16 done)"));
    assert_eq!(lines(&folder.join("results.jsonl")), results);
}

#[test]
fn a_sweep_stopped_half_way_continues_to_the_same_results() {
    let dir = scratch("sweep-resume");
    // One LR (8 cells) and long teacher cells: the sweep is stopped inside one, with 1,480 of
    // its steps to go when the signal is sent (a margin of about a second, also on a loaded
    // machine).
    let sweep = SWEEP.replace("lrs = [3e-3, 1e-2]", "lrs = [3e-3]").replace(
        "set = [\"train.steps=30\"]",
        "set = [\"train.steps=1500\", \"train.checkpoint_every=20\", \"train.eval_every=100\"]",
    );
    write_sweep(&dir, &sweep);
    let straight = ffn_train(
        &[
            "sweep",
            "--config",
            "tiny.toml",
            "--out",
            "straight",
            "--threads",
            "1",
        ],
        &dir,
    );
    assert!(straight.status.success(), "{}", stderr(&straight));

    // Stop it once the first teacher cell (the second cell to run, as the first of
    // each task runs first) has written a checkpoint.
    let child = Command::new(env!("CARGO_BIN_EXE_ffn-train"))
        .args([
            "sweep",
            "--config",
            "tiny.toml",
            "--out",
            "stopped",
            "--threads",
            "1",
        ])
        .current_dir(&dir)
        .env_remove("FFN_DEVICE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let cell = dir.join("stopped/cells/teacher/FFN_ReLU/seed-1_lr-3e-3");
    let start = Instant::now();
    while !cell.join("checkpoints/step-000020").is_dir() {
        assert!(start.elapsed() < Duration::from_secs(600), "no checkpoint");
        std::thread::sleep(Duration::from_millis(10));
    }
    // SAFETY: kill(2) on the child this test started.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let stopped = child.wait_with_output().unwrap();
    assert_eq!(stopped.status.code(), Some(130), "{}", stderr(&stopped));
    let err = stderr(&stopped);
    assert!(
        err.contains("sweep interrupted with 1 of 8 cells done"),
        "{err}"
    );
    // The cell stopped at a checkpoint, with no result: it resumes, it does not start over.
    assert!(!cell.with_extension("json").exists());
    let summary = cell.join("summary.json");
    assert!(!summary.exists());
    let on_record = lines(&dir.join("stopped/results.jsonl"));
    assert_eq!(on_record.len(), 1, "the finished cell is on record");
    assert_eq!(on_record[0]["task"], "lm");

    let resumed = ffn_train(
        &[
            "sweep",
            "--config",
            "tiny.toml",
            "--out",
            "stopped",
            "--threads",
            "1",
        ],
        &dir,
    );
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    assert!(stdout(&resumed).contains("8 cells (1 done)"));
    let log = std::fs::read_to_string(cell.with_extension("log")).unwrap();
    assert!(log.contains("resuming at step"), "{log}");
    assert_eq!(
        untimed(&dir.join("stopped/results.jsonl")),
        untimed(&dir.join("straight/results.jsonl"))
    );
}

#[test]
fn sweeps_refuse_what_would_make_them_unfair_or_ambiguous() {
    let dir = scratch("sweep-errors");
    write_sweep(&dir, SWEEP);
    let check = |sweep: &str, needle: &str| {
        std::fs::write(dir.join("bad.toml"), sweep).unwrap();
        let out = ffn_train(&["sweep", "--config", "bad.toml", "--dry-run"], &dir);
        assert_error(&out, needle);
    };
    check(
        &SWEEP.replace(
            "[\"FFN_ReLU\", \"FFN_SwiGLU\"]",
            "[\"FFN_GELU\", \"FFN_SwiGLU\"]",
        ),
        "the baseline FFN_ReLU is not among the variants",
    );
    check(&SWEEP.replace("[1, 2]", "[1, 1]"), "seed 1 is listed twice");
    check(
        &SWEEP.replace("[3e-3, 1e-2]", "[3e-3, -1]"),
        "learning rate -1",
    );
    check(
        &SWEEP.replace("name = \"lm\"", "name = \"../x\""),
        "task name `../x`",
    );
    check(&SWEEP.replace("FFN_SwiGLU", "FFN_SwiGLUE"), "FFN_SwiGLUE");
    // Named variants: a name that is a preset's, one unfit for a folder, an unknown field, a
    // name listed twice, a baseline that is none of them.
    let named = |table: &str| SWEEP.replace("\"FFN_SwiGLU\"]", &format!("{table}]"));
    check(
        &named(r#"{ name = "swiglu", preset = "GELU" }"#),
        "variant name `swiglu` is a preset's",
    );
    check(
        &named(r#"{ name = "a/b", preset = "GELU" }"#),
        "variant name `a/b`",
    );
    check(
        &named(r#"{ name = "wide", preset = "GELU", width = 9 }"#),
        "unknown field `width`",
    );
    check(
        &named(r#"{ name = "w", preset = "GELU" }, { name = "w", preset = "GLU", d_ff = 9 }"#),
        "variant w is listed twice",
    );
    check(
        &format!("baseline = \"w\"\n{SWEEP}"),
        "the baseline w is not",
    );
    check(&named("7"), "a variant is a preset's name or a table");
    // Extra pairs name two variants, neither the baseline, once.
    let paired = |pairs: &str| {
        format!(
            "pairs = {pairs}\n{}",
            named(r#"{ name = "w", preset = "GELU" }, "FFN_GLU""#)
        )
    };
    check(&paired(r#"[["w", "x"]]"#), "x is not among the variants");
    check(&paired(r#"[["w", "w"]]"#), "compares a variant with itself");
    check(
        &paired(r#"[["w", "relu"]]"#),
        "tested against the baseline already",
    );
    check(
        &paired(r#"[["w", "glu"], ["FFN_GLU", "w"]]"#),
        "is listed twice",
    );
    // A named variant's mixture is checked like `model.ffn.moe`.
    check(
        &named(r#"{ name = "moe", preset = "GELU", moe = { n_experts = 2, top_k = 3 } }"#),
        "top_k",
    );
    // A named variant's precision is `train.precision`'s: known names only.
    check(
        &named(r#"{ name = "lowp", preset = "GELU", precision = "fp8" }"#),
        "fp8",
    );
    check(&SWEEP.replace("seeds", "sedes"), "sedes");
    // A base config that fixes the FFN's width, or makes it sparse, breaks parameter parity.
    check(
        &SWEEP.replace(
            "set = [\"train.steps=30\"]",
            "set = [\"model.ffn.d_ff=64\"]",
        ),
        "break parameter parity",
    );
    check(
        &SWEEP.replace(
            "set = [\"train.steps=30\"]",
            "set = [\"model.ffn.moe={ n_experts = 2, top_k = 1 }\"]",
        ),
        "break parameter parity",
    );
    // A task without a known optimum.
    std::fs::write(dir.join("corpus.txt"), "hello world ".repeat(200)).unwrap();
    check(
        &SWEEP.replace(
            "set = [\"train.steps=30\"]",
            "set = [\"task={ kind = \\\"text\\\", path = \\\"corpus.txt\\\" }\", \"model={ kind = \\\"transformer\\\" }\"]",
        ),
        "has none",
    );

    // A cell folder holding a run of another config: the sweep file was edited.
    let small = SWEEP.replace("seeds = [1, 2]", "seeds = [1]").replace(
        "variants = [\"FFN_ReLU\", \"FFN_SwiGLU\"]",
        "variants = [\"FFN_ReLU\"]",
    );
    std::fs::write(dir.join("small.toml"), &small).unwrap();
    let first = ffn_train(&["sweep", "--config", "small.toml", "--out", "o"], &dir);
    assert!(first.status.success(), "{}", stderr(&first));
    std::fs::write(
        dir.join("small.toml"),
        small.replace("train.steps=30", "train.steps=40"),
    )
    .unwrap();
    let edited = ffn_train(&["sweep", "--config", "small.toml", "--out", "o"], &dir);
    assert_error(&edited, "another config");
    // Nothing of the first sweep was touched.
    assert_eq!(lines(&dir.join("o/results.jsonl")).len(), 4);
}

/// Named variants: a mixture of experts and a dense FFN of another width train beside a preset;
/// the results and the report carry each one's FFN parameters, total and active per token.
#[test]
fn named_variants_compare_mixtures_and_widths_with_their_active_parameters() {
    let dir = scratch("sweep-named");
    let sweep = r#"
variants = [
    "FFN_SwiGLU",
    { name = "MoE-4x22", preset = "SwiGLU", d_ff = 22, moe = { n_experts = 4, top_k = 2 } },
    { name = "SwiGLU-88", preset = "swiglu", d_ff = 88 },
]
seeds = [1, 2]
baseline = "swiglu"
pairs = [["MoE-4x22", "SwiGLU-88"]]

[[tasks]]
name = "lm"
config = "lm.toml"
"#;
    let (results, summary) = run_sweep(&dir, sweep);
    assert_eq!(results.len(), 6);
    // d_model 16, one layer: SwiGLU d_ff 43 (8/3 · 16), experts of 22 behind a 16 → 4 router.
    let params = |i: usize| {
        let r = &results[i];
        assert_eq!(r["status"], "completed", "{r}");
        (
            r["variant"].as_str().unwrap().to_string(),
            r["ffn_params"].as_u64().unwrap(),
            r["ffn_active_params"].as_u64().unwrap(),
        )
    };
    assert_eq!(params(0), ("FFN_SwiGLU".into(), 3 * 16 * 43, 3 * 16 * 43));
    assert_eq!(
        params(2),
        (
            "MoE-4x22".into(),
            4 * 3 * 16 * 22 + 16 * 4,
            2 * 3 * 16 * 22 + 16 * 4
        )
    );
    assert_eq!(params(4), ("SwiGLU-88".into(), 3 * 16 * 88, 3 * 16 * 88));
    // Each cell's run is the variant's: the mixture in its config and its metrics.
    let cell = dir.join("o/cells/lm/MoE-4x22/seed-1_lr-1e-2");
    let config = std::fs::read_to_string(cell.join("config.toml")).unwrap();
    assert!(config.contains("n_experts = 4"), "{config}");
    let metrics = std::fs::read_to_string(cell.join("metrics.jsonl")).unwrap();
    assert!(metrics.contains("load_max_over_mean"), "{metrics}");
    assert_eq!(summary["baseline"], "FFN_SwiGLU");
    let compared: Vec<&str> = summary["comparisons"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["variant"].as_str().unwrap())
        .collect();
    assert_eq!(compared, ["MoE-4x22", "SwiGLU-88", "MoE-4x22"]);
    // The extra pair: the mixture against the dense FFN of its total width, paired by seed.
    let extra = &summary["comparisons"][2];
    assert_eq!(extra["baseline"], "SwiGLU-88");
    let gap = |i: usize| results[i]["final_gap"].as_f64().unwrap();
    let mean = ((gap(2) - gap(4)) + (gap(3) - gap(5))) / 2.0;
    assert!((extra["mean_difference"].as_f64().unwrap() - mean).abs() < 1e-12);
    // Holm over the task's three tests.
    for c in summary["comparisons"].as_array().unwrap() {
        assert!(c["p_holm"].as_f64() >= c["p"].as_f64(), "{c}");
    }
    let report = std::fs::read_to_string(dir.join("o/report.md")).unwrap();
    let moe_row = format!(
        "| MoE-4x22 | {} ({}) | {} |",
        results[2]["params"],
        4 * 3 * 16 * 22 + 16 * 4,
        2 * 3 * 16 * 22 + 16 * 4
    );
    assert!(report.contains(&moe_row), "{report}");
    assert!(report.contains("| MoE-4x22 | SwiGLU-88 | 2 |"), "{report}");
}

/// A variant may set the FFNs' precision: the bf16 twin of a preset is paired, seed by seed, with
/// its f32 self, which is how the mixed-precision recipe's cost in loss is measured (with its
/// interval, in the summary).
#[test]
fn a_variant_sets_its_precision_and_is_paired_with_its_f32_self() {
    let dir = scratch("sweep-precision");
    let sweep = r#"
variants = ["FFN_SwiGLU", { name = "SwiGLU-bf16", preset = "SwiGLU", precision = "bf16" }]
seeds = [1, 2]
baseline = "FFN_SwiGLU"

[[tasks]]
name = "lm"
config = "lm.toml"
"#;
    let (results, summary) = run_sweep(&dir, sweep);
    assert_eq!(results.len(), 4);
    for (variant, precision) in [("FFN_SwiGLU", "F32"), ("SwiGLU-bf16", "Bf16")] {
        let cell = dir.join(format!("o/cells/lm/{variant}/seed-1_lr-1e-2"));
        let ffn = std::fs::read_to_string(cell.join("ffn.toml")).unwrap();
        let ffn = ffn_model::FeedForwardConfig::from_toml(&ffn).unwrap();
        assert_eq!(format!("{:?}", ffn.precision), precision, "{variant}");
    }
    let comparison = &summary["comparisons"][0];
    assert_eq!(comparison["variant"], "SwiGLU-bf16");
    let difference = comparison["mean_difference"].as_f64().unwrap();
    assert!(difference.abs() < 0.01, "bf16 − f32 gap: {difference}");
}
