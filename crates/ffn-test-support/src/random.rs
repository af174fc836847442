//! A seeded random stream without a dependency, and seeded property tests on it.

use std::time::{Duration, Instant};

/// xorshift64*: a reproducible stream without a dependency (gradient checks, property tests).
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform().max(1e-300), self.uniform());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }

    /// One of `items`, uniformly.
    pub fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }
}

/// Runs `case` on up to `FFN_FUZZ_CASES` seeds (else `default_cases`), stopping early after
/// `FFN_FUZZ_SECONDS` (default 60); a panic fails the test and names its seed, so that one case
/// can be replayed. Returns the number of cases run, which must reach `min(cases, 50)`.
pub fn property(
    name: &str,
    seed: u64,
    default_cases: usize,
    mut case: impl FnMut(&mut Rng),
) -> usize {
    let variable = |name: &str| std::env::var(name).ok().and_then(|v| v.parse().ok());
    let cases = variable("FFN_FUZZ_CASES").unwrap_or(default_cases);
    let time_box = Duration::from_secs(variable("FFN_FUZZ_SECONDS").unwrap_or(60) as u64);
    let start = Instant::now();
    let mut done = 0;
    for i in 0..cases {
        if start.elapsed() > time_box {
            break;
        }
        let case_seed = seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut rng = Rng(case_seed);
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| case(&mut rng)));
        assert!(
            outcome.is_ok(),
            "{name}: case {i} (seed {case_seed:#x}) panicked"
        );
        done += 1;
    }
    eprintln!("{name}: {done} cases in {:.1?}", start.elapsed());
    assert!(done >= cases.min(50), "{name}: only {done} cases ran");
    done
}
