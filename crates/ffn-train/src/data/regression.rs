//! Regression tasks: `y = f(x) + σ ε` with a frozen random teacher FFN or a smooth map as `f`,
//! whose optimum is `σ²`.

use burn::tensor::{Device, Tensor, TensorData};
use ffn_model::FeedForward;

use crate::rng::Rng;

/// The target map of a regression task.
// One per task, built once and never moved in the training loop: the size is no cost.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub(super) enum Target {
    Teacher(FeedForward),
    /// `sin(x A + b)`.
    Sine {
        a: Tensor<2>,
        b: Tensor<1>,
    },
}

/// `y = f(x) + σ ε` with `x, ε ~ N(0, I_d)`.
#[derive(Debug, Clone)]
pub struct Regression {
    pub(super) d_model: usize,
    pub(super) noise: f64,
    pub(super) target: Target,
}

impl Regression {
    fn apply(&self, x: Tensor<2>) -> Tensor<2> {
        match &self.target {
            Target::Teacher(teacher) => teacher.forward(x),
            Target::Sine { a, b } => (x.matmul(a.clone()) + b.clone().unsqueeze()).sin(),
        }
    }

    /// `n` samples of stream `(seed, name, index)`: `(x, y)`.
    pub(super) fn sample(
        &self,
        rng: &mut Rng,
        n: usize,
        device: &Device,
    ) -> (Tensor<2>, Tensor<2>) {
        let d = self.d_model;
        let mut normal =
            |count: usize| -> Vec<f32> { (0..count).map(|_| rng.normal() as f32).collect() };
        let x = Tensor::<2>::from_data(TensorData::new(normal(n * d), [n, d]), device);
        let eps = Tensor::<2>::from_data(TensorData::new(normal(n * d), [n, d]), device);
        let y = self.apply(x.clone()).detach() + eps * self.noise;
        (x, y)
    }
}
