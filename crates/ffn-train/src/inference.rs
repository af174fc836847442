//! # Using a trained run: evaluation and sampling
//!
//! Both load the newest good checkpoint of a run folder into the model its `config.toml`
//! describes. Evaluation rebuilds the task (its validation batches); sampling needs only the
//! run's `vocab.json`.

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::tensor::{Device, Int, Tensor, TensorData};

use crate::error::{Error, Result};
use crate::model::Model;
use crate::model::evaluate;
use crate::rng::Rng;
use crate::run::{load_at, load_language_model, load_latest_good};

/// The validation loss of a trained run (`eval --json` prints it).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Evaluation {
    /// Steps the checkpoint had trained.
    pub step: usize,
    /// Mean validation loss.
    pub loss: f64,
    /// Validation batches it is the mean over.
    pub batches: usize,
    /// The optimum, when known.
    pub optimal_loss: Option<f64>,
    /// `loss − optimal_loss`, when the optimum is known.
    pub gap: Option<f64>,
    /// The checkpoint evaluated.
    pub checkpoint: PathBuf,
    /// What the user should know: newer checkpoints passed over (corrupt or incomplete), an
    /// approximate optimum.
    pub warnings: Vec<String>,
}

/// Evaluates a checkpoint of `run` on `batches` validation batches: the folder `checkpoint`
/// (see [`checkpoint_named`](crate::run::checkpoint_named)) if given, else the newest
/// good one.
pub fn evaluate_run(
    run: &Path,
    device: &Device,
    batches: usize,
    checkpoint: Option<&Path>,
) -> Result<Evaluation> {
    if batches == 0 {
        return Err(Error::Config("--batches must be at least 1".into()));
    }
    let (loaded, state, checkpoint, mut warnings) = match checkpoint {
        Some(chosen) => {
            let (loaded, state) = load_at(run, device, chosen)?;
            (loaded, state, chosen.to_path_buf(), Vec::new())
        }
        None => load_latest_good(run, device, false)?,
    };
    warnings.extend(loaded.task.warning());
    let config = &loaded.config;
    config.check_memory(batches)?;
    let eval_device = device.clone().inner();
    let valid =
        loaded
            .task
            .valid_batches(config.seed, batches, config.train.batch_size, &eval_device);
    let loss = evaluate(&loaded.model, &valid);
    let optimal_loss = loaded.task.optimal_loss();
    Ok(Evaluation {
        step: state.step,
        loss,
        batches,
        optimal_loss,
        gap: optimal_loss.map(|o| loss - o),
        checkpoint,
        warnings,
    })
}

/// How to sample.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleOptions {
    /// Text to continue (empty: start from the first token of the vocabulary).
    pub prompt: String,
    /// Tokens to generate.
    pub tokens: usize,
    /// Softmax temperature; 0 picks the most likely token.
    pub temperature: f64,
    /// Sample among the `k` most likely tokens only.
    pub top_k: Option<usize>,
    /// Seed of the sampling stream.
    pub seed: u64,
    /// The checkpoint folder to sample from (default: the newest good one).
    pub checkpoint: Option<PathBuf>,
}

/// The most tokens one `sample` call generates.
pub const MAX_SAMPLE_TOKENS: usize = 1_000_000;

/// Continues `options.prompt` with the newest checkpoint of a language-model run, handing the
/// text to `out` as it is generated (a token at a time; for a byte vocabulary, as soon as the
/// bytes so far form whole UTF-8 characters). Returns the warnings of loading the run.
pub fn sample(
    run: &Path,
    device: &Device,
    options: &SampleOptions,
    mut out: impl FnMut(&str),
) -> Result<Vec<String>> {
    if options.tokens > MAX_SAMPLE_TOKENS {
        return Err(Error::Config(format!(
            "--tokens must be at most {MAX_SAMPLE_TOKENS}, got {}",
            options.tokens
        )));
    }
    if !(options.temperature.is_finite() && options.temperature >= 0.0) {
        return Err(Error::Config(format!(
            "--temperature must be ≥ 0, got {}",
            options.temperature
        )));
    }
    if options.top_k == Some(0) {
        return Err(Error::Config("--top-k must be at least 1".into()));
    }
    // The run's own tokeniser, as written when it started: no corpus is read.
    let (model, vocab, warnings) = load_language_model(run, device, options.checkpoint.as_deref())?;
    let mut tokens = vocab.encode(&options.prompt).map_err(Error::Config)?;
    if tokens.is_empty() {
        tokens.push(0);
    }
    let model: Model = model.valid();
    let max_context = model.max_context().unwrap_or(usize::MAX);
    let device = device.clone().inner();
    let mut rng = Rng::stream(options.seed, "sample", 0);
    // Tokens generated but not yet handed out (an incomplete UTF-8 sequence).
    let mut pending: Vec<u32> = Vec::new();
    for _ in 0..options.tokens {
        // Only the model's context is kept.
        if tokens.len() > max_context.saturating_mul(2).max(4096) {
            tokens.drain(..tokens.len() - max_context.min(tokens.len()));
        }
        let context = &tokens[tokens.len().saturating_sub(max_context)..];
        let input: Vec<i64> = context.iter().map(|&t| i64::from(t)).collect();
        let input =
            Tensor::<2, Int>::from_data(TensorData::new(input, [1, context.len()]), &device);
        let logits = model.logits(input).expect("a language model");
        let [_, seq, v] = logits.dims();
        let last: Vec<f64> = logits
            .slice([0..1, seq - 1..seq, 0..v])
            .into_data()
            .iter::<f64>()
            .collect();
        let token = pick(&last, options, &mut rng) as u32;
        tokens.push(token);
        pending.push(token);
        if let Some(text) = vocab.decode_complete(&pending) {
            out(&text);
            pending.clear();
        }
    }
    if !pending.is_empty() {
        out(&vocab.decode(&pending));
    }
    Ok(warnings)
}

/// Draws a token from logits with temperature and top-k.
fn pick(logits: &[f64], options: &SampleOptions, rng: &mut Rng) -> usize {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    if options.temperature == 0.0 {
        return order[0];
    }
    order.truncate(options.top_k.unwrap_or(logits.len()).min(logits.len()));
    let max = logits[order[0]];
    let weights: Vec<f64> = order
        .iter()
        .map(|&i| ((logits[i] - max) / options.temperature).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut sum = 0.0;
    let cdf: Vec<f64> = weights
        .iter()
        .map(|w| {
            sum += w / total;
            sum
        })
        .collect();
    order[rng.sample_cdf(&cdf)]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(temperature: f64, top_k: Option<usize>) -> SampleOptions {
        SampleOptions {
            prompt: String::new(),
            tokens: 1,
            temperature,
            top_k,
            seed: 0,
            checkpoint: None,
        }
    }

    #[test]
    fn greedy_and_top_k() {
        let logits = [0.1, 3.0, 2.0, -1.0];
        let mut rng = Rng::stream(0, "t", 0);
        assert_eq!(pick(&logits, &options(0.0, None), &mut rng), 1);
        for _ in 0..200 {
            let t = pick(&logits, &options(5.0, Some(2)), &mut rng);
            assert!(t == 1 || t == 2);
        }
        // Temperature 1 follows the softmax: token 1 has probability e³ / Σ ≈ 0.70.
        let n = 20_000;
        let hits = (0..n)
            .filter(|_| pick(&logits, &options(1.0, None), &mut rng) == 1)
            .count();
        let p = 3f64.exp() / logits.iter().map(|l| l.exp()).sum::<f64>();
        assert!((hits as f64 / n as f64 - p).abs() < 0.015);
    }
}
