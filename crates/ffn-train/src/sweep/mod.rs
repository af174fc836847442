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

mod config;
mod grid;
mod plan;
mod report;
mod scheduler;

pub use config::{CustomVariant, SweepConfig, SweepTask, SweepVariant};
pub use grid::{
    CELLS, CURVES_PLOT, Cell, CellResult, GAPS_PLOT, Options, REPORT, RESULTS, SUMMARY, Sweep,
};
pub use report::{Comparison, SweepSummary, VariantStats, report, sweep_summary};

#[cfg(test)]
mod tests {
    use ffn_model::Variant;

    use super::scheduler::Pace;
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
        let s = sweep_summary("s", &config, 13, &results);
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
