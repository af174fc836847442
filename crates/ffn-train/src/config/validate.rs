//! Validation: every field of a config checked, with an error that names it, before anything
//! runs.

use super::*;
use crate::error::{Error, Result};

impl TrainConfig {
    /// Checks every value ([`TaskConfig::validate`], [`ModelConfig::validate`],
    /// [`TrainSettings::validate`]), the pairing of task and model, and the FFNs.
    pub fn validate(&self) -> Result<()> {
        self.task.validate()?;
        self.model.validate()?;
        match (&self.model, self.task.is_language()) {
            (ModelConfig::Transformer(_) | ModelConfig::Window(_), true) => {}
            (ModelConfig::Ffn(_), false) => {}
            (_, true) => {
                return fail(
                    "a language task needs model.kind = \"transformer\" or \"window\"".to_string(),
                );
            }
            (_, false) => {
                return fail("a regression task needs model.kind = \"ffn\"".to_string());
            }
        }
        self.ffn()?;
        self.moe()?;
        if let (TaskConfig::Teacher(t), ModelConfig::Ffn(m)) = (&self.task, &self.model)
            && let Some(spec) = &t.teacher
        {
            spec.resolve(m.d_model, "task.teacher")?;
        }
        self.train.validate()
    }
}

fn fail(message: String) -> Result<()> {
    Err(Error::Config(message))
}

/// A size: at least 1 and at most [`MAX_SIZE`] (the memory estimate decides combinations).
fn positive(name: &str, value: usize) -> Result<()> {
    if value == 0 {
        fail(format!("{name} must be at least 1"))
    } else if value > MAX_SIZE {
        fail(format!(
            "{name} = {value} is too large (at most {MAX_SIZE})"
        ))
    } else {
        Ok(())
    }
}

/// A count of steps: at least 1 (no memory depends on it).
fn count(name: &str, value: usize) -> Result<()> {
    if value == 0 {
        fail(format!("{name} must be at least 1"))
    } else {
        Ok(())
    }
}

/// A probability in `[0, 1)`.
fn probability(name: &str, value: f64) -> Result<()> {
    if value.is_finite() && (0.0..1.0).contains(&value) {
        Ok(())
    } else {
        fail(format!("{name} must be in [0, 1), got {value}"))
    }
}

/// A finite value `≥ 0`.
fn non_negative(name: &str, value: f64) -> Result<()> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        fail(format!("{name} must be ≥ 0, got {value}"))
    }
}

impl TaskConfig {
    /// Whether the best achievable loss is known exactly (every task but a text file).
    pub fn optimal_loss_known(&self) -> bool {
        !matches!(self, TaskConfig::Text(_))
    }

    /// Whether the task is language modelling (else regression).
    pub fn is_language(&self) -> bool {
        matches!(self, TaskConfig::Markov(_) | TaskConfig::Text(_))
    }

    /// Checks the task's values.
    pub fn validate(&self) -> Result<()> {
        match self {
            TaskConfig::Markov(m) => m.validate(),
            TaskConfig::Text(t) => t.validate(),
            TaskConfig::Teacher(t) => t.validate(),
            TaskConfig::Sine(s) => s.validate(),
        }
    }
}

impl MarkovConfig {
    /// Checks the chain's sizes, and that it is ergodic.
    pub fn validate(&self) -> Result<()> {
        let alphabet = MARKOV_ALPHABET.len();
        if !(2..=alphabet).contains(&self.vocab_size) {
            return fail(format!(
                "task.vocab_size must be in 2..={alphabet}, got {}",
                self.vocab_size
            ));
        }
        positive("task.order", self.order)?;
        if markov_contexts(self.vocab_size, self.order).is_none() {
            return fail(format!(
                "task.vocab_size^task.order = {}^{} contexts is too many (at most 2^20)",
                self.vocab_size, self.order
            ));
        }
        if !(1..=self.vocab_size).contains(&self.support) {
            return fail(format!(
                "task.support must be in 1..=vocab_size ({}), got {}",
                self.vocab_size, self.support
            ));
        }
        probability("task.smoothing", self.smoothing)?;
        if self.smoothing == 0.0 && self.support < self.vocab_size {
            return fail(
                "task.smoothing must be positive when support < vocab_size, so that the chain is ergodic"
                    .to_string(),
            );
        }
        positive("task.seq_len", self.seq_len)
    }
}

impl TextConfig {
    /// Checks the split and the sequence length (the file is checked when it is read).
    pub fn validate(&self) -> Result<()> {
        if !(self.valid_fraction > 0.0 && self.valid_fraction < 1.0) {
            return fail(format!(
                "task.valid_fraction must be in (0, 1), got {}",
                self.valid_fraction
            ));
        }
        positive("task.seq_len", self.seq_len)
    }
}

impl TeacherConfig {
    /// Checks the noise and the teacher's gain (its FFN is checked with the model's `d_model`).
    pub fn validate(&self) -> Result<()> {
        non_negative("task.noise", self.noise)?;
        if !(self.teacher_gain.is_finite() && self.teacher_gain > 0.0) {
            return fail(format!(
                "task.teacher_gain must be > 0, got {}",
                self.teacher_gain
            ));
        }
        Ok(())
    }
}

impl SineConfig {
    /// Checks the noise and the frequency.
    pub fn validate(&self) -> Result<()> {
        non_negative("task.noise", self.noise)?;
        non_negative("task.frequency", self.frequency)
    }
}

impl ModelConfig {
    /// Checks the network's sizes (its FFN is resolved by [`TrainConfig::ffn`]).
    pub fn validate(&self) -> Result<()> {
        match self {
            ModelConfig::Transformer(m) => {
                positive("model.d_model", m.d_model)?;
                positive("model.n_layers", m.n_layers)?;
                positive("model.n_heads", m.n_heads)?;
                if m.d_model % m.n_heads != 0 {
                    return fail(format!(
                        "model.d_model ({}) must be a multiple of model.n_heads ({})",
                        m.d_model, m.n_heads
                    ));
                }
                probability("model.attention_dropout", m.attention_dropout)
            }
            ModelConfig::Window(m) => {
                positive("model.window", m.window)?;
                positive("model.d_embed", m.d_embed)?;
                positive("model.d_model", m.d_model)
            }
            ModelConfig::Ffn(m) => positive("model.d_model", m.d_model),
        }
    }
}

impl TrainSettings {
    /// Checks the schedule, the optimiser's values and the sizes.
    pub fn validate(&self) -> Result<()> {
        count("train.steps", self.steps)?;
        positive("train.batch_size", self.batch_size)?;
        count("train.eval_every", self.eval_every)?;
        positive("train.eval_batches", self.eval_batches)?;
        count("train.log_every", self.log_every)?;
        count("train.checkpoint_every", self.checkpoint_every)?;
        count("train.keep_checkpoints", self.keep_checkpoints)?;
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return fail(format!("train.lr must be > 0, got {}", self.lr));
        }
        if !(self.min_lr.is_finite() && self.min_lr >= 0.0 && self.min_lr <= self.lr) {
            return fail(format!(
                "train.min_lr must be in [0, lr = {}], got {}",
                self.lr, self.min_lr
            ));
        }
        probability("train.beta1", self.beta1)?;
        probability("train.beta2", self.beta2)?;
        non_negative("train.weight_decay", self.weight_decay)?;
        non_negative("train.grad_clip", self.grad_clip)?;
        if self.shards > MAX_SIZE {
            return fail(format!(
                "train.shards = {} is too large (at most {MAX_SIZE})",
                self.shards
            ));
        }
        Ok(())
    }
}
