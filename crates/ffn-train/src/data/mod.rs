//! # Data with a known optimum
//!
//! Each task generates its batches from the run's random streams and knows the best loss any
//! model can reach on them, so a run reports its *gap to the optimum* rather than a bare loss.
//!
//! - [`MarkovSource`]: a random sparse order-`k` Markov chain over `V` symbols. The
//!   Bayes-optimal cross-entropy of a next-token predictor that sees `j` previous tokens is the
//!   conditional entropy `H(X | X₋ⱼ … X₋₁)`, computed exactly from the chain's stationary
//!   distribution.
//! - [`TextCorpus`]: a file the user points at, tokenised by bytes or characters, split into
//!   training and validation parts. Its optimum is unknown.
//! - [`Regression`]: `y = f(x) + σ ε` with `x, ε ~ N(0, I)` and `f` a frozen random teacher FFN or
//!   a smooth map `sin(A x + b)`. The Bayes-optimal predictor is `f` itself, with mean squared
//!   error `σ²`.

use std::path::Path;

use burn::module::Module;
use burn::tensor::{Device, Distribution, Int, Tensor, TensorData};
use ffn_model::FeedForwardConfig;

use crate::config::{TaskConfig, TrainConfig};
use crate::error::{Error, Result};
use crate::rng::Rng;

mod markov;
mod regression;
mod text;

pub use crate::config::MARKOV_ALPHABET;
pub use markov::{MARKOV, MarkovSource};
pub use regression::Regression;
use regression::Target;
pub use text::{MAX_TEXT, TextCorpus, VOCAB, Vocab, read_vocab};

/// One batch.
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)] // one per step, moved rarely; boxing buys nothing
pub enum Batch {
    /// `[batch, seq_len + 1]` tokens: inputs are the first `seq_len`, targets the last.
    Tokens(Tensor<2, Int>),
    /// Regression inputs and noisy targets, `[batch, d_model]` each.
    Pairs {
        /// Inputs.
        x: Tensor<2>,
        /// Targets.
        y: Tensor<2>,
    },
}

impl Batch {
    /// Examples (rows) in the batch.
    pub fn len(&self) -> usize {
        match self {
            Batch::Tokens(t) => t.dims()[0],
            Batch::Pairs { x, .. } => x.dims()[0],
        }
    }

    /// Whether the batch has no examples.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The batch cut into `parts` runs of consecutive rows whose sizes differ by at most one
    /// (fewer parts if there are fewer rows), in order.
    pub fn split(&self, parts: usize) -> Vec<Batch> {
        let n = self.len();
        let parts = parts.clamp(1, n.max(1));
        let bounds = (0..=parts).map(|i| i * n / parts).collect::<Vec<_>>();
        bounds
            .windows(2)
            .map(|w| match self {
                Batch::Tokens(t) => Batch::Tokens(t.clone().narrow(0, w[0], w[1] - w[0])),
                Batch::Pairs { x, y } => Batch::Pairs {
                    x: x.clone().narrow(0, w[0], w[1] - w[0]),
                    y: y.clone().narrow(0, w[0], w[1] - w[0]),
                },
            })
            .collect()
    }
}

/// Where language batches come from.
#[derive(Debug, Clone)]
pub enum Language {
    /// A Markov chain.
    Markov(MarkovSource),
    /// A text file.
    Text(TextCorpus),
}

/// A task: batches, validation data, the optimum.
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)] // one per run
pub enum Task {
    /// Next-token prediction, cross-entropy in nats per token.
    Language {
        /// The source.
        source: Language,
        /// Targets per sequence.
        seq_len: usize,
    },
    /// Regression, mean squared error per output element.
    Regression(Regression),
}

impl Task {
    /// Builds the task of a config whose FFN resolves to `ffn` ([`TrainConfig::ffn`]) on
    /// `device` (teacher and map weights live there).
    pub fn new(config: &TrainConfig, ffn: &FeedForwardConfig, device: &Device) -> Result<Self> {
        Self::build(config, ffn, device, None)
    }

    /// The task of the run in folder `run`: a Markov source's `π` comes from the folder's
    /// `markov.bin` (solved and cached there when missing or damaged), and a text file is
    /// tokenised with the run's `vocab.json`.
    pub fn of_run(
        config: &TrainConfig,
        ffn: &FeedForwardConfig,
        device: &Device,
        run: &Path,
    ) -> Result<Self> {
        Self::build(config, ffn, device, Some(run))
    }

    fn build(
        config: &TrainConfig,
        ffn: &FeedForwardConfig,
        device: &Device,
        run: Option<&Path>,
    ) -> Result<Self> {
        let seed = config.seed;
        Ok(match &config.task {
            TaskConfig::Markov(m) => {
                let cache = run.map(|run| run.join(MARKOV));
                Task::Language {
                    source: Language::Markov(MarkovSource::cached(m, seed, cache.as_deref())),
                    seq_len: m.seq_len,
                }
            }
            TaskConfig::Text(t) => {
                let vocab = run.map(read_vocab).transpose()?;
                Task::Language {
                    source: Language::Text(TextCorpus::load(t, vocab)?),
                    seq_len: t.seq_len,
                }
            }
            TaskConfig::Teacher(t) => {
                let d = ffn.d_model;
                let teacher: FeedForwardConfig = match &t.teacher {
                    Some(spec) => spec.resolve(d, "task.teacher")?,
                    None => ffn.clone(),
                }
                .with_dropout(0.0)
                .with_initializer(burn::nn::Initializer::KaimingNormal {
                    gain: t.teacher_gain,
                    fan_out_only: false,
                });
                device.seed(Rng::derive_seed(seed, "teacher", 0));
                let teacher = teacher
                    .try_init(device)
                    .map_err(|source| Error::Ffn {
                        context: "task.teacher".into(),
                        source,
                    })?
                    .no_grad();
                Task::Regression(Regression {
                    d_model: d,
                    noise: t.noise,
                    target: Target::Teacher(teacher),
                })
            }
            TaskConfig::Sine(s) => {
                let d = ffn.d_model;
                device.seed(Rng::derive_seed(seed, "sine", 0));
                let std = s.frequency / (d as f64).sqrt();
                let a = Tensor::<2>::random([d, d], Distribution::Normal(0.0, std), device);
                let b = Tensor::<1>::random(
                    [d],
                    Distribution::Uniform(0.0, std::f64::consts::TAU),
                    device,
                );
                Task::Regression(Regression {
                    d_model: d,
                    noise: s.noise,
                    target: Target::Sine { a, b },
                })
            }
        })
    }

    /// The best achievable validation loss, when known.
    pub fn optimal_loss(&self) -> Option<f64> {
        match self {
            Task::Language {
                source: Language::Markov(m),
                seq_len,
            } => Some(m.optimal_loss(*seq_len)),
            Task::Language { .. } => None,
            Task::Regression(r) => Some(r.noise * r.noise),
        }
    }

    /// Why [`optimal_loss`](Self::optimal_loss) is only approximate, when it is: a Markov
    /// source whose stationary distribution did not converge within the bounded work.
    pub fn warning(&self) -> Option<String> {
        match self {
            Task::Language {
                source: Language::Markov(m),
                ..
            } if !m.converged() => Some(format!(
                "the Markov source mixes too slowly for its stationary distribution to converge \
                 (residual {:.1e} after the bounded power iteration): the optimum and gap are \
                 approximate; a larger task.smoothing or task.support mixes faster",
                m.residual()
            )),
            _ => None,
        }
    }

    /// The tokeniser of a language task.
    pub fn vocab(&self) -> Option<Vocab> {
        match self {
            Task::Language {
                source: Language::Markov(m),
                ..
            } => Some(Vocab::Chars {
                chars: MARKOV_ALPHABET.chars().take(m.vocab_size()).collect(),
            }),
            Task::Language {
                source: Language::Text(t),
                ..
            } => Some(t.vocab().clone()),
            Task::Regression(_) => None,
        }
    }

    /// Tokens (language) or samples (regression) per batch of `batch_size`.
    pub fn tokens_per_batch(&self, batch_size: usize) -> usize {
        match self {
            Task::Language { seq_len, .. } => batch_size * seq_len,
            Task::Regression(_) => batch_size,
        }
    }

    /// The training batch of step `step`: a function of `(seed, step)` only.
    pub fn train_batch(&self, seed: u64, step: usize, batch_size: usize, device: &Device) -> Batch {
        let mut rng = Rng::stream(seed, "train", step as u64);
        self.batch(&mut rng, batch_size, device, None)
    }

    /// The fixed validation set: `batches` batches of `batch_size`.
    pub fn valid_batches(
        &self,
        seed: u64,
        batches: usize,
        batch_size: usize,
        device: &Device,
    ) -> Vec<Batch> {
        let mut rng = Rng::stream(seed, "valid", 0);
        (0..batches)
            .map(|i| self.batch(&mut rng, batch_size, device, Some((i, batches))))
            .collect()
    }

    /// `valid = Some((i, n))` draws the `i`-th of `n` validation batches.
    fn batch(
        &self,
        rng: &mut Rng,
        batch_size: usize,
        device: &Device,
        valid: Option<(usize, usize)>,
    ) -> Batch {
        match self {
            Task::Language { source, seq_len } => {
                let len = seq_len + 1;
                let tokens: Vec<i64> = match source {
                    Language::Markov(m) => (0..batch_size)
                        .flat_map(|_| m.sample(rng, len))
                        .map(i64::from)
                        .collect(),
                    Language::Text(t) => {
                        let (data, windows) = match valid {
                            None => (&t.train, None),
                            Some((i, n)) => (&t.valid, Some((i * batch_size, n * batch_size))),
                        };
                        let last = data.len() - len;
                        (0..batch_size)
                            .flat_map(|b| {
                                // Validation windows are spread evenly over the held-out part.
                                let start = match windows {
                                    None => rng.below(last + 1),
                                    Some((first, total)) => (first + b) * last / (total - 1).max(1),
                                };
                                data[start..start + len].iter().map(|&t| i64::from(t))
                            })
                            .collect()
                    }
                };
                Batch::Tokens(Tensor::from_data(
                    TensorData::new(tokens, [batch_size, len]),
                    device,
                ))
            }
            Task::Regression(r) => {
                let (x, y) = r.sample(rng, batch_size, device);
                Batch::Pairs { x, y }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::markov::{CACHE_TAG, entropy};
    use super::*;
    use crate::config::MarkovConfig;

    fn chain(v: usize, k: usize, support: usize, smoothing: f64) -> MarkovSource {
        MarkovSource::new(
            &MarkovConfig {
                vocab_size: v,
                order: k,
                support,
                smoothing,
                seq_len: 16,
            },
            7,
        )
    }

    /// `π` is solved once and read back from the cache, which is ignored (and rewritten) when
    /// damaged or of another chain.
    #[test]
    fn the_stationary_distribution_is_cached() {
        let dir = std::env::temp_dir().join(format!("ffn-markov-cache-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("markov.bin");
        let config = |smoothing| MarkovConfig {
            vocab_size: 4,
            order: 2,
            support: 2,
            smoothing,
            seq_len: 8,
        };
        let fresh = MarkovSource::new(&config(0.1), 5);
        let solved = MarkovSource::cached(&config(0.1), 5, Some(&path));
        let written = std::fs::read(&path).unwrap();
        let read = MarkovSource::cached(&config(0.1), 5, Some(&path));
        assert_eq!(solved.stationary, fresh.stationary);
        assert_eq!(read.stationary, fresh.stationary);
        assert_eq!(read.residual, fresh.residual);
        // A cache with `π` edited is passed over: its checksum fails.
        let mut edited = written.clone();
        let at = CACHE_TAG.len() + read.key.len() + 16;
        edited[at] ^= 1;
        std::fs::write(&path, &edited).unwrap();
        let again = MarkovSource::cached(&config(0.1), 5, Some(&path));
        assert_eq!(again.stationary, fresh.stationary);
        assert_eq!(std::fs::read(&path).unwrap(), written);
        // Another chain (seed or config) does not take this one's `π`.
        let other = MarkovSource::cached(&config(0.2), 5, Some(&path));
        assert_eq!(
            other.stationary,
            MarkovSource::new(&config(0.2), 5).stationary
        );
        let other = MarkovSource::cached(&config(0.1), 6, Some(&path));
        assert_eq!(
            other.stationary,
            MarkovSource::new(&config(0.1), 6).stationary
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_uniform_chain_has_entropy_ln_v() {
        let m = chain(5, 2, 5, 1.0 - 1e-12);
        for h in m.conditional_entropies() {
            assert!((h - 5f64.ln()).abs() < 1e-9, "{h}");
        }
    }

    #[test]
    fn entropy_rate_matches_the_empirical_plug_in_estimate() {
        // The log-loss of the true conditional probabilities on a long sample converges to h.
        let m = chain(6, 2, 2, 0.05);
        let mut rng = Rng::stream(1, "test", 0);
        let n = 400_000;
        let x = m.sample(&mut rng, n);
        let v = 6;
        let mut loss = 0.0;
        for t in 2..n {
            let c = x[t - 2] as usize * v + x[t - 1] as usize;
            loss -= m.probs[c * v + x[t] as usize].ln();
        }
        let empirical = loss / (n - 2) as f64;
        let h = m.entropy_rate();
        assert!(
            (empirical - h).abs() < 0.01,
            "empirical {empirical} vs exact {h}"
        );
        // The stationary distribution is stationary.
        let mut next = vec![0.0; 36];
        for c in 0..36 {
            for s in 0..6 {
                next[(c * 6 + s) % 36] += m.stationary[c] * m.probs[c * 6 + s];
            }
        }
        for (a, b) in next.iter().zip(&m.stationary) {
            assert!((a - b).abs() < 1e-12);
        }
    }

    #[test]
    fn conditional_entropies_decrease_to_the_rate_and_match_counts() {
        let m = chain(4, 2, 2, 0.1);
        let h = m.conditional_entropies();
        assert_eq!(h.len(), 3);
        assert!(h[0] >= h[1] && h[1] >= h[2] - 1e-12, "{h:?}");
        // H(X) against the empirical unigram entropy.
        let mut rng = Rng::stream(2, "test", 0);
        let x = m.sample(&mut rng, 200_000);
        let mut counts = [0usize; 4];
        for &s in &x {
            counts[s as usize] += 1;
        }
        let unigram = entropy(counts.iter().map(|&c| c as f64 / x.len() as f64));
        assert!((unigram - h[0]).abs() < 0.005, "{unigram} vs {}", h[0]);
        // The windowed optimum lies between the rate and the unigram entropy.
        let opt = m.optimal_loss(8);
        assert!((opt - (h[1] + 7.0 * h[2]) / 8.0).abs() < 1e-12);
    }

    #[test]
    fn vocab_round_trips() {
        let chars = Vocab::Chars {
            chars: vec!['a', 'b', 'é'],
        };
        assert_eq!(chars.decode(&chars.encode("abéba").unwrap()), "abéba");
        assert!(chars.encode("abc").unwrap_err().contains("'c'"));
        assert_eq!(
            Vocab::Bytes.decode(&Vocab::Bytes.encode("héllo").unwrap()),
            "héllo"
        );
    }
}
