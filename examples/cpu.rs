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

#[path = "shared/teacher.rs"]
mod teacher;

fn main() {
    teacher::train(ffn::cpu().autodiff(), 2000);
}
