//! The tasks reach their known optimum: teacher-student regression to within 1.2 σ², every
//! variant learns, the FFN-only language model nears the Markov entropy.

use crate::common::{device, scratch, serial};
use ffn_model::Variant;
use ffn_train::metrics::{Progress, RunSummary};
use ffn_train::{TrainConfig, Trainer};

fn train(name: &str, toml: &str, sets: &[&str]) -> RunSummary {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let config = TrainConfig::from_toml(toml, &sets).unwrap();
    let dir = scratch(name);
    Trainer::start(config, &dir.join("run"), &device())
        .unwrap()
        .run(&Progress::Silent)
        .unwrap()
}

const TEACHER: &str = r#"
[task]
kind = "teacher"
noise = 0.2
[model]
kind = "ffn"
d_model = 8
ffn = { preset = "SwiGLU" }
[train]
steps = 2000
batch_size = 512
lr = 2e-2
min_lr = 1e-4
warmup_steps = 20
weight_decay = 0.0
eval_every = 100
eval_batches = 16
checkpoint_every = 2000
"#;

#[test]
fn a_student_of_the_teachers_variant_reaches_the_noise_floor() {
    let _serial = serial();
    let s = train("teacher", TEACHER, &[]);
    let sigma2 = 0.04;
    assert!((s.optimal_loss.unwrap() - sigma2).abs() < 1e-12);
    let valid = s.final_valid_loss.unwrap();
    println!(
        "teacher-student SwiGLU: valid MSE {valid:.5} = {:.3} σ²",
        valid / sigma2
    );
    assert!(
        valid <= 1.2 * sigma2,
        "valid MSE {valid} > 1.2 σ² = {}",
        1.2 * sigma2
    );
    // The estimate of σ² itself: it cannot beat the noise by more than sampling error.
    assert!(
        valid >= 0.9 * sigma2,
        "valid MSE {valid} below the noise floor"
    );
}

#[test]
fn every_variant_learns_its_teacher() {
    let _serial = serial();
    for variant in Variant::ALL {
        let preset = format!("model.ffn.preset={}", variant.name());
        let s = train(
            &format!("variant-{variant}"),
            TEACHER,
            &[
                &preset,
                "train.steps=600",
                "train.eval_every=600",
                "train.checkpoint_every=600",
            ],
        );
        let valid = s.final_valid_loss.unwrap();
        println!(
            "{:>12}: valid MSE {valid:.5} = {:.2} σ²",
            variant.name(),
            valid / 0.04
        );
        assert!(valid < 1.5 * 0.04, "{variant}: valid MSE {valid}");
    }
}

#[test]
fn a_smooth_map_is_learned() {
    let _serial = serial();
    let toml = TEACHER.replace("kind = \"teacher\"", "kind = \"sine\"");
    let s = train(
        "sine",
        &toml,
        &["model.ffn.preset=FFN_GELU", "train.steps=1000"],
    );
    let valid = s.final_valid_loss.unwrap();
    println!("sine map: valid MSE {valid:.4} (optimum 0.04)");
    // The map's own variance is about 0.4: nearly all of it is explained.
    assert!(valid < 0.08, "{valid}");
    assert!(valid > 0.9 * 0.04, "{valid}");
}

#[test]
fn the_ffn_only_language_model_nears_the_entropy_rate() {
    let _serial = serial();
    let toml = r#"
[task]
kind = "markov"
vocab_size = 8
order = 2
support = 2
seq_len = 16
[model]
kind = "window"
window = 3
d_embed = 8
d_model = 32
ffn = { preset = "GEGLU" }
[train]
steps = 400
batch_size = 32
lr = 1e-2
warmup_steps = 20
eval_every = 100
checkpoint_every = 400
"#;
    let s = train("window", toml, &[]);
    let gap = s.final_gap.unwrap();
    println!(
        "window LM: valid {:.4}, optimum {:.4}, gap {gap:+.4}",
        s.final_valid_loss.unwrap(),
        s.optimal_loss.unwrap()
    );
    assert!(gap < 0.1, "gap {gap}");
    assert!(
        gap > -0.05,
        "below the optimum by more than sampling error: {gap}"
    );
}
