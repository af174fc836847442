//! # Files, read and written safely
//!
//! Every file this crate and `ffn-train` read or write goes through these functions:
//!
//! - reads take regular files only, with a size limit: a folder, a device such as `/dev/zero`
//!   (which never ends) or a FIFO (which blocks until a writer comes) is refused before it is
//!   opened, and a file over its limit is an error, not an allocation of its size;
//! - writes are atomic: the bytes go to a temporary file beside the target, are synced, and the
//!   temporary file is renamed over the target, so a reader sees the old file or the new one,
//!   and a failure (a full disk, a kill) leaves the old one as it was.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::Path;

/// Opens `path` for reading if it is a regular file (after symbolic links): a device such as
/// `/dev/zero` would never end, and opening a FIFO blocks until a writer comes.
pub(crate) fn open_regular(path: &Path) -> std::io::Result<File> {
    let metadata = std::fs::metadata(path)?;
    if !metadata.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file (a folder, device, FIFO or socket)",
        ));
    }
    File::open(path)
}

/// The whole of a regular file of at most `limit` bytes: a folder, device, FIFO or socket is
/// refused before it is opened (`/dev/zero` would never end; a FIFO blocks until a writer comes).
pub fn read_regular(path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
    let file = open_regular(path)?;
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("larger than the limit of {limit} bytes for this kind of file"),
        ));
    }
    Ok(bytes)
}

/// The largest JSON or TOML config file read (16 MiB).
pub const MAX_CONFIG_FILE: u64 = 16 << 20;

/// A text file of at most `limit` bytes (see [`read_regular`]), which must be UTF-8.
pub fn read_text(path: &Path, limit: u64) -> std::io::Result<String> {
    String::from_utf8(read_regular(path, limit)?).map_err(|e| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "not UTF-8 (invalid byte at offset {})",
                e.utf8_error().valid_up_to()
            ),
        )
    })
}

/// Writes `bytes` to a temporary file beside `path`, syncs it, and renames it over `path`:
/// readers see the old file or the new one, never a part of it, and a failure leaves the old
/// one as it was.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::other("the path names no file"))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| {
        let mut file = fs::File::create(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}
