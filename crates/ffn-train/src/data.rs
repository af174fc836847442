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
use ffn_model::{FeedForward, FeedForwardConfig};

use crate::config::{MarkovConfig, TaskConfig, TextConfig, TextLevel, TrainConfig};
use crate::error::{Error, Result};
use crate::rng::Rng;

/// The tokeniser of a language task, in its run folder.
pub const VOCAB: &str = "vocab.json";
/// A Markov source's stationary distribution, solved once, in its run folder.
pub const MARKOV: &str = "markov.bin";

pub use crate::config::MARKOV_ALPHABET;

/// A random sparse order-`k` Markov chain.
///
/// After each context `c = (x₋ₖ, …, x₋₁)` the next symbol follows
/// `P(· | c) = (1 − ε) · Dirichlet(1) on s random symbols + ε · uniform`,
/// the uniform part (`smoothing` ε) making the chain ergodic. The contexts are the states of an
/// ordinary Markov chain, `c → (x₋ₖ₊₁, …, x₋₁, s)`, with stationary distribution `π`; sequences
/// start from `π`, so every window of the stream is stationary, and
///
/// ```text
/// entropy rate        h = Σ_c π(c) H(P(· | c))
/// j < k tokens seen   H(X | X₋ⱼ … X₋₁) = H_{j+1} − H_j   (H_m: entropy of m consecutive symbols)
/// ```
#[derive(Debug, Clone)]
pub struct MarkovSource {
    vocab_size: usize,
    order: usize,
    /// `P(s | c)` at `c · V + s`.
    probs: Vec<f64>,
    /// Row-wise cumulative sums of `probs`, for sampling.
    cdf: Vec<f64>,
    /// `π(c)`.
    stationary: Vec<f64>,
    stationary_cdf: Vec<f64>,
    /// `Σ |πP − π|` at the last power iteration: below 10⁻¹⁵ when it converged.
    residual: f64,
    /// What a cached `π` must be of: the seed and the chain's config.
    key: String,
}

/// The work the power iteration for `π` may do, in multiply-adds (a few seconds): a nearly
/// reducible chain (tiny `smoothing`, small `support`) mixes too slowly to converge, and its
/// optimum is then reported as approximate rather than computed for hours.
const POWER_ITERATION_WORK: usize = 1 << 31;

fn entropy(p: impl IntoIterator<Item = f64>) -> f64 {
    p.into_iter()
        .filter(|&p| p > 0.0)
        .map(|p| -p * p.ln())
        .sum()
}

fn cumulative(p: &[f64]) -> Vec<f64> {
    let mut sum = 0.0;
    let mut cdf: Vec<f64> = p
        .iter()
        .map(|x| {
            sum += x;
            sum
        })
        .collect();
    if let Some(last) = cdf.last_mut() {
        *last = 1.0;
    }
    cdf
}

/// The start of a cached stationary distribution (`markov.bin` in a run folder): this tag, a
/// key of the chain, the number of contexts, the residual and `π`, all little-endian, then the
/// SHA-256 (hex) of everything before it.
const CACHE_TAG: &[u8; 8] = b"ffn-pi\0\x01";

/// `π` of the context chain `probs` (`contexts × v`) by power iteration, within a bounded
/// amount of work, with the residual `Σ |πP − π|` of the last iteration. Prints its progress to
/// stderr when it takes more than a second.
fn solve(probs: &[f64], v: usize, contexts: usize) -> (Vec<f64>, f64) {
    let mut stationary = vec![1.0 / contexts as f64; contexts];
    let iterations = (POWER_ITERATION_WORK / (contexts * v)).clamp(64, 100_000);
    let start = std::time::Instant::now();
    let mut shown = 0;
    let mut residual = f64::INFINITY;
    for i in 0..iterations {
        let seconds = start.elapsed().as_secs();
        if seconds > shown {
            shown = seconds;
            eprint!(
                "\rcomputing the Markov source's stationary distribution: iteration {i} of at \
                 most {iterations}"
            );
        }
        let mut next = vec![0.0; contexts];
        for c in 0..contexts {
            for s in 0..v {
                next[(c * v + s) % contexts] += stationary[c] * probs[c * v + s];
            }
        }
        let change: f64 = next
            .iter()
            .zip(&stationary)
            .map(|(a, b)| (a - b).abs())
            .sum();
        stationary = next;
        residual = change;
        if change < 1e-15 {
            break;
        }
    }
    if shown > 0 {
        eprintln!();
    }
    (stationary, residual)
}

/// The bytes of a `markov.bin` (see [`CACHE_TAG`]).
fn cache_bytes(key: &str, (stationary, residual): &(Vec<f64>, f64)) -> Vec<u8> {
    let mut bytes = CACHE_TAG.to_vec();
    bytes.extend_from_slice(key.as_bytes());
    bytes.extend_from_slice(&(stationary.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&residual.to_le_bytes());
    for p in stationary {
        bytes.extend_from_slice(&p.to_le_bytes());
    }
    let sum = crate::files::sha256(&bytes);
    bytes.extend_from_slice(sum.as_bytes());
    bytes
}

/// The cached `(π, residual)` in `path`, if it is intact and of the chain `key`.
fn read_cache(path: &Path, key: &str, contexts: usize) -> Option<(Vec<f64>, f64)> {
    let expected = CACHE_TAG.len() + key.len() + 16 + 8 * contexts + 64;
    let bytes = ffn_model::files::read_regular(path, expected as u64).ok()?;
    let (body, sum) = bytes.split_at_checked(expected - 64)?;
    if bytes.len() != expected || crate::files::sha256(body).as_bytes() != sum {
        return None;
    }
    let rest = bytes
        .strip_prefix(CACHE_TAG)?
        .strip_prefix(key.as_bytes())?;
    let word = |i: usize| <[u8; 8]>::try_from(&rest[8 * i..8 * i + 8]).expect("8 bytes");
    if u64::from_le_bytes(word(0)) != contexts as u64 {
        return None;
    }
    let residual = f64::from_le_bytes(word(1));
    let stationary: Vec<f64> = (0..contexts)
        .map(|c| f64::from_le_bytes(word(2 + c)))
        .collect();
    Some((stationary, residual))
}

impl MarkovSource {
    /// Draws the chain from the run's seed and solves for its stationary distribution.
    pub fn new(config: &MarkovConfig, seed: u64) -> Self {
        Self::cached(config, seed, None)
    }

    /// [`new`](Self::new), with `π` read from the file `cache` when it holds this chain's (a run
    /// folder's `markov.bin`), else solved and written there (atomically; a folder that cannot
    /// be written is no error): a resumed run, `eval` and `sample` do not solve again.
    pub fn cached(config: &MarkovConfig, seed: u64, cache: Option<&Path>) -> Self {
        let (v, k) = (config.vocab_size, config.order);
        let contexts = v.pow(k as u32);
        let mut rng = Rng::stream(seed, "markov", 0);
        let mut probs = vec![config.smoothing / v as f64; contexts * v];
        for c in 0..contexts {
            // `support` distinct symbols by a partial Fisher–Yates shuffle, Dirichlet(1) weights.
            let mut symbols: Vec<usize> = (0..v).collect();
            for i in 0..config.support {
                let j = i + rng.below(v - i);
                symbols.swap(i, j);
            }
            let weights: Vec<f64> = (0..config.support)
                .map(|_| -(1.0 - rng.uniform()).ln())
                .collect();
            let total: f64 = weights.iter().sum();
            for (s, w) in symbols.iter().zip(&weights) {
                probs[c * v + s] += (1.0 - config.smoothing) * w / total;
            }
        }
        let cdf = probs.chunks(v).flat_map(cumulative).collect();
        let key = crate::files::fingerprint(&format!(
            "{seed} {v} {k} {} {:e}",
            config.support, config.smoothing
        ));
        let (stationary, residual) = match cache.and_then(|path| read_cache(path, &key, contexts)) {
            Some(solved) => solved,
            None => {
                let solved = solve(&probs, v, contexts);
                if let Some(path) = cache {
                    let _ = crate::files::write_atomically(path, &cache_bytes(&key, &solved));
                }
                solved
            }
        };
        let stationary_cdf = cumulative(&stationary);
        Self {
            vocab_size: v,
            order: k,
            probs,
            cdf,
            stationary,
            stationary_cdf,
            residual,
            key,
        }
    }

    /// Writes `π` to `path` for [`cached`](Self::cached) to read.
    pub fn write_cache(&self, path: &Path) -> Result<()> {
        let solved = (self.stationary.clone(), self.residual);
        crate::files::write_atomically(path, &cache_bytes(&self.key, &solved))
    }

    /// Whether the stationary distribution `π` converged (to `Σ |πP − π| < 10⁻¹⁵`); when not,
    /// [`optimal_loss`](Self::optimal_loss) and the entropies are approximate.
    pub fn converged(&self) -> bool {
        self.residual < 1e-15
    }

    /// `Σ |πP − π|` after the last power iteration.
    pub fn residual(&self) -> f64 {
        self.residual
    }

    /// The number of symbols.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The entropy rate `h` in nats per token: the optimum given at least `k` previous tokens.
    pub fn entropy_rate(&self) -> f64 {
        let v = self.vocab_size;
        self.stationary
            .iter()
            .enumerate()
            .map(|(c, pi)| pi * entropy(self.probs[c * v..(c + 1) * v].iter().copied()))
            .sum()
    }

    /// `H(X | j previous tokens)` for `j = 0, …, k`, in nats.
    pub fn conditional_entropies(&self) -> Vec<f64> {
        let v = self.vocab_size;
        // H_m for m = 0..=k: the entropy of the last m symbols of a context under π.
        let block_entropy = |m: usize| {
            let size = v.pow(m as u32);
            let mut marginal = vec![0.0; size];
            for (c, pi) in self.stationary.iter().enumerate() {
                marginal[c % size] += pi;
            }
            entropy(marginal)
        };
        let blocks: Vec<f64> = (0..=self.order).map(block_entropy).collect();
        let mut out: Vec<f64> = blocks.windows(2).map(|w| w[1] - w[0]).collect();
        out.push(self.entropy_rate());
        out
    }

    /// The Bayes-optimal mean cross-entropy over a training sequence of `seq_len` targets,
    /// where target `i` is predicted from the `i + 1` tokens before it.
    pub fn optimal_loss(&self, seq_len: usize) -> f64 {
        let h = self.conditional_entropies();
        (0..seq_len)
            .map(|i| h[(i + 1).min(self.order)])
            .sum::<f64>()
            / seq_len as f64
    }

    /// `len` tokens of the chain, started from its stationary distribution.
    pub fn sample(&self, rng: &mut Rng, len: usize) -> Vec<u32> {
        let (v, k) = (self.vocab_size, self.order);
        let contexts = self.stationary.len();
        let mut context = rng.sample_cdf(&self.stationary_cdf);
        // The context's own symbols come first, oldest first.
        let mut out: Vec<u32> = (0..k)
            .rev()
            .map(|j| ((context / v.pow(j as u32)) % v) as u32)
            .take(len)
            .collect();
        while out.len() < len {
            let s = rng.sample_cdf(&self.cdf[context * v..(context + 1) * v]);
            out.push(s as u32);
            context = (context * v + s) % contexts;
        }
        out
    }
}

/// The tokeniser a run wrote when it started, its `vocab.json`.
pub fn read_vocab(run: &Path) -> Result<Vocab> {
    let path = run.join(VOCAB);
    let text = ffn_model::files::read_text(&path, 64 << 20).map_err(Error::io(&path))?;
    serde_json::from_str(&text).map_err(|e| Error::Checkpoint {
        path,
        message: format!("corrupt: {e}"),
    })
}

/// Token ↔ text.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Vocab {
    /// Token `i` is byte `i`.
    Bytes,
    /// Token `i` is the `i`-th character.
    Chars {
        /// The characters, in token order.
        chars: Vec<char>,
    },
}

impl Vocab {
    /// The number of tokens.
    pub fn len(&self) -> usize {
        match self {
            Vocab::Bytes => 256,
            Vocab::Chars { chars } => chars.len(),
        }
    }

    /// Whether there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tokenises `text`; a character outside the vocabulary is an error naming it.
    pub fn encode(&self, text: &str) -> std::result::Result<Vec<u32>, String> {
        match self {
            Vocab::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Vocab::Chars { chars } => text
                .chars()
                .map(|c| {
                    chars
                        .iter()
                        .position(|&x| x == c)
                        .map(|i| i as u32)
                        .ok_or_else(|| {
                            format!(
                                "the character {c:?} is not in the vocabulary ({})",
                                chars.iter().collect::<String>().escape_debug()
                            )
                        })
                })
                .collect(),
        }
    }

    /// The text of `tokens` (invalid UTF-8 from a byte model is replaced by `�`).
    pub fn decode(&self, tokens: &[u32]) -> String {
        match self {
            Vocab::Bytes => {
                String::from_utf8_lossy(&tokens.iter().map(|&t| t as u8).collect::<Vec<_>>())
                    .into_owned()
            }
            Vocab::Chars { chars } => tokens
                .iter()
                .map(|&t| chars.get(t as usize).copied().unwrap_or('\u{fffd}'))
                .collect(),
        }
    }

    /// [`decode`](Self::decode), or `None` while `tokens` end inside a UTF-8 character that
    /// more bytes could complete (for streaming a byte model's output).
    pub fn decode_complete(&self, tokens: &[u32]) -> Option<String> {
        if let Vocab::Bytes = self {
            let bytes: Vec<u8> = tokens.iter().map(|&t| t as u8).collect();
            if let Err(e) = std::str::from_utf8(&bytes)
                && e.error_len().is_none()
                && bytes.len() < 4
            {
                return None;
            }
        }
        Some(self.decode(tokens))
    }
}

/// The largest text file a run trains on (256 MiB: its tokens take 4× that in memory).
pub const MAX_TEXT: u64 = 256 << 20;

/// A text file, tokenised and split: the first `1 − valid_fraction` for training, the rest for
/// validation.
#[derive(Debug, Clone)]
pub struct TextCorpus {
    train: Vec<u32>,
    valid: Vec<u32>,
    vocab: Vocab,
}

impl TextCorpus {
    /// Reads and splits the file, tokenised with `vocab` if given (a run's own), else with the
    /// file's own characters.
    pub fn load(config: &TextConfig, vocab: Option<Vocab>) -> Result<Self> {
        let path = &config.path;
        let bytes = ffn_model::files::read_regular(path, MAX_TEXT).map_err(Error::io(path))?;
        let data_error = |message: String| Error::Data {
            path: path.clone(),
            message,
        };
        if bytes.is_empty() {
            return Err(data_error("the file is empty".into()));
        }
        let (tokens, vocab) = match config.level {
            TextLevel::Byte if matches!(vocab, None | Some(Vocab::Bytes)) => {
                (bytes.iter().map(|&b| u32::from(b)).collect(), Vocab::Bytes)
            }
            TextLevel::Byte => {
                return Err(data_error(
                    "the run's vocab.json is not a byte vocabulary; the run folder was edited"
                        .into(),
                ));
            }
            TextLevel::Char => {
                let text = String::from_utf8(bytes).map_err(|e| {
                    data_error(format!(
                        "not UTF-8 (invalid byte at offset {}); use task.level = \"byte\"",
                        e.utf8_error().valid_up_to()
                    ))
                })?;
                let vocab = vocab.unwrap_or_else(|| {
                    let mut chars: Vec<char> = text.chars().collect();
                    chars.sort_unstable();
                    chars.dedup();
                    Vocab::Chars { chars }
                });
                (vocab.encode(&text).map_err(data_error)?, vocab)
            }
        };
        let tokens: Vec<u32> = tokens;
        let n_valid = ((tokens.len() as f64) * config.valid_fraction).round() as usize;
        let need = config.seq_len + 1;
        let n_train = tokens.len() - n_valid;
        if n_valid < need || n_train < need {
            return Err(data_error(format!(
                "too short: {} tokens split into {n_train} for training and {n_valid} for \
                 validation, but each part needs at least seq_len + 1 = {need}; use a longer \
                 file or a smaller task.seq_len",
                tokens.len()
            )));
        }
        Ok(Self {
            valid: tokens[n_train..].to_vec(),
            train: tokens[..n_train].to_vec(),
            vocab,
        })
    }

    /// The tokeniser.
    pub fn vocab(&self) -> &Vocab {
        &self.vocab
    }
}

/// The target map of a regression task.
// One per task, built once and never moved in the training loop: the size is no cost.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
enum Target {
    Teacher(FeedForward),
    /// `sin(x A + b)`.
    Sine {
        a: Tensor<2>,
        b: Tensor<1>,
    },
}

/// `y = f(x) + σ ε` with `x, ε ~ N(0, I_d)`.
#[derive(Debug, Clone)]
pub struct Regression {
    d_model: usize,
    noise: f64,
    target: Target,
}

impl Regression {
    fn apply(&self, x: Tensor<2>) -> Tensor<2> {
        match &self.target {
            Target::Teacher(teacher) => teacher.forward(x),
            Target::Sine { a, b } => (x.matmul(a.clone()) + b.clone().unsqueeze()).sin(),
        }
    }

    /// `n` samples of stream `(seed, name, index)`: `(x, y)`.
    fn sample(&self, rng: &mut Rng, n: usize, device: &Device) -> (Tensor<2>, Tensor<2>) {
        let d = self.d_model;
        let mut normal =
            |count: usize| -> Vec<f32> { (0..count).map(|_| rng.normal() as f32).collect() };
        let x = Tensor::<2>::from_data(TensorData::new(normal(n * d), [n, d]), device);
        let eps = Tensor::<2>::from_data(TensorData::new(normal(n * d), [n, d]), device);
        let y = self.apply(x.clone()).detach() + eps * self.noise;
        (x, y)
    }
}

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
    use super::*;

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
