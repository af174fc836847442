//! What the CLI tests share: tiny run configs, running the binary, reading a run folder.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use burn::tensor::Device;

pub use ffn_test_support::{Rng, property, scratch};

/// The `[train]` table of the tiny runs: 60 steps, evaluated and checkpointed every 10.
macro_rules! tiny_schedule {
    () => {
        r#"[train]
steps = 60
batch_size = 8
lr = 1e-2
warmup_steps = 5
eval_every = 10
eval_batches = 2
log_every = 5
checkpoint_every = 10
keep_checkpoints = 10
"#
    };
}

/// A language-model run that takes a second or two: a 1-layer transformer on a small Markov
/// chain, with FFN dropout so that the dropout RNG is exercised too.
pub const TINY_LM: &str = concat!(
    r#"
seed = 7
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
ffn = { preset = "SwiGLU", dropout = 0.1 }
"#,
    tiny_schedule!()
);

/// A teacher-student regression run of the same length, with dropout in the student: its
/// teacher's weights must come from the teacher's own stream, whatever step a process starts at.
pub const TINY_TEACHER: &str = concat!(
    r#"
seed = 3
[task]
kind = "teacher"
noise = 0.1
[model]
kind = "ffn"
d_model = 8
ffn = { preset = "GEGLU", dropout = 0.1 }
"#,
    tiny_schedule!()
);

/// burn's device RNG is process-wide: tests that train hold this lock, one run at a time.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

pub fn device() -> Device {
    Device::flex().autodiff()
}

/// `(step, kind, loss)` of every metrics record of a run.
pub fn losses(run: &Path) -> Vec<(usize, String, f64)> {
    ffn_train::metrics::read_records(&run.join("metrics.jsonl"))
        .unwrap()
        .into_iter()
        .map(|r| (r.step, r.kind, r.loss))
        .collect()
}

/// Copies a folder tree.
pub fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// Every file under a folder with its bytes, sorted: to check a folder was left intact.
pub fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(snapshot(&path));
        } else {
            out.push((path.clone(), std::fs::read(&path).unwrap()));
        }
    }
    out.sort();
    out
}

/// Runs the `ffn-train` binary in `cwd`.
///
/// As in a plain shell: `FFN_DEVICE` and `XDG_RUNTIME_DIR` unset (a command that names a GPU
/// device gets a runtime folder of its own, as a desktop session would give it). A command that
/// names no GPU device must not start a GPU runtime, in any process it starts (a sweep's
/// cells): on Linux the dynamic loader's trace shows which libraries each process opened, and
/// none may be a GPU driver's.
pub fn ffn_train(args: &[&str], cwd: &Path) -> Output {
    ffn_train_with(args, cwd, &[])
}

/// [`ffn_train`] with these environment variables set.
pub fn ffn_train_with(args: &[&str], cwd: &Path, vars: &[(&str, &str)]) -> Output {
    let gpu = args.iter().any(|a| matches!(*a, "wgpu" | "cuda"));
    let mut command = Command::new(env!("CARGO_BIN_EXE_ffn-train"));
    command
        .args(args)
        .current_dir(cwd)
        .env_remove("FFN_DEVICE")
        .env_remove("XDG_RUNTIME_DIR")
        .envs(vars.iter().copied());
    let runtime = cwd.join(".xdg-runtime");
    if gpu {
        std::fs::create_dir_all(&runtime).unwrap();
        command.env("XDG_RUNTIME_DIR", &runtime);
    }
    let trace = (!gpu && cfg!(all(target_os = "linux", target_env = "gnu"))).then(|| {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("ffn-ld-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        command
            .env("LD_DEBUG", "files")
            .env("LD_DEBUG_OUTPUT", dir.join("trace"));
        dir
    });
    let out = command.output().expect("the binary runs");
    if let Some(dir) = trace {
        let opened = gpu_libraries_opened(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            opened.is_empty(),
            "`ffn-train {}` on the CPU started a GPU runtime: it opened {opened:?}",
            args.join(" ")
        );
    }
    out
}

/// The shared libraries of a GPU runtime (Vulkan, GL, CUDA).
pub const GPU_LIBRARIES: &[&str] = &[
    "libvulkan.so",
    "libEGL.so",
    "libGL.so",
    "libGLX",
    "libcuda.so",
    "libnvrtc",
    "libnvidia-ml",
];

/// The GPU libraries that the processes traced into `dir` (`LD_DEBUG=files`) opened.
pub fn gpu_libraries_opened(dir: &Path) -> Vec<String> {
    let mut opened = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let text = std::fs::read_to_string(entry.unwrap().path()).unwrap_or_default();
        for line in text.lines() {
            let Some(file) = line.split("file=").nth(1) else {
                continue;
            };
            let name = file.split([' ', ';']).next().unwrap_or_default();
            if GPU_LIBRARIES.iter().any(|lib| name.contains(lib))
                && !opened.contains(&name.to_string())
            {
                opened.push(name.to_string());
            }
        }
    }
    opened
}

/// Asserts that a command succeeded and that its stderr holds only ffn-train's own lines
/// (`warning: …`): nothing from a driver or a library.
pub fn assert_quiet_success(o: &Output) {
    assert!(
        o.status.success(),
        "stdout: {}\nstderr: {}",
        stdout(o),
        stderr(o)
    );
    let err = stderr(o);
    assert!(
        err.lines().all(|l| l.starts_with("warning: ")),
        "stderr holds lines that are not ffn-train's:\n{err}"
    );
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts a failed command printed exactly one line, `error: …` containing `needle`, and
/// exited with status 1.
pub fn assert_error(o: &Output, needle: &str) {
    assert_error_status(o, 1, needle)
}

/// [`assert_error`] with another exit status.
pub fn assert_error_status(o: &Output, status: i32, needle: &str) {
    assert_eq!(
        o.status.code(),
        Some(status),
        "stdout: {}\nstderr: {}",
        stdout(o),
        stderr(o)
    );
    let err = stderr(o);
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "one line expected:\n{err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    assert!(err.contains(needle), "`{needle}` not in: {err}");
}

/// Writes [`TINY_LM`] to `dir/tiny.toml` and returns its path.
pub fn tiny(dir: &Path) -> PathBuf {
    let path = dir.join("tiny.toml");
    std::fs::write(&path, TINY_LM).unwrap();
    path
}
