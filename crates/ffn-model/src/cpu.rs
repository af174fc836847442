//! # The FFN op's kernels on Flex (CPU)
//!
//! - Matrix products through a tuned SGEMM when one is found at run time (`blas.rs`), else
//!   Flex's own.
//! - The element-wise passes as one loop each over the `[tokens, d_ff]` rows, split over rayon's
//!   threads and vectorised (AVX-512 or AVX2+FMA when the CPU has them, chosen at run time). The
//!   loops use branch-free `f32` forms of `exp`, `σ` and the normal CDF that
//!   compilers vectorise; they are accurate to a few ulp (tested against f64 in this file and
//!   against PyTorch in the golden tests).
//!
//! Anything else (other dtypes, layouts the loops do not take, `tanh`) goes to the composed
//! default.

use burn::backend::{DType, Flex};
use burn::tensor::Shape;
use burn_flex::FlexTensor;
use rayon::prelude::*;

use crate::Activation;
use crate::bf16;
use crate::blas::{self, Operand};
use crate::op::{Kernels, Pre, composed};

impl Kernels for Flex {
    /// With at least as many pieces as rayon has threads, the pieces run in parallel, each
    /// with unsplit (single-threaded) matrix products: for the experts of a mixture, larger
    /// products per thread than splitting each expert's products over the threads.
    fn ffn_each<T: Send>(n: usize, work: impl Fn(usize) -> T + Sync) -> Vec<T> {
        if n < 2 || n < rayon::current_num_threads() {
            return (0..n).map(work).collect();
        }
        (0..n)
            .into_par_iter()
            .map(|i| blas::unsplit(|| work(i)))
            .collect()
    }

    /// f32 operands: the BLAS chosen at run time, else Flex's own product. bf16 operands (both):
    /// `bf16.rs`'s packed kernel on a CPU with `avx512_bf16`; elsewhere the operands are
    /// widened to f32 (exactly) and multiplied as f32: the same function, the products exact
    /// in either case and summed in f32.
    fn ffn_matmul(lhs: FlexTensor, rhs: FlexTensor) -> FlexTensor {
        use burn::backend::ops::FloatTensorOps;
        if lhs.dtype() == DType::BF16 && rhs.dtype() == DType::BF16 {
            return if bf16::available() && !widening() {
                matmul_bf16(lhs, rhs)
            } else {
                matmul_bf16_widened(lhs, rhs)
            };
        }
        match blas::get() {
            Some(blas) if lhs.dtype() == DType::F32 && rhs.dtype() == DType::F32 => {
                matmul_blas(blas, lhs, rhs)
            }
            _ => <Flex as FloatTensorOps<Flex>>::float_matmul(lhs, rhs),
        }
    }

    fn ffn_hidden(pre: &Pre<Flex>, activation: Activation) -> FlexTensor {
        let Some(act) = vectorised(activation) else {
            return composed::hidden::<Flex>(pre, activation);
        };
        match pre {
            Pre::Plain(a) => match rows(a) {
                Some(a) => {
                    let mut out = Out::new(a.rows, a.cols);
                    out.for_rows(|r, h| forward_row(act, a.row(r), None, h));
                    out.tensor()
                }
                None => composed::hidden::<Flex>(pre, activation),
            },
            Pre::Gated(g, u) => gated_forward(act, rows(g), rows(u), pre, activation),
            Pre::Fused(gu) => {
                let f = gu.layout().shape()[1] / 2;
                gated_forward(
                    act,
                    rows(&gu.narrow(1, 0, f)),
                    rows(&gu.narrow(1, f, f)),
                    pre,
                    activation,
                )
            }
        }
    }

    fn ffn_hidden_backward(dh: FlexTensor, pre: &Pre<Flex>, activation: Activation) -> Pre<Flex> {
        let (Some(act), Some(dh_rows)) = (vectorised(activation), rows(&dh)) else {
            return composed::hidden_backward::<Flex>(dh, pre, activation);
        };
        let (g, u) = match pre {
            Pre::Plain(a) => {
                let Some(a) = rows(a) else {
                    return composed::hidden_backward::<Flex>(dh, pre, activation);
                };
                // da = dh ⊙ φ'(a), written over dh when nothing else holds it (one
                // [tokens, d_ff] buffer less at the backward pass's peak).
                let contiguous = dh_rows.stride == dh_rows.cols && dh.layout().start_offset() == 0;
                let mut dh = dh;
                if contiguous && let Some(d) = dh.try_storage_mut::<f32>() {
                    let cols = a.cols.max(1);
                    let block = (16_384 / cols).max(1) * cols;
                    d.par_chunks_mut(block).enumerate().for_each(|(b, chunk)| {
                        for (i, row) in chunk.chunks_mut(cols).enumerate() {
                            backward_row_in_place(act, a.row(b * block / cols + i), row);
                        }
                    });
                    return Pre::Plain(dh);
                }
                let dh_rows = rows(&dh).expect("checked above");
                let mut out = Out::new(a.rows, a.cols);
                out.for_rows(|r, da| backward_row(act, dh_rows.row(r), a.row(r), None, da));
                return Pre::Plain(out.tensor());
            }
            Pre::Gated(g, u) => (g.clone(), u.clone()),
            Pre::Fused(gu) => {
                let f = gu.layout().shape()[1] / 2;
                (gu.narrow(1, 0, f), gu.narrow(1, f, f))
            }
        };
        let (Some(g_rows), Some(u_rows)) = (rows(&g), rows(&u)) else {
            return composed::hidden_backward::<Flex>(dh, pre, activation);
        };
        // [dg | du] as one [T, 2·d_ff] tensor: one product each for dW and dx when fused.
        let f = g_rows.cols;
        let mut out = Out::new(g_rows.rows, 2 * f);
        out.for_rows(|r, dgu| {
            let (dg, du) = dgu.split_at_mut(f);
            backward_row(
                act,
                dh_rows.row(r),
                g_rows.row(r),
                Some((u_rows.row(r), du)),
                dg,
            )
        });
        let dgu = out.tensor();
        match pre {
            Pre::Fused(_) => Pre::Fused(dgu),
            _ => Pre::Gated(dgu.narrow(1, 0, f), dgu.narrow(1, f, f)),
        }
    }
}

fn gated_forward(
    act: Act,
    g: Option<Rows<'_>>,
    u: Option<Rows<'_>>,
    pre: &Pre<Flex>,
    activation: Activation,
) -> FlexTensor {
    let (Some(g), Some(u)) = (g, u) else {
        return composed::hidden::<Flex>(pre, activation);
    };
    let mut out = Out::new(g.rows, g.cols);
    out.for_rows(|r, h| forward_row(act, g.row(r), Some(u.row(r)), h));
    out.tensor()
}

/// `lhs · rhs` by the BLAS, for 2-D f32 operands with unit stride along rows or columns.
fn matmul_blas(blas: &blas::Blas, lhs: FlexTensor, rhs: FlexTensor) -> FlexTensor {
    let (lhs, a) = operand(lhs);
    let (rhs, b) = operand(rhs);
    let [m, k] = lhs.layout().shape().dims::<2>();
    let n = rhs.layout().shape()[1];
    if m == 0 || n == 0 || k == 0 {
        let c = vec![0.0f32; m * n];
        return FlexTensor::from_data(burn::tensor::TensorData::new(c, [m, n]));
    }
    // No zero fill: with β = 0 the SGEMM writes every element of C without reading it.
    // SAFETY: `operand` checked the layouts; the SGEMM writes all m·n floats.
    unsafe { product(m, n, |c| blas.sgemm(m, n, k, a, b, c)) }
}

/// A new `[m, n]` f32 tensor whose every element `write` stores through the pointer it is
/// given, without zeroing it first.
///
/// # Safety
///
/// `write` must write all `m · n` floats.
unsafe fn product(m: usize, n: usize, write: impl FnOnce(*mut f32)) -> FlexTensor {
    let mut c: Vec<std::mem::MaybeUninit<f32>> = Vec::with_capacity(m * n);
    write(c.as_mut_ptr().cast::<f32>());
    // SAFETY: the caller's contract: every element is initialised.
    let c = unsafe {
        c.set_len(m * n);
        let mut c = std::mem::ManuallyDrop::new(c);
        Vec::from_raw_parts(c.as_mut_ptr().cast::<f32>(), c.len(), c.capacity())
    };
    FlexTensor::from_data(burn::tensor::TensorData::new(c, [m, n]))
}

/// `lhs · rhs` for bf16 operands without `avx512_bf16`: widened to f32 (exactly) and multiplied
/// by the f32 product.
fn matmul_bf16_widened(lhs: FlexTensor, rhs: FlexTensor) -> FlexTensor {
    use burn::backend::ops::FloatTensorOps;
    let widen = |t| <Flex as FloatTensorOps<Flex>>::float_cast(t, burn::tensor::FloatDType::F32);
    <Flex as Kernels>::ffn_matmul(widen(lhs), widen(rhs))
}

/// `lhs · rhs` for 2-D bf16 operands of any strides, in f32, by `bf16.rs`'s kernel.
fn matmul_bf16(lhs: FlexTensor, rhs: FlexTensor) -> FlexTensor {
    let matrix = |t: &FlexTensor| {
        let layout = t.layout();
        let strides = [layout.strides()[0], layout.strides()[1]];
        let data = t.storage::<burn::tensor::bf16>();
        (strides[0] >= 0 && strides[1] >= 0).then(|| bf16::Matrix {
            // SAFETY: bf16 is 16 bits, read as its bit pattern.
            ptr: data[layout.start_offset()..].as_ptr().cast::<u16>(),
            row_stride: strides[0] as usize,
            col_stride: strides[1] as usize,
        })
    };
    let own = |t: FlexTensor| match matrix(&t) {
        Some(_) => t,
        None => t.to_contiguous(),
    };
    let (lhs, rhs) = (own(lhs), own(rhs));
    let (a, b) = (
        matrix(&lhs).expect("non-negative strides"),
        matrix(&rhs).expect("non-negative strides"),
    );
    let [m, k] = lhs.layout().shape().dims::<2>();
    let n = rhs.layout().shape()[1];
    // SAFETY: the strides address the operands' shapes; `gemm` writes all m·n floats.
    unsafe { product(m, n, |c| bf16::gemm(m, n, k, a, b, c)) }
}

/// A 2-D tensor as a BLAS operand: row-major (`trans = false`) or the transpose of a row-major
/// matrix (`trans = true`), copied to contiguous memory if it is neither.
fn operand(t: FlexTensor) -> (FlexTensor, Operand) {
    let describe = |t: &FlexTensor| {
        let layout = t.layout();
        let [rows, cols] = layout.shape().dims::<2>();
        let [s0, s1] = [layout.strides()[0], layout.strides()[1]];
        let ptr = t.storage::<f32>()[layout.start_offset()..].as_ptr();
        if (s1 == 1 || cols == 1) && s0 >= cols.max(1) as isize {
            Some(Operand {
                ptr,
                ld: s0 as usize,
                trans: false,
            })
        } else if (s0 == 1 || rows == 1) && s1 >= rows.max(1) as isize {
            Some(Operand {
                ptr,
                ld: s1 as usize,
                trans: true,
            })
        } else {
            None
        }
    };
    match describe(&t) {
        Some(op) => (t, op),
        None => {
            let t = t.to_contiguous();
            let op = describe(&t).expect("a contiguous matrix is row-major");
            (t, op)
        }
    }
}

/// The rows of a 2-D f32 tensor whose rows are contiguous (any row stride).
#[derive(Clone, Copy)]
struct Rows<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    stride: usize,
}

impl<'a> Rows<'a> {
    fn row(&self, r: usize) -> &'a [f32] {
        &self.data[r * self.stride..r * self.stride + self.cols]
    }
}

fn rows(t: &FlexTensor) -> Option<Rows<'_>> {
    let layout = t.layout();
    if t.dtype() != DType::F32 || layout.num_dims() != 2 {
        return None;
    }
    let [rows, cols] = layout.shape().dims::<2>();
    let [s0, s1] = [layout.strides()[0], layout.strides()[1]];
    if (s1 != 1 && cols > 1) || (s0 < cols as isize && rows > 1) || s0 < 0 {
        return None;
    }
    let stride = if rows > 1 { s0 as usize } else { cols };
    let start = layout.start_offset();
    let len = if rows == 0 {
        0
    } else {
        (rows - 1) * stride + cols
    };
    Some(Rows {
        data: &t.storage::<f32>()[start..start + len],
        rows,
        cols,
        stride,
    })
}

/// A new contiguous `[rows, cols]` output, filled row block by row block on rayon's threads.
struct Out {
    data: Vec<f32>,
    rows: usize,
    cols: usize,
}

impl Out {
    fn new(rows: usize, cols: usize) -> Self {
        Self {
            data: vec![0.0; rows * cols],
            rows,
            cols,
        }
    }

    /// Calls `f(r, row)` for every row; blocks of about 16k elements go to rayon's threads.
    fn for_rows(&mut self, f: impl Fn(usize, &mut [f32]) + Sync) {
        if self.cols == 0 {
            return;
        }
        let block = (16_384 / self.cols).max(1);
        let cols = self.cols;
        self.data
            .par_chunks_mut(block * cols)
            .enumerate()
            .for_each(|(b, chunk)| {
                for (i, row) in chunk.chunks_mut(cols).enumerate() {
                    f(b * block + i, row);
                }
            });
    }

    fn tensor(self) -> FlexTensor {
        FlexTensor::from_data(burn::tensor::TensorData::new(
            self.data,
            Shape::new([self.rows, self.cols]),
        ))
    }
}

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
    (fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        fn $name($($arg: $ty),*) {
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
    fn forward_row(act: Act, a: &[f32], u: Option<&[f32]>, h: &mut [f32]) {
        Loops::forward(act, a, u, h)
    }
}

multiversion! {
    fn backward_row_in_place(act: Act, a: &[f32], d: &mut [f32]) {
        act.backward_in_place(a, d)
    }
}

multiversion! {
    fn backward_row(
        act: Act,
        dh: &[f32],
        a: &[f32],
        up: Option<(&[f32], &mut [f32])>,
        out: &mut [f32],
    ) {
        act.backward(dh, a, up, out)
    }
}

/// The activations with vectorised loops: all but `tanh`, which stays composed.
type Act = Activation;

fn vectorised(activation: Activation) -> Option<Act> {
    (activation != Activation::Tanh).then_some(activation)
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
            Activation::Tanh => unreachable!("tanh is not vectorised"),
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
            Activation::Tanh => unreachable!("tanh is not vectorised"),
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
            Activation::Tanh => unreachable!("tanh is not vectorised"),
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
/// computed directly, without cancellation. `erfc(z) = t · exp(-z² + P(t))`, `t = 1/(1 + z/2)`,
/// with the degree-9 Chebyshev fit `P` of Numerical Recipes (`erfcc`, relative error
/// < 1.2·10⁻⁷ for every `z ≥ 0`); `φ_N(x) = e^{-x²/2}/√(2π)`.
#[inline(always)]
fn gelu(x: f32) -> (f32, f32) {
    const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
    const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;
    let z = if x < 0.0 { -x } else { x } * FRAC_1_SQRT_2;
    let t = 1.0 / (1.0 + 0.5 * z);
    let mut p = 0.170_872_77;
    p = p * t - 0.822_152_23;
    p = p * t + 1.488_515_9;
    p = p * t - 1.135_204;
    p = p * t + 0.278_868_07;
    p = p * t - 0.186_288_06;
    p = p * t + 0.096_784_18;
    p = p * t + 0.374_091_96;
    p = p * t + 1.000_023_7;
    p = p * t - 1.265_512_2;
    let half_erfc = 0.5 * t * exp(p - z * z);
    let cdf = if x < 0.0 { half_erfc } else { 1.0 - half_erfc };
    (x * cdf, cdf + x * exp(-0.5 * x * x) * FRAC_1_SQRT_2PI)
}

/// Whether bf16 products take the widening fallback on a CPU that has the bf16 kernel: only
/// inside [`tests::widened`]; otherwise the CPU alone decides.
fn widening() -> bool {
    #[cfg(test)]
    return tests::WIDEN.with(std::cell::Cell::get);
    #[cfg(not(test))]
    false
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    thread_local! {
        /// Makes bf16 products on this thread take the widening fallback.
        pub(super) static WIDEN: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    /// Runs `work` with bf16 products on the widening fallback (as on a CPU without
    /// `avx512_bf16`).
    pub(crate) fn widened<T>(work: impl FnOnce() -> T) -> T {
        let before = WIDEN.with(|w| w.replace(true));
        let out = work();
        WIDEN.with(|w| w.set(before));
        out
    }

    /// A bf16 product, by the packed kernel (where the CPU has `avx512_bf16`) and by the
    /// widening fallback, equals the f64 sum of the products of the operands rounded to bf16,
    /// within the rounding of k f32 additions, for plain and transposed operands. Rounding
    /// matters: the f32 product of the unrounded operands misses that reference by far more.
    #[test]
    fn bf16_products_are_exact_products_summed_in_f32() {
        use burn::backend::ops::FloatTensorOps;
        use burn::tensor::{FloatDType, TensorData};
        let (m, n, k) = (37, 45, 300);
        let mut seed = 11u32;
        let mut values = |len: usize| -> Vec<f32> {
            (0..len)
                .map(|_| {
                    seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    (seed >> 8) as f32 / (1u32 << 24) as f32 * 4.0 - 2.0
                })
                .collect()
        };
        let (a, b) = (values(m * k), values(k * n));
        let rounded = |v: &[f32]| v.iter().map(|&x| bf16::widen(bf16::round(x))).collect();
        let (ra, rb): (Vec<f32>, Vec<f32>) = (rounded(&a), rounded(&b));
        let product = |a: &[f32], b: &[f32]| -> Vec<f64> {
            let mut c = vec![0f64; m * n];
            for i in 0..m {
                for p in 0..k {
                    for j in 0..n {
                        c[i * n + j] += a[i * k + p] as f64 * b[p * n + j] as f64;
                    }
                }
            }
            c
        };
        let want = product(&ra, &rb);
        let abs = product(
            &ra.iter().map(|x| x.abs()).collect::<Vec<_>>(),
            &rb.iter().map(|x| x.abs()).collect::<Vec<_>>(),
        );
        let worst = |c: &FlexTensor| -> f64 {
            let got = c.clone().into_data().try_to_vec::<f32>().unwrap();
            got.iter()
                .zip(&want)
                .zip(&abs)
                .map(|((&g, &w), &s)| (g as f64 - w).abs() / (k as f64 * 2f64.powi(-24) * s))
                .fold(0.0, f64::max)
        };
        let tensor = |v: &[f32], shape: [usize; 2]| {
            FlexTensor::from_data(TensorData::new(v.to_vec(), shape))
        };
        let cast = |t: FlexTensor, dtype| <Flex as FloatTensorOps<Flex>>::float_cast(t, dtype);
        let transpose = <Flex as FloatTensorOps<Flex>>::float_transpose;
        // A and B as bf16, plain and as transposed views of their transposes.
        let a16 = cast(tensor(&a, [m, k]), FloatDType::BF16);
        let b16 = cast(tensor(&b, [k, n]), FloatDType::BF16);
        let at16 = transpose(cast(transpose(tensor(&a, [m, k])), FloatDType::BF16));
        let bt16 = transpose(cast(transpose(tensor(&b, [k, n])), FloatDType::BF16));
        for (lhs, rhs) in [
            (a16.clone(), b16.clone()),
            (at16.clone(), b16.clone()),
            (a16.clone(), bt16.clone()),
            (at16, bt16),
        ] {
            let fallback = matmul_bf16_widened(lhs.clone(), rhs.clone());
            assert!(worst(&fallback) <= 1.0, "fallback: {}", worst(&fallback));
            let chosen = <Flex as Kernels>::ffn_matmul(lhs.clone(), rhs.clone());
            assert!(worst(&chosen) <= 1.0, "chosen kernel: {}", worst(&chosen));
            if bf16::available() {
                let packed = matmul_bf16(lhs, rhs);
                assert!(worst(&packed) <= 1.0, "packed: {}", worst(&packed));
            }
        }
        // Unrounded operands: the f32 product is another function.
        let plain = <Flex as Kernels>::ffn_matmul(tensor(&a, [m, k]), tensor(&b, [k, n]));
        assert!(worst(&plain) > 10.0, "{}", worst(&plain));
    }

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
        let mut f = z;
        for n in (1..=80).rev() {
            f = z + (n as f64 / 2.0) / f;
        }
        let erfc = (-z * z).exp() / (std::f64::consts::PI.sqrt() * f);
        x.signum() * (1.0 - erfc)
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
