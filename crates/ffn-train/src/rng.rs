//! Reproducible randomness: xoshiro256** (Blackman & Vigna 2018) seeded through SplitMix64.
//!
//! Every random draw of a run comes from a *stream* named by the run's seed, a purpose and an
//! index, for example `(seed, "train", step)` for the batch of a step. No generator state is
//! carried from one step to the next, so the complete RNG state of a run at step `t` is
//! `(seed, t)`: a checkpoint that stores both resumes every stream exactly, and the data of a
//! step never depends on how many draws earlier steps made.

/// A xoshiro256** generator.
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

fn splitmix64(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Rng {
    /// The generator of stream `(seed, name, index)`.
    pub fn stream(seed: u64, name: &str, index: u64) -> Self {
        let mut x = seed
            ^ crate::files::fnv1a(name.as_bytes()).rotate_left(17)
            ^ index.wrapping_mul(0xD1B5_4A32_D192_ED03);
        let s = [
            splitmix64(&mut x),
            splitmix64(&mut x),
            splitmix64(&mut x),
            splitmix64(&mut x),
        ];
        Self { s }
    }

    /// A seed for another generator (burn's device RNG) derived from this stream.
    pub fn derive_seed(seed: u64, name: &str, index: u64) -> u64 {
        Self::stream(seed, name, index).next_u64()
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in `[0, 1)`, 53 bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (Lemire's multiply-shift; the bias is below 2⁻³² for the sizes used).
    pub fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u = 1.0 - self.uniform(); // (0, 1]
        let v = self.uniform();
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }

    /// An index drawn from the cumulative distribution `cdf` (non-decreasing, last entry 1).
    pub fn sample_cdf(&mut self, cdf: &[f64]) -> usize {
        let u = self.uniform();
        cdf.partition_point(|&c| c <= u).min(cdf.len() - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_reproducible_and_distinct() {
        let a: Vec<u64> = (0..4)
            .map(|_| Rng::stream(1, "train", 5).next_u64())
            .collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
        let b = Rng::stream(1, "train", 6).next_u64();
        let c = Rng::stream(1, "valid", 5).next_u64();
        let d = Rng::stream(2, "train", 5).next_u64();
        assert!(a[0] != b && a[0] != c && a[0] != d && b != c);
    }

    #[test]
    fn moments() {
        let mut rng = Rng::stream(3, "moments", 0);
        let n = 200_000;
        let (mut s1, mut s2, mut u1) = (0.0, 0.0, 0.0);
        for _ in 0..n {
            let x = rng.normal();
            s1 += x;
            s2 += x * x;
            u1 += rng.uniform();
        }
        let n = f64::from(n);
        assert!((s1 / n).abs() < 0.01);
        assert!((s2 / n - 1.0).abs() < 0.02);
        assert!((u1 / n - 0.5).abs() < 0.005);
        let mut counts = [0usize; 3];
        for _ in 0..30_000 {
            counts[rng.sample_cdf(&[0.2, 0.5, 1.0])] += 1;
        }
        assert!(
            (counts[0] as f64 / 30_000.0 - 0.2).abs() < 0.015,
            "{counts:?}"
        );
        assert!(
            (counts[2] as f64 / 30_000.0 - 0.5).abs() < 0.015,
            "{counts:?}"
        );
    }
}
