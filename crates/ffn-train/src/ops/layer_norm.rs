//! # Layer normalisation as one operation, with its own backward pass
//!
//! burn's `LayerNorm` is composed from tensor ops under autodiff: a mean, a subtraction, a
//! variance, a square root, a division, a scale and a shift, each a pass over `[rows, d]`, and
//! each differentiated on its own in the backward pass. It keeps two `[rows, d]` tensors (the
//! centred input and the normalised one). Here, for a row `x` of `d` values (Ba et al. 2016),
//!
//! ```text
//! forward                                   backward (given dy = ∂L/∂y)
//! μ  = Σ_j x_j / d                          g_j  = dy_j γ_j
//! σ² = Σ_j (x_j − μ)² / d                   dx_j = r (g_j − mean(g) − x̂_j mean(g ⊙ x̂))
//! r  = 1 / √(σ² + ε)                        dγ   = Σ_rows dy ⊙ x̂
//! x̂_j = (x_j − μ) r                         dβ   = Σ_rows dy
//! y_j = x̂_j γ_j + β_j
//! ```
//!
//! (`dx` is the derivative through `μ` and `r` as well as the direct term: `∂x̂_j/∂x_k =
//! r (δ_jk − 1/d − x̂_j x̂_k / d)`.) The op keeps `x̂` and `r` (one `[rows, d]` tensor and one
//! value a row) and makes two passes over a row each way. It runs on Flex in `f32` and `f64`;
//! elsewhere [`layer_norm`] is burn's `LayerNorm`, whose outputs and gradients it matches
//! (tests below). Rows run in parallel on rayon's threads.

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, DType, Flex, backend_extension};
use burn::nn::LayerNorm;
use burn::tensor::{Shape, Tensor};
use burn_flex::FlexTensor;
use rayon::prelude::*;

use super::kernel::{Real, contiguous, dispatch, dot_by, new_tensor, sum};

/// The layer-norm op. Call it through [`layer_norm`].
#[backend_extension(Flex, Autodiff)]
pub trait NormOps: Backend {
    /// `y = (x − μ) / √(σ² + ε) ⊙ γ + β` over the last dimension of `x` (`γ, β: [d]`).
    fn layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self>;
}

/// `norm(x)` over the last dimension, for `epsilon` the ε `norm` was built with (burn keeps it
/// private): through the op where it runs (Flex, `f32` or `f64`, a norm with a bias), else
/// through burn's `LayerNorm::forward`. The same function either way.
pub fn layer_norm<const D: usize>(norm: &LayerNorm, x: Tensor<D>, epsilon: f64) -> Tensor<D> {
    use burn::backend::{Dispatch, DispatchDevice};
    // A width other than γ's goes to burn's forward too, which reports it.
    let runs = matches!(
        x.device().without_autodiff().as_dispatch(),
        DispatchDevice::Flex(_)
    ) && matches!(x.dtype(), DType::F32 | DType::F64)
        && x.dims().last() == norm.gamma.dims().first();
    let (Some(beta), true) = (&norm.beta, runs) else {
        return norm.forward(x);
    };
    let (gamma, beta) = (norm.gamma.val(), beta.val());
    let (gamma, beta) = (gamma.cast(x.dtype()), beta.cast(x.dtype()));
    let y = <Dispatch as NormOps>::layer_norm(
        x.into_dispatch(),
        gamma.into_dispatch(),
        beta.into_dispatch(),
        epsilon,
    );
    Tensor::from_dispatch(y)
}

impl NormOps for Flex {
    fn layer_norm(x: FlexTensor, gamma: FlexTensor, beta: FlexTensor, epsilon: f64) -> FlexTensor {
        forward(&x, &gamma, &beta, epsilon).y
    }
}

/// The forward pass's results: `y`, and what the backward pass keeps.
struct Forward {
    y: FlexTensor,
    /// `x̂`, `[rows, d]`.
    x_hat: FlexTensor,
    /// `r = 1/√(σ² + ε)` of each row, `[rows]`.
    r: FlexTensor,
}

fn forward(x: &FlexTensor, gamma: &FlexTensor, beta: &FlexTensor, epsilon: f64) -> Forward {
    let x = contiguous(x);
    let (gamma, beta) = (contiguous(gamma), contiguous(beta));
    let shape = x.layout().shape().clone();
    // The row loops take the width from γ.
    assert_eq!(
        shape.iter().last().copied(),
        Some(gamma.layout().shape().num_elements()),
        "layer_norm: the input's last dimension is not γ's length"
    );
    macro_rules! typed {
        ($e:ty) => {{
            let [y, x_hat, r] = forward_typed::<$e>(
                x.storage(),
                gamma.storage(),
                beta.storage(),
                epsilon,
                &shape,
            );
            Forward { y, x_hat, r }
        }};
    }
    match x.dtype() {
        DType::F32 => typed!(f32),
        DType::F64 => typed!(f64),
        other => panic!("layer_norm: dtype {other:?} is not supported (f32, f64)"),
    }
}

/// Rows per block of rayon's work.
fn block_rows(d: usize) -> usize {
    (16_384 / d.max(1)).max(1)
}

fn forward_typed<E: Real>(
    x: &[E],
    gamma: &[E],
    beta: &[E],
    epsilon: f64,
    shape: &Shape,
) -> [FlexTensor; 3] {
    let d = shape[shape.num_dims() - 1];
    let n = shape.num_elements();
    let rows = n.checked_div(d).unwrap_or(0);
    let (mut y, mut x_hat, mut r) = (vec![E::ZERO; n], vec![E::ZERO; n], vec![E::ZERO; rows]);
    if d > 0 {
        let block = block_rows(d);
        y.par_chunks_mut(block * d)
            .zip(x_hat.par_chunks_mut(block * d))
            .zip(r.par_chunks_mut(block))
            .zip(x[..n].par_chunks(block * d))
            .for_each(|(((y, x_hat), r), x)| {
                dispatch!(forward_rows(x, (gamma, beta), epsilon, y, x_hat, r));
            });
    }
    [
        new_tensor(y, shape.clone()),
        new_tensor(x_hat, shape.clone()),
        new_tensor(r, [rows]),
    ]
}

/// A block of rows of `x` (`d = γ.len()` wide): `y`, `x̂` and `r` of each.
/// (Compiled by [`dispatch`] for the CPU's widest vectors; no fused multiply-adds, so the
/// results are the same bits on every CPU.)
#[inline(always)]
fn forward_rows<E: Real, const FUSED: bool>(
    x: &[E],
    (gamma, beta): (&[E], &[E]),
    epsilon: f64,
    y: &mut [E],
    x_hat: &mut [E],
    r: &mut [E],
) {
    let d = gamma.len();
    let scale = E::from_f64(1.0 / d as f64);
    let rows = y.chunks_mut(d).zip(x_hat.chunks_mut(d)).zip(x.chunks(d));
    for (((y, x_hat), x), r) in rows.zip(r) {
        let mean = sum(x) * scale;
        for (c, &x) in x_hat.iter_mut().zip(x) {
            *c = x - mean;
        }
        let variance = dot_by(x_hat, x_hat, |x| x) * scale;
        *r = E::from_f64(1.0 / (variance.to_f64() + epsilon).sqrt());
        for ((c, y), (&gamma, &beta)) in x_hat.iter_mut().zip(y).zip(gamma.iter().zip(beta)) {
            *c = *c * *r;
            *y = *c * gamma + beta;
        }
    }
}

/// `[dx, dγ, dβ]` for `dy`.
fn backward(s: &Saved, dy: &FlexTensor) -> [FlexTensor; 3] {
    let (dy, x_hat, r, gamma) = (
        contiguous(dy),
        contiguous(&s.x_hat),
        contiguous(&s.r),
        contiguous(&s.gamma),
    );
    let shape = x_hat.layout().shape().clone();
    macro_rules! typed {
        ($e:ty) => {
            backward_typed::<$e>(
                dy.storage(),
                x_hat.storage(),
                r.storage(),
                gamma.storage(),
                &shape,
            )
        };
    }
    match x_hat.dtype() {
        DType::F32 => typed!(f32),
        DType::F64 => typed!(f64),
        other => panic!("layer_norm: dtype {other:?} is not supported (f32, f64)"),
    }
}

fn backward_typed<E: Real>(
    dy: &[E],
    x_hat: &[E],
    r: &[E],
    gamma: &[E],
    shape: &Shape,
) -> [FlexTensor; 3] {
    let d = shape[shape.num_dims() - 1];
    let n = shape.num_elements();
    let mut dx = vec![E::ZERO; n];
    let zeros = || (vec![E::ZERO; d], vec![E::ZERO; d]);
    let (d_gamma, d_beta) = if d == 0 {
        zeros()
    } else {
        let block = block_rows(d);
        dx.par_chunks_mut(block * d)
            .zip(dy[..n].par_chunks(block * d))
            .zip(x_hat[..n].par_chunks(block * d))
            .zip(r.par_chunks(block))
            .fold(
                zeros,
                |(mut d_gamma, mut d_beta), (((dx, dy), x_hat), r)| {
                    let sums = (d_gamma.as_mut_slice(), d_beta.as_mut_slice());
                    dispatch!(backward_rows(dy, x_hat, r, gamma, dx, sums));
                    (d_gamma, d_beta)
                },
            )
            .reduce(zeros, |(mut a, mut b), (c, e)| {
                for (a, c) in a.iter_mut().zip(c) {
                    *a += c;
                }
                for (b, e) in b.iter_mut().zip(e) {
                    *b += e;
                }
                (a, b)
            })
    };
    [
        new_tensor(dx, shape.clone()),
        new_tensor(d_gamma, [d]),
        new_tensor(d_beta, [d]),
    ]
}

/// A block of rows: `dx` of each, and `dy ⊙ x̂`, `dy` added into the sums of `dγ`, `dβ`.
#[inline(always)]
fn backward_rows<E: Real, const FUSED: bool>(
    dy: &[E],
    x_hat: &[E],
    r: &[E],
    gamma: &[E],
    dx: &mut [E],
    (d_gamma, d_beta): (&mut [E], &mut [E]),
) {
    let d = gamma.len();
    let scale = E::from_f64(1.0 / d as f64);
    let rows = dx.chunks_mut(d).zip(dy.chunks(d)).zip(x_hat.chunks(d));
    for (((dx, dy), x_hat), &r) in rows.zip(r) {
        // dx holds g = dy ⊙ γ until it is overwritten below.
        for ((g, &dy), &gamma) in dx.iter_mut().zip(dy).zip(gamma) {
            *g = dy * gamma;
        }
        let mean_g = sum(dx) * scale;
        let mean_gx = dot_by(dx, x_hat, |g| g) * scale;
        for (g, &x_hat) in dx.iter_mut().zip(x_hat) {
            *g = r * (*g - mean_g - x_hat * mean_gx);
        }
        let sums = d_gamma.iter_mut().zip(d_beta.iter_mut());
        for ((d_gamma, d_beta), (&dy, &x_hat)) in sums.zip(dy.iter().zip(x_hat)) {
            *d_gamma += dy * x_hat;
            *d_beta += dy;
        }
    }
}

/// What the backward pass keeps.
#[derive(Debug, Clone)]
struct Saved {
    x_hat: FlexTensor,
    r: FlexTensor,
    gamma: FlexTensor,
}

#[derive(Debug)]
struct NormBackward;

impl Backward<Flex, 3> for NormBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<Flex>(&ops.node);
        let [dx, d_gamma, d_beta] = backward(&ops.state, &dy);
        for (node, grad) in ops.parents.into_iter().zip([dx, d_gamma, d_beta]) {
            if let Some(node) = node {
                grads.register::<Flex>(node.id, grad);
            }
        }
    }
}

impl<C: CheckpointStrategy> NormOps for Autodiff<Flex, C> {
    fn layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        let (x, node_x) = x.into_parts();
        let (gamma, node_gamma) = gamma.into_parts();
        let (beta, node_beta) = beta.into_parts();
        match NormBackward
            .prepare::<C>([node_x, node_gamma, node_beta])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let Forward { y, x_hat, r } = forward(&x, &gamma, &beta, epsilon);
                prep.finish(Saved { x_hat, r, gamma }, y)
            }
            OpsKind::UnTracked(prep) => prep.finish(forward(&x, &gamma, &beta, epsilon).y),
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::nn::LayerNormConfig;
    use burn::tensor::{Device, Distribution, TensorData};

    use super::*;

    const EPSILON: f64 = 1e-5;

    /// `[y, dx, dγ, dβ]` for `L = Σ y ⊙ g`, through the op or through burn's `LayerNorm`.
    fn run(norm: &LayerNorm, x: &Tensor<3>, g: &Tensor<3>, op: bool) -> [Vec<f64>; 4] {
        let x = x.clone().require_grad();
        let y = if op {
            layer_norm(norm, x.clone(), EPSILON)
        } else {
            norm.forward(x.clone())
        };
        let grads = (y.clone() * g.clone()).sum().backward();
        let host = |t: TensorData| t.iter::<f64>().collect::<Vec<f64>>();
        let beta = norm.beta.as_ref().unwrap();
        [
            host(y.into_data()),
            host(x.grad(&grads).unwrap().into_data()),
            host(norm.gamma.grad(&grads).unwrap().into_data()),
            host(beta.grad(&grads).unwrap().into_data()),
        ]
    }

    fn relative(a: &[f64], b: &[f64]) -> f64 {
        let scale = b.iter().fold(0f64, |m, x| m.max(x.abs()));
        let error = a.iter().zip(b).fold(0f64, |m, (a, b)| m.max((a - b).abs()));
        error / scale.max(1e-30)
    }

    /// The op's output and the gradients of `x`, `γ` and `β` are burn's `LayerNorm`'s, within
    /// f32 reordering (1e-5 of each tensor's scale), for widths that do and do not fill the
    /// sixteen lanes of the sums, a γ and β away from their initial 1 and 0, and an input whose
    /// rows have a large mean (the two-pass variance keeps it exact).
    #[test]
    fn matches_burns_layer_norm() {
        let device = Device::flex().autodiff();
        for (rows, d, offset) in [(7, 32, 0.0), (5, 37, 3.0), (3, 1, 0.0), (64, 256, 100.0)] {
            device.seed(11);
            let mut norm = LayerNormConfig::new(d).with_epsilon(EPSILON).init(&device);
            // γ, β drawn away from 1 and 0, so that their roles are tested.
            norm.gamma = norm.gamma.map(|_| {
                Tensor::random([d], Distribution::Normal(1.0, 0.5), &device).require_grad()
            });
            norm.beta = norm.beta.map(|b| {
                b.map(|_| {
                    Tensor::random([d], Distribution::Normal(0.0, 0.5), &device).require_grad()
                })
            });
            let x = Tensor::<3>::random([2, rows, d], Distribution::Normal(offset, 2.0), &device);
            let g = Tensor::<3>::random([2, rows, d], Distribution::Default, &device);
            let (got, want) = (run(&norm, &x, &g, true), run(&norm, &x, &g, false));
            for (which, (got, want)) in got.iter().zip(&want).enumerate() {
                let error = relative(got, want);
                let tolerance = if d == 1 { 1e-6 } else { 1e-5 };
                assert!(
                    error < tolerance || want.iter().all(|w| w.abs() < 1e-6),
                    "rows {rows}, d {d}, output {which}: {error:e}"
                );
            }
        }
    }

    /// The op's gradients against central differences of `L = Σ y ⊙ g` in f64, for `x`, `γ`
    /// and `β`.
    #[test]
    fn gradients_match_finite_differences() {
        use burn::backend::Dispatch;
        let device = Device::flex().autodiff();
        device.seed(12);
        let (rows, d) = (3, 9);
        let draw = |shape: Vec<usize>, mean: f64| -> Vec<f64> {
            Tensor::<1>::random(
                [shape.iter().product::<usize>()],
                Distribution::Normal(mean, 1.0),
                &device,
            )
            .into_data()
            .iter::<f64>()
            .collect()
        };
        let base = [
            draw(vec![rows, d], 0.5),
            draw(vec![d], 1.0),
            draw(vec![d], 0.0),
        ];
        let g = draw(vec![rows, d], 0.0);
        // L and, on a device with autodiff, its gradients.
        let loss = |v: &[Vec<f64>; 3], device: &Device, tracked: bool| {
            let t = |v: &Vec<f64>| {
                let t = Tensor::<1>::from_data(
                    TensorData::new(v.clone(), [v.len()]),
                    (device, DType::F64),
                );
                if tracked { t.require_grad() } else { t }
            };
            let [x, gamma, beta] = [t(&v[0]), t(&v[1]), t(&v[2])];
            let y = <Dispatch as NormOps>::layer_norm(
                x.clone().reshape([rows, d]).into_dispatch(),
                gamma.clone().into_dispatch(),
                beta.clone().into_dispatch(),
                EPSILON,
            );
            let y = Tensor::<2>::from_dispatch(y).reshape([rows * d]);
            ((y * t(&g).detach()).sum(), [x, gamma, beta])
        };
        let (l, inputs) = loss(&base, &device, true);
        let grads = l.backward();
        let cpu = device.clone().without_autodiff();
        let h = 1e-6;
        for (which, input) in inputs.iter().enumerate() {
            let analytic: Vec<f64> = input
                .grad(&grads)
                .unwrap()
                .into_data()
                .iter::<f64>()
                .collect();
            for (i, &a) in analytic.iter().enumerate() {
                let at = |delta: f64| -> f64 {
                    let mut v = base.clone();
                    v[which][i] += delta;
                    loss(&v, &cpu, false).0.into_scalar()
                };
                let numeric = (at(h) - at(-h)) / (2.0 * h);
                assert!(
                    (a - numeric).abs() < 1e-6 * (1.0 + numeric.abs()),
                    "tensor {which}, element {i}: analytic {a}, numeric {numeric}"
                );
            }
        }
    }
}
