//! A sweep's statistics (per task and variant, and each variant against the baseline), its
//! report and its plots.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::config::*;
use super::grid::*;
use crate::error::Result;
use crate::metrics::{self};
use crate::stats;

/// Per task and variant, at its best learning rate: an entry of `summary.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VariantStats {
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
    pub variants: Vec<VariantStats>,
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
    /// The statistics of `results` (grid order, `None` for unfinished cells).
    pub fn summarize(&self, results: &[Option<CellResult>]) -> SweepSummary {
        sweep_summary(&self.name, &self.config, self.cells.len(), results)
    }

    pub(super) fn write_outputs(
        &self,
        summary: &SweepSummary,
        results: &[Option<CellResult>],
    ) -> Result<()> {
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
pub fn sweep_summary(
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
                    (
                        lr,
                        gaps.and_then(|g| stats::sample_stats(&g)).map(|s| s.mean),
                    )
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
            let s = stats::sample_stats(&gaps);
            variants.push(VariantStats {
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
                mean_best_gap: stats::sample_stats(&best).map(|s| s.mean),
                tokens_per_s: stats::sample_stats(&speeds).map(|s| s.mean),
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
                stats::sample_stats(&a.iter().zip(&b).map(|(x, y)| x - y).collect::<Vec<_>>()),
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
        let mut rows: Vec<&VariantStats> =
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
