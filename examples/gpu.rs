//! The `cpu` example on a GPU: train a small FFN with wgpu and watch the loss fall to the
//! noise floor.
//!
//! ```text
//! cargo run --release --example gpu --features wgpu
//! ```
//!
//! wgpu takes the adapter it prefers: a discrete GPU, else an integrated one, else a software
//! Vulkan driver such as Mesa's lavapipe (slow, but the same numbers). Without any, the example
//! says so and exits with status 1.

#[path = "shared/teacher.rs"]
mod teacher;

fn main() {
    let device = match ffn::wgpu() {
        Ok(device) => device,
        Err(err) => {
            eprintln!("error: {err}");
            std::process::exit(1);
        }
    };
    let steps = std::env::args()
        .nth(1)
        .map_or(2000, |s| s.parse().expect("the number of steps"));
    teacher::train(device.autodiff(), steps);
}
