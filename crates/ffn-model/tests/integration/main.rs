//! ffn-model's integration tests, one binary: each module is one subject, its own doc says
//! which oracle it checks against. Helpers and the oracle's files are in `ffn-test-support`.

mod config;
mod dropout;
mod fused;
mod golden;
mod gradcheck;
mod hostile;
mod huggingface;
mod module;
mod moe;
mod persistence;
