//! # Checkpoints: files in other codebases' names
//!
//! The FFN itself needs none of this. Here are the ways its weights, and a mixture's, come in
//! from and go out to PyTorch and Hugging Face:
//!
//! - [`scheme`]: the naming schemes of the FFN's three projections ([`Scheme`](crate::Scheme));
//! - `safetensors.rs`, `host.rs`, `weights.rs`: the file format read tensor by tensor, tensors in
//!   PyTorch's layout, and [`FeedForward`](crate::FeedForward)'s load and save in any scheme;
//! - [`hf`]: Hugging Face model folders ([`HfModel`](crate::HfModel)), found by tensor names and
//!   config fields, dense layers in `hf/mod.rs` and sparse ones in `hf/moe.rs`
//!   ([`MoeScheme`](crate::MoeScheme));
//! - [`inspect`]: what any weight file holds, and which FFNs.

pub mod hf;
pub(crate) mod host;
pub mod inspect;
pub(crate) mod safetensors;
pub mod scheme;
pub(crate) mod weights;
