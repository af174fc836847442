//! The teacher-student run shared by the `cpu` and `gpu` examples.
//!
//! A frozen random SwiGLU "teacher" labels random inputs with Gaussian noise σ = 0.2; a SwiGLU
//! student learns it with AdamW. No predictor can beat the noise: the best mean squared error
//! is σ² = 0.04, and the student gets close.

use burn::module::Module;
use burn::nn::Initializer;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Distribution, Tensor};
use ffn::{FeedForwardConfig, Variant};

const D_MODEL: usize = 8;
const NOISE: f64 = 0.2;
const BATCH: usize = 512;

/// Trains the student for `steps` steps on `device` (an autodiff device), printing the loss.
pub fn train(device: Device, steps: usize) {
    device.seed(42);

    let config = FeedForwardConfig::preset(Variant::SwiGlu, D_MODEL);
    let teacher = config
        .clone()
        .with_initializer(Initializer::KaimingNormal {
            gain: 1.0,
            fan_out_only: false,
        })
        .init(&device)
        .no_grad();
    let mut student = config.init(&device);
    println!("teacher and student: {student}");

    // y = teacher(x) + σ ε, x, ε ~ N(0, I)
    let batch = || {
        let x = Tensor::<2>::random([BATCH, D_MODEL], Distribution::Normal(0.0, 1.0), &device);
        let noise =
            Tensor::<2>::random([BATCH, D_MODEL], Distribution::Normal(0.0, NOISE), &device);
        let y = teacher.forward(x.clone()).detach() + noise;
        (x, y)
    };

    let mut optim = AdamWConfig::new().with_weight_decay(0.0).init();
    for step in 1..=steps {
        let (x, y) = batch();
        let loss = (student.forward(x) - y).powi_scalar(2).mean();
        if step == 1 || step % (steps / 10).max(1) == 0 {
            let mse: f64 = loss.clone().into_scalar();
            println!(
                "step {step:>4}: MSE {mse:.4}   (best possible: σ² = {:.4})",
                NOISE * NOISE
            );
        }
        let grads = GradientsParams::from_grads(loss.backward(), &student);
        // Cosine decay from 2e-2 to 0.
        let lr = 1e-2 * (1.0 + (std::f64::consts::PI * step as f64 / steps as f64).cos());
        student = optim.step(lr, student, grads);
    }
}
