//! # The experts as one operation: a grouped FFN
//!
//! After routing, the token–expert pairs are listed expert by expert (`router.rs`), so expert
//! `e`'s inputs are one contiguous block `X_e` of `n_e` rows. The experts' weights are stacked,
//! `W_up: [E, d_model, d_ff]` and so on, and the op computes every block with its own expert:
//!
//! ```text
//! Y_e = FFN_e(X_e) = φ(X_e W_up[e]) W_down[e]          (gated: (φ(X_e W_gate[e]) ⊙ X_e W_up[e]) W_down[e])
//! ```
//!
//! forward and backward through the FFN op (`op/`) on views of the stacked weights: the
//! same matrix products and element-wise passes, at the same GEMM speed, one group at a time
//! (a grouped GEMM). The backward pass writes each expert's weight gradient into its slot of
//! the stacked gradient (an expert without tokens gets zeros), so no per-expert slice of a
//! parameter ever becomes a zero-padded full-size gradient, and every expert is in every graph.
//!
//! Backends without the op (see [`supported`](crate::op::supported)) run the same math composed
//! from burn's tensor ops ([`experts_composed`]), which is also the reference the op is tested
//! against.
//!
//! In [`Precision::Bf16`](crate::Precision) the products take bf16 operands as in the FFN op:
//! `X` and the stacked weights are rounded once per forward pass (every expert's slice with
//! them) and kept rounded for the backward pass, which rounds `dy` and `d(pre)`; the gradients,
//! biases and element-wise passes stay f32.

use std::sync::Arc;

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, NodeGuard, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Slice, TensorMetadata, backend_extension};
use burn::tensor::{DType, Tensor};

use crate::op::backward::{Need, Present, backward_pass, untrack};
use crate::op::{
    Kernels, Maybe, Spec, Weights, forward_pass, inference, operand, straight_through,
};

/// Rows per expert: expert `e`'s rows follow those of experts `0..e`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Groups(pub Arc<[usize]>);

impl Groups {
    /// Each expert's row range.
    fn ranges(&self) -> impl Iterator<Item = (usize, std::ops::Range<usize>)> + '_ {
        self.0.iter().enumerate().scan(0, |start, (e, &n)| {
            let r = *start..*start + n;
            *start += n;
            Some((e, r))
        })
    }
}

/// The grouped FFN op. Call it through [`experts`].
#[backend_extension(
    Flex: cfg(feature = "flex"),
    NdArray: cfg(feature = "ndarray"),
    Cube: cfg(feature = "cube"),
    Autodiff
)]
pub trait ExpertOps: Backend {
    /// `Y = [FFN_0(X_0); …; FFN_{E−1}(X_{E−1})]` for `x: [N, d_model]` whose rows are grouped
    /// by `groups`. Weights stacked: `w_gate`, `w_up` `[E, d_model, d_ff]`, `w_down`
    /// `[E, d_ff, d_model]`; biases `b_gate`, `b_up` `[E, d_ff]`, `b_down` `[E, d_model]`.
    #[allow(clippy::too_many_arguments)]
    // burn's generated dispatch reads the arguments in one arm per backend: none without a
    // backend feature.
    #[allow(unused_variables)]
    fn experts(
        x: FloatTensor<Self>,
        #[extension_type] w_gate: Maybe<Self>,
        w_up: FloatTensor<Self>,
        w_down: FloatTensor<Self>,
        #[extension_type] b_gate: Maybe<Self>,
        #[extension_type] b_up: Maybe<Self>,
        #[extension_type] b_down: Maybe<Self>,
        groups: Groups,
        spec: Spec,
    ) -> FloatTensor<Self>;
}

/// Expert `e`'s slice of a stacked tensor `[E, a, b]` as `[a, b]` (or `[E, a]` as `[a]`).
fn expert<B: Backend>(stacked: &FloatTensor<B>, e: usize) -> FloatTensor<B> {
    let shape = stacked.shape();
    let mut slices = vec![Slice::new(e as isize, Some(e as isize + 1), 1)];
    slices.extend(
        shape
            .iter()
            .skip(1)
            .map(|&n| Slice::new(0, Some(n as isize), 1)),
    );
    let view = B::float_slice(stacked.clone(), &slices);
    B::float_reshape(
        view,
        shape.iter().skip(1).copied().collect::<Vec<_>>().into(),
    )
}

/// Expert `e`'s weights (views).
fn expert_weights<B: Backend>(w: &Weights<B>, e: usize) -> Weights<B> {
    let one = |t: &Option<FloatTensor<B>>| t.as_ref().map(|t| expert::<B>(t, e));
    Weights {
        w_gate: one(&w.w_gate),
        w_up: expert::<B>(&w.w_up, e),
        w_down: expert::<B>(&w.w_down, e),
        b_gate: one(&w.b_gate),
        b_up: one(&w.b_up),
        b_down: one(&w.b_down),
        mask: None,
    }
}

/// Rows `r` of `x: [N, d]`.
fn rows<B: Backend>(x: &FloatTensor<B>, r: &std::ops::Range<usize>) -> FloatTensor<B> {
    let d = x.shape()[1];
    let slices = [
        Slice::new(r.start as isize, Some(r.end as isize), 1),
        Slice::new(0, Some(d as isize), 1),
    ];
    B::float_slice(x.clone(), &slices)
}

/// `Y` without autodiff: each group through its expert, then the groups in order.
fn grouped_inference<B: Kernels>(
    x: FloatTensor<B>,
    w: Weights<B>,
    groups: &Groups,
    spec: Spec,
) -> FloatTensor<B> {
    let active: Vec<_> = groups.ranges().filter(|(_, r)| !r.is_empty()).collect();
    let parts = B::ffn_each(active, |(e, r)| {
        inference::<B>(rows::<B>(&x, &r), expert_weights::<B>(&w, e), spec)
    });
    let dtype = x.dtype();
    join::<B>(parts, &x, &w, dtype)
}

/// The groups' outputs as one `[N, d_model]` tensor (empty, of `dtype`, when no expert has
/// rows).
fn join<B: Backend>(
    mut parts: Vec<FloatTensor<B>>,
    x: &FloatTensor<B>,
    w: &Weights<B>,
    dtype: DType,
) -> FloatTensor<B> {
    match parts.len() {
        0 => {
            let d_model = w.w_down.shape()[2];
            B::float_zeros([0, d_model].into(), &x.device(), dtype.into())
        }
        1 => parts.pop().expect("one part"),
        _ => B::float_cat(parts, 0),
    }
}

#[allow(unused_macros)] // instantiated once per backend feature: none in a build without one
macro_rules! inference_impl {
    ($backend:ty) => {
        impl ExpertOps for $backend {
            fn experts(
                x: FloatTensor<Self>,
                w_gate: Maybe<Self>,
                w_up: FloatTensor<Self>,
                w_down: FloatTensor<Self>,
                b_gate: Maybe<Self>,
                b_up: Maybe<Self>,
                b_down: Maybe<Self>,
                groups: Groups,
                spec: Spec,
            ) -> FloatTensor<Self> {
                let biases = [b_gate, b_up, b_down];
                let w = Weights::new(w_gate, w_up, w_down, biases, Maybe::Absent);
                grouped_inference::<Self>(x, w, &groups, spec)
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

/// The backward step; `N` is the number of parents (3 to 7).
#[derive(Debug)]
struct ExpertsBackward;

/// What one expert's backward pass keeps: its pre-activations and, unless recomputed, `h`.
#[derive(Debug, Clone)]
struct Group<B: Backend> {
    expert: usize,
    rows: std::ops::Range<usize>,
    pre: crate::op::Pre<B>,
    h: Option<FloatTensor<B>>,
}

#[derive(Debug, Clone)]
struct Saved<B: Backend> {
    /// `X` as the products take it (rounded in bf16).
    x: FloatTensor<B>,
    weights: Weights<B>,
    groups: Vec<Group<B>>,
    n_experts: usize,
    spec: Spec,
    present: Present,
    /// The network's float type: the gradients'.
    dtype: DType,
}

/// Expert gradients `[a, b]` (or `[a]`), `None` for an expert without tokens, stacked into
/// `[E, a, b]` (`[E, a]`, the shape of `like`) with zeros of `dtype` for the missing ones.
fn stack<B: Backend>(
    parts: Vec<Option<FloatTensor<B>>>,
    like: &FloatTensor<B>,
    dtype: DType,
) -> FloatTensor<B> {
    let shape = like.shape();
    let mut one: Vec<usize> = vec![1];
    one.extend(shape.iter().skip(1));
    let device = like.device();
    let parts = parts
        .into_iter()
        .map(|p| match p {
            Some(g) => B::float_reshape(g, one.clone().into()),
            None => B::float_zeros(one.clone().into(), &device, dtype.into()),
        })
        .collect();
    B::float_cat(parts, 0)
}

impl<B: Kernels, const N: usize> Backward<B, N> for ExpertsBackward {
    type State = Saved<B>;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let Saved {
            x,
            weights: w,
            groups,
            n_experts,
            spec,
            present,
            dtype,
        } = ops.state;
        let dy = grads.consume::<B>(&ops.node);
        let parents = present.parents(ops.parents).map(|n| n.map(|n| n.id));
        let need = Need::of(&parents);
        // Per expert: [dW_gate, dW_up, dW_down, db_gate, db_up, db_down]; dx per group.
        let mut per_expert: [Vec<Option<FloatTensor<B>>>; 6] =
            std::array::from_fn(|_| vec![None; n_experts]);
        // Each group (its pre-activations and `h`) is moved into its backward pass, not
        // cloned: held alone there, they can be overwritten by `d(pre)` and freed when used.
        let computed = B::ffn_each(groups, |group| {
            let grads = backward_pass::<B>(
                &rows::<B>(&x, &group.rows),
                rows::<B>(&dy, &group.rows),
                expert_weights::<B>(&w, group.expert),
                group.pre,
                group.h,
                spec,
                need,
            );
            (group.expert, grads)
        });
        let mut dx_parts = Vec::with_capacity(computed.len());
        for (e, g) in computed {
            for (slot, grad) in per_expert
                .iter_mut()
                .zip([g.w_gate, g.w_up, g.w_down, g.b_gate, g.b_up, g.b_down])
            {
                slot[e] = grad;
            }
            dx_parts.extend(g.x);
        }
        let [dw_gate, dw_up, dw_down, db_gate, db_up, db_down] = per_expert;
        let stacked =
            |parts: Vec<Option<FloatTensor<B>>>, like: &Option<FloatTensor<B>>, need| match (
                need, like,
            ) {
                (true, Some(like)) => Some(stack::<B>(parts, like, dtype)),
                _ => None,
            };
        let dx = need.x.then(|| join::<B>(dx_parts, &x, &w, dtype));
        crate::op::backward::InputGrads::<B> {
            x: dx,
            w_gate: stacked(dw_gate, &w.w_gate, need.w_gate),
            w_up: stacked(dw_up, &Some(w.w_up.clone()), need.w_up),
            w_down: stacked(dw_down, &Some(w.w_down.clone()), need.w_down),
            b_gate: stacked(db_gate, &w.b_gate, need.b_gate),
            b_up: stacked(db_up, &w.b_up, need.b_up),
            b_down: stacked(db_down, &w.b_down, need.b_down),
        }
        .register(parents, grads);
    }
}

/// Registers the op with `N` parents and computes its forward pass.
fn tracked<B: Kernels, C: CheckpointStrategy, const N: usize>(
    nodes: Vec<NodeGuard>,
    x: FloatTensor<B>,
    w: Weights<B>,
    groups: Groups,
    spec: Spec,
    present: Present,
) -> FloatTensor<Autodiff<B, C>> {
    let nodes: [NodeGuard; N] = nodes.try_into().expect("N parents");
    match ExpertsBackward
        .prepare::<C>(nodes)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            // In bf16, X and the stacked weights are rounded once and kept rounded: what every
            // product of both passes takes.
            let dtype = x.dtype();
            let (x, w) = (operand::<B>(x, spec.precision), w.operands(spec.precision));
            let active: Vec<_> = groups.ranges().filter(|(_, r)| !r.is_empty()).collect();
            let computed = B::ffn_each(active, |(e, r)| {
                let we = expert_weights::<B>(&w, e);
                let (pre, y, h) = forward_pass(&rows::<B>(&x, &r), &we, spec);
                let h = h.filter(|_| spec.memory == crate::Memory::Save);
                (
                    y,
                    Group {
                        expert: e,
                        rows: r,
                        pre,
                        h,
                    },
                )
            });
            let (parts, saved): (Vec<_>, Vec<_>) = computed.into_iter().unzip();
            let y = join::<B>(parts, &x, &w, dtype);
            let state = Saved {
                x,
                weights: w,
                groups: saved,
                n_experts: groups.0.len(),
                spec,
                present,
                dtype,
            };
            prep.finish(state, y)
        }
        OpsKind::UnTracked(prep) => prep.finish(grouped_inference(x, w, &groups, spec)),
    }
}

impl<B: Kernels, C: CheckpointStrategy> ExpertOps for Autodiff<B, C> {
    fn experts(
        x: FloatTensor<Self>,
        w_gate: Maybe<Self>,
        w_up: FloatTensor<Self>,
        w_down: FloatTensor<Self>,
        b_gate: Maybe<Self>,
        b_up: Maybe<Self>,
        b_down: Maybe<Self>,
        groups: Groups,
        spec: Spec,
    ) -> FloatTensor<Self> {
        let w = Weights::new(w_gate, w_up, w_down, [b_gate, b_up, b_down], Maybe::Absent);
        let (x, w, nodes, present) = untrack::<B, C>(x, w);
        match nodes.len() {
            3 => tracked::<B, C, 3>(nodes, x, w, groups, spec, present),
            4 => tracked::<B, C, 4>(nodes, x, w, groups, spec, present),
            5 => tracked::<B, C, 5>(nodes, x, w, groups, spec, present),
            6 => tracked::<B, C, 6>(nodes, x, w, groups, spec, present),
            7 => tracked::<B, C, 7>(nodes, x, w, groups, spec, present),
            n => unreachable!("the experts op has 3 to 7 inputs, got {n}"),
        }
    }
}

/// The stacked weights of the experts, as [`experts`] takes them.
#[derive(Debug, Clone)]
pub(crate) struct Stacked {
    pub w_gate: Option<Tensor<3>>,
    pub w_up: Tensor<3>,
    pub w_down: Tensor<3>,
    pub b_gate: Option<Tensor<2>>,
    pub b_up: Option<Tensor<2>>,
    pub b_down: Option<Tensor<2>>,
}

/// `Y` through the op, for `x: [N, d_model]` grouped by `groups`, on a
/// [`supported`](crate::op::supported) device.
pub(crate) fn experts(x: Tensor<2>, w: Stacked, groups: &[usize], spec: Spec) -> Tensor<2> {
    use burn::backend::Dispatch;
    let maybe = |t: Option<FloatTensor<Dispatch>>| Maybe::<Dispatch>::from_option(t);
    let y = <Dispatch as ExpertOps>::experts(
        x.into_dispatch(),
        maybe(w.w_gate.map(|t| t.into_dispatch())),
        w.w_up.into_dispatch(),
        w.w_down.into_dispatch(),
        maybe(w.b_gate.map(|t| t.into_dispatch())),
        maybe(w.b_up.map(|t| t.into_dispatch())),
        maybe(w.b_down.map(|t| t.into_dispatch())),
        Groups(groups.into()),
        spec,
    );
    Tensor::from_dispatch(y)
}

/// `Y` composed from burn's tensor ops and differentiated by autodiff: each group through its
/// expert's slice of the stacked weights (in bf16, on a device that rounds, with the operands
/// rounded straight-through, as the dense FFN's composed network does).
pub(crate) fn experts_composed(
    x: Tensor<2>,
    w: Stacked,
    groups: &[usize],
    spec: Spec,
) -> Tensor<2> {
    let d_model = w.w_down.dims()[2];
    let dtype = spec.precision.operands_on(&x.device());
    let operand = |t: Tensor<2>| straight_through(t, dtype);
    let mut start = 0;
    let mut parts = Vec::new();
    for (e, &n) in groups.iter().enumerate() {
        if n == 0 {
            continue;
        }
        let x_e = x.clone().narrow(0, start, n);
        start += n;
        let mat = |t: &Tensor<3>| t.clone().narrow(0, e, 1).squeeze_dim::<2>(0);
        let vec = |t: &Option<Tensor<2>>| t.as_ref().map(|t| t.clone().narrow(0, e, 1));
        let linear = |x: Tensor<2>, w: Tensor<2>, b: Option<Tensor<2>>| {
            let product = operand(x).matmul(operand(w));
            match b {
                Some(b) => product + b,
                None => product,
            }
        };
        let phi = spec.activation;
        let up = linear(x_e.clone(), mat(&w.w_up), vec(&w.b_up));
        let h = match &w.w_gate {
            Some(w_gate) => phi.glu(linear(x_e, mat(w_gate), vec(&w.b_gate)), up),
            None => phi.forward(up),
        };
        parts.push(linear(h, mat(&w.w_down), vec(&w.b_down)));
    }
    if parts.is_empty() {
        return Tensor::<2>::zeros([0, d_model], &x.device()).cast(x.dtype());
    }
    Tensor::cat(parts, 0)
}
