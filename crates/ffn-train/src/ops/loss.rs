//! # The cross-entropy as one operation, with its own backward pass
//!
//! A language model's loss is the mean negative log-likelihood of the targets under the
//! softmax of the logits. Composed from burn's ops it is `log_softmax` (max, subtract, `exp`,
//! sum, `log`, subtract: a pass each), a `gather` and a mean, and the backward pass
//! differentiates each. As one op, for logits `z: [N, V]` and targets `t: [N]`:
//!
//! ```text
//! forward                                    backward (given g = ∂L'/∂L)
//! ℓ_i = m_i + log Σ_j exp(z_ij − m_i)        ∂L/∂z_ij = g/N · (exp(z_ij − ℓ_i) − [j = t_i])
//!       (m_i = max_j z_ij)
//! L   = 1/N Σ_i (ℓ_i − z_{i,t_i})
//! ```
//!
//! one pass over the logits each way; the op keeps the logits, the targets and `ℓ`. It runs on
//! Flex (`f32`, `f64`); elsewhere [`cross_entropy`] composes burn's ops (the same function,
//! tested).
//!
//! In bf16 ([`ffn_model::Precision::Bf16`]) the op is unchanged: it has no matrix product, and
//! the recipe keeps softmax and reductions in f32. Its logits come from the head's product of
//! bf16 operands, accumulated and kept in f32.

use burn::tensor::{Int, Tensor};
#[cfg(feature = "flex")]
pub use op::CrossEntropyOps;

/// The mean cross-entropy (nats) of `logits: [N, V]` against `targets: [N]` (class indices
/// `< V`): through the op on Flex, composed from burn's ops elsewhere.
pub fn cross_entropy(logits: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
    #[cfg(feature = "flex")]
    if op::supported(&logits) {
        return op::cross_entropy(logits, targets);
    }
    composed(logits, targets)
}

/// `−mean_i log_softmax(z)_{i,t_i}` from burn's ops.
pub fn composed(logits: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
    let n = targets.dims()[0];
    let log_probs = burn::tensor::activation::log_softmax(logits, 1);
    -log_probs.gather(1, targets.reshape([n, 1])).mean()
}

#[cfg(feature = "flex")]
mod op {
    use burn::backend::autodiff::Autodiff;
    use burn::backend::autodiff::checkpoint::base::Checkpointer;
    use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
    use burn::backend::autodiff::grads::Gradients;
    use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
    use burn::backend::tensor::{FloatTensor, IntTensor};
    use burn::backend::{Backend, DType, Flex, backend_extension};
    use burn::tensor::{Int, Shape, Tensor, TensorData};
    use burn_flex::FlexTensor;

    use crate::ops::kernel::{Real, contiguous};

    /// The cross-entropy op. Call it through [`cross_entropy`](super::cross_entropy).
    #[backend_extension(Flex, Autodiff)]
    pub trait CrossEntropyOps: Backend {
        /// `1/N Σ_i (log Σ_j exp z_ij − z_{i,t_i})` for `logits: [N, V]`, `targets: [N]`; shape `[1]`.
        fn cross_entropy(logits: FloatTensor<Self>, targets: IntTensor<Self>) -> FloatTensor<Self>;
    }

    /// Whether the op runs on `logits`' device and dtype (Flex, `f32` or `f64`).
    pub(super) fn supported(logits: &Tensor<2>) -> bool {
        use burn::backend::DispatchDevice;
        let device = logits.device().without_autodiff();
        matches!(device.as_dispatch(), DispatchDevice::Flex(_))
            && matches!(logits.dtype(), DType::F32 | DType::F64)
    }

    /// The op, on a [`supported`] tensor.
    pub(super) fn cross_entropy(logits: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
        use burn::backend::Dispatch;
        let loss = <Dispatch as CrossEntropyOps>::cross_entropy(
            logits.into_dispatch(),
            targets.into_dispatch(),
        );
        Tensor::from_dispatch(loss)
    }

    impl CrossEntropyOps for Flex {
        fn cross_entropy(logits: FlexTensor, targets: FlexTensor) -> FlexTensor {
            forward(&logits, &targets).0
        }
    }

    /// What the backward pass keeps: the logits, the targets and `ℓ`.
    #[derive(Debug, Clone)]
    struct Saved {
        logits: FlexTensor,
        targets: Vec<usize>,
        /// `ℓ: [N]`.
        lse: FlexTensor,
    }

    #[derive(Debug)]
    struct CrossEntropyBackward;

    impl Backward<Flex, 1> for CrossEntropyBackward {
        type State = Saved;

        fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
            let g = grads.consume::<Flex>(&ops.node);
            let [node] = ops.parents;
            if let Some(node) = node {
                grads.register::<Flex>(node.id, backward(&ops.state, &g));
            }
        }
    }

    impl<C: CheckpointStrategy> CrossEntropyOps for Autodiff<Flex, C> {
        fn cross_entropy(logits: FloatTensor<Self>, targets: IntTensor<Self>) -> FloatTensor<Self> {
            let (logits, node) = logits.into_parts();
            match CrossEntropyBackward
                .prepare::<C>([node])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => {
                    let (loss, targets, lse) = forward(&logits, &targets);
                    prep.finish(
                        Saved {
                            logits,
                            targets,
                            lse,
                        },
                        loss,
                    )
                }
                OpsKind::UnTracked(prep) => prep.finish(forward(&logits, &targets).0),
            }
        }
    }

    /// The targets as class indices.
    ///
    /// # Panics
    ///
    /// If a target is not a class index `< V` (the batches are built by this crate's data code).
    fn class_indices(targets: &FlexTensor, n: usize, v: usize) -> Vec<usize> {
        let targets: Vec<usize> = targets
            .clone()
            .into_data()
            .iter::<i64>()
            .map(|t| usize::try_from(t).ok().filter(|&t| t < v))
            .collect::<Option<_>>()
            .unwrap_or_else(|| panic!("cross_entropy: a target is not a class index below {v}"));
        assert_eq!(
            targets.len(),
            n,
            "cross_entropy: one target per row of logits"
        );
        targets
    }

    /// `(L, t, ℓ)`: the loss `[1]` in the logits' dtype, the targets and the row log-sum-exps.
    fn forward(logits: &FlexTensor, targets: &FlexTensor) -> (FlexTensor, Vec<usize>, FlexTensor) {
        let logits = contiguous(logits);
        let [n, v] = logits.layout().shape().dims::<2>();
        let targets = class_indices(targets, n, v);
        let (loss, lse) = match logits.dtype() {
            DType::F32 => forward_typed::<f32>(logits.storage(), v, &targets),
            DType::F64 => forward_typed::<f64>(logits.storage(), v, &targets),
            other => panic!("cross_entropy: dtype {other:?} is not supported (f32, f64)"),
        };
        (loss, targets, lse)
    }

    fn forward_typed<E: Real>(z: &[E], v: usize, targets: &[usize]) -> (FlexTensor, FlexTensor) {
        let mut lse = Vec::with_capacity(targets.len());
        let mut total = 0.0;
        for (row, &t) in z.chunks(v.max(1)).zip(targets) {
            let m = row.iter().fold(E::NEG_INFINITY, |m, &x| m.max(x));
            let mut sum = E::ZERO;
            for &x in row {
                sum += (x - m).exp();
            }
            let l = m + sum.ln();
            total += (l - row[t]).to_f64();
            lse.push(l);
        }
        let loss = E::from_f64(total / targets.len() as f64);
        let n = targets.len();
        (
            scalar(loss),
            FlexTensor::from_data(TensorData::new(lse, [n])),
        )
    }

    /// `∂L/∂z = g/N · (softmax(z) − onehot(t))`, in the logits' dtype.
    fn backward(s: &Saved, g: &FlexTensor) -> FlexTensor {
        let logits = contiguous(&s.logits);
        let g: f64 = g.clone().into_data().iter::<f64>().sum();
        let scale = g / s.targets.len().max(1) as f64;
        let [n, v] = logits.layout().shape().dims::<2>();
        match logits.dtype() {
            DType::F32 => {
                backward_typed::<f32>(logits.storage(), s.lse.storage(), scale, &s.targets, [n, v])
            }
            _ => {
                backward_typed::<f64>(logits.storage(), s.lse.storage(), scale, &s.targets, [n, v])
            }
        }
    }

    fn backward_typed<E: Real>(
        z: &[E],
        lse: &[E],
        scale: f64,
        targets: &[usize],
        [n, v]: [usize; 2],
    ) -> FlexTensor {
        let scale = E::from_f64(scale);
        let mut dz = z.to_vec();
        for ((row, &t), &l) in dz.chunks_mut(v.max(1)).zip(targets).zip(lse) {
            for x in row.iter_mut() {
                *x = (*x - l).exp() * scale;
            }
            row[t] = row[t] - scale;
        }
        FlexTensor::from_data(TensorData::new(dz, Shape::new([n, v])))
    }

    fn scalar<E: Real>(x: E) -> FlexTensor {
        FlexTensor::from_data(TensorData::new(vec![x], [1]))
    }
}

#[cfg(all(test, feature = "flex"))]
mod tests {
    use burn::tensor::{DType, Device, Distribution, Int, Tensor, TensorData};

    use super::*;

    fn setup(device: &Device) -> (Tensor<2>, Tensor<1, Int>) {
        let (n, v) = (7, 5);
        let logits = Tensor::<2>::random([n, v], Distribution::Normal(0.0, 2.0), device);
        let targets = TensorData::new(vec![0i64, 4, 2, 2, 1, 3, 0], [n]);
        (logits, Tensor::from_data(targets, device))
    }

    /// The op's loss and logit gradient equal burn's composed `log_softmax` + `gather` + mean.
    #[test]
    fn matches_the_composed_cross_entropy() {
        let device = Device::flex().autodiff();
        device.seed(3);
        let (logits, targets) = setup(&device);
        let run = |op: bool| {
            let z = logits.clone().require_grad();
            let loss = if op {
                cross_entropy(z.clone(), targets.clone())
            } else {
                composed(z.clone(), targets.clone())
            };
            let grads = (loss.clone() * 3.0).backward();
            (loss.into_scalar::<f64>(), z.grad(&grads).unwrap())
        };
        let ((l_op, g_op), (l_ref, g_ref)) = (run(true), run(false));
        assert!(
            (l_op - l_ref).abs() < 1e-6 * l_ref.abs(),
            "{l_op} vs {l_ref}"
        );
        let error: f64 = (g_op - g_ref).abs().max().into_scalar();
        assert!(error < 1e-6, "gradient off by {error}");
    }

    /// In f64 the gradient matches central differences along a random direction, and large
    /// logits (±1000) give a finite loss (the log-sum-exp is shifted by the row maximum).
    #[test]
    fn gradient_matches_finite_differences_and_large_logits_stay_finite() {
        let device = Device::flex().autodiff();
        device.seed(4);
        let (logits, targets) = setup(&device);
        let logits = logits.cast(DType::F64);
        let u = Tensor::<2>::random(logits.dims(), Distribution::Normal(0.0, 1.0), &device)
            .cast(DType::F64);
        let loss = |z: Tensor<2>| cross_entropy(z, targets.clone());
        let z = logits.clone().require_grad();
        let grads = loss(z.clone()).backward();
        let analytic: f64 = (z.grad(&grads).unwrap() * u.clone().inner())
            .sum()
            .into_scalar();
        let eps = 1e-6;
        let at = |s: f64| -> f64 { loss(logits.clone() + u.clone() * (s * eps)).into_scalar() };
        let numeric = (at(1.0) - at(-1.0)) / (2.0 * eps);
        assert!(
            (analytic - numeric).abs() < 1e-8 * analytic.abs().max(1.0),
            "{analytic} vs {numeric}"
        );

        let big: f64 = loss(logits * 500.0).into_scalar();
        assert!(big.is_finite() && big >= 0.0, "{big}");
    }
}
