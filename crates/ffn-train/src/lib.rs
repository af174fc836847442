//! Training for `ffn-model` (see issue: ffn-train).
