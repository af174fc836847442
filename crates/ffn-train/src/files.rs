//! Hashing and file writes, the leaves every other module may use.

use std::path::Path;

use crate::error::{Error, Result};

/// FNV-1a: the hash of random streams' names ([`crate::rng`]) and of config texts
/// ([`fingerprint`]).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xCBF2_9CE4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3)
    })
}

/// FNV-1a of a config text, as 16 hex digits.
pub fn fingerprint(text: &str) -> String {
    format!("{:016x}", fnv1a(text.as_bytes()))
}

/// SHA-256 of `bytes`, as 64 hex digits.
pub fn sha256(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Writes a file atomically (see [`ffn_model::files::write_atomically`]): a failed write
/// never leaves a half-written file or destroys the one that was there.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    ffn_model::files::write_atomically(path, bytes).map_err(Error::io(path))
}
