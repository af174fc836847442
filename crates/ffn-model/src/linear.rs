//! # A linear layer in the op's precision
//!
//! The layers around an FFN (a transformer's query, key, value and output projections, its
//! vocabulary head) are matrix products too, and under mixed precision they follow the same
//! recipe ([`Precision`]): for `x: [T, d_in]` and burn's `Linear` weight `W: [d_in, d_out]`,
//!
//! ```text
//! forward                          backward (given ∂L/∂y = dy)
//! y = bf16(x) bf16(W) + b          dx = bf16(dy) bf16(W)ᵀ
//!                                  dW = bf16(x)ᵀ bf16(dy),   db = Σ_T dy
//! ```
//!
//! every product accumulated in f32, the bias and every gradient f32. `bf16(x)` and `bf16(W)`
//! are made once, in the forward pass, and kept for the backward pass (half the memory of `x`).
//! In [`Precision::F32`] nothing is rounded and this is burn's `Linear::forward`. The products
//! run on the backend's [`Kernels`]: the `avx512_bf16` GEMM on Flex where the CPU has it, else
//! the f32 product of the rounded operands (the same function); on a GPU in the type the device
//! computes in (`Precision::operands_on`: bf16, f16 or f32) and on NdArray in f32, as the FFN op
//! does.

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, backend_extension};
use burn::nn::Linear;
use burn::tensor::Tensor;

use crate::op::{
    Kernels, Maybe, Precision, add_bias, bias_grad, operand, passing_operand, supported, t,
};

/// The linear op. Call it through [`linear`].
#[backend_extension(
    Flex: cfg(feature = "flex"),
    NdArray: cfg(feature = "ndarray"),
    Cube: cfg(feature = "cube"),
    Autodiff
)]
pub trait LinearOps: Backend {
    /// `y = x W + b` for `x: [T, d_in]`, `W: [d_in, d_out]`, `b: [d_out]`, in `precision`.
    // burn's generated dispatch reads the arguments in one arm per backend: none without a
    // backend feature.
    #[allow(unused_variables)]
    fn ffn_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        #[extension_type] b: Maybe<Self>,
        precision: Precision,
    ) -> FloatTensor<Self>;
}

/// `bf16(x) bf16(W) + b` (operands as [`operand`] makes them).
fn forward<B: Kernels>(
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    b: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    add_bias::<B>(B::ffn_matmul(x, w), b)
}

#[allow(unused_macros)] // instantiated once per backend feature: none in a build without one
macro_rules! inference_impl {
    ($backend:ty) => {
        impl LinearOps for $backend {
            fn ffn_linear(
                x: FloatTensor<Self>,
                w: FloatTensor<Self>,
                b: Maybe<Self>,
                precision: Precision,
            ) -> FloatTensor<Self> {
                let (x, w) = (
                    passing_operand::<Self>(x, precision),
                    operand::<Self>(w, precision),
                );
                forward::<Self>(x, w, b.into_option())
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

/// The backward step; `N` parents: `x`, `W` and, when present, `b`.
#[derive(Debug)]
struct LinearBackward;

/// What the backward pass keeps: the operands as the forward pass multiplied them.
#[derive(Debug, Clone)]
struct Saved<B: Backend> {
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    precision: Precision,
}

impl<B: Kernels, const N: usize> Backward<B, N> for LinearBackward {
    type State = Saved<B>;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let Saved { x, w, precision } = ops.state;
        let dy = grads.consume::<B>(&ops.node);
        let parents = ops.parents.map(|n| n.map(|n| n.id));
        // db = Σ_T dy in f32; the products take dy rounded.
        if let Some(Some(id)) = parents.get(2) {
            grads.register::<B>(*id, bias_grad::<B>(dy.clone()));
        }
        let dy = passing_operand::<B>(dy, precision);
        if let Some(id) = parents[1] {
            grads.register::<B>(id, B::ffn_matmul(t::<B>(x), dy.clone()));
        }
        if let Some(id) = parents[0] {
            grads.register::<B>(id, B::ffn_matmul(dy, t::<B>(w)));
        }
    }
}

/// Registers the op with `N` parents and computes its forward pass.
fn tracked<B: Kernels, C: CheckpointStrategy, const N: usize>(
    nodes: [burn::backend::autodiff::ops::NodeGuard; N],
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    b: Option<FloatTensor<B>>,
    precision: Precision,
) -> FloatTensor<Autodiff<B, C>> {
    let (x, w) = (operand::<B>(x, precision), operand::<B>(w, precision));
    match LinearBackward
        .prepare::<C>(nodes)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let y = forward::<B>(x.clone(), w.clone(), b);
            prep.finish(Saved { x, w, precision }, y)
        }
        OpsKind::UnTracked(prep) => prep.finish(forward::<B>(x, w, b)),
    }
}

impl<B: Kernels, C: CheckpointStrategy> LinearOps for Autodiff<B, C> {
    fn ffn_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: Maybe<Self>,
        precision: Precision,
    ) -> FloatTensor<Self> {
        let (x, x_node) = x.into_parts();
        let (w, w_node) = w.into_parts();
        match b.into_option().map(|b| b.into_parts()) {
            Some((b, b_node)) => {
                tracked::<B, C, 3>([x_node, w_node, b_node], x, w, Some(b), precision)
            }
            None => tracked::<B, C, 2>([x_node, w_node], x, w, None, precision),
        }
    }
}

/// `layer(x)` over the last dimension of `x: [..., d_in]` in `precision`: burn's
/// `Linear::forward` in [`Precision::F32`] or on a device without the op, the op above in
/// [`Precision::Bf16`].
///
/// ```
/// # #[cfg(feature = "flex")] {
/// use burn::nn::LinearConfig;
/// use burn::tensor::{Device, Distribution, Tensor};
/// use ffn_model::{Precision, linear};
///
/// let device = Device::flex();
/// let layer = LinearConfig::new(8, 4).init(&device);
/// let x = Tensor::<3>::random([2, 5, 8], Distribution::Default, &device);
/// let f32 = linear(&layer, x.clone(), Precision::F32);
/// let bf16 = linear(&layer, x, Precision::Bf16);
/// assert_eq!(bf16.dims(), [2, 5, 4]);
/// // The operands rounded to 8 significant bits: close to the f32 layer, not equal.
/// let diff: f32 = (f32 - bf16).abs().max().into_scalar();
/// assert!(diff > 0.0 && diff < 1e-1);
/// # }
/// ```
pub fn linear<const D: usize>(layer: &Linear, x: Tensor<D>, precision: Precision) -> Tensor<D> {
    if precision == Precision::F32 || !supported(&x.device()) {
        return layer.forward(x);
    }
    use burn::backend::Dispatch;
    let w = layer.weight.val();
    let [d_in, d_out] = w.dims();
    let mut dims = x.dims();
    assert_eq!(
        dims[D - 1],
        d_in,
        "linear: the input's last dimension is not d_in"
    );
    dims[D - 1] = d_out;
    let b = layer.bias.as_ref().map(|b| b.val().into_dispatch());
    let y = <Dispatch as LinearOps>::ffn_linear(
        x.reshape([-1, d_in as i64]).into_dispatch(),
        w.into_dispatch(),
        Maybe::<Dispatch>::from_option(b),
        precision,
    );
    Tensor::<2>::from_dispatch(y).reshape(dims)
}

// Every test compares the op on Flex with burn's own composition.
#[cfg(all(test, feature = "flex"))]
mod tests {
    use super::*;
    use burn::nn::LinearConfig;
    use burn::tensor::{Device, Distribution};

    fn rounded<const D: usize>(t: Tensor<D>) -> Tensor<D> {
        t.cast(burn::tensor::DType::BF16)
            .cast(burn::tensor::DType::F32)
    }

    fn max_diff<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> f32 {
        (a - b).abs().max().into_scalar()
    }

    /// Output and every gradient against the composed recipe: the operands rounded (and `dy`,
    /// through a straight-through rounding of the output's gradient), products in f32. Skipping
    /// the rounding of `dy` fails it.
    #[test]
    fn bf16_output_and_gradients_match_the_rounded_f32_products() {
        let device = Device::flex().autodiff();
        for bias in [true, false] {
            let layer = LinearConfig::new(37, 23).with_bias(bias).init(&device);
            let x = Tensor::<3>::random([3, 7, 37], Distribution::Default, &device);
            let g = Tensor::<3>::random([3, 7, 23], Distribution::Default, &device);
            // The op.
            let x_op = x.clone().detach().require_grad();
            let y = linear(&layer, x_op.clone(), Precision::Bf16);
            let grads = (y.clone() * g.clone()).sum().backward();
            let dx = x_op.grad(&grads).unwrap();
            let dw = layer.weight.grad(&grads).unwrap();
            // The recipe in f32 burn ops: y = r(x) r(W) + b, dx = r(dy) r(W)ᵀ, dW = r(x)ᵀ r(dy).
            let (xi, gi) = (x.clone().detach().inner(), g.clone().inner());
            let xr = rounded(xi.clone().reshape([21, 37]));
            let wr = rounded(layer.weight.val().detach().inner());
            let gr = rounded(gi.clone().reshape([21, 23]));
            let mut want_y = xr.clone().matmul(wr.clone());
            if let Some(b) = &layer.bias {
                want_y = want_y + b.val().inner().unsqueeze();
            }
            let want_dx = gr.clone().matmul(wr.clone().transpose());
            let want_dw = xr.transpose().matmul(gr);
            let tol = 1e-5;
            assert!(max_diff(y.inner().reshape([21, 23]), want_y) < tol);
            assert!(max_diff(dx.reshape([21, 37]), want_dx) < tol);
            assert!(max_diff(dw.clone(), want_dw.clone()) < tol);
            if let Some(b) = &layer.bias {
                let db = b.grad(&grads).unwrap();
                assert!(max_diff(db, gi.reshape([21, 23]).sum_dim(0).squeeze_dim(0)) < tol);
            }
            // Without rounding dy the weight gradient is measurably another function.
            let unrounded = rounded(xi.reshape([21, 37]))
                .transpose()
                .matmul(g.inner().reshape([21, 23]));
            assert!(max_diff(dw, unrounded) > 1e-3);
        }
    }

    /// Without autodiff: in f32 the layer is burn's `Linear` exactly; in bf16 it is the f32
    /// product of the rounded operands plus the bias (1e-5).
    #[test]
    fn f32_is_burns_linear_and_bf16_inference_rounds_the_operands() {
        let device = Device::flex();
        let layer = LinearConfig::new(16, 9).init(&device);
        let x = Tensor::<2>::random([11, 16], Distribution::Default, &device);
        let f32 = linear(&layer, x.clone(), Precision::F32);
        f32.to_data()
            .assert_eq(&layer.forward(x.clone()).to_data(), true);
        let bf16 = linear(&layer, x.clone(), Precision::Bf16);
        let bias = layer.bias.as_ref().unwrap().val().unsqueeze();
        let want = rounded(x).matmul(rounded(layer.weight.val())) + bias;
        assert!(max_diff(bf16, want) < 1e-5);
    }
}
