//! Resuming a run continues it exactly: the rest of its loss curve equals the uninterrupted
//! run's, value for value, on CPU.

mod common;

use common::{TINY_LM, copy_tree, device, losses, scratch, serial};
use ffn_train::metrics::Progress;
use ffn_train::{TrainConfig, Trainer};

#[test]
fn a_resumed_run_equals_the_uninterrupted_run() {
    let _serial = serial();
    let dir = scratch("resume-in-process");
    let config = TrainConfig::from_toml(TINY_LM, &[]).unwrap();
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
}

#[test]
fn the_same_seed_gives_the_same_run_and_another_seed_another() {
    let _serial = serial();
    let dir = scratch("determinism");
    let run = |name: &str, seed: u64| {
        let config =
            TrainConfig::from_toml(TINY_LM, &[format!("seed={seed}"), "train.steps=20".into()])
                .unwrap();
        let folder = dir.join(name);
        Trainer::start(config, &folder, &device())
            .unwrap()
            .run(&Progress::Silent)
            .unwrap();
        losses(&folder)
    };
    let a = run("a", 7);
    assert_eq!(a, run("b", 7));
    assert_ne!(a, run("c", 8));
}
