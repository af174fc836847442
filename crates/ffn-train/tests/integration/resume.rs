//! Resuming a run continues it exactly: the rest of its loss curve equals the uninterrupted
//! run's, value for value, on CPU.

use crate::common::{TINY_LM, TINY_TEACHER, copy_tree, device, losses, scratch, serial};
use ffn_train::metrics::Progress;
use ffn_train::{TrainConfig, Trainer};

#[test]
fn a_resumed_run_equals_the_uninterrupted_run() {
    resumes_exactly(TINY_LM, "resume-lm");
}

/// The teacher is rebuilt by every process that trains (start or resume): it must not depend on
/// where the run starts.
#[test]
fn a_resumed_teacher_student_run_equals_the_uninterrupted_run() {
    resumes_exactly(TINY_TEACHER, "resume-teacher");
}

/// A DeepSeek-style mixture of experts in place of the FFN: the selection bias, moved after
/// every step by the expert loads, is part of the checkpoint, so a resumed run routes as the
/// uninterrupted one. Capacity drops pairs, and every training record logs the load.
#[test]
fn a_resumed_mixture_of_experts_run_equals_the_uninterrupted_run() {
    let moe = "model.ffn.moe={ n_experts = 4, top_k = 2, scoring = \"sigmoid\", n_group = 2, \
               topk_group = 1, selection_bias = true, bias_update_rate = 0.01, \
               n_shared_experts = 1, capacity_factor = 0.75 }";
    let overrides = ["model.ffn.dropout=0", "model.ffn.d_ff=12", moe];
    resumes_exactly_with(TINY_LM, "resume-moe", &overrides, &|full| {
        let records = ffn_train::metrics::read_records(&full.join("metrics.jsonl")).unwrap();
        let train: Vec<_> = records.iter().filter(|r| r.kind == "train").collect();
        assert!(
            train.iter().all(|r| r.moe.is_some()),
            "every training record logs the load"
        );
        assert!(train.iter().any(|r| r.moe.unwrap().dropped_fraction > 0.0));
        assert!(
            records
                .iter()
                .filter(|r| r.kind == "valid")
                .all(|r| r.moe.is_none())
        );
    });

    // Configs the layer cannot take are refused, naming the table.
    for bad in [
        "model.ffn.moe={ n_experts = 4, top_k = 5 }",
        "model.ffn.moe={ n_experts = 4, top_k = 2, expert = {} }",
        "model.ffn.moe={ n_experts = 4, top_k = 2, capacity_factor = -1.0 }",
        "model.ffn.moe=3",
    ] {
        let overrides = ["model.ffn.dropout=0".to_string(), bad.to_string()];
        let error = TrainConfig::from_toml(TINY_LM, &overrides).unwrap_err();
        assert!(
            error.to_string().contains("model.ffn.moe"),
            "{bad}: {error}"
        );
    }
    let error = TrainConfig::from_toml(TINY_LM, &[moe.to_string()]).unwrap_err();
    assert!(error.to_string().contains("expert.dropout"), "{error}");
}

/// Runs `config` for 60 steps, then again from copies cut back to steps 20, 30 and 50 with
/// `Trainer::resume`: every loss record is the same.
fn resumes_exactly(config: &str, name: &str) {
    resumes_exactly_with(config, name, &[], &|_| {});
}

/// [`resumes_exactly`] with `--set`-style overrides, and `check` run on the uninterrupted
/// run's folder.
fn resumes_exactly_with(
    config: &str,
    name: &str,
    overrides: &[&str],
    check: &dyn Fn(&std::path::Path),
) {
    let _serial = serial();
    let dir = scratch(name);
    let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    let config = TrainConfig::from_toml(config, &overrides).unwrap();
    let full = dir.join("full");
    let summary = Trainer::start(config, &full, &device())
        .unwrap()
        .run(&Progress::Silent)
        .unwrap();
    assert_eq!(summary.steps, 60);
    let expected = losses(&full);
    assert_eq!(expected.len(), 12 + 6, "12 train and 6 valid records");

    // The same run, interrupted after step 20 (or 30, or 50): its later checkpoints and
    // metrics never happened, and a half-written checkpoint folder was left behind.
    for cut in [20, 30, 50] {
        let partial = dir.join(format!("cut-{cut}"));
        copy_tree(&full, &partial);
        for checkpoint in ffn_train::checkpoint::list(&partial).unwrap() {
            let step: usize = checkpoint.file_name().unwrap().to_str().unwrap()[5..]
                .parse()
                .unwrap();
            if step > cut {
                std::fs::remove_dir_all(&checkpoint).unwrap();
            }
        }
        std::fs::create_dir(partial.join(format!("checkpoints/.tmp-step-{:06}", cut + 10)))
            .unwrap();
        std::fs::remove_file(partial.join("summary.json")).unwrap();

        let trainer = Trainer::resume(&partial, &device()).unwrap();
        assert_eq!(trainer.step(), cut);
        trainer.run(&Progress::Silent).unwrap();
        assert_eq!(losses(&partial), expected, "resumed at step {cut}");
    }
    check(&full);
}

/// 20 steps of the tiny language model with `overrides`, in `folder`: its loss records.
fn train_20_steps(folder: &std::path::Path, overrides: &[&str]) -> Vec<(usize, String, f64)> {
    let mut overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    overrides.push("train.steps=20".into());
    let config = TrainConfig::from_toml(TINY_LM, &overrides).unwrap();
    Trainer::start(config, folder, &device())
        .unwrap()
        .run(&Progress::Silent)
        .unwrap();
    losses(folder)
}

#[test]
fn the_same_seed_gives_the_same_run_and_another_seed_another() {
    let _serial = serial();
    let dir = scratch("determinism");
    let run = |name: &str, seed: u64| train_20_steps(&dir.join(name), &[&format!("seed={seed}")]);
    let a = run("a", 7);
    assert_eq!(a, run("b", 7));
    assert_ne!(a, run("c", 8));
}

/// With dropout, a batch cut into shards draws its masks reproducibly: with the FFN's dropout
/// only, each shard from its own seeded stream (the shards at once); with the attention's too,
/// from the device's stream in shard order (the forward passes one after another). The same
/// seed gives the same run, whatever the threads' timing.
#[test]
fn sharded_dropout_runs_are_reproducible() {
    let _serial = serial();
    let dir = scratch("sharded-dropout");
    for attention in ["0.0", "0.1"] {
        let run = |name: &str, shards: usize| {
            train_20_steps(
                &dir.join(format!("{name}-{attention}")),
                &[
                    &format!("model.attention_dropout={attention}"),
                    &format!("train.shards={shards}"),
                ],
            )
        };
        let a = run("a", 3);
        for name in ["b", "c", "d"] {
            assert_eq!(run(name, 3), a, "attention dropout {attention}");
        }
        // Another shard count draws other masks: another run.
        assert_ne!(run("two", 2), a, "attention dropout {attention}");
    }
}

#[test]
fn fusing_and_gradient_checkpointing_change_speed_and_memory_not_the_run() {
    let _serial = serial();
    let dir = scratch("fused-checkpointing");
    let run = |name: &str, overrides: &[&str]| train_20_steps(&dir.join(name), overrides);
    let plain = run("plain", &[]);
    let checkpointed = run("checkpointed", &["train.gradient_checkpointing=true"]);
    assert_eq!(checkpointed, plain, "recomputation gives the same numbers");
    // Fused: the same function and the same initial weights, but another summation order in
    // the first product; the curves agree to rounding.
    let fused = run("fused", &["model.ffn.fused_gate_up=true"]);
    assert_eq!(fused.len(), plain.len());
    for (f, p) in fused.iter().zip(&plain) {
        assert_eq!((f.0, &f.1), (p.0, &p.1));
        assert!((f.2 - p.2).abs() < 1e-3, "{f:?} vs {p:?}");
    }
}
