//! # Statistics of repeated runs
//!
//! The variant study compares final gaps over seeds. For `n` values `x_i`:
//!
//! ```text
//! mean   x̄ = Σ x_i / n
//! std    s = √(Σ (x_i − x̄)² / (n − 1))          (the sample standard deviation)
//! stderr   = s / √n
//! 95 % CI  = x̄ ± t_{0.975, n−1} · stderr         (Student's t, n − 1 degrees of freedom)
//! ```
//!
//! Two variants run with the same seeds are compared **paired** (Student 1908): the differences
//! `d_i = a_i − b_i` of the same seed's runs (the same data order, the same teacher) remove the
//! seed's share of the variance, and
//!
//! ```text
//! t = d̄ / (s_d / √n),   p = P(|T_{n−1}| ≥ |t|) = I_{ν/(ν+t²)}(ν/2, 1/2),   ν = n − 1
//! ```
//!
//! with `I` the regularised incomplete beta function, computed by its continued fraction
//! (Numerical Recipes, 3rd ed., §6.4) and `ln Γ` by Lanczos' approximation (g = 7, n = 9).

/// Mean, spread and 95 % confidence interval of a sample.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleStats {
    /// The number of values.
    pub n: usize,
    /// Their mean.
    pub mean: f64,
    /// The sample standard deviation (`n − 1` in the denominator; 0 for one value).
    pub std: f64,
    /// The standard error of the mean, `std / √n`.
    pub stderr: f64,
    /// The 95 % confidence interval of the mean (the mean itself for one value).
    pub ci95: (f64, f64),
}

/// The [`SampleStats`] of `values`, or `None` when there are none.
pub fn sample_stats(values: &[f64]) -> Option<SampleStats> {
    let n = values.len();
    if n == 0 {
        return None;
    }
    let mean = values.iter().sum::<f64>() / n as f64;
    let std = if n > 1 {
        (values.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt()
    } else {
        0.0
    };
    let stderr = std / (n as f64).sqrt();
    let half = if n > 1 {
        t_quantile(0.975, (n - 1) as f64) * stderr
    } else {
        0.0
    };
    Some(SampleStats {
        n,
        mean,
        std,
        stderr,
        ci95: (mean - half, mean + half),
    })
}

/// A paired t-test of `a` against `b` (equal lengths, pairs in order).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Paired {
    /// The number of pairs.
    pub n: usize,
    /// The mean difference `mean(a − b)`.
    pub mean_difference: f64,
    /// `t = d̄ / (s_d / √n)` (infinite when every difference is the same non-zero value).
    pub t: f64,
    /// The two-sided p-value, `n − 1` degrees of freedom (1 when every difference is 0).
    pub p: f64,
}

/// The paired t-test of `a` against `b`, or `None` with fewer than two pairs or unequal lengths.
pub fn paired_t_test(a: &[f64], b: &[f64]) -> Option<Paired> {
    if a.len() != b.len() || a.len() < 2 {
        return None;
    }
    let d: Vec<f64> = a.iter().zip(b).map(|(x, y)| x - y).collect();
    let s = sample_stats(&d)?;
    let (t, p) = if s.stderr > 0.0 {
        let t = s.mean / s.stderr;
        (t, t_two_sided_p(t, (s.n - 1) as f64))
    } else if s.mean == 0.0 {
        (0.0, 1.0)
    } else {
        (s.mean.signum() * f64::INFINITY, 0.0)
    };
    Some(Paired {
        n: s.n,
        mean_difference: s.mean,
        t,
        p,
    })
}

/// Holm's (1979) step-down correction of `m` p-values for testing them together: with the
/// p-values sorted, `p_(1) ≤ … ≤ p_(m)`, the adjusted `p̃_(i) = max_{j ≤ i} min(1, (m − j + 1)
/// p_(j))`; returned in the input's order. Rejecting where `p̃ < α` keeps the chance of any
/// false rejection below `α`, whatever the dependence between the tests.
pub fn holm(p: &[f64]) -> Vec<f64> {
    let m = p.len();
    let mut order: Vec<usize> = (0..m).collect();
    order.sort_by(|&a, &b| p[a].total_cmp(&p[b]));
    let mut adjusted = vec![0.0; m];
    let mut running = 0.0_f64;
    for (j, &i) in order.iter().enumerate() {
        running = running.max(((m - j) as f64 * p[i]).min(1.0));
        adjusted[i] = running;
    }
    adjusted
}

/// `P(|T_ν| ≥ |t|)` for Student's t with `ν` degrees of freedom.
pub fn t_two_sided_p(t: f64, nu: f64) -> f64 {
    incomplete_beta(nu / (nu + t * t), nu / 2.0, 0.5)
}

/// The `q`-quantile of Student's t with `ν` degrees of freedom (`0 < q < 1`), by bisection on
/// its distribution function to f64 precision.
pub fn t_quantile(q: f64, nu: f64) -> f64 {
    // P(T ≤ t) for t ≥ 0 is 1 − p/2; the quantile of q < ½ is minus that of 1 − q.
    if q < 0.5 {
        return -t_quantile(1.0 - q, nu);
    }
    let cdf = |t: f64| 1.0 - t_two_sided_p(t, nu) / 2.0;
    let (mut lo, mut hi) = (0.0, 1.0);
    while cdf(hi) < q {
        hi *= 2.0;
        if hi > 1e300 {
            return f64::INFINITY;
        }
    }
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if cdf(mid) < q {
            lo = mid;
        } else {
            hi = mid;
        }
        if hi - lo <= f64::EPSILON * hi {
            break;
        }
    }
    0.5 * (lo + hi)
}

/// `ln Γ(x)` for `x > 0` (Lanczos, g = 7, n = 9: about 15 significant digits).
fn ln_gamma(x: f64) -> f64 {
    const G: f64 = 7.0;
    const C: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        // Reflection: Γ(x) Γ(1 − x) = π / sin(πx).
        return (std::f64::consts::PI / (std::f64::consts::PI * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let mut sum = C[0];
    for (i, c) in C.iter().enumerate().skip(1) {
        sum += c / (x + i as f64);
    }
    let t = x + G + 0.5;
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + sum.ln()
}

/// The regularised incomplete beta function `I_x(a, b)`.
fn incomplete_beta(x: f64, a: f64, b: f64) -> f64 {
    if x <= 0.0 {
        return 0.0;
    }
    if x >= 1.0 {
        return 1.0;
    }
    let front =
        (ln_gamma(a + b) - ln_gamma(a) - ln_gamma(b) + a * x.ln() + b * (1.0 - x).ln()).exp();
    // The continued fraction converges fast for x < (a + 1) / (a + b + 2); else use symmetry.
    if x < (a + 1.0) / (a + b + 2.0) {
        front * beta_fraction(x, a, b) / a
    } else {
        1.0 - front * beta_fraction(1.0 - x, b, a) / b
    }
}

/// The continued fraction of `I_x(a, b)` (modified Lentz).
fn beta_fraction(x: f64, a: f64, b: f64) -> f64 {
    const TINY: f64 = 1e-300;
    let (qab, qap, qam) = (a + b, a + 1.0, a - 1.0);
    let mut c = 1.0;
    let mut d = 1.0 - qab * x / qap;
    if d.abs() < TINY {
        d = TINY;
    }
    d = 1.0 / d;
    let mut h = d;
    // One step of the modified Lentz recurrence with partial numerator `aa`: the factor it
    // multiplies `h` by.
    let mut step = |aa: f64| {
        d = 1.0 + aa * d;
        if d.abs() < TINY {
            d = TINY;
        }
        c = 1.0 + aa / c;
        if c.abs() < TINY {
            c = TINY;
        }
        d = 1.0 / d;
        d * c
    };
    for m in 1..=300 {
        let m = m as f64;
        let m2 = 2.0 * m;
        // The even step, then the odd one.
        h *= step(m * (b - m) * x / ((qam + m2) * (a + m2)));
        let delta = step(-(a + m) * (qab + m) * x / ((a + m2) * (qap + m2)));
        h *= delta;
        if (delta - 1.0).abs() < 1e-15 {
            break;
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol * b.abs().max(1.0)
    }

    /// Student's t quantiles against published tables (t_{0.975, ν}, to the tables' 4–5 digits).
    #[test]
    fn t_quantiles_match_the_tables() {
        for (nu, t) in [
            (1.0, 12.7062),
            (2.0, 4.3027),
            (4.0, 2.7764),
            (9.0, 2.2622),
            (10.0, 2.2281),
            (30.0, 2.0423),
            (1000.0, 1.9623),
        ] {
            let q = t_quantile(0.975, nu);
            assert!(close(q, t, 5e-5), "ν = {nu}: {q} vs {t}");
            assert!(close(t_quantile(0.025, nu), -t, 5e-5));
        }
        // ν = 1 is the Cauchy distribution: the 0.975-quantile is tan(0.475 π).
        let cauchy = (0.475 * std::f64::consts::PI).tan();
        assert!(close(t_quantile(0.975, 1.0), cauchy, 1e-12));
        // ν = 2 has the closed form t = (2q − 1) √(2 / (1 − (2q − 1)²)).
        let a: f64 = 2.0 * 0.975 - 1.0;
        assert!(close(
            t_quantile(0.975, 2.0),
            a * (2.0 / (1.0 - a * a)).sqrt(),
            1e-12
        ));
    }

    /// `ln Γ` against exact values, and p-values against the closed form of ν = 2:
    /// `P(|T| ≥ t) = 1 − t / √(2 + t²)`.
    #[test]
    fn ln_gamma_and_p_values_are_exact() {
        assert!(close(ln_gamma(1.0), 0.0, 1e-14));
        assert!(close(ln_gamma(5.0), 24f64.ln(), 1e-14));
        assert!(close(
            ln_gamma(0.5),
            std::f64::consts::PI.sqrt().ln(),
            1e-14
        ));
        assert!(close(
            ln_gamma(10.5),
            1_133_278.388_948_785_4f64.ln(),
            1e-13
        ));
        for t in [0.0, 0.3, 1.0, 2.5, 10.0, 100.0] {
            let p = t_two_sided_p(t, 2.0);
            let exact = 1.0 - t / (2.0 + t * t).sqrt();
            assert!(close(p, exact, 1e-12), "t = {t}: {p} vs {exact}");
        }
        // ν = 1: P(|T| ≥ t) = 1 − (2/π) atan t.
        for t in [0.5, 3.0, 40.0] {
            let exact = 1.0 - 2.0 / std::f64::consts::PI * f64::atan(t);
            assert!(close(t_two_sided_p(t, 1.0), exact, 1e-12));
        }
    }

    /// A summary and a paired test computed by hand.
    ///
    /// Values 1, 2, 3, 4, 6: mean 16/5 = 3.2, Σ(x − x̄)² = 4.84 + 1.44 + 0.04 + 0.64 + 7.84 =
    /// 14.8, s = √(14.8/4) = √3.7, stderr = √(3.7/5) = √0.74, CI = 3.2 ± 2.776445 · √0.74.
    ///
    /// Pairs a = (1.0, 2.0, 3.0, 4.0), b = (0.5, 1.9, 2.2, 3.4): d = (0.5, 0.1, 0.8, 0.6),
    /// d̄ = 0.5, Σ(d − d̄)² = 0 + 0.16 + 0.09 + 0.01 = 0.26, s_d = √(0.26/3), t = 0.5 /
    /// (s_d / 2) = 3.3968311; p (ν = 3) = 0.042560366 (2 ∫_t^∞ of the t density, integrated
    /// numerically).
    /// Holm by hand: sorted 0.01, 0.02, 0.04, 0.3 → 4·0.01 = 0.04, 3·0.02 = 0.06,
    /// 2·0.04 = 0.08, max(0.08, 1·0.3) = 0.3; a product above 1 is capped, and a smaller product
    /// after a larger one keeps the larger (monotone).
    #[test]
    fn holm_adjusts_by_hand() {
        let a = holm(&[0.04, 0.3, 0.01, 0.02]);
        for (x, y) in a.iter().zip([0.08, 0.3, 0.04, 0.06]) {
            assert!(close(*x, y, 1e-15), "{a:?}");
        }
        assert_eq!(holm(&[0.5, 0.6]), vec![1.0, 1.0]);
        // 3·0.01 = 0.03, then 2·0.012 = 0.024 < 0.03 → 0.03.
        let b = holm(&[0.01, 0.012, 0.9]);
        assert!(close(b[1], 0.03, 1e-15), "{b:?}");
        assert!(holm(&[]).is_empty());
    }

    #[test]
    fn summaries_and_paired_tests_match_hand_computed_values() {
        let s = sample_stats(&[1.0, 2.0, 3.0, 4.0, 6.0]).unwrap();
        assert_eq!(s.n, 5);
        assert!(close(s.mean, 3.2, 1e-15));
        assert!(close(s.std, 3.7f64.sqrt(), 1e-15));
        assert!(close(s.stderr, 0.74f64.sqrt(), 1e-15));
        let half = 2.776_445_105_197_8 * 0.74f64.sqrt();
        assert!(close(s.ci95.0, 3.2 - half, 1e-12) && close(s.ci95.1, 3.2 + half, 1e-12));
        let one = sample_stats(&[2.5]).unwrap();
        assert_eq!((one.std, one.ci95), (0.0, (2.5, 2.5)));
        assert_eq!(sample_stats(&[]), None);

        let p = paired_t_test(&[1.0, 2.0, 3.0, 4.0], &[0.5, 1.9, 2.2, 3.4]).unwrap();
        assert_eq!(p.n, 4);
        assert!(close(p.mean_difference, 0.5, 1e-12));
        let t = 0.5 / ((0.26f64 / 3.0).sqrt() / 2.0);
        assert!(close(p.t, t, 1e-12) && close(t, 3.396_831_1, 1e-7));
        assert!(close(p.p, 0.042_560_366, 1e-8), "p = {}", p.p);
        // Swapping the sides flips t and keeps p.
        let q = paired_t_test(&[0.5, 1.9, 2.2, 3.4], &[1.0, 2.0, 3.0, 4.0]).unwrap();
        assert!(close(q.t, -p.t, 1e-12) && close(q.p, p.p, 1e-12));
        // Degenerate cases.
        assert_eq!(paired_t_test(&[1.0], &[2.0]), None);
        assert_eq!(paired_t_test(&[1.0, 2.0], &[2.0]), None);
        let same = paired_t_test(&[1.0, 2.0], &[1.0, 2.0]).unwrap();
        assert_eq!((same.t, same.p), (0.0, 1.0));
        let shifted = paired_t_test(&[2.0, 3.0], &[1.0, 2.0]).unwrap();
        assert_eq!((shifted.t, shifted.p), (f64::INFINITY, 0.0));
    }
}
