//! # The hidden layer's element-wise passes, composed from burn's ops
//!
//! Between the two projections the FFN computes, for pre-activations `a` (ungated) or `g`, `u`
//! (gated),
//!
//! ```text
//! h = φ(a)                  da = dh ⊙ φ'(a)
//! h = φ(g) ⊙ ψ(u)           dg = dh ⊙ ψ(u) ⊙ φ'(g),   du = dh ⊙ φ(g) ⊙ ψ'(u)
//! ```
//!
//! with `ψ` the identity for every activation but [`Activation::SwigluOai`] (whose
//! `ψ(u) = clamp(u, −7, 7) + 1`).
//!
//! written here with burn's tensor ops, so that every backend has them: the default of the
//! op's [`Kernels`](crate::op::Kernels) (Flex runs its own vectorised loops, `loops.rs`, and
//! falls back to these for what they do not take).

use std::ops::Range;

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Slice, TensorMetadata, get_or_init_device_settings};

use crate::Activation;

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

impl<B: Backend> Pre<B> {
    pub(crate) fn rows(&self, r: &Range<usize>) -> Self {
        match self {
            Pre::Plain(a) => Pre::Plain(rows_of::<B>(a, r)),
            Pre::Gated(g, u) => Pre::Gated(rows_of::<B>(g, r), rows_of::<B>(u, r)),
            Pre::Fused(gu) => Pre::Fused(rows_of::<B>(gu, r)),
        }
    }

    /// Rows and total width (`d_ff`, or `2·d_ff` gated).
    pub(crate) fn dims(&self) -> (usize, usize) {
        let [rows, width] = match self {
            Pre::Plain(a) | Pre::Gated(a, _) => a.shape().dims::<2>(),
            Pre::Fused(gu) => gu.shape().dims::<2>(),
        };
        let gated = matches!(self, Pre::Gated(..));
        (rows, if gated { 2 * width } else { width })
    }
}

/// Rows `r` of a `[T, n]` tensor (a view on the CPU backends).
pub(crate) fn rows_of<B: Backend>(m: &FloatTensor<B>, r: &Range<usize>) -> FloatTensor<B> {
    let n = m.shape()[1];
    let slices = [
        Slice::new(r.start as isize, Some(r.end as isize), 1),
        Slice::new(0, Some(n as isize), 1),
    ];
    B::float_slice(m.clone(), &slices)
}

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
        // φ(a) = a s,  s = σ(α a):  φ'(a) = s + α a s (1 - s)
        Activation::QuickGelu => {
            let s = B::sigmoid(scale::<B>(a.clone(), Activation::QUICK_GELU_ALPHA));
            let phi = mul::<B>(a, s.clone());
            let d = upstream.map(|up| {
                let ds = mul::<B>(phi.clone(), one_minus::<B>(s.clone()));
                mul::<B>(
                    up,
                    B::float_add(s, scale::<B>(ds, Activation::QUICK_GELU_ALPHA)),
                )
            });
            (phi, d)
        }
        // φ(a) = a' s,  a' = min(a, L),  s = σ(α a'):  φ'(a) = [a ≤ L] (s + α a' s (1 - s))
        Activation::SwigluOai => {
            let clipped = B::float_clamp_max(a.clone(), Activation::OAI_LIMIT.into());
            let s = B::sigmoid(scale::<B>(clipped.clone(), Activation::OAI_ALPHA));
            let phi = mul::<B>(clipped, s.clone());
            let d = upstream.map(|up| {
                let ds = mul::<B>(phi.clone(), one_minus::<B>(s.clone()));
                let d = mul::<B>(up, B::float_add(s, scale::<B>(ds, Activation::OAI_ALPHA)));
                zero_where::<B>(d, &a, Activation::OAI_LIMIT, None)
            });
            (phi, d)
        }
    }
}

/// `d` with zeros where `a > above` or, given `below`, `a < below`: the gradient of a clamp.
fn zero_where<B: Backend>(
    d: FloatTensor<B>,
    a: &FloatTensor<B>,
    above: f64,
    below: Option<f64>,
) -> FloatTensor<B> {
    let bool_dtype = get_or_init_device_settings::<B>(&a.device()).bool_dtype;
    let d = B::float_mask_fill(
        d,
        B::float_greater_elem(a.clone(), above.into(), bool_dtype),
        0.into(),
    );
    match below {
        Some(below) => B::float_mask_fill(
            d,
            B::float_lower_elem(a.clone(), below.into(), bool_dtype),
            0.into(),
        ),
        None => d,
    }
}

/// The `up` side of a gated unit, `ψ(u)`: `u` but for [`Activation::SwigluOai`],
/// `ψ(u) = clamp(u, −L, L) + 1`.
fn up_side<B: Backend>(u: FloatTensor<B>, activation: Activation) -> FloatTensor<B> {
    match activation {
        Activation::SwigluOai => {
            let limit = Activation::OAI_LIMIT;
            shift::<B>(B::float_clamp(u, (-limit).into(), limit.into()), 1.0)
        }
        _ => u,
    }
}

/// `upstream ⊙ ψ'(u)`: `upstream` but for [`Activation::SwigluOai`], `ψ'(u) = [|u| ≤ L]`.
fn up_side_backward<B: Backend>(
    upstream: FloatTensor<B>,
    u: &FloatTensor<B>,
    activation: Activation,
) -> FloatTensor<B> {
    match activation {
        Activation::SwigluOai => {
            let limit = Activation::OAI_LIMIT;
            zero_where::<B>(upstream, u, limit, Some(-limit))
        }
        _ => upstream,
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
            mul::<B>(phi, up_side::<B>(u.clone(), activation))
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
        // dg = dh ⊙ ψ(u) ⊙ φ'(g),  du = dh ⊙ φ(g) ⊙ ψ'(u)   (ψ: the identity but for
        // SwigluOai, see `up_side`)
        Pre::Gated(g, u) => {
            let upstream = mul::<B>(dh.clone(), up_side::<B>(u.clone(), activation));
            let (phi, dg) = activate_and_backward::<B>(g.clone(), Some(upstream), activation);
            let du = up_side_backward::<B>(mul::<B>(dh, phi), u, activation);
            Pre::Gated(dg.expect("asked for"), du)
        }
        Pre::Fused(gu) => {
            let (g, u) = split::<B>(gu);
            let Pre::Gated(dg, du) = hidden_backward::<B>(dh, &Pre::Gated(g, u), activation) else {
                unreachable!("gated in, gated out")
            };
            Pre::Fused(B::float_cat(vec![dg, du], 1))
        }
    }
}
