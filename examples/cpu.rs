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

#[cfg(any(feature = "flex", feature = "ndarray"))]
#[path = "shared/teacher.rs"]
mod teacher;

#[cfg(any(feature = "flex", feature = "ndarray"))]
fn main() {
    teacher::train(ffn::cpu().autodiff(), 2000);
}

#[cfg(not(any(feature = "flex", feature = "ndarray")))]
fn main() {
    eprintln!(
        "error: this build has no CPU backend: enable the `flex` (default) or `ndarray` feature"
    );
    std::process::exit(2);
}
