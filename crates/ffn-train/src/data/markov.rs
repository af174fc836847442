//! A random sparse order-`k` Markov chain over `V` symbols, and its optimum: the conditional
//! entropies of its stationary stream, computed exactly.

use std::path::Path;

use crate::config::MarkovConfig;
use crate::error::Result;
use crate::rng::Rng;

/// A Markov source's stationary distribution, solved once, in its run folder.
pub const MARKOV: &str = "markov.bin";

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
    pub(super) probs: Vec<f64>,
    /// Row-wise cumulative sums of `probs`, for sampling.
    cdf: Vec<f64>,
    /// `π(c)`.
    pub(super) stationary: Vec<f64>,
    stationary_cdf: Vec<f64>,
    /// `Σ |πP − π|` at the last power iteration: below 10⁻¹⁵ when it converged.
    pub(super) residual: f64,
    /// What a cached `π` must be of: the seed and the chain's config.
    pub(super) key: String,
}

/// The work the power iteration for `π` may do, in multiply-adds (a few seconds): a nearly
/// reducible chain (tiny `smoothing`, small `support`) mixes too slowly to converge, and its
/// optimum is then reported as approximate rather than computed for hours.
const POWER_ITERATION_WORK: usize = 1 << 31;

pub(super) fn entropy(p: impl IntoIterator<Item = f64>) -> f64 {
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
pub(super) const CACHE_TAG: &[u8; 8] = b"ffn-pi\0\x01";

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
