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
//! SGEMM and vectorised element-wise loops on Flex (`cpu.rs`).

use std::ops::Range;

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, NodeGuard, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, DType, ExtensionType, Slice, TensorMetadata, backend_extension};
use burn::tensor::FloatDType;
use serde::{Deserialize, Serialize};

use crate::Activation;

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
/// the same function at f32 speed. NdArray (which has no bf16 tensors) and the CubeCL backends
/// (wgpu, CUDA) compute in f32 for now: a bf16 config runs there, as f32. An f64 network
/// computes in f64 whatever its precision.
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

/// The pre-activations (and, with the same shapes, their gradients).
#[derive(Debug, Clone)]
pub enum Pre<B: Backend> {
    /// `a = x W_up + b_up` of an ungated network, `[T, d_ff]`.
    Plain(FloatTensor<B>),
    /// `g` and `u` of a gated network, each `[T, d_ff]`.
    Gated(FloatTensor<B>, FloatTensor<B>),
    /// `[g | u]` of a fused gated network, `[T, 2·d_ff]`.
    Fused(FloatTensor<B>),
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
    /// or both as [`ffn_bf16`](Self::ffn_bf16) returns them: by default those are widened to f32
    /// (exactly) and multiplied as f32.
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

    /// `h = φ(a)` or `h = φ(g) ⊙ u`.
    fn ffn_hidden(pre: &Pre<Self>, activation: Activation) -> FloatTensor<Self> {
        composed::hidden::<Self>(pre, activation)
    }

    /// Runs `work(i)` for `i` in `0..n`, pieces of work independent of each other (the
    /// experts of the grouped op), and returns the results in order: one after another by
    /// default.
    fn ffn_each<T: Send>(n: usize, work: impl Fn(usize) -> T + Sync) -> Vec<T> {
        (0..n).map(work).collect()
    }

    /// The gradient of the pre-activations, given `dh = ∂L/∂h`, in the form of `pre`.
    fn ffn_hidden_backward(
        dh: FloatTensor<Self>,
        pre: &Pre<Self>,
        activation: Activation,
    ) -> Pre<Self> {
        composed::hidden_backward::<Self>(dh, pre, activation)
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

    /// [`ffn_hidden_backward`](Self::ffn_hidden_backward) as the products' operands in
    /// `precision`, and, when `sums`, the column sums of the unrounded gradient (the biases'
    /// gradients: `[d_ff]`, or `[2·d_ff]` as `[Σ dg | Σ du]` when gated). By default one pass
    /// each; a backend may do all three in one. A backend may also leave the gradient in f32
    /// (when rounding it later, once `pre` is freed, holds less memory at once): the caller
    /// rounds what is still f32.
    fn ffn_hidden_backward_operand(
        dh: FloatTensor<Self>,
        pre: &Pre<Self>,
        activation: Activation,
        precision: Precision,
        sums: bool,
    ) -> (Pre<Self>, Option<FloatTensor<Self>>) {
        as_operands::<Self>(
            Self::ffn_hidden_backward(dh, pre, activation),
            precision,
            sums,
        )
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
        Pre::Plain(a) => Pre::Plain(operand::<B>(a, precision)),
        Pre::Fused(gu) => Pre::Fused(operand::<B>(gu, precision)),
        Pre::Gated(g, u) => Pre::Gated(operand::<B>(g, precision), operand::<B>(u, precision)),
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
/// CubeCL backends compute [`Precision::Bf16`] in f32 for now: wgpu has no bf16 arithmetic
/// (WGSL), and the operands are left as they are.
#[cfg(feature = "cube")]
impl Kernels for burn::backend::Cube {
    fn ffn_bf16(t: FloatTensor<Self>) -> FloatTensor<Self> {
        t
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

/// Rows `r` of a `[T, n]` tensor (a view on the CPU backends).
fn rows_of<B: Backend>(m: &FloatTensor<B>, r: &Range<usize>) -> FloatTensor<B> {
    let n = m.shape()[1];
    let slices = [
        Slice::new(r.start as isize, Some(r.end as isize), 1),
        Slice::new(0, Some(n as isize), 1),
    ];
    B::float_slice(m.clone(), &slices)
}

/// Dropout on the hidden layer: `h ⊙ mask` (rows `r` of the mask when `h` is a chunk).
fn masked<B: Backend>(
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

impl<B: Backend> Pre<B> {
    fn rows(&self, r: &Range<usize>) -> Self {
        match self {
            Pre::Plain(a) => Pre::Plain(rows_of::<B>(a, r)),
            Pre::Gated(g, u) => Pre::Gated(rows_of::<B>(g, r), rows_of::<B>(u, r)),
            Pre::Fused(gu) => Pre::Fused(rows_of::<B>(gu, r)),
        }
    }

    /// Rows and total width (`d_ff`, or `2·d_ff` gated).
    fn dims(&self) -> (usize, usize) {
        let [rows, width] = match self {
            Pre::Plain(a) | Pre::Gated(a, _) => a.shape().dims::<2>(),
            Pre::Fused(gu) => gu.shape().dims::<2>(),
        };
        let gated = matches!(self, Pre::Gated(..));
        (rows, if gated { 2 * width } else { width })
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

/// `y = φ(pre) W_down + b_down`, one chunk of rows at a time (see [`chunks`]); also `h` (as the
/// product's operand: rounded in bf16) when it is computed whole. `w` holds the operands of
/// [`Weights::operands`].
pub(crate) fn project_out_chunked<B: Kernels>(
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
fn hidden_operand<B: Kernels>(
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
fn accumulate<B: Backend>(acc: &mut Option<FloatTensor<B>>, t: FloatTensor<B>) {
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
    let (x, w) = (operand::<B>(x, spec.precision), w.operands(spec.precision));
    let pre = project_in(&x, &w, spec);
    let h = hidden_operand::<B>(&pre, &w.mask, None, spec);
    drop(pre);
    project_out(h, &w, spec)
}

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

/// The parents of the op's node, in order: `x`, then the weights and biases that are present.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Present {
    w_gate: bool,
    b_gate: bool,
    b_up: bool,
    b_down: bool,
}

/// The parent nodes of an op that takes `x` and [`Weights`], by input:
/// `[x, w_gate, w_up, w_down, b_gate, b_up, b_down]`, `None` where an input is absent or needs
/// no gradient.
pub(crate) type Parents = [Option<NodeId>; 7];

impl Present {
    /// The op's parents by input, from the `N` nodes in the order [`untrack`] listed them.
    pub(crate) fn parents<T, const N: usize>(self, nodes: [Option<T>; N]) -> [Option<T>; 7] {
        let mut nodes = nodes.into_iter();
        let mut next = |is_present: bool| {
            if is_present {
                nodes.next().flatten()
            } else {
                None
            }
        };
        [
            next(true),
            next(self.w_gate),
            next(true),
            next(true),
            next(self.b_gate),
            next(self.b_up),
            next(self.b_down),
        ]
    }
}

impl Need {
    /// The inputs whose parent node exists.
    pub(crate) fn of(parents: &Parents) -> Self {
        let [x, w_gate, w_up, w_down, b_gate, b_up, b_down] =
            parents.each_ref().map(Option::is_some);
        Self {
            x,
            w_gate,
            w_up,
            w_down,
            b_gate,
            b_up,
            b_down,
        }
    }
}

impl<B: Backend> InputGrads<B> {
    /// Registers each gradient with its parent.
    pub(crate) fn register(self, parents: Parents, grads: &mut Gradients) {
        let all = [
            self.x,
            self.w_gate,
            self.w_up,
            self.w_down,
            self.b_gate,
            self.b_up,
            self.b_down,
        ];
        for (node, grad) in parents.into_iter().zip(all) {
            if let (Some(id), Some(grad)) = (node, grad) {
                grads.register::<B>(id, grad);
            }
        }
    }
}

/// Splits the autodiff inputs of an op on `x` and [`Weights`] into their primitives (a
/// `mask` is a constant: its primitive only) and the nodes of those present, in the order
/// `x, w_gate, w_up, w_down, b_gate, b_up, b_down`.
#[allow(clippy::type_complexity)]
pub(crate) fn untrack<B: Backend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    w: Weights<Autodiff<B, C>>,
) -> (FloatTensor<B>, Weights<B>, Vec<NodeGuard>, Present) {
    let present = Present {
        w_gate: w.w_gate.is_some(),
        b_gate: w.b_gate.is_some(),
        b_up: w.b_up.is_some(),
        b_down: w.b_down.is_some(),
    };
    let mut nodes = Vec::with_capacity(7);
    let mut inner = |t: FloatTensor<Autodiff<B, C>>| {
        let (primitive, node) = t.into_parts();
        nodes.push(node);
        primitive
    };
    let x = inner(x);
    let w_gate = w.w_gate.map(&mut inner);
    let w_up = inner(w.w_up);
    let w_down = inner(w.w_down);
    let b_gate = w.b_gate.map(&mut inner);
    let b_up = w.b_up.map(&mut inner);
    let b_down = w.b_down.map(&mut inner);
    let mask = w.mask.map(|m| m.into_parts().0);
    let w = Weights {
        w_gate,
        w_up,
        w_down,
        b_gate,
        b_up,
        b_down,
        mask,
    };
    (x, w, nodes, present)
}

/// The backward step; `N` is the number of parents (3 to 7).
#[derive(Debug)]
struct FeedForwardBackward;

/// What the backward pass keeps.
#[derive(Debug, Clone)]
struct Saved<B: Backend> {
    x: FloatTensor<B>,
    weights: Weights<B>,
    pre: Pre<B>,
    /// `h` (after dropout), unless it is recomputed ([`Memory::Recompute`]).
    h: Option<FloatTensor<B>>,
    spec: Spec,
    present: Present,
}

impl<B: Kernels, const N: usize> Backward<B, N> for FeedForwardBackward {
    type State = Saved<B>;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let Saved {
            x,
            weights: w,
            pre,
            h,
            spec,
            present,
        } = ops.state;
        let dy = grads.consume::<B>(&ops.node);
        let parents = present.parents(ops.parents).map(|n| n.map(|n| n.id));
        #[cfg(test)]
        let spec = tests::maybe_break(spec);
        backward_pass::<B>(&x, dy, &w, pre, h, spec, Need::of(&parents)).register(parents, grads);
    }
}

/// Which inputs of the op need a gradient.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Need {
    pub x: bool,
    pub w_gate: bool,
    pub w_up: bool,
    pub w_down: bool,
    pub b_gate: bool,
    pub b_up: bool,
    pub b_down: bool,
}

/// The gradients of the op's inputs (those asked for).
#[derive(Debug)]
pub(crate) struct InputGrads<B: Backend> {
    pub x: Option<FloatTensor<B>>,
    pub w_gate: Option<FloatTensor<B>>,
    pub w_up: Option<FloatTensor<B>>,
    pub w_down: Option<FloatTensor<B>>,
    pub b_gate: Option<FloatTensor<B>>,
    pub b_up: Option<FloatTensor<B>>,
    pub b_down: Option<FloatTensor<B>>,
}

/// The backward pass of `y = FFN(x)` given `dy = ∂L/∂y`, from what the forward pass kept
/// (`pre`, and `h` unless it is recomputed).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_pass<B: Kernels>(
    x: &FloatTensor<B>,
    dy: FloatTensor<B>,
    w: &Weights<B>,
    pre: Pre<B>,
    h: Option<FloatTensor<B>>,
    spec: Spec,
    need: Need,
) -> InputGrads<B> {
    // db_down = Σ_T dy (in f32; the products take dy rounded, in bf16).
    let db_down = need.b_down.then(|| bias_grad::<B>(dy.clone()));
    let dy = operand::<B>(dy, spec.precision);

    // The rest row chunk by row chunk (one chunk, the whole batch, unless recomputing):
    // dW_down = hᵀ dy,  dh = dy W_downᵀ (⊙ the dropout mask, with h = φ(·) ⊙ mask, when
    // there is one), then through φ (and the gating product) to the
    // pre-activations, then dW = xᵀ d(pre), db = Σ_T d(pre), dx = Σ d(pre) Wᵀ over the
    // projections; the weight gradients are summed over chunks.
    let ranges = chunks(&pre, spec.memory);
    let whole = ranges.len() == 1;
    let (mut pre, mut h) = (Some(pre), h);
    let mut dw_down = None;
    let [mut dw, mut db] = [[None, None], [None, None]];
    let mut dx_parts = Vec::with_capacity(ranges.len());
    for r in &ranges {
        // The whole batch is moved, not viewed, so that it is freed as soon as it is used.
        let pre_r = if whole {
            pre.take().expect("one chunk")
        } else {
            pre.as_ref().expect("pre-activations").rows(r)
        };
        let (x_r, dy_r) = if whole {
            (x.clone(), dy.clone())
        } else {
            (rows_of::<B>(x, r), rows_of::<B>(&dy, r))
        };
        if need.w_down {
            let h_r = match h.take() {
                Some(h) => h,
                None => hidden_operand::<B>(&pre_r, &w.mask, (!whole).then_some(r), spec),
            };
            accumulate::<B>(&mut dw_down, B::ffn_matmul(t::<B>(h_r), dy_r.clone()));
        }
        let dh = B::ffn_matmul(dy_r, t::<B>(w.w_down.clone()));
        let dh = masked::<B>(dh, &w.mask, (!whole).then_some(r));
        // d(pre) as the products' operands, with the bias gradients Σ_T d(pre) summed from
        // the unrounded values.
        let (dpre, sums) = B::ffn_hidden_backward_operand(
            dh,
            &pre_r,
            spec.activation,
            spec.precision,
            need.b_gate || need.b_up,
        );
        drop(pre_r);
        let projections = match dpre {
            Pre::Plain(da) | Pre::Fused(da) => vec![(da, 1)],
            Pre::Gated(dg, du) => vec![(dg, 0), (du, 1)],
        };
        let width = |d: &FloatTensor<B>| d.shape()[1];
        let mut dx_r: Option<FloatTensor<B>> = None;
        for (d, p) in projections {
            let (weight, need_w, need_b) = if p == 0 {
                let w_gate = w.w_gate.as_ref().expect("a gated, unfused op has W_gate");
                (w_gate, need.w_gate, need.b_gate)
            } else {
                (&w.w_up, need.w_up, need.b_up)
            };
            if need_b && let Some(sums) = &sums {
                // Gated, unfused: [Σ dg | Σ du], this projection's half.
                let (f, all) = (width(&d), sums.shape()[0]);
                let start = if p == 1 { all - f } else { 0 };
                let half = B::float_slice(
                    sums.clone(),
                    &[Slice::new(start as isize, Some((start + f) as isize), 1)],
                );
                accumulate::<B>(&mut db[p], half);
            }
            let d = operand::<B>(d, spec.precision);
            if need_w {
                accumulate::<B>(&mut dw[p], B::ffn_matmul(t::<B>(x_r.clone()), d.clone()));
            }
            if need.x {
                accumulate::<B>(&mut dx_r, B::ffn_matmul(d, t::<B>(weight.clone())));
            }
        }
        dx_parts.extend(dx_r);
    }
    let dx = need.x.then(|| {
        if dx_parts.len() == 1 {
            dx_parts.pop().expect("one part")
        } else {
            B::float_cat(dx_parts, 0)
        }
    });
    let [dw_gate, dw_up] = dw;
    let [db_gate, db_up] = db;
    InputGrads {
        x: dx,
        w_gate: dw_gate,
        w_up: dw_up,
        w_down: dw_down,
        b_gate: db_gate,
        b_up: db_up,
        b_down: db_down,
    }
}

/// Registers the op with `N` parents and computes its forward pass.
fn tracked<B: Kernels, C: CheckpointStrategy, const N: usize>(
    nodes: Vec<NodeGuard>,
    x: FloatTensor<B>,
    w: Weights<B>,
    spec: Spec,
    present: Present,
) -> FloatTensor<Autodiff<B, C>> {
    let nodes: [NodeGuard; N] = nodes.try_into().expect("N parents");
    match FeedForwardBackward
        .prepare::<C>(nodes)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            // In bf16, x and the weights are kept rounded: what every product of both passes
            // takes.
            let (x, w) = (operand::<B>(x, spec.precision), w.operands(spec.precision));
            let pre = project_in(&x, &w, spec);
            let (y, h) = project_out_chunked(&pre, &w, spec);
            let h = h.filter(|_| spec.memory == Memory::Save);
            let saved = Saved {
                x,
                weights: w,
                pre,
                h,
                spec,
                present,
            };
            prep.finish(saved, y)
        }
        OpsKind::UnTracked(prep) => prep.finish(inference(x, w, spec)),
    }
}

impl<B: Kernels, C: CheckpointStrategy> FfnOps for Autodiff<B, C> {
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
        let (x, w, nodes, present) = untrack::<B, C>(x, w);
        match nodes.len() {
            3 => tracked::<B, C, 3>(nodes, x, w, spec, present),
            4 => tracked::<B, C, 4>(nodes, x, w, spec, present),
            5 => tracked::<B, C, 5>(nodes, x, w, spec, present),
            6 => tracked::<B, C, 6>(nodes, x, w, spec, present),
            7 => tracked::<B, C, 7>(nodes, x, w, spec, present),
            n => unreachable!("the FFN op has 3 to 7 inputs, got {n}"),
        }
    }
}

/// The element-wise passes composed from burn's ops: every backend's default.
pub mod composed {
    use super::*;

    use std::f64::consts::{FRAC_1_SQRT_2, FRAC_2_SQRT_PI};

    /// `1/√(2π)`, the standard normal density at 0.
    const FRAC_1_SQRT_2PI: f64 = FRAC_2_SQRT_PI * FRAC_1_SQRT_2 * 0.5;
    /// `2 √(2/π)`: `2u = 2√(2/π) (x + 0.044715 x³)` in the tanh form of GELU.
    const TWO_SQRT_2_OVER_PI: f64 = 2.0 * FRAC_2_SQRT_PI * FRAC_1_SQRT_2;
    const GELU_CUBIC: f64 = 0.044715;

    fn mul<B: Backend>(a: FloatTensor<B>, b: FloatTensor<B>) -> FloatTensor<B> {
        B::float_mul(a, b)
    }

    fn scale<B: Backend>(a: FloatTensor<B>, s: f64) -> FloatTensor<B> {
        B::float_mul_scalar(a, s.into())
    }

    fn shift<B: Backend>(a: FloatTensor<B>, s: f64) -> FloatTensor<B> {
        B::float_add_scalar(a, s.into())
    }

    /// `1 - a`.
    fn one_minus<B: Backend>(a: FloatTensor<B>) -> FloatTensor<B> {
        shift::<B>(B::float_neg(a), 1.0)
    }

    /// `φ(a)` and `upstream ⊙ φ'(a)`.
    pub(super) fn activate_and_backward<B: Backend>(
        a: FloatTensor<B>,
        upstream: Option<FloatTensor<B>>,
        activation: Activation,
    ) -> (FloatTensor<B>, Option<FloatTensor<B>>) {
        let times = |d: FloatTensor<B>| upstream.clone().map(|up| mul::<B>(up, d));
        match activation {
            Activation::Relu => {
                let r = B::relu(a);
                let d = upstream.map(|up| B::relu_backward(r.clone(), up));
                (r, d)
            }
            // GELU(a) = a Φ(a),  GELU'(a) = Φ(a) + a φ_N(a),  Φ(a) = ½ (1 + erf(a/√2))
            Activation::Gelu => {
                let cdf = scale::<B>(
                    shift::<B>(B::float_erf(scale::<B>(a.clone(), FRAC_1_SQRT_2)), 1.0),
                    0.5,
                );
                let phi = mul::<B>(a.clone(), cdf.clone());
                let d = upstream.map(|up| {
                    let a2 = mul::<B>(a.clone(), a.clone());
                    let pdf = scale::<B>(B::float_exp(scale::<B>(a2, -0.5)), FRAC_1_SQRT_2PI);
                    mul::<B>(up, B::float_add(cdf, mul::<B>(a.clone(), pdf)))
                });
                (phi, d)
            }
            // a σ(2u), 2u = k (a + c a³):  φ' = s + a s (1 - s) k (1 + 3 c a²),  s = σ(2u)
            Activation::GeluTanh => {
                let a2 = mul::<B>(a.clone(), a.clone());
                let two_u = mul::<B>(
                    shift::<B>(
                        scale::<B>(a2.clone(), GELU_CUBIC * TWO_SQRT_2_OVER_PI),
                        TWO_SQRT_2_OVER_PI,
                    ),
                    a.clone(),
                );
                let s = B::sigmoid(two_u);
                let phi = mul::<B>(a.clone(), s.clone());
                let d = upstream.map(|up| {
                    let du = shift::<B>(
                        scale::<B>(a2, 3.0 * GELU_CUBIC * TWO_SQRT_2_OVER_PI),
                        TWO_SQRT_2_OVER_PI,
                    );
                    let ds = mul::<B>(mul::<B>(phi.clone(), one_minus::<B>(s.clone())), du);
                    mul::<B>(up, B::float_add(s, ds))
                });
                (phi, d)
            }
            // SiLU(a) = a σ(a),  SiLU'(a) = σ(a) (1 + a (1 - σ(a)))
            Activation::Silu => {
                let s = B::sigmoid(a.clone());
                let phi = mul::<B>(a.clone(), s.clone());
                let d = upstream.map(|up| {
                    let inner = shift::<B>(mul::<B>(a, one_minus::<B>(s.clone())), 1.0);
                    mul::<B>(up, mul::<B>(s, inner))
                });
                (phi, d)
            }
            // σ'(a) = σ(a) (1 - σ(a))
            Activation::Sigmoid => {
                let s = B::sigmoid(a);
                let d = times(mul::<B>(s.clone(), one_minus::<B>(s.clone())));
                (s, d)
            }
            Activation::Identity => (a, upstream),
            // ReLU(a)², derivative 2 ReLU(a)
            Activation::Relu2 => {
                let r = B::relu(a);
                let d = times(scale::<B>(r.clone(), 2.0));
                (mul::<B>(r.clone(), r), d)
            }
            // tanh'(a) = 1 - tanh(a)²
            Activation::Tanh => {
                let th = B::float_tanh(a);
                let d = times(one_minus::<B>(mul::<B>(th.clone(), th.clone())));
                (th, d)
            }
        }
    }

    /// `[g | u]` → `(g, u)`.
    pub(super) fn split<B: Backend>(gu: &FloatTensor<B>) -> (FloatTensor<B>, FloatTensor<B>) {
        let [rows, width] = gu.shape().dims::<2>();
        let half = |start: usize| {
            let slices = [
                Slice::new(0, Some(rows as isize), 1),
                Slice::new(start as isize, Some((start + width / 2) as isize), 1),
            ];
            B::float_slice(gu.clone(), &slices)
        };
        (half(0), half(width / 2))
    }

    pub fn hidden<B: Backend>(pre: &Pre<B>, activation: Activation) -> FloatTensor<B> {
        match pre {
            Pre::Plain(a) => activate_and_backward::<B>(a.clone(), None, activation).0,
            Pre::Gated(g, u) => {
                let (phi, _) = activate_and_backward::<B>(g.clone(), None, activation);
                mul::<B>(phi, u.clone())
            }
            Pre::Fused(gu) => {
                let (g, u) = split::<B>(gu);
                hidden::<B>(&Pre::Gated(g, u), activation)
            }
        }
    }

    pub fn hidden_backward<B: Backend>(
        dh: FloatTensor<B>,
        pre: &Pre<B>,
        activation: Activation,
    ) -> Pre<B> {
        match pre {
            Pre::Plain(a) => {
                let (_, da) = activate_and_backward::<B>(a.clone(), Some(dh), activation);
                Pre::Plain(da.expect("asked for"))
            }
            // dg = dh ⊙ u ⊙ φ'(g),  du = dh ⊙ φ(g)
            Pre::Gated(g, u) => {
                let upstream = mul::<B>(dh.clone(), u.clone());
                let (phi, dg) = activate_and_backward::<B>(g.clone(), Some(upstream), activation);
                Pre::Gated(dg.expect("asked for"), mul::<B>(dh, phi))
            }
            Pre::Fused(gu) => {
                let (g, u) = split::<B>(gu);
                let Pre::Gated(dg, du) = hidden_backward::<B>(dh, &Pre::Gated(g, u), activation)
                else {
                    unreachable!("gated in, gated out")
                };
                Pre::Fused(B::float_cat(vec![dg, du], 1))
            }
        }
    }
}

/// Whether `device`'s backend has the op in this build (see the crate's backend features).
pub fn supported(device: &burn::tensor::Device) -> bool {
    use burn::backend::DispatchDevice;
    let device = device.clone().without_autodiff();
    match device.as_dispatch() {
        #[cfg(feature = "flex")]
        DispatchDevice::Flex(_) => true,
        #[cfg(feature = "ndarray")]
        DispatchDevice::NdArray(_) => true,
        #[cfg(feature = "cube")]
        DispatchDevice::Cube(_) => true,
        #[allow(unreachable_patterns)]
        _ => false,
    }
}

/// `t` rounded to bf16 and back, the rounding transparent to the gradient: the straight-through
/// `t + (bf16(t) − t)`, with the difference detached (exact in f32). The composed networks'
/// operands in [`Precision::Bf16`].
pub(crate) fn straight_through_bf16<const D: usize>(
    t: burn::tensor::Tensor<D>,
) -> burn::tensor::Tensor<D> {
    let rounded = t.clone().cast(DType::BF16).cast(t.dtype());
    t.clone() + (rounded - t).detach()
}

/// Whether [`Precision::Bf16`] rounds the operands on `device`: on Flex; NdArray (no bf16
/// tensors) and CubeCL backends compute it in f32 for now (see their [`Kernels`]).
pub(crate) fn rounds_bf16(device: &burn::tensor::Device) -> bool {
    use burn::backend::DispatchDevice;
    match device.clone().without_autodiff().as_dispatch() {
        #[cfg(feature = "flex")]
        DispatchDevice::Flex(_) => true,
        #[allow(unreachable_patterns)]
        _ => false,
    }
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
    #[test]
    fn bf16_kernels_agree_and_round_as_documented() {
        use crate::{Memory, Precision};
        let device = Device::flex().autodiff();
        for (activation, gated, fused, memory) in [
            (Activation::Relu, false, false, Memory::Save),
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
            let fast = outputs(&bf16_net, &x, &g);
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
