//! # The FFN op's kernels on Flex (CPU)
//!
//! - Matrix products through a tuned SGEMM when one is found at run time (`blas.rs`), else
//!   Flex's own.
//! - The element-wise passes as one loop each over the `[tokens, d_ff]` rows (`loops.rs`),
//!   split over rayon's threads; in bf16 on a CPU with `avx512_bf16`, run inside the products
//!   they follow, on each block of rows as it comes out (`bf16::gemm_then`).
//!
//! Anything else (other dtypes, layouts the loops do not take, `tanh`) goes to the composed
//! default.

use std::mem::MaybeUninit;

use burn::backend::{DType, Flex};
use burn::tensor::Shape;
use burn_flex::FlexTensor;
use rayon::prelude::*;

use crate::Activation;
use crate::bf16;
use crate::blas::{self, Operand};
use crate::loops::{
    add_row, backward_row, backward_row_in_place, forward_row, round_f32_into, round_in_place,
    round_into, round_row, unwritten, vectorised, written,
};
use crate::op::hidden as composed;
use crate::op::{self, Kernels, Pre, Precision, as_operands};

impl Kernels for Flex {
    /// With at least as many pieces as rayon has threads, the pieces run in parallel, each
    /// with unsplit (single-threaded) matrix products: for the experts of a mixture, larger
    /// products per thread than splitting each expert's products over the threads.
    fn ffn_each<I: Send, T: Send>(items: Vec<I>, work: impl Fn(I) -> T + Sync) -> Vec<T> {
        if items.len() < 2 || items.len() < rayon::current_num_threads() {
            return items.into_iter().map(work).collect();
        }
        items
            .into_par_iter()
            .map(|item| blas::unsplit(|| work(item)))
            .collect()
    }

    /// f32 operands: the BLAS chosen at run time, else Flex's own product. bf16 operands (both):
    /// `bf16.rs`'s packed kernel on a CPU with `avx512_bf16`; elsewhere the operands are
    /// widened to f32 (exactly) and multiplied as f32: the same function, the products exact
    /// in either case and summed in f32. A bf16 operand beside an f32 one (rounded already, by
    /// [`ffn_bf16_passing`](Kernels::ffn_bf16_passing)) is widened.
    fn ffn_matmul(lhs: FlexTensor, rhs: FlexTensor) -> FlexTensor {
        use burn::backend::ops::FloatTensorOps;
        match (lhs.dtype(), rhs.dtype()) {
            (DType::BF16, DType::BF16) if on_kernel() => return matmul_bf16(lhs, rhs),
            (DType::BF16, DType::BF16 | DType::F32) | (DType::F32, DType::BF16) => {
                return matmul_bf16_widened(lhs, rhs);
            }
            _ => {}
        }
        match blas::get() {
            Some(blas) if lhs.dtype() == DType::F32 && rhs.dtype() == DType::F32 => {
                matmul_blas(blas, lhs, rhs)
            }
            _ => <Flex as FloatTensorOps<Flex>>::float_matmul(lhs, rhs),
        }
    }

    fn ffn_bf16(t: FlexTensor) -> FlexTensor {
        use burn::backend::ops::FloatTensorOps;
        round_to_bf16(&t).unwrap_or_else(|| {
            <Flex as FloatTensorOps<Flex>>::float_cast(t, burn::tensor::FloatDType::BF16)
        })
    }

    /// Off `bf16.rs`'s kernel, where the products widen bf16 operands to f32: `t` rounded in
    /// place and left f32 when it is held alone and contiguous (else a bf16 copy).
    fn ffn_bf16_passing(t: FlexTensor) -> FlexTensor {
        if on_kernel() {
            return Self::ffn_bf16(t);
        }
        rounded_in_place(t).unwrap_or_else(Self::ffn_bf16)
    }

    fn ffn_hidden(pre: &Pre<Flex>, activation: Activation) -> FlexTensor {
        hidden(pre, activation, Precision::F32)
            .unwrap_or_else(|| composed::hidden::<Flex>(pre, activation))
    }

    /// In bf16 each row is computed in f32 and rounded as it is written: no f32 `h` is made.
    fn ffn_hidden_operand(
        pre: &Pre<Flex>,
        activation: Activation,
        precision: Precision,
    ) -> FlexTensor {
        hidden(pre, activation, precision).unwrap_or_else(|| {
            op::operand::<Flex>(composed::hidden::<Flex>(pre, activation), precision)
        })
    }

    /// In bf16 on `bf16.rs`'s kernel: each block of rows of `x w + b` (`a`, `[g | u]`, or `u`
    /// after a separate `g = x W_gate + b_gate`) gets its bias and is turned into rows of `h`
    /// (computed in f32, rounded as written) while it is in cache.
    fn ffn_project_in_hidden(
        x: &FlexTensor,
        w: &FlexTensor,
        b: Option<&FlexTensor>,
        gate: Option<(&FlexTensor, Option<&FlexTensor>)>,
        activation: Activation,
        gated: bool,
        precision: Precision,
    ) -> Option<(Pre<Flex>, FlexTensor)> {
        if precision != Precision::Bf16 {
            return None;
        }
        let act = vectorised(activation)?;
        if !on_bf16_kernel([x, w]) || (gate.is_some() && !gated) {
            return None;
        }
        let bias = match b {
            Some(b) => Some(contiguous_f32(b)?),
            None => None,
        };
        let [m, k] = x.layout().shape().dims::<2>();
        let n = w.layout().shape()[1];
        // The width of h: all of the product's columns, half of a fused [g | u]'s.
        let f = if gated && gate.is_none() { n / 2 } else { n };
        if gated && gate.is_none() && !n.is_multiple_of(2) {
            return None;
        }
        // A separate gate's pre-activations first, whole: the up product's blocks read its rows.
        let g = match gate {
            Some((w_gate, b_gate)) => {
                if !on_bf16_kernel([x, w_gate]) || w_gate.layout().shape()[1] != n {
                    return None;
                }
                let g = matmul_bf16(x.clone(), w_gate.clone());
                Some(op::add_bias::<Flex>(g, b_gate.cloned()))
            }
            None => None,
        };
        let g_rows = match &g {
            Some(g) => Some(rows(g)?),
            None => None,
        };
        let ((_x, a), (_w, bm)) = (bf16_matrix(x.clone()), bf16_matrix(w.clone()));
        let mut h = unwritten(m * f);
        let out = RowsMut {
            addr: h.as_mut_ptr() as usize,
            stride: f,
        };
        let then = |rows: std::ops::Range<usize>, block: &mut [f32]| {
            for (r, pre) in rows.zip(block.chunks_mut(n)) {
                if let Some(b) = bias {
                    add_row(Some(&mut *pre), b);
                }
                // SAFETY: row r of h, this block's alone.
                let h = unsafe { out.row(r, f) };
                with_scratch(f, |s| {
                    match (g_rows, gated) {
                        (Some(g), _) => forward_row(act, g.row(r), Some(pre), s),
                        (None, true) => {
                            let (g, u) = pre.split_at(f);
                            forward_row(act, g, Some(u), s)
                        }
                        (None, false) => forward_row(act, pre, None, s),
                    }
                    round_into(s, h);
                });
            }
        };
        // SAFETY: the matrices address their tensors' shapes; `gemm_then` writes all m·n floats.
        let pre = unsafe { product(m, n, |c| bf16::gemm_then(m, n, k, a, bm, Some(c), &then)) };
        let pre = match (g, gated) {
            (Some(g), _) => Pre::Gated(g, pre),
            (None, true) => Pre::Fused(pre),
            (None, false) => Pre::Plain(pre),
        };
        // SAFETY: `then` rounded every row of h into place.
        let h = unsafe { written(h) };
        Some((pre, bf16_tensor(h, Shape::new([m, f]))))
    }

    /// In bf16 on `bf16.rs`'s kernel: each block of rows of `dh = dy W_downᵀ`, computed into a
    /// buffer of its own (`dh` is never whole), is turned into rows of `d(pre)` (in f32, added
    /// into the column sums, rounded as written).
    ///
    /// When this op holds the pre-activations alone, `d(pre)` is written over them: row `r` of
    /// `d(pre)` (bf16, `f` or `2·f` wide) fills the first bytes of row `r` of `a`, `g` or
    /// `[g | u]` (f32, `f` or `2·f` wide), which is read whole before it is written. So the
    /// backward pass never holds `pre` and `d(pre)` at once: the largest two tensors of a bf16
    /// step become one.
    fn ffn_down_backward_operand(
        dy: &FlexTensor,
        w_down: &FlexTensor,
        pre: Pre<Flex>,
        activation: Activation,
        precision: Precision,
        sums: bool,
    ) -> Result<(Pre<Flex>, Option<FlexTensor>), Pre<Flex>> {
        let Some(act) = vectorised(activation) else {
            return Err(pre);
        };
        if precision != Precision::Bf16 || !on_bf16_kernel([dy, w_down]) {
            return Err(pre);
        }
        let ((_dy, a), (_w, wm)) = (bf16_matrix(dy.clone()), bf16_matrix(w_down.clone()));
        // W_downᵀ: `[d_model, d_ff]` through the strides of `W_down: [d_ff, d_model]`.
        let b = bf16::Matrix {
            ptr: wm.ptr,
            row_stride: wm.col_stride,
            col_stride: wm.row_stride,
        };
        let [m, k] = dy.layout().shape().dims::<2>();
        let f = w_down.layout().shape()[0];
        let gated = !matches!(pre, Pre::Plain(_));
        let width = if gated { 2 * f } else { f };
        // The buffer of `a`, `g` or `[g | u]` (the host of `d(pre)` when written in place), and
        // a `u` of its own: rows of f32 with unit column stride, `f` or `2·f` of them.
        let (host, u) = match &pre {
            Pre::Plain(a) => (a, None),
            Pre::Gated(g, u) => (g, Some(u)),
            Pre::Fused(gu) => (gu, None),
        };
        let host_cols = if matches!(pre, Pre::Fused(_)) {
            2 * f
        } else {
            f
        };
        let stride = match rows(host) {
            Some(h) if h.rows == m && h.cols == host_cols => h.stride,
            _ => return Err(pre),
        };
        let u = match u.map(rows) {
            None => None,
            Some(Some(u)) if u.rows == m && u.cols == f => Some(RowPtrs::of(u)),
            Some(_) => return Err(pre),
        };
        let in_place = host.is_unique() && host.layout().start_offset() == 0;
        let mut host = match pre {
            Pre::Plain(a) => a,
            Pre::Gated(g, _) => g,
            Pre::Fused(gu) => gu,
        };
        // Every row of `g` (and of a fused `u`) is read through this address; in place, the
        // rows of `d(pre)` are written through it too.
        let base = if in_place {
            let all = host.try_storage_mut::<f32>().expect("held alone");
            all.as_mut_ptr()
        } else {
            let start = host.layout().start_offset();
            host.storage::<f32>()[start..].as_ptr().cast_mut()
        };
        let g = RowPtrs {
            addr: base as usize,
            cols: f,
            stride,
        };
        let u = match u {
            None if gated => Some(RowPtrs {
                addr: base.wrapping_add(f) as usize,
                ..g
            }),
            u => u,
        };
        let mut own = (!in_place).then(|| unwritten(m * width));
        let out = match own.as_mut() {
            Some(d) => RowsMut {
                addr: d.as_mut_ptr() as usize,
                stride: width,
            },
            None => RowsMut {
                addr: base as usize,
                stride: 2 * stride,
            },
        };
        // Each block's column sums, added in the order of the blocks (the same sum every run).
        let blocks = std::sync::Mutex::new(Vec::new());
        let then = |rows: std::ops::Range<usize>, block: &mut [f32]| {
            let mut acc = sums.then(|| vec![0.0f32; width]);
            let start = rows.start;
            for (r, dh) in rows.zip(block.chunks_mut(f)) {
                // SAFETY (every `row`): rows r of g, u and d(pre) are this block's alone; g's
                // and u's are read whole (into `dh` or the scratch row) before d(pre)'s, which
                // may lie over them, is written.
                match u {
                    None => {
                        backward_row_in_place(act, unsafe { g.row(r) }, dh);
                        add_row(acc.as_deref_mut(), dh);
                        round_into(dh, unsafe { out.row(r, width) });
                    }
                    Some(u) => with_scratch(width, |s| {
                        let (dg, du) = s.split_at_mut(f);
                        let (g, u) = unsafe { (g.row(r), u.row(r)) };
                        backward_row(act, dh, g, Some((u, du)), dg);
                        add_row(acc.as_deref_mut(), s);
                        round_into(s, unsafe { out.row(r, width) });
                    }),
                }
            }
            if let Some(acc) = acc {
                blocks.lock().expect("no panic holds it").push((start, acc));
            }
        };
        // SAFETY: the matrices address their tensors' shapes.
        unsafe { bf16::gemm_then(m, f, k, a, b, None, &then) };
        let sums = sums.then(|| {
            let mut blocks = blocks.into_inner().expect("no panic holds it");
            blocks.sort_by_key(|(start, _)| *start);
            let mut total = vec![0.0f32; width];
            for (_, acc) in &blocks {
                add_row(Some(&mut total), acc);
            }
            FlexTensor::from_data(burn::tensor::TensorData::new(total, [width]))
        });
        let shape = Shape::new([m, width]);
        let d = match own {
            // SAFETY: `then` rounded every row of d(pre) into place.
            Some(d) => bf16_tensor(unsafe { written(d) }, shape),
            // The host's buffer, now rows of bf16 `2·stride` apart (each within the f32 row it
            // replaced: `width ≤ 2·host_cols`).
            None => {
                let layout = burn_flex::Layout::new(shape, vec![2 * stride as isize, 1], 0);
                FlexTensor::from_arc(host.data_arc(), layout, DType::BF16)
            }
        };
        drop(host);
        let d = if !gated {
            Pre::Plain(d)
        } else if host_cols == f {
            Pre::Gated(d.narrow(1, 0, f), d.narrow(1, f, f))
        } else {
            Pre::Fused(d)
        };
        Ok((d, sums))
    }

    fn ffn_hidden_backward(dh: FlexTensor, pre: &Pre<Flex>, activation: Activation) -> Pre<Flex> {
        match hidden_backward(dh, pre.clone(), activation, Precision::F32, false) {
            Ok((d, _)) => d,
            Err((dh, _)) => composed::hidden_backward::<Flex>(dh, pre, activation),
        }
    }

    /// One pass: each row of the gradient computed in f32, added into the column sums, and
    /// written as the products take it (see [`hidden_backward`]); an ungated gradient left in
    /// f32 over `dh` for the kernel is rounded once `pre` is freed.
    fn ffn_hidden_backward_operand(
        dh: FlexTensor,
        pre: Pre<Flex>,
        activation: Activation,
        precision: Precision,
        sums: bool,
    ) -> (Pre<Flex>, Option<FlexTensor>) {
        match hidden_backward(dh, pre, activation, precision, sums) {
            Ok(done) => done,
            Err((dh, pre)) => {
                let d = composed::hidden_backward::<Flex>(dh, &pre, activation);
                drop(pre);
                as_operands::<Flex>(d, precision, sums)
            }
        }
    }
}

/// The pre-activations as `a` (or `g`) and, gated, `u` (views of a fused `[g | u]`).
fn halves(pre: &Pre<Flex>) -> (FlexTensor, Option<FlexTensor>) {
    match pre {
        Pre::Plain(a) => (a.clone(), None),
        Pre::Gated(g, u) => (g.clone(), Some(u.clone())),
        Pre::Fused(gu) => {
            let f = gu.layout().shape()[1] / 2;
            (gu.narrow(1, 0, f), Some(gu.narrow(1, f, f)))
        }
    }
}

/// `h = φ(a)` or `φ(g) ⊙ u`, in f32 or rounded to bf16 row by row; `None` where the loops do not
/// apply (`tanh`, other dtypes or layouts).
fn hidden(pre: &Pre<Flex>, activation: Activation, precision: Precision) -> Option<FlexTensor> {
    let act = vectorised(activation)?;
    let (g, u) = halves(pre);
    let g = rows(&g)?;
    let u = match &u {
        Some(u) => Some(rows(u)?),
        None => None,
    };
    let row = |r: usize, h: &mut [f32]| forward_row(act, g.row(r), u.map(|u| u.row(r)), h);
    Some(match precision {
        Precision::F32 => {
            let (out, _) = Out::<f32>::from_rows(g.rows, g.cols, false, |r, h, _| row(r, h));
            out.tensor()
        }
        Precision::Bf16 => {
            let (out, _) = Out::<u16>::from_rows(g.rows, g.cols, false, |r, h, _| {
                with_scratch(g.cols, |s| {
                    row(r, s);
                    round_row(s, h);
                })
            });
            out.bf16_tensor()
        }
    })
}

/// The gradient of the pre-activations and, when `sums`, the column sums of the unrounded
/// gradient; `Err((dh, pre))` where the loops do not apply. In f32 a new tensor, or, ungated,
/// written over `dh` when nothing else holds it. In bf16 the products' operands
/// ([`Kernels::ffn_bf16_passing`]), rounded to bf16 as they are written, with two exceptions
/// where the gradient can be written over a buffer held alone: on `bf16.rs`'s kernel an
/// ungated one is written over `dh` in f32 and rounded into a bf16 copy once `pre` is freed;
/// off it, where the products widen bf16 to f32 anyway, the rounded values are kept in f32
/// over `dh` (ungated) or over the pre-activations (gated, [`gated_over_pre`]): no copy, and
/// nothing to widen.
// The tensors come back to the caller once a pass (their handles, not their data).
#[allow(clippy::type_complexity, clippy::result_large_err)]
fn hidden_backward(
    dh: FlexTensor,
    pre: Pre<Flex>,
    activation: Activation,
    precision: Precision,
    sums: bool,
) -> Result<(Pre<Flex>, Option<FlexTensor>), (FlexTensor, Pre<Flex>)> {
    let Some(act) = vectorised(activation) else {
        return Err((dh, pre));
    };
    // Off the kernel, bf16 values are kept in f32.
    let kept_f32 = precision == Precision::Bf16 && !on_kernel();
    let pre = if kept_f32 {
        match gated_over_pre(act, &dh, pre, sums) {
            Ok(done) => return Ok(done),
            Err(pre) => pre,
        }
    } else {
        pre
    };
    let (g, u) = halves(&pre);
    let (Some(g_rows), Some(dh_rows)) = (rows(&g), rows(&dh)) else {
        drop((g, u));
        return Err((dh, pre));
    };
    let u_rows = match &u {
        Some(u) => match rows(u) {
            Some(u) => Some(u),
            None => {
                drop((g, u));
                return Err((dh, pre));
            }
        },
        None => None,
    };
    let (tokens, f) = (g_rows.rows, g_rows.cols);
    // One row of the gradient in f32: `da`, or `[dg | du]` (the width of a fused `[g | u]`).
    let width = if u_rows.is_some() { 2 * f } else { f };
    let over_dh = u_rows.is_none() && dh_rows.stride == f && dh.layout().start_offset() == 0;
    let mut dh = dh;
    let (d, sums) = match dh.try_storage_mut::<f32>().filter(|_| over_dh) {
        // Ungated: da = dh ⊙ φ'(a), written over dh when nothing else holds it (one [tokens,
        // d_ff] buffer less at the backward pass's peak). On the bf16 kernel too: rounded
        // below once the pre-activations are freed, it needs less memory at once than a bf16
        // copy written beside them.
        Some(d) => {
            let sums = for_rows(&mut d[..tokens * f], f, sums, |r, d, acc| {
                backward_row_in_place(act, g_rows.row(r), d);
                add_row(acc, d);
                if kept_f32 {
                    round_in_place(d);
                }
            });
            (dh, sums)
        }
        None => {
            let dh_rows = rows(&dh).expect("checked above");
            let row = |r: usize, d: &mut [f32]| match u_rows {
                None => backward_row(act, dh_rows.row(r), g_rows.row(r), None, d),
                Some(u) => {
                    let (dg, du) = d.split_at_mut(f);
                    backward_row(act, dh_rows.row(r), g_rows.row(r), Some((u.row(r), du)), dg)
                }
            };
            match precision {
                Precision::F32 => {
                    let (out, sums) = Out::<f32>::from_rows(tokens, width, sums, |r, d, acc| {
                        row(r, d);
                        add_row(acc, d);
                    });
                    (out.tensor(), sums)
                }
                Precision::Bf16 => {
                    let (out, sums) = Out::<u16>::from_rows(tokens, width, sums, |r, d, acc| {
                        with_scratch(width, |s| {
                            row(r, s);
                            add_row(acc, s);
                            round_row(s, d);
                        })
                    });
                    (out.bf16_tensor(), sums)
                }
            }
        }
    };
    let sums = sums.map(|s| FlexTensor::from_data(burn::tensor::TensorData::new(s, [width])));
    let gated = u.is_some();
    drop((g, u));
    let fused = matches!(pre, Pre::Fused(_));
    drop(pre);
    // Ungated on the kernel: the f32 gradient rounded now that `pre` is freed.
    let d = if precision == Precision::Bf16 && d.dtype() == DType::F32 && !kept_f32 {
        <Flex as Kernels>::ffn_bf16(d)
    } else {
        d
    };
    let d = match (gated, fused) {
        (false, _) => Pre::Plain(d),
        (true, true) => Pre::Fused(d),
        (true, false) => Pre::Gated(d.narrow(1, 0, f), d.narrow(1, f, f)),
    };
    Ok((d, sums))
}

/// Off the kernel in bf16: a gated gradient `[dg | du]` written over the pre-activations (a fused
/// `[g | u]`, or `g` and `u`) when nothing else holds them, each row read whole before it is
/// overwritten, rounded to bf16 values kept in f32. `Err(pre)` otherwise.
// The tensors come back to the caller once a pass (their handles, not their data).
#[allow(clippy::type_complexity, clippy::result_large_err)]
fn gated_over_pre(
    act: Activation,
    dh: &FlexTensor,
    pre: Pre<Flex>,
    sums: bool,
) -> Result<(Pre<Flex>, Option<FlexTensor>), Pre<Flex>> {
    let Some(dh) = rows(dh) else {
        return Err(pre);
    };
    let (tokens, f) = (dh.rows, dh.cols);
    // A buffer of its own, whole, row-major, `[tokens, cols]`.
    let alone = |t: &FlexTensor, cols: usize| {
        t.dtype() == DType::F32
            && t.is_unique()
            && t.layout().start_offset() == 0
            && t.layout().is_contiguous()
            && t.layout().shape().dims::<2>() == [tokens, cols]
    };
    // Rows of `g` and of `u`: the two halves of a fused row, or two buffers.
    let (hosts, g, u) = match pre {
        Pre::Fused(mut gu) if alone(&gu, 2 * f) => {
            let base = gu
                .try_storage_mut::<f32>()
                .expect("held alone")
                .as_mut_ptr();
            let g = RowPtrs {
                addr: base as usize,
                cols: f,
                stride: 2 * f,
            };
            let u = RowPtrs {
                addr: base.wrapping_add(f) as usize,
                ..g
            };
            ([Some(gu), None], g, u)
        }
        Pre::Gated(mut g, mut u) if alone(&g, f) && alone(&u, f) => {
            let [pg, pu] = [&mut g, &mut u].map(|t| RowPtrs {
                addr: t.try_storage_mut::<f32>().expect("held alone").as_mut_ptr() as usize,
                cols: f,
                stride: f,
            });
            ([Some(g), Some(u)], pg, pu)
        }
        pre => return Err(pre),
    };
    let sums = for_row_indices(tokens, 2 * f, sums, |r, acc| {
        with_scratch(2 * f, |s| {
            let (dg, du) = s.split_at_mut(f);
            // SAFETY: rows r of g and u are this call's alone; they are read whole (the borrows
            // end with `backward_row`) before they are written.
            backward_row(
                act,
                dh.row(r),
                unsafe { g.row(r) },
                Some((unsafe { u.row(r) }, du)),
                dg,
            );
            add_row(acc, s);
            let (dg, du) = s.split_at(f);
            unsafe {
                round_f32_into(dg, g.row_mut(r));
                round_f32_into(du, u.row_mut(r));
            }
        })
    });
    let sums = sums.map(|s| FlexTensor::from_data(burn::tensor::TensorData::new(s, [2 * f])));
    let d = match hosts {
        [Some(gu), None] => Pre::Fused(gu),
        [Some(g), Some(u)] => Pre::Gated(g, u),
        _ => unreachable!("one host or two"),
    };
    Ok((d, sums))
}

thread_local! {
    /// Each thread's f32 row, for values that are rounded to bf16 as they are written.
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Calls `f` with this thread's scratch row of `len` floats.
fn with_scratch(len: usize, f: impl FnOnce(&mut [f32])) {
    SCRATCH.with_borrow_mut(|s| {
        if s.len() < len {
            s.resize(len, 0.0);
        }
        f(&mut s[..len])
    })
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
    unsafe { product(m, n, |c| blas.sgemm(m, n, k, a, b, c, n)) }
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

/// Elements of a bf16 operand widened to f32 at once (4 MiB) by [`matmul_bf16_widened`].
const WIDEN_BLOCK: usize = 1 << 20;

/// `lhs · rhs` for bf16 operands off `bf16.rs`'s kernel: widened to f32 (exactly) and multiplied
/// by the f32 product. With a BLAS, an operand larger than [`WIDEN_BLOCK`] elements is widened
/// a block at a time: blocks of rows of `lhs` (each gives rows of the product) or of columns of
/// `rhs` (columns of the product), the larger of the two, so that no f32 copy of it is ever
/// whole. (An f32 copy of `d(pre)` is as large as the f32 pre-activations that bf16 halves.)
fn matmul_bf16_widened(lhs: FlexTensor, rhs: FlexTensor) -> FlexTensor {
    let [m, k] = lhs.layout().shape().dims::<2>();
    let n = rhs.layout().shape()[1];
    let whole = |lhs, rhs| <Flex as Kernels>::ffn_matmul(widen(lhs), widen(rhs));
    let Some(blas) = blas::get() else {
        return whole(lhs, rhs);
    };
    // The elements to widen: an f32 operand (rounded already) is taken as it is.
    let to_widen = |t: &FlexTensor, len: usize| if t.dtype() == DType::BF16 { len } else { 0 };
    let (lhs_len, rhs_len) = (to_widen(&lhs, m * k), to_widen(&rhs, k * n));
    if lhs_len <= WIDEN_BLOCK && rhs_len <= WIDEN_BLOCK || m == 0 || n == 0 || k == 0 {
        return whole(lhs, rhs);
    }
    // Rows (of lhs) or columns (of rhs) per block, in multiples of 16 (at least 16, however
    // long the sums), and no more than there are.
    let per_block = |len: usize| (WIDEN_BLOCK / k).next_multiple_of(16).max(16).min(len);
    if lhs_len >= rhs_len {
        let (_rhs, b) = operand(widen(rhs));
        let rows = per_block(m);
        // SAFETY: each block writes its rows of the product; together they write all m·n.
        unsafe {
            product(m, n, |c| {
                for start in (0..m).step_by(rows) {
                    let size = rows.min(m - start);
                    let (_block, a) = operand(widen(lhs.narrow(0, start, size)));
                    blas.sgemm(size, n, k, a, b, c.add(start * n), n);
                }
            })
        }
    } else {
        let (_lhs, a) = operand(widen(lhs));
        let cols = per_block(n);
        // SAFETY: each block writes its columns of the product; together they write all m·n.
        unsafe {
            product(m, n, |c| {
                for start in (0..n).step_by(cols) {
                    let size = cols.min(n - start);
                    let (_block, b) = operand(widen(rhs.narrow(1, start, size)));
                    blas.sgemm(m, size, k, a, b, c.add(start), n);
                }
            })
        }
    }
}

/// A 2-D bf16 tensor widened to f32 (exactly: its 16 bits become an f32's high 16) in the order
/// its elements lie in memory: a transposed view (unit row stride) becomes a transposed f32
/// view, which the SGEMM reads as it is, where burn's cast would first gather it element by
/// element into row-major order. In parallel over rows (or columns). Other layouts and dtypes
/// take burn's cast.
fn widen(t: FlexTensor) -> FlexTensor {
    use burn::backend::ops::FloatTensorOps;
    let cast = |t| <Flex as FloatTensorOps<Flex>>::float_cast(t, burn::tensor::FloatDType::F32);
    if t.dtype() == DType::F32 {
        return t;
    }
    if t.dtype() != DType::BF16 || t.layout().num_dims() != 2 {
        return cast(t);
    }
    let layout = t.layout();
    let [rows, cols] = layout.shape().dims::<2>();
    let [s0, s1] = [layout.strides()[0], layout.strides()[1]];
    // Lines of `len` contiguous elements, `stride` apart: rows, or columns of a transpose.
    let (lines, len, stride, transposed) = if s1 == 1 && s0 >= cols as isize {
        (rows, cols, s0 as usize, false)
    } else if s0 == 1 && s1 >= rows as isize {
        (cols, rows, s1 as usize, true)
    } else {
        return cast(t);
    };
    if lines == 0 || len == 0 {
        return cast(t);
    }
    let data = &t.storage::<burn::tensor::bf16>()[layout.start_offset()..];
    let mut out: Vec<std::mem::MaybeUninit<f32>> = Vec::with_capacity(lines * len);
    // SAFETY: `MaybeUninit` needs no initialisation; every slot is written below.
    unsafe { out.set_len(lines * len) };
    out.par_chunks_mut(len)
        .with_min_len((1 << 16) / len + 1)
        .enumerate()
        .for_each(|(i, line)| {
            let src = &data[i * stride..i * stride + len];
            for (o, v) in line.iter_mut().zip(src) {
                o.write(f32::from_bits(u32::from(v.to_bits()) << 16));
            }
        });
    // SAFETY: every element was written above; `MaybeUninit<f32>` has f32's layout.
    let out = unsafe {
        let mut out = std::mem::ManuallyDrop::new(out);
        Vec::from_raw_parts(out.as_mut_ptr().cast::<f32>(), out.len(), out.capacity())
    };
    let shape = if transposed {
        [cols, rows]
    } else {
        [rows, cols]
    };
    let t = FlexTensor::from_data(burn::tensor::TensorData::new(out, shape));
    if transposed {
        <Flex as FloatTensorOps<Flex>>::float_swap_dims(t, 0, 1)
    } else {
        t
    }
}

/// `lhs · rhs` for 2-D bf16 operands of any strides, in f32, by `bf16.rs`'s kernel.
fn matmul_bf16(lhs: FlexTensor, rhs: FlexTensor) -> FlexTensor {
    let ((lhs, a), (rhs, b)) = (bf16_matrix(lhs), bf16_matrix(rhs));
    let [m, k] = lhs.layout().shape().dims::<2>();
    let n = rhs.layout().shape()[1];
    // SAFETY: the strides address the operands' shapes; `gemm` writes all m·n floats.
    unsafe { product(m, n, |c| bf16::gemm(m, n, k, a, b, c)) }
}

/// A 2-D bf16 tensor as `bf16.rs`'s matrix (copied to contiguous memory if a stride is
/// negative), with the tensor that holds it.
fn bf16_matrix(t: FlexTensor) -> (FlexTensor, bf16::Matrix) {
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
    described(t, matrix)
}

/// `t` with `describe(t)`, or, where its layout has no description, a contiguous copy with its
/// own (every contiguous matrix has one).
fn described<T>(t: FlexTensor, describe: impl Fn(&FlexTensor) -> Option<T>) -> (FlexTensor, T) {
    match describe(&t) {
        Some(d) => (t, d),
        None => {
            let t = t.to_contiguous();
            let d = describe(&t).expect("a contiguous matrix is described");
            (t, d)
        }
    }
}

/// Whether a bf16 product of these operands runs on `bf16.rs`'s kernel (both 2-D bf16, on a
/// CPU with `avx512_bf16`), as the fused passes need.
fn on_bf16_kernel(operands: [&FlexTensor; 2]) -> bool {
    on_kernel()
        && operands
            .iter()
            .all(|t| t.dtype() == DType::BF16 && t.layout().num_dims() == 2)
}

/// An output of bf16 slots, each written once (by [`round_into`]); its address crosses to rayon's
/// threads, and each block of rows is written by one thread.
#[derive(Clone, Copy)]
struct RowsMut {
    addr: usize,
    /// Slots from the start of one row to the next.
    stride: usize,
}

impl RowsMut {
    /// Row `r` (`cols` wide).
    ///
    /// # Safety
    ///
    /// Row `r` must be inside the buffer, and no other thread may touch it meanwhile.
    #[allow(clippy::mut_from_ref)]
    unsafe fn row(&self, r: usize, cols: usize) -> &mut [MaybeUninit<u16>] {
        let first = (self.addr as *mut MaybeUninit<u16>).wrapping_add(r * self.stride);
        unsafe { std::slice::from_raw_parts_mut(first, cols) }
    }
}

/// The rows of an f32 matrix by address (it crosses to rayon's threads): each row is borrowed
/// only while it is read, so that a pass may write over a row once it has read it.
#[derive(Clone, Copy)]
struct RowPtrs {
    addr: usize,
    cols: usize,
    stride: usize,
}

impl RowPtrs {
    fn of(rows: Rows<'_>) -> Self {
        Self {
            addr: rows.data.as_ptr() as usize,
            cols: rows.cols,
            stride: rows.stride,
        }
    }

    /// Row `r`.
    ///
    /// # Safety
    ///
    /// Row `r` must be inside the matrix, and not written while the borrow lives.
    unsafe fn row<'a>(self, r: usize) -> &'a [f32] {
        let first = (self.addr as *const f32).wrapping_add(r * self.stride);
        unsafe { std::slice::from_raw_parts(first, self.cols) }
    }
    /// Row `r`, to write.
    ///
    /// # Safety
    ///
    /// Row `r` must be inside a matrix this pass may write, and not touched by anything else
    /// while the borrow lives.
    #[allow(clippy::mut_from_ref)]
    unsafe fn row_mut<'a>(self, r: usize) -> &'a mut [f32] {
        let first = (self.addr as *mut f32).wrapping_add(r * self.stride);
        unsafe { std::slice::from_raw_parts_mut(first, self.cols) }
    }
}

/// The values of a contiguous f32 tensor (a bias).
fn contiguous_f32(t: &FlexTensor) -> Option<&[f32]> {
    let layout = t.layout();
    if t.dtype() != DType::F32 || !layout.is_contiguous() {
        return None;
    }
    let start = layout.start_offset();
    Some(&t.storage::<f32>()[start..start + layout.num_elements()])
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
    described(t, describe)
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

/// A new contiguous `[rows, cols]` output (f32, or bf16 as its bits), filled row block by row
/// block on rayon's threads.
struct Out<T> {
    data: Vec<T>,
    rows: usize,
    cols: usize,
}

impl<T: Copy + Default + Send> Out<T> {
    /// The output whose row `r` is `f(r, row, sums)` ([`for_rows`]). Each row is zeroed just
    /// before `f` writes it, by the thread that writes it: not in a pass of its own over the
    /// whole output on the calling thread (that pass took 1 % of an f32 FFN step).
    fn from_rows(
        rows: usize,
        cols: usize,
        sums: bool,
        f: impl Fn(usize, &mut [T], Option<&mut [f32]>) + Sync,
    ) -> (Self, Option<Vec<f32>>) {
        let mut data: Vec<MaybeUninit<T>> = Vec::with_capacity(rows * cols);
        // SAFETY: `MaybeUninit` needs no initialisation.
        unsafe { data.set_len(rows * cols) };
        let sums = for_rows(&mut data, cols, sums, |r, row, acc| {
            for x in row.iter_mut() {
                x.write(T::default());
            }
            // SAFETY: every element of the row was written just above.
            let row = unsafe { &mut *(row as *mut [MaybeUninit<T>] as *mut [T]) };
            f(r, row, acc)
        });
        let mut data = std::mem::ManuallyDrop::new(data);
        // SAFETY: `for_rows` visits every row (and with `cols = 0` there is no element), each
        // initialised above; `MaybeUninit<T>` has `T`'s layout, so the allocation moves over whole.
        let data = unsafe {
            Vec::from_raw_parts(data.as_mut_ptr().cast::<T>(), data.len(), data.capacity())
        };
        (Self { data, rows, cols }, sums)
    }
}

impl Out<f32> {
    fn tensor(self) -> FlexTensor {
        FlexTensor::from_data(burn::tensor::TensorData::new(
            self.data,
            Shape::new([self.rows, self.cols]),
        ))
    }
}

impl Out<u16> {
    fn bf16_tensor(self) -> FlexTensor {
        bf16_tensor(self.data, Shape::new([self.rows, self.cols]))
    }
}

/// A bf16 tensor of `shape` from the values' bits.
fn bf16_tensor(bits: Vec<u16>, shape: Shape) -> FlexTensor {
    let mut bits = std::mem::ManuallyDrop::new(bits);
    // SAFETY: `bf16` is a transparent `u16`: same size, alignment and every bit pattern a
    // value; the vector's allocation moves over whole.
    let values = unsafe {
        Vec::from_raw_parts(
            bits.as_mut_ptr().cast::<burn::tensor::bf16>(),
            bits.len(),
            bits.capacity(),
        )
    };
    FlexTensor::from_data(burn::tensor::TensorData::new(values, shape))
}

/// `t` rounded to bf16 by the vectorised loop on rayon's threads, blocks of 64k elements (burn's
/// cast, which rounds the same way, is one scalar loop); `None` unless `t` is f32 and
/// contiguous.
fn round_to_bf16(t: &FlexTensor) -> Option<FlexTensor> {
    let layout = t.layout();
    if t.dtype() != DType::F32 || !layout.is_contiguous() {
        return None;
    }
    let shape = layout.shape().clone();
    let start = layout.start_offset();
    let x = &t.storage::<f32>()[start..start + shape.num_elements()];
    let mut bits = unwritten(x.len());
    const BLOCK: usize = 1 << 16;
    bits.par_chunks_mut(BLOCK)
        .zip(x.par_chunks(BLOCK))
        .for_each(|(out, x)| round_into(x, out));
    // SAFETY: the chunks cover every slot.
    Some(bf16_tensor(unsafe { written(bits) }, shape))
}

/// `t`'s values rounded to bf16 in place, kept f32 (see [`Kernels::ffn_bf16_passing`]), by the
/// vectorised loop on rayon's threads; `Err(t)` unless `t` is f32, contiguous and held alone.
fn rounded_in_place(mut t: FlexTensor) -> Result<FlexTensor, FlexTensor> {
    let layout = t.layout();
    if t.dtype() != DType::F32 || !layout.is_contiguous() || !t.is_unique() {
        return Err(t);
    }
    let (start, len) = (layout.start_offset(), layout.num_elements());
    let Some(all) = t.try_storage_mut::<f32>() else {
        return Err(t);
    };
    all[start..start + len]
        .par_chunks_mut(1 << 16)
        .for_each(round_in_place);
    Ok(t)
}

/// Calls `f(r, row, sums)` for every row `r` of `data` (`cols` wide); blocks of about 16k
/// elements go to rayon's threads. With `sums`, each block of rows gets a column-sum
/// accumulator (`f` adds its row into it) and their total is returned.
fn for_rows<T: Send>(
    data: &mut [T],
    cols: usize,
    sums: bool,
    f: impl Fn(usize, &mut [T], Option<&mut [f32]>) + Sync,
) -> Option<Vec<f32>> {
    if cols == 0 {
        return sums.then(Vec::new);
    }
    let block = (16_384 / cols).max(1);
    let chunks = data.par_chunks_mut(block * cols).enumerate();
    let each = |(b, chunk): (usize, &mut [T]), mut acc: Option<&mut [f32]>| {
        for (i, row) in chunk.chunks_mut(cols).enumerate() {
            f(b * block + i, row, acc.as_deref_mut());
        }
    };
    if !sums {
        chunks.for_each(|c| each(c, None));
        return None;
    }
    let total = chunks
        .fold(
            || vec![0.0f32; cols],
            |mut acc, c| {
                each(c, Some(&mut acc));
                acc
            },
        )
        .reduce(
            || vec![0.0f32; cols],
            |mut a, b| {
                add_row(Some(&mut a), &b);
                a
            },
        );
    Some(total)
}

/// Calls `f(r, sums)` for every row index `r < rows` of a pass over rows `cols` wide, as
/// [`for_rows`] splits them, with a `cols`-wide column-sum accumulator when `sums`: for passes
/// that address their rows themselves.
fn for_row_indices(
    rows: usize,
    cols: usize,
    sums: bool,
    f: impl Fn(usize, Option<&mut [f32]>) + Sync,
) -> Option<Vec<f32>> {
    // Rows of zero-sized slots: the split without the memory.
    let mut slots = vec![(); rows * cols];
    for_rows(&mut slots, cols, sums, |r, _, acc| f(r, acc))
}

/// Whether bf16 products run on `bf16.rs`'s kernel: where [`bf16::chosen`] says so, or, inside
/// [`tests::widened`] and [`tests::on_kernel`], as the test asks (the kernel only where the CPU
/// can run it).
fn on_kernel() -> bool {
    #[cfg(test)]
    if let Some(widen) = tests::WIDEN.with(std::cell::Cell::get) {
        return !widen && bf16::available();
    }
    bf16::chosen()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    thread_local! {
        /// Makes bf16 products on this thread take the widening fallback (`Some(true)`) or the
        /// kernel where the CPU has it (`Some(false)`) whatever [`bf16::chosen`] says.
        pub(super) static WIDEN: std::cell::Cell<Option<bool>> =
            const { std::cell::Cell::new(None) };
    }

    fn with_widen<T>(widen: bool, work: impl FnOnce() -> T) -> T {
        let before = WIDEN.with(|w| w.replace(Some(widen)));
        let out = work();
        WIDEN.with(|w| w.set(before));
        out
    }

    /// Runs `work` with bf16 products on the widening fallback (as on a CPU without
    /// `avx512_bf16`).
    pub(crate) fn widened<T>(work: impl FnOnce() -> T) -> T {
        with_widen(true, work)
    }

    /// Runs `work` with bf16 products on `bf16.rs`'s kernel where the CPU has `avx512_bf16`
    /// (also where ffn would widen: Intel).
    pub(crate) fn on_kernel<T>(work: impl FnOnce() -> T) -> T {
        with_widen(false, work)
    }

    /// `len` values on [-2, 2) from a linear congruential generator at `seed` (advanced).
    fn uniform(seed: &mut u32, len: usize) -> Vec<f32> {
        (0..len)
            .map(|_| {
                *seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (*seed >> 8) as f32 / (1u32 << 24) as f32 * 4.0 - 2.0
            })
            .collect()
    }

    /// Pre-activations `[m, f]` (`[m, 2·f]` fused) from `draw`, one of each form, with an
    /// activation: GELU plain, SiLU gated with `u` apart, `fused` for a fused `[g | u]`.
    fn pre_cases(
        draw: &mut impl FnMut(usize) -> Vec<f32>,
        m: usize,
        f: usize,
        fused: Activation,
    ) -> [(Activation, Pre<Flex>); 3] {
        let tensor = |v: Vec<f32>, shape: [usize; 2]| {
            FlexTensor::from_data(burn::tensor::TensorData::new(v, shape))
        };
        let (a, g, u) = (draw(m * f), draw(m * f), draw(m * f));
        let gu: Vec<f32> = g
            .chunks(f)
            .zip(u.chunks(f))
            .flat_map(|(g, u)| g.iter().chain(u).copied())
            .collect();
        [
            (Activation::Gelu, Pre::Plain(tensor(a, [m, f]))),
            (
                Activation::Silu,
                Pre::Gated(tensor(g, [m, f]), tensor(u, [m, f])),
            ),
            (fused, Pre::Fused(tensor(gu, [m, 2 * f]))),
        ]
    }

    /// The tensors of a `Pre`, in order.
    fn parts(d: &Pre<Flex>) -> Vec<FlexTensor> {
        match d {
            Pre::Plain(d) | Pre::Fused(d) => vec![d.clone()],
            Pre::Gated(dg, du) => vec![dg.clone(), du.clone()],
        }
    }

    /// `d(pre)` from the fused backward pass is written over the pre-activations when they are
    /// held alone (the same buffer comes back, as bf16 rows in the f32 rows' place), and is
    /// then bit for bit the `d(pre)` written to a buffer of its own (pre-activations shared):
    /// plain, gated with `u` apart, and fused `[g | u]`, with an odd width and the bias sums.
    #[test]
    fn d_pre_is_written_over_pre_held_alone() {
        use burn::tensor::TensorData;
        if !bf16::available() {
            return;
        }
        let (m, k, f) = (29, 40, 37);
        let mut seed = 5u32;
        let mut draw = |len: usize| uniform(&mut seed, len);
        let f32_tensor =
            |v: Vec<f32>, shape: [usize; 2]| FlexTensor::from_data(TensorData::new(v, shape));
        let round = |t: FlexTensor| {
            use burn::backend::ops::FloatTensorOps;
            <Flex as FloatTensorOps<Flex>>::float_cast(t, burn::tensor::FloatDType::BF16)
        };
        let dy = round(f32_tensor(draw(m * k), [m, k]));
        let w_down = round(f32_tensor(draw(f * k), [f, k]));
        let cases = pre_cases(&mut draw, m, f, Activation::Silu);
        let values = |d: &Pre<Flex>| -> Vec<u16> {
            parts(d)
                .into_iter()
                .flat_map(|d| d.into_data().try_to_vec::<burn::tensor::bf16>().unwrap())
                .map(|v| v.to_bits())
                .collect()
        };
        let sums = |s: Option<FlexTensor>| s.unwrap().into_data().try_to_vec::<f32>().unwrap();
        // The address of the buffer that holds `a`, `g` or `[g | u]` (or d(pre)).
        let buffer = |pre: &Pre<Flex>| match pre {
            Pre::Plain(t) | Pre::Fused(t) | Pre::Gated(t, _) => {
                std::sync::Arc::as_ptr(&t.data_arc()) as usize
            }
        };
        for ((act, pre), kind) in cases.into_iter().zip(["plain", "gated", "fused"]) {
            let call = |pre| {
                <Flex as Kernels>::ffn_down_backward_operand(
                    &dy,
                    &w_down,
                    pre,
                    act,
                    Precision::Bf16,
                    true,
                )
                .unwrap_or_else(|_| panic!("{kind}: declined"))
            };
            let host = buffer(&pre);
            // Shared with `pre` here: written apart; then held alone: written over it.
            let (apart, apart_sums) = on_kernel(|| call(pre.clone()));
            let (d, d_sums) = on_kernel(|| call(pre));
            assert_ne!(buffer(&apart), host, "{kind}");
            assert_eq!(buffer(&d), host, "{kind}");
            assert_eq!(values(&d), values(&apart), "{kind}");
            assert_eq!(sums(d_sums), sums(apart_sums), "{kind}");
        }
    }

    /// Off the kernel, bf16 values kept in f32: `d(pre)` is rounded in place over `dh`
    /// (ungated) or over the pre-activations (gated `g` and `u`, fused `[g | u]`) when they are
    /// held alone (the same buffer comes back, f32), and is otherwise written apart in bf16; in
    /// both its values are burn's rounding (the cast to bf16 and back) of the f32 gradient, and
    /// the bias sums are the unrounded gradient's. `ffn_bf16_passing` rounds a tensor held
    /// alone in place and copies a shared one to bf16.
    #[test]
    fn widened_d_pre_is_rounded_over_a_buffer_held_alone() {
        use burn::backend::ops::FloatTensorOps;
        use burn::tensor::{FloatDType, TensorData};
        let (m, f) = (29, 37);
        let mut seed = 7u32;
        let mut draw = |len: usize| uniform(&mut seed, len);
        let tensor =
            |v: Vec<f32>, shape: [usize; 2]| FlexTensor::from_data(TensorData::new(v, shape));
        let cast = |t: FlexTensor, dtype| <Flex as FloatTensorOps<Flex>>::float_cast(t, dtype);
        let dh = draw(m * f);
        let cases = pre_cases(&mut draw, m, f, Activation::Relu);
        // Each part's values as f32 (bf16 ones widened by burn's cast).
        let values = |d: &Pre<Flex>| -> Vec<f32> {
            parts(d)
                .into_iter()
                .flat_map(|d| {
                    cast(d, FloatDType::F32)
                        .into_data()
                        .try_to_vec::<f32>()
                        .unwrap()
                })
                .collect()
        };
        let dtype = |d: &Pre<Flex>| match d {
            Pre::Plain(t) | Pre::Fused(t) | Pre::Gated(t, _) => t.dtype(),
        };
        let buffer = |t: &FlexTensor| std::sync::Arc::as_ptr(&t.data_arc()) as usize;
        let host = |pre: &Pre<Flex>| match pre {
            Pre::Plain(t) | Pre::Fused(t) | Pre::Gated(t, _) => buffer(t),
        };
        let sums = |s: Option<FlexTensor>| s.unwrap().into_data().try_to_vec::<f32>().unwrap();
        for ((act, pre), kind) in cases.into_iter().zip(["plain", "gated", "fused"]) {
            let call = |dh: FlexTensor, pre, precision| {
                <Flex as Kernels>::ffn_hidden_backward_operand(dh, pre, act, precision, true)
            };
            let dh = || tensor(dh.clone(), [m, f]);
            // The oracle: the f32 gradient, rounded by burn's cast.
            let (exact, exact_sums) = call(dh(), pre.clone(), Precision::F32);
            let want: Vec<f32> = values(&exact)
                .into_iter()
                .map(|v| bf16::widen(bf16::round(v)))
                .collect();
            let round_trip: Vec<f32> = values(&match exact {
                Pre::Plain(t) => Pre::Plain(cast(t, FloatDType::BF16)),
                Pre::Fused(t) => Pre::Fused(cast(t, FloatDType::BF16)),
                Pre::Gated(g, u) => {
                    Pre::Gated(cast(g, FloatDType::BF16), cast(u, FloatDType::BF16))
                }
            });
            assert_eq!(want, round_trip, "{kind}: the rounding is burn's");
            // Shared: written apart, in bf16.
            let shared = dh();
            let (apart, apart_sums) =
                widened(|| call(shared.clone(), pre.clone(), Precision::Bf16));
            assert_eq!(dtype(&apart), DType::BF16, "{kind}");
            assert_ne!(host(&apart), host(&pre), "{kind}");
            assert_ne!(host(&apart), buffer(&shared), "{kind}");
            // Held alone: over dh (ungated) or the pre-activations (gated), in f32.
            let (dh, before) = (dh(), host(&pre));
            let dh_buffer = buffer(&dh);
            let (over, over_sums) = widened(|| call(dh, pre, Precision::Bf16));
            assert_eq!(dtype(&over), DType::F32, "{kind}");
            let expected = if kind == "plain" { dh_buffer } else { before };
            assert_eq!(
                host(&over),
                expected,
                "{kind}: not written over the buffer held alone"
            );
            for (d, s, how) in [(&apart, apart_sums, "apart"), (&over, over_sums, "over")] {
                assert_eq!(values(d), want, "{kind} {how}");
                assert_eq!(sums(s), sums(exact_sums.clone()), "{kind} {how}: sums");
            }
        }
        // `ffn_bf16_passing`: in place when held alone, else a bf16 copy; the same values.
        let x = draw(m * f);
        let want: Vec<f32> = x.iter().map(|&v| bf16::widen(bf16::round(v))).collect();
        let alone = tensor(x.clone(), [m, f]);
        let address = buffer(&alone);
        let rounded = widened(|| <Flex as Kernels>::ffn_bf16_passing(alone));
        assert_eq!((rounded.dtype(), buffer(&rounded)), (DType::F32, address));
        assert_eq!(rounded.into_data().try_to_vec::<f32>().unwrap(), want);
        let shared = tensor(x.clone(), [m, f]);
        let copy = widened(|| <Flex as Kernels>::ffn_bf16_passing(shared.clone()));
        assert_eq!(copy.dtype(), DType::BF16);
        let copy = cast(copy, FloatDType::F32)
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        assert_eq!(copy, want);
        assert_eq!(
            shared.into_data().try_to_vec::<f32>().unwrap(),
            x,
            "the shared one is untouched"
        );
    }

    /// Widening gives burn's cast bit for bit (infinities, subnormals, signed zeros; a NaN
    /// stays a NaN, its payload kept where burn's sets the quiet bit) in the logical order, for row-major tensors, transposed views (kept transposed: unit row
    /// stride), a view with a row stride wider than its rows, and one that starts inside its
    /// buffer; a layout of neither kind takes burn's cast.
    #[test]
    fn widening_is_burns_cast() {
        use burn::backend::ops::FloatTensorOps;
        use burn::tensor::{FloatDType, TensorData};
        let (m, n) = (300, 517);
        let mut seed = 11u32;
        let bits: Vec<burn::tensor::bf16> = (0..m * n)
            .map(|_| {
                seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                burn::tensor::bf16::from_bits((seed >> 16) as u16)
            })
            .collect();
        let t = FlexTensor::from_data(TensorData::new(bits, [m, n]));
        let swap = |t| <Flex as FloatTensorOps<Flex>>::float_swap_dims(t, 0, 1);
        let views = [
            ("row-major", t.clone()),
            ("transposed", swap(t.clone())),
            ("narrowed columns", t.narrow(1, 3, 400)),
            ("narrowed rows", t.narrow(0, 7, 200)),
            ("transposed, narrowed", swap(t.narrow(0, 5, 100))),
            (
                "strided",
                t.narrow(1, 0, 258).reshape(Shape::new([600, 129])),
            ),
        ];
        for (kind, view) in views {
            let cast = <Flex as FloatTensorOps<Flex>>::float_cast(view.clone(), FloatDType::F32);
            let widened = widen(view);
            assert_eq!(widened.layout().shape(), cast.layout().shape(), "{kind}");
            let as_bits = |t: FlexTensor| -> Vec<u32> {
                let v = t.into_data().try_to_vec::<f32>().unwrap();
                // Every NaN as one pattern.
                v.into_iter()
                    .map(|x| if x.is_nan() { u32::MAX } else { x.to_bits() })
                    .collect()
            };
            let (widened, cast) = (as_bits(widened), as_bits(cast));
            let differ = widened.iter().zip(&cast).filter(|(a, b)| a != b).count();
            assert_eq!(differ, 0, "{kind}: {differ} of {} differ", cast.len());
            assert!(cast.contains(&u32::MAX), "{kind}: NaNs among the patterns");
        }
    }

    /// The op's rounding to bf16 on Flex (parallel, vectorised) is burn's cast bit for bit, over
    /// several blocks of random bit patterns (NaN, infinities and subnormals among them), on a
    /// 3-D tensor and on a view that does not start at its buffer's start; a transposed view
    /// takes burn's cast.
    #[test]
    fn rounding_to_bf16_is_burns_cast() {
        use burn::backend::ops::FloatTensorOps;
        use burn::tensor::{FloatDType, TensorData};
        let mut seed = 11u32;
        let x: Vec<f32> = (0..3 * 70_000)
            .map(|_| {
                seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                f32::from_bits(seed)
            })
            .collect();
        let t = FlexTensor::from_data(TensorData::new(x, [3, 700, 100]));
        let bits = |t: FlexTensor| -> Vec<u16> {
            t.into_data()
                .as_slice::<burn::tensor::bf16>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        let cast = |t: FlexTensor| <Flex as FloatTensorOps<Flex>>::float_cast(t, FloatDType::BF16);
        let views = [
            t.clone(),
            t.narrow(0, 1, 2),
            t.narrow(0, 0, 2).transpose(1, 2),
        ];
        for view in views {
            let (ours, burns) = (
                <Flex as Kernels>::ffn_bf16(view.clone()),
                cast(view.clone()),
            );
            assert_eq!(ours.layout().shape(), burns.layout().shape());
            assert_eq!(ours.dtype(), DType::BF16);
            assert!(bits(ours) == bits(burns));
        }
    }

    /// A bf16 product, by the packed kernel (where the CPU has `avx512_bf16`) and by the
    /// widening fallback, equals the f64 sum of the products of the operands rounded to bf16,
    /// within the rounding of k f32 additions, for plain and transposed operands; also where
    /// the fallback widens `lhs` a block of rows at a time, and `rhs` a block of columns (an
    /// operand over `WIDEN_BLOCK` elements, with a BLAS). Rounding matters: the f32 product of
    /// the unrounded operands misses that reference by far more.
    #[test]
    fn bf16_products_are_exact_products_summed_in_f32() {
        // The last: sums longer than a block holds (each block still has at least 16 rows).
        for (m, n, k) in [
            (37, 45, 300),
            (1100, 40, 1000),
            (40, 1100, 1000),
            (2, 1, 1 << 21),
        ] {
            bf16_product_is_exact(m, n, k);
        }
    }

    fn bf16_product_is_exact(m: usize, n: usize, k: usize) {
        use burn::backend::ops::FloatTensorOps;
        use burn::tensor::{FloatDType, TensorData};
        let mut seed = 11u32;
        let mut values = |len: usize| uniform(&mut seed, len);
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
        // One operand rounded but kept f32 (`ffn_bf16_passing` off the kernel) beside a bf16 one,
        // or two such: the same function, only the bf16 one widened (in blocks when large).
        let (ra32, rb32) = (tensor(&ra, [m, k]), tensor(&rb, [k, n]));
        for (lhs, rhs) in [
            (ra32.clone(), b16.clone()),
            (a16.clone(), rb32.clone()),
            (
                transpose(transpose(tensor(&ra, [m, k])).to_contiguous()),
                b16.clone(),
            ),
            (ra32, rb32),
        ] {
            let mixed = <Flex as Kernels>::ffn_matmul(lhs, rhs);
            assert!(worst(&mixed) <= 1.0, "mixed: {}", worst(&mixed));
        }
        // Unrounded operands: the f32 product is another function (visibly, for sums short
        // enough that their own rounding does not hide it).
        if k <= 1000 {
            let plain = <Flex as Kernels>::ffn_matmul(tensor(&a, [m, k]), tensor(&b, [k, n]));
            assert!(worst(&plain) > 2.0, "{}", worst(&plain));
        }
    }
}
