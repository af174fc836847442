//! Hostile input, as a new user (or a fuzzer) would give it, against the binary: every case
//! ends in one `error:` line and status 1 without touching the disk, and run folders survive
//! concurrent processes, corrupt checkpoints, signals and edited files.

use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{Rng, assert_error, ffn_train, scratch, stderr, stdout, tiny};

/// Waits until `done()` holds, failing after a minute.
fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "timed out: {what}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn hostile_configs_fail_cleanly_and_write_no_run_folder() {
    let dir = scratch("hostile-configs");
    let config = tiny(&dir);
    let config = config.to_str().unwrap();
    fs::write(
        dir.join("sine.toml"),
        "[task]\nkind = \"sine\"\n[model]\nkind = \"ffn\"\nd_model = 4\n",
    )
    .unwrap();
    let cases: &[(&str, &str)] = &[
        ("task.order=4294967296", "task.order"),
        ("task.order=2147483648", "task.order"),
        ("task.order=40", "contexts is too many"),
        (
            "model.ffn.initializer={ Uniform = { min = 1.0, max = 0.0 } }",
            "min < max",
        ),
        (
            "model.ffn.initializer={ Uniform = { min = nan, max = 1.0 } }",
            "finite",
        ),
        (
            "model.ffn.initializer={ KaimingUniform = { gain = -1.0, fan_out_only = false } }",
            "gain",
        ),
        (
            "model.ffn.initializer={ XavierNormal = { gain = 0.0 } }",
            "gain",
        ),
        (
            "model.ffn.initializer={ Normal = { mean = 0.0, std = nan } }",
            "std",
        ),
        (
            "model.ffn.initializer={ Normal = { mean = 0.0, std = -1.0 } }",
            "std",
        ),
        ("model.ffn.d_ff=1000000000000", "too large"),
        ("model.ffn.multiple_of=4611686018427387904", "too large"),
        ("train.batch_size=100000000000", "too large"),
        ("train.batch_size=10000000", "of memory"),
        ("train.eval_batches=100000000", "too large"),
        ("task.seq_len=10000000", "of memory"),
        ("model.n_layers=10000000", "of memory"),
        ("model.d_model=4611686018427387904", "too large"),
        ("model.d_model=16777216", "too large"),
        ("train.shards=100000000000", "too large"),
    ];
    for (set, needle) in cases {
        let out = ffn_train(
            &["train", "--config", config, "--set", set, "--run", "r"],
            &dir,
        );
        assert_error(&out, needle);
        assert!(!dir.join("r").exists(), "--set {set} left a run folder");
    }
    for set in [
        "task.frequency=nan",
        "task.frequency=inf",
        "task.frequency=-1",
    ] {
        let out = ffn_train(
            &["train", "--config", "sine.toml", "--set", set, "--run", "r"],
            &dir,
        );
        assert_error(&out, "task.frequency");
        assert!(!dir.join("r").exists());
    }
    // No --run: nothing under runs/ either.
    let out = ffn_train(
        &[
            "train",
            "--config",
            config,
            "--set",
            "task.order=4294967296",
        ],
        &dir,
    );
    assert_error(&out, "task.order");
    assert!(!dir.join("runs").exists());

    let out = ffn_train(&["eval", "nowhere", "--batches", "100000000000"], &dir);
    assert_error(&out, "nowhere");
}

#[test]
fn devices_fifos_and_folders_are_refused_as_files() {
    let dir = scratch("hostile-files");
    let fifo = dir.join("fifo");
    let made = Command::new("mkfifo").arg(&fifo).status();
    let fifo = fifo.to_str().unwrap();
    let mut cases: Vec<Vec<&str>> = vec![
        vec!["train", "--text", "/dev/zero", "--run", "r"],
        vec!["train", "--config", "/dev/zero", "--run", "r"],
        vec!["train", "--text", ".", "--run", "r"],
        vec!["inspect", "/dev/zero"],
    ];
    if made.is_ok_and(|s| s.success()) {
        cases.push(vec!["train", "--text", fifo, "--run", "r"]);
        cases.push(vec!["train", "--config", fifo, "--run", "r"]);
        cases.push(vec!["inspect", fifo]);
        // A model folder whose config.json is a FIFO.
        fs::create_dir_all(dir.join("model")).unwrap();
        Command::new("mkfifo")
            .arg(dir.join("model/config.json"))
            .status()
            .unwrap();
        cases.push(vec!["inspect", "model"]);
    }
    for args in cases {
        let start = Instant::now();
        let out = ffn_train(&args, &dir);
        assert_error(&out, "not a regular file");
        assert!(start.elapsed() < Duration::from_secs(20), "{args:?} hung");
        assert!(!dir.join("r").exists());
    }
}

#[test]
fn long_and_control_character_values_are_escaped_and_clipped_in_errors() {
    let dir = scratch("hostile-output");
    let long = "x".repeat(10 << 20);
    let config = format!(
        "[task]\nkind = \"markov\"\n[model]\nkind = \"transformer\"\nffn = {{ activation = \"{long}\" }}\n"
    );
    fs::write(dir.join("long.toml"), config).unwrap();
    let out = ffn_train(&["train", "--config", "long.toml", "--run", "r"], &dir);
    assert_error(&out, "more characters");
    assert!(out.stderr.len() < 4000, "{} bytes", out.stderr.len());

    let config = "[task]\nkind = \"markov\"\n[model]\nkind = \"transformer\"\nffn = { activation = \"\\u001b[31mred\\u0007\" }\n";
    fs::write(dir.join("esc.toml"), config).unwrap();
    let out = ffn_train(&["train", "--config", "esc.toml", "--run", "r"], &dir);
    assert_error(&out, "red");
    assert!(!out.stderr.contains(&0x1b) && !out.stderr.contains(&0x07));

    // Key names with control characters, listed by inspect.
    let header = r#"{"a\u001b[2Jb":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header.as_bytes());
    file.extend_from_slice(&1f32.to_le_bytes());
    fs::write(dir.join("esc.safetensors"), file).unwrap();
    let out = ffn_train(&["inspect", "esc.safetensors"], &dir);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!out.stdout.contains(&0x1b), "{}", stdout(&out));
    assert!(stdout(&out).contains("\\u{1b}[2Jb"), "{}", stdout(&out));
}

#[test]
fn sample_is_bounded() {
    let dir = scratch("hostile-sample");
    let out = ffn_train(&["sample", "nowhere", "--tokens", "100000000000"], &dir);
    assert_error(&out, "--tokens must be at most");
}

/// A tiny run of `steps` steps, checkpointed every 10.
fn train(dir: &Path, run: &str, steps: usize) -> std::process::Output {
    let config = tiny(dir);
    let steps = format!("train.steps={steps}");
    ffn_train(
        &[
            "train",
            "--config",
            config.to_str().unwrap(),
            "--set",
            &steps,
            "--run",
            run,
        ],
        dir,
    )
}

#[test]
fn a_locked_run_refuses_a_second_process_and_sigterm_stops_cleanly() {
    let dir = scratch("hostile-lock");
    let config = tiny(&dir);
    let first = Command::new(env!("CARGO_BIN_EXE_ffn-train"))
        .args([
            "train",
            "--config",
            config.to_str().unwrap(),
            "--set",
            "train.steps=1000000",
            "--run",
            "r",
        ])
        .current_dir(&dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("the first checkpoint", || {
        dir.join("r/checkpoints/step-000010").exists()
    });
    let out = train(&dir, "r", 60);
    assert_error(&out, "in use by another ffn-train process");
    let out = ffn_train(&["resume", "r"], &dir);
    assert_error(&out, "in use by another ffn-train process");

    // SIGTERM: the step ends, a checkpoint is written, status 130 with the resume command.
    let pid = first.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let out = first.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("interrupted at step"), "{err}");
    assert!(err.contains("ffn-train resume r"), "{err}");
    let step: usize = err
        .split("interrupted at step ")
        .nth(1)
        .and_then(|rest| rest.split(';').next())
        .and_then(|n| n.parse().ok())
        .expect("the step in the message");
    let checkpoint = dir.join(format!("r/checkpoints/step-{step:06}"));
    assert!(checkpoint.join("checksums.json").exists(), "{err}");
    // The lock is free again: evaluation of the interrupted run works.
    let out = ffn_train(&["eval", "r", "--batches", "1"], &dir);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains(&format!("step {step},")),
        "{}",
        stdout(&out)
    );
}

#[test]
fn corrupt_and_incomplete_checkpoints_are_passed_over_for_the_newest_good_one() {
    let dir = scratch("hostile-corrupt");
    let out = train(&dir, "r", 60);
    assert!(out.status.success(), "{}", stderr(&out));
    let newest = dir.join("r/checkpoints/step-000060");
    let original = fs::read(newest.join("model.bpk")).unwrap();
    let mut corrupt = original.clone();
    let middle = corrupt.len() / 2;
    for b in &mut corrupt[middle..middle + 64] {
        *b ^= 0x5a;
    }
    fs::write(newest.join("model.bpk"), &corrupt).unwrap();
    // A stray, empty checkpoint folder newer than both.
    fs::create_dir_all(dir.join("r/checkpoints/step-000070")).unwrap();

    let out = ffn_train(&["eval", "r", "--batches", "1"], &dir);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("step 50,"), "{}", stdout(&out));
    let err = stderr(&out);
    assert!(
        err.contains("step-000070") && err.contains("incomplete"),
        "{err}"
    );
    assert!(
        err.contains("step-000060") && err.contains("corrupt"),
        "{err}"
    );

    // Resuming sets both aside, trains steps 51–60 again, and gets the same weights.
    let out = ffn_train(&["resume", "r"], &dir);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("kept as"), "{}", stderr(&out));
    assert!(dir.join("r/checkpoints/corrupt-step-000060").exists());
    assert_eq!(fs::read(newest.join("model.bpk")).unwrap(), original);

    // With no intact checkpoint left, a clear error.
    for entry in fs::read_dir(dir.join("r/checkpoints")).unwrap() {
        let path = entry.unwrap().path();
        if path
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("step-")
        {
            fs::write(path.join("state.json"), "{").unwrap();
        }
    }
    let out = ffn_train(&["eval", "r"], &dir);
    assert_error(&out, "no checkpoint of this run is intact");
}

#[test]
fn a_run_that_failed_before_its_first_checkpoint_restarts_with_train() {
    let dir = scratch("hostile-dead-end");
    let config = tiny(&dir);
    let config = config.to_str().unwrap();
    // A learning rate that diverges at once: the run stops before its first checkpoint.
    let out = ffn_train(
        &[
            "train",
            "--config",
            config,
            "--set",
            "train.lr=1e30",
            "--set",
            "train.min_lr=0",
            "--set",
            "train.warmup_steps=0",
            "--run",
            "r",
        ],
        &dir,
    );
    assert_eq!(out.status.code(), Some(3), "{}", stdout(&out));
    assert!(dir.join("r/config.toml").exists());
    let out = ffn_train(&["resume", "r"], &dir);
    assert_error(&out, "ffn-train train --run r");
    // The documented way: train into the same folder again.
    let out = ffn_train(&["train", "--config", config, "--run", "r"], &dir);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(dir.join("r/summary.json").exists());
    // A folder with a user's file in it is never taken over.
    fs::create_dir_all(dir.join("mine")).unwrap();
    fs::write(dir.join("mine/notes.txt"), "keep me").unwrap();
    let out = ffn_train(&["train", "--config", config, "--run", "mine"], &dir);
    assert_error(&out, "already exists");
    assert_eq!(
        fs::read_to_string(dir.join("mine/notes.txt")).unwrap(),
        "keep me"
    );
}

#[test]
fn resume_keeps_metrics_lines_verbatim_and_refuses_a_damaged_one() {
    let dir = scratch("hostile-metrics");
    let out = train(&dir, "r", 60);
    assert!(out.status.success(), "{}", stderr(&out));
    let metrics = dir.join("r/metrics.jsonl");
    let before = fs::read_to_string(&metrics).unwrap();
    // Back to step 30: what resume keeps is the original text, byte for byte.
    for step in [40, 50, 60] {
        fs::remove_dir_all(dir.join(format!("r/checkpoints/step-{step:06}"))).unwrap();
    }
    let out = ffn_train(&["resume", "r"], &dir);
    assert!(out.status.success(), "{}", stderr(&out));
    let after = fs::read_to_string(&metrics).unwrap();
    let kept = |text: &str| -> Vec<String> {
        text.lines()
            .filter(|l| {
                let step: usize = l
                    .split("\"step\":")
                    .nth(1)
                    .unwrap()
                    .split(',')
                    .next()
                    .unwrap()
                    .parse()
                    .unwrap();
                step <= 30
            })
            .map(String::from)
            .collect()
    };
    assert_eq!(kept(&after), kept(&before));
    assert!(after.starts_with(&kept(&before).join("\n")));

    // A damaged line in the middle is an error, not silently dropped.
    let mut lines: Vec<&str> = after.lines().collect();
    lines[3] = "{\"step\": 1, \"kind\": ";
    fs::write(&metrics, lines.join("\n") + "\n").unwrap();
    fs::remove_dir_all(dir.join("r/checkpoints/step-000060")).unwrap();
    let out = ffn_train(&["resume", "r"], &dir);
    assert_error(&out, "line 4 is not a metrics record");
}

#[test]
fn a_changed_corpus_is_refused_and_sample_uses_the_runs_vocabulary() {
    let dir = scratch("hostile-corpus");
    let text = "the quick brown fox jumps over the lazy dog. ".repeat(40);
    fs::write(dir.join("corpus.txt"), &text).unwrap();
    let config = "seed = 1\n[task]\nkind = \"markov\"\n[model]\nkind = \"transformer\"\nd_model = 16\nn_layers = 1\nn_heads = 2\n[train]\nsteps = 10\nbatch_size = 4\neval_every = 10\neval_batches = 1\ncheckpoint_every = 10\n";
    fs::write(dir.join("t.toml"), config).unwrap();
    let out = ffn_train(
        &[
            "train",
            "--config",
            "t.toml",
            "--text",
            "corpus.txt",
            "--level",
            "char",
            "--run",
            "r",
        ],
        &dir,
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(dir.join("r/corpus.json").exists());
    let out = ffn_train(&["sample", "r", "--tokens", "5", "--prompt", "the"], &dir);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).starts_with("the"));

    fs::write(dir.join("corpus.txt"), text.replace("fox", "cat")).unwrap();
    for args in [vec!["resume", "r"], vec!["eval", "r"]] {
        let out = ffn_train(&args, &dir);
        assert_error(&out, "changed since the run started");
    }
    // Sampling needs the run's vocab.json only, not the corpus.
    fs::remove_file(dir.join("corpus.txt")).unwrap();
    let out = ffn_train(&["sample", "r", "--tokens", "5", "--prompt", "the"], &dir);
    assert!(out.status.success(), "{}", stderr(&out));
    fs::write(dir.join("r/vocab.json"), "{").unwrap();
    let out = ffn_train(&["sample", "r", "--tokens", "5"], &dir);
    assert_error(&out, "vocab.json");
}

#[test]
fn twenty_sigkills_at_random_moments_change_nothing() {
    let dir = scratch("hostile-kill-soak");
    let config = tiny(&dir);
    let config = config.to_str().unwrap();
    // Checkpoints every 3 steps, so that kills land in checkpoint writes too.
    let sets = [
        "--set",
        "train.steps=1200",
        "--set",
        "train.checkpoint_every=3",
        "--set",
        "train.keep_checkpoints=2",
    ];
    let mut args = vec!["train", "--config", config, "--run", "full"];
    args.extend_from_slice(&sets);
    let out = ffn_train(&args, &dir);
    assert!(out.status.success(), "{}", stderr(&out));

    // Seeded kill delays.
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut kills = 0;
    let mut starts = 0;
    while kills < 20 {
        starts += 1;
        assert!(starts < 200, "the run finished before 20 kills ({kills})");
        let has_checkpoint = dir.join("killed/checkpoints").exists()
            && fs::read_dir(dir.join("killed/checkpoints"))
                .unwrap()
                .any(|e| {
                    e.unwrap()
                        .file_name()
                        .to_string_lossy()
                        .starts_with("step-")
                });
        let mut args: Vec<&str> = if has_checkpoint {
            vec!["resume", "killed"]
        } else {
            // Killed before its first checkpoint: the documented restart.
            vec!["train", "--config", config, "--run", "killed"]
        };
        if !has_checkpoint {
            args.extend_from_slice(&sets);
        }
        let mut child = Command::new(env!("CARGO_BIN_EXE_ffn-train"))
            .args(&args)
            .current_dir(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(20 + rng.below(300) as u64));
        if child.try_wait().unwrap().is_none() {
            child.kill().unwrap(); // SIGKILL
            kills += 1;
        }
        child.wait().unwrap();
        if dir.join("killed/summary.json").exists() {
            break;
        }
    }
    if !dir.join("killed/summary.json").exists() {
        let out = ffn_train(&["resume", "killed"], &dir);
        assert!(out.status.success(), "{}", stderr(&out));
    }
    assert!(
        kills >= 20,
        "only {kills} kills landed before the run ended"
    );

    // The final checkpoint and the metrics, byte for byte.
    let last = "checkpoints/step-001200";
    for file in ["model.bpk", "optim.bpk", "state.json", "checksums.json"] {
        let read = |run: &str| fs::read(dir.join(run).join(last).join(file)).unwrap();
        assert!(
            read("full") == read("killed"),
            "{file} differs after {kills} kills"
        );
    }
    for file in ["metrics.jsonl", "metrics.csv"] {
        let read = |run: &str| fs::read_to_string(dir.join(run).join(file)).unwrap();
        assert_eq!(read("full"), read("killed"), "{file}");
    }
    // The clock goes on across the kills.
    let timings = ffn_train::metrics::read_timings(&dir.join("killed/timing.jsonl")).unwrap();
    assert!(timings.windows(2).all(|w| w[0].step <= w[1].step));
    assert!(timings.windows(2).all(|w| w[0].elapsed_s <= w[1].elapsed_s));
    assert_eq!(timings.last().unwrap().step, 1200);
}
