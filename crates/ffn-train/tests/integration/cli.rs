//! The `ffn-train` binary end to end: a run and its folder, evaluation, sampling, resume after
//! `kill -9`, and one clear line for every error.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{
    assert_error, assert_error_status, assert_quiet_success, ffn_train, losses, scratch, snapshot,
    stderr, stdout, tiny,
};

#[test]
fn train_eval_and_sample_end_to_end() {
    let dir = scratch("cli-e2e");
    let config = tiny(&dir);
    let out = ffn_train(
        &[
            "train",
            "--config",
            config.to_str().unwrap(),
            "--run",
            "run",
        ],
        &dir,
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    // Piped stdout: plain lines at each evaluation, no progress-bar escapes, no debug dumps.
    assert!(text.contains("step 10/60 | train "), "{text}");
    assert!(text.contains("step 60/60 | train "), "{text}");
    assert!(text.contains("| gap "), "{text}");
    assert!(text.contains("tok/s"), "{text}");
    assert!(text.contains("done: 60 steps"), "{text}");
    assert!(
        !text.contains('\u{1b}') && !text.contains("Snapshot"),
        "{text}"
    );

    let run = dir.join("run");
    for file in [
        "config.toml",
        "ffn.toml",
        "vocab.json",
        "metrics.jsonl",
        "metrics.csv",
        "timing.jsonl",
        "markov.bin",
        "summary.json",
        "loss.svg",
        "gap.svg",
    ] {
        assert!(run.join(file).is_file(), "{file} missing");
    }
    // The resolved config reloads; the FFN config is a FeedForwardConfig file.
    let resolved = std::fs::read_to_string(run.join("config.toml")).unwrap();
    ffn_train::TrainConfig::from_toml(&resolved, &[]).unwrap();
    let ffn = std::fs::read_to_string(run.join("ffn.toml")).unwrap();
    let ffn = ffn_model::FeedForwardConfig::from_toml(&ffn).unwrap();
    assert_eq!((ffn.d_model, ffn.d_ff, ffn.gated), (16, 43, true));
    // Checkpoints: every 10 steps, all kept (keep_checkpoints = 10).
    assert_eq!(ffn_train::checkpoint::list(&run).unwrap().len(), 6);
    let csv = std::fs::read_to_string(run.join("metrics.csv")).unwrap();
    assert_eq!(csv.lines().next(), Some("step,kind,loss,gap,lr"));
    assert_eq!(csv.lines().count(), 1 + 12 + 6);
    let summary = ffn_train::metrics::read_summary(&run).unwrap();
    assert_eq!(summary.steps, 60);
    let gap = summary.final_gap.unwrap();
    assert!(
        (summary.final_valid_loss.unwrap() - summary.optimal_loss.unwrap() - gap).abs() < 1e-12
    );
    assert!(summary.tokens_per_s > 0.0 && summary.wall_time_s > 0.0);
    // The header and the summary name what the products ran on: the kernel and the CPU.
    assert_eq!(summary.kernels, ffn_model::cpu_kernels());
    assert!(
        text.contains(&format!("matrix products: {}", summary.kernels)),
        "{text}"
    );

    let out = ffn_train(&["eval", "run", "--batches", "4"], &dir);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("step 60, validation loss"),
        "{}",
        stdout(&out)
    );
    assert!(stdout(&out).contains("gap"), "{}", stdout(&out));

    let sample = |extra: &[&str]| {
        let mut args = vec!["sample", "run", "--prompt", "abc", "--tokens", "30"];
        args.extend_from_slice(extra);
        let out = ffn_train(&args, &dir);
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out).trim_end().to_string()
    };
    let a = sample(&["--seed", "3"]);
    assert_eq!(a.chars().count(), 33);
    assert!(
        a.starts_with("abc") && a.chars().all(|c| "abcdef".contains(c)),
        "{a}"
    );
    assert_eq!(
        a,
        sample(&["--seed", "3"]),
        "the same seed samples the same text"
    );
    let greedy = sample(&["--temperature", "0"]);
    assert_eq!(greedy, sample(&["--temperature", "0", "--seed", "9"]));
    let out = ffn_train(&["sample", "run", "--prompt", "xyz"], &dir);
    assert_error(&out, "not in the vocabulary");
}

#[test]
fn a_run_killed_with_sigkill_resumes_to_the_same_curve() {
    let dir = scratch("cli-kill");
    let config = tiny(&dir);
    let config = config.to_str().unwrap();
    let sets = [
        "--set",
        "train.steps=400",
        "--set",
        "train.keep_checkpoints=3",
    ];
    let mut args = vec!["train", "--config", config, "--run", "full"];
    args.extend_from_slice(&sets);
    assert!(ffn_train(&args, &dir).status.success());

    let mut args = vec!["train", "--config", config, "--run", "killed"];
    args.extend_from_slice(&sets);
    let mut child = Command::new(env!("CARGO_BIN_EXE_ffn-train"))
        .args(&args)
        .current_dir(&dir)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let killed = dir.join("killed");
    let start = Instant::now();
    while !killed.join("checkpoints/step-000100").exists() {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "no checkpoint appeared"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    assert!(
        !killed.join("summary.json").exists(),
        "the run finished before it was killed"
    );

    let out = ffn_train(&["resume", "killed"], &dir);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("resuming at step"),
        "{}",
        stdout(&out)
    );
    assert_eq!(losses(&killed), losses(&dir.join("full")));
}

#[test]
fn every_error_is_one_clear_line() {
    let dir = scratch("cli-errors");
    let config = tiny(&dir);
    let config = config.to_str().unwrap();
    let train = |extra: &[&str]| {
        let mut args = vec!["train", "--config", config];
        args.extend_from_slice(extra);
        ffn_train(&args, &dir)
    };

    assert_error(&train(&["--set", "train.stepz=5"]), "stepz");
    // A value of the wrong kind names its key (the table has lost the file's positions).
    assert_error(
        &train(&["--set", "train.precision=fp8"]),
        "train.precision: unknown variant `fp8`, expected one of `f32`, `bf16`",
    );
    assert_error(
        &train(&["--set", "train.steps=many"]),
        "train.steps: invalid type: string \"many\"",
    );
    // Inside a section chosen by its `kind` (serde buffers it), the section is named.
    assert_error(
        &train(&["--set", "model.ffn.dropout=high"]),
        "model: invalid type: string \"high\", expected f64",
    );
    assert_error(
        &train(&["--set", "train.batch_size=0"]),
        "train.batch_size must be at least 1",
    );
    assert_error(
        &train(&["--set", "model.ffn.activation=gleu"]),
        "unknown activation `gleu`",
    );
    assert_error(
        &train(&["--set", "model.ffn.preset=SwiGLOO"]),
        "unknown preset",
    );
    assert_error(
        &train(&[
            "--set",
            "model.ffn.bias_gate=true",
            "--set",
            "model.ffn.preset=FFN_ReLU",
        ]),
        "model.ffn",
    );
    assert_error(
        &train(&["--set", "model.n_heads=3"]),
        "multiple of model.n_heads",
    );
    assert_error(&train(&["--set", "model.kind=ffn"]), "");
    assert_error(&train(&["--set", "nonsense"]), "expected key=value");
    // An unknown device is a usage error naming the devices of this build.
    let out = train(&["--device", "tpu"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("possible values: flex"),
        "{}",
        stderr(&out)
    );
    assert_error(
        &ffn_train(&["train", "--config", "missing.toml"], &dir),
        "missing.toml",
    );

    // Text files.
    std::fs::write(dir.join("empty.txt"), "").unwrap();
    std::fs::write(dir.join("short.txt"), "just a few words").unwrap();
    std::fs::write(dir.join("latin1.txt"), b"caf\xe9 ".repeat(100)).unwrap();
    assert_error(&train(&["--text", "empty.txt"]), "the file is empty");
    assert_error(&train(&["--text", "short.txt"]), "too short");
    assert_error(
        &train(&["--text", "latin1.txt", "--level", "char"]),
        "not UTF-8",
    );
    assert_error(&train(&["--text", "nowhere.txt"]), "nowhere.txt");
    assert!(
        !dir.join("runs").exists(),
        "no run folder is created for a bad file"
    );

    // An existing run folder is never overwritten.
    let sets = ["--set", "train.steps=20"];
    let mut args = vec!["--run", "run"];
    args.extend_from_slice(&sets);
    assert!(train(&args).status.success());
    let before = snapshot(&dir.join("run"));
    assert_error(&train(&args), "already exists");
    assert_eq!(snapshot(&dir.join("run")), before);

    // Resume: not a run folder; no intact checkpoint (a newer corrupt one alone is passed
    // over: tests/hostile.rs); a checkpoint of another config.
    assert_error(&ffn_train(&["resume", "."], &dir), "not a run folder");
    let checkpoints = ffn_train::checkpoint::list(&dir.join("run")).unwrap();
    let originals: Vec<(PathBuf, Vec<u8>)> = checkpoints
        .iter()
        .map(|c| {
            let model = c.join("model.bpk");
            let bytes = std::fs::read(&model).unwrap();
            std::fs::write(&model, &bytes[..bytes.len() / 2]).unwrap();
            (model, bytes)
        })
        .collect();
    let before = snapshot(&dir.join("run"));
    assert_error(&ffn_train(&["resume", "run"], &dir), "model.bpk");
    assert_error(&ffn_train(&["eval", "run"], &dir), "model.bpk");
    assert_eq!(
        snapshot(&dir.join("run")),
        before,
        "the run folder is left as it was"
    );
    for (model, bytes) in originals {
        std::fs::write(&model, &bytes).unwrap();
    }
    let config_path = dir.join("run/config.toml");
    let original = std::fs::read_to_string(&config_path).unwrap();
    std::fs::write(&config_path, original.replace("seed = 7", "seed = 8")).unwrap();
    assert_error(&ffn_train(&["resume", "run"], &dir), "another config");
    std::fs::write(&config_path, original).unwrap();

    // A diverging run stops, names the step, keeps its last good checkpoint.
    let out = train(&[
        "--run",
        "nan",
        "--set",
        "train.lr=1e30",
        "--set",
        "train.min_lr=1e30",
        "--set",
        "train.grad_clip=0",
        "--set",
        "train.checkpoint_every=1",
        "--set",
        "train.warmup_steps=0",
    ]);
    // Status 3: a divergence, told apart from other errors.
    assert_error_status(&out, 3, "the loss became");
    let err = stderr(&out);
    assert!(err.contains("at step"), "{err}");
    let last_good = ffn_train::checkpoint::list(&dir.join("nan")).unwrap();
    assert!(!last_good.is_empty(), "{err}");
    let name = last_good
        .last()
        .unwrap()
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    assert!(err.contains(&format!("nan/checkpoints/{name}")), "{err}");
    let step: usize = name["step-".len()..].parse().unwrap();
    assert!(err.contains(&format!("at step {}", step + 1)), "{err}");

    // A bad command line is clap's business: exit status 2.
    let out = ffn_train(&["train", "--stepz", "3"], &dir);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn text_files_train_byte_and_char_level() {
    let dir = scratch("cli-text");
    let text = "the quick brown fox jumps over the lazy dog. ".repeat(60) + "ça va très bien.\n";
    std::fs::write(dir.join("corpus.txt"), &text).unwrap();
    for level in ["byte", "char"] {
        let run = format!("run-{level}");
        let out = ffn_train(
            &[
                "train",
                "--text",
                "corpus.txt",
                "--level",
                level,
                "--run",
                &run,
                "--set",
                "train.steps=20",
                "--set",
                "train.eval_every=10",
                "--set",
                "task.seq_len=32",
            ],
            &dir,
        );
        assert!(out.status.success(), "{}", stderr(&out));
        assert!(stdout(&out).contains("optimum unknown"), "{}", stdout(&out));
        let summary = ffn_train::metrics::read_summary(&dir.join(&run)).unwrap();
        assert_eq!(summary.optimal_loss, None);
        assert!(
            summary.final_valid_loss.unwrap() < (if level == "byte" { 256f64 } else { 30f64 }).ln()
        );
        let out = ffn_train(&["sample", &run, "--prompt", "ça ", "--tokens", "10"], &dir);
        assert!(out.status.success(), "{}", stderr(&out));
    }
}

#[test]
fn inspect_shows_tensors_schemes_and_configs() {
    let dir = scratch("cli-inspect");
    let fixtures = ffn_test_support::data_file("hf");
    let out = ffn_train(
        &["inspect", fixtures.join("llama-sharded").to_str().unwrap()],
        &dir,
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    for expected in [
        "Hugging Face `llama` model, 2 layers, FFN scheme `llama`",
        "d_ff = 40",
        "activation = \"silu\"",
        "layer 1: prefix `model.layers.1.mlp.`",
        "tensors (21)",
    ] {
        assert!(text.contains(expected), "`{expected}` not in:\n{text}");
    }
    // A MoE model: its dense first layer and its sparse second one.
    let out = ffn_train(
        &["inspect", fixtures.join("deepseek_v3").to_str().unwrap()],
        &dir,
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    for expected in [
        "Hugging Face `deepseek_v3` model, 2 layers",
        "FFN config (from config.json and the tensors), dense layers",
        "sparse layers: 8 experts of d_ff 12, top-2, Sigmoid scores, renormalised, 2 of 4 groups, 1 shared expert(s)",
        "routed_scaling = 2.5",
        "layer 0: prefix `model.layers.0.mlp.`",
        "layer 1: sparse (MoE), prefix `model.layers.1.mlp.`",
    ] {
        assert!(text.contains(expected), "`{expected}` not in:\n{text}");
    }
    // Families found by their names and fields: each shows its scheme and layer prefix.
    for (name, model_type, scheme, layer1) in [
        ("phi3", "phi3", "gate_up_proj", "model.layers.1.mlp."),
        (
            "modernbert",
            "modernbert",
            "modernbert",
            "model.layers.1.mlp.",
        ),
        (
            "gpt_bigcode",
            "gpt_bigcode",
            "bigcode",
            "transformer.h.1.mlp.",
        ),
        ("opt", "opt", "fc", "model.decoder.layers.1."),
        ("bart", "bart", "fc", "model.encoder.layers.1."),
    ] {
        let out = ffn_train(&["inspect", fixtures.join(name).to_str().unwrap()], &dir);
        assert!(out.status.success(), "{}", stderr(&out));
        let text = stdout(&out);
        for expected in [
            format!("Hugging Face `{model_type}` model, 2 layers, FFN scheme `{scheme}`"),
            format!("layer 1: prefix `{layer1}`"),
        ] {
            assert!(text.contains(&expected), "`{expected}` not in:\n{text}");
        }
    }
    let out = ffn_train(&["inspect", fixtures.join("olmoe").to_str().unwrap()], &dir);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains("layer 1: sparse (MoE), prefix `model.layers.1.mlp.`")
            && text.contains("4 experts of d_ff 12, top-2"),
        "{text}"
    );
    // Llama 4: a dense layer 0 of its own width, a sparse layer 1 weighting its inputs;
    // gpt-oss: every layer sparse, biased, its clamped SwiGLU.
    for (name, expected) in [
        (
            "llama4_text",
            &[
                "layer 0: prefix `model.layers.0.feed_forward.`",
                "layer 1: sparse (MoE), prefix `model.layers.1.feed_forward.`",
                "top-1, Sigmoid scores, weighting the experts' inputs, 1 shared expert(s)",
                "d_ff = 20",
            ][..],
        ),
        (
            "gpt_oss",
            &[
                "layer 0: sparse (MoE), prefix `model.layers.0.mlp.`",
                "activation = \"swiglu_oai\"",
                "router_bias = true",
                "bias_down = true",
            ],
        ),
    ] {
        let out = ffn_train(&["inspect", fixtures.join(name).to_str().unwrap()], &dir);
        assert!(out.status.success(), "{}", stderr(&out));
        let text = stdout(&out);
        for expected in expected {
            assert!(
                text.contains(expected),
                "{name}: `{expected}` not in:\n{text}"
            );
        }
    }
    let out = ffn_train(
        &["inspect", fixtures.join("mixtral").to_str().unwrap()],
        &dir,
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(!text.contains("dense layers"), "{text}");
    assert!(
        text.contains("layer 0: sparse (MoE), prefix `model.layers.0.block_sparse_moe.`"),
        "{text}"
    );
    let out = ffn_train(
        &[
            "inspect",
            fixtures.join("gpt2/model.safetensors").to_str().unwrap(),
            "--all",
        ],
        &dir,
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("FFNs found: 2"), "{text}");
    assert!(
        text.contains("`transformer.h.1.mlp.`: gpt2 scheme, ungated, d_model 16, d_ff 64"),
        "{text}"
    );
    assert!(text.contains("transformer.h.1.mlp.c_fc.weight"), "{text}");
    assert_error(
        &ffn_train(&["inspect", "nowhere.safetensors"], &dir),
        "nowhere.safetensors",
    );
    std::fs::write(dir.join("junk.safetensors"), b"not a tensor file at all").unwrap();
    assert_error(
        &ffn_train(&["inspect", "junk.safetensors"], &dir),
        "not a valid safetensors file",
    );
}

/// A CPU run never starts a GPU runtime, whatever backends the binary was built with: resuming
/// (the optimiser state is built on the run's device, not burn's default, which is the GPU in a
/// `wgpu` build), evaluating, sampling, a mixture of experts with its selection bias, and the
/// cells of a sweep. [`ffn_train`] checks that no process opened a GPU library; here stderr
/// must also hold nothing but ffn-train's own lines, in a shell without `XDG_RUNTIME_DIR` (where
/// Mesa's Vulkan driver complains as it loads).
#[test]
fn a_cpu_run_never_starts_a_gpu_runtime() {
    let dir = scratch("cli-cpu-only");
    let config = tiny(&dir);
    let config = config.to_str().unwrap();
    let moe = "model.ffn.moe={ n_experts = 4, top_k = 2, scoring = \"sigmoid\", \
               selection_bias = true, bias_update_rate = 0.01 }";
    for (run, extra) in [
        ("dense", vec![]),
        ("moe", vec!["--set", "model.ffn.dropout=0", "--set", moe]),
    ] {
        let mut args = vec!["train", "--config", config, "--run", run, "--steps", "30"];
        args.extend(extra);
        assert_quiet_success(&ffn_train(&args, &dir));
        // Back to step 20, and on from there.
        std::fs::remove_dir_all(dir.join(run).join("checkpoints/step-000030")).unwrap();
        assert_quiet_success(&ffn_train(&["resume", run], &dir));
        assert_quiet_success(&ffn_train(&["eval", run], &dir));
        assert_quiet_success(&ffn_train(
            &["sample", run, "--prompt", "ab", "--tokens", "5"],
            &dir,
        ));
    }

    // A sweep's cells: each a process of its own, traced too.
    std::fs::write(
        dir.join("sweep.toml"),
        "variants = [\"FFN_ReLU\"]\nseeds = [1]\nlrs = [1e-2]\n[[tasks]]\nname = \"lm\"\n\
         config = \"tiny.toml\"\nset = [\"train.steps=20\"]\n",
    )
    .unwrap();
    let out = ffn_train(&["sweep", "--config", "sweep.toml", "--out", "sweep"], &dir);
    assert_quiet_success(&out);
    let mut logs = 0;
    for entry in walk(&dir.join("sweep")) {
        if entry.extension().is_some_and(|e| e == "log") {
            let log = std::fs::read_to_string(&entry).unwrap();
            assert!(!log.contains("XDG_RUNTIME_DIR"), "{log}");
            logs += 1;
        }
    }
    assert_eq!(logs, 1, "one cell, one log");
}

/// `train.precision = "bf16"`: the FFN's config records it, and a run trains as the f32 run does
/// to within bf16's rounding (the same seed, the same batches: the final validation losses
/// within 0.01 nats), a mixture of experts too.
#[test]
fn a_bf16_run_trains_like_the_f32_run() {
    let dir = scratch("cli-bf16");
    let config = tiny(&dir);
    let config = config.to_str().unwrap();
    for precision in ["f32", "bf16"] {
        let set = format!("train.precision={precision}");
        let args = [
            "train", "--config", config, "--run", precision, "--set", &set,
        ];
        assert_quiet_success(&ffn_train(&args, &dir));
        let ffn = std::fs::read_to_string(dir.join(precision).join("ffn.toml")).unwrap();
        let ffn = ffn_model::FeedForwardConfig::from_toml(&ffn).unwrap();
        assert_eq!(format!("{:?}", ffn.precision).to_lowercase(), precision);
    }
    let last = |run: &str| {
        let s = ffn_train::metrics::read_summary(&dir.join(run)).unwrap();
        s.final_valid_loss.unwrap()
    };
    let (f32, bf16) = (last("f32"), last("bf16"));
    assert!((f32 - bf16).abs() < 0.01, "f32 {f32}, bf16 {bf16}");
    // A mixture's experts too: the run trains as its f32 run does.
    let moe = "model.ffn.moe={ n_experts = 4, top_k = 2 }";
    for precision in ["f32", "bf16"] {
        let set = format!("train.precision={precision}");
        let run = format!("moe-{precision}");
        let args = [
            "train",
            "--config",
            config,
            "--run",
            &run,
            "--set",
            &set,
            "--set",
            "model.ffn.dropout=0",
            "--set",
            moe,
        ];
        assert_quiet_success(&ffn_train(&args, &dir));
    }
    let (f32, bf16) = (last("moe-f32"), last("moe-bf16"));
    assert!((f32 - bf16).abs() < 0.01, "MoE: f32 {f32}, bf16 {bf16}");
}

/// The f32 kernel follows the CPU, not a library older than it nor an `OPENBLAS_CORETYPE`
/// left in the environment: on a CPU with AVX-512, an OpenBLAS told to run its AVX2 (`Haswell`)
/// kernels is passed over for Flex's AVX-512 product, and the header says why; its AVX-512
/// kernels (`SkylakeX`) are taken, and so is any library `FFN_BLAS` names; with the variable
/// empty, ffn asks OpenBLAS for its AVX-512 kernels itself (OpenBLAS 0.3.21 would take an
/// Emerald Rapids Xeon for a Pentium 4). Without AVX-512 the library runs as told. (Where no
/// OpenBLAS is installed, every run reports Flex's product.)
#[test]
fn the_f32_kernel_follows_the_cpu_not_openblas_coretype() {
    let dir = scratch("cli-kernels");
    let config = tiny(&dir);
    let config = config.to_str().unwrap();
    let runs = std::cell::Cell::new(0);
    let header = |vars: &[(&str, &str)]| {
        runs.set(runs.get() + 1);
        let run = format!("run{}", runs.get());
        let args = ["train", "--config", config, "--run", &run, "--steps", "2"];
        let out = crate::common::ffn_train_with(&args, &dir, vars);
        assert_quiet_success(&out);
        let text = stdout(&out);
        let line = text
            .lines()
            .find_map(|l| l.strip_prefix("matrix products: "))
            .unwrap_or_else(|| panic!("no kernel line in\n{text}"))
            .to_string();
        line.split("; bf16:").next().unwrap().to_string()
    };
    let avx512 = ffn_model::cpu_kernels().contains("avx512bw");
    let narrow = header(&[("OPENBLAS_CORETYPE", "Haswell")]);
    if !narrow.contains("OpenBLAS") {
        assert!(narrow.starts_with("Flex's gemm"), "{narrow}");
        return;
    }
    if avx512 {
        assert!(
            narrow.starts_with("Flex's gemm: OpenBLAS")
                && narrow
                    .contains("Haswell kernels (OPENBLAS_CORETYPE=Haswell) on this AVX-512 CPU"),
            "{narrow}"
        );
        let wide = header(&[("OPENBLAS_CORETYPE", "SkylakeX")]);
        assert!(
            wide.starts_with("OpenBLAS") && wide.contains("SkylakeX kernels"),
            "{wide}"
        );
        let asked = header(&[("OPENBLAS_CORETYPE", "")]);
        assert!(
            asked.starts_with("OpenBLAS")
                && asked.contains("SkylakeX kernels (OPENBLAS_CORETYPE=SkylakeX)"),
            "{asked}"
        );
        let named = header(&[
            ("OPENBLAS_CORETYPE", "Haswell"),
            ("FFN_BLAS", "libopenblas.so.0"),
        ]);
        assert!(
            named.starts_with("OpenBLAS") && named.contains("Haswell kernels"),
            "{named}"
        );
    } else {
        assert!(
            narrow.starts_with("OpenBLAS") && narrow.contains("Haswell kernels"),
            "{narrow}"
        );
    }
}

/// Every file under `dir`.
fn walk(dir: &Path) -> Vec<PathBuf> {
    snapshot(dir).into_iter().map(|(path, _)| path).collect()
}

/// The CLI trains on the GPU backend (on CI: Mesa's software Vulkan driver, lavapipe).
#[cfg(feature = "wgpu")]
#[test]
fn trains_on_wgpu() {
    let dir = scratch("cli-wgpu");
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/teacher.toml");
    let train = |run: &str, set: &[&str]| {
        let mut args = vec!["train", "--config", config.to_str().unwrap(), "--run", run];
        args.extend(["--device", "wgpu", "--set", "train.steps=60"]);
        args.extend(["--set", "train.eval_every=30"]);
        for s in set {
            args.extend(["--set", s]);
        }
        ffn_train(&args, &dir)
    };
    let out = train("run", &["train.checkpoint_every=30"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let curve = losses(&dir.join("run"));
    let valid: Vec<f64> = curve
        .iter()
        .filter(|(_, kind, _)| kind == "valid")
        .map(|r| r.2)
        .collect();
    assert_eq!(valid.len(), 2, "{curve:?}");
    assert!(valid.iter().all(|v| v.is_finite()), "{curve:?}");
    // Teacher outputs have variance of order one; 60 steps bring the student well under it.
    assert!(valid[1] < 0.5, "{curve:?}");
    // And it resumes on the same device.
    let out = ffn_train(&["eval", "run", "--device", "wgpu"], &dir);
    assert!(out.status.success(), "{}", stderr(&out));

    // In bf16 the products take the narrower type the adapter computes in (lavapipe: f16, as
    // wgpu has no bf16; `parity.rs` checks that they do), and the header and the summary say
    // which.
    let out = train("bf16", &["train.precision=bf16"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let summary = ffn_train::metrics::read_summary(&dir.join("bf16")).unwrap();
    let said = [
        "; bf16: bf16 operands",
        "; bf16: f16 operands",
        "; bf16: f32 (",
    ];
    assert!(
        said.iter().any(|s| summary.kernels.contains(s)),
        "{}",
        summary.kernels
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&summary.kernels), "{text}");
    let valid = summary.final_valid_loss.unwrap();
    assert!(valid.is_finite() && valid < 0.5, "{valid}");
}

/// Without any GPU driver (here: the Vulkan and GL loaders replaced by empty files), `--device
/// wgpu` is one clear error line, and no run folder is created.
#[cfg(all(feature = "wgpu", target_os = "linux"))]
#[test]
fn wgpu_without_an_adapter_is_one_clear_error() {
    let dir = scratch("cli-wgpu-none");
    let fake = dir.join("no-drivers");
    std::fs::create_dir_all(&fake).unwrap();
    for lib in [
        "libvulkan.so.1",
        "libvulkan.so",
        "libEGL.so.1",
        "libEGL.so",
        "libGL.so.1",
    ] {
        std::fs::write(fake.join(lib), b"").unwrap();
    }
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/teacher.toml");
    let out = Command::new(env!("CARGO_BIN_EXE_ffn-train"))
        .args([
            "train",
            "--config",
            config.to_str().unwrap(),
            "--device",
            "wgpu",
        ])
        .current_dir(&dir)
        .env("LD_LIBRARY_PATH", &fake)
        .env_remove("FFN_DEVICE")
        .output()
        .unwrap();
    assert_error(&out, "no wgpu adapter could be initialised");
    assert!(!dir.join("runs").exists());
}

#[test]
fn dry_runs_shortcuts_checkpoints_and_json() {
    let dir = scratch("cli-options");
    let config = tiny(&dir);
    let config = config.to_str().unwrap();

    // --dry-run: the resolved config and its memory estimate; nothing written.
    let out = ffn_train(
        &[
            "train",
            "--config",
            config,
            "--seed",
            "5",
            "--steps",
            "20",
            "--run",
            "r",
            "--dry-run",
        ],
        &dir,
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let toml_part: String = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n");
    let resolved = ffn_train::TrainConfig::from_toml(&toml_part, &[]).unwrap();
    assert_eq!((resolved.seed, resolved.train.steps), (5, 20));
    assert!(text.contains("# memory estimate: "), "{text}");
    assert!(!dir.join("r").exists());
    // An explicit --set wins over a shortcut.
    let out = ffn_train(
        &[
            "train",
            "--config",
            config,
            "--steps",
            "20",
            "--set",
            "train.steps=30",
            "--dry-run",
        ],
        &dir,
    );
    assert!(stdout(&out).contains("steps = 30"), "{}", stdout(&out));

    // --help lists this build's devices and the environment variable.
    let help = stdout(&ffn_train(&["train", "--help"], &dir));
    assert!(
        help.contains("FFN_DEVICE") && help.contains("possible values: flex"),
        "{help}"
    );
    assert!(stdout(&ffn_train(&["--help"], &dir)).contains("3 the loss diverged"));

    // A run, then eval of a chosen checkpoint, as JSON.
    let out = ffn_train(
        &["train", "--config", config, "--steps", "20", "--run", "r"],
        &dir,
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("device flex (CPU)"),
        "{}",
        stdout(&out)
    );
    let summary = ffn_train::metrics::read_summary(&dir.join("r")).unwrap();
    assert_eq!(summary.device, "flex (CPU)");
    let eval = |extra: &[&str]| {
        let mut args = vec!["eval", "r", "--batches", "2", "--json"];
        args.extend_from_slice(extra);
        let out = ffn_train(&args, &dir);
        assert!(out.status.success(), "{}", stderr(&out));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let newest = eval(&[]);
    assert_eq!(newest["step"], 20);
    let at_10 = eval(&["--checkpoint", "10"]);
    assert_eq!(at_10["step"], 10);
    let (loss, optimum, gap) = (
        at_10["loss"].as_f64().unwrap(),
        at_10["optimal_loss"].as_f64().unwrap(),
        at_10["gap"].as_f64().unwrap(),
    );
    assert!((loss - optimum - gap).abs() < 1e-12);
    assert_ne!(newest["loss"], at_10["loss"]);
    let folder = dir.join("r/checkpoints/step-000010");
    assert_eq!(
        eval(&["--checkpoint", folder.to_str().unwrap()])["loss"],
        at_10["loss"]
    );
    assert_error(
        &ffn_train(&["eval", "r", "--checkpoint", "999"], &dir),
        "no such checkpoint folder",
    );

    // sample from a chosen checkpoint: the newest by default.
    let sample = |checkpoint: &str| {
        let out = ffn_train(
            &[
                "sample",
                "r",
                "--tokens",
                "30",
                "--temperature",
                "0",
                "--checkpoint",
                checkpoint,
            ],
            &dir,
        );
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out)
    };
    assert_eq!(sample("20"), {
        let out = ffn_train(
            &["sample", "r", "--tokens", "30", "--temperature", "0"],
            &dir,
        );
        stdout(&out)
    });
    // `--checkpoint 10` loads step 10: with step 20 damaged, the default falls back to step 10
    // and must write the same text, while `--checkpoint 20` is refused.
    let at_10 = sample("10");
    let model = dir.join("r/checkpoints/step-000020/model.bpk");
    let mut bytes = std::fs::read(&model).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xFF;
    std::fs::write(&model, bytes).unwrap();
    let out = ffn_train(
        &["sample", "r", "--tokens", "30", "--temperature", "0"],
        &dir,
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("skipping checkpoint"),
        "{}",
        stderr(&out)
    );
    assert_eq!(stdout(&out), at_10);
    assert_error(
        &ffn_train(&["sample", "r", "--checkpoint", "20"], &dir),
        "corrupt",
    );
}
