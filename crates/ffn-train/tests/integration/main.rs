//! ffn-train's integration tests, one binary: the library's tasks and ops, and the `ffn-train`
//! binary end to end. Each module is one subject; `common` holds what they share beyond
//! `ffn-test-support`.

mod cli;
mod common;
mod fuzz;
mod golden_ops;
mod hostile;
mod resume;
mod sweep;
mod tasks;
