//! # Sweeps: the variant study
//!
//! A sweep trains a grid of runs, `{tasks} × {variants} × {seeds} × {learning rates}`, and
//! compares the variants by their **gap to the optimum** (validation loss minus the best loss
//! any model can reach), which the tasks know exactly. Its config (`configs/sweeps/*.toml`):
//!
//! ```toml
//! variants = ["FFN_ReLU", "FFN_GELU", "FFN_SwiGLU"]   # presets, at parameter parity
//! # or a named FFN of your own: a preset's activation and gating, a width, optionally sparse
//! # variants = ["FFN_SwiGLU", { name = "MoE-8x86", preset = "SwiGLU", d_ff = 86,
//! #                            moe = { n_experts = 8, top_k = 2 } }]
//! # or a preset in mixed precision, paired with its f32 self:
//! # variants = ["FFN_SwiGLU", { name = "SwiGLU-bf16", preset = "SwiGLU", precision = "bf16" }]
//! seeds = [1, 2, 3]
//! lrs = [1e-3, 3e-3]          # the learning-rate grid (a task may give its own)
//! baseline = "FFN_ReLU"       # what every other variant is tested against
//!
//! [[tasks]]
//! name = "markov"
//! config = "../default.toml"  # a run config, relative to this file
//! set = ["train.steps=400"]   # overrides, as `ffn-train train --set`
//! ```
//!
//! ## Fair by construction
//! - **Parameter parity**: each cell's FFN is the variant's preset ([`ffn_model::Variant`]: the
//!   gated ones at `d_ff = 8/3 · d_model`); a base config whose FFN sets `d_ff`, `activation`,
//!   `gated` or `moe` is refused, as it would break the parity. A named variant
//!   ([`SweepVariant::Custom`]) sets its own width or mixture of experts: its parity is the
//!   sweep author's, and the results carry the FFN parameters, total and active per token,
//!   of every variant so that the report shows it.
//! - **Paired seeds**: a cell's seed is the run's seed, and every random stream of a run is
//!   derived from it by name ([`crate::rng`]): the same seed gives every variant the same
//!   Markov chain or teacher, the same training batches in the same order and the same
//!   validation set. Only the student's initial weights differ (they have other shapes).
//! - **Learning rate chosen per variant**: at the LR whose mean final validation gap over the
//!   seeds is lowest (an LR where any seed diverged is never chosen). The schedule keeps its
//!   shape: `min_lr` is scaled with `lr`.
//!
//! ## Statistics ([`crate::stats`])
//! Per task and variant, at its LR: the mean final gap over seeds, its sample standard
//! deviation, standard error and Student-t 95 % interval. Each variant is tested against the
//! baseline by a **paired t-test** over seeds (the baseline at its own best LR), two-sided, with
//! Holm's step-down correction over the variants of a task. The LR is chosen on the same
//! validation data the gaps are reported on; that selection favours every variant alike, by
//! an amount of the order of the seed-to-seed spread when the LRs are close.
//!
//! ## The folder `runs/<name>/`
//! ```text
//! results.jsonl   one record per finished cell, in grid order (see `CellResult`)
//! summary.json    per task × variant at its best LR: n, mean_gap, std_gap, stderr_gap,
//!                 ci95_low, ci95_high, tokens_per_s; the paired tests
//! report.md       a table per task, ranks, the paired tests against the baseline
//! gaps.svg        mean gap with 95 % error bars, per task and variant
//! curves.svg      validation gap against steps (log scale), one line per variant
//! cells/TASK/VARIANT/seed-S_lr-LR/        the cell's run folder (see `crate::run`)
//!                    seed-S_lr-LR.toml    its config; .json its result; .log its output
//! ```
//!
//! ## Running and resuming
//! Each cell trains in a process of its own (the `ffn-train` binary given in [`Options`]) with
//! `threads` rayon threads, `jobs` at a time, in grid order but for the first cell of each
//! task, which runs first: the progress line's ETA then knows every task's pace (seconds per
//! step) early, and counts each task's remaining steps at its own pace.
//!
//! A sweep resumes where it stopped: a cell with a result is skipped, one with a checkpoint is
//! resumed from it, any other is started. A cell's run is deterministic, so a resumed sweep
//! writes the same results as one that ran straight through (all but the timings,
//! `tokens_per_s` and `wall_time_s`). A cell whose folder holds a run of another config (the
//! sweep file was edited) is an error, never overwritten. SIGINT/SIGTERM stop the running
//! cells at a checkpoint; the sweep then exits as interrupted (status 130).

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ffn_model::Variant;
use serde::{Deserialize, Serialize};

use crate::config::TrainConfig;
use crate::metrics::{self, Progress};
use crate::stats;
use crate::{Error, Result};

/// `ffn-train train`'s exit statuses, as `ExitStatus::code` gives them.
const EXIT_DIVERGED: i32 = crate::EXIT_DIVERGED as i32;
const EXIT_INTERRUPTED: i32 = crate::EXIT_INTERRUPTED as i32;

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

/// A sweep config file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SweepConfig {
    /// The variants compared: presets at parameter parity, or named FFNs of your own.
    pub variants: Vec<SweepVariant>,
    /// The seeds: each is one paired replicate.
    pub seeds: Vec<u64>,
    /// The learning-rate grid (default: each task's own `train.lr`).
    #[serde(default)]
    pub lrs: Vec<f64>,
    /// The variant the others are tested against (a preset's name, any spelling, or a named
    /// variant's).
    #[serde(default = "default_baseline")]
    pub baseline: String,
    /// More paired tests, `[variant, against]` (`[["MoE-8x86", "SwiGLU-688"]]`), corrected
    /// for multiple testing with those against the baseline.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pairs: Vec<[String; 2]>,
    /// The tasks.
    pub tasks: Vec<SweepTask>,
}

fn default_baseline() -> String {
    Variant::FfnRelu.name().into()
}

/// A variant of a sweep: a preset at parameter parity, or an FFN of your own under a name.
///
/// ```toml
/// variants = [
///     "FFN_SwiGLU",                                               # d_ff = 8/3 · d_model
///     { name = "SwiGLU-688", preset = "SwiGLU", d_ff = 688 },     # another width
///     { name = "MoE-8x86", preset = "SwiGLU", d_ff = 86, moe = { n_experts = 8, top_k = 2 } },
/// ]
/// ```
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum SweepVariant {
    /// A preset, at parameter parity ([`Variant::d_ff`]).
    Preset(Variant),
    /// A named FFN.
    Custom(CustomVariant),
}

/// A named variant: a preset's activation and gating, its own width, optionally a sparse
/// mixture of those FFNs as experts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CustomVariant {
    /// Its name in the results (letters, digits, `-`, `_`; not a preset's name).
    pub name: String,
    /// The activation and gating.
    pub preset: Variant,
    /// The hidden width (default: the preset's at parameter parity); of each expert with `moe`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub d_ff: Option<usize>,
    /// A mixture of experts: the table of `model.ffn.moe` (`{ n_experts = 8, top_k = 2 }`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<toml::Table>,
    /// The FFNs' matrix products' precision, `train.precision` (default: the task's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<ffn_model::Precision>,
}

impl SweepVariant {
    /// Its name in the results: the preset's (`FFN_SwiGLU`) or the given one.
    pub fn name(&self) -> &str {
        match self {
            Self::Preset(v) => v.name(),
            Self::Custom(c) => &c.name,
        }
    }

    /// Whether `name` names this variant (a preset in any spelling `Variant` parses).
    fn is(&self, name: &str) -> bool {
        match self {
            Self::Preset(v) => name.parse::<Variant>().is_ok_and(|n| n == *v),
            Self::Custom(c) => c.name == name,
        }
    }

    /// The overrides that make a task's config this variant.
    fn overrides(&self) -> Vec<String> {
        match self {
            Self::Preset(v) => vec![format!("model.ffn.preset=\"{}\"", v.name())],
            Self::Custom(c) => {
                let mut set = vec![format!("model.ffn.preset=\"{}\"", c.preset.name())];
                if let Some(d_ff) = c.d_ff {
                    set.push(format!("model.ffn.d_ff={d_ff}"));
                }
                if let Some(moe) = &c.moe {
                    set.push(format!("model.ffn.moe={}", toml::Value::Table(moe.clone())));
                }
                if let Some(precision) = c.precision {
                    let name = match precision {
                        ffn_model::Precision::F32 => "f32",
                        ffn_model::Precision::Bf16 => "bf16",
                    };
                    set.push(format!("train.precision=\"{name}\""));
                }
                set
            }
        }
    }

    /// The variant must decide the FFN's width, activation, gating and sparsity.
    fn check_parity(&self, config: &TrainConfig, task: &str) -> Result<()> {
        let ffn = config.ffn()?;
        let (preset, d_ff, sparse) = match self {
            Self::Preset(v) => (*v, None, false),
            Self::Custom(c) => (c.preset, c.d_ff, c.moe.is_some()),
        };
        let wanted = ffn_model::FeedForwardConfig::preset(preset, ffn.d_model);
        let wanted = (d_ff.unwrap_or(wanted.d_ff), wanted.activation, wanted.gated);
        if (ffn.d_ff, ffn.activation, ffn.gated) != wanted || config.moe()?.is_some() != sparse {
            return Err(Error::Config(format!(
                "task `{task}`: its model.ffn sets d_ff, multiple_of, activation, gated or moe, \
                 which would override the {} variant and break parameter parity: remove them",
                self.name()
            )));
        }
        Ok(())
    }
}

impl<'de> Deserialize<'de> for SweepVariant {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error as _;
        match toml::Value::deserialize(deserializer)? {
            toml::Value::String(name) => name.parse().map(Self::Preset).map_err(D::Error::custom),
            table @ toml::Value::Table(_) => {
                table
                    .try_into()
                    .map(Self::Custom)
                    .map_err(|e: toml::de::Error| {
                        D::Error::custom(format!("a named variant: {}", e.message()))
                    })
            }
            other => Err(D::Error::custom(format!(
                "a variant is a preset's name or a table {{ name, preset, d_ff, moe, precision }}, \
                 not `{other}`"
            ))),
        }
    }
}

/// A name for files and results: 1 to 64 letters, digits, `-` or `_`.
fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// One task of a sweep: a run config and overrides.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SweepTask {
    /// Its name in the results (letters, digits, `-`, `_`).
    pub name: String,
    /// The run config, relative to the sweep file.
    pub config: PathBuf,
    /// Overrides, as `ffn-train train --set`.
    #[serde(default)]
    pub set: Vec<String>,
    /// This task's learning-rate grid (default: the sweep's).
    #[serde(default)]
    pub lrs: Vec<f64>,
}

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

/// Per task and variant, at its best learning rate: an entry of `summary.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VariantSummary {
    /// The task.
    pub task: String,
    /// The variant.
    pub variant: String,
    /// The chosen learning rate (`None` when every LR diverged for some seed).
    pub lr: Option<f64>,
    /// Its rank in the task by mean gap (1 = smallest).
    pub rank: Option<usize>,
    /// Seeds.
    pub n: usize,
    /// Mean final gap.
    pub mean_gap: Option<f64>,
    /// Sample standard deviation of the final gap.
    pub std_gap: Option<f64>,
    /// Standard error of the mean.
    pub stderr_gap: Option<f64>,
    /// Lower end of the Student-t 95 % interval of the mean.
    pub ci95_low: Option<f64>,
    /// Upper end.
    pub ci95_high: Option<f64>,
    /// Mean best gap (best validation loss over training).
    pub mean_best_gap: Option<f64>,
    /// Mean training throughput.
    pub tokens_per_s: Option<f64>,
    /// Trainable parameters of the model (FFN ones in `ffn_params`).
    pub params: usize,
    /// FFN parameters.
    pub ffn_params: usize,
    /// FFN parameters one token uses.
    pub ffn_active_params: usize,
    /// Mean final gap at each learning rate of the grid (`None`: a seed diverged).
    pub gap_by_lr: Vec<(f64, Option<f64>)>,
}

/// A variant against the baseline, paired by seed: an entry of `summary.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Comparison {
    /// The task.
    pub task: String,
    /// The variant.
    pub variant: String,
    /// The baseline.
    pub baseline: String,
    /// Pairs (seeds run by both).
    pub n: usize,
    /// Mean of `gap(variant) − gap(baseline)` over seeds: negative favours the variant.
    pub mean_difference: f64,
    /// Student-t 95 % interval of the mean difference.
    pub ci95_low: f64,
    /// Upper end.
    pub ci95_high: f64,
    /// The t statistic.
    pub t: f64,
    /// Two-sided p-value.
    pub p: f64,
    /// `p` after Holm's correction over the task's comparisons.
    pub p_holm: f64,
}

/// `summary.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepSummary {
    /// The sweep's name.
    pub name: String,
    /// The baseline variant.
    pub baseline: String,
    /// How the variants were compared.
    pub method: String,
    /// Per task × variant.
    pub variants: Vec<VariantSummary>,
    /// Each variant against the baseline.
    pub comparisons: Vec<Comparison>,
    /// Cells finished of the grid.
    pub cells_done: usize,
    /// Cells in the grid.
    pub cells_total: usize,
    /// Seconds of training summed over cells.
    pub cell_time_s: f64,
}

const METHOD: &str = "final validation gap (loss − optimum) per seed; each variant at the \
    learning rate with the lowest mean gap over seeds; mean ± Student-t 95% interval; each \
    variant against the baseline (and the sweep's extra pairs) by a two-sided paired t-test \
    over seeds (same data, same teacher per seed), p-values Holm-corrected within each task";

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

    /// Plans the cells of `config`, whose tasks' config paths are relative to `base`.
    fn plan(name: String, folder: PathBuf, config: SweepConfig, base: &Path) -> Result<Self> {
        let fail = |m: String| Err(Error::Config(m));
        if config.variants.is_empty() || config.seeds.is_empty() || config.tasks.is_empty() {
            return fail("a sweep needs at least one variant, one seed and one task".into());
        }
        for variant in &config.variants {
            if let SweepVariant::Custom(c) = variant {
                if !valid_name(&c.name) {
                    return fail(format!(
                        "variant name `{}`: use 1 to 64 letters, digits, `-` or `_`",
                        ffn_model::printable(&c.name, 80)
                    ));
                }
                if c.name.parse::<Variant>().is_ok() {
                    return fail(format!(
                        "variant name `{}` is a preset's: give the named variant another",
                        c.name
                    ));
                }
            }
        }
        if !config.variants.iter().any(|v| v.is(&config.baseline)) {
            return fail(format!(
                "the baseline {} is not among the variants",
                ffn_model::printable(&config.baseline, 80)
            ));
        }
        let names: Vec<&str> = config.variants.iter().map(SweepVariant::name).collect();
        if let Some(dup) = first_duplicate(&names) {
            return fail(format!("variant {dup} is listed twice"));
        }
        let index = |name: &str| config.variants.iter().position(|v| v.is(name));
        let baseline = index(&config.baseline);
        let mut tested = Vec::new();
        for pair in &config.pairs {
            let (Some(a), Some(b)) = (index(&pair[0]), index(&pair[1])) else {
                let missing = &pair[usize::from(index(&pair[0]).is_some())];
                return fail(format!(
                    "pair {pair:?}: {} is not among the variants",
                    ffn_model::printable(missing, 80)
                ));
            };
            if a == b {
                return fail(format!("pair {pair:?} compares a variant with itself"));
            }
            if baseline == Some(a) || baseline == Some(b) {
                return fail(format!(
                    "pair {pair:?}: every variant is tested against the baseline already"
                ));
            }
            if tested.contains(&(a.min(b), a.max(b))) {
                return fail(format!("pair {pair:?} is listed twice"));
            }
            tested.push((a.min(b), a.max(b)));
        }
        if let Some(dup) = first_duplicate(&config.seeds) {
            return fail(format!("seed {dup} is listed twice"));
        }
        let mut cells = Vec::new();
        let mut names = Vec::new();
        for task in &config.tasks {
            if !valid_name(&task.name) {
                return fail(format!(
                    "task name `{}`: use 1 to 64 letters, digits, `-` or `_`",
                    ffn_model::printable(&task.name, 80)
                ));
            }
            if names.contains(&&task.name) {
                return fail(format!("task `{}` is listed twice", task.name));
            }
            names.push(&task.name);
            let file = base.join(&task.config);
            let text = ffn_model::files::read_text(&file, ffn_model::files::MAX_CONFIG_FILE)
                .map_err(Error::io(&file))?;
            let context = format!("task `{}` ({})", task.name, file.display());
            let task_config = TrainConfig::from_toml(&text, &task.set)
                .map_err(|e| Error::Config(format!("{context}: {e}")))?;
            if !task_config.task.optimal_loss_known() {
                return fail(format!(
                    "task `{}`: a sweep compares gaps to the optimum, and this task has none \
                     (use markov, teacher or sine)",
                    task.name
                ));
            }
            let lrs = match (&task.lrs[..], &config.lrs[..]) {
                ([], []) => vec![task_config.train.lr],
                ([], lrs) | (lrs, _) => lrs.to_vec(),
            };
            if let Some(bad) = lrs.iter().find(|lr| !(lr.is_finite() && **lr > 0.0)) {
                return fail(format!("task `{}`: learning rate {bad}", task.name));
            }
            if let Some(dup) = first_duplicate(&lrs.iter().map(|l| l.to_bits()).collect::<Vec<_>>())
            {
                return fail(format!(
                    "task `{}`: learning rate {} is listed twice",
                    task.name,
                    f64::from_bits(dup)
                ));
            }
            for variant in &config.variants {
                for &lr in &lrs {
                    for &seed in &config.seeds {
                        let mut set = task.set.clone();
                        set.push(format!("seed={seed}"));
                        set.push(format!("train.lr={lr:e}"));
                        // The schedule keeps its shape at every peak LR.
                        set.push(format!(
                            "train.min_lr={:e}",
                            task_config.train.min_lr * lr / task_config.train.lr
                        ));
                        set.extend(variant.overrides());
                        let config = TrainConfig::from_toml(&text, &set).map_err(|e| {
                            Error::Config(format!("{context}, variant {}: {e}", variant.name()))
                        })?;
                        variant.check_parity(&config, &task.name)?;
                        cells.push(Cell {
                            task: task.name.clone(),
                            variant: variant.clone(),
                            seed,
                            lr,
                            config,
                        });
                    }
                }
            }
        }
        Ok(Self {
            name,
            folder,
            config,
            cells,
        })
    }

    fn cell_path(&self, cell: &Cell, extension: &str) -> PathBuf {
        let id = cell.id();
        let path = self.folder.join(CELLS).join(id);
        if extension.is_empty() {
            path
        } else {
            path.with_extension(extension)
        }
    }

    /// The results of the cells that have finished, in grid order (a result written for
    /// another config of the cell is an error).
    pub fn finished(&self) -> Result<Vec<Option<CellResult>>> {
        self.cells.iter().map(|c| self.result_of(c)).collect()
    }

    fn result_of(&self, cell: &Cell) -> Result<Option<CellResult>> {
        let path = self.cell_path(cell, "json");
        let text = match fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io(&path)(e)),
        };
        let mut result: CellResult = serde_json::from_str(&text).map_err(|e| Error::Data {
            path: path.clone(),
            message: format!("not a cell result ({e}); remove it to run the cell again"),
        })?;
        if result.config != fingerprint(&cell.config) {
            return Err(Error::Config(format!(
                "{} is the result of another config of this cell (was the sweep file edited?): \
                 remove {} or write the sweep to another --out",
                path.display(),
                self.folder.display()
            )));
        }
        // Results written before the field existed.
        result.ffn_active_params = active_params(&cell.config);
        Ok(Some(result))
    }

    /// Runs every unfinished cell, then writes the outputs. `progress` shows one line for the
    /// whole grid.
    pub fn run(&self, options: &Options, progress: &Progress) -> Result<SweepSummary> {
        if options.jobs == 0 || options.threads == 0 {
            return Err(Error::Config(
                "--jobs and --threads must be at least 1".into(),
            ));
        }
        fs::create_dir_all(&self.folder).map_err(Error::io(&self.folder))?;
        let mut results = self.finished()?;
        let pending: Vec<usize> = (0..self.cells.len())
            .filter(|&i| results[i].is_none())
            .collect();
        for &i in &pending {
            self.check_folder(&self.cells[i])?;
        }
        // The first cell of each task runs first: the ETA then knows every task's pace.
        let mut pending = pending;
        let mut firsts: Vec<usize> = Vec::new();
        for &i in &pending {
            if !firsts
                .iter()
                .any(|&f| self.cells[f].task == self.cells[i].task)
            {
                firsts.push(i);
            }
        }
        pending.retain(|i| !firsts.contains(i));
        let pending: Vec<usize> = firsts.into_iter().chain(pending).collect();
        let total_steps: usize = pending
            .iter()
            .map(|&i| self.cells[i].config.train.steps)
            .sum();
        progress.set_length(total_steps);
        // Steps of the cells finished in this invocation; seconds per step of each task.
        let mut steps_done = 0;
        let mut pace = Pace::default();
        let mut eta = "unknown".to_string();
        let mut queue = pending.into_iter().peekable();
        let mut running: Vec<(usize, Child, Instant)> = Vec::new();
        let mut failure: Option<Error> = None;
        let mut stopping = false;
        loop {
            if !stopping && (failure.is_some() || crate::interrupt::stop_requested()) {
                // Every running cell stops at a checkpoint; no new one starts.
                stopping = true;
                for (_, child, _) in &mut running {
                    stop(child);
                }
            }
            while !stopping && running.len() < options.jobs {
                let Some(i) = queue.next() else { break };
                running.push((i, self.spawn(&self.cells[i], options)?, Instant::now()));
            }
            if running.is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
            let mut still = Vec::new();
            for (i, mut child, spawned) in running {
                let cell = &self.cells[i];
                match child.try_wait().map_err(Error::io(&options.program))? {
                    None => still.push((i, child, spawned)),
                    Some(status) => match self.finish(cell, status.code()) {
                        Ok(Some(result)) => {
                            steps_done += cell.config.train.steps;
                            pace.record(
                                &cell.task,
                                spawned.elapsed().as_secs_f64(),
                                cell.config.train.steps,
                            );
                            let done = results.iter().filter(|r| r.is_some()).count() + 1;
                            progress.println(&format!(
                                "[{done}/{}] {}: gap {} | {:.0} tok/s | {} | ETA {eta}",
                                self.cells.len(),
                                cell.id(),
                                result
                                    .final_gap
                                    .map_or("diverged".into(), |g| format!("{g:+.4}")),
                                result.tokens_per_s.unwrap_or(0.0),
                                metrics::duration(spawned.elapsed().as_secs_f64()),
                            ));
                            results[i] = Some(result);
                            self.write_results(&results)?;
                        }
                        Ok(None) if stopping => {}
                        Ok(None) => {
                            failure.get_or_insert(Error::Config(format!(
                                "cell {} was stopped by a signal; run the sweep again to \
                                 continue it",
                                cell.id()
                            )));
                        }
                        Err(e) => {
                            failure.get_or_insert(e);
                        }
                    },
                }
            }
            running = still;
            if !stopping {
                // What is left: the running cells' remaining steps and the queued cells'.
                let mut live = 0;
                let mut left: Vec<(&str, usize)> = Vec::new();
                for (i, _, _) in &running {
                    let cell = &self.cells[*i];
                    let step = latest_step(&self.cell_path(cell, "")).min(cell.config.train.steps);
                    live += step;
                    left.push((&cell.task, cell.config.train.steps - step));
                }
                left.extend(queue.clone().map(|i| {
                    (
                        self.cells[i].task.as_str(),
                        self.cells[i].config.train.steps,
                    )
                }));
                let done = results.iter().filter(|r| r.is_some()).count();
                eta = pace.eta(&left, options.jobs);
                progress.update(
                    steps_done + live,
                    &format!(
                        "[{done}/{}] ETA {eta} | running {}",
                        self.cells.len(),
                        running
                            .iter()
                            .map(|(i, _, _)| self.cells[*i].id())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                    false,
                );
            }
        }
        if let Some(e) = failure {
            return Err(e);
        }
        if stopping {
            return Err(Error::SweepInterrupted {
                done: results.iter().filter(|r| r.is_some()).count(),
                total: self.cells.len(),
            });
        }
        progress.finish();
        self.write_results(&results)?;
        let summary = self.summarize(&results);
        self.write_outputs(&summary, &results)?;
        Ok(summary)
    }

    /// Refuses a cell folder that holds a run of another config.
    fn check_folder(&self, cell: &Cell) -> Result<()> {
        let run = self.cell_path(cell, "");
        let path = run.join(crate::run::CONFIG);
        if !path.is_file() {
            return Ok(());
        }
        let theirs = TrainConfig::load(&path, &[])?;
        if theirs != cell.config {
            return Err(Error::Config(format!(
                "{} holds a run of another config (was the sweep file edited?): remove {} or \
                 write the sweep to another --out",
                run.display(),
                self.folder.display()
            )));
        }
        Ok(())
    }

    /// Starts the process that trains (or resumes) `cell`.
    fn spawn(&self, cell: &Cell, options: &Options) -> Result<Child> {
        let run = self.cell_path(cell, "");
        let config_file = self.cell_path(cell, "toml");
        let log_file = self.cell_path(cell, "log");
        let parent = run.parent().expect("a cell has a parent folder");
        fs::create_dir_all(parent).map_err(Error::io(parent))?;
        let mut command = Command::new(&options.program);
        let resumable = crate::checkpoint::list(&run)
            .is_ok_and(|list| list.iter().any(|c| crate::checkpoint::verify(c).is_ok()));
        if resumable {
            command.arg("resume").arg(&run);
        } else {
            crate::files::write_atomically(&config_file, cell.config.to_toml().as_bytes())?;
            command
                .arg("train")
                .arg("--config")
                .arg(&config_file)
                .arg("--run")
                .arg(&run);
        }
        if let Some(device) = &options.device {
            command.arg("--device").arg(device);
        }
        let log = File::options()
            .create(true)
            .append(true)
            .open(&log_file)
            .map_err(Error::io(&log_file))?;
        let log2 = log.try_clone().map_err(Error::io(&log_file))?;
        command
            .env("RAYON_NUM_THREADS", options.threads.to_string())
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2);
        #[cfg(unix)]
        {
            // A process group of its own: a Ctrl-C reaches the sweep only, which then stops
            // each cell once (a second signal would make a cell exit before its checkpoint).
            use std::os::unix::process::CommandExt;
            command.process_group(0);
        }
        command.spawn().map_err(|e| {
            Error::Config(format!(
                "cannot start {} for cell {}: {e}",
                options.program.display(),
                cell.id()
            ))
        })
    }

    /// The result of a cell whose process ended with `code`: `Ok(None)` if it was stopped.
    fn finish(&self, cell: &Cell, code: Option<i32>) -> Result<Option<CellResult>> {
        let run = self.cell_path(cell, "");
        let log = self.cell_path(cell, "log");
        let result = match code {
            Some(0) => {
                let s = metrics::read_summary(&run)?;
                CellResult {
                    task: cell.task.clone(),
                    variant: cell.variant.name().into(),
                    seed: cell.seed,
                    lr: cell.lr,
                    status: "completed".into(),
                    steps: s.steps,
                    final_gap: s.final_gap,
                    best_gap: s.best_gap,
                    final_valid_loss: s.final_valid_loss,
                    optimal_loss: s.optimal_loss,
                    tokens_per_s: Some(s.tokens_per_s),
                    wall_time_s: Some(s.wall_time_s),
                    params: s.params,
                    ffn_params: s.ffn_params,
                    ffn_active_params: active_params(&cell.config),
                    config: fingerprint(&cell.config),
                }
            }
            Some(EXIT_DIVERGED) => {
                let records = metrics::read_records(&run.join(crate::run::METRICS_JSONL))?;
                CellResult {
                    task: cell.task.clone(),
                    variant: cell.variant.name().into(),
                    seed: cell.seed,
                    lr: cell.lr,
                    status: "diverged".into(),
                    steps: records.last().map_or(0, |r| r.step),
                    final_gap: None,
                    best_gap: None,
                    final_valid_loss: None,
                    optimal_loss: None,
                    tokens_per_s: None,
                    wall_time_s: None,
                    params: 0,
                    ffn_params: 0,
                    ffn_active_params: active_params(&cell.config),
                    config: fingerprint(&cell.config),
                }
            }
            Some(EXIT_INTERRUPTED) | None => return Ok(None),
            Some(code) => {
                let last = fs::read_to_string(&log)
                    .ok()
                    .and_then(|t| {
                        t.lines()
                            .rfind(|l| l.starts_with("error:"))
                            .map(String::from)
                    })
                    .unwrap_or_default();
                return Err(Error::Config(format!(
                    "cell {} failed (exit status {code}){}; its output is in {}",
                    cell.id(),
                    if last.is_empty() {
                        String::new()
                    } else {
                        format!(": {}", last.trim_start_matches("error:").trim())
                    },
                    log.display()
                )));
            }
        };
        let json = serde_json::to_string_pretty(&result).expect("a result serialises") + "\n";
        crate::files::write_atomically(&self.cell_path(cell, "json"), json.as_bytes())?;
        Ok(Some(result))
    }

    fn write_results(&self, results: &[Option<CellResult>]) -> Result<()> {
        let mut text = String::new();
        for r in results.iter().flatten() {
            text += &serde_json::to_string(r).expect("a result serialises");
            text.push('\n');
        }
        crate::files::write_atomically(&self.folder.join(RESULTS), text.as_bytes())
    }

    /// The statistics of `results` (grid order, `None` for unfinished cells).
    pub fn summarize(&self, results: &[Option<CellResult>]) -> SweepSummary {
        summarize(&self.name, &self.config, self.cells.len(), results)
    }

    fn write_outputs(&self, summary: &SweepSummary, results: &[Option<CellResult>]) -> Result<()> {
        let json = serde_json::to_string_pretty(summary).expect("a summary serialises") + "\n";
        crate::files::write_atomically(&self.folder.join(SUMMARY), json.as_bytes())?;
        crate::files::write_atomically(&self.folder.join(REPORT), report(summary).as_bytes())?;
        crate::files::write_atomically(
            &self.folder.join(GAPS_PLOT),
            crate::plot::gaps_svg(&self.name, &intervals(summary)).as_bytes(),
        )?;
        // The validation curves of each variant at its chosen LR, averaged over seeds.
        let mut curves: BTreeMap<(String, String), Vec<Points>> = BTreeMap::new();
        for (cell, result) in self.cells.iter().zip(results) {
            let chosen = summary
                .variants
                .iter()
                .find(|v| v.task == cell.task && v.variant == cell.variant.name())
                .and_then(|v| v.lr);
            if result.is_none() || chosen != Some(cell.lr) {
                continue;
            }
            let path = self.cell_path(cell, "").join(crate::run::METRICS_JSONL);
            let curve = metrics::read_records(&path)?
                .into_iter()
                .filter(|r| r.kind == "valid")
                .filter_map(|r| Some((r.step, r.gap?)))
                .collect();
            curves
                .entry((cell.task.clone(), cell.variant.name().to_string()))
                .or_default()
                .push(curve);
        }
        let tasks: Vec<&str> = self.config.tasks.iter().map(|t| t.name.as_str()).collect();
        let mut lines = Vec::new();
        for task in &tasks {
            for variant in &self.config.variants {
                if let Some(runs) = curves.get(&(task.to_string(), variant.name().to_string())) {
                    lines.push(crate::plot::Curve {
                        task: task.to_string(),
                        variant: variant.name().to_string(),
                        points: mean_curve(runs),
                    });
                }
            }
        }
        crate::files::write_atomically(
            &self.folder.join(CURVES_PLOT),
            crate::plot::curves_svg(&self.name, &tasks, &lines).as_bytes(),
        )
    }
}

fn first_duplicate<T: PartialEq + Copy>(items: &[T]) -> Option<T> {
    items
        .iter()
        .enumerate()
        .find(|(i, x)| items[..*i].contains(x))
        .map(|(_, x)| *x)
}

/// The FFN parameters a token uses, every layer's.
fn active_params(config: &TrainConfig) -> usize {
    config.ffn_params().map_or(0, |(_, active)| active)
}

fn fingerprint(config: &TrainConfig) -> String {
    crate::files::fingerprint(&config.to_toml())
}

/// Stops a cell's process at its next step (it writes a checkpoint first).
fn stop(child: &mut Child) {
    #[cfg(unix)]
    if let Ok(pid) = i32::try_from(child.id()) {
        // SAFETY: kill(2) with a process id this process started and has not reaped.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        return;
    }
    let _ = child.kill();
}

/// Seconds per step of each task, from the cells finished so far (tasks differ: a step of a
/// transformer costs more than one of a small regression FFN).
#[derive(Debug, Default)]
struct Pace {
    tasks: BTreeMap<String, (f64, usize)>,
}

impl Pace {
    fn record(&mut self, task: &str, seconds: f64, steps: usize) {
        let entry = self.tasks.entry(task.to_string()).or_default();
        entry.0 += seconds;
        entry.1 += steps;
    }

    /// The time `left` (task, steps) takes at `jobs` cells at a time: each task at its own
    /// pace, a task not yet timed at the mean pace of the others. `unknown` before any.
    fn eta(&self, left: &[(&str, usize)], jobs: usize) -> String {
        let (seconds, steps) = self
            .tasks
            .values()
            .fold((0.0, 0), |(s, n), (a, b)| (s + a, n + b));
        if steps == 0 {
            return "unknown".into();
        }
        let mean = seconds / steps as f64;
        let total: f64 = left
            .iter()
            .map(|&(task, steps)| {
                let pace = self
                    .tasks
                    .get(task)
                    .filter(|p| p.1 > 0)
                    .map_or(mean, |p| p.0 / p.1 as f64);
                pace * steps as f64
            })
            .sum();
        metrics::duration(total / jobs.max(1) as f64)
    }
}

/// The newest step in a run's `metrics.jsonl` (0 if none): progress within a running cell.
fn latest_step(run: &Path) -> usize {
    let Ok(text) = fs::read_to_string(run.join(crate::run::METRICS_JSONL)) else {
        return 0;
    };
    text.lines()
        .rev()
        .find_map(|l| serde_json::from_str::<metrics::Record>(l).ok())
        .map_or(0, |r| r.step)
}

/// A validation curve: `(step, gap)`.
type Points = Vec<(usize, f64)>;

/// The mean of several runs' curves at the steps all of them have.
fn mean_curve(runs: &[Points]) -> Points {
    let Some(first) = runs.first() else {
        return Vec::new();
    };
    first
        .iter()
        .filter_map(|&(step, _)| {
            let values: Vec<f64> = runs
                .iter()
                .filter_map(|r| r.iter().find(|p| p.0 == step).map(|p| p.1))
                .collect();
            (values.len() == runs.len())
                .then(|| (step, values.iter().sum::<f64>() / values.len() as f64))
        })
        .collect()
}

/// The statistics of a sweep's results: see the module documentation.
pub fn summarize(
    name: &str,
    config: &SweepConfig,
    cells_total: usize,
    results: &[Option<CellResult>],
) -> SweepSummary {
    let done: Vec<&CellResult> = results.iter().flatten().collect();
    let mut variants = Vec::new();
    let mut comparisons = Vec::new();
    for task in &config.tasks {
        let mut chosen: Vec<(&SweepVariant, Option<f64>, Vec<&CellResult>)> = Vec::new();
        for variant in &config.variants {
            let mine: Vec<&CellResult> = done
                .iter()
                .copied()
                .filter(|r| r.task == task.name && r.variant == variant.name())
                .collect();
            let mut lrs: Vec<f64> = Vec::new();
            for r in &mine {
                if !lrs.contains(&r.lr) {
                    lrs.push(r.lr);
                }
            }
            lrs.sort_by(f64::total_cmp);
            let gap_by_lr: Vec<(f64, Option<f64>)> = lrs
                .iter()
                .map(|&lr| {
                    let gaps: Option<Vec<f64>> = mine
                        .iter()
                        .filter(|r| r.lr == lr)
                        .map(|r| r.final_gap)
                        .collect();
                    (lr, gaps.and_then(|g| stats::summarize(&g)).map(|s| s.mean))
                })
                .collect();
            let lr = gap_by_lr
                .iter()
                .filter_map(|&(lr, g)| Some((lr, g?)))
                .min_by(|a, b| a.1.total_cmp(&b.1))
                .map(|(lr, _)| lr);
            let at: Vec<&CellResult> = mine.iter().copied().filter(|r| Some(r.lr) == lr).collect();
            let gaps: Vec<f64> = at.iter().filter_map(|r| r.final_gap).collect();
            let best: Vec<f64> = at.iter().filter_map(|r| r.best_gap).collect();
            let speeds: Vec<f64> = at.iter().filter_map(|r| r.tokens_per_s).collect();
            let s = stats::summarize(&gaps);
            variants.push(VariantSummary {
                task: task.name.clone(),
                variant: variant.name().into(),
                lr,
                rank: None,
                n: gaps.len(),
                mean_gap: s.map(|s| s.mean),
                std_gap: s.map(|s| s.std),
                stderr_gap: s.map(|s| s.stderr),
                ci95_low: s.map(|s| s.ci95.0),
                ci95_high: s.map(|s| s.ci95.1),
                mean_best_gap: stats::summarize(&best).map(|s| s.mean),
                tokens_per_s: stats::summarize(&speeds).map(|s| s.mean),
                params: at.first().map_or(0, |r| r.params),
                ffn_params: at.first().map_or(0, |r| r.ffn_params),
                ffn_active_params: at.first().map_or(0, |r| r.ffn_active_params),
                gap_by_lr,
            });
            chosen.push((variant, lr, at));
        }
        // Ranks by mean gap within the task.
        let first = variants.len() - config.variants.len();
        let mut order: Vec<usize> = (first..variants.len())
            .filter(|&i| variants[i].mean_gap.is_some())
            .collect();
        order.sort_by(|&a, &b| {
            variants[a]
                .mean_gap
                .unwrap_or(f64::INFINITY)
                .total_cmp(&variants[b].mean_gap.unwrap_or(f64::INFINITY))
        });
        for (rank, i) in order.into_iter().enumerate() {
            variants[i].rank = Some(rank + 1);
        }
        // Paired tests by seed: every variant against the baseline, then the extra pairs.
        let find = |name: &str| chosen.iter().find(|c| c.0.is(name));
        let mut pairs = Vec::new();
        if let Some(base) = find(&config.baseline) {
            pairs.extend(chosen.iter().filter(|c| c.0 != base.0).map(|c| (c, base)));
        }
        pairs.extend(
            config
                .pairs
                .iter()
                .filter_map(|[a, b]| Some((find(a)?, find(b)?))),
        );
        let mut tests = Vec::new();
        for ((variant, _, at), (baseline, _, base)) in pairs {
            let pairs: Vec<(f64, f64)> = at
                .iter()
                .filter_map(|r| {
                    let b = base.iter().find(|b| b.seed == r.seed)?;
                    Some((r.final_gap?, b.final_gap?))
                })
                .collect();
            let (a, b): (Vec<f64>, Vec<f64>) = pairs.into_iter().unzip();
            let (Some(test), Some(d)) = (
                stats::paired_t_test(&a, &b),
                stats::summarize(&a.iter().zip(&b).map(|(x, y)| x - y).collect::<Vec<_>>()),
            ) else {
                continue;
            };
            tests.push(Comparison {
                task: task.name.clone(),
                variant: variant.name().into(),
                baseline: baseline.name().into(),
                n: test.n,
                mean_difference: test.mean_difference,
                ci95_low: d.ci95.0,
                ci95_high: d.ci95.1,
                t: test.t,
                p: test.p,
                p_holm: test.p,
            });
        }
        let holm = stats::holm(&tests.iter().map(|c| c.p).collect::<Vec<_>>());
        for (c, p) in tests.iter_mut().zip(holm) {
            c.p_holm = p;
        }
        comparisons.extend(tests);
    }
    let baseline = config
        .variants
        .iter()
        .find(|v| v.is(&config.baseline))
        .map_or(config.baseline.as_str(), SweepVariant::name);
    SweepSummary {
        name: name.into(),
        baseline: baseline.into(),
        method: METHOD.into(),
        variants,
        comparisons,
        cells_done: done.len(),
        cells_total,
        cell_time_s: done.iter().filter_map(|r| r.wall_time_s).sum(),
    }
}

/// `report.md`: a table per task (ranked by mean gap), the learning rates, and the paired
/// tests against the baseline.
pub fn report(summary: &SweepSummary) -> String {
    let mut out = format!(
        "# Sweep `{}`\n\n{} of {} cells, {} of training. Method: {}.\n",
        summary.name,
        summary.cells_done,
        summary.cells_total,
        metrics::duration(summary.cell_time_s),
        summary.method
    );
    let fmt = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v:.4}"));
    let mut tasks: Vec<&str> = Vec::new();
    for v in &summary.variants {
        if !tasks.contains(&v.task.as_str()) {
            tasks.push(&v.task);
        }
    }
    for task in tasks {
        let mut rows: Vec<&VariantSummary> =
            summary.variants.iter().filter(|v| v.task == task).collect();
        rows.sort_by_key(|v| v.rank.unwrap_or(usize::MAX));
        out += &format!(
            "\n## Task `{task}`\n\n| rank | variant | params (FFN) | active FFN | lr | n | mean gap | 95% CI | std | best gap | tokens/s |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
        );
        for v in &rows {
            out += &format!(
                "| {} | {} | {} ({}) | {} | {} | {} | {} | [{}, {}] | {} | {} | {} |\n",
                v.rank.map_or("–".into(), |r| r.to_string()),
                v.variant,
                v.params,
                v.ffn_params,
                v.ffn_active_params,
                v.lr.map_or("–".into(), |lr| format!("{lr:e}")),
                v.n,
                fmt(v.mean_gap),
                fmt(v.ci95_low),
                fmt(v.ci95_high),
                fmt(v.std_gap),
                fmt(v.mean_best_gap),
                v.tokens_per_s.map_or("–".into(), |t| format!("{t:.0}")),
            );
        }
        let lrs: Vec<f64> = {
            let mut all: Vec<f64> = rows
                .iter()
                .flat_map(|v| v.gap_by_lr.iter().map(|p| p.0))
                .collect();
            all.sort_by(f64::total_cmp);
            all.dedup();
            all
        };
        if lrs.len() > 1 {
            out += "\nMean final gap at each learning rate (– : a seed diverged):\n\n| variant |";
            for lr in &lrs {
                out += &format!(" {lr:e} |");
            }
            out += "\n|---|";
            out += &"---|".repeat(lrs.len());
            out.push('\n');
            for v in &rows {
                out += &format!("| {} |", v.variant);
                for lr in &lrs {
                    let g = v.gap_by_lr.iter().find(|p| p.0 == *lr).and_then(|p| p.1);
                    out += &format!(" {} |", fmt(g));
                }
                out.push('\n');
            }
        }
        let tests: Vec<&Comparison> = summary
            .comparisons
            .iter()
            .filter(|c| c.task == task)
            .collect();
        let (ours, others): (Vec<&Comparison>, Vec<&Comparison>) = tests
            .into_iter()
            .partition(|c| c.baseline == summary.baseline);
        let row = |c: &Comparison| {
            format!(
                "| {} | {:+.4} | [{:+.4}, {:+.4}] | {:.2} | {:.3} | {:.3} |\n",
                c.n, c.mean_difference, c.ci95_low, c.ci95_high, c.t, c.p, c.p_holm
            )
        };
        if !ours.is_empty() {
            out += &format!(
                "\nAgainst {} (paired by seed; negative: smaller gap than {}):\n\n| variant | n | mean difference | 95% CI | t | p | p (Holm) |\n|---|---|---|---|---|---|---|\n",
                summary.baseline, summary.baseline
            );
            for c in ours {
                out += &format!("| {} {}", c.variant, row(c));
            }
        }
        if !others.is_empty() {
            out += "\nMore pairs (paired by seed; negative: the variant's gap is smaller):\n\n| variant | against | n | mean difference | 95% CI | t | p | p (Holm) |\n|---|---|---|---|---|---|---|---|\n";
            for c in others {
                out += &format!("| {} | {} {}", c.variant, c.baseline, row(c));
            }
        }
    }
    // Ranks over tasks.
    let mut names: Vec<&str> = Vec::new();
    for v in &summary.variants {
        if !names.contains(&v.variant.as_str()) {
            names.push(&v.variant);
        }
    }
    let mut mean_ranks: Vec<(&str, f64, usize)> = names
        .iter()
        .map(|name| {
            let ranks: Vec<f64> = summary
                .variants
                .iter()
                .filter(|v| v.variant == *name)
                .filter_map(|v| v.rank.map(|r| r as f64))
                .collect();
            (
                *name,
                ranks.iter().sum::<f64>() / ranks.len().max(1) as f64,
                ranks.len(),
            )
        })
        .collect();
    mean_ranks.sort_by(|a, b| a.1.total_cmp(&b.1));
    out += "\n## Mean rank over tasks\n\n| variant | mean rank | tasks |\n|---|---|---|\n";
    for (name, rank, n) in mean_ranks {
        out += &format!("| {name} | {rank:.2} | {n} |\n");
    }
    out
}

/// Each variant's mean final gap and its 95 % interval, where a sweep has them, for
/// `gaps.svg`.
fn intervals(summary: &SweepSummary) -> Vec<crate::plot::Interval> {
    summary
        .variants
        .iter()
        .filter_map(|v| {
            Some(crate::plot::Interval {
                task: v.task.clone(),
                variant: v.variant.clone(),
                mean: v.mean_gap?,
                low: v.ci95_low?,
                high: v.ci95_high?,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(variant: Variant, seed: u64, lr: f64, gap: Option<f64>) -> Option<CellResult> {
        Some(CellResult {
            task: "t".into(),
            variant: variant.name().into(),
            seed,
            lr,
            status: if gap.is_some() {
                "completed"
            } else {
                "diverged"
            }
            .into(),
            steps: 10,
            final_gap: gap,
            best_gap: gap,
            final_valid_loss: gap.map(|g| 1.0 + g),
            optimal_loss: Some(1.0),
            tokens_per_s: gap.map(|_| 100.0 * seed as f64),
            wall_time_s: gap.map(|_| 2.0),
            params: 50,
            ffn_params: 40,
            ffn_active_params: 40,
            config: String::new(),
        })
    }

    /// Hand-computed: the LR is chosen per variant by mean gap, an LR with a diverged seed is
    /// never chosen, the statistics are those of the seeds at the chosen LR, and the paired
    /// test pairs seeds across the variants' own LRs.
    #[test]
    fn the_summary_follows_the_method_by_hand() {
        let (relu, glu) = (Variant::FfnRelu, Variant::Glu);
        let config = SweepConfig {
            variants: vec![SweepVariant::Preset(relu), SweepVariant::Preset(glu)],
            seeds: vec![1, 2, 3],
            lrs: vec![0.1, 0.2],
            baseline: "relu".into(),
            pairs: vec![],
            tasks: vec![SweepTask {
                name: "t".into(),
                config: "x.toml".into(),
                set: vec![],
                lrs: vec![],
            }],
        };
        let results = vec![
            // ReLU at 0.1: mean 0.2; at 0.2: mean 0.1 (chosen).
            result(relu, 1, 0.1, Some(0.1)),
            result(relu, 2, 0.1, Some(0.2)),
            result(relu, 3, 0.1, Some(0.3)),
            result(relu, 1, 0.2, Some(0.05)),
            result(relu, 2, 0.2, Some(0.10)),
            result(relu, 3, 0.2, Some(0.15)),
            // GLU at 0.1: mean 0.06 (chosen); at 0.2 one seed diverged, though the others
            // have smaller gaps.
            result(glu, 1, 0.1, Some(0.04)),
            result(glu, 2, 0.1, Some(0.06)),
            result(glu, 3, 0.1, Some(0.08)),
            result(glu, 1, 0.2, Some(0.01)),
            result(glu, 2, 0.2, None),
            result(glu, 3, 0.2, Some(0.01)),
            None, // an unfinished cell
        ];
        let s = summarize("s", &config, 13, &results);
        assert_eq!((s.cells_done, s.cells_total), (12, 13));
        let (r, g) = (&s.variants[0], &s.variants[1]);
        assert_eq!((r.lr, g.lr), (Some(0.2), Some(0.1)));
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(r.mean_gap.unwrap(), 0.1));
        assert!(close(g.mean_gap.unwrap(), 0.06));
        // Gaps 0.04, 0.06, 0.08: s = 0.02, stderr = 0.02/√3, t_{0.975,2} = 4.302652729911275.
        assert!(close(g.std_gap.unwrap(), 0.02));
        assert!(close(g.stderr_gap.unwrap(), 0.02 / 3f64.sqrt()));
        let half = 4.302_652_729_911_275 * 0.02 / 3f64.sqrt();
        assert!((g.ci95_low.unwrap() - (0.06 - half)).abs() < 1e-9);
        assert!((g.ci95_high.unwrap() - (0.06 + half)).abs() < 1e-9);
        assert!(close(g.tokens_per_s.unwrap(), 200.0));
        assert_eq!(g.gap_by_lr[1], (0.2, None));
        assert_eq!((g.rank, r.rank), (Some(1), Some(2)));
        // Paired by seed: differences 0.04−0.05, 0.06−0.10, 0.08−0.15 = −0.01, −0.04, −0.07:
        // mean −0.04, s = 0.03, t = −0.04 / (0.03/√3) = −2.3094.
        let c = &s.comparisons[0];
        assert_eq!((c.variant.as_str(), c.n), ("FFN_GLU", 3));
        assert!(close(c.mean_difference, -0.04));
        assert!((c.t - (-0.04 / (0.03 / 3f64.sqrt()))).abs() < 1e-9);
        let half = 4.302_652_729_911_275 * 0.03 / 3f64.sqrt();
        assert!((c.ci95_low - (-0.04 - half)).abs() < 1e-9);
        // p = P(|T₂| ≥ 2.3094) = 1 − |t|/√(t² + 2) for ν = 2.
        let t = c.t.abs();
        assert!(
            (c.p - (1.0 - t / (t * t + 2.0).sqrt())).abs() < 1e-9,
            "{}",
            c.p
        );
        assert_eq!(c.p_holm, c.p);
        let report = report(&s);
        assert!(
            report.contains("| 1 | FFN_GLU | 50 (40) | 40 | 1e-1 | 3 | 0.0600 |"),
            "{report}"
        );
        assert!(report.contains("| FFN_GLU | 0.0600 | – |"), "{report}");
    }

    /// Each task at its own pace; an untimed task at the mean pace of the timed ones.
    #[test]
    fn the_eta_times_each_task_at_its_own_pace() {
        let mut pace = Pace::default();
        assert_eq!(pace.eta(&[("a", 10)], 1), "unknown");
        pace.record("a", 10.0, 100); // 0.1 s a step
        pace.record("b", 1.0, 100); // 0.01 s a step
        // 0.1·300 + 0.01·1000 = 40 s; with 2 jobs 20 s.
        assert_eq!(pace.eta(&[("a", 300), ("b", 1000)], 1), "40.0s");
        assert_eq!(pace.eta(&[("a", 300), ("b", 1000)], 2), "20.0s");
        // Unknown task: (10 + 1)/200 = 0.055 s a step.
        assert_eq!(pace.eta(&[("c", 1000)], 1), "55.0s");
    }

    #[test]
    fn cell_ids_name_task_variant_seed_and_lr() {
        let cell = Cell {
            task: "markov".into(),
            variant: SweepVariant::Preset(Variant::SwiGlu),
            seed: 4,
            lr: 0.003,
            config: crate::TrainConfig::from_toml(crate::DEFAULT_CONFIG, &[]).unwrap(),
        };
        assert_eq!(cell.id(), "markov/FFN_SwiGLU/seed-4_lr-3e-3");
    }
}
