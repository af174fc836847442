//! # Safetensors files, read tensor by tensor and written in key order
//!
//! A safetensors file is an 8-byte little-endian header length `n`, a JSON header of `n` bytes
//! (`{"key": {"dtype", "shape", "data_offsets": [begin, end]}, …, "__metadata__": {…}}`, offsets
//! relative to the end of the header), then the data. [`TensorFile`] reads and checks the header
//! only, then reads the byte range of each tensor asked for: loading the FFN of one layer from
//! a multi-gigabyte checkpoint reads that layer's tensors, not the file.

use std::collections::{BTreeMap, HashMap};
use std::io::{Cursor, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use burn::tensor::{DType, TensorData};

use crate::Error;
use crate::files::open_regular;
use crate::interop::host::HostTensor;

/// Largest header accepted (the format's own limit).
const MAX_HEADER: u64 = 100 * 1024 * 1024;

/// Where a tensor is in its file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// The dtype's name as written (`F32`, `BF16`, …).
    pub dtype: String,
    /// The shape.
    pub shape: Vec<usize>,
    begin: u64,
    end: u64,
}

trait Source: Read + Seek + Send {}
impl<T: Read + Seek + Send> Source for T {}

/// An open safetensors file (or buffer) whose header has been read and checked.
pub struct TensorFile {
    path: PathBuf,
    source: Box<dyn Source>,
    data_start: u64,
    tensors: BTreeMap<String, TensorInfo>,
    metadata: HashMap<String, String>,
}

/// Bytes per element of the dtypes the format defines (sub-byte ones excluded).
fn dtype_size(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" | "F8_E4M3FNUZ"
        | "F8_E5M2FNUZ" => 1,
        "I16" | "U16" | "F16" | "BF16" => 2,
        "I32" | "U32" | "F32" => 4,
        "I64" | "U64" | "F64" | "C64" => 8,
        _ => return None,
    })
}

/// The header's entries in file order, duplicates kept (a JSON object read into a map would
/// silently keep the last of two equal keys).
struct Entries(Vec<(String, serde_json::Value)>);

impl<'de> serde::Deserialize<'de> for Entries {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = Entries;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Entries, A::Error> {
                let mut entries = Vec::new();
                while let Some(entry) = map.next_entry()? {
                    entries.push(entry);
                }
                Ok(Entries(entries))
            }
        }
        deserializer.deserialize_map(Visitor)
    }
}

impl TensorFile {
    /// Opens a file and reads its header.
    pub fn open(path: &Path) -> Result<Self, Error> {
        let file = open_regular(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::new(path.to_path_buf(), Box::new(file))
    }

    /// Reads the header of an in-memory file.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, Error> {
        Self::new(
            PathBuf::from("<bytes>"),
            Box::new(Cursor::new(bytes.to_vec())),
        )
    }

    fn new(path: PathBuf, mut source: Box<dyn Source>) -> Result<Self, Error> {
        let corrupt = |reason: String| Error::Corrupt {
            path: path.clone(),
            reason,
        };
        let io = |e: std::io::Error| Error::Io {
            path: path.clone(),
            source: e,
        };
        let len = source.seek(SeekFrom::End(0)).map_err(io)?;
        source.seek(SeekFrom::Start(0)).map_err(io)?;
        if len < 8 {
            return Err(corrupt(format!("{len} bytes: too short for a header")));
        }
        let mut n = [0u8; 8];
        source.read_exact(&mut n).map_err(io)?;
        let n = u64::from_le_bytes(n);
        if n > MAX_HEADER || 8 + n > len {
            return Err(corrupt(format!(
                "the header claims {n} bytes but the file has {len}"
            )));
        }
        let mut header = vec![0u8; n as usize];
        source.read_exact(&mut header).map_err(io)?;
        let Entries(header) = serde_json::from_slice(&header)
            .map_err(|e| corrupt(format!("the header is not a JSON object: {e}")))?;
        let data_len = len - 8 - n;
        let mut tensors = BTreeMap::new();
        let mut metadata = HashMap::new();
        let mut seen_metadata = false;
        for (key, value) in header {
            // Keys as messages show them: escaped and clipped.
            let shown = crate::error::clip(&key);
            if tensors.contains_key(&key) || (key == "__metadata__" && seen_metadata) {
                return Err(corrupt(format!("the header lists `{shown}` twice")));
            }
            if key == "__metadata__" {
                seen_metadata = true;
                let map: HashMap<String, String> = serde_json::from_value(value)
                    .map_err(|e| corrupt(format!("bad __metadata__: {e}")))?;
                metadata = map;
                continue;
            }
            #[derive(serde::Deserialize)]
            struct Raw {
                dtype: String,
                shape: Vec<usize>,
                data_offsets: (u64, u64),
            }
            let raw: Raw = serde_json::from_value(value)
                .map_err(|e| corrupt(format!("bad entry for `{shown}`: {e}")))?;
            let (begin, end) = raw.data_offsets;
            let size = dtype_size(&raw.dtype).ok_or_else(|| Error::DType {
                key: shown.clone(),
                dtype: crate::error::clip(&raw.dtype),
            })?;
            // Checked: a shape such as [2³², 2³², 16] must not wrap to a small size.
            let bytes = raw
                .shape
                .iter()
                .try_fold(size, |acc, &d| acc.checked_mul(d as u64));
            if begin > end || end > data_len || Some(end - begin) != bytes {
                return Err(corrupt(format!(
                    "tensor `{shown}` claims bytes {begin}..{end} for shape {:?} {}, but the data \
                     section has {data_len} bytes (truncated?)",
                    raw.shape, raw.dtype
                )));
            }
            tensors.insert(
                key,
                TensorInfo {
                    dtype: raw.dtype,
                    shape: raw.shape,
                    begin,
                    end,
                },
            );
        }
        // As the `safetensors` crate checks: the tensors tile the data section exactly, in
        // offset order, without gaps or overlaps.
        let mut ranges: Vec<(u64, u64, &str)> = tensors
            .iter()
            .map(|(key, info)| (info.begin, info.end, key.as_str()))
            .collect();
        ranges.sort_unstable();
        let mut at = 0;
        for (begin, end, key) in ranges {
            if begin != at {
                return Err(corrupt(format!(
                    "tensor `{}` starts at byte {begin} of the data section, expected {at} \
                     (tensors must follow each other without gaps or overlaps)",
                    crate::error::clip(key)
                )));
            }
            at = end;
        }
        if at != data_len {
            return Err(corrupt(format!(
                "the tensors cover {at} bytes of a data section of {data_len}"
            )));
        }
        Ok(Self {
            path,
            source,
            data_start: 8 + n,
            tensors,
            metadata,
        })
    }

    /// The file's path (`<bytes>` for a buffer).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Every tensor, by key.
    pub fn tensors(&self) -> &BTreeMap<String, TensorInfo> {
        &self.tensors
    }

    /// The `__metadata__` strings.
    pub fn metadata(&self) -> &HashMap<String, String> {
        &self.metadata
    }

    /// Reads a float tensor as f32 (f64 stays f64; F16 and BF16 widen exactly). Other dtypes
    /// are refused with [`Error::DType`].
    pub fn read_float(&mut self, key: &str) -> Result<TensorData, Error> {
        let info = self
            .tensors
            .get(key)
            .cloned()
            .ok_or_else(|| Error::MissingTensor {
                key: key.to_string(),
                hint: String::new(),
            })?;
        let mut bytes = vec![0u8; (info.end - info.begin) as usize];
        let path = self.path.clone();
        self.source
            .seek(SeekFrom::Start(self.data_start + info.begin))
            .and_then(|_| self.source.read_exact(&mut bytes))
            .map_err(|source| Error::Io { path, source })?;
        let shape = info.shape.clone();
        Ok(match info.dtype.as_str() {
            "F32" => TensorData::new(decode(&bytes, f32::from_le_bytes), shape),
            "F64" => TensorData::new(decode(&bytes, f64::from_le_bytes), shape),
            "F16" => TensorData::new(
                decode(&bytes, |b| burn::tensor::f16::from_le_bytes(b).to_f32()),
                shape,
            ),
            "BF16" => TensorData::new(
                decode(&bytes, |b| burn::tensor::bf16::from_le_bytes(b).to_f32()),
                shape,
            ),
            other => {
                return Err(Error::DType {
                    key: key.to_string(),
                    dtype: other.to_string(),
                });
            }
        })
    }
}

fn decode<const N: usize, T>(bytes: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
    bytes
        .chunks_exact(N)
        .map(|c| f(c.try_into().expect("chunk of N")))
        .collect()
}

/// The tensors of a model spread over one file or several shards (`model.safetensors` or
/// `model.safetensors.index.json` with its `weight_map`).
pub struct TensorFiles {
    files: Vec<TensorFile>,
    /// Key → index in `files`.
    index: BTreeMap<String, usize>,
}

impl TensorFiles {
    /// One file.
    pub fn single(file: TensorFile) -> Self {
        let index = file.tensors().keys().map(|k| (k.clone(), 0)).collect();
        Self {
            files: vec![file],
            index,
        }
    }

    /// Several files; a key in two of them is an error.
    pub fn many(files: Vec<TensorFile>) -> Result<Self, Error> {
        let mut index = BTreeMap::new();
        for (i, file) in files.iter().enumerate() {
            for key in file.tensors().keys() {
                if let Some(j) = index.insert(key.clone(), i) {
                    return Err(Error::Corrupt {
                        path: file.path().to_path_buf(),
                        reason: format!(
                            "tensor `{}` is also in {}",
                            crate::error::clip(key),
                            files[j].path().display()
                        ),
                    });
                }
            }
        }
        Ok(Self { files, index })
    }

    /// Every key, sorted.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// Every tensor: key, dtype, shape, in key order.
    pub fn list(&self) -> Vec<(String, String, Vec<usize>)> {
        self.keys()
            .map(|k| {
                let info = self.info(k).expect("listed");
                (k.to_string(), info.dtype.clone(), info.shape.clone())
            })
            .collect()
    }

    /// Where a tensor is.
    pub fn info(&self, key: &str) -> Option<&TensorInfo> {
        self.index
            .get(key)
            .and_then(|&i| self.files[i].tensors().get(key))
    }

    /// Reads a float tensor (see [`TensorFile::read_float`]).
    pub fn read_float(&mut self, key: &str) -> Result<TensorData, Error> {
        let i = *self.index.get(key).ok_or_else(|| Error::MissingTensor {
            key: key.to_string(),
            hint: String::new(),
        })?;
        self.files[i].read_float(key)
    }

    /// A metadata value of any of the files.
    pub fn metadata(&self, key: &str) -> Option<&str> {
        self.files
            .iter()
            .find_map(|f| f.metadata().get(key).map(String::as_str))
    }
}

/// A safetensors file: an 8-byte little-endian header length, the JSON header (tensors in key
/// order, each `{dtype, shape, data_offsets}`, and `__metadata__`), padded with spaces to a
/// multiple of 8 bytes, then the tensors' bytes. Written here rather than by the `safetensors`
/// crate, whose metadata map is a `HashMap`: the same module gives byte-identical files.
pub(crate) fn serialize(tensors: &[(String, HostTensor)], metadata: &[(&str, &str)]) -> Vec<u8> {
    let mut sorted: Vec<&(String, HostTensor)> = tensors.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let mut header = serde_json::Map::new();
    let meta: serde_json::Map<String, serde_json::Value> = metadata
        .iter()
        .map(|(k, v)| (k.to_string(), serde_json::Value::from(*v)))
        .collect();
    header.insert("__metadata__".into(), meta.into());
    let mut offset = 0;
    for (key, t) in &sorted {
        let dtype = if t.data.dtype() == DType::F64 {
            "F64"
        } else {
            "F32"
        };
        let size = t.data.as_bytes().len();
        header.insert(
            key.clone(),
            serde_json::json!({"dtype": dtype, "shape": t.shape, "data_offsets": [offset, offset + size]}),
        );
        offset += size;
    }
    let mut json = serde_json::Value::Object(header).to_string().into_bytes();
    json.resize(json.len().div_ceil(8) * 8, b' ');
    let mut out = Vec::with_capacity(8 + json.len() + offset);
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    for (_, t) in sorted {
        out.extend_from_slice(t.data.as_bytes());
    }
    out
}
