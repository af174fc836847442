//! # ffn-model
//!
//! The transformer's position-wise feed-forward network as one burn [`Module`](burn::module::Module),
//! [`FeedForward`], covering the variants in use: any [`Activation`], optional gating (the GLU
//! family of Shazeer 2020), a bias switch per projection, dropout on the hidden layer or the
//! output.
//!
//! ```text
//! ungated: y = down(φ(up(x)))
//! gated:   y = down(φ(gate(x)) ⊙ up(x))
//! ```
//!
//! The [`Device`](burn::tensor::Device) a caller passes decides where the module lives, and the
//! same type runs on every backend the final binary compiles in. The crate's features (`flex`,
//! the default, `ndarray`, `wgpu`, `cuda`) add the FFN op's fast path for a backend and enable
//! it in burn; with `default-features = false` it enables no backend.
//!
//! ```
//! use burn::tensor::{Device, Tensor};
//! use ffn_model::{FeedForwardConfig, Variant};
//!
//! let device = Device::flex();
//! let config = FeedForwardConfig::preset(Variant::SwiGlu, 512); // d_ff = 1365
//! let ffn = config.init(&device);
//! assert_eq!(ffn.num_params(), 3 * 512 * 1365);
//!
//! let y = ffn.forward(Tensor::<3>::zeros([4, 16, 512], &device));
//! assert_eq!(y.dims(), [4, 16, 512]);
//! ```
//!
//! Weights load from and save to safetensors files with PyTorch names and layout
//! ([`FeedForward::load_safetensors`], [`FeedForward::save_safetensors`]).
//!
//! [`Moe`] ([`MoeConfig`]) is the sparse form of the same layer: a mixture of FeedForward
//! experts behind a router (top-k, groups, shared experts, capacity, balancing losses), whose
//! layers load from and save to Mixtral, Qwen-MoE and DeepSeek-V3 checkpoints
//! ([`HfModel::load_moe_layer`]).

mod activation;
#[cfg(feature = "flex")]
mod bf16;
#[cfg(feature = "flex")]
mod blas;
mod config;
#[cfg(feature = "flex")]
mod cpu;
pub mod dropout;
mod error;
/// Bounded reads and atomic writes, shared with `ffn-train`: not part of the crate's API.
#[doc(hidden)]
pub mod files;
pub mod interop;
// burn-ndarray is deprecated upstream; it is still a backend the ops support.
#[allow(deprecated)]
mod linear;
#[cfg(feature = "flex")]
mod loops;
mod model;
#[allow(deprecated)]
mod moe;
#[allow(deprecated)]
mod op;
mod preset;

pub use activation::Activation;
pub use config::{DropoutAt, FeedForwardConfig, MAX_DIM, MAX_MATRIX};
#[doc(hidden)]
pub use error::printable;
pub use error::{ConfigError, Error};
pub use interop::hf::HfModel;
pub use interop::hf::moe::MoeScheme;
pub use interop::scheme::Scheme;
#[doc(hidden)]
pub use linear::linear;
pub use model::FeedForward;
pub use moe::{MAX_EXPERTS, Moe, MoeConfig, MoeOutput, Scoring};
pub use op::{Memory, Precision};
pub use preset::Variant;

/// A name as the parsers of activations, variants and schemes compare it: trimmed, ASCII
/// lower case, `-` read as `_`.
pub(crate) fn normal_name(name: &str) -> String {
    name.trim().to_ascii_lowercase().replace('-', "_")
}

/// Branch-free `f32` math that compilers vectorise, as the CPU kernels use it (shared with
/// `ffn-train`'s attention and loss kernels): not part of the crate's API.
#[cfg(feature = "flex")]
#[doc(hidden)]
pub mod math {
    pub use crate::loops::exp;
}

/// Tells the C allocator to keep freed memory for reuse instead of returning it to the operating
/// system (glibc on Linux; elsewhere it does nothing). Process-wide: call it once, first thing in
/// `main`, as `ffn-train` does.
///
/// A training step frees and allocates the same large buffers again and again. glibc serves
/// blocks of 32 MiB and more (and, after a free, ones above a threshold that adapts) from fresh
/// `mmap`s and trims its heaps after each free, so every step page-faults and zero-fills its
/// buffers anew. Raising the mmap and trim thresholds keeps those pages mapped, which makes training
/// steps measurably faster for a few MiB more resident memory (BENCHMARKS.md has the figures:
/// the README's main job, the FFN op, a [`Moe`] layer). The price: memory freed after a
/// peak stays with the process until it exits.
///
/// ```
/// ffn_model::keep_freed_memory();
/// ```
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; it is safe to call at any time.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
    }
}

/// What the FFN op's matrix products run on, in one line: for f32 the BLAS library and its
/// kernels (or Flex's own `gemm`, and why), for bf16 ([`Precision::Bf16`]) the `avx512_bf16`
/// kernel or the widening fallback (and why), then the CPU and its vector features. The library
/// is loaded at run time on first use (the `FFN_BLAS` and `FFN_BF16` variables of
/// docs/precision.md); an OpenBLAS that runs kernels narrower than the CPU's vectors there (it
/// does not know the CPU) is passed over for Flex's product, and on Linux x86-64 a CPU with
/// AVX-512 has OpenBLAS asked for its AVX-512 kernels before it loads.
///
/// ```
/// let report = ffn_model::cpu_kernels();
/// assert!(report.contains("; bf16: ") && report.contains("; CPU: "));
/// ```
#[cfg(feature = "flex")]
pub fn cpu_kernels() -> &'static str {
    static REPORT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    REPORT.get_or_init(|| {
        format!(
            "{}; bf16: {}; CPU: {}",
            blas::report(),
            bf16::report(),
            blas::cpu::describe()
        )
    })
}
