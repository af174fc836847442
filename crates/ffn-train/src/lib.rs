//! # ffn-train
//!
//! Trains [`ffn_model::FeedForward`] networks on tasks whose best achievable loss is known
//! exactly, so every run reports how far it is from the optimum:
//!
//! - a language model on a synthetic Markov source of known entropy rate (the default data:
//!   nothing is downloaded), or on a text file the user points at;
//! - teacher-student regression (optimal MSE = σ²), or a smooth multi-output map.
//!
//! The binary `ffn-train` (`train`, `resume`, `eval`, `sample`, `inspect`, `sweep`) drives it
//! from TOML configs; each run writes a folder with its resolved config, metrics (JSONL and
//! CSV), checkpoints, a summary and a loss plot, and a [`sweep`] compares the variants over a
//! grid of seeds, learning rates and tasks. Layout, as in burn's examples: [`data`], [`model`],
//! [`training`], [`inference`].

pub mod backend;
pub mod checkpoint;
pub mod config;
pub mod data;
mod error;
pub mod files;
pub mod inference;
pub mod inspect;
pub mod interrupt;
pub mod metrics;
pub mod model;
pub mod ops;
pub mod optim;
pub mod plot;
pub mod rng;
pub mod run;
mod shards;
pub mod stats;
pub mod sweep;
pub mod training;

pub use config::TrainConfig;
pub use error::{EXIT_DIVERGED, EXIT_INTERRUPTED, Error, Result};
pub use training::Trainer;

/// The built-in default config: a small SwiGLU transformer on a synthetic language
/// (`crates/ffn-train/configs/default.toml`; the repository's `configs/default.toml` links to it).
pub const DEFAULT_CONFIG: &str = include_str!("../configs/default.toml");
