//! # ffn
//!
//! The transformer's position-wise feed-forward network as a trainable, backend-swappable
//! burn module. This crate gathers the workspace: [`model`] (`ffn-model`: the
//! [`FeedForward`] module) and [`train`] (`ffn-train`), and owns the backend features
//! (`flex`, the default, `ndarray`, `wgpu`, `cuda`).
//!
//! ```
//! use ffn::{Device, FeedForwardConfig, Tensor, Variant};
//!
//! let device = ffn::cpu();
//! let ffn = FeedForwardConfig::preset(Variant::GeGlu, 32).init(&device);
//! let y = ffn.forward(Tensor::<3>::ones([2, 4, 32], &device));
//! assert_eq!(y.dims(), [2, 4, 32]);
//! # let _: Device = device;
//! ```

pub use burn::tensor::{Device, Tensor};
pub use ffn_model as model;
pub use ffn_model::{
    Activation, DropoutAt, FeedForward, FeedForwardConfig, Moe, MoeConfig, Variant,
};
pub use ffn_train as train;

/// The default CPU device of this build: Flex when the `flex` feature is on (the default), else
/// NdArray.
#[cfg(any(feature = "flex", feature = "ndarray"))]
pub fn cpu() -> Device {
    #[cfg(feature = "flex")]
    return Device::flex();
    #[cfg(not(feature = "flex"))]
    #[allow(deprecated)]
    return Device::ndarray();
}

/// The wgpu device (feature `wgpu`): the adapter wgpu prefers, initialised once per process.
///
/// # Errors
///
/// [`train::Error::Device`] when no adapter can be initialised (no GPU driver, no Vulkan, …).
#[cfg(feature = "wgpu")]
pub fn wgpu() -> Result<Device, train::Error> {
    ffn_train::backend::wgpu()
}

/// The first CUDA device (feature `cuda`).
///
/// # Errors
///
/// [`train::Error::Device`] when there is none (no NVIDIA GPU or no driver).
#[cfg(feature = "cuda")]
pub fn cuda() -> Result<Device, train::Error> {
    ffn_train::backend::cuda()
}

/// The README's Rust examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The Rust examples of the pages under `docs/`, compiled and run as doctests.
#[cfg(doctest)]
pub mod docs {
    #[doc = include_str!("../docs/model.md")]
    pub struct Model;
    #[doc = include_str!("../docs/interop.md")]
    pub struct Interop;
    #[doc = include_str!("../docs/moe.md")]
    pub struct Moe;
}
