//! Loading a run from its folder: its config, task and model as they were written, and the
//! checkpoint to resume from or evaluate (the newest good one, or one by name).

use std::fs;
use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::tensor::Device;

use crate::checkpoint::{self, State};
use crate::config::{TaskConfig, TrainConfig};
use crate::data::{Task, Vocab};
use crate::error::{Error, Result};
use crate::files;
use crate::model::{Materialize, Model};
use crate::rng::Rng;
use crate::run;
use ffn_model::FeedForwardConfig;

/// The text file a `--text` run trains on, as `corpus.json` records it: a resumed run,
/// `eval` and `sample` refuse a file that changed.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Corpus {
    /// Its absolute path.
    pub path: PathBuf,
    /// Its size in bytes.
    pub bytes: u64,
    /// Its SHA-256, hex.
    pub sha256: String,
}

impl Corpus {
    /// Reads and fingerprints the file.
    pub fn of(path: &Path) -> Result<Self> {
        let bytes =
            ffn_model::files::read_regular(path, crate::data::MAX_TEXT).map_err(Error::io(path))?;
        Ok(Self {
            path: path.to_path_buf(),
            bytes: bytes.len() as u64,
            sha256: files::sha256(&bytes),
        })
    }

    /// Checks the run folder's recorded corpus against the file as it is now.
    fn check(run: &Path, path: &Path) -> Result<()> {
        let record = run.join(run::CORPUS);
        let text = fs::read_to_string(&record).map_err(Error::io(&record))?;
        let recorded: Corpus = serde_json::from_str(&text).map_err(|e| Error::Checkpoint {
            path: record.clone(),
            message: format!("corrupt: {e}"),
        })?;
        let now = Corpus::of(path)?;
        if now != recorded {
            return Err(Error::Data {
                path: path.to_path_buf(),
                message: format!(
                    "the text file changed since the run started (it had {} bytes, SHA-256 {}; \
                     now {} bytes, {}): restore it, or start a new run",
                    recorded.bytes, recorded.sha256, now.bytes, now.sha256
                ),
            });
        }
        Ok(())
    }
}

/// What `config.toml` of a run folder holds, and the model built from it.
pub struct Loaded {
    /// The run's config.
    pub config: TrainConfig,
    /// Its FFN, resolved once ([`TrainConfig::ffn`]).
    pub ffn: FeedForwardConfig,
    /// Its fingerprint.
    pub fingerprint: String,
    /// The task (data, optimum).
    pub task: Task,
    /// A freshly initialised model of the run.
    pub model: Model,
    /// The device it trains on ([`TrainSettings::device`](crate::config::TrainSettings::device)).
    pub device: Device,
}

/// A run folder's `config.toml`: its text and the config.
fn read_config(run: &Path) -> Result<(String, TrainConfig)> {
    let path = run.join(run::CONFIG);
    if !path.exists() {
        return Err(Error::Checkpoint {
            path: run.to_path_buf(),
            message: "not a run folder (no config.toml)".into(),
        });
    }
    let text = ffn_model::files::read_text(&path, ffn_model::files::MAX_CONFIG_FILE)
        .map_err(Error::io(&path))?;
    let config = TrainConfig::from_toml(&text, &[]).map_err(|e| Error::Checkpoint {
        path: path.clone(),
        message: e.to_string(),
    })?;
    Ok((text, config))
}

/// Reads a run folder's config and builds its task and (initial) model on `device`.
pub fn load_run(run: &Path, device: &Device) -> Result<Loaded> {
    let (text, config) = read_config(run)?;
    if let TaskConfig::Text(t) = &config.task {
        Corpus::check(run, &t.path)?;
    }
    let device = &config.train.device(device);
    let ffn = config.ffn()?;
    let task = Task::of_run(&config, &ffn, device, run)?;
    initialise(config, ffn, &text, task, device)
}

/// The initial model of a run whose config file holds `text` (its FFN resolved: `ffn`), on the
/// training device `device`.
pub fn initialise(
    config: TrainConfig,
    ffn: FeedForwardConfig,
    text: &str,
    task: Task,
    device: &Device,
) -> Result<Loaded> {
    let vocab_size = task.vocab().map_or(0, |v| v.len());
    let model = initial_model(&config, &ffn, vocab_size, device)?;
    Ok(Loaded {
        fingerprint: files::fingerprint(text),
        config,
        ffn,
        task,
        model,
        device: device.clone(),
    })
}

/// A run's initial model: every parameter drawn now from the run's init stream (burn draws
/// lazily, at first use), and numbered (see [`crate::model::number_params`]).
fn initial_model(
    config: &TrainConfig,
    ffn: &FeedForwardConfig,
    vocab_size: usize,
    device: &Device,
) -> Result<Model> {
    device.seed(Rng::derive_seed(config.seed, "init", 0));
    let model = crate::model::number_params(Model::new(config, ffn, vocab_size, device)?);
    model.visit(&mut Materialize);
    Ok(model)
}

/// The trained language model of the run in folder `run` and its tokeniser (`vocab.json`),
/// without its task: no text file is read and no Markov source solved. From the checkpoint
/// `only` if given, else the newest good one (with the warnings of [`load_latest_good`]).
pub fn load_language_model(
    run: &Path,
    device: &Device,
    only: Option<&Path>,
) -> Result<(Model, Vocab, Vec<String>)> {
    let (text, config) = read_config(run)?;
    if !matches!(config.task, TaskConfig::Markov(_) | TaskConfig::Text(_)) {
        return Err(Error::Config(
            "this needs a language-model run; this one is a regression".into(),
        ));
    }
    let vocab = crate::data::read_vocab(run)?;
    let device = &config.train.device(device);
    let model = initial_model(&config, &config.ffn()?, vocab.len(), device)?;
    let fingerprint = files::fingerprint(&text);
    let (model, _, _, warnings) = match only {
        Some(chosen) => {
            let (model, state) = load_checkpoint(chosen, &fingerprint, model)?;
            (model, state, chosen.to_path_buf(), Vec::new())
        }
        None => newest_good(run, &fingerprint, model, false)?,
    };
    Ok((model, vocab, warnings))
}

/// A checkpoint folder of `run` named by the user: a path, or a step (`250` for
/// `checkpoints/step-000250`).
pub fn checkpoint_named(run: &Path, name: &str) -> PathBuf {
    match name.parse::<usize>() {
        Ok(step) => checkpoint::folder(run).join(format!("step-{step:06}")),
        Err(_) => PathBuf::from(name),
    }
}

/// One checkpoint, verified and loaded into `model`.
fn load_checkpoint(checkpoint: &Path, fingerprint: &str, model: Model) -> Result<(Model, State)> {
    if !checkpoint.is_dir() {
        return Err(Error::Checkpoint {
            path: checkpoint.to_path_buf(),
            message: "no such checkpoint folder".into(),
        });
    }
    checkpoint::verify(checkpoint)?;
    let state = checkpoint::read_state(checkpoint, fingerprint)?;
    Ok((checkpoint::load_model(checkpoint, model)?, state))
}

/// The run in folder `run` at its newest good checkpoint: config, task and trained model, the
/// checkpoint's state, and its folder (see [`load_latest_good`]).
pub fn load_latest(run: &Path, device: &Device) -> Result<(Loaded, State, PathBuf)> {
    let (loaded, state, latest, _) = load_latest_good(run, device, false)?;
    Ok((loaded, state, latest))
}

/// The run in folder `run` at its newest checkpoint that verifies (checksums) and loads,
/// with a warning for each newer one passed over. With `set_aside` (the caller holds the run's
/// lock) those are renamed `checkpoints/corrupt-step-…`, so they are kept but no longer
/// listed.
pub fn load_latest_good(
    run: &Path,
    device: &Device,
    set_aside: bool,
) -> Result<(Loaded, State, PathBuf, Vec<String>)> {
    let loaded = load_run(run, device)?;
    let (model, state, latest, warnings) =
        newest_good(run, &loaded.fingerprint, loaded.model.clone(), set_aside)?;
    Ok((Loaded { model, ..loaded }, state, latest, warnings))
}

/// The run in folder `run` at the checkpoint folder `checkpoint`, which must verify and load.
pub fn load_at(run: &Path, device: &Device, checkpoint: &Path) -> Result<(Loaded, State)> {
    let loaded = load_run(run, device)?;
    let (model, state) = load_checkpoint(checkpoint, &loaded.fingerprint, loaded.model.clone())?;
    Ok((Loaded { model, ..loaded }, state))
}

/// The newest checkpoint of `run` that verifies and loads into `model`: see
/// [`load_latest_good`].
fn newest_good(
    run: &Path,
    fingerprint: &str,
    model: Model,
    set_aside: bool,
) -> Result<(Model, State, PathBuf, Vec<String>)> {
    let mut warnings = Vec::new();
    let candidates = checkpoint::list(run)?;
    if candidates.is_empty() {
        return Err(Error::Checkpoint {
            path: checkpoint::folder(run),
            message: format!(
                "no checkpoint yet; start the run again with `ffn-train train --run {}` and its \
                 config",
                run.display()
            ),
        });
    }
    let mut passed_over: Vec<(PathBuf, String)> = Vec::new();
    for candidate in candidates.into_iter().rev() {
        let attempt = checkpoint::verify(&candidate)
            .and_then(|()| checkpoint::read_state(&candidate, fingerprint))
            .and_then(|state| {
                let model = checkpoint::load_model(&candidate, model.clone())?;
                Ok((state, model))
            });
        match attempt {
            Ok((state, model)) => {
                // Only once a good one is found are the bad ones set aside: a folder without
                // any intact checkpoint is left as it was.
                for (bad, mut warning) in passed_over {
                    let name = bad.file_name().expect("a checkpoint folder has a name");
                    let aside = bad.with_file_name(format!("corrupt-{}", name.to_string_lossy()));
                    if set_aside && fs::rename(&bad, &aside).is_ok() {
                        warning += &format!(" (kept as {})", aside.display());
                    }
                    warnings.push(warning);
                }
                return Ok((model, state, candidate, warnings));
            }
            Err(e) => {
                let warning = format!("skipping checkpoint {}: {e}", candidate.display());
                passed_over.push((candidate, warning));
            }
        }
    }
    let passed_over: Vec<String> = passed_over.into_iter().map(|(_, w)| w).collect();
    Err(Error::Checkpoint {
        path: checkpoint::folder(run),
        message: format!(
            "no checkpoint of this run is intact: {}",
            passed_over.join("; ")
        ),
    })
}
