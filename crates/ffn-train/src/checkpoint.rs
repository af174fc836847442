//! # Checkpoints
//!
//! `RUN/checkpoints/step-000250/` holds everything needed to continue a run exactly:
//!
//! - `model.bpk`: the model (burn record, parameter ids included, so the optimiser state
//!   finds its parameters again);
//! - `optim.bpk`: AdamW's moments and step counts;
//! - `checksums.json`: the SHA-256 of the three others, written last and checked on loading
//!   (a corrupt or incomplete checkpoint is passed over for the newest good one);
//! - `state.json`: the step, the RNG state (every random stream is a function of the run's seed
//!   and the step, so the state is the pair), the partial training-loss average of the current
//!   logging interval, the best validation loss, and a fingerprint of the run's config.
//!
//! Nothing in a checkpoint depends on the wall clock or on the process that wrote it (the
//! parameter ids are numbered, see [`crate::model::number_params`]): a run killed and resumed
//! any number of times ends with the same bytes as a run in one go.
//!
//! A checkpoint is written to a hidden temporary folder that is renamed into place only when
//! complete, so a run killed at any moment (even by `kill -9`) leaves complete checkpoints
//! only; the oldest are deleted beyond `keep_checkpoints`.

use std::fs;
use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::optim::ModuleOptimizer;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::files;
use crate::model::Model;

/// The non-tensor state of a run at a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct State {
    /// Steps completed.
    pub step: usize,
    /// The RNG state: the run's seed and the next step (see [`crate::rng`]).
    pub rng: RngState,
    /// Sum and count of training losses since the last logged record.
    pub pending_loss: (f64, usize),
    /// The best validation loss so far, and its step.
    pub best_valid: Option<(f64, usize)>,
    /// Tokens (or samples) trained on so far.
    pub tokens: u64,
    /// Fingerprint of the run's `config.toml`, to refuse a checkpoint of another config.
    pub config_fingerprint: String,
}

/// The state of every random stream: see [`crate::rng`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RngState {
    /// The run's seed.
    pub seed: u64,
    /// The step whose streams come next.
    pub next_step: usize,
}

/// A run folder's checkpoint folder.
pub const CHECKPOINTS: &str = "checkpoints";

/// The files of a checkpoint, each with its SHA-256 in `checksums.json`.
const PARTS: [&str; 3] = ["model.bpk", "optim.bpk", "state.json"];

/// The checksum file, written last: a checkpoint without it is incomplete.
const CHECKSUMS: &str = "checksums.json";

/// Checks a checkpoint's files against its `checksums.json`.
pub fn verify(checkpoint: &Path) -> Result<()> {
    let fail = |message: String| Error::Checkpoint {
        path: checkpoint.to_path_buf(),
        message,
    };
    let path = checkpoint.join(CHECKSUMS);
    let text = fs::read_to_string(&path)
        .map_err(|e| fail(format!("incomplete: no readable {CHECKSUMS} ({e})")))?;
    let sums: std::collections::BTreeMap<String, String> =
        serde_json::from_str(&text).map_err(|e| fail(format!("corrupt {CHECKSUMS}: {e}")))?;
    for part in PARTS {
        let expected = sums
            .get(part)
            .ok_or_else(|| fail(format!("{CHECKSUMS} has no entry for {part}")))?;
        let file = checkpoint.join(part);
        let bytes = fs::read(&file).map_err(|e| fail(format!("{part}: {e}")))?;
        if &files::sha256(&bytes) != expected {
            return Err(fail(format!(
                "{part} is corrupt: its SHA-256 differs from the one recorded when it was written"
            )));
        }
    }
    Ok(())
}

/// The checkpoint folder of a run.
pub fn folder(run: &Path) -> PathBuf {
    run.join(CHECKPOINTS)
}

/// Complete checkpoints of a run, oldest first.
pub fn list(run: &Path) -> Result<Vec<PathBuf>> {
    let dir = folder(run);
    if !dir.exists() {
        return Ok(Vec::new());
    }
    let mut found: Vec<(usize, PathBuf)> = fs::read_dir(&dir)
        .map_err(Error::io(&dir))?
        .filter_map(|entry| {
            let path = entry.ok()?.path();
            let name = path.file_name()?.to_str()?;
            let step = name.strip_prefix("step-")?.parse().ok()?;
            Some((step, path))
        })
        .collect();
    found.sort();
    Ok(found.into_iter().map(|(_, p)| p).collect())
}

/// Writes a checkpoint atomically and deletes the oldest beyond `keep`; returns its folder.
pub fn save(
    run: &Path,
    model: &Model,
    optim: &ModuleOptimizer,
    state: &State,
    keep: usize,
) -> Result<PathBuf> {
    let dir = folder(run);
    fs::create_dir_all(&dir).map_err(Error::io(&dir))?;
    let name = format!("step-{:06}", state.step);
    let tmp = dir.join(format!(".tmp-{name}"));
    let target = dir.join(&name);
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(Error::io(&tmp))?;
    }
    fs::create_dir(&tmp).map_err(Error::io(&tmp))?;
    let record_error = |path: PathBuf| {
        move |e: burn::store::RecordError| Error::Checkpoint {
            path,
            message: e.to_string(),
        }
    };
    let model_path = tmp.join("model.bpk");
    model
        .clone()
        .save_file(&model_path)
        .map_err(record_error(model_path.clone()))?;
    let optim_path = tmp.join("optim.bpk");
    // burn writes the moments in the order of a hash map, a different order in each process;
    // read back, they come in the order of their names, and written again, so do the bytes.
    let canonical = optim
        .into_bytes()
        .and_then(burn::optim::OptimizerRecord::from_bytes)
        .and_then(burn::optim::OptimizerRecord::into_bytes)
        .map_err(record_error(optim_path.clone()))?;
    fs::write(&optim_path, &*canonical).map_err(Error::io(&optim_path))?;
    let state_path = tmp.join("state.json");
    let json = serde_json::to_string_pretty(state).expect("state serialises");
    fs::write(&state_path, json).map_err(Error::io(&state_path))?;
    let mut sums = std::collections::BTreeMap::new();
    for part in PARTS {
        let file = tmp.join(part);
        let bytes = fs::read(&file).map_err(Error::io(&file))?;
        sums.insert(part, files::sha256(&bytes));
    }
    let sums_path = tmp.join(CHECKSUMS);
    let json = serde_json::to_string_pretty(&sums).expect("checksums serialise");
    fs::write(&sums_path, json).map_err(Error::io(&sums_path))?;
    for file in [&model_path, &optim_path, &state_path, &sums_path] {
        fs::File::open(file)
            .and_then(|f| f.sync_all())
            .map_err(Error::io(file))?;
    }
    if target.exists() {
        fs::remove_dir_all(&target).map_err(Error::io(&target))?;
    }
    fs::rename(&tmp, &target).map_err(Error::io(&target))?;

    let all = list(run)?;
    for old in all.iter().take(all.len().saturating_sub(keep)) {
        fs::remove_dir_all(old).map_err(Error::io(old))?;
    }
    Ok(target)
}

/// Reads a checkpoint's state, checking it belongs to the config with `fingerprint`.
pub fn read_state(checkpoint: &Path, fingerprint: &str) -> Result<State> {
    let path = checkpoint.join("state.json");
    let text = fs::read_to_string(&path).map_err(Error::io(&path))?;
    let state: State = serde_json::from_str(&text).map_err(|e| Error::Checkpoint {
        path: path.clone(),
        message: format!("corrupt checkpoint state: {e}"),
    })?;
    if state.config_fingerprint != fingerprint {
        return Err(Error::Checkpoint {
            path,
            message: "this checkpoint was written by a run with another config.toml".into(),
        });
    }
    Ok(state)
}

/// A file of a checkpoint, which must exist.
fn part(checkpoint: &Path, name: &str) -> Result<PathBuf> {
    let path = checkpoint.join(name);
    if path.exists() {
        Ok(path)
    } else {
        Err(Error::Checkpoint {
            path,
            message: "missing: the checkpoint is incomplete".into(),
        })
    }
}

/// Loads a checkpoint's model into `model` (built from the run's config).
pub fn load_model(checkpoint: &Path, model: Model) -> Result<Model> {
    let path = part(checkpoint, "model.bpk")?;
    // Read whole, now: a record loaded from the file reads it lazily, and the file may be
    // rotated away (keep_checkpoints) or damaged before the last tensor is used.
    let bytes = fs::read(&path).map_err(Error::io(&path))?;
    burn::store::ModuleRecord::from_bytes(burn::tensor::Bytes::from_bytes_vec(bytes))
        .and_then(|record| model.try_load_record(record))
        .map_err(|e| Error::Checkpoint {
            path,
            message: format!("cannot load the model (corrupt, or from another model): {e}"),
        })
}

/// Loads a checkpoint's optimiser state into `optim`.
pub fn load_optim(checkpoint: &Path, optim: ModuleOptimizer) -> Result<ModuleOptimizer> {
    let path = part(checkpoint, "optim.bpk")?;
    let bytes = fs::read(&path).map_err(Error::io(&path))?;
    optim
        .from_bytes(burn::tensor::Bytes::from_bytes_vec(bytes))
        .map_err(|e| Error::Checkpoint {
            path,
            message: format!("cannot load the optimiser state: {e}"),
        })
}
