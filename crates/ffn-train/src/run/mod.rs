//! # The run folder
//!
//! ```text
//! RUN/config.toml      the resolved config (every default written out)
//!     ffn.toml         the FFN's FeedForwardConfig, for loading the weights elsewhere
//!     vocab.json       the tokeniser of a language task
//!     corpus.json      the text file's path, size and SHA-256 (a `--text` run)
//!     markov.bin       a Markov source's stationary distribution, solved once (Markov tasks)
//!     metrics.jsonl    one JSON record a line; metrics.csv the same as CSV
//!     timing.jsonl     the wall clock at each logged step
//!     summary.json     the end-of-run summary
//!     loss.svg         the losses against steps, the optimum dashed
//!     gap.svg          the gap to the optimum, log scale (when the optimum is known)
//!     load.svg         the experts' load (a model with sparse layers)
//!     checkpoints/     step-NNNNNN/ folders (see `checkpoint`)
//!     .lock            held (an advisory lock) by the one process training the run
//! ```
//!
//! Every file is written atomically (a temporary file renamed into place), so a reader or a
//! killed writer never leaves a half-written one. One process at a time trains a run: `train`
//! and `resume` take an exclusive lock on `RUN/.lock` (released when the process ends, even
//! by `kill -9`), and a second process gets a clear error instead of interleaving its
//! metrics and checkpoints with the first's.

use std::fs::{self, File, OpenOptions, TryLockError};
use std::path::{Path, PathBuf};

mod load;

pub use crate::checkpoint::CHECKPOINTS;
pub use crate::data::{MARKOV, VOCAB};
use crate::error::{Error, Result};
pub use load::{
    Corpus, Loaded, checkpoint_named, initialise, load_at, load_language_model, load_latest,
    load_latest_good, load_run,
};

/// The resolved config.
pub const CONFIG: &str = "config.toml";
/// The FFN's config.
pub const FFN: &str = "ffn.toml";
/// The text corpus's fingerprint.
pub const CORPUS: &str = "corpus.json";
/// The metrics, one JSON object a line.
pub const METRICS_JSONL: &str = "metrics.jsonl";
/// The metrics as CSV.
pub const METRICS_CSV: &str = "metrics.csv";
/// The wall clock at each logged moment, one JSON object a line.
pub const TIMING: &str = "timing.jsonl";
/// The end-of-run summary.
pub const SUMMARY: &str = "summary.json";
/// The loss plot.
pub const PLOT: &str = "loss.svg";
/// The gap to the optimum, on a log scale.
pub const GAP_PLOT: &str = "gap.svg";
/// The expert load of a run with sparse layers.
pub const LOAD_PLOT: &str = "load.svg";
/// The lock file.
pub const LOCK: &str = ".lock";

/// Every name `ffn-train` writes in a run folder.
pub const NAMES: [&str; 14] = [
    CONFIG,
    FFN,
    VOCAB,
    CORPUS,
    MARKOV,
    METRICS_JSONL,
    METRICS_CSV,
    TIMING,
    SUMMARY,
    PLOT,
    GAP_PLOT,
    LOAD_PLOT,
    CHECKPOINTS,
    LOCK,
];

/// The exclusive claim of one process on a run folder: an advisory lock on `RUN/.lock`,
/// released when this is dropped or the process ends.
#[derive(Debug)]
pub struct Lock {
    _file: File,
}

/// Takes the lock of the run folder `run`, which must exist.
pub fn lock(run: &Path) -> Result<Lock> {
    let path = run.join(LOCK);
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(Error::io(&path))?;
    match file.try_lock() {
        Ok(()) => Ok(Lock { _file: file }),
        Err(TryLockError::WouldBlock) => Err(Error::Locked {
            path: run.to_path_buf(),
        }),
        Err(TryLockError::Error(e)) => Err(Error::io(&path)(e)),
    }
}

/// Whether `name` is a file `ffn-train` writes in a run folder, or the temporary file of an
/// atomic write of one that was cut short (`.metrics.jsonl.tmp-1234`).
fn is_ours(name: &str) -> bool {
    NAMES.contains(&name)
        || name
            .strip_prefix('.')
            .and_then(|rest| rest.rsplit_once(".tmp-"))
            .is_some_and(|(file, pid)| {
                NAMES.contains(&file) && !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit())
            })
}

/// Whether `run` holds a run that never reached its first checkpoint (it failed or was
/// killed before it): only names `ffn-train` writes, a `config.toml`, and no checkpoint that
/// verifies. `train --run RUN` starts such a run again.
fn is_dead_end(run: &Path) -> Result<bool> {
    let mut names = Vec::new();
    for entry in fs::read_dir(run).map_err(Error::io(run))? {
        let entry = entry.map_err(Error::io(run))?;
        names.push(entry.file_name());
    }
    let ours = names.iter().all(|n| n.to_str().is_some_and(is_ours));
    let no_good_checkpoint = crate::checkpoint::list(run)?
        .iter()
        .all(|c| crate::checkpoint::verify(c).is_err());
    Ok(ours && run.join(CONFIG).is_file() && no_good_checkpoint)
}

/// Creates (or takes over) the run folder `run` for a new run and locks it. `run` may not
/// exist, be empty, or hold a run that never reached its first checkpoint, whose files are
/// then removed; anything else is refused. Returns the lock and whether the folder was created.
pub fn claim(run: &Path) -> Result<(Lock, bool)> {
    if let Some(parent) = run.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::create_dir_all(parent).map_err(Error::io(parent))?;
    }
    let created = match fs::create_dir(run) {
        Ok(()) => true,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && run.is_dir() => false,
        Err(e) => return Err(Error::io(run)(e)),
    };
    let lock = lock(run)?;
    let only_lock = fs::read_dir(run)
        .map_err(Error::io(run))?
        .filter_map(|e| e.ok())
        .all(|e| e.file_name() == LOCK);
    if !only_lock {
        if !is_dead_end(run)? {
            return Err(Error::Config(format!(
                "the run folder {} already exists; continue it with `ffn-train resume {0}` or \
                 choose another --run",
                run.display()
            )));
        }
        // Only names `is_dead_end` found to be ours.
        for entry in fs::read_dir(run).map_err(Error::io(run))? {
            let path = entry.map_err(Error::io(run))?.path();
            if path.file_name().is_some_and(|n| n == LOCK) {
                continue;
            }
            let removed = if path.is_dir() {
                fs::remove_dir_all(&path)
            } else {
                fs::remove_file(&path)
            };
            removed.map_err(Error::io(&path))?;
        }
    }
    Ok((lock, created))
}

/// Creates and locks the first free folder of `base`, `base-2`, `base-3`, …: two processes
/// starting at once get different folders.
pub fn claim_numbered(base: &Path) -> Result<(PathBuf, Lock)> {
    if let Some(parent) = base.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::create_dir_all(parent).map_err(Error::io(parent))?;
    }
    for i in 1.. {
        let run = match i {
            1 => base.to_path_buf(),
            i => PathBuf::from(format!("{}-{i}", base.display())),
        };
        match fs::create_dir(&run) {
            Ok(()) => return Ok((run.clone(), lock(&run)?)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(Error::io(&run)(e)),
        }
    }
    unreachable!("some suffix is free")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ffn-run-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_second_claim_on_a_locked_folder_is_refused() {
        let dir = scratch("lock");
        let run = dir.join("r");
        let (first, created) = claim(&run).unwrap();
        assert!(created);
        let err = lock(&run).unwrap_err();
        assert!(matches!(err, Error::Locked { .. }), "{err}");
        assert!(err.to_string().contains("in use by another"), "{err}");
        drop(first);
        lock(&run).unwrap();
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn numbered_claims_never_share_a_folder() {
        let dir = scratch("numbered");
        let base = dir.join("runs/default");
        let (a, _la) = claim_numbered(&base).unwrap();
        let (b, _lb) = claim_numbered(&base).unwrap();
        assert_eq!(a, base);
        assert_eq!(b, dir.join("runs/default-2"));
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_dead_end_run_is_taken_over_and_anything_else_refused() {
        let dir = scratch("dead-end");
        let run = dir.join("r");
        fs::create_dir_all(run.join(CHECKPOINTS)).unwrap();
        fs::write(run.join(CONFIG), "x").unwrap();
        fs::write(run.join(METRICS_JSONL), "").unwrap();
        fs::write(run.join(".metrics.csv.tmp-4321"), "").unwrap();
        assert!(!is_ours(".notes.tmp-1") && !is_ours(".config.toml.tmp-") && !is_ours("x"));
        let (lock, created) = claim(&run).unwrap();
        assert!(!created);
        assert!(!run.join(CONFIG).exists() && !run.join(CHECKPOINTS).exists());
        assert!(!run.join(".metrics.csv.tmp-4321").exists());
        drop(lock);

        // A user's file is never removed.
        fs::write(run.join(CONFIG), "x").unwrap();
        fs::write(run.join("notes.txt"), "mine").unwrap();
        assert!(claim(&run).is_err());
        assert!(run.join("notes.txt").exists());

        // A stray empty checkpoint folder does not make a run resumable.
        fs::remove_file(run.join("notes.txt")).unwrap();
        fs::create_dir_all(run.join(CHECKPOINTS).join("step-000010")).unwrap();
        assert!(is_dead_end(&run).unwrap());
        fs::remove_dir_all(dir).unwrap();
    }
}
