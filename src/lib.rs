//! ffn
