//! `ffn-train`: train, resume, evaluate and sample FFN models from the command line.
//!
//! Errors print as one line, `error: …`, and exit with status 1 (2 for a bad command line, 3
//! for a run whose loss diverged, 130 for a run stopped by SIGINT/SIGTERM).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use ffn_train::config::{TaskConfig, TextConfig, TextLevel};
use ffn_train::inference::{self, SampleOptions};
use ffn_train::metrics::{self, Progress, RunSummary};
use ffn_train::training::describe;
use ffn_train::{
    DEFAULT_CONFIG, EXIT_DIVERGED, EXIT_INTERRUPTED, Result, TrainConfig, Trainer, backend,
};

#[derive(Parser)]
#[command(
    name = "ffn-train",
    version,
    about = "Train transformer feed-forward networks on tasks with a known optimum",
    after_help = "Exit status: 0 done; 1 error (one `error:` line); 2 bad command line; \
                  3 the loss diverged (NaN or infinite; the checkpoints before are kept); \
                  130 stopped by SIGINT/SIGTERM after writing a checkpoint."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The backend device of a command.
#[derive(clap::Args)]
struct DeviceArg {
    /// Backend device (default: the first of this build's).
    #[arg(
        long,
        env = ffn_train::backend::DEVICE_VARIABLE,
        value_parser = clap::builder::PossibleValuesParser::new(ffn_train::backend::DEVICES)
    )]
    device: Option<String>,
}

impl DeviceArg {
    fn device(&self) -> Result<burn::tensor::Device> {
        backend::device(self.device.as_deref())
    }
}

#[derive(Subcommand)]
enum Command {
    /// Start a run.
    Train {
        /// The run's TOML config (default: the built-in configs/default.toml).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Override a config key, e.g. --set train.steps=500 (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// The run's seed (shortcut for --set seed=N).
        #[arg(long)]
        seed: Option<u64>,
        /// Training steps (shortcut for --set train.steps=N).
        #[arg(long)]
        steps: Option<usize>,
        /// Train a language model on this text file instead of the config's task.
        #[arg(long)]
        text: Option<PathBuf>,
        /// Tokenisation of --text.
        #[arg(long, value_enum, default_value_t = TextLevel::Byte, requires = "text")]
        level: TextLevel,
        /// The run folder (default: runs/<config name>, numbered if taken).
        #[arg(long)]
        run: Option<PathBuf>,
        /// Print the resolved config and its memory estimate, and write nothing.
        #[arg(long)]
        dry_run: bool,
        #[command(flatten)]
        device: DeviceArg,
    },
    /// Continue a run from its newest good checkpoint.
    Resume {
        /// The run folder.
        run: PathBuf,
        #[command(flatten)]
        device: DeviceArg,
    },
    /// Evaluate a checkpoint of a run (default: the newest good one) on its validation data.
    Eval {
        /// The run folder.
        run: PathBuf,
        /// Validation batches.
        #[arg(long, default_value_t = 16)]
        batches: usize,
        /// The checkpoint: a step (250) or a checkpoint folder.
        #[arg(long)]
        checkpoint: Option<String>,
        /// Print the result as one JSON object.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        device: DeviceArg,
    },
    /// Train a grid of runs (tasks × variants × seeds × learning rates) and compare the
    /// variants' gaps to the optimum with 95% intervals and paired tests (see
    /// configs/sweeps/). Writes results.jsonl, summary.json, report.md, gaps.svg and
    /// curves.svg in the output folder; run it again to continue a sweep that stopped.
    Sweep {
        /// The sweep's TOML config.
        #[arg(long)]
        config: PathBuf,
        /// The output folder (default: runs/<config name>).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Cells trained at a time, each in a process of its own.
        #[arg(long, default_value_t = 1)]
        jobs: usize,
        /// Threads of each cell (default: the machine's cores divided by --jobs).
        #[arg(long)]
        threads: Option<usize>,
        /// Print the cells and write nothing.
        #[arg(long)]
        dry_run: bool,
        #[command(flatten)]
        device: DeviceArg,
    },
    /// Show the tensors of a safetensors file or Hugging Face model folder, the FFNs in it, their
    /// naming scheme and the FeedForwardConfig each would load with.
    Inspect {
        /// A .safetensors file, or a folder with config.json.
        path: PathBuf,
        /// List every tensor (default: the first 40).
        #[arg(long)]
        all: bool,
    },
    /// Generate text with a checkpoint of a language-model run (default: the newest good one).
    Sample {
        /// The run folder.
        run: PathBuf,
        /// Text to continue.
        #[arg(long, default_value = "")]
        prompt: String,
        /// Tokens to generate.
        #[arg(long, default_value_t = 200)]
        tokens: usize,
        /// Softmax temperature (0: always the most likely token).
        #[arg(long, default_value_t = 1.0)]
        temperature: f64,
        /// Sample among the k most likely tokens only.
        #[arg(long)]
        top_k: Option<usize>,
        /// Seed of the sampling.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// The checkpoint: a step (250) or a checkpoint folder.
        #[arg(long)]
        checkpoint: Option<String>,
        #[command(flatten)]
        device: DeviceArg,
    },
}

/// The most characters of an error line (a 10 MB string in a config is not echoed whole).
const MAX_ERROR_CHARS: usize = 2000;

#[cfg(unix)]
extern "C" fn on_stop_signal(_: libc::c_int) {
    if ffn_train::interrupt::stop_requested() {
        // A second signal: stop now (the newest checkpoint is complete, as always).
        // SAFETY: _exit is async-signal-safe.
        unsafe { libc::_exit(i32::from(EXIT_INTERRUPTED)) }
    }
    ffn_train::interrupt::request_stop();
}

fn main() -> ExitCode {
    #[cfg(unix)]
    // SAFETY: setting signal dispositions before any thread is started; the handler only
    // stores an atomic flag (or calls _exit).
    unsafe {
        // Like other command-line tools, end quietly when the reader of stdout goes away
        // (`ffn-train inspect … | head`) instead of panicking on the failed write.
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        // A file-size limit (ulimit -f) then gives a clean write error, not a silent death.
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
    // Freed buffers stay mapped: no page faults every step (see the function).
    ffn_model::keep_freed_memory();
    let cli = Cli::parse();
    // A panic (a bug, or a check that is missing) still ends in one `error:` line and status 1.
    if std::env::var_os("RUST_BACKTRACE").is_none() {
        std::panic::set_hook(Box::new(|_| {}));
    }
    let result = std::panic::catch_unwind(|| run(cli)).unwrap_or_else(|payload| {
        let what = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("a panic");
        Err(ffn_train::Error::Config(format!(
            "internal error: {what} (a bug: please report it with the command that caused it)"
        )))
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            // One line, whatever the message: control characters escaped, length bounded.
            let message = err.to_string();
            let message: Vec<&str> = message
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect();
            let line = ffn_model::printable(&message.join(" "), MAX_ERROR_CHARS);
            eprintln!("error: {line}");
            match err {
                ffn_train::Error::Interrupted { .. }
                | ffn_train::Error::SweepInterrupted { .. } => ExitCode::from(EXIT_INTERRUPTED),
                ffn_train::Error::Diverged { .. } => ExitCode::from(EXIT_DIVERGED),
                _ => ExitCode::FAILURE,
            }
        }
    }
}

/// SIGINT and SIGTERM stop training cleanly: the step ends, a checkpoint is written, and the
/// command exits with status 130 (a second signal exits at once).
fn stop_cleanly_on_signals() {
    #[cfg(unix)]
    // SAFETY: the handler only stores an atomic flag or calls _exit, both async-signal-safe.
    unsafe {
        let handler = on_stop_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
    }
}

fn run(cli: Cli) -> Result<()> {
    if matches!(
        cli.command,
        Command::Train { .. } | Command::Resume { .. } | Command::Sweep { .. }
    ) {
        stop_cleanly_on_signals();
    }
    match cli.command {
        Command::Train {
            config,
            mut set,
            seed,
            steps,
            text,
            level,
            run,
            dry_run,
            device,
        } => {
            // The shortcuts come first: an explicit --set of the same key wins.
            if let Some(steps) = steps {
                set.insert(0, format!("train.steps={steps}"));
            }
            if let Some(seed) = seed {
                set.insert(0, format!("seed={seed}"));
            }
            let task = text.as_ref().map(|path| {
                TaskConfig::Text(TextConfig {
                    path: path.clone(),
                    level,
                    ..TextConfig::default()
                })
            });
            let (config, name) = match &config {
                Some(path) => (
                    TrainConfig::load_with(path, task, &set)?,
                    path.file_stem()
                        .map_or("run".into(), |s| s.to_string_lossy().into_owned()),
                ),
                None => (
                    TrainConfig::from_toml_with(DEFAULT_CONFIG, task, &set)?,
                    "default".to_string(),
                ),
            };
            if dry_run {
                print!("{}", config.to_toml());
                println!(
                    "# memory estimate: {} (training and {} validation batches)",
                    ffn_train::config::memory::bytes(config.memory_estimate()),
                    config.train.eval_batches
                );
                return Ok(());
            }
            let name = if text.is_some() {
                format!("{name}-text")
            } else {
                name
            };
            let device = device.device()?;
            // `runs/<name>`, or `runs/<name>-2`, `-3`, … if taken.
            let trainer = match &run {
                Some(folder) => Trainer::start(config, folder, &device)?,
                None => Trainer::start_numbered(config, &Path::new("runs").join(name), &device)?,
            };
            announce(&trainer, &device, "training");
            let folder = trainer.folder().to_path_buf();
            let progress = Progress::auto(trainer.config().train.steps);
            report(&folder, trainer.run(&progress)?)
        }
        Command::Resume { run, device } => {
            let device = device.device()?;
            let trainer = Trainer::resume(&run, &device)?;
            announce(
                &trainer,
                &device,
                &format!("resuming at step {}", trainer.step()),
            );
            let progress = Progress::auto(trainer.config().train.steps);
            report(&run, trainer.run(&progress)?)
        }
        Command::Eval {
            run,
            batches,
            checkpoint,
            json,
            device,
        } => {
            let device = device.device()?;
            let checkpoint = checkpoint.map(|c| ffn_train::run::checkpoint_named(&run, &c));
            let e = inference::evaluate_run(&run, &device, batches, checkpoint.as_deref())?;
            for warning in &e.warnings {
                eprintln!("warning: {warning}");
            }
            if json {
                println!(
                    "{}",
                    serde_json::to_string(&e).expect("an evaluation serialises")
                );
                return Ok(());
            }
            print!(
                "{}: step {}, validation loss {:.4} over {batches} batches",
                e.checkpoint.display(),
                e.step,
                e.loss
            );
            match e.optimal_loss {
                Some(o) => println!(", optimum {o:.4}, gap {:+.4}", e.loss - o),
                None => println!(),
            }
            Ok(())
        }
        Command::Inspect { path, all } => {
            ffn_train::inspect::inspect(&path, all, &mut std::io::stdout().lock())
        }
        Command::Sweep {
            config,
            out,
            jobs,
            threads,
            dry_run,
            device,
        } => sweep(&config, out.as_deref(), jobs, threads, dry_run, device),
        Command::Sample {
            run,
            prompt,
            tokens,
            temperature,
            top_k,
            seed,
            checkpoint,
            device,
        } => {
            let device = device.device()?;
            let options = SampleOptions {
                prompt: prompt.clone(),
                tokens,
                temperature,
                top_k,
                seed,
                checkpoint: checkpoint.map(|c| ffn_train::run::checkpoint_named(&run, &c)),
            };
            use std::io::Write;
            let mut stdout = std::io::stdout().lock();
            let mut written = Ok(());
            let mut started = false;
            let warnings = inference::sample(&run, &device, &options, |text| {
                if !started {
                    started = true;
                    written = write!(stdout, "{prompt}");
                }
                if written.is_ok() {
                    written = write!(stdout, "{text}").and_then(|()| stdout.flush());
                }
            })?;
            if !started {
                written = write!(stdout, "{prompt}");
            }
            written
                .and_then(|()| writeln!(stdout))
                .map_err(|e| ffn_train::Error::Io {
                    path: "<stdout>".into(),
                    source: e,
                })?;
            for warning in warnings {
                eprintln!("warning: {warning}");
            }
            Ok(())
        }
    }
}

fn sweep(
    config: &Path,
    out: Option<&Path>,
    jobs: usize,
    threads: Option<usize>,
    dry_run: bool,
    device: DeviceArg,
) -> Result<()> {
    let sweep = ffn_train::sweep::Sweep::load(config, out)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let options = ffn_train::sweep::Options {
        program: std::env::current_exe().map_err(|e| ffn_train::Error::Io {
            path: "<this program>".into(),
            source: e,
        })?,
        jobs,
        threads: threads.unwrap_or((cores / jobs.max(1)).max(1)),
        device: device.device,
    };
    let done = sweep.finished()?.iter().filter(|r| r.is_some()).count();
    let steps: usize = sweep.cells.iter().map(|c| c.config.train.steps).sum();
    println!(
        "sweep {}: {} tasks × {} variants × {} seeds, {} cells ({} done), {} steps in all | {} at a time, {} threads each | {}",
        sweep.name,
        sweep.config.tasks.len(),
        sweep.config.variants.len(),
        sweep.config.seeds.len(),
        sweep.cells.len(),
        done,
        steps,
        options.jobs,
        options.threads,
        sweep.folder.display()
    );
    if dry_run {
        for cell in &sweep.cells {
            println!("  {}", cell.id());
        }
        return Ok(());
    }
    let progress = Progress::auto(steps);
    let summary = sweep.run(&options, &progress)?;
    print!("{}", ffn_train::sweep::report(&summary));
    println!(
        "wrote {0}/results.jsonl, {0}/summary.json, {0}/report.md, {0}/gaps.svg, {0}/curves.svg",
        sweep.folder.display()
    );
    Ok(())
}

fn announce(trainer: &Trainer, device: &burn::tensor::Device, what: &str) {
    for warning in trainer.warnings() {
        eprintln!("warning: {warning}");
    }
    let config = trainer.config();
    println!("{what}: {}", describe(config));
    println!(
        "run folder {} | device {} | {} steps of {} | optimum {}",
        trainer.folder().display(),
        backend::describe(device),
        config.train.steps,
        config.train.batch_size,
        trainer
            .optimal_loss()
            .map_or("unknown".into(), |o| format!("{o:.4}")),
    );
    println!("matrix products: {}", backend::kernels(device));
}

fn report(run: &Path, s: RunSummary) -> Result<()> {
    let fmt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.4}"));
    println!(
        "done: {} steps in {} | train {} | valid {} (best {} at step {}) | optimum {} | gap {} | {:.0} tokens/s",
        s.steps,
        metrics::duration(s.wall_time_s),
        fmt(s.final_train_loss),
        fmt(s.final_valid_loss),
        fmt(s.best_valid_loss),
        s.best_valid_step.map_or("-".into(), |v| v.to_string()),
        fmt(s.optimal_loss),
        s.final_gap.map_or("-".to_string(), |g| format!("{g:+.4}")),
        s.tokens_per_s,
    );
    println!(
        "wrote {0}/summary.json, {0}/metrics.jsonl, {0}/metrics.csv, {0}/timing.jsonl, {0}/loss.svg{1}{2}, {0}/checkpoints/",
        run.display(),
        if s.optimal_loss.is_some() {
            format!(", {}/gap.svg", run.display())
        } else {
            String::new()
        },
        if run.join(ffn_train::run::LOAD_PLOT).exists() {
            format!(", {}/load.svg", run.display())
        } else {
            String::new()
        }
    );
    Ok(())
}
