//! The workspace's own integration tests, one binary: the shipped configs, and parity across
//! every backend compiled in.

mod configs;
mod parity;
