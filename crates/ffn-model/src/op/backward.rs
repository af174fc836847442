//! # The op's backward pass, and its place in burn's autodiff graph
//!
//! The gradients of the module's doc table (see [`crate::op`]) from what the forward pass
//! kept, with every product skipped that nothing needs; [`untrack`] and [`InputGrads`] are
//! shared with the mixture's grouped op (`moe/experts.rs`).

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, NodeGuard, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Slice, TensorMetadata};

use super::hidden::{Pre, rows_of};
use super::{
    FfnOps, Kernels, Maybe, Memory, Spec, Weights, accumulate, bias_grad, chunks, forward_pass,
    hidden_operand, inference, masked, operand, passing_operand, t,
};

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
        let spec = super::tests::maybe_break(spec);
        backward_pass::<B>(&x, dy, w, pre, h, spec, Need::of(&parents)).register(parents, grads);
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
    w: Weights<B>,
    pre: Pre<B>,
    h: Option<FloatTensor<B>>,
    spec: Spec,
    need: Need,
) -> InputGrads<B> {
    // db_down = Σ_T dy (in f32; the products take dy rounded, in bf16).
    let db_down = need.b_down.then(|| bias_grad::<B>(dy.clone()));
    let ranges = chunks(&pre, spec.memory);
    let whole = ranges.len() == 1;
    // Whole, dy is freed after its two products, which may take it rounded in its own buffer;
    // in chunks it is held to the last one, and a bf16 copy holds less.
    let dy = if whole {
        passing_operand::<B>(dy, spec.precision)
    } else {
        operand::<B>(dy, spec.precision)
    };

    // The rest row chunk by row chunk (one chunk, the whole batch, unless recomputing):
    // dW_down = hᵀ dy,  dh = dy W_downᵀ (⊙ the dropout mask, with h = φ(·) ⊙ mask, when
    // there is one), then through φ (and the gating product) to the
    // pre-activations, then dW = xᵀ d(pre), db = Σ_T d(pre), dx = Σ d(pre) Wᵀ over the
    // projections; the weight gradients are summed over chunks.
    let (mut pre, mut h) = (Some(pre), h);
    // dy and W_down are freed after their last product (the last chunk's dh), not held
    // through the products of d(pre) that follow.
    let Weights {
        w_gate,
        w_up,
        w_down,
        mask,
        ..
    } = w;
    let (mut dy, mut w_down) = (Some(dy), Some(w_down));
    let mut dw_down = None;
    let [mut dw, mut db] = [[None, None], [None, None]];
    let mut dx_parts = Vec::with_capacity(ranges.len());
    for (i, r) in ranges.iter().enumerate() {
        let last = i + 1 == ranges.len();
        // The whole batch is moved, not viewed, so that it is freed as soon as it is used.
        let pre_r = if whole {
            pre.take().expect("one chunk")
        } else {
            pre.as_ref().expect("pre-activations").rows(r)
        };
        let (x_r, dy_r) = if whole {
            (x.clone(), dy.take().expect("one chunk"))
        } else {
            (
                rows_of::<B>(x, r),
                rows_of::<B>(dy.as_ref().expect("dy"), r),
            )
        };
        let w_down_r = if last {
            w_down.take().expect("W_down")
        } else {
            w_down.clone().expect("W_down")
        };
        if last {
            dy = None;
        }
        if need.w_down {
            let h_r = match h.take() {
                Some(h) => h,
                None => hidden_operand::<B>(&pre_r, &mask, (!whole).then_some(r), spec),
            };
            accumulate::<B>(&mut dw_down, B::ffn_matmul(t::<B>(h_r), dy_r.clone()));
        }
        // d(pre) as the products' operands, with the bias gradients Σ_T d(pre) summed from
        // the unrounded values: from dh as its blocks come out of the product where the
        // backend can (no dropout mask between them), else from the whole dh.
        let sums = need.b_gate || need.b_up;
        // `pre_r` is moved in and freed (or overwritten by d(pre)) as soon as it is used.
        let fused = match &mask {
            None => B::ffn_down_backward_operand(
                &dy_r,
                &w_down_r,
                pre_r,
                spec.activation,
                spec.precision,
                sums,
            ),
            Some(_) => Err(pre_r),
        };
        let (dpre, sums) = match fused {
            Ok(fused) => fused,
            Err(pre_r) => {
                let dh = B::ffn_matmul(dy_r.clone(), t::<B>(w_down_r.clone()));
                let dh = masked::<B>(dh, &mask, (!whole).then_some(r));
                B::ffn_hidden_backward_operand(dh, pre_r, spec.activation, spec.precision, sums)
            }
        };
        drop((dy_r, w_down_r));
        let projections = match dpre {
            Pre::Plain(da) | Pre::Fused(da) => vec![(da, 1)],
            Pre::Gated(dg, du) => vec![(dg, 0), (du, 1)],
        };
        let width = |d: &FloatTensor<B>| d.shape()[1];
        let mut dx_r: Option<FloatTensor<B>> = None;
        for (d, p) in projections {
            let (weight, need_w, need_b) = if p == 0 {
                let w_gate = w_gate.as_ref().expect("a gated, unfused op has W_gate");
                (w_gate, need.w_gate, need.b_gate)
            } else {
                (&w_up, need.w_up, need.b_up)
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
            let (pre, y, h) = forward_pass(&x, &w, spec);
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
