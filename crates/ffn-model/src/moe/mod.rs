//! # A sparse mixture of experts
//!
//! [`Moe`]: `n_experts` [`FeedForward`](crate::FeedForward) experts behind a router, of which
//! each token uses `top_k`, plus optional shared experts; configured by [`MoeConfig`].
//!
//! - `config.rs`: the serde config and its validation;
//! - `router.rs`: choosing each token's experts (top-k, groups, selection bias, capacity);
//! - `experts.rs`: the experts as one grouped FFN op with its own backward pass;
//! - `model.rs`: the layer, its routing weights and auxiliary losses.
//!
//! The sparse layers of Hugging Face checkpoints load and save in `interop/hf/moe.rs`.

mod config;
mod experts;
mod model;
mod router;

pub use config::{MAX_EXPERTS, MoeConfig, Scoring};
pub use model::{Moe, MoeOutput};
