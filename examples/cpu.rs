//! Train a small FFN on the default CPU backend and watch the loss fall to the noise floor.
//!
//! ```text
//! cargo run --release --example cpu
//! ```
//!
//! A frozen random SwiGLU "teacher" labels random inputs with Gaussian noise σ = 0.2; a SwiGLU
//! student learns it with AdamW. No predictor can beat the noise: the best mean squared error
//! is σ² = 0.04, and the student gets close. (`ffn-train` does the same with configs,
//! checkpoints and plots: `cargo run --release -p ffn-train -- train --config configs/teacher.toml`.)

use burn::module::Module;
use burn::nn::Initializer;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Distribution, Tensor};
use ffn::{FeedForwardConfig, Variant};

const D_MODEL: usize = 8;
const NOISE: f64 = 0.2;
const BATCH: usize = 512;

fn main() {
    let device = ffn::cpu().autodiff();
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
    let steps = 2000;
    for step in 1..=steps {
        let (x, y) = batch();
        let loss = (student.forward(x) - y).powi_scalar(2).mean();
        if step == 1 || step % 200 == 0 {
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
