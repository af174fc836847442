//! # Metrics, progress and the run summary
//!
//! Every logged value goes to `metrics.jsonl` (one JSON object a line) and `metrics.csv`, each
//! line flushed as it is written. On a terminal a live bar shows step, losses, gap to the
//! optimum, tokens/s and ETA; otherwise (a pipe, a log file, CI) plain lines are printed at
//! each evaluation.

use std::fs::{self, File, OpenOptions};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

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
    /// Training throughput over the interval (training records).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_per_s: Option<f64>,
    /// Seconds since the run started.
    pub elapsed_s: f64,
}

const CSV_HEADER: &str = "step,kind,loss,gap,lr,tokens_per_s,elapsed_s";

/// The metrics files of a run, open for appending.
#[derive(Debug)]
pub struct Metrics {
    jsonl: File,
    csv: File,
    jsonl_path: PathBuf,
}

fn opt(v: Option<f64>) -> String {
    v.map(|v| v.to_string()).unwrap_or_default()
}

impl Metrics {
    /// Opens (creating) the metrics files of `run`, keeping only records up to `keep_until`
    /// steps: what a resumed run will write again is dropped, and so is a line cut short by a
    /// killed process.
    pub fn open(run: &Path, keep_until: usize) -> Result<Self> {
        let jsonl_path = run.join(crate::run::METRICS_JSONL);
        let csv_path = run.join(crate::run::METRICS_CSV);
        // Kept lines are copied as they were, never re-serialised.
        let mut jsonl_text = String::new();
        let mut csv_text = format!("{CSV_HEADER}\n");
        for (line, r) in read_lines(&jsonl_path)? {
            if r.step <= keep_until {
                jsonl_text += &line;
                jsonl_text.push('\n');
                csv_text += &csv_line(&r);
            }
        }
        crate::run::write_atomically(&jsonl_path, jsonl_text.as_bytes())?;
        crate::run::write_atomically(&csv_path, csv_text.as_bytes())?;
        let append = |path: &Path| {
            OpenOptions::new()
                .append(true)
                .open(path)
                .map_err(Error::io(path))
        };
        Ok(Self {
            jsonl: append(&jsonl_path)?,
            csv: append(&csv_path)?,
            jsonl_path,
        })
    }

    /// Appends a record to both files.
    pub fn write(&mut self, record: &Record) -> Result<()> {
        let line = serde_json::to_string(record).expect("record serialises") + "\n";
        self.jsonl
            .write_all(line.as_bytes())
            .and_then(|_| self.jsonl.flush())
            .map_err(Error::io(&self.jsonl_path))?;
        self.csv
            .write_all(csv_line(record).as_bytes())
            .and_then(|_| self.csv.flush())
            .map_err(Error::io(&self.jsonl_path))
    }
}

fn csv_line(r: &Record) -> String {
    format!(
        "{},{},{},{},{},{},{}\n",
        r.step,
        r.kind,
        r.loss,
        opt(r.gap),
        opt(r.lr),
        opt(r.tokens_per_s),
        r.elapsed_s
    )
}

/// The records of a `metrics.jsonl`. A last line cut short (by a process killed while writing
/// it) is dropped; any other line that is not a record is an error, never silently deleted.
pub fn read_records(path: &Path) -> Result<Vec<Record>> {
    Ok(read_lines(path)?.into_iter().map(|(_, r)| r).collect())
}

/// [`read_records`] with each record's line as written.
fn read_lines(path: &Path) -> Result<Vec<(String, Record)>> {
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
                        "line {} is not a metrics record ({e}); the file was edited or damaged: \
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
pub struct Summary {
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
}

/// How progress is shown.
#[derive(Debug)]
pub enum Progress {
    /// A live bar (stdout is a terminal).
    Bar(ProgressBar),
    /// A plain line at each evaluation (stdout is not a terminal).
    Lines,
    /// Nothing (library use, tests).
    Silent,
}

impl Progress {
    /// A bar on a terminal, plain lines otherwise.
    pub fn auto(total_steps: usize) -> Self {
        if std::io::stdout().is_terminal() {
            let bar = ProgressBar::new(total_steps as u64);
            bar.set_style(
                ProgressStyle::with_template(
                    "{bar:30.cyan/blue} {msg} [{elapsed_precise} < {eta_precise}]",
                )
                .expect("valid template"),
            );
            bar.enable_steady_tick(Duration::from_millis(250));
            Progress::Bar(bar)
        } else {
            Progress::Lines
        }
    }

    /// Shows the state after `step` steps; `line` is set at evaluations.
    pub fn update(&self, step: usize, message: &str, evaluation: bool) {
        match self {
            Progress::Bar(bar) => {
                bar.set_position(step as u64);
                bar.set_message(message.to_string());
            }
            Progress::Lines if evaluation => println!("{message}"),
            _ => {}
        }
    }

    /// Prints a line above the bar, or plainly.
    pub fn println(&self, line: &str) {
        match self {
            Progress::Bar(bar) => bar.println(line),
            Progress::Lines => println!("{line}"),
            Progress::Silent => {}
        }
    }

    /// Ends the bar.
    pub fn finish(&self) {
        if let Progress::Bar(bar) = self {
            bar.finish();
        }
    }
}

/// Writes the summary as pretty JSON.
pub fn write_summary(run: &Path, summary: &Summary) -> Result<()> {
    let json = serde_json::to_string_pretty(summary).expect("summary serialises") + "\n";
    crate::run::write_atomically(&run.join(crate::run::SUMMARY), json.as_bytes())
}

/// Reads `summary.json`.
pub fn read_summary(run: &Path) -> Result<Summary> {
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
