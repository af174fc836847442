//! The ops with their own backward pass, beside the FFN's (which lives in `ffn-model`): causal
//! self-attention, layer normalisation and the cross-entropy, and the kernel pieces they share.

#[cfg(feature = "flex")]
pub mod attention;
#[cfg(feature = "flex")]
mod kernel;
#[cfg(feature = "flex")]
pub mod layer_norm;
pub mod loss;
