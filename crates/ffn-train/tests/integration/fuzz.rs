//! Seeded property tests: TOML configs with `--set` overrides, and checkpoint folders, mutated
//! at random. Every case must end in a typed error or a success, never a panic, and a config
//! that validates must have a finite memory estimate.
//!
//! `FFN_FUZZ_CASES=N` sets the cases per property (defaults below), `FFN_FUZZ_SECONDS` the time
//! box of each (default 60).

use std::fs;

use crate::common::{TINY_LM, device, property, scratch, serial};
use ffn_train::{DEFAULT_CONFIG, TrainConfig, Trainer};

const KEYS: [&str; 30] = [
    "seed",
    "task.kind",
    "task.vocab_size",
    "task.order",
    "task.support",
    "task.smoothing",
    "task.seq_len",
    "task.noise",
    "task.frequency",
    "model.kind",
    "model.d_model",
    "model.n_layers",
    "model.n_heads",
    "model.attention_dropout",
    "model.window",
    "model.ffn.preset",
    "model.ffn.d_ff",
    "model.ffn.multiple_of",
    "model.ffn.activation",
    "model.ffn.gated",
    "model.ffn.dropout",
    "model.ffn.initializer",
    "model.ffn.memory",
    "train.steps",
    "train.batch_size",
    "train.lr",
    "train.min_lr",
    "train.eval_batches",
    "train.shards",
    "train.grad_clip",
];

const VALUES: [&str; 32] = [
    "0",
    "1",
    "-1",
    "2",
    "7",
    "64",
    "4294967296",
    "18446744073709551615",
    "9223372036854775807",
    "4611686018427387904",
    "1e300",
    "nan",
    "inf",
    "-inf",
    "0.5",
    "1.0",
    "true",
    "\"\"",
    "\"SwiGLU\"",
    "\"gelu\"",
    "\"transformer\"",
    "\"window\"",
    "\"ffn\"",
    "\"teacher\"",
    "\"sine\"",
    "\"recompute\"",
    "[]",
    "{}",
    "{ Uniform = { min = 1.0, max = 0.0 } }",
    "{ Normal = { mean = 0.0, std = -1.0 } }",
    "{ KaimingNormal = { gain = nan, fan_out_only = true } }",
    "\"\\u0000\\u001b\"",
];

#[test]
fn configs_and_overrides_never_panic() {
    let bases = [
        DEFAULT_CONFIG,
        TINY_LM,
        "[task]\nkind = \"sine\"\n[model]\nkind = \"ffn\"\nd_model = 4\n",
    ];
    let mut valid = 0;
    property("config mutations", 0xC0F1, 6000, |rng| {
        let base = bases[rng.below(bases.len())];
        let mut overrides = Vec::new();
        for _ in 0..1 + rng.below(4) {
            let assignment = match rng.below(8) {
                // A malformed assignment.
                0 => rng
                    .pick(&[
                        "",
                        "=",
                        "a",
                        "task.=1",
                        ".x=1",
                        "a..b=1",
                        "train=1",
                        "x=[",
                        "task.order=1=2",
                    ])
                    .to_string(),
                _ => format!("{}={}", rng.pick(&KEYS), rng.pick(&VALUES)),
            };
            overrides.push(assignment);
        }
        // A mutated base text too, sometimes.
        let text = if rng.below(4) == 0 {
            let mut bytes = base.as_bytes().to_vec();
            let i = rng.below(bytes.len());
            bytes[i] = rng.pick(&["=", "[", "\"", "0", "\n", "x", "#"]).as_bytes()[0];
            String::from_utf8_lossy(&bytes).into_owned()
        } else {
            base.to_string()
        };
        if let Ok(config) = TrainConfig::from_toml(&text, &overrides) {
            valid += 1;
            assert!(config.memory_estimate() > 0);
            let _ = config.check_memory(config.train.eval_batches);
            let _ = config.ffn();
            // What a run writes is read back the same.
            assert_eq!(
                TrainConfig::from_toml(&config.to_toml(), &[]).unwrap(),
                config
            );
        }
    });
    assert!(valid > 0, "no mutated config validated");
}

#[test]
fn mutated_checkpoint_folders_never_panic() {
    let _serial = serial();
    let dir = scratch("fuzz-checkpoints");
    let config = TrainConfig::from_toml(TINY_LM, &["train.steps=20".into()]).unwrap();
    let device = device();
    Trainer::start(config, &dir.join("r"), &device)
        .unwrap()
        .run(&ffn_train::metrics::Progress::Silent)
        .unwrap();
    let run = dir.join("r");
    let checkpoints = run.join("checkpoints");
    let pristine: Vec<(std::path::PathBuf, Vec<u8>)> = crate::common::snapshot(&run);
    let files = ["model.bpk", "optim.bpk", "state.json", "checksums.json"];
    let mut loaded = 0;
    property("checkpoint mutations", 0xC4EC, 400, |rng| {
        // Back to the pristine run, then damage one or two things.
        let _ = fs::remove_dir_all(&run);
        for (path, bytes) in &pristine {
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, bytes).unwrap();
        }
        for _ in 0..1 + rng.below(2) {
            let step = rng.pick(&["step-000010", "step-000020"]);
            let path = checkpoints.join(step).join(rng.pick(&files));
            match rng.below(6) {
                0 => {
                    let _ = fs::remove_file(&path);
                }
                1 => {
                    let bytes = fs::read(&path).unwrap_or_default();
                    fs::write(&path, &bytes[..rng.below(bytes.len() + 1)]).unwrap();
                }
                2 => {
                    let mut bytes = fs::read(&path).unwrap_or_default();
                    if !bytes.is_empty() {
                        let i = rng.below(bytes.len());
                        bytes[i] ^= 1 << rng.below(8);
                    }
                    fs::write(&path, bytes).unwrap();
                }
                3 => fs::write(
                    &path,
                    rng.pick(&["", "{", "null", "[1,2]", "{\"step\": -1}"]),
                )
                .unwrap(),
                4 => {
                    let _ = fs::remove_dir_all(checkpoints.join(step));
                    fs::create_dir_all(checkpoints.join(step)).unwrap();
                }
                _ => {
                    let target =
                        run.join(rng.pick(&["config.toml", "metrics.jsonl", "vocab.json"]));
                    let mut bytes = fs::read(&target).unwrap_or_default();
                    if !bytes.is_empty() {
                        let i = rng.below(bytes.len());
                        bytes[i] ^= 1 << rng.below(8);
                    }
                    fs::write(&target, bytes).unwrap();
                }
            }
        }
        if ffn_train::run::load_latest(&run, &device).is_ok() {
            loaded += 1;
        }
        let _ = Trainer::resume(&run, &device);
    });
    assert!(loaded > 0, "no mutation left a loadable checkpoint");
}
