//! # Metrics, progress and the run summary
//!
//! Every logged value goes to `metrics.jsonl` (one JSON object a line) and `metrics.csv`, each
//! line flushed as it is written. They hold only what the run computes, a function of its
//! config and seed: a run resumed after any number of kills writes the same bytes as a run in
//! one go. The wall clock (tokens/s, elapsed time) goes to `timing.jsonl` beside them.
//!
//! On a terminal a live bar shows step, losses, gap to the optimum, tokens/s and ETA; otherwise
//! (a pipe, a log file, CI) plain lines are printed at each evaluation.

use std::fs::{self, File, OpenOptions};
#[cfg(feature = "cli")]
use std::io::IsTerminal;
use std::io::Write;
use std::path::{Path, PathBuf};

#[cfg(feature = "cli")]
use indicatif::{ProgressBar, ProgressStyle};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// One logged value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// Steps completed.
    pub step: usize,
    /// `train` (mean over the logging interval) or `valid` (the validation set).
    pub kind: String,
    /// The loss: nats per token, or squared error per output.
    pub loss: f64,
    /// `loss − optimum`, when the optimum is known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gap: Option<f64>,
    /// The learning rate of the step (training records).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    /// How the sparse layers routed the logged step's batch (training records of a model with
    /// `model.ffn.moe`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeLoad>,
}

impl Record {
    /// The record as the run's plots take it.
    pub fn point(&self) -> crate::plot::Point {
        crate::plot::Point {
            step: self.step,
            valid: self.kind == "valid",
            loss: self.loss,
            gap: self.gap,
            load: self
                .moe
                .map(|m| [m.load_max_over_mean, m.load_cv, m.dropped_fraction]),
        }
    }
}

/// The expert load of one step, over the sparse layers.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MoeLoad {
    /// The busiest expert's pairs over the mean (1 when balanced; the largest over the layers).
    pub load_max_over_mean: f64,
    /// The coefficient of variation of the experts' pairs (0 when balanced; the largest over
    /// the layers).
    pub load_cv: f64,
    /// The fraction of token–expert pairs dropped by capacity (mean over the layers).
    pub dropped_fraction: f64,
}

/// The wall clock at one logged moment, a line of `timing.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    /// Steps completed.
    pub step: usize,
    /// `train` (a training record was logged), `valid` (an evaluation ended) or `checkpoint`
    /// (one is about to be written: a resumed run's clock starts from its `elapsed_s`).
    pub event: String,
    /// Training throughput since the previous `train` line, evaluations excluded (at `train`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_per_s: Option<f64>,
    /// Seconds of the run so far (its resumed parts added up).
    pub elapsed_s: f64,
}

const CSV_HEADER: &str = "step,kind,loss,gap,lr";

/// The metrics files of a run, open for appending.
#[derive(Debug)]
pub struct Metrics {
    jsonl: Log,
    csv: Log,
    timing: Log,
    elapsed_s: f64,
}

/// A file open for appending whole lines.
#[derive(Debug)]
struct Log {
    file: File,
    path: PathBuf,
}

impl Log {
    /// Rewrites `path` atomically with `text`, then opens it for appending.
    fn open(path: PathBuf, text: &str) -> Result<Self> {
        crate::files::write_atomically(&path, text.as_bytes())?;
        let file = OpenOptions::new()
            .append(true)
            .open(&path)
            .map_err(Error::io(&path))?;
        Ok(Self { file, path })
    }

    fn append(&mut self, line: &str) -> Result<()> {
        self.file
            .write_all(line.as_bytes())
            .and_then(|_| self.file.flush())
            .map_err(Error::io(&self.path))
    }
}

fn opt(v: Option<f64>) -> String {
    v.map(|v| v.to_string()).unwrap_or_default()
}

impl Metrics {
    /// Opens (creating) the metrics files of `run`, keeping only lines up to `keep_until`
    /// steps: what a resumed run will write again is dropped, and so is a line cut short by a
    /// killed process. Kept lines are copied as they were, never re-serialised.
    pub fn open(run: &Path, keep_until: usize) -> Result<Self> {
        let jsonl_path = run.join(crate::run::METRICS_JSONL);
        let timing_path = run.join(crate::run::TIMING);
        let mut jsonl_text = String::new();
        let mut csv_text = format!("{CSV_HEADER}\n");
        for (line, r) in read_lines::<Record>(&jsonl_path, "metrics record")? {
            if r.step <= keep_until {
                jsonl_text += &line;
                jsonl_text.push('\n');
                csv_text += &csv_line(&r);
            }
        }
        let mut timing_text = String::new();
        let mut elapsed_s = 0.0;
        for (line, t) in read_lines::<Timing>(&timing_path, "timing record")? {
            if t.step <= keep_until {
                timing_text += &line;
                timing_text.push('\n');
                elapsed_s = t.elapsed_s;
            }
        }
        Ok(Self {
            jsonl: Log::open(jsonl_path, &jsonl_text)?,
            csv: Log::open(run.join(crate::run::METRICS_CSV), &csv_text)?,
            timing: Log::open(timing_path, &timing_text)?,
            elapsed_s,
        })
    }

    /// The run's clock at the last kept line of `timing.jsonl`: where a resumed run's starts.
    pub fn elapsed_s(&self) -> f64 {
        self.elapsed_s
    }

    /// Appends a record to `metrics.jsonl` and `metrics.csv`.
    pub fn write(&mut self, record: &Record) -> Result<()> {
        self.jsonl
            .append(&(serde_json::to_string(record).expect("record serialises") + "\n"))?;
        self.csv.append(&csv_line(record))
    }

    /// Appends a line to `timing.jsonl`.
    pub fn time(&mut self, timing: &Timing) -> Result<()> {
        self.timing
            .append(&(serde_json::to_string(timing).expect("timing serialises") + "\n"))
    }
}

fn csv_line(r: &Record) -> String {
    format!(
        "{},{},{},{},{}\n",
        r.step,
        r.kind,
        r.loss,
        opt(r.gap),
        opt(r.lr)
    )
}

/// The records of a `metrics.jsonl`. A last line cut short (by a process killed while writing
/// it) is dropped; any other line that is not a record is an error, never silently deleted.
pub fn read_records(path: &Path) -> Result<Vec<Record>> {
    Ok(read_lines(path, "metrics record")?
        .into_iter()
        .map(|(_, r)| r)
        .collect())
}

/// The lines of a `timing.jsonl`, read as [`read_records`] reads metrics.
pub fn read_timings(path: &Path) -> Result<Vec<Timing>> {
    Ok(read_lines(path, "timing record")?
        .into_iter()
        .map(|(_, t)| t)
        .collect())
}

/// The JSON lines of a file, each with its text as written.
fn read_lines<T: DeserializeOwned>(path: &Path, what: &str) -> Result<Vec<(String, T)>> {
    if !path.exists() {
        return Ok(Vec::new());
    }
    let text = fs::read_to_string(path).map_err(Error::io(path))?;
    let mut out = Vec::new();
    let pieces: Vec<&str> = text.split_inclusive('\n').collect();
    for (i, piece) in pieces.iter().enumerate() {
        let complete = piece.ends_with('\n');
        let line = piece.trim_end_matches(['\n', '\r']);
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str(line) {
            Ok(record) => out.push((line.to_string(), record)),
            Err(_) if !complete && i + 1 == pieces.len() => {}
            Err(e) => {
                return Err(Error::Data {
                    path: path.to_path_buf(),
                    message: format!(
                        "line {} is not a {what} ({e}); the file was edited or damaged: \
                         restore it, or remove that line to continue",
                        i + 1
                    ),
                });
            }
        }
    }
    Ok(out)
}

/// The end-of-run summary, `summary.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunSummary {
    /// `completed`.
    pub status: String,
    /// Steps completed.
    pub steps: usize,
    /// The last logged training loss.
    pub final_train_loss: Option<f64>,
    /// The last validation loss.
    pub final_valid_loss: Option<f64>,
    /// The best validation loss.
    pub best_valid_loss: Option<f64>,
    /// The step of the best validation loss.
    pub best_valid_step: Option<usize>,
    /// The optimum, when known.
    pub optimal_loss: Option<f64>,
    /// `final_valid_loss − optimal_loss`.
    pub final_gap: Option<f64>,
    /// `best_valid_loss − optimal_loss`.
    pub best_gap: Option<f64>,
    /// Mean training throughput: tokens (or samples) per second of training.
    pub tokens_per_s: f64,
    /// Wall-clock seconds of the whole run (resumed parts added up).
    pub wall_time_s: f64,
    /// Trainable parameters of the model.
    pub params: usize,
    /// Of which in FFNs.
    pub ffn_params: usize,
    /// The device.
    pub device: String,
    /// What its matrix products ran on: the library, its kernels and the CPU's features
    /// ([`crate::backend::kernels`]; empty in summaries written before it was recorded).
    #[serde(default)]
    pub kernels: String,
}

/// How progress is shown.
#[derive(Debug)]
#[non_exhaustive]
pub enum Progress {
    /// A live bar on stderr (feature `cli`).
    #[cfg(feature = "cli")]
    Bar(ProgressBar),
    /// A plain line on stdout at each evaluation.
    Lines,
    /// Nothing (library use, tests).
    Silent,
}

impl Progress {
    /// A bar when stderr (where it draws) is a terminal, plain lines otherwise (a pipe, a log
    /// file, CI); plain lines without the feature `cli`.
    pub fn auto(total_steps: usize) -> Self {
        #[cfg(feature = "cli")]
        if std::io::stderr().is_terminal() {
            let bar = ProgressBar::new(total_steps as u64);
            bar.set_style(
                ProgressStyle::with_template(
                    "{bar:30.cyan/blue} {msg} [{elapsed_precise} < {eta_precise}]",
                )
                .expect("valid template"),
            );
            bar.enable_steady_tick(std::time::Duration::from_millis(250));
            return Progress::Bar(bar);
        }
        let _ = total_steps;
        Progress::Lines
    }

    /// Shows the state after `step` steps; `line` is set at evaluations.
    #[cfg_attr(not(feature = "cli"), allow(unused_variables))]
    pub fn update(&self, step: usize, message: &str, evaluation: bool) {
        match self {
            #[cfg(feature = "cli")]
            Progress::Bar(bar) => {
                bar.set_position(step as u64);
                bar.set_message(message.to_string());
            }
            Progress::Lines if evaluation => println!("{message}"),
            _ => {}
        }
    }

    /// Sets the bar's length (the total it counts to).
    pub fn set_length(&self, total: usize) {
        #[cfg(feature = "cli")]
        if let Progress::Bar(bar) = self {
            bar.set_length(total as u64);
        }
        let _ = total;
    }

    /// Prints a line above the bar, or plainly.
    pub fn println(&self, line: &str) {
        match self {
            #[cfg(feature = "cli")]
            Progress::Bar(bar) => bar.println(line),
            Progress::Lines => println!("{line}"),
            Progress::Silent => {}
        }
    }

    /// Ends the bar.
    pub fn finish(&self) {
        #[cfg(feature = "cli")]
        if let Progress::Bar(bar) = self {
            bar.finish();
        }
    }
}

/// Writes the summary as pretty JSON.
pub fn write_summary(run: &Path, summary: &RunSummary) -> Result<()> {
    let json = serde_json::to_string_pretty(summary).expect("summary serialises") + "\n";
    crate::files::write_atomically(&run.join(crate::run::SUMMARY), json.as_bytes())
}

/// Reads `summary.json`.
pub fn read_summary(run: &Path) -> Result<RunSummary> {
    let path = run.join(crate::run::SUMMARY);
    let text = fs::read_to_string(&path).map_err(Error::io(&path))?;
    serde_json::from_str(&text).map_err(|e| Error::Checkpoint {
        path,
        message: e.to_string(),
    })
}

/// `1h02m03s`, `4m05s`, `6.7s`.
pub fn duration(seconds: f64) -> String {
    let s = seconds.max(0.0);
    if s < 60.0 {
        format!("{s:.1}s")
    } else if s < 3600.0 {
        format!("{}m{:02}s", (s / 60.0) as u64, (s % 60.0) as u64)
    } else {
        format!(
            "{}h{:02}m{:02}s",
            (s / 3600.0) as u64,
            ((s % 3600.0) / 60.0) as u64,
            (s % 60.0) as u64
        )
    }
}
