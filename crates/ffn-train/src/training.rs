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

use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::tensor::Device;

use crate::checkpoint::{self, RngState, State};
use crate::config::{TaskConfig, TrainConfig};
use crate::data::{Batch, Language, Task};
use crate::error::{Error, Result};
use crate::files;
use crate::interrupt;
use crate::metrics::{self, Metrics, MoeLoad, Progress, Record, RunSummary, Timing};
use crate::model::{Model, evaluate};
use crate::optim::optimizer;
use crate::optim::{clip_global_norm, learning_rate};
use crate::rng::Rng;
use crate::run::{self, Corpus, Loaded, initialise, load_latest_good};
use crate::shards::{Masks, loss_and_gradients, shards};

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
    pub fn run(mut self, progress: &Progress) -> Result<RunSummary> {
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
    fn finish(&self, elapsed_s: f64) -> Result<RunSummary> {
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
        let summary = RunSummary {
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
    use burn::module::{ModuleVisitor, Param};
    use burn::optim::GradientsParams;
    use burn::tensor::Tensor;

    use super::*;
    use crate::config::TrainSettings;
    use crate::model::Materialize;

    /// `Σ_params Σ |g|` and `Σ_params Σ g²` of a model's gradients.
    struct RunSummary<'a>(&'a GradientsParams, Vec<(f64, f64)>);

    impl ModuleVisitor for RunSummary<'_> {
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
                let mut s = RunSummary(&grads, Vec::new());
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
