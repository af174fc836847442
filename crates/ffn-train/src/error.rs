//! Every way a run can fail, each with a message that names what to fix.

use std::path::PathBuf;

/// An error of `ffn-train`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The FFN part of a config is invalid.
    #[error("{context}: {source}")]
    Ffn {
        /// Which table (`model.ffn`, `task.teacher`).
        context: String,
        /// The problem.
        source: ffn_model::ConfigError,
    },
    /// The config is invalid: a bad value, a missing key, a misspelt key.
    #[error("{0}")]
    Config(String),
    /// A `--set key=value` override that does not apply.
    #[error("--set {0}")]
    Override(String),
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// Training data that cannot be used: an empty, too short or undecodable text file.
    #[error("{}: {message}", path.display())]
    Data {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// A checkpoint or run folder that cannot be resumed or loaded.
    #[error("{}: {message}", path.display())]
    Checkpoint {
        /// The checkpoint, or the run folder.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// The loss became NaN or infinite.
    #[error(
        "the loss became {loss} at step {step}; training stopped. {}",
        match last_good { Some(p) => format!("The last good checkpoint is {}.", p.display()), None => "No checkpoint had been written yet.".to_string() }
    )]
    Diverged {
        /// The step whose loss was not finite.
        step: usize,
        /// The loss (`NaN`, `inf`).
        loss: f64,
        /// The newest checkpoint written before, kept as it was.
        last_good: Option<PathBuf>,
    },
    /// Another process holds the run folder's lock (it is training or resuming that run).
    #[error(
        "the run folder {} is in use by another ffn-train process (it holds {}/.lock); wait for it to end or choose another --run",
        path.display(),
        path.display()
    )]
    Locked {
        /// The run folder.
        path: PathBuf,
    },
    /// Training stopped on SIGINT or SIGTERM after writing a checkpoint.
    #[error(
        "interrupted at step {step}; checkpoint {} written; continue with `ffn-train resume {}`",
        checkpoint.display(),
        run.display()
    )]
    Interrupted {
        /// The step completed.
        step: usize,
        /// The checkpoint written.
        checkpoint: PathBuf,
        /// The run folder.
        run: PathBuf,
    },
    /// A sweep stopped by SIGINT or SIGTERM, each running cell at a checkpoint.
    #[error(
        "sweep interrupted with {done} of {total} cells done; run the same command to continue it"
    )]
    SweepInterrupted {
        /// Cells finished.
        done: usize,
        /// Cells in the grid.
        total: usize,
    },
    /// An error of `ffn-model` (weights, configs, Hugging Face folders).
    #[error(transparent)]
    Model(#[from] ffn_model::Error),
    /// A device that is not compiled in, or cannot start.
    #[error("{0}")]
    Device(String),
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io { path, source }
    }
}

/// The result type of `ffn-train`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Exit status of `ffn-train` for a run whose loss diverged ([`Error::Diverged`]).
pub const EXIT_DIVERGED: u8 = 3;

/// Exit status of `ffn-train` stopped by SIGINT or SIGTERM (after its checkpoint), as shells
/// use.
pub const EXIT_INTERRUPTED: u8 = 130;
