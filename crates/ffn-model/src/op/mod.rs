//! # The FFN as one operation, with its own backward pass
//!
//! Composed from burn's tensor ops, the network leaves its backward pass to autodiff, which
//! differentiates op by op: it keeps every intermediate (`x W_up`, `φ(·)`, the gating product),
//! runs one element-wise pass per op in each direction, and on the fused `[W_gate | W_up]`
//! projection zero-pads each half's gradient back to full width. Written as one operation,
//! forward and backward are the handful of matrix products and element-wise passes the math
//! needs. For `x` of shape `[T, d_model]` (any leading dimensions are flattened into `T`):
//!
//! ```text
//! forward                                  backward (given ∂L/∂y = dy)
//! a = x W_up + b_up          (ungated)     dW_down = hᵀ dy,   db_down = Σ_T dy
//! g = x W_gate + b_gate      (gated)       dh = dy W_downᵀ
//! u = x W_up + b_up          (gated)       da = dh ⊙ φ'(a)                       (ungated)
//! h = φ(a)  or  φ(g) ⊙ u                   dg = dh ⊙ u ⊙ φ'(g),  du = dh ⊙ φ(g)   (gated)
//! y = h W_down + b_down                    dW_up = xᵀ da,  db_up = Σ_T da  (likewise gate)
//!                                          dx = da W_upᵀ  (gated: dg W_gateᵀ + du W_upᵀ)
//! ```
//!
//! Six matrix products in all (gated: nine, or six of double width when fused), each skipped
//! when nothing needs its result (`dx` when the input does not require a gradient). With the
//! fused projection, `[g | u] = x [W_gate | W_up]` is one product, `[dg | du]` is written as one
//! tensor, and `dW_gate_up = xᵀ [dg | du]` and `dx = [dg | du] [W_gate | W_up]ᵀ` are one product
//! each.
//!
//! What the backward keeps ([`Memory`]): `x` and the pre-activations `a` (or `g`, `u`), and, in
//! [`Memory::Save`] mode, `h`; in [`Memory::Recompute`] mode both passes go through the tokens
//! in chunks (the weight gradients summed over them) and `h` is recomputed from the
//! pre-activations in the backward pass (one element-wise pass, the Liger-Kernel trade).
//!
//! Each backend gets the op through burn's backend extensions. The matrix products and the two
//! element-wise passes are the [`Kernels`] of a backend: burn's own ops by default, a tuned
//! SGEMM and vectorised element-wise loops on Flex (`cpu.rs`, `loops.rs`).

use std::ops::Range;

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, DType, ExtensionType, TensorMetadata, backend_extension};
use burn::tensor::FloatDType;
use serde::{Deserialize, Serialize};

use crate::Activation;

pub(crate) mod backward;
pub(crate) mod hidden;

pub use hidden::Pre;
use hidden::rows_of;

/// What the FFN's backward pass keeps from the forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Memory {
    /// Keep `x`, the pre-activations and the hidden activations `h`.
    #[default]
    Save,
    /// Keep `x` and the pre-activations; recompute `h` in the backward pass (one element-wise
    /// pass more), and work through the tokens in chunks of about 2²¹ hidden values in both
    /// passes, so that no other `[tokens, d_ff]` tensor is ever whole: the peak memory of a
    /// step is then the saved pre-activations plus a few MiB (the Liger-Kernel trade); with
    /// hidden-layer dropout, its `[tokens, d_ff]` mask is kept too.
    Recompute,
}

/// The number format of the FFN's matrix products (the autocast recipe of mixed precision).
///
/// In `Bf16` the six (gated: nine) products take operands rounded to bfloat16 (8-bit mantissa,
/// relative rounding error at most 2⁻⁹) and sum their exact products in f32:
/// `C = Σ_k bf16(A)[i,k] · bf16(B)[k,j]`. Everything else stays f32: the parameters, their
/// gradients and the optimiser's state, the biases, the activation and its derivative, the
/// dropout mask, and the outputs of the products (`y`, `dx`, `dW`). `x` and `h` are kept for
/// the backward pass already rounded (half the memory of f32, the same function), the weights'
/// bf16 copies are made once per forward pass and kept for the backward pass.
///
/// On Flex a CPU with `avx512_bf16` runs the products on a bf16 kernel (about twice the f32
/// SGEMM's speed); any other CPU widens the rounded operands to f32 and runs the f32 product:
/// the same function at f32 speed. On a GPU (the CubeCL backends) the operands are bf16 where
/// the device computes in bf16 (CUDA), else f16 where it computes in f16 (wgpu on an adapter
/// with `shader-f16`: a 10-bit mantissa and a range of ±65504), else f32; there the products'
/// outputs come out of burn's matmul in that type too (as under PyTorch's autocast) and are
/// widened to f32. NdArray, which has no bf16 tensors, computes in f32.
/// [`operands_on`](Self::operands_on) says which applies to a device. An f64 network computes
/// in f64 whatever its precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    /// f32 operands, f32 sums.
    #[default]
    F32,
    /// bf16 operands, f32 sums.
    #[serde(alias = "bfloat16")]
    Bf16,
}

impl Precision {
    /// The type the matrix products' operands of an f32 network take on `device` in this
    /// precision: f32 for [`Precision::F32`]; for [`Precision::Bf16`], bf16 on Flex and on GPUs
    /// that compute in bf16 (CUDA), f16 on GPUs that compute in f16 but not bf16 (wgpu with
    /// `shader-f16`), f32 where there is neither (NdArray, wgpu without `shader-f16`).
    ///
    /// ```
    /// # #[cfg(feature = "flex")] {
    /// use burn::tensor::{DType, Device};
    /// use ffn_model::Precision;
    ///
    /// let cpu = Device::flex();
    /// assert_eq!(Precision::Bf16.operands_on(&cpu), DType::BF16);
    /// assert_eq!(Precision::F32.operands_on(&cpu), DType::F32);
    /// # }
    /// ```
    pub fn operands_on(self, device: &burn::tensor::Device) -> DType {
        if self == Precision::F32 {
            return DType::F32;
        }
        match device.clone().without_autodiff().as_dispatch() {
            #[cfg(feature = "flex")]
            burn::backend::DispatchDevice::Flex(_) => DType::BF16,
            #[cfg(feature = "cube")]
            burn::backend::DispatchDevice::Cube(device) => cube_operands(device),
            #[allow(unreachable_patterns)]
            _ => DType::F32,
        }
    }
}

/// The narrower float a CubeCL device computes in: bf16, else f16, else f32.
#[cfg(feature = "cube")]
fn cube_operands(device: &<burn::backend::Cube as burn::backend::BackendTypes>::Device) -> DType {
    use burn::backend::Cube;
    if Cube::supports_dtype(device, DType::BF16) {
        DType::BF16
    } else if Cube::supports_dtype(device, DType::F16) {
        DType::F16
    } else {
        DType::F32
    }
}

/// How the op is to compute: the activation, gating, layout, memory mode and precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spec {
    pub activation: Activation,
    pub gated: bool,
    pub memory: Memory,
    pub precision: Precision,
}

/// A tensor that may be absent (a bias that is switched off, `W_gate` of an ungated or fused
/// network).
#[derive(ExtensionType, Debug)]
pub enum Maybe<B: Backend> {
    Present(FloatTensor<B>),
    Absent,
}

impl<B: Backend> Maybe<B> {
    pub(crate) fn into_option(self) -> Option<FloatTensor<B>> {
        match self {
            Maybe::Present(t) => Some(t),
            Maybe::Absent => None,
        }
    }

    pub(crate) fn from_option(t: Option<FloatTensor<B>>) -> Self {
        t.map_or(Maybe::Absent, Maybe::Present)
    }
}

/// The FFN op. Call it through [`feed_forward`](crate::op::feed_forward).
#[backend_extension(
    Flex: cfg(feature = "flex"),
    NdArray: cfg(feature = "ndarray"),
    Cube: cfg(feature = "cube"),
    Autodiff
)]
pub trait FfnOps: Backend {
    /// `y = FFN(x)` for `x: [T, d_model]`. `w_up` is `[d_model, 2·d_ff]` (`[W_gate | W_up]`,
    /// with `b_up` its `[b_gate | b_up]`) when the network is gated and `w_gate` is absent.
    /// `mask`, `[T, d_ff]`, is hidden-layer dropout's `m / (1 − p)` (`m` Bernoulli): `h ← h ⊙
    /// mask`; it is a constant of the op, never differentiated.
    #[allow(clippy::too_many_arguments)]
    // burn's generated dispatch reads the arguments in one arm per backend: none without a
    // backend feature.
    #[allow(unused_variables)]
    fn feed_forward(
        x: FloatTensor<Self>,
        #[extension_type] w_gate: Maybe<Self>,
        w_up: FloatTensor<Self>,
        w_down: FloatTensor<Self>,
        #[extension_type] b_gate: Maybe<Self>,
        #[extension_type] b_up: Maybe<Self>,
        #[extension_type] b_down: Maybe<Self>,
        #[extension_type] mask: Maybe<Self>,
        spec: Spec,
    ) -> FloatTensor<Self>;
}

/// The pieces of the op that a backend may compute its own way; the defaults compose burn's ops.
pub trait Kernels: Backend {
    /// `lhs · rhs` for 2-D operands, either of which may be a transposed view, in f32. Both f32,
    /// or each as [`ffn_bf16`](Self::ffn_bf16) or [`ffn_bf16_passing`](Self::ffn_bf16_passing)
    /// returns it: by default the bf16 ones are widened to f32 (exactly) and multiplied as f32.
    fn ffn_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        let widen = |t: FloatTensor<Self>| match t.dtype() {
            DType::BF16 => Self::float_cast(t, FloatDType::F32),
            _ => t,
        };
        Self::float_matmul(widen(lhs), widen(rhs))
    }

    /// `t` rounded to bf16 (to nearest, ties to even), as a matrix product's operand: by default
    /// a bf16 tensor.
    fn ffn_bf16(t: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_cast(t, FloatDType::BF16)
    }

    /// `t` rounded to bf16 as the operand of products that follow at once and do not keep it:
    /// by default [`ffn_bf16`](Self::ffn_bf16)'s. A backend whose products widen bf16 operands
    /// to f32 anyway may instead round `t`'s values in place and leave it f32 (no copy now, no
    /// widening later); its [`ffn_matmul`](Self::ffn_matmul) then takes that f32 operand as
    /// it is, beside a bf16 one or another like it.
    fn ffn_bf16_passing(t: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::ffn_bf16(t)
    }

    /// `h = φ(a)` or `h = φ(g) ⊙ u`.
    fn ffn_hidden(pre: &Pre<Self>, activation: Activation) -> FloatTensor<Self> {
        hidden::hidden::<Self>(pre, activation)
    }

    /// Runs `work` on each of `items`, pieces of work independent of each other (the experts
    /// of the grouped op), each item moved into its call (so that what it owns, such as an
    /// expert's saved pre-activations, is held alone there), and returns the results in order:
    /// one after another by default.
    fn ffn_each<I: Send, T: Send>(items: Vec<I>, work: impl Fn(I) -> T + Sync) -> Vec<T> {
        items.into_iter().map(work).collect()
    }

    /// The gradient of the pre-activations, given `dh = ∂L/∂h`, in the form of `pre`.
    fn ffn_hidden_backward(
        dh: FloatTensor<Self>,
        pre: &Pre<Self>,
        activation: Activation,
    ) -> Pre<Self> {
        hidden::hidden_backward::<Self>(dh, pre, activation)
    }

    /// `h = φ(a)` or `φ(g) ⊙ u` as a product's operand in `precision`: by default
    /// [`ffn_hidden`](Self::ffn_hidden), then rounded. A backend may round as it computes, so
    /// that no f32 copy of `h` is ever whole.
    fn ffn_hidden_operand(
        pre: &Pre<Self>,
        activation: Activation,
        precision: Precision,
    ) -> FloatTensor<Self> {
        operand::<Self>(Self::ffn_hidden(pre, activation), precision)
    }

    /// The up projection and the hidden layer in one pass where a backend can: the
    /// pre-activations `a = x w + b` (or, gated, `[g | u]` with `w = [W_gate | W_up]`, or `g` and
    /// `u` when `gate` holds a separate `W_gate` and its bias) and `h = φ(a)` or `φ(g) ⊙ u` as
    /// the down product's operand in `precision`, each block of the (last) product's rows turned
    /// into `h` while it is still in cache. `None` (the default) where it cannot; the caller
    /// then composes [`ffn_matmul`](Self::ffn_matmul), the biases and
    /// [`ffn_hidden_operand`](Self::ffn_hidden_operand), which compute the same function.
    #[allow(clippy::type_complexity)]
    fn ffn_project_in_hidden(
        _x: &FloatTensor<Self>,
        _w: &FloatTensor<Self>,
        _b: Option<&FloatTensor<Self>>,
        _gate: Option<(&FloatTensor<Self>, Option<&FloatTensor<Self>>)>,
        _activation: Activation,
        _gated: bool,
        _precision: Precision,
    ) -> Option<(Pre<Self>, FloatTensor<Self>)> {
        None
    }

    /// `dh = dy W_downᵀ` and [`ffn_hidden_backward_operand`](Self::ffn_hidden_backward_operand)
    /// of it in one pass where a backend can, each block of `dh`'s rows turned into `d(pre)` as
    /// it comes out of the product, so that `dh` is never whole in memory. It takes the
    /// pre-activations, which it may overwrite with `d(pre)`. `Err(pre)` (the default) where it
    /// cannot; the caller then composes the two.
    #[allow(clippy::type_complexity)]
    fn ffn_down_backward_operand(
        _dy: &FloatTensor<Self>,
        _w_down: &FloatTensor<Self>,
        pre: Pre<Self>,
        _activation: Activation,
        _precision: Precision,
        _sums: bool,
    ) -> Result<(Pre<Self>, Option<FloatTensor<Self>>), Pre<Self>> {
        Err(pre)
    }

    /// [`ffn_hidden_backward`](Self::ffn_hidden_backward) as the operands of the products that
    /// follow in `precision` (as [`ffn_bf16_passing`](Self::ffn_bf16_passing) gives them), and,
    /// when `sums`, the column sums of the unrounded gradient (the biases' gradients: `[d_ff]`,
    /// or `[2·d_ff]` as `[Σ dg | Σ du]` when gated). It takes the pre-activations, which it may
    /// overwrite with the gradient. By default one pass each, rounding once `pre` is freed; a
    /// backend may do all three in one.
    fn ffn_hidden_backward_operand(
        dh: FloatTensor<Self>,
        pre: Pre<Self>,
        activation: Activation,
        precision: Precision,
        sums: bool,
    ) -> (Pre<Self>, Option<FloatTensor<Self>>) {
        let d = Self::ffn_hidden_backward(dh, &pre, activation);
        drop(pre);
        as_operands::<Self>(d, precision, sums)
    }
}

/// A gradient of the pre-activations as the products' operands in `precision`, with its column
/// sums when `sums` (see [`Kernels::ffn_hidden_backward_operand`]): one pass each.
pub(crate) fn as_operands<B: Kernels>(
    d: Pre<B>,
    precision: Precision,
    sums: bool,
) -> (Pre<B>, Option<FloatTensor<B>>) {
    let sums = sums.then(|| match &d {
        Pre::Plain(a) | Pre::Fused(a) => bias_grad::<B>(a.clone()),
        Pre::Gated(g, u) => B::float_cat(
            vec![bias_grad::<B>(g.clone()), bias_grad::<B>(u.clone())],
            0,
        ),
    });
    let d = match d {
        Pre::Plain(a) => Pre::Plain(passing_operand::<B>(a, precision)),
        Pre::Fused(gu) => Pre::Fused(passing_operand::<B>(gu, precision)),
        Pre::Gated(g, u) => Pre::Gated(
            passing_operand::<B>(g, precision),
            passing_operand::<B>(u, precision),
        ),
    };
    (d, sums)
}

/// NdArray has no bf16 tensors: it computes [`Precision::Bf16`] in f32 (the operands are left
/// as they are).
#[cfg(feature = "ndarray")]
impl Kernels for burn::backend::NdArray {
    fn ffn_bf16(t: FloatTensor<Self>) -> FloatTensor<Self> {
        t
    }
}
/// CubeCL backends round [`Precision::Bf16`]'s operands to the narrower type the device
/// computes in ([`Precision::operands_on`]: bf16 on CUDA; f16 on wgpu with `shader-f16`, since
/// WGSL has no bf16), or leave them in f32 where there is none. burn's matmul of two bf16 (f16)
/// operands sums in f32 and returns bf16 (f16): its output is widened to f32.
#[cfg(feature = "cube")]
impl Kernels for burn::backend::Cube {
    fn ffn_bf16(t: FloatTensor<Self>) -> FloatTensor<Self> {
        use burn::backend::ops::FloatTensorOps;
        match cube_operands(&t.device()) {
            DType::BF16 => Self::float_cast(t, FloatDType::BF16),
            DType::F16 => Self::float_cast(t, FloatDType::F16),
            _ => t,
        }
    }

    fn ffn_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        use burn::backend::ops::FloatTensorOps;
        let narrow = |t: &FloatTensor<Self>| matches!(t.dtype(), DType::BF16 | DType::F16);
        if narrow(&lhs) && lhs.dtype() == rhs.dtype() {
            return Self::float_cast(Self::float_matmul(lhs, rhs), FloatDType::F32);
        }
        Self::float_matmul(lhs, rhs)
    }
}

/// The inputs of the op for one backend, biases and `W_gate` optional.
pub(crate) struct Weights<B: Backend> {
    pub w_gate: Option<FloatTensor<B>>,
    pub w_up: FloatTensor<B>,
    pub w_down: FloatTensor<B>,
    pub b_gate: Option<FloatTensor<B>>,
    pub b_up: Option<FloatTensor<B>>,
    pub b_down: Option<FloatTensor<B>>,
    /// Hidden-layer dropout's `m / (1 − p)`, `[T, d_ff]`.
    pub mask: Option<FloatTensor<B>>,
}

impl<B: Backend> Weights<B> {
    /// The weights as an op's entry point receives them.
    pub(crate) fn new(
        w_gate: Maybe<B>,
        w_up: FloatTensor<B>,
        w_down: FloatTensor<B>,
        [b_gate, b_up, b_down]: [Maybe<B>; 3],
        mask: Maybe<B>,
    ) -> Self {
        Self {
            w_gate: w_gate.into_option(),
            w_up,
            w_down,
            b_gate: b_gate.into_option(),
            b_up: b_up.into_option(),
            b_down: b_down.into_option(),
            mask: mask.into_option(),
        }
    }
}

impl<B: Backend> Clone for Weights<B> {
    fn clone(&self) -> Self {
        Self {
            w_gate: self.w_gate.clone(),
            w_up: self.w_up.clone(),
            w_down: self.w_down.clone(),
            b_gate: self.b_gate.clone(),
            b_up: self.b_up.clone(),
            b_down: self.b_down.clone(),
            mask: self.mask.clone(),
        }
    }
}

impl<B: Backend> core::fmt::Debug for Weights<B> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("Weights")
    }
}

/// A matrix product's operand in `precision`: `t` itself in f32, rounded to bf16 (once: a tensor
/// already rounded is left as it is) in bf16.
pub(crate) fn operand<B: Kernels>(t: FloatTensor<B>, precision: Precision) -> FloatTensor<B> {
    match precision {
        Precision::Bf16 if t.dtype() == DType::F32 => B::ffn_bf16(t),
        _ => t,
    }
}

/// The operand in `precision` of products that follow at once and do not keep it
/// ([`Kernels::ffn_bf16_passing`]): `t` itself in f32 or when already bf16. Not for a tensor
/// that is rounded again later ([`operand`] takes an f32 one for unrounded).
pub(crate) fn passing_operand<B: Kernels>(
    t: FloatTensor<B>,
    precision: Precision,
) -> FloatTensor<B> {
    match precision {
        Precision::Bf16 if t.dtype() == DType::F32 => B::ffn_bf16_passing(t),
        _ => t,
    }
}

impl<B: Kernels> Weights<B> {
    /// The weight matrices as operands in `precision` (the biases and the mask stay f32): the
    /// bf16 copies of one forward pass, kept for its backward pass.
    pub(crate) fn operands(self, precision: Precision) -> Self {
        Self {
            w_gate: self.w_gate.map(|w| operand::<B>(w, precision)),
            w_up: operand::<B>(self.w_up, precision),
            w_down: operand::<B>(self.w_down, precision),
            ..self
        }
    }
}

/// `t + b`, with `b: [n]` broadcast over the rows of `t: [T, n]`.
pub(crate) fn add_bias<B: Backend>(t: FloatTensor<B>, b: Option<FloatTensor<B>>) -> FloatTensor<B> {
    match b {
        Some(b) => {
            let n = b.shape()[0];
            B::float_add(t, B::float_reshape(b, [1, n].into()))
        }
        None => t,
    }
}

/// `Σ_T t`: the gradient of a bias from that of the rows it was added to, `[T, n] → [n]`.
pub(crate) fn bias_grad<B: Backend>(t: FloatTensor<B>) -> FloatTensor<B> {
    let n = t.shape()[1];
    B::float_reshape(B::float_sum_dim(t, 0), [n].into())
}

pub(crate) fn t<B: Backend>(m: FloatTensor<B>) -> FloatTensor<B> {
    B::float_transpose(m)
}

/// Dropout on the hidden layer: `h ⊙ mask` (rows `r` of the mask when `h` is a chunk).
pub(crate) fn masked<B: Backend>(
    h: FloatTensor<B>,
    mask: &Option<FloatTensor<B>>,
    r: Option<&Range<usize>>,
) -> FloatTensor<B> {
    match (mask, r) {
        (None, _) => h,
        (Some(m), None) => B::float_mul(h, m.clone()),
        (Some(m), Some(r)) => B::float_mul(h, rows_of::<B>(m, r)),
    }
}

/// Elements of `[rows, d_ff]` hidden tensors that one chunk of [`Memory::Recompute`] holds
/// (8 MiB in f32).
const CHUNK_ELEMENTS: usize = 1 << 21;

/// The token ranges the op works through: all at once in [`Memory::Save`] mode; in
/// [`Memory::Recompute`] mode chunks of about [`CHUNK_ELEMENTS`] hidden values, so that no
/// `[T, d_ff]` tensor besides the saved pre-activations is ever whole.
fn chunks(pre: &Pre<impl Backend>, memory: Memory) -> Vec<Range<usize>> {
    let (rows, width) = pre.dims();
    #[cfg(test)]
    let target = tests::chunk_elements();
    #[cfg(not(test))]
    let target = CHUNK_ELEMENTS;
    let step = match memory {
        Memory::Save => rows.max(1),
        Memory::Recompute => (target / width.max(1)).max(1),
    };
    let mut ranges: Vec<Range<usize>> = (0..rows)
        .step_by(step)
        .map(|r0| r0..(r0 + step).min(rows))
        .collect();
    if ranges.is_empty() {
        ranges.push(0..0);
    }
    ranges
}

/// The forward pass on the operands of [`Weights::operands`]: the pre-activations, `y`, and `h`
/// (as the down product's operand: rounded in bf16) when it is computed whole.
pub(crate) fn forward_pass<B: Kernels>(
    x: &FloatTensor<B>,
    w: &Weights<B>,
    spec: Spec,
) -> (Pre<B>, FloatTensor<B>, Option<FloatTensor<B>>) {
    if let Some((pre, h)) = project_in_hidden(x, w, spec) {
        return (pre, project_out(h.clone(), w, spec), Some(h));
    }
    let pre = project_in(x, w, spec);
    let (y, h) = project_out_chunked(&pre, w, spec);
    (pre, y, h)
}

/// The pre-activations and `h` in one pass ([`Kernels::ffn_project_in_hidden`]), where the
/// backend has it and `h` is computed whole: in [`Memory::Save`] mode, without dropout.
fn project_in_hidden<B: Kernels>(
    x: &FloatTensor<B>,
    w: &Weights<B>,
    spec: Spec,
) -> Option<(Pre<B>, FloatTensor<B>)> {
    if spec.memory != Memory::Save || w.mask.is_some() {
        return None;
    }
    let gate = match (spec.gated, &w.w_gate) {
        (true, Some(w_gate)) => Some((w_gate, w.b_gate.as_ref())),
        _ => None,
    };
    B::ffn_project_in_hidden(
        x,
        &w.w_up,
        w.b_up.as_ref(),
        gate,
        spec.activation,
        spec.gated,
        spec.precision,
    )
}

/// `y = φ(pre) W_down + b_down`, one chunk of rows at a time (see [`chunks`]); also `h` (as the
/// product's operand: rounded in bf16) when it is computed whole. `w` holds the operands of
/// [`Weights::operands`].
fn project_out_chunked<B: Kernels>(
    pre: &Pre<B>,
    w: &Weights<B>,
    spec: Spec,
) -> (FloatTensor<B>, Option<FloatTensor<B>>) {
    let ranges = chunks(pre, spec.memory);
    if ranges.len() == 1 {
        let h = hidden_operand::<B>(pre, &w.mask, None, spec);
        return (project_out(h.clone(), w, spec), Some(h));
    }
    let parts = ranges
        .iter()
        .map(|r| {
            let h = hidden_operand::<B>(&pre.rows(r), &w.mask, Some(r), spec);
            B::ffn_matmul(h, w.w_down.clone())
        })
        .collect();
    (
        add_bias::<B>(B::float_cat(parts, 0), w.b_down.clone()),
        None,
    )
}

/// `h = φ(pre) ⊙ mask` (rows `r` of the mask when `pre` is a chunk) as a product's operand.
pub(crate) fn hidden_operand<B: Kernels>(
    pre: &Pre<B>,
    mask: &Option<FloatTensor<B>>,
    r: Option<&Range<usize>>,
    spec: Spec,
) -> FloatTensor<B> {
    match mask {
        None => B::ffn_hidden_operand(pre, spec.activation, spec.precision),
        Some(_) => operand::<B>(
            masked::<B>(B::ffn_hidden(pre, spec.activation), mask, r),
            spec.precision,
        ),
    }
}

/// `acc + t`, or `t` for the first term.
pub(crate) fn accumulate<B: Backend>(acc: &mut Option<FloatTensor<B>>, t: FloatTensor<B>) {
    *acc = Some(match acc.take() {
        Some(sum) => B::float_add(sum, t),
        None => t,
    });
}

/// The pre-activations: `a`, `(g, u)` or `[g | u]`.
pub(crate) fn project_in<B: Kernels>(x: &FloatTensor<B>, w: &Weights<B>, spec: Spec) -> Pre<B> {
    let linear = |weight: &FloatTensor<B>, bias: &Option<FloatTensor<B>>| {
        add_bias::<B>(B::ffn_matmul(x.clone(), weight.clone()), bias.clone())
    };
    match (spec.gated, &w.w_gate) {
        (false, _) => Pre::Plain(linear(&w.w_up, &w.b_up)),
        (true, Some(w_gate)) => Pre::Gated(linear(w_gate, &w.b_gate), linear(&w.w_up, &w.b_up)),
        (true, None) => Pre::Fused(linear(&w.w_up, &w.b_up)),
    }
}

/// `y = h W_down + b_down`, for `h` as [`hidden_operand`] gives it.
pub(crate) fn project_out<B: Kernels>(
    h: FloatTensor<B>,
    w: &Weights<B>,
    spec: Spec,
) -> FloatTensor<B> {
    let h = operand::<B>(h, spec.precision);
    add_bias::<B>(B::ffn_matmul(h, w.w_down.clone()), w.b_down.clone())
}

/// The op on a backend without autodiff: the forward pass only.
pub(crate) fn inference<B: Kernels>(
    x: FloatTensor<B>,
    w: Weights<B>,
    spec: Spec,
) -> FloatTensor<B> {
    let (x, w) = (
        passing_operand::<B>(x, spec.precision),
        w.operands(spec.precision),
    );
    if let Some((pre, h)) = project_in_hidden(&x, &w, spec) {
        drop(pre);
        return project_out(h, &w, spec);
    }
    let pre = project_in(&x, &w, spec);
    let h = hidden_operand::<B>(&pre, &w.mask, None, spec);
    drop(pre);
    project_out(h, &w, spec)
}

#[allow(unused_macros)] // instantiated once per backend feature: none in a build without one
macro_rules! inference_impl {
    ($backend:ty) => {
        impl FfnOps for $backend {
            fn feed_forward(
                x: FloatTensor<Self>,
                w_gate: Maybe<Self>,
                w_up: FloatTensor<Self>,
                w_down: FloatTensor<Self>,
                b_gate: Maybe<Self>,
                b_up: Maybe<Self>,
                b_down: Maybe<Self>,
                mask: Maybe<Self>,
                spec: Spec,
            ) -> FloatTensor<Self> {
                let w = Weights::new(w_gate, w_up, w_down, [b_gate, b_up, b_down], mask);
                inference::<Self>(x, w, spec)
            }
        }
    };
}

#[cfg(feature = "flex")]
inference_impl!(burn::backend::Flex);
#[cfg(feature = "ndarray")]
inference_impl!(burn::backend::NdArray);
#[cfg(feature = "cube")]
inference_impl!(burn::backend::Cube);

/// Whether `device`'s backend has the op in this build (see the crate's backend features).
pub fn supported(device: &burn::tensor::Device) -> bool {
    let device = device.clone().without_autodiff();
    match device.as_dispatch() {
        #[cfg(feature = "flex")]
        burn::backend::DispatchDevice::Flex(_) => true,
        #[cfg(feature = "ndarray")]
        burn::backend::DispatchDevice::NdArray(_) => true,
        #[cfg(feature = "cube")]
        burn::backend::DispatchDevice::Cube(_) => true,
        #[allow(unreachable_patterns)]
        _ => false,
    }
}

/// `t` rounded to `dtype` (bf16 or f16) and back, the rounding transparent to the gradient: the
/// straight-through `t + (r(t) − t)`, with the difference detached (exact in f32). The composed
/// networks' operands in [`Precision::Bf16`], `dtype` being [`Precision::operands_on`] the
/// device; `t` itself where that is `t`'s own type (f32, or an f64 network).
pub(crate) fn straight_through<const D: usize>(
    t: burn::tensor::Tensor<D>,
    dtype: DType,
) -> burn::tensor::Tensor<D> {
    if t.dtype() != DType::F32 || dtype == DType::F32 {
        return t;
    }
    let rounded = t.clone().cast(dtype).cast(t.dtype());
    t.clone() + (rounded - t).detach()
}

/// `y = FFN(x)` through the op, for `x: [T, d_model]` on a [`supported`] device.
#[allow(clippy::too_many_arguments)]
pub(crate) fn feed_forward(
    x: burn::tensor::Tensor<2>,
    w_gate: Option<burn::tensor::Tensor<2>>,
    w_up: burn::tensor::Tensor<2>,
    w_down: burn::tensor::Tensor<2>,
    b_gate: Option<burn::tensor::Tensor<1>>,
    b_up: Option<burn::tensor::Tensor<1>>,
    b_down: Option<burn::tensor::Tensor<1>>,
    mask: Option<burn::tensor::Tensor<2>>,
    spec: Spec,
) -> burn::tensor::Tensor<2> {
    use burn::backend::Dispatch;
    let maybe = |t: Option<FloatTensor<Dispatch>>| Maybe::<Dispatch>::from_option(t);
    let y = <Dispatch as FfnOps>::feed_forward(
        x.into_dispatch(),
        maybe(w_gate.map(|t| t.into_dispatch())),
        w_up.into_dispatch(),
        w_down.into_dispatch(),
        maybe(b_gate.map(|t| t.into_dispatch())),
        maybe(b_up.map(|t| t.into_dispatch())),
        maybe(b_down.map(|t| t.into_dispatch())),
        maybe(mask.map(|t| t.into_dispatch())),
        spec,
    );
    burn::tensor::Tensor::from_dispatch(y)
}

#[cfg(test)]
mod tests {
    // The tests run the op on Flex; without that feature only the thread-locals below are used.
    #![cfg_attr(not(feature = "flex"), allow(dead_code, unused_imports))]
    use std::cell::Cell;

    use burn::tensor::{DType, Device, Distribution, Tensor};

    use super::Spec;
    use crate::{Activation, FeedForwardConfig};

    thread_local! {
        /// Makes the op's backward use the identity's derivative (`φ' = 1`) instead of `φ'`.
        static BROKEN: Cell<bool> = const { Cell::new(false) };
        /// The chunk size of [`Memory::Recompute`](super::Memory) on this thread.
        static CHUNK: Cell<usize> = const { Cell::new(super::CHUNK_ELEMENTS) };
    }

    pub(super) fn chunk_elements() -> usize {
        CHUNK.with(Cell::get)
    }

    pub(super) fn maybe_break(spec: Spec) -> Spec {
        if BROKEN.with(Cell::get) {
            Spec {
                activation: Activation::Identity,
                ..spec
            }
        } else {
            spec
        }
    }

    /// `|⟨∂L/∂x, v⟩ - (L(x + εv) - L(x - εv)) / 2ε|`, relative, for `L = Σ y ⊙ g`, in f64.
    fn input_gradient_error(gated: bool, fused: bool) -> f64 {
        let device = Device::flex().autodiff();
        device.seed(3);
        let config = FeedForwardConfig::new(5, 7)
            .with_activation(Activation::Silu)
            .with_gated(gated)
            .with_fused_gate_up(fused);
        let ffn = config.init(&device);
        let normal = || {
            Tensor::<2>::random([4, 5], Distribution::Normal(0.0, 1.0), &device).cast(DType::F64)
        };
        let ffn = ffn.map(&mut F64);
        let (x, g, v) = (normal(), normal(), normal());
        let loss = |x: Tensor<2>| (ffn.forward(x) * g.clone()).sum();
        let x_grad = x.clone().require_grad();
        let grads = loss(x_grad.clone()).backward();
        let analytic: f64 = (x_grad.grad(&grads).unwrap() * v.clone())
            .sum()
            .into_scalar();
        let eps = 1e-6;
        let at = |s: f64| -> f64 { loss(x.clone() + v.clone() * (s * eps)).into_scalar() };
        let numeric = (at(1.0) - at(-1.0)) / (2.0 * eps);
        (analytic - numeric).abs() / analytic.abs().max(numeric.abs()).max(1.0)
    }

    struct F64;

    impl burn::module::ModuleMapper for F64 {
        fn map_float<const D: usize>(
            &mut self,
            param: burn::module::Param<Tensor<D>>,
        ) -> burn::module::Param<Tensor<D>> {
            let id = param.id;
            let t = param
                .val()
                .inner()
                .cast(DType::F64)
                .autodiff()
                .require_grad();
            burn::module::Param::initialized(id, t)
        }
    }

    use burn::module::Module as _;

    /// `memory = "recompute"` in chunks of a few rows (37 tokens: chunks of 3 to 10 rows, the
    /// last one short) gives the output and every gradient of `memory = "save"` (one chunk),
    /// biased and not, gated, fused and not, to f64 rounding.
    #[cfg(feature = "flex")] // the op on Flex
    #[test]
    fn recomputing_in_chunks_gives_the_same_outputs_and_gradients() {
        let device = Device::flex().autodiff();
        for (gated, fused, bias) in [
            (false, false, true),
            (true, false, false),
            (true, true, true),
        ] {
            device.seed(5);
            let config = FeedForwardConfig::new(5, 7)
                .with_activation(Activation::Gelu)
                .with_gated(gated)
                .with_fused_gate_up(fused)
                .with_bias_up(bias)
                .with_bias_gate(bias && gated)
                .with_bias_down(bias);
            let save = config.clone().init(&device).map(&mut F64);
            let x = Tensor::<2>::random([37, 5], Distribution::Normal(0.0, 1.0), &device)
                .cast(DType::F64);
            let g = Tensor::<2>::random([37, 5], Distribution::Normal(0.0, 1.0), &device)
                .cast(DType::F64);
            let run = |memory: super::Memory, chunk: usize| {
                CHUNK.with(|c| c.set(chunk));
                let mut ffn = save.clone();
                ffn.memory = memory;
                let x = x.clone().require_grad();
                let y = ffn.forward(x.clone());
                let grads = (y.clone() * g.clone()).sum().backward();
                CHUNK.with(|c| c.set(super::CHUNK_ELEMENTS));
                let mut all = vec![y.inner(), x.grad(&grads).unwrap()];
                ffn.visit(&mut Grads(&grads, &mut all));
                all
            };
            let reference = run(super::Memory::Save, super::CHUNK_ELEMENTS);
            for chunk in [3 * 7, 10 * 14] {
                let chunked = run(super::Memory::Recompute, chunk);
                assert_eq!(chunked.len(), reference.len());
                for (a, b) in chunked.into_iter().zip(&reference) {
                    let error: f64 = (a - b.clone()).abs().max().into_scalar();
                    assert!(error < 1e-12, "gated {gated}, fused {fused}: {error}");
                }
            }
        }
    }

    /// With a dropout mask, the op's output and the gradients of `x` and every weight equal
    /// those of the same function composed from burn's ops (autodiff), in `save` mode and in
    /// `recompute` mode in chunks of a few rows (the mask cut into the same rows), ungated,
    /// gated and fused, in f64.
    #[cfg(feature = "flex")] // the op on Flex
    #[test]
    fn the_dropout_mask_is_applied_forward_and_backward() {
        let device = Device::flex().autodiff();
        let (t, d, f) = (37, 5, 7);
        let data = |rows: usize, cols: usize, seed: usize| {
            let v: Vec<f64> = (0..rows * cols)
                .map(|i| ((i * 7919 + seed * 104729) % 1000) as f64 / 500.0 - 1.0)
                .collect();
            Tensor::<2>::from_data(burn::tensor::TensorData::new(v, [rows, cols]), &device)
                .cast(DType::F64)
        };
        // Every third hidden value dropped, the others scaled by 1 / (1 - p).
        let keep: Vec<f64> = (0..t * f)
            .map(|i| if i % 3 == 1 { 0.0 } else { 1.0 / 0.7 })
            .collect();
        let mask = Tensor::<2>::from_data(burn::tensor::TensorData::new(keep, [t, f]), &device)
            .cast(DType::F64);
        let (x, g) = (data(t, d, 1), data(t, d, 2));
        let (w_gate, w_up, w_down) = (data(d, f, 3), data(d, f, 4), data(f, d, 5));
        let (b_up, b_down) = (data(1, f, 6).reshape([f]), data(1, d, 7).reshape([d]));
        let phi = |a: Tensor<2>| burn::tensor::activation::gelu(a);
        for (gated, fused) in [(false, false), (true, false), (true, true)] {
            let leaves = || [&x, &w_gate, &w_up, &w_down].map(|t| t.clone().require_grad());
            let b = || (b_up.clone().require_grad(), b_down.clone().require_grad());
            let collect = |y: Tensor<2>, leaves: &[Tensor<2>; 4], b: &(Tensor<1>, Tensor<1>)| {
                let grads = (y.clone() * g.clone()).sum().backward();
                let mut all = vec![y.inner()];
                for leaf in leaves {
                    all.extend(leaf.grad(&grads).map(|t| t.reshape([1, -1])));
                }
                all.push(b.0.grad(&grads).unwrap().reshape([1, -1]));
                all.push(b.1.grad(&grads).unwrap().reshape([1, -1]));
                all
            };
            // The reference: h = φ(x W_gate) ⊙ (x W_up + b_up) or φ(x W_up + b_up), then
            // (h ⊙ mask) W_down + b_down.
            let reference = {
                let [x, w_gate, w_up, w_down] = leaves();
                let (bu, bd) = b();
                let up = x.clone().matmul(w_up.clone()) + bu.clone().unsqueeze();
                let h = if gated {
                    phi(x.clone().matmul(w_gate.clone())) * up
                } else {
                    phi(up)
                };
                let y = (h * mask.clone()).matmul(w_down.clone()) + bd.clone().unsqueeze();
                collect(y, &[x, w_gate, w_up, w_down], &(bu, bd))
            };
            for (memory, chunk) in [
                (super::Memory::Save, super::CHUNK_ELEMENTS),
                (super::Memory::Recompute, 3 * 7),
                (super::Memory::Recompute, 10 * 14),
            ] {
                let [x, w_gate, w_up, w_down] = leaves();
                let (bu, bd) = b();
                let spec = Spec {
                    activation: Activation::Gelu,
                    gated,
                    memory,
                    precision: super::Precision::F32,
                };
                CHUNK.with(|c| c.set(chunk));
                let y = if fused {
                    // [W_gate | W_up] and [0 | b_up], as one product.
                    let gu = Tensor::cat(vec![w_gate.clone(), w_up.clone()], 1);
                    let b = Tensor::cat(vec![bu.clone().zeros_like(), bu.clone()], 0);
                    super::feed_forward(
                        x.clone(),
                        None,
                        gu,
                        w_down.clone(),
                        None,
                        Some(b),
                        Some(bd.clone()),
                        Some(mask.clone()),
                        spec,
                    )
                } else {
                    super::feed_forward(
                        x.clone(),
                        gated.then(|| w_gate.clone()),
                        w_up.clone(),
                        w_down.clone(),
                        None,
                        Some(bu.clone()),
                        Some(bd.clone()),
                        Some(mask.clone()),
                        spec,
                    )
                };
                CHUNK.with(|c| c.set(super::CHUNK_ELEMENTS));
                let op = collect(y, &[x, w_gate, w_up, w_down], &(bu, bd));
                assert_eq!(op.len(), reference.len(), "gated {gated}, fused {fused}");
                for (i, (a, b)) in op.into_iter().zip(&reference).enumerate() {
                    let error: f64 = (a - b.clone()).abs().max().into_scalar();
                    assert!(
                        error < 1e-12,
                        "gated {gated}, fused {fused}, {memory:?} chunk {chunk}, tensor {i}: {error}"
                    );
                }
            }
        }
    }

    /// Collects every parameter's gradient, flattened.
    struct Grads<'a>(&'a burn::tensor::Gradients, &'a mut Vec<Tensor<2>>);

    impl burn::module::ModuleVisitor for Grads<'_> {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
            let g = param.val().grad(self.0).expect("a gradient");
            let n = g.shape().num_elements();
            self.1.push(g.reshape([1, n]));
        }
    }

    /// The finite-difference check passes on the op's backward and fails on a broken one.
    #[cfg(feature = "flex")] // the op on Flex
    #[test]
    fn a_wrong_backward_fails_the_gradient_check() {
        for (gated, fused) in [(false, false), (true, false), (true, true)] {
            let right = input_gradient_error(gated, fused);
            BROKEN.with(|b| b.set(true));
            let wrong = input_gradient_error(gated, fused);
            BROKEN.with(|b| b.set(false));
            assert!(right < 1e-7, "gated={gated} fused={fused}: {right:e}");
            assert!(
                wrong > 1e-3,
                "gated={gated} fused={fused}: not caught, {wrong:e}"
            );
        }
    }

    /// The op's outputs and gradients (`y`, `dx`, then every parameter's) for `L = Σ y ⊙ g`.
    fn outputs(ffn: &crate::FeedForward, x: &Tensor<2>, g: &Tensor<2>) -> Vec<Tensor<2>> {
        let x = x.clone().require_grad();
        let y = ffn.forward(x.clone());
        let grads = (y.clone() * g.clone()).sum().backward();
        let mut all = vec![y.inner(), x.grad(&grads).unwrap()];
        ffn.visit(&mut Grads(&grads, &mut all));
        all
    }

    /// The largest `|a − b|` over the tensors, relative to each tensor's largest `|b|`.
    fn worst(a: &[Tensor<2>], b: &[Tensor<2>]) -> f64 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(a, b)| {
                let scale: f64 = b.clone().abs().max().cast(DType::F64).into_scalar();
                let error: f64 = (a.clone() - b.clone())
                    .abs()
                    .max()
                    .cast(DType::F64)
                    .into_scalar();
                error / scale.max(1e-30)
            })
            .fold(0.0, f64::max)
    }

    /// `precision = "bf16"` through the op: the fast kernel (where the CPU has `avx512_bf16`)
    /// and the widening fallback compute the same function, to the reordering of f32 sums
    /// (≤ 1e-5 of each tensor's scale; products of ≤ 64 terms); both memory modes, gated,
    /// fused and biased. Rounding happens: the f32 op differs by far more than that, and by no
    /// more than bf16's rounding explains (each operand within 2⁻⁹ of its value, each product
    /// within 2⁻⁸, through two layers: ≤ 2⁻⁶ of a tensor's scale). And where the activation is
    /// exact in f32 (ReLU), the composed network in bf16 (which rounds `x`, the weights and `h`
    /// the same way) gives the same output to the reordering of sums.
    #[cfg(feature = "flex")]
    #[test]
    fn bf16_kernels_agree_and_round_as_documented() {
        use crate::{Memory, Precision};
        let device = Device::flex().autodiff();
        for (activation, gated, fused, memory) in [
            (Activation::Relu, false, false, Memory::Save),
            (Activation::Gelu, false, false, Memory::Save),
            (Activation::Gelu, true, true, Memory::Save),
            (Activation::Gelu, false, false, Memory::Recompute),
            (Activation::Silu, true, false, Memory::Save),
            (Activation::Silu, true, true, Memory::Recompute),
        ] {
            device.seed(9);
            let config = FeedForwardConfig::new(48, 64)
                .with_activation(activation)
                .with_gated(gated)
                .with_fused_gate_up(fused)
                .with_bias_up(true)
                .with_bias_gate(gated)
                .with_bias_down(true)
                .with_memory(memory);
            let f32_net = config.clone().init(&device);
            let mut bf16_net = f32_net.clone();
            bf16_net.precision = Precision::Bf16;
            let x = Tensor::<2>::random([37, 48], Distribution::Normal(0.0, 1.0), &device);
            let g = Tensor::<2>::random([37, 48], Distribution::Normal(0.0, 1.0), &device);
            CHUNK.with(|c| c.set(10 * 64));
            let fast = crate::cpu::tests::on_kernel(|| outputs(&bf16_net, &x, &g));
            let widened = crate::cpu::tests::widened(|| outputs(&bf16_net, &x, &g));
            let exact = outputs(&f32_net, &x, &g);
            CHUNK.with(|c| c.set(super::CHUNK_ELEMENTS));
            let case = format!("{activation:?} gated {gated} fused {fused} {memory:?}");
            let reorder = worst(&fast, &widened);
            assert!(reorder <= 1e-5, "{case}: fast vs fallback {reorder:e}");
            let rounding = worst(&fast, &exact);
            assert!(
                rounding > 1e-3,
                "{case}: bf16 hardly differs from f32: {rounding:e}"
            );
            // Smooth activations: within 2⁻⁶ everywhere (measured ≤ 5.9e-3 ≈ 1.5·2⁻⁸). ReLU's
            // output too; its gradients jump where rounding moves a pre-activation across the
            // kink (measured up to 0.12 on dW_up): bounded, not small.
            let smooth = if activation == Activation::Relu {
                assert!(worst(&fast[1..], &exact[1..]) < 0.5, "{case}");
                worst(&fast[..1], &exact[..1])
            } else {
                rounding
            };
            assert!(smooth < 2f64.powi(-6), "{case}: bf16 vs f32 {smooth:e}");
            if activation == Activation::Relu {
                let composed = bf16_net.forward_composed(x.clone()).inner();
                let error = worst(&fast[..1], &[composed]);
                assert!(error <= 1e-5, "{case}: op vs composed {error:e}");
            }
        }
    }
}
