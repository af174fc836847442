//! A planned sweep: its cells (task, variant, learning rate, seed), the results they give,
//! and where those go in the sweep's folder.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::TrainConfig;
use crate::error::{Error, Result};

use super::config::{SweepConfig, SweepVariant};

/// The results, one record per line.
pub const RESULTS: &str = "results.jsonl";
/// The statistics per task and variant.
pub const SUMMARY: &str = "summary.json";
/// The report.
pub const REPORT: &str = "report.md";
/// Mean gaps with error bars.
pub const GAPS_PLOT: &str = "gaps.svg";
/// Validation curves.
pub const CURVES_PLOT: &str = "curves.svg";
/// The cells' folder.
pub const CELLS: &str = "cells";

/// One run of the grid.
#[derive(Debug, Clone, PartialEq)]
pub struct Cell {
    /// The task's name.
    pub task: String,
    /// The variant.
    pub variant: SweepVariant,
    /// The seed.
    pub seed: u64,
    /// The peak learning rate.
    pub lr: f64,
    /// The run's config.
    pub config: TrainConfig,
}

impl Cell {
    /// `TASK/VARIANT/seed-S_lr-LR`: the cell's path under `cells/`, without extension.
    pub fn id(&self) -> String {
        format!(
            "{}/{}/seed-{}_lr-{:e}",
            self.task,
            self.variant.name(),
            self.seed,
            self.lr
        )
    }
}

/// A planned sweep: its cells in grid order (task, variant, learning rate, seed).
#[derive(Debug, Clone)]
pub struct Sweep {
    /// Its name (the config file's stem).
    pub name: String,
    /// The output folder.
    pub folder: PathBuf,
    /// The config.
    pub config: SweepConfig,
    /// The cells.
    pub cells: Vec<Cell>,
}

/// How the cells run.
#[derive(Debug, Clone)]
pub struct Options {
    /// The `ffn-train` binary that trains each cell in a process of its own.
    pub program: PathBuf,
    /// Cells at a time.
    pub jobs: usize,
    /// Rayon threads of each cell (`RAYON_NUM_THREADS`).
    pub threads: usize,
    /// The device of every cell (`--device`), or the binary's default.
    pub device: Option<String>,
}

/// The result of one cell: a line of `results.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CellResult {
    /// The task.
    pub task: String,
    /// The variant (`FFN_ReLU`, …).
    pub variant: String,
    /// The seed.
    pub seed: u64,
    /// The peak learning rate.
    pub lr: f64,
    /// `completed`, or `diverged` (the loss became NaN or infinite; no gaps).
    pub status: String,
    /// Steps trained.
    pub steps: usize,
    /// Final validation loss minus the optimum.
    pub final_gap: Option<f64>,
    /// Best validation loss minus the optimum.
    pub best_gap: Option<f64>,
    /// The final validation loss.
    pub final_valid_loss: Option<f64>,
    /// The optimum.
    pub optimal_loss: Option<f64>,
    /// Training throughput, tokens (samples for regression) per second.
    pub tokens_per_s: Option<f64>,
    /// Wall-clock seconds of the cell's run.
    pub wall_time_s: Option<f64>,
    /// Trainable parameters of the model.
    pub params: usize,
    /// Of which in FFNs (every expert of a mixture).
    pub ffn_params: usize,
    /// The FFN parameters one token uses (a mixture's `top_k` experts, router and shared
    /// experts; a dense FFN's all). From the cell's config.
    #[serde(default)]
    pub ffn_active_params: usize,
    /// The fingerprint of the cell's config (a result of another config is not reused).
    pub config: String,
}

impl Sweep {
    /// Reads a sweep config and plans its cells, every one resolved and validated: a config
    /// that fails does so here, before anything runs. The output folder is `out`, or
    /// `runs/<file stem>`.
    pub fn load(path: &Path, out: Option<&Path>) -> Result<Self> {
        let text = ffn_model::files::read_text(path, ffn_model::files::MAX_CONFIG_FILE)
            .map_err(Error::io(path))?;
        let config: SweepConfig = toml::from_str(&text).map_err(|e| {
            Error::Config(format!(
                "{}: {}",
                path.display(),
                crate::config::toml_error(&text, &e)
            ))
        })?;
        let name = path
            .file_stem()
            .map_or("sweep".into(), |s| s.to_string_lossy().into_owned());
        let base = path.parent().unwrap_or(Path::new(""));
        let folder = out.map_or_else(|| Path::new("runs").join(&name), Path::to_path_buf);
        Self::plan(name, folder, config, base).map_err(|e| match e {
            Error::Config(m) => Error::Config(format!("{}: {m}", path.display())),
            e => e,
        })
    }

    pub(super) fn cell_path(&self, cell: &Cell, extension: &str) -> PathBuf {
        let id = cell.id();
        let path = self.folder.join(CELLS).join(id);
        if extension.is_empty() {
            path
        } else {
            path.with_extension(extension)
        }
    }
}

/// The FFN parameters a token uses, every layer's.
pub(super) fn active_params(config: &TrainConfig) -> usize {
    config.ffn_params().map_or(0, |(_, active)| active)
}

pub(super) fn fingerprint(config: &TrainConfig) -> String {
    crate::files::fingerprint(&config.to_toml())
}
