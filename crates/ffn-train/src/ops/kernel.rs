//! What the ops' kernels share: their element types ([`Real`]: `f32` and `f64`), tensors in
//! row-major order, and [`dispatch`], which compiles a kernel for the widest vector unit the CPU
//! has.

use burn::tensor::{Shape, TensorData};
use burn_flex::FlexTensor;

/// The `f32` or `f64` elements of `x` in row-major order.
pub(crate) fn contiguous(x: &FlexTensor) -> FlexTensor {
    if x.is_contiguous() && x.layout().start_offset() == 0 {
        x.clone()
    } else {
        x.to_contiguous()
    }
}

/// A tensor of `data` (row-major) in `shape`.
pub(crate) fn new_tensor<E: Real>(data: Vec<E>, shape: impl Into<Shape>) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(data, shape.into()))
}

/// Partial sums of the reductions below: one AVX-512 register of f32.
const LANES: usize = 16;

/// `Σ_j x_j`, in [`LANES`] partial sums (a plain running sum is one chain that the compiler may
/// not reorder, so it is never vectorised).
#[inline(always)]
pub(crate) fn sum<E: Real>(x: &[E]) -> E {
    dot_by(x, x, |_| E::ONE)
}

/// `Σ_j f(x_j) y_j`, in [`LANES`] partial sums.
#[inline(always)]
pub(crate) fn dot_by<E: Real>(x: &[E], y: &[E], f: impl Fn(E) -> E) -> E {
    let mut sums = [E::ZERO; LANES];
    let (xs, ys) = (x.chunks_exact(LANES), y.chunks_exact(LANES));
    let tail = xs.remainder().iter().zip(ys.remainder());
    let tail = tail.fold(E::ZERO, |s, (&x, &y)| s + f(x) * y);
    for (x, y) in xs.zip(ys) {
        for l in 0..LANES {
            sums[l] += f(x[l]) * y[l];
        }
    }
    sums.into_iter().fold(tail, |s, x| s + x)
}

/// Calls `$f::<E, true>` compiled for AVX-512 (a tile row of `L` = 16 f32 in one register)
/// or AVX2 + FMA, the widest the CPU has, else `$f::<E, false>` compiled for the baseline
/// target.
macro_rules! dispatch {
    ($f:ident($($arg:expr),* $(,)?)) => {{
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
            unsafe fn wide<E: Real>(f: impl FnOnce()) {
                f()
            }
            #[target_feature(enable = "avx2,fma")]
            unsafe fn fast<E: Real>(f: impl FnOnce()) {
                f()
            }
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512vl")
            {
                // SAFETY: the CPU has AVX-512 F and VL (and so AVX2 and FMA).
                unsafe { wide::<E>(|| $f::<E, true>($($arg),*)) }
            } else if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                // SAFETY: the CPU has AVX2 and FMA.
                unsafe { fast::<E>(|| $f::<E, true>($($arg),*)) }
            } else {
                $f::<E, false>($($arg),*)
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        $f::<E, false>($($arg),*)
    }};
}

pub(crate) use dispatch;

/// The element types of the ops: `f32`, and `f64` (which computes in f64 whatever the
/// precision).
pub(crate) trait Real:
    Copy
    + Send
    + Sync
    + PartialOrd
    + core::ops::Add<Output = Self>
    + core::ops::Sub<Output = Self>
    + core::ops::Mul<Output = Self>
    + core::ops::Div<Output = Self>
    + core::ops::AddAssign
    + burn::tensor::Element
{
    const ZERO: Self;
    const ONE: Self;
    const NEG_INFINITY: Self;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn max(self, other: Self) -> Self;
    fn mul_add(self, a: Self, b: Self) -> Self;
    fn to_f64(self) -> f64;
    fn from_f64(x: f64) -> Self;
    /// The value rounded to bf16 (to nearest, ties to even) as a product's operand: f32 is
    /// rounded, f64 (which computes in f64 whatever the precision) is left as it is.
    fn bf16(self) -> Self;
}

impl Real for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    const NEG_INFINITY: Self = f32::NEG_INFINITY;
    #[inline(always)]
    fn exp(self) -> Self {
        ffn_model::math::exp(self)
    }
    fn ln(self) -> Self {
        f32::ln(self)
    }
    #[inline(always)]
    fn max(self, other: Self) -> Self {
        f32::max(self, other)
    }
    #[inline(always)]
    fn mul_add(self, a: Self, b: Self) -> Self {
        f32::mul_add(self, a, b)
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    #[inline(always)]
    fn bf16(self) -> Self {
        burn::tensor::bf16::from_f32(self).to_f32()
    }
}

impl Real for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    const NEG_INFINITY: Self = f64::NEG_INFINITY;
    fn exp(self) -> Self {
        f64::exp(self)
    }
    fn ln(self) -> Self {
        f64::ln(self)
    }
    fn max(self, other: Self) -> Self {
        f64::max(self, other)
    }
    #[inline(always)]
    fn mul_add(self, a: Self, b: Self) -> Self {
        f64::mul_add(self, a, b)
    }
    fn to_f64(self) -> f64 {
        self
    }
    fn from_f64(x: f64) -> Self {
        x
    }
    fn bf16(self) -> Self {
        self
    }
}
