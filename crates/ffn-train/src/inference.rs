//! # Using a trained run: evaluation and sampling
//!
//! Both load the newest checkpoint of a run folder into the model its `config.toml` describes.

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::tensor::{Device, Int, Tensor, TensorData};

use crate::data::Vocab;
use crate::model::Model;
use crate::rng::Rng;
use crate::training::{evaluate, load_latest};
use crate::{Error, Result};

/// The validation loss of a trained run.
#[derive(Debug, Clone, PartialEq)]
pub struct Evaluation {
    /// Steps the checkpoint had trained.
    pub step: usize,
    /// Mean validation loss.
    pub loss: f64,
    /// The optimum, when known.
    pub optimal_loss: Option<f64>,
    /// The checkpoint evaluated.
    pub checkpoint: PathBuf,
}

/// Evaluates the newest checkpoint of `run` on `batches` validation batches.
pub fn evaluate_run(run: &Path, device: &Device, batches: usize) -> Result<Evaluation> {
    if batches == 0 {
        return Err(Error::Config("--batches must be at least 1".into()));
    }
    let (loaded, state, checkpoint) = load_latest(run, device)?;
    let config = &loaded.config;
    let eval_device = device.clone().inner();
    let valid =
        loaded
            .task
            .valid_batches(config.seed, batches, config.train.batch_size, &eval_device);
    Ok(Evaluation {
        step: state.step,
        loss: evaluate(&loaded.model, &valid),
        optimal_loss: loaded.task.optimal_loss(),
        checkpoint,
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
}

/// Continues `options.prompt` with the newest checkpoint of a language-model run.
pub fn sample(run: &Path, device: &Device, options: &SampleOptions) -> Result<String> {
    if !(options.temperature.is_finite() && options.temperature >= 0.0) {
        return Err(Error::Config(format!(
            "--temperature must be ≥ 0, got {}",
            options.temperature
        )));
    }
    if options.top_k == Some(0) {
        return Err(Error::Config("--top-k must be at least 1".into()));
    }
    let (loaded, _, _) = load_latest(run, device)?;
    let vocab: Vocab = loaded.task.vocab().ok_or_else(|| {
        Error::Config("`sample` needs a language-model run; this one is a regression".into())
    })?;
    let mut tokens = vocab.encode(&options.prompt).map_err(Error::Config)?;
    if tokens.is_empty() {
        tokens.push(0);
    }
    let prompt_len = tokens.len();
    let model: Model = loaded.model.valid();
    let max_context = model.max_context().unwrap_or(usize::MAX);
    let device = device.clone().inner();
    let mut rng = Rng::stream(options.seed, "sample", 0);
    for _ in 0..options.tokens {
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
        tokens.push(pick(&last, options, &mut rng) as u32);
    }
    Ok(vocab.decode(&tokens[prompt_len..]))
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
