//! Planning a sweep: its config resolved into cells (task, variant, learning rate, seed), each
//! checked before anything runs (parameter parity, names, duplicates).

use std::path::{Path, PathBuf};

use ffn_model::Variant;

use super::config::valid_name;
use super::config::*;
use super::grid::*;
use crate::config::TrainConfig;
use crate::error::{Error, Result};

impl Sweep {
    /// Plans the cells of `config`, whose tasks' config paths are relative to `base`.
    pub(super) fn plan(
        name: String,
        folder: PathBuf,
        config: SweepConfig,
        base: &Path,
    ) -> Result<Self> {
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
}

fn first_duplicate<T: PartialEq + Copy>(items: &[T]) -> Option<T> {
    items
        .iter()
        .enumerate()
        .find(|(i, x)| items[..*i].contains(x))
        .map(|(_, x)| *x)
}
