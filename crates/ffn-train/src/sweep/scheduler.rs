//! Running a sweep's cells: each in a process of its own, `jobs` at a time, resumed where
//! they stopped, with a progress line whose ETA counts each task at its own pace.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::grid::*;
use super::report::SweepSummary;
use crate::config::TrainConfig;
use crate::error::{Error, Result};
use crate::metrics::{self, Progress};

/// `ffn-train train`'s exit statuses, as `ExitStatus::code` gives them.
const EXIT_DIVERGED: i32 = crate::error::EXIT_DIVERGED as i32;
const EXIT_INTERRUPTED: i32 = crate::error::EXIT_INTERRUPTED as i32;

impl Sweep {
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
pub(super) struct Pace {
    tasks: BTreeMap<String, (f64, usize)>,
}

impl Pace {
    pub(super) fn record(&mut self, task: &str, seconds: f64, steps: usize) {
        let entry = self.tasks.entry(task.to_string()).or_default();
        entry.0 += seconds;
        entry.1 += steps;
    }

    /// The time `left` (task, steps) takes at `jobs` cells at a time: each task at its own
    /// pace, a task not yet timed at the mean pace of the others. `unknown` before any.
    pub(super) fn eta(&self, left: &[(&str, usize)], jobs: usize) -> String {
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
