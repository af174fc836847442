//! # Causal self-attention as one operation, with its own backward pass
//!
//! burn's `MultiHeadAttention` composes attention from tensor ops: the heads are split out by a
//! transposing copy, the scores `QKᵀ/√dₕ` are a batched product, the causal mask fills the
//! upper triangle with `-10⁴`, the softmax (under autodiff: `exp`, `sum`, `div`, each a pass
//! over `[batch, heads, T, T]`) runs over all `T²` scores, masked ones included, and the
//! backward pass differentiates each of those ops. At the main job's sizes (`T = 64`,
//! `dₕ = 16`) that is many small passes, and 14 % of the run's time was scalar `expf`, most of
//! it on masked scores that underflow (glibc's slow path).
//!
//! Here the attention of one sequence and head, for `q, k, v` the rows of the query, key and
//! value projections (`i, j` positions, `j ≤ i` only: the mask is never materialised), is
//!
//! ```text
//! forward                                   backward (given dO = ∂L/∂O)
//! s_ij = q_i · k_j / √dₕ                    p_ij  = exp(s_ij − ℓ_i)        (recomputed)
//! ℓ_i  = log Σ_{j≤i} exp(s_ij)              dp_ij = dO_i · v_j
//! p_ij = exp(s_ij − ℓ_i)                    D_i   = Σ_{j≤i} p_ij dp_ij     (= dO_i · O_i)
//! O_i  = Σ_{j≤i} p_ij v_j                   ds_ij = p_ij (dp_ij − D_i)
//!                                           dq_i  = Σ_j ds_ij k_j / √dₕ
//!                                           dk_j  = Σ_i ds_ij q_i / √dₕ
//!                                           dv_j  = Σ_i p_ij dO_i
//! ```
//!
//! (FlashAttention's backward, Dao et al. 2022, which takes `D_i` as `dO_i · O_i`; here it is
//! summed from the row of `dP` the backward pass computes anyway, so `O` need not be kept.) The
//! op keeps `q, k, v` and the row log-sum-exps `ℓ` (`[batch, heads, T]`): not `O`, nor the
//! `[batch, heads, T, T]` probabilities.
//!
//! It reads the heads straight out of the `[batch, T, heads·dₕ]` projections and writes its
//! output in that layout, so no transposing copy is made either way. Per sequence and head the
//! products `QKᵀ`, `PV` (and in the backward `dO Vᵀ`, `dS K`, `dSᵀ Q`, `Pᵀ dO`) are register-tiled
//! (4 × 16 sums held in registers, tiles above the diagonal skipped) and compiled for AVX-512 or
//! AVX2 + FMA, the widest the CPU has. In bf16 the products take rounded operands (see
//! `causal_attention`). Sequences run in parallel on rayon's threads. It exists on Flex (`f32`,
//! `f64`); other devices, attention dropout and
//! quiet softmax use burn's `MultiHeadAttention`, whose outputs and gradients it matches
//! (tests below).

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, DType, Flex, backend_extension};
use burn::tensor::Tensor;
use burn_flex::FlexTensor;
use ffn_model::Precision;
use rayon::prelude::*;

use super::kernel::{Real, contiguous, dispatch, dot_by, new_tensor};

/// The attention op. Call it through [`causal_attention`].
#[backend_extension(Flex, Autodiff)]
pub trait AttentionOps: Backend {
    /// `O = softmax(QKᵀ/√dₕ + causal mask) V` per head, for `q, k, v: [batch, T, heads·dₕ]`;
    /// with `bf16`, every product's operands rounded to bf16 (see [`causal_attention`]).
    fn causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        heads: usize,
        bf16: bool,
    ) -> FloatTensor<Self>;
}

/// Whether the op runs on the device and dtype of `x` (Flex, `f32` or `f64`).
pub fn supported(x: &Tensor<3>) -> bool {
    use burn::backend::DispatchDevice;
    let device = x.device().without_autodiff();
    matches!(device.as_dispatch(), DispatchDevice::Flex(_))
        && matches!(x.dtype(), DType::F32 | DType::F64)
}

/// Causal multi-head attention of the projections `q, k, v: [batch, T, heads·dₕ]`, in that
/// layout; on a [`supported`] tensor.
///
/// In [`Precision::Bf16`] (of an f32 network) the products take bf16 operands, as the FFN
/// op's do: `S = bf16(Q) bf16(K)ᵀ`, `O = bf16(P) bf16(V)`, and in the backward pass `dP =
/// bf16(dO) bf16(V)ᵀ`, `dQ = bf16(dS) bf16(K)`, `dK = bf16(dS)ᵀ bf16(Q)`, `dV = bf16(P)ᵀ
/// bf16(dO)`, every sum in f32. The softmax, `ℓ`, `D = Σ_j bf16(p_ij) dp_ij` (`= dO · O`, `O`
/// being `bf16(P) bf16(V)`) and `dS = P ⊙ (dP − D)/√dₕ` stay f32.
/// (The per-head products are small, `T × dₕ`: they run on the f32 kernels, on the rounded
/// values, which is the same function.)
pub fn causal_attention(
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
    heads: usize,
    precision: Precision,
) -> Tensor<3> {
    use burn::backend::Dispatch;
    let o = <Dispatch as AttentionOps>::causal_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        heads,
        precision == Precision::Bf16,
    );
    Tensor::from_dispatch(o)
}

impl AttentionOps for Flex {
    fn causal_attention(
        q: FlexTensor,
        k: FlexTensor,
        v: FlexTensor,
        heads: usize,
        bf16: bool,
    ) -> FlexTensor {
        let [q, k, v] = [q, k, v].map(|x| operand(x, bf16));
        forward(&q, &k, &v, heads, bf16).0
    }
}

/// `x` as the products take it: rounded to bf16 (kept in f32) when `bf16` and `x` is f32,
/// else `x` itself.
fn operand(x: FlexTensor, bf16: bool) -> FlexTensor {
    if !bf16 || x.dtype() != DType::F32 {
        return x;
    }
    let x = contiguous(&x);
    let shape = x.layout().shape().dims::<3>();
    let rounded = x.storage::<f32>().par_iter().map(|&e| e.bf16()).collect();
    new_tensor(rounded, shape)
}

/// An operand of [`operand`] as the backward pass keeps it: in bf16 when `bf16` (its values
/// are bf16's already, so dropping the low half of each f32 is exact).
fn kept(x: FlexTensor, bf16: bool) -> FlexTensor {
    if !bf16 || x.dtype() != DType::F32 {
        return x;
    }
    let x = contiguous(&x);
    let shape = x.layout().shape().clone();
    let halves: Vec<burn::tensor::bf16> = x.storage::<f32>()[..shape.num_elements()]
        .par_iter()
        .map(|&e| burn::tensor::bf16::from_bits((e.to_bits() >> 16) as u16))
        .collect();
    FlexTensor::from_data(burn::tensor::TensorData::new(halves, shape))
}

/// A kept operand as the kernels read it: f32 again (exactly) if kept in bf16, contiguous.
fn widened(x: &FlexTensor) -> FlexTensor {
    if x.dtype() != DType::BF16 {
        return contiguous(x);
    }
    let x = contiguous(x);
    let shape = x.layout().shape().dims::<3>();
    let wide = x.storage::<burn::tensor::bf16>()[..shape.iter().product()]
        .par_iter()
        .map(|h| f32::from_bits(u32::from(h.to_bits()) << 16))
        .collect();
    new_tensor(wide, shape)
}

/// What the backward pass keeps.
#[derive(Debug, Clone)]
struct Saved {
    q: FlexTensor,
    k: FlexTensor,
    v: FlexTensor,
    lse: FlexTensor,
    heads: usize,
    bf16: bool,
}

#[derive(Debug)]
struct AttentionBackward;

impl Backward<Flex, 3> for AttentionBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let s = ops.state;
        let d_o = grads.consume::<Flex>(&ops.node);
        let [dq, dk, dv] = backward(&s, &d_o);
        for (node, grad) in ops.parents.into_iter().zip([dq, dk, dv]) {
            if let Some(node) = node {
                grads.register::<Flex>(node.id, grad);
            }
        }
    }
}

impl<C: CheckpointStrategy> AttentionOps for Autodiff<Flex, C> {
    fn causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        heads: usize,
        bf16: bool,
    ) -> FloatTensor<Self> {
        // In bf16 the rounded q, k, v are what both passes multiply (and what is kept).
        let (q, node_q) = q.into_parts();
        let (k, node_k) = k.into_parts();
        let (v, node_v) = v.into_parts();
        let [q, k, v] = [q, k, v].map(|x| operand(x, bf16));
        match AttentionBackward
            .prepare::<C>([node_q, node_k, node_v])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (o, lse) = forward(&q, &k, &v, heads, bf16);
                // In bf16 the rounded q, k, v are kept as bf16: the same values, half the
                // memory (widened again, exactly, for the backward pass).
                let [q, k, v] = [q, k, v].map(|x| kept(x, bf16));
                let saved = Saved {
                    q,
                    k,
                    v,
                    lse,
                    heads,
                    bf16,
                };
                prep.finish(saved, o)
            }
            OpsKind::UnTracked(prep) => prep.finish(forward(&q, &k, &v, heads, bf16).0),
        }
    }
}

/// The shape of the op: `[batch, T, d]` with `d = heads · dₕ`; and whether `P` and `dS` are
/// rounded to bf16 as operands.
#[derive(Debug, Clone, Copy)]
struct Dims {
    t: usize,
    d: usize,
    heads: usize,
    bf16: bool,
}

impl Dims {
    fn of(x: &FlexTensor, heads: usize, bf16: bool) -> (usize, Self) {
        let [batch, t, d] = x.layout().shape().dims::<3>();
        assert!(
            heads > 0 && d.is_multiple_of(heads),
            "attention: d_model {d} is not a multiple of {heads} heads"
        );
        (batch, Self { t, d, heads, bf16 })
    }

    fn dh(&self) -> usize {
        self.d / self.heads
    }
}

/// `(O, ℓ)`: the output `[batch, T, d]` and the row log-sum-exps `[batch, heads, T]`.
fn forward(
    q: &FlexTensor,
    k: &FlexTensor,
    v: &FlexTensor,
    heads: usize,
    bf16: bool,
) -> (FlexTensor, FlexTensor) {
    let (q, k, v) = (contiguous(q), contiguous(k), contiguous(v));
    let dims = Dims::of(&q, heads, bf16);
    match q.dtype() {
        DType::F32 => forward_typed::<f32>(q.storage(), k.storage(), v.storage(), dims),
        DType::F64 => forward_typed::<f64>(q.storage(), k.storage(), v.storage(), dims),
        other => panic!("attention: dtype {other:?} is not supported (f32, f64)"),
    }
}

fn forward_typed<E: Real>(
    q: &[E],
    k: &[E],
    v: &[E],
    (batch, dims): (usize, Dims),
) -> (FlexTensor, FlexTensor) {
    let Dims { t, d, heads, .. } = dims;
    let mut o = vec![E::ZERO; batch * t * d];
    let mut lse = vec![E::ZERO; batch * heads * t];
    let n = t * d;
    o.par_chunks_mut(n.max(1))
        .zip(lse.par_chunks_mut((heads * t).max(1)))
        .enumerate()
        .for_each(|(b, (o, lse))| {
            let range = b * n..(b + 1) * n;
            let (q, k, v) = (&q[range.clone()], &k[range.clone()], &v[range]);
            dispatch!(forward_sequence(q, k, v, dims, o, lse));
        });
    (
        new_tensor(o, [batch, t, d]),
        new_tensor(lse, [batch, heads, t]),
    )
}

/// Per-head scratch: `T` and `dₕ` rounded up to the tile width, and the operands of the
/// products laid out so that each product's right operand has contiguous rows.
struct Scratch<E> {
    tp: usize,
    dp: usize,
    /// `Kᵀ`, `Vᵀ`: `[dₕ, tp]`.
    kt: Vec<E>,
    vt: Vec<E>,
    /// `K`, `V`, `Q`, `dO` of the head: `[T, dp]`.
    kh: Vec<E>,
    vh: Vec<E>,
    qh: Vec<E>,
    doh: Vec<E>,
    /// Scores, then probabilities `P`; and `dS`: `[T, tp]`.
    p: Vec<E>,
    ds: Vec<E>,
    /// A `[T, dp]` result.
    out: Vec<E>,
}

impl<E: Real> Scratch<E> {
    fn new(t: usize, dh: usize) -> Self {
        let (tp, dp) = (t.next_multiple_of(L), dh.next_multiple_of(L));
        let z = |n: usize| vec![E::ZERO; n];
        Self {
            tp,
            dp,
            kt: z(dh * tp),
            vt: z(dh * tp),
            kh: z(t * dp),
            vh: z(t * dp),
            qh: z(t * dp),
            doh: z(t * dp),
            p: z(t * tp),
            ds: z(t * tp),
            out: z(t * dp),
        }
    }
}

/// Rows and columns of a register tile of [`product`].
const R: usize = 4;
const L: usize = 16;

/// `C[i, j] = Σ_{p ∈ ks(i₀)} A(i, p) B[p, j]` for `i < m` and `j < cols(i₀)`, where `i₀` is the
/// first row of `i`'s tile of `R` rows, `A(i, p) = a[i·ars + p·acs]`, and the rows of `B` and `C`
/// are contiguous (`ldb`, `ldc` apart). `cols` returns multiples of `L`; `B` has that many
/// (zero-padded) columns. A tile of `R × L` sums stays in registers; the causal structure
/// enters through `cols` and `ks`, which skip the blocks that are all zero.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn product<E: Real, const FUSED: bool>(
    m: usize,
    (a, ars, acs): (&[E], usize, usize),
    (b, ldb): (&[E], usize),
    (c, ldc): (&mut [E], usize),
    cols: impl Fn(usize) -> usize,
    ks: impl Fn(usize) -> (usize, usize),
) {
    for i0 in (0..m).step_by(R) {
        let rows = R.min(m - i0);
        let (k0, k1) = ks(i0);
        // Rows past `m` repeat the last one and are not stored.
        let row = |r: usize| (i0 + r).min(m - 1) * ars;
        for j0 in (0..cols(i0)).step_by(L) {
            let mut acc = [[E::ZERO; L]; R];
            for p in k0..k1 {
                let bp: &[E; L] = b[p * ldb + j0..p * ldb + j0 + L].try_into().unwrap();
                for (r, acc) in acc.iter_mut().enumerate() {
                    let a_ip = a[row(r) + p * acs];
                    for l in 0..L {
                        acc[l] = if FUSED {
                            a_ip.mul_add(bp[l], acc[l])
                        } else {
                            acc[l] + a_ip * bp[l]
                        };
                    }
                }
            }
            for (r, acc) in acc.iter().enumerate().take(rows) {
                c[(i0 + r) * ldc + j0..(i0 + r) * ldc + j0 + L].copy_from_slice(acc);
            }
        }
    }
}

/// The columns of `S` a tile of rows from `i₀` needs (`j ≤ i`), rounded up to the tile width.
fn causal_cols(i0: usize, t: usize) -> usize {
    (i0 + R).min(t).next_multiple_of(L)
}

/// Copies head columns `col..col + dₕ` of `x: [T, d]` into `rows: [T, dp]` and, if given,
/// into `cols: [dₕ, tp]` (transposed); the padding stays zero.
fn gather_head<E: Real>(
    x: &[E],
    (t, d, col, dh): (usize, usize, usize, usize),
    rows: &mut [E],
    dp: usize,
    cols: Option<(&mut [E], usize)>,
) {
    for i in 0..t {
        rows[i * dp..i * dp + dh].copy_from_slice(&x[i * d + col..i * d + col + dh]);
    }
    if let Some((cols, tp)) = cols {
        for i in 0..t {
            for c in 0..dh {
                cols[c * tp + i] = x[i * d + col + c];
            }
        }
    }
}

/// One sequence, all heads: `S = QKᵀ`, the causal softmax by rows, `O = PV`.
#[inline(always)]
fn forward_sequence<E: Real, const FUSED: bool>(
    q: &[E],
    k: &[E],
    v: &[E],
    dims: Dims,
    o: &mut [E],
    lse: &mut [E],
) {
    let Dims { t, d, heads, bf16 } = dims;
    let dh = dims.dh();
    let scale = E::from_f64(1.0 / (dh as f64).sqrt());
    let mut w = Scratch::<E>::new(t, dh);
    let (tp, dp) = (w.tp, w.dp);
    for h in 0..heads {
        let col = h * dh;
        let head = (t, d, col, dh);
        gather_head(k, head, &mut w.kh, dp, Some((&mut w.kt, tp)));
        gather_head(v, head, &mut w.vh, dp, None);
        // S = Q Kᵀ (j < i₀ + R only)
        product::<E, FUSED>(
            t,
            (&q[col..], d, 1),
            (&w.kt, tp),
            (&mut w.p, tp),
            |i0| causal_cols(i0, t),
            |_| (0, dh),
        );
        // P = softmax over j ≤ i of S/√dₕ;  ℓ_i = m + log Σ exp(s − m)
        for i in 0..t {
            let row = &mut w.p[i * tp..(i + 1) * tp];
            let (seen, masked) = row.split_at_mut(i + 1);
            let m = seen.iter().fold(E::NEG_INFINITY, |m, &s| m.max(s * scale));
            let mut l = E::ZERO;
            for s in seen.iter_mut() {
                *s = (*s * scale - m).exp();
                l += *s;
            }
            let inv = E::ONE / l;
            seen.iter_mut().for_each(|s| *s = *s * inv);
            if bf16 {
                seen.iter_mut().for_each(|s| *s = s.bf16());
            }
            masked.fill(E::ZERO);
            lse[h * t + i] = m + l.ln();
        }
        // O = P V (p < i₀ + R only)
        product::<E, FUSED>(
            t,
            (&w.p, tp, 1),
            (&w.vh, dp),
            (&mut w.out, dp),
            |_| dp,
            |i0| (0, (i0 + R).min(t)),
        );
        for i in 0..t {
            o[i * d + col..i * d + col + dh].copy_from_slice(&w.out[i * dp..i * dp + dh]);
        }
    }
}

/// `[dq, dk, dv]`, each `[batch, T, d]`.
fn backward(s: &Saved, d_o: &FlexTensor) -> [FlexTensor; 3] {
    let d_o = contiguous(&operand(d_o.clone(), s.bf16));
    let (q, k, v, lse) = (
        widened(&s.q),
        widened(&s.k),
        widened(&s.v),
        contiguous(&s.lse),
    );
    let dims = Dims::of(&q, s.heads, s.bf16);
    macro_rules! typed {
        ($e:ty) => {
            backward_typed::<$e>(
                [q.storage(), k.storage(), v.storage(), d_o.storage()],
                lse.storage(),
                dims,
            )
        };
    }
    match q.dtype() {
        DType::F32 => typed!(f32),
        DType::F64 => typed!(f64),
        other => panic!("attention: dtype {other:?} is not supported (f32, f64)"),
    }
}

fn backward_typed<E: Real>(
    [q, k, v, d_o]: [&[E]; 4],
    lse: &[E],
    (batch, dims): (usize, Dims),
) -> [FlexTensor; 3] {
    let Dims { t, d, heads, .. } = dims;
    let n = t * d;
    let mut grads = [(); 3].map(|_| vec![E::ZERO; batch * n]);
    let [dq, dk, dv] = &mut grads;
    dq.par_chunks_mut(n.max(1))
        .zip(dk.par_chunks_mut(n.max(1)))
        .zip(dv.par_chunks_mut(n.max(1)))
        .enumerate()
        .for_each(|(b, ((dq, dk), dv))| {
            let r = b * n..(b + 1) * n;
            let inputs = [&q[r.clone()], &k[r.clone()], &v[r.clone()], &d_o[r]];
            let lse = &lse[b * heads * t..(b + 1) * heads * t];
            dispatch!(backward_sequence(inputs, lse, dims, [dq, dk, dv]));
        });
    grads.map(|g| new_tensor(g, [batch, t, d]))
}

/// One sequence, all heads: `P` recomputed from `S = QKᵀ` and `ℓ`, `dP = dO Vᵀ`,
/// `dS = P ⊙ (dP − D)/√dₕ`, then `dQ = dS K`, `dK = dSᵀ Q`, `dV = Pᵀ dO`.
#[inline(always)]
fn backward_sequence<E: Real, const FUSED: bool>(
    [q, k, v, d_o]: [&[E]; 4],
    lse: &[E],
    dims: Dims,
    [dq, dk, dv]: [&mut [E]; 3],
) {
    let Dims { t, d, heads, bf16 } = dims;
    let dh = dims.dh();
    let scale = E::from_f64(1.0 / (dh as f64).sqrt());
    let mut w = Scratch::<E>::new(t, dh);
    let (tp, dp) = (w.tp, w.dp);
    let cols = |i0| causal_cols(i0, t);
    // Row tiles from i₀ need p < i₀ + R (P and dS vanish above the diagonal) ...
    let below = |i0: usize| (0, (i0 + R).min(t));
    // ... and column tiles from j₀ (the transposed products) need i ≥ j₀.
    let above = |j0: usize| (j0, t);
    for h in 0..heads {
        let col = h * dh;
        let head = (t, d, col, dh);
        gather_head(k, head, &mut w.kh, dp, Some((&mut w.kt, tp)));
        gather_head(v, head, &mut w.vh, dp, Some((&mut w.vt, tp)));
        gather_head(q, head, &mut w.qh, dp, None);
        gather_head(d_o, head, &mut w.doh, dp, None);
        product::<E, FUSED>(
            t,
            (&q[col..], d, 1),
            (&w.kt, tp),
            (&mut w.p, tp),
            cols,
            |_| (0, dh),
        );
        product::<E, FUSED>(
            t,
            (&d_o[col..], d, 1),
            (&w.vt, tp),
            (&mut w.ds, tp),
            cols,
            |_| (0, dh),
        );
        for i in 0..t {
            let l_i = lse[h * t + i];
            let p = &mut w.p[i * tp..(i + 1) * tp];
            let ds = &mut w.ds[i * tp..(i + 1) * tp];
            // D_i = Σ_j p̃_ij dP_ij, for p̃ the operand of O = P̃V (bf16(p) in bf16): equal to
            // dO_i · O_i, without keeping O.
            for p in &mut p[..=i] {
                *p = (*p * scale - l_i).exp();
            }
            let d_i = dot_by(&p[..=i], &ds[..=i], |p| if bf16 { p.bf16() } else { p });
            for (p, ds) in p[..=i].iter_mut().zip(&mut ds[..=i]) {
                *ds = *p * (*ds - d_i) * scale;
                if bf16 {
                    // As the operands of dV = Pᵀ dO and of dQ, dK.
                    (*p, *ds) = (p.bf16(), ds.bf16());
                }
            }
            p[i + 1..].fill(E::ZERO);
            ds[i + 1..].fill(E::ZERO);
        }
        let scatter = |out: &[E], to: &mut [E]| {
            for i in 0..t {
                to[i * d + col..i * d + col + dh].copy_from_slice(&out[i * dp..i * dp + dh]);
            }
        };
        product::<E, FUSED>(
            t,
            (&w.ds, tp, 1),
            (&w.kh, dp),
            (&mut w.out, dp),
            |_| dp,
            below,
        );
        scatter(&w.out, dq);
        product::<E, FUSED>(
            t,
            (&w.ds, 1, tp),
            (&w.qh, dp),
            (&mut w.out, dp),
            |_| dp,
            above,
        );
        scatter(&w.out, dk);
        product::<E, FUSED>(
            t,
            (&w.p, 1, tp),
            (&w.doh, dp),
            (&mut w.out, dp),
            |_| dp,
            above,
        );
        scatter(&w.out, dv);
    }
}

#[cfg(test)]
mod tests {
    use burn::nn::attention::{MhaInput, MultiHeadAttentionConfig};
    use burn::tensor::{Bool, DType, Device, Distribution, Tensor, TensorData};

    use super::*;

    fn normal(shape: [usize; 3], device: &Device) -> Tensor<3> {
        Tensor::random(shape, Distribution::Normal(0.0, 1.0), device)
    }

    /// `max |a − b| / max(1, max |b|)`.
    fn relative(a: Tensor<3>, b: Tensor<3>) -> f64 {
        let scale = b.clone().abs().max().into_scalar::<f64>().max(1.0);
        (a - b).abs().max().into_scalar::<f64>() / scale
    }

    /// Outputs and gradients (input and every projection's weight) equal burn's
    /// `MultiHeadAttention` with a causal mask, to f32 rounding.
    #[test]
    fn matches_burns_multi_head_attention() {
        let device = Device::flex().autodiff();
        device.seed(7);
        let (batch, t, d, heads) = (3, 9, 12, 3);
        let mha = MultiHeadAttentionConfig::new(d, heads)
            .with_dropout(0.0)
            .init(&device);
        let x = normal([batch, t, d], &device);
        let g = normal([batch, t, d], &device);
        let causal = Tensor::<2, Bool>::tril_mask([t, t], 0, &device).expand([batch, t, t]);

        let run = |op: bool| {
            let x = x.clone().require_grad();
            let y = if op {
                let (q, k, v) = (
                    mha.query.forward(x.clone()),
                    mha.key.forward(x.clone()),
                    mha.value.forward(x.clone()),
                );
                mha.output
                    .forward(causal_attention(q, k, v, heads, Precision::F32))
            } else {
                mha.forward(MhaInput::self_attn(x.clone()).mask_attn(causal.clone()))
                    .context
            };
            let grads = (y.clone() * g.clone()).sum().backward();
            let weight = |l: &burn::nn::Linear| {
                let w = l.weight.val().grad(&grads).unwrap();
                let [r, c] = w.dims();
                w.reshape([1, r, c])
            };
            (
                y.inner(),
                x.grad(&grads).unwrap(),
                [&mha.query, &mha.key, &mha.value, &mha.output].map(weight),
            )
        };
        let (y_op, dx_op, dw_op) = run(true);
        let (y_ref, dx_ref, dw_ref) = run(false);
        assert!(relative(y_op, y_ref) < 1e-5);
        assert!(relative(dx_op, dx_ref) < 1e-4);
        for (a, b) in dw_op.into_iter().zip(dw_ref) {
            assert!(relative(a, b) < 1e-4);
        }
    }

    /// In f64, `⟨∇L, u⟩` of each input matches the central difference
    /// `(L(x + εu) − L(x − εu)) / 2ε` for `L = Σ O ⊙ g`; and a later position never moves an
    /// earlier output (causality).
    #[test]
    fn gradients_match_finite_differences_and_attention_is_causal() {
        let device = Device::flex().autodiff();
        device.seed(11);
        let (batch, t, d, heads) = (2, 6, 8, 2);
        let f64_normal = || normal([batch, t, d], &device).cast(DType::F64);
        let inputs = [f64_normal(), f64_normal(), f64_normal()];
        let g = f64_normal();
        let loss = |[q, k, v]: [Tensor<3>; 3]| {
            (causal_attention(q, k, v, heads, Precision::F32) * g.clone()).sum()
        };

        let tracked = inputs.clone().map(|x| x.require_grad());
        let grads = loss(tracked.clone()).backward();
        for which in 0..3 {
            let u = f64_normal();
            let analytic: f64 = (tracked[which].grad(&grads).unwrap() * u.clone().inner())
                .sum()
                .into_scalar();
            let eps = 1e-6;
            let at = |s: f64| -> f64 {
                let mut shifted = inputs.clone();
                shifted[which] = shifted[which].clone() + u.clone() * (s * eps);
                loss(shifted).into_scalar()
            };
            let numeric = (at(1.0) - at(-1.0)) / (2.0 * eps);
            let error = (analytic - numeric).abs() / analytic.abs().max(1.0);
            assert!(error < 1e-7, "input {which}: {analytic} vs {numeric}");
        }

        // Changing the keys and values of the last position leaves the others' outputs.
        let [q, k, v] = inputs;
        let o = causal_attention(q.clone(), k.clone(), v.clone(), heads, Precision::F32);
        let bump = |x: Tensor<3>| {
            let last = x.clone().slice([0..batch, t - 1..t, 0..d]) + 1.0;
            x.slice_assign([0..batch, t - 1..t, 0..d], last)
        };
        let o2 = causal_attention(q, bump(k), bump(v), heads, Precision::F32);
        let head = |o: Tensor<3>| o.slice([0..batch, 0..t - 1, 0..d]);
        assert!(relative(head(o2.clone()), head(o.clone())) == 0.0);
        assert!(relative(o2, o) > 1e-3);
    }

    /// The bf16 recipe of the op (see [`causal_attention`]) in f64: `[O, dQ, dK, dV]` for
    /// `L = Σ O ⊙ g`, each `[batch, T, d]` in row-major order.
    fn recipe(
        [q, k, v, g]: [&[f32]; 4],
        (batch, t, d, heads): (usize, usize, usize, usize),
    ) -> [Vec<f64>; 4] {
        let r = |x: f32| f64::from(x.bf16());
        let dh = d / heads;
        let scale = 1.0 / (dh as f64).sqrt();
        let mut out = [(); 4].map(|_| vec![0f64; batch * t * d]);
        for b in 0..batch {
            for h in 0..heads {
                let at = |i: usize, c: usize| (b * t + i) * d + h * dh + c;
                let dot = |x: &[f32], y: &[f32], i: usize, j: usize| -> f64 {
                    (0..dh).map(|c| r(x[at(i, c)]) * r(y[at(j, c)])).sum()
                };
                for i in 0..t {
                    let s: Vec<f64> = (0..=i).map(|j| dot(q, k, i, j) * scale).collect();
                    let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let l: f64 = s.iter().map(|s| (s - m).exp()).sum();
                    let p: Vec<f64> = s.iter().map(|s| (s - m).exp() / l).collect();
                    // p rounded as an operand: through f32, as the op holds it.
                    let rp = |j: usize| r(p[j] as f32);
                    let o: Vec<f64> = (0..dh)
                        .map(|c| (0..=i).map(|j| rp(j) * r(v[at(j, c)])).sum())
                        .collect();
                    let d_i: f64 = (0..dh).map(|c| r(g[at(i, c)]) * o[c]).sum();
                    for c in 0..dh {
                        out[0][at(i, c)] = o[c];
                    }
                    for j in 0..=i {
                        let dp = dot(g, v, i, j);
                        let ds = r((p[j] * (dp - d_i) * scale) as f32);
                        for c in 0..dh {
                            out[1][at(i, c)] += ds * r(k[at(j, c)]);
                            out[2][at(j, c)] += ds * r(q[at(i, c)]);
                            out[3][at(j, c)] += rp(j) * r(g[at(i, c)]);
                        }
                    }
                }
            }
        }
        out
    }

    /// In bf16 the output and the gradients of `q, k, v` follow the recipe in f64, to within
    /// f32 rounding and a rare operand that f32 and f64 round to different sides of a bf16
    /// midpoint (‖·‖∞ relative 1e-4); the f32 op misses the recipe by more than 5e-4, so a
    /// rounding skipped anywhere fails the test.
    #[test]
    fn bf16_products_take_rounded_operands_as_the_recipe_says() {
        let device = Device::flex().autodiff();
        device.seed(5);
        let (batch, t, d, heads) = (2, 16, 32, 2);
        let inputs = [(); 4].map(|_| normal([batch, t, d], &device));
        let data = inputs
            .clone()
            .map(|x| x.into_data().convert::<f32>().try_to_vec::<f32>().unwrap());
        let want = recipe(
            [&data[0], &data[1], &data[2], &data[3]],
            (batch, t, d, heads),
        );
        let to_tensor = |v: &Vec<f64>| {
            Tensor::<3>::from_data(
                TensorData::new(v.clone(), [batch, t, d]),
                &device.clone().without_autodiff(),
            )
            .cast(DType::F32)
        };
        let run = |precision: Precision| {
            let [q, k, v, g] = inputs.clone();
            let [q, k, v] = [q, k, v].map(|x| x.require_grad());
            let o = causal_attention(q.clone(), k.clone(), v.clone(), heads, precision);
            let grads = (o.clone() * g).sum().backward();
            [
                o.inner(),
                q.grad(&grads).unwrap(),
                k.grad(&grads).unwrap(),
                v.grad(&grads).unwrap(),
            ]
        };
        let (bf16, f32) = (run(Precision::Bf16), run(Precision::F32));
        for (which, ((got, plain), want)) in bf16.into_iter().zip(f32).zip(&want).enumerate() {
            let error = relative(got, to_tensor(want));
            let f32_error = relative(plain, to_tensor(want));
            assert!(error < 1e-4, "output {which}: {error:e} from the recipe");
            assert!(
                f32_error > 5e-4,
                "output {which}: f32 only {f32_error:e} from it"
            );
        }
    }
}
