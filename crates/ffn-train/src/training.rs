//! # The training loop
//!
//! A lean loop rather than burn-train's `Learner`: the Learner checkpoints per epoch (these
//! tasks are infinite streams), clips each gradient separately (we clip the global norm, as
//! PyTorch's `clip_grad_norm_`), has no notion of a known optimum, and prints a raw debug line
//! per batch when stdout is not a terminal. The loop is:
//!
//! ```text
//! for step in start..steps:
//!     seed burn's device RNG from (seed, step)          # dropout: reproducible, resumable
//!     batch ← task.train_batch(seed, step)              # a function of (seed, step)
//!     L ← model.loss(batch);  stop if L is NaN or ±∞
//!     g ← ∇L;  g ← g · min(1, clip / ‖g‖₂)              # global-norm clipping
//!     θ ← AdamW(θ, g, lr(step))                         # warm-up, then cosine decay
//!     log / evaluate / checkpoint on their schedules
//! ```
//!
//! With every random draw a function of `(seed, step)` and checkpoints holding the model, the
//! optimiser and the partial logging state, a resumed run continues exactly as the
//! uninterrupted run would have on CPU.
//!
//! burn's random number generator (weights, dropout masks) belongs to the device and is shared
//! by every thread of the process: for reproducible runs, train one run at a time per process.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::{Device, Tensor};
use rayon::prelude::*;

use crate::checkpoint::{self, RngState, State};
use crate::config::{ModelConfig, TaskConfig, TrainConfig, TrainSettings};
use crate::data::{Batch, Language, Task, Vocab};
use crate::files;
use crate::interrupt;
use crate::metrics::{self, Metrics, MoeLoad, Progress, Record, Summary, Timing};
use crate::model::{Materialize, Model};
use crate::optim::optimizer;
use crate::rng::Rng;
use crate::run;
use crate::{Error, Result};
use ffn_model::FeedForwardConfig;

/// The learning rate after `step` completed steps: linear warm-up from `lr / warmup` to `lr`
/// over `warmup_steps`, then cosine decay to `min_lr` at the last step.
pub fn learning_rate(t: &TrainSettings, step: usize) -> f64 {
    let warmup = t.warmup_steps.min(t.steps);
    if step < warmup {
        return t.lr * (step + 1) as f64 / warmup as f64;
    }
    let decay_steps = (t.steps - warmup).max(1) as f64;
    let progress = ((step - warmup) as f64 / decay_steps).min(1.0);
    t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + (std::f64::consts::PI * progress).cos())
}

/// `Σ ‖g‖²` over the module's parameters.
struct SquaredNorm<'a> {
    grads: &'a GradientsParams,
    total: Option<Tensor<1>>,
}

impl ModuleVisitor for SquaredNorm<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(g) = self.grads.get::<D>(param.id) {
            let s = g.square().sum();
            self.total = Some(match self.total.take() {
                Some(t) => t + s,
                None => s,
            });
        }
    }
}

/// Multiplies every gradient by a factor.
struct Scale<'a> {
    grads: &'a mut GradientsParams,
    factor: f64,
}

impl ModuleVisitor for Scale<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(g) = self.grads.remove::<D>(param.id) {
            self.grads.register(param.id, g * self.factor);
        }
    }
}

/// Clips the global gradient norm to `max_norm` (no-op for 0); returns the norm before.
pub fn clip_global_norm(model: &Model, grads: &mut GradientsParams, max_norm: f64) -> f64 {
    let mut norm = SquaredNorm { grads, total: None };
    model.visit(&mut norm);
    let norm = norm.total.map_or(0.0, |t| t.into_scalar::<f64>().sqrt());
    if max_norm > 0.0 && norm > max_norm {
        model.visit(&mut Scale {
            grads,
            factor: max_norm / norm,
        });
    }
    norm
}

/// Adds the gradients of `from` into `into`, parameter by parameter.
struct Accumulate<'a> {
    into: &'a mut GradientsParams,
    from: GradientsParams,
}

impl ModuleVisitor for Accumulate<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(g) = self.from.remove::<D>(param.id) {
            let sum = match self.into.remove::<D>(param.id) {
                Some(total) => total + g,
                None => g,
            };
            self.into.register(param.id, sum);
        }
    }
}

/// The same parameters as new autodiff leaves: a shard's copy of the model, whose graph
/// shares no node with another shard's.
struct Leaves;

impl ModuleMapper for Leaves {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let id = param.id;
        let tracked = param.is_require_grad();
        let t = param.val().detach();
        Param::initialized(id, if tracked { t.require_grad() } else { t })
    }
}

/// The shards a batch is cut into on `device` (see [`TrainSettings::shards`]).
pub fn shards(config: &TrainConfig, device: &Device) -> usize {
    match config.train.shards {
        0 if is_cpu(device) => rayon::current_num_threads(),
        0 => 1,
        n => n,
    }
}

/// Whether `device` is one of the CPU backends.
fn is_cpu(device: &Device) -> bool {
    use burn::backend::DispatchDevice;
    match device.clone().without_autodiff().as_dispatch() {
        #[cfg(feature = "flex")]
        DispatchDevice::Flex(_) => true,
        #[cfg(feature = "ndarray")]
        DispatchDevice::NdArray(_) => true,
        #[allow(unreachable_patterns)]
        _ => false,
    }
}

/// Where the dropout masks of a training step come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Masks {
    /// The model has no dropout.
    None,
    /// The FFNs' dropout only: each shard's from its own stream, seeded from this one
    /// ([`ffn_model::dropout::with_seed`]).
    PerShard(u64),
    /// Dropout outside the FFNs too (burn's attention): the device's random stream.
    Device,
}

impl Masks {
    /// The masks of step `step` of a run of `config` with seed `seed`.
    pub fn of(config: &TrainConfig, seed: u64, step: usize) -> Masks {
        let attention =
            matches!(&config.model, ModelConfig::Transformer(m) if m.attention_dropout > 0.0);
        if !config.uses_dropout() {
            Masks::None
        } else if attention {
            Masks::Device
        } else {
            Masks::PerShard(Rng::derive_seed(seed, "ffn-dropout", step as u64))
        }
    }
}

/// The mean loss of `batch` and its gradients, the batch cut into `shards` parts computed at
/// once (data parallelism over the CPU's threads).
///
/// Shard `i` holds `n_i` of the batch's `n` examples; it runs forward and backward on its own
/// copy of the parameters (the same values, new autodiff leaves) and
///
/// ```text
/// L = Σ_i (n_i / n) L_i          ∇L = Σ_i (n_i / n) ∇L_i
/// ```
///
/// which is the batch's mean loss and gradient up to the order of float additions (every loss
/// here is a mean over independent examples). The shards are summed in order, so a run stays
/// reproducible for a given shard count.
///
/// Dropout masks (see [`Masks`]): with [`Masks::PerShard`] and more than one shard, shard `i`
/// draws the FFNs' masks from its own seeded stream, so the shards run at once and a run stays reproducible; with
/// [`Masks::Device`] the shards' forward passes run one after another on this thread, in shard
/// order, so that they draw from the device's one random stream in the same order on every
/// run, and only their backward passes run at once.
pub fn loss_and_gradients(
    model: &Model,
    batch: &Batch,
    shards: usize,
    masks: Masks,
) -> (f64, GradientsParams, Routing) {
    let n = batch.len().max(1) as f64;
    let parts = batch.split(shards);
    // Shard `i`'s forward pass, in its dropout stream: its loss, and the loss it trains on
    // (with the sparse layers' auxiliary losses), both weighted by its share of the batch.
    let forward = |copy: &Model, part: &Batch, i: usize, weight: f64| {
        let (loss, aux) = match masks {
            Masks::PerShard(seed) => {
                let seed = Rng::derive_seed(seed, "shard", i as u64);
                ffn_model::dropout::with_seed(seed, || copy.loss_with_aux(part))
            }
            Masks::None | Masks::Device => copy.loss_with_aux(part),
        };
        let loss = loss * weight;
        let objective = match &aux.loss {
            Some(extra) => loss.clone() + extra.clone() * weight,
            None => loss.clone(),
        };
        (loss, objective, Routing::of(aux, weight))
    };
    let backward = |copy: &Model, (loss, objective, routing): (Tensor<1>, Tensor<1>, Routing)| {
        let value = loss.into_scalar::<f64>();
        (
            value,
            GradientsParams::from_grads(objective.backward(), copy),
            routing,
        )
    };
    if parts.len() == 1 {
        // One shard (a GPU, or `train.shards = 1`): the device's stream, where the masks are
        // drawn on the device.
        return backward(model, forward(model, batch, 0, 1.0));
    }
    let copies: Vec<Model> = parts
        .iter()
        .map(|_| model.clone().map(&mut Leaves))
        .collect();
    let results: Vec<(f64, GradientsParams, Routing)> = if matches!(masks, Masks::Device) {
        let losses: Vec<_> = copies
            .iter()
            .zip(&parts)
            .enumerate()
            .map(|(i, (copy, part))| forward(copy, part, i, part.len() as f64 / n))
            .collect();
        copies
            .into_par_iter()
            .zip(losses)
            .with_max_len(1)
            .map(|(copy, loss)| backward(&copy, loss))
            .collect()
    } else {
        copies
            .into_par_iter()
            .zip(parts.into_par_iter())
            .enumerate()
            .with_max_len(1)
            .map(|(i, (copy, part))| {
                let weight = part.len() as f64 / n;
                backward(&copy, forward(&copy, &part, i, weight))
            })
            .collect()
    };
    let mut results = results.into_iter();
    let (mut loss, mut grads, mut routing) = results.next().expect("at least one shard");
    for (value, from, shard) in results {
        loss += value;
        routing.add(shard);
        model.visit(&mut Accumulate {
            into: &mut grads,
            from,
        });
    }
    (loss, grads, routing)
}

/// How the sparse layers routed one step's batch, in layer order (empty without them).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Routing {
    /// Each layer's token–expert pairs per expert, summed over the shards.
    pub loads: Vec<Vec<usize>>,
    /// Each layer's fraction of pairs dropped by capacity, over the batch.
    pub dropped: Vec<f64>,
}

impl Routing {
    /// A shard's routing, its dropped fractions weighted by its share of the batch.
    fn of(aux: crate::model::Aux, weight: f64) -> Self {
        Self {
            loads: aux.loads,
            dropped: aux.dropped.into_iter().map(|d| d * weight).collect(),
        }
    }

    fn add(&mut self, other: Routing) {
        for (mine, theirs) in self.loads.iter_mut().zip(other.loads) {
            for (a, b) in mine.iter_mut().zip(theirs) {
                *a += b;
            }
        }
        for (a, b) in self.dropped.iter_mut().zip(other.dropped) {
            *a += b;
        }
    }

    /// Over all sparse layers: the largest expert load over the mean load (1 when balanced),
    /// the loads' coefficient of variation (0 when balanced), and the mean dropped fraction;
    /// `None` without sparse layers.
    pub fn summary(&self) -> Option<(f64, f64, f64)> {
        if self.loads.is_empty() {
            return None;
        }
        let (mut max_over_mean, mut cv) = (0f64, 0f64);
        for load in &self.loads {
            let n = load.len().max(1) as f64;
            let mean = load.iter().sum::<usize>() as f64 / n;
            let max = load.iter().copied().max().unwrap_or(0) as f64;
            let var = load.iter().map(|&l| (l as f64 - mean).powi(2)).sum::<f64>() / n;
            if mean > 0.0 {
                max_over_mean = max_over_mean.max(max / mean);
                cv = cv.max(var.sqrt() / mean);
            }
        }
        let dropped = self.dropped.iter().sum::<f64>() / self.dropped.len() as f64;
        Some((max_over_mean, cv, dropped))
    }
}

/// The mean loss of a model over batches (validation mode, no autodiff).
pub fn evaluate(model: &Model, batches: &[Batch]) -> f64 {
    let model = model.valid();
    let total: f64 = batches
        .iter()
        .map(|b| model.loss(b).into_scalar::<f64>())
        .sum();
    total / batches.len() as f64
}

/// A run in progress: everything the loop needs.
pub struct Trainer {
    run: PathBuf,
    config: TrainConfig,
    task: Task,
    device: Device,
    model: Model,
    optim: ModuleOptimizer,
    valid: Vec<Batch>,
    state: State,
    metrics: Metrics,
    last_checkpoint: Option<PathBuf>,
    /// What the user should know (a checkpoint set aside, an approximate optimum).
    warnings: Vec<String>,
    /// Held while the run trains.
    _lock: run::Lock,
}

/// A new run built in memory, before its folder is written.
struct Prepared {
    text: String,
    loaded: Loaded,
    optim: ModuleOptimizer,
}

impl Prepared {
    fn new(mut config: TrainConfig, device: &Device) -> Result<Self> {
        // A text file is stored by its absolute path, so the run resumes from anywhere.
        if let TaskConfig::Text(t) = &mut config.task {
            t.path = fs::canonicalize(&t.path).map_err(Error::io(&t.path))?;
        }
        config.check_memory(config.train.eval_batches)?;
        let device = &config.train.device(device);
        let ffn = config.ffn()?;
        let task = Task::new(&config, &ffn, device)?;
        let text = config.to_toml();
        // What `resume` will read back is exactly this config.
        debug_assert_eq!(
            TrainConfig::from_toml(&text, &[]).ok().as_ref(),
            Some(&config)
        );
        let optim = optimizer(&config.train, device);
        let loaded = initialise(config, ffn, &text, task, device)?;
        Ok(Self {
            text,
            loaded,
            optim,
        })
    }

    /// Writes the run's files into its claimed folder and builds the trainer; on failure a
    /// folder this process created is removed again.
    fn write(self, folder: &Path, lock: run::Lock, created: bool) -> Result<Trainer> {
        let Prepared {
            text,
            loaded,
            optim,
        } = self;
        let written = (|| {
            files::write_atomically(&folder.join(run::CONFIG), text.as_bytes())?;
            files::write_atomically(&folder.join(run::FFN), loaded.ffn.to_toml().as_bytes())?;
            if let Some(vocab) = loaded.task.vocab() {
                let json = serde_json::to_string(&vocab).expect("vocab serialises");
                files::write_atomically(&folder.join(run::VOCAB), json.as_bytes())?;
            }
            if let Task::Language {
                source: Language::Markov(m),
                ..
            } = &loaded.task
            {
                m.write_cache(&folder.join(run::MARKOV))?;
            }
            if let TaskConfig::Text(t) = &loaded.config.task {
                let corpus = Corpus::of(&t.path)?;
                let json = serde_json::to_string_pretty(&corpus).expect("corpus serialises");
                files::write_atomically(&folder.join(run::CORPUS), json.as_bytes())?;
            }
            Ok(())
        })();
        let trainer = written.and_then(|()| {
            let seed = loaded.config.seed;
            let state = State {
                step: 0,
                rng: RngState { seed, next_step: 0 },
                pending_loss: (0.0, 0),
                best_valid: None,
                tokens: 0,
                config_fingerprint: loaded.fingerprint.clone(),
            };
            let mut trainer = Trainer::assemble(folder, loaded, optim, state, None, lock)?;
            trainer.warnings.extend(trainer.task.warning());
            Ok(trainer)
        });
        if trainer.is_err() && created {
            let _ = fs::remove_dir_all(folder);
        }
        trainer
    }
}

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
fn initialise(
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

impl Trainer {
    /// Starts a new run in the folder `run`, which may not exist, be empty, or hold a run that
    /// never reached its first checkpoint (which is then started again; see [`run::claim`]).
    /// Everything is built and checked before the folder is touched: a config that fails
    /// leaves no folder behind.
    pub fn start(config: TrainConfig, run: &Path, device: &Device) -> Result<Self> {
        let prepared = Prepared::new(config, device)?;
        let (lock, created) = run::claim(run)?;
        prepared.write(run, lock, created)
    }

    /// [`start`](Self::start) in the first free folder of `base`, `base-2`, `base-3`, … (two
    /// processes starting at once get different folders).
    pub fn start_numbered(config: TrainConfig, base: &Path, device: &Device) -> Result<Self> {
        let prepared = Prepared::new(config, device)?;
        let (run, lock) = run::claim_numbered(base)?;
        prepared.write(&run, lock, true)
    }

    /// Continues the run in folder `run` from its newest good checkpoint (a corrupt or
    /// incomplete newer one is set aside as `checkpoints/corrupt-step-…`, with a warning).
    pub fn resume(run: &Path, device: &Device) -> Result<Self> {
        let lock = run::lock(run)?;
        let (loaded, state, latest, warnings) = load_latest_good(run, device, true)?;
        loaded
            .config
            .check_memory(loaded.config.train.eval_batches)?;
        let optim = optimizer(&loaded.config.train, &loaded.device);
        let optim = checkpoint::load_optim(&latest, optim)?;
        let mut trainer = Self::assemble(run, loaded, optim, state, Some(latest), lock)?;
        trainer.warnings = warnings;
        trainer.warnings.extend(trainer.task.warning());
        Ok(trainer)
    }

    fn assemble(
        run: &Path,
        loaded: Loaded,
        optim: ModuleOptimizer,
        state: State,
        last_checkpoint: Option<PathBuf>,
        lock: run::Lock,
    ) -> Result<Self> {
        let t = &loaded.config.train;
        let eval_device = loaded.device.clone().inner();
        let valid = loaded.task.valid_batches(
            loaded.config.seed,
            t.eval_batches,
            t.batch_size,
            &eval_device,
        );
        Ok(Self {
            metrics: Metrics::open(run, state.step)?,
            run: run.to_path_buf(),
            config: loaded.config,
            task: loaded.task,
            device: loaded.device,
            model: loaded.model,
            optim,
            valid,
            state,
            last_checkpoint,
            warnings: Vec::new(),
            _lock: lock,
        })
    }

    /// Steps completed.
    pub fn step(&self) -> usize {
        self.state.step
    }

    /// The run's config.
    pub fn config(&self) -> &TrainConfig {
        &self.config
    }

    /// The best achievable loss, when known.
    pub fn optimal_loss(&self) -> Option<f64> {
        self.task.optimal_loss()
    }

    /// What the user should know before training: a checkpoint passed over on resuming, an
    /// approximate optimum (see [`Task::warning`]).
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// Trains to the configured number of steps, then writes the summary and the plot.
    pub fn run(mut self, progress: &Progress) -> Result<Summary> {
        let seed = self.config.seed;
        let t = self.config.train.clone();
        let optimum = self.task.optimal_loss();
        let tokens_per_step = self.task.tokens_per_batch(t.batch_size);
        let shards = shards(&self.config, &self.device);
        let clock = Instant::now();
        let elapsed_before = self.metrics.elapsed_s();
        let elapsed = |clock: &Instant| elapsed_before + clock.elapsed().as_secs_f64();
        let mut interval = (Instant::now(), 0usize); // training time and tokens since last log
        let mut last_train: Option<f64> = None;
        let mut last_valid: Option<f64> = None;
        let gap_text =
            |loss: f64| optimum.map_or(String::new(), |o| format!(" | gap {:+.4}", loss - o));

        while self.state.step < t.steps {
            let step = self.state.step;
            self.device
                .seed(Rng::derive_seed(seed, "dropout", step as u64));
            let batch = self
                .task
                .train_batch(seed, step, t.batch_size, &self.device);
            let masks = Masks::of(&self.config, seed, step);
            let (value, mut grads, routing) =
                loss_and_gradients(&self.model, &batch, shards, masks);
            if !value.is_finite() {
                progress.finish();
                return Err(Error::Diverged {
                    step: step + 1,
                    loss: value,
                    last_good: self.last_checkpoint.clone(),
                });
            }
            clip_global_norm(&self.model, &mut grads, t.grad_clip);
            let lr = learning_rate(&t, step);
            self.model = self.optim.step(lr, self.model.clone(), grads);
            if !routing.loads.is_empty() {
                self.model = self.model.clone().update_selection_bias(&routing.loads);
            }

            self.state.step += 1;
            self.state.rng.next_step = self.state.step;
            self.state.tokens += tokens_per_step as u64;
            self.state.pending_loss.0 += value;
            self.state.pending_loss.1 += 1;
            interval.1 += tokens_per_step;
            let done = self.state.step;
            let last = done == t.steps;

            if done.is_multiple_of(t.log_every) || last {
                let (sum, count) = std::mem::take(&mut self.state.pending_loss);
                let mean = sum / count as f64;
                let seconds = interval.0.elapsed().as_secs_f64().max(1e-9);
                self.metrics.write(&Record {
                    step: done,
                    kind: "train".into(),
                    loss: mean,
                    gap: optimum.map(|o| mean - o),
                    lr: Some(lr),
                    moe: routing.summary().map(|(max, cv, dropped)| MoeLoad {
                        load_max_over_mean: max,
                        load_cv: cv,
                        dropped_fraction: dropped,
                    }),
                })?;
                self.metrics.time(&Timing {
                    step: done,
                    event: "train".into(),
                    tokens_per_s: Some(interval.1 as f64 / seconds),
                    elapsed_s: elapsed(&clock),
                })?;
                last_train = Some(mean);
                interval = (Instant::now(), 0);
            }
            let evaluating = done.is_multiple_of(t.eval_every) || last;
            if evaluating {
                let valid = evaluate(&self.model, &self.valid);
                self.metrics.write(&Record {
                    step: done,
                    kind: "valid".into(),
                    loss: valid,
                    gap: optimum.map(|o| valid - o),
                    lr: None,
                    moe: None,
                })?;
                self.metrics.time(&Timing {
                    step: done,
                    event: "valid".into(),
                    tokens_per_s: None,
                    elapsed_s: elapsed(&clock),
                })?;
                if self.state.best_valid.is_none_or(|(best, _)| valid < best) {
                    self.state.best_valid = Some((valid, done));
                }
                last_valid = Some(valid);
                interval.0 = Instant::now(); // evaluation time is not training throughput
            }
            let stopping = interrupt::stop_requested() && !last;
            if done.is_multiple_of(t.checkpoint_every) || last || stopping {
                self.metrics.time(&Timing {
                    step: done,
                    event: "checkpoint".into(),
                    tokens_per_s: None,
                    elapsed_s: elapsed(&clock),
                })?;
                let path = checkpoint::save(
                    &self.run,
                    &self.model,
                    &self.optim,
                    &self.state,
                    t.keep_checkpoints,
                )?;
                self.last_checkpoint = Some(path.clone());
                if stopping {
                    progress.finish();
                    return Err(Error::Interrupted {
                        step: done,
                        checkpoint: path,
                        run: self.run.clone(),
                    });
                }
            }

            let tokens_per_s = self.state.tokens as f64 / elapsed(&clock).max(1e-9);
            let eta = elapsed(&clock) / done as f64 * (t.steps - done) as f64;
            let message = format!(
                "step {done}/{} | train {} | valid {}{} | {:.1}k tok/s | eta {}",
                t.steps,
                last_train.map_or("-".into(), |l| format!("{l:.4}")),
                last_valid.map_or("-".into(), |l| format!("{l:.4}")),
                last_valid.map_or(String::new(), gap_text),
                tokens_per_s / 1e3,
                metrics::duration(eta),
            );
            progress.update(done, &message, evaluating);
        }
        progress.finish();
        self.finish(elapsed(&clock))
    }

    /// Writes `summary.json` and `loss.svg` from the metrics and the final state.
    fn finish(&self, elapsed_s: f64) -> Result<Summary> {
        let records = metrics::read_records(&self.run.join(run::METRICS_JSONL))?;
        let timings = metrics::read_timings(&self.run.join(run::TIMING))?;
        let optimum = self.task.optimal_loss();
        let last = |kind: &str| {
            records
                .iter()
                .rev()
                .find(|r| r.kind == kind)
                .map(|r| r.loss)
        };
        let train_rates: Vec<f64> = timings.iter().filter_map(|t| t.tokens_per_s).collect();
        let best = self.state.best_valid;
        let ffn_params = self.ffn_params();
        let summary = Summary {
            status: "completed".into(),
            steps: self.state.step,
            final_train_loss: last("train"),
            final_valid_loss: last("valid"),
            best_valid_loss: best.map(|b| b.0),
            best_valid_step: best.map(|b| b.1),
            optimal_loss: optimum,
            final_gap: last("valid").zip(optimum).map(|(l, o)| l - o),
            best_gap: best.zip(optimum).map(|(b, o)| b.0 - o),
            tokens_per_s: if train_rates.is_empty() {
                0.0
            } else {
                train_rates.iter().sum::<f64>() / train_rates.len() as f64
            },
            wall_time_s: elapsed_s,
            params: self.model.num_params(),
            ffn_params,
            device: crate::backend::describe(&self.device),
            kernels: crate::backend::kernels(&self.device),
        };
        metrics::write_summary(&self.run, &summary)?;
        let title = format!(
            "{}: {}",
            self.run
                .file_name()
                .map_or("run".into(), |n| n.to_string_lossy()),
            describe(&self.config)
        );
        let points: Vec<_> = records.iter().map(Record::point).collect();
        let svg = crate::plot::svg(&title, &points, optimum);
        files::write_atomically(&self.run.join(run::PLOT), svg.as_bytes())?;
        if optimum.is_some() {
            let svg = crate::plot::gap_svg(&title, &points);
            files::write_atomically(&self.run.join(run::GAP_PLOT), svg.as_bytes())?;
        }
        if let Some(svg) = crate::plot::load_svg(&title, &points) {
            files::write_atomically(&self.run.join(run::LOAD_PLOT), svg.as_bytes())?;
        }
        Ok(summary)
    }

    fn ffn_params(&self) -> usize {
        // A sparse layer counts every expert, the router and the shared experts.
        self.config.ffn_params().map_or(0, |(total, _)| total)
    }

    /// The run folder.
    pub fn folder(&self) -> &Path {
        &self.run
    }
}

/// A short description of a run's model and task, for titles and logs.
pub fn describe(config: &TrainConfig) -> String {
    let ffn = config
        .ffn()
        .map(|f| {
            let variant = ffn_model::Variant::ALL
                .into_iter()
                .find(|v| v.activation() == f.activation && v.gated() == f.gated);
            let name = variant.map_or_else(
                || format!("{}{}", f.activation, if f.gated { " gated" } else { "" }),
                |v| v.name().to_string(),
            );
            format!("{name} d_ff {}", f.d_ff)
        })
        .unwrap_or_default();
    let task = match &config.task {
        TaskConfig::Markov(m) => format!("Markov V={} k={}", m.vocab_size, m.order),
        TaskConfig::Text(t) => format!(
            "text {}",
            t.path
                .file_name()
                .map_or("".into(), |n| n.to_string_lossy())
        ),
        TaskConfig::Teacher(t) => format!("teacher σ={}", t.noise),
        TaskConfig::Sine(s) => format!("sine σ={}", s.noise),
    };
    let model = match &config.model {
        crate::config::ModelConfig::Transformer(m) => {
            format!("transformer {}×d{}", m.n_layers, m.d_model)
        }
        crate::config::ModelConfig::Window(m) => format!("window-{} d{}", m.window, m.d_model),
        crate::config::ModelConfig::Ffn(m) => format!("FFN d{}", m.d_model),
    };
    format!("{model}, {ffn}, {task}")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Σ_params Σ |g|` and `Σ_params Σ g²` of a model's gradients.
    struct Summary<'a>(&'a GradientsParams, Vec<(f64, f64)>);

    impl ModuleVisitor for Summary<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let g = self
                .0
                .get::<D>(param.id)
                .expect("every parameter has a gradient");
            let abs = g.clone().abs().sum().into_scalar::<f64>();
            let square = g.square().sum().into_scalar::<f64>();
            self.1.push((abs, square));
        }
    }

    /// Cut into 1, 2, 3 or 7 shards (7 does not divide the batch of 10), a batch gives the same
    /// mean loss and the same gradient of every parameter, to f32 rounding: the shards are
    /// weighted by their sizes. Both language models, and the regression FFN.
    #[test]
    fn sharded_batches_give_the_batch_loss_and_gradients() {
        for (model, task) in [
            (
                "kind = \"transformer\"\nd_model = 16\nn_heads = 2",
                "kind = \"markov\"\nvocab_size = 5\nseq_len = 6",
            ),
            (
                "kind = \"window\"\nd_model = 16\nwindow = 3",
                "kind = \"markov\"\nvocab_size = 5\nseq_len = 6",
            ),
            ("kind = \"ffn\"\nd_model = 8", "kind = \"teacher\""),
        ] {
            let text = format!(
                "[task]\n{task}\n[model]\n{model}\nffn = {{ preset = \"SwiGLU\" }}\n[train]\nbatch_size = 10\n"
            );
            let config = TrainConfig::from_toml(&text, &[]).unwrap();
            let device = Device::flex().autodiff();
            let ffn = config.ffn().unwrap();
            let task = Task::new(&config, &ffn, &device).unwrap();
            device.seed(5);
            let vocab_size = task.vocab().map_or(0, |v| v.len());
            let model = Model::new(&config, &ffn, vocab_size, &device).unwrap();
            model.visit(&mut Materialize);
            let batch = task.train_batch(1, 0, 10, &device);
            assert_eq!(
                batch.split(3).iter().map(Batch::len).collect::<Vec<_>>(),
                [3, 3, 4]
            );
            let summary = |shards: usize, masks: Masks| {
                let (loss, grads, _) = loss_and_gradients(&model, &batch, shards, masks);
                let mut s = Summary(&grads, Vec::new());
                model.visit(&mut s);
                (loss, s.1)
            };
            let (loss, grads) = summary(1, Masks::None);
            for (shards, masks) in [
                (2, Masks::None),
                (3, Masks::None),
                (7, Masks::None),
                (2, Masks::Device),
                (7, Masks::Device),
                (3, Masks::PerShard(9)),
            ] {
                let (l, g) = summary(shards, masks);
                assert!(
                    (l - loss).abs() <= 1e-6 * loss.abs(),
                    "{model}, {shards}: {l} vs {loss}"
                );
                assert_eq!(g.len(), grads.len());
                for ((a, s), (a1, s1)) in g.iter().zip(&grads) {
                    assert!(
                        (a - a1).abs() <= 1e-4 * a1.abs().max(1e-3),
                        "{model}: {a} vs {a1}"
                    );
                    assert!(
                        (s - s1).abs() <= 1e-4 * s1.abs().max(1e-6),
                        "{model}: {s} vs {s1}"
                    );
                }
            }
        }
    }

    #[test]
    fn schedule_warms_up_then_decays_to_min_lr() {
        let t = TrainSettings {
            steps: 100,
            warmup_steps: 10,
            lr: 1.0,
            min_lr: 0.1,
            ..TrainSettings::default()
        };
        assert!((learning_rate(&t, 0) - 0.1).abs() < 1e-12);
        assert!((learning_rate(&t, 9) - 1.0).abs() < 1e-12);
        assert!((learning_rate(&t, 10) - 1.0).abs() < 1e-12);
        assert!((learning_rate(&t, 55) - 0.55).abs() < 1e-12);
        assert!((learning_rate(&t, 100) - 0.1).abs() < 1e-12);
        for s in 10..99 {
            assert!(learning_rate(&t, s + 1) <= learning_rate(&t, s));
        }
    }
}
