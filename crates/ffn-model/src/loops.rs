//! # The element-wise loops of the CPU kernels
//!
//! One row at a time: `h = φ(a)` or `φ(g) ⊙ u`, their gradients, column sums, and the rounding
//! to bf16. Each loop is compiled three times (AVX-512, AVX2+FMA, baseline) and the widest one
//! the CPU runs is chosen at run time. They use branch-free `f32` forms of `exp`, `σ` and the
//! normal CDF that compilers vectorise, accurate to a few ulp (tested against f64 here, and
//! against PyTorch in the golden tests). `ffn-train`'s attention and loss kernels share [`exp`].

use std::mem::MaybeUninit;

use crate::Activation;

/// The vector unit the element-wise loops are compiled for: 2 AVX-512, 1 AVX2+FMA, 0 baseline.
fn simd_level() -> u8 {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static LEVEL: OnceLock<u8> = OnceLock::new();
        *LEVEL.get_or_init(|| {
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512vl")
            {
                2
            } else if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                1
            } else {
                0
            }
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    0
}

/// Defines `fn $name` whose body is compiled three times (AVX-512, AVX2+FMA, baseline), the
/// widest one this CPU runs being called. The body's loops are `#[inline(always)]`, so they are
/// vectorised for each.
macro_rules! multiversion {
    ($vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $vis fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
            unsafe fn avx512($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2($($arg: $ty),*) $body
            fn baseline($($arg: $ty),*) $body
            match simd_level() {
                // SAFETY: `simd_level` detected the features.
                #[cfg(target_arch = "x86_64")]
                2 => unsafe { avx512($($arg),*) },
                #[cfg(target_arch = "x86_64")]
                1 => unsafe { avx2($($arg),*) },
                _ => baseline($($arg),*),
            }
        }
    };
}

multiversion! {
    pub(crate) fn forward_row(act: Act, a: &[f32], u: Option<&[f32]>, h: &mut [f32]) {
        Loops::forward(act, a, u, h)
    }
}

multiversion! {
    pub(crate) fn backward_row_in_place(act: Act, a: &[f32], d: &mut [f32]) {
        act.backward_in_place(a, d)
    }
}

multiversion! {
    pub(crate) fn backward_row(
        act: Act,
        dh: &[f32],
        a: &[f32],
        up: Option<(&[f32], &mut [f32])>,
        out: &mut [f32],
    ) {
        act.backward(dh, a, up, out)
    }
}

multiversion! {
    fn add_into(acc: &mut [f32], row: &[f32]) {
        for (s, &v) in acc.iter_mut().zip(row) {
            *s += v;
        }
    }
}

/// `acc += row`, when there is an accumulator.
pub(crate) fn add_row(acc: Option<&mut [f32]>, row: &[f32]) {
    if let Some(acc) = acc {
        add_into(acc, row);
    }
}

multiversion! {
    pub(crate) fn round_row(x: &[f32], out: &mut [u16]) {
        for (o, &x) in out.iter_mut().zip(x) {
            *o = round_bf16(x);
        }
    }
}

// `round_row` into slots not yet written (of `unwritten`).
multiversion! {
    pub(crate) fn round_into(x: &[f32], out: &mut [MaybeUninit<u16>]) {
        for (o, &x) in out.iter_mut().zip(x) {
            o.write(round_bf16(x));
        }
    }
}

// `x` rounded to bf16 in place, each value kept as the f32 of the same value (a bf16's bits
// are an f32's high 16): operands of products that widen bf16 to f32 anyway.
multiversion! {
    pub(crate) fn round_in_place(x: &mut [f32]) {
        for v in x.iter_mut() {
            *v = f32::from_bits(u32::from(round_bf16(*v)) << 16);
        }
    }
}

// `round_in_place` of `x` into `out`.
multiversion! {
    pub(crate) fn round_f32_into(x: &[f32], out: &mut [f32]) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = f32::from_bits(u32::from(round_bf16(v)) << 16);
        }
    }
}

/// `len` bf16 slots, not zeroed: for a pass that writes every one ([`written`] then).
pub(crate) fn unwritten(len: usize) -> Vec<MaybeUninit<u16>> {
    let mut v = Vec::with_capacity(len);
    // SAFETY: `MaybeUninit` needs no initialisation.
    unsafe { v.set_len(len) };
    v
}

/// The bits of [`unwritten`] slots once every one has been written.
///
/// # Safety
///
/// Every slot must have been written.
pub(crate) unsafe fn written(v: Vec<MaybeUninit<u16>>) -> Vec<u16> {
    let mut v = std::mem::ManuallyDrop::new(v);
    // SAFETY: the caller's contract; same layout, the allocation moves over whole.
    unsafe { Vec::from_raw_parts(v.as_mut_ptr().cast::<u16>(), v.len(), v.capacity()) }
}

/// `x` rounded to bf16 (to nearest, ties to even) as its bits; NaN stays NaN (quiet), as in
/// burn's cast. Branch-free, so that [`round_row`] is vectorised.
#[inline(always)]
fn round_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    let rounded = (bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16;
    let quiet = ((bits >> 16) as u16) | 0x0040;
    if x.is_nan() { quiet } else { rounded }
}

/// The activations with vectorised loops: all but `tanh` and gpt-oss's clamped SwiGLU, which
/// stay composed.
type Act = Activation;

pub(crate) fn vectorised(activation: Activation) -> Option<Act> {
    (!matches!(activation, Activation::Tanh | Activation::SwigluOai)).then_some(activation)
}

trait Loops {
    fn forward(self, a: &[f32], u: Option<&[f32]>, h: &mut [f32]);
    fn backward_in_place(self, a: &[f32], d: &mut [f32]);
    fn backward(self, dh: &[f32], a: &[f32], up: Option<(&[f32], &mut [f32])>, out: &mut [f32]);
}

impl Loops for Activation {
    /// `h = φ(a)`, or `h = φ(g) ⊙ u` with `gate = Some(u)`.
    #[inline(always)]
    fn forward(self, a: &[f32], u: Option<&[f32]>, h: &mut [f32]) {
        match self {
            Activation::Relu => fwd(a, u, h, relu),
            Activation::Gelu => fwd(a, u, h, |x| gelu(x).0),
            Activation::GeluTanh => fwd(a, u, h, |x| gelu_tanh(x).0),
            Activation::Silu => fwd(a, u, h, |x| silu(x).0),
            Activation::Sigmoid => fwd(a, u, h, |x| sigmoid_grad(x).0),
            Activation::Identity => fwd(a, u, h, |x| x),
            Activation::Relu2 => fwd(a, u, h, |x| relu2(x).0),
            Activation::QuickGelu => fwd(a, u, h, |x| quick_gelu(x).0),
            Activation::Tanh | Activation::SwigluOai => unreachable!("not vectorised"),
        }
    }

    /// Ungated, in place: `d ← d ⊙ φ'(a)`.
    #[inline(always)]
    fn backward_in_place(self, a: &[f32], d: &mut [f32]) {
        match self {
            Activation::Relu => bwd_in_place(a, d, |x| if x > 0.0 { 1.0 } else { 0.0 }),
            Activation::Gelu => bwd_in_place(a, d, |x| gelu(x).1),
            Activation::GeluTanh => bwd_in_place(a, d, |x| gelu_tanh(x).1),
            Activation::Silu => bwd_in_place(a, d, |x| silu(x).1),
            Activation::Sigmoid => bwd_in_place(a, d, |x| sigmoid_grad(x).1),
            Activation::Identity => {}
            Activation::Relu2 => bwd_in_place(a, d, |x| relu2(x).1),
            Activation::QuickGelu => bwd_in_place(a, d, |x| quick_gelu(x).1),
            Activation::Tanh | Activation::SwigluOai => unreachable!("not vectorised"),
        }
    }

    /// Ungated: `da = dh ⊙ φ'(a)` into `out`. Gated (`up = Some((u, du))`):
    /// `dg = dh ⊙ u ⊙ φ'(g)` into `out`, `du = dh ⊙ φ(g)`.
    #[inline(always)]
    fn backward(self, dh: &[f32], a: &[f32], up: Option<(&[f32], &mut [f32])>, out: &mut [f32]) {
        match self {
            Activation::Relu => bwd(dh, a, up, out, |x| {
                (relu(x), if x > 0.0 { 1.0 } else { 0.0 })
            }),
            Activation::Gelu => bwd(dh, a, up, out, gelu),
            Activation::GeluTanh => bwd(dh, a, up, out, gelu_tanh),
            Activation::Silu => bwd(dh, a, up, out, silu),
            Activation::Sigmoid => bwd(dh, a, up, out, sigmoid_grad),
            Activation::Identity => bwd(dh, a, up, out, |x| (x, 1.0)),
            Activation::Relu2 => bwd(dh, a, up, out, relu2),
            Activation::QuickGelu => bwd(dh, a, up, out, quick_gelu),
            Activation::Tanh | Activation::SwigluOai => unreachable!("not vectorised"),
        }
    }
}

#[inline(always)]
fn bwd_in_place(a: &[f32], d: &mut [f32], grad: impl Fn(f32) -> f32) {
    for (d, &a) in d.iter_mut().zip(a) {
        *d *= grad(a);
    }
}

#[inline(always)]
fn fwd(a: &[f32], u: Option<&[f32]>, h: &mut [f32], phi: impl Fn(f32) -> f32) {
    match u {
        None => {
            for (h, &a) in h.iter_mut().zip(a) {
                *h = phi(a);
            }
        }
        Some(u) => {
            for ((h, &g), &u) in h.iter_mut().zip(a).zip(u) {
                *h = phi(g) * u;
            }
        }
    }
}

#[inline(always)]
fn bwd(
    dh: &[f32],
    a: &[f32],
    up: Option<(&[f32], &mut [f32])>,
    out: &mut [f32],
    phi_and_grad: impl Fn(f32) -> (f32, f32),
) {
    match up {
        None => {
            for ((d, &dh), &a) in out.iter_mut().zip(dh).zip(a) {
                *d = dh * phi_and_grad(a).1;
            }
        }
        Some((u, du)) => {
            for ((((dg, du), &dh), &g), &u) in out.iter_mut().zip(du).zip(dh).zip(a).zip(u) {
                let (phi, grad) = phi_and_grad(g);
                *dg = dh * u * grad;
                *du = dh * phi;
            }
        }
    }
}

/// `max(x, 0)`, keeping NaN.
#[inline(always)]
fn relu(x: f32) -> f32 {
    if x < 0.0 { 0.0 } else { x }
}

/// `ReLU(x)²` and its derivative `2 ReLU(x)`.
#[inline(always)]
fn relu2(x: f32) -> (f32, f32) {
    let r = relu(x);
    (r * r, 2.0 * r)
}

/// `eˣ`, branch-free (Cephes' `expf`: `x = n ln 2 + r`, `|r| ≤ ln2/2`, a degree-6 polynomial
/// for `eʳ`, `2ⁿ` written into the exponent bits). Relative error ≤ 2 ulp; NaN stays NaN; the
/// argument is clamped to `[-87.3, 88]`, so it neither overflows nor goes subnormal.
///
/// ```
/// let e = ffn_model::math::exp(1.0);
/// assert!((e - std::f32::consts::E).abs() <= 2.0 * f32::EPSILON * e);
/// assert!(ffn_model::math::exp(f32::NAN).is_nan());
/// ```
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 · 2²³: adding it rounds to an integer, held in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let x = if x > 88.0 { 88.0 } else { x };
    let x = if x < -87.3 { -87.3 } else { x };
    let t = x * LOG2_E + ROUND;
    let n = t - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_2e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 0.166_666_65;
    p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    let n = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    e * f32::from_bits(((n + 127) << 23) as u32)
}

/// `σ(x) = 1 / (1 + e⁻ˣ)` and `σ'(x) = σ(x)(1 - σ(x))`.
#[inline(always)]
fn sigmoid_grad(x: f32) -> (f32, f32) {
    let s = 1.0 / (1.0 + exp(-x));
    (s, s * (1.0 - s))
}

/// `SiLU(x) = x σ(x)`, `SiLU'(x) = σ(x) (1 + x (1 - σ(x)))`.
#[inline(always)]
fn silu(x: f32) -> (f32, f32) {
    let s = 1.0 / (1.0 + exp(-x));
    (x * s, s * (1.0 + x * (1.0 - s)))
}

/// CLIP's `x σ(αx)`, `α = 1.702`, and its derivative `s + α x s (1 - s)`, `s = σ(αx)`.
#[inline(always)]
fn quick_gelu(x: f32) -> (f32, f32) {
    const ALPHA: f32 = Activation::QUICK_GELU_ALPHA as f32;
    let s = 1.0 / (1.0 + exp(-(ALPHA * x)));
    let phi = x * s;
    (phi, s + ALPHA * phi * (1.0 - s))
}

/// GELU's tanh form `x σ(2u)`, `2u = k (x + c x³)`, `k = 2√(2/π)`, and its derivative
/// `s + x s (1 - s) k (1 + 3 c x²)`, `s = σ(2u)`.
#[inline(always)]
fn gelu_tanh(x: f32) -> (f32, f32) {
    const K: f32 = 1.595_769; // 2 √(2/π)
    const C: f32 = 0.044_715;
    let x2 = x * x;
    let s = 1.0 / (1.0 + exp(-(K * x * (1.0 + C * x2))));
    let phi = x * s;
    (phi, s + phi * (1.0 - s) * K * (1.0 + 3.0 * C * x2))
}

/// Exact GELU `x Φ(x)` and its derivative `Φ(x) + x φ_N(x)`.
///
/// `Φ(x) = 1 - ½ erfc(x/√2)` for `x ≥ 0` and `½ erfc(|x|/√2)` for `x < 0`, so the tail is
/// computed directly, without cancellation. With `z = |x|/√2` and `t = 1/(1 + z/2)`,
///
/// ```text
/// erfc(z) = t · Q(t) · e^{-z²},        φ_N(x) = e^{-z²} / √(2π)
/// ```
///
/// where `Q(t) = erfcx(z)/t` (`erfcx(z) = e^{z²} erfc(z)`) is smooth on `t ∈ [0, 1]` (`z` from
/// ∞ to 0): a degree-10 Chebyshev fit in `t` (relative error 1.2·10⁻⁸; 1.5·10⁻⁷ evaluated in
/// f32) replaces the `exp(P(t))` of Numerical Recipes' `erfcc`, so that the value and the
/// derivative share one `exp`: the backward pass's two became one.
#[inline(always)]
fn gelu(x: f32) -> (f32, f32) {
    const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
    const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;
    let z = if x < 0.0 { -x } else { x } * FRAC_1_SQRT_2;
    let t = 1.0 / (1.0 + 0.5 * z);
    let mut q = 4.317_201_7e-2;
    q = q * t - 0.234_600_3;
    q = q * t + 0.493_374_75;
    q = q * t - 0.454_550_75;
    q = q * t + 0.131_840_7;
    q = q * t - 5.904_669e-2;
    q = q * t + 9.341_356e-2;
    q = q * t + 0.175_324_28;
    q = q * t + 0.246_883_86;
    q = q * t + 0.282_093_8;
    q = q * t + 0.282_094_8;
    // e^{-z²} from x (exact halving, one rounding), not from z (two more roundings, which the
    // exponential multiplies by z² in the tail).
    let e = exp(-0.5 * x * x);
    let half_erfc = 0.5 * t * q * e;
    let cdf = if x < 0.0 { half_erfc } else { 1.0 - half_erfc };
    (x * cdf, cdf + x * e * FRAC_1_SQRT_2PI)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grid() -> impl Iterator<Item = f32> {
        (-2000..=2000).map(|i| i as f32 * 0.005) // [-10, 10]
    }

    /// Largest error relative to max(|reference|, floor).
    fn worst(f: impl Fn(f32) -> f32, reference: impl Fn(f64) -> f64, floor: f64) -> f64 {
        grid()
            .map(|x| {
                let r = reference(x as f64);
                (f(x) as f64 - r).abs() / r.abs().max(floor)
            })
            .fold(0.0, f64::max)
    }

    /// GELU's left tail, relative to its own (vanishing) size: `Φ` comes from `erfc` directly,
    /// and `e^{-x²/2}` from `x` (one rounding before the exponential, which multiplies an error
    /// of its argument by `x²/2`). Measured 4.0·10⁻⁶ (value) and 3.8·10⁻⁶ (derivative) below
    /// `x = -8`; the earlier form, whose exponent came from `z = x/√2`, 1.7·10⁻⁵.
    #[test]
    fn the_gelu_tail_is_accurate_relative_to_its_size() {
        let (mut value, mut grad) = (0f64, 0f64);
        for i in 0..9_500 {
            let x = -12.5 + i as f32 * 1e-3;
            let xd = x as f64;
            let cdf = 0.5 * erfc64(-xd / 2f64.sqrt());
            let pdf = (-0.5 * xd * xd).exp() / (2.0 * std::f64::consts::PI).sqrt();
            let (v, d) = gelu(x);
            value = value.max((v as f64 / (xd * cdf) - 1.0).abs());
            grad = grad.max((d as f64 / (cdf + xd * pdf) - 1.0).abs());
        }
        assert!(
            value < 6e-6 && grad < 6e-6,
            "value {value:e}, derivative {grad:e}"
        );
    }

    /// erf in f64, independent of the kernel's formula: the Maclaurin series for |x| ≤ 3 (where
    /// its cancellation costs < 1e-12), the continued fraction of erfc beyond.
    fn erf64(x: f64) -> f64 {
        let z = x.abs();
        if z <= 3.0 {
            let (mut sum, mut term) = (0.0, x);
            for n in 0..120 {
                sum += term / (2 * n + 1) as f64;
                term *= -x * x / (n + 1) as f64;
            }
            return sum * 2.0 / std::f64::consts::PI.sqrt();
        }
        x.signum() * (1.0 - erfc64(z))
    }

    /// `erfc(z)` for `z > 3` by its continued fraction (no cancellation in the tail); `1 −
    /// erf(z)` below.
    fn erfc64(z: f64) -> f64 {
        if z <= 3.0 {
            return 1.0 - erf64(z);
        }
        let mut f = z;
        for n in (1..=80).rev() {
            f = z + (n as f64 / 2.0) / f;
        }
        (-z * z).exp() / (std::f64::consts::PI.sqrt() * f)
    }

    /// The element-wise loops' rounding to bf16 is burn's cast (the `half` crate's
    /// `bf16::from_f32`), bit for bit: ties to even, the largest finite values overflowing to
    /// infinity, subnormals, signed zeros and NaN (quieted) included.
    #[test]
    fn rounding_in_the_loops_is_burns_cast() {
        let mut x: Vec<f32> = vec![
            0.0,
            -0.0,
            1.0 + f32::EPSILON * 64.0,  // a tie: rounds to even (down)
            1.0 + f32::EPSILON * 192.0, // a tie: rounds to even (up)
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001), // a signalling NaN
            f32::from_bits(0xff80_0001),
            f32::MIN_POSITIVE / 3.0,
        ];
        let mut seed = 7u32;
        for _ in 0..100_000 {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            x.push(f32::from_bits(seed));
        }
        let mut ours = vec![0u16; x.len()];
        round_row(&x, &mut ours);
        for (&x, &ours) in x.iter().zip(&ours) {
            let cast = burn::tensor::bf16::from_f32(x).to_bits();
            assert_eq!(ours, cast, "{x:e} ({:#010x})", x.to_bits());
            assert_eq!(ours, crate::bf16::round(x), "{x:e}");
        }
    }

    #[test]
    fn exp_is_accurate_and_keeps_nan() {
        let e = worst(|x| exp(x * 8.0), |x| (x * 8.0).exp(), 0.0);
        assert!(e < 4e-7, "exp: {e}");
        assert!(exp(f32::NAN).is_nan());
        assert!(exp(-200.0) < 1e-37 && exp(-200.0) >= 0.0);
    }

    #[test]
    fn activations_and_derivatives_match_f64() {
        let cdf = |x: f64| 0.5 * (1.0 + erf64(x / 2f64.sqrt()));
        let pdf = |x: f64| (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
        let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
        let k = 2.0 * (2.0 / std::f64::consts::PI).sqrt();
        let two_u = |x: f64| k * (x + 0.044715 * x * x * x);
        type Reference<'a> = Box<dyn Fn(f64) -> (f64, f64) + 'a>;
        type Case<'a> = (&'static str, fn(f32) -> (f32, f32), Reference<'a>);
        let cases: [Case<'_>; 4] = [
            (
                "gelu",
                gelu,
                Box::new(move |x| (x * cdf(x), cdf(x) + x * pdf(x))),
            ),
            (
                "gelu_tanh",
                gelu_tanh,
                Box::new(move |x| {
                    let s = sig(two_u(x));
                    let d2u = k * (1.0 + 3.0 * 0.044715 * x * x);
                    (x * s, s + x * s * (1.0 - s) * d2u)
                }),
            ),
            (
                "silu",
                silu,
                Box::new(move |x| (x * sig(x), sig(x) * (1.0 + x * (1.0 - sig(x))))),
            ),
            (
                "sigmoid",
                sigmoid_grad,
                Box::new(move |x| (sig(x), sig(x) * (1.0 - sig(x)))),
            ),
        ];
        for (name, f, reference) in cases {
            // Relative to the larger of |value| and 1e-2, of |derivative| and 0.1: where the
            // derivative crosses zero, it is the difference of two terms of order 0.2 (GELU at
            // x = -0.75), and f32 rounding of those is the floor of any f32 formula.
            let value = worst(|x| f(x).0, |x| reference(x).0, 1e-2);
            let grad = worst(|x| f(x).1, |x| reference(x).1, 0.1);
            assert!(
                value < 2e-6 && grad < 2e-6,
                "{name}: value {value:e}, derivative {grad:e}"
            );
            assert!(f(f32::NAN).0.is_nan(), "{name} keeps NaN");
        }
    }
}
