//! # Weight files in PyTorch layout
//!
//! A [`FeedForward`] reads and writes safetensors files with the names and layout a PyTorch
//! module with the same attributes would use (`nn.Linear` stores `[out_features, in_features]`,
//! the transpose of burn's `[d_input, d_output]`):
//!
//! | key           | shape             |
//! |---------------|-------------------|
//! | `up.weight`   | `[d_ff, d_model]` |
//! | `up.bias`     | `[d_ff]`          |
//! | `gate.weight` | `[d_ff, d_model]` |
//! | `gate.bias`   | `[d_ff]`          |
//! | `down.weight` | `[d_model, d_ff]` |
//! | `down.bias`   | `[d_model]`       |
//!
//! Loading is strict: the file must hold exactly the tensors the module has, with these shapes.
//! F32 and F64 are read as they are, F16 and BF16 widened exactly; other dtypes are refused.
//! Files written here carry the header metadata `ffn.activation` (and `format = pt`, as
//! `transformers` writes); loading such a file adopts its activation, as burn records do.
//!
//! burn-store's `SafetensorsStore` is not used: its adapters and regex remapping cannot give a
//! typed error per key, nor split and join the packed layouts other schemes use.

use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::path::Path;

use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::{DType, Tensor, TensorData};
use safetensors::{Dtype, SafeTensors, tensor::TensorView};

use crate::{Activation, Error, FeedForward};

const ACTIVATION_KEY: &str = "ffn.activation";

/// One tensor as it goes to or comes from a file: PyTorch layout, f32 or f64.
struct HostTensor {
    shape: Vec<usize>,
    data: TensorData,
}

impl FeedForward {
    /// Loads weights from a safetensors file in PyTorch layout (see the [module
    /// docs](crate::weights)), keeping this module's device.
    ///
    /// Call it on a module built from the matching config, as with burn's `load_file`.
    ///
    /// # Errors
    ///
    /// [`Error::Io`] if the file cannot be read, [`Error::Corrupt`] if it is not a valid
    /// safetensors file, and [`Error::MissingTensor`], [`Error::UnexpectedTensor`],
    /// [`Error::Shape`] or [`Error::DType`] naming the first offending key.
    pub fn load_safetensors(self, path: impl AsRef<Path>) -> Result<Self, Error> {
        let path = path.as_ref();
        let bytes = fs::read(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        self.load_from_bytes(&bytes, path)
    }

    /// [`load_safetensors`](Self::load_safetensors) from bytes in memory.
    pub fn load_safetensors_bytes(self, bytes: &[u8]) -> Result<Self, Error> {
        self.load_from_bytes(bytes, Path::new("<bytes>"))
    }

    /// Writes the weights to a safetensors file in PyTorch layout, atomically: the data goes to
    /// a temporary file beside `path`, which then replaces `path`, so a failure leaves any
    /// earlier file intact.
    pub fn save_safetensors(&self, path: impl AsRef<Path>) -> Result<(), Error> {
        let path = path.as_ref();
        let bytes = self.to_safetensors_bytes();
        write_atomically(path, &bytes).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })
    }

    /// The bytes [`save_safetensors`](Self::save_safetensors) writes.
    pub fn to_safetensors_bytes(&self) -> Vec<u8> {
        let tensors: Vec<(String, HostTensor)> = self
            .projections()
            .into_iter()
            .flat_map(|(name, linear)| {
                let weight = to_pytorch(linear.weight.val());
                let bias = linear.bias.as_ref().map(|b| to_pytorch(b.val()));
                [
                    (format!("{name}.weight"), Some(weight)),
                    (format!("{name}.bias"), bias),
                ]
            })
            .filter_map(|(key, tensor)| tensor.map(|t| (key, t)))
            .collect();
        let metadata = [("format", "pt"), (ACTIVATION_KEY, self.activation().name())];
        serialize(&tensors, &metadata)
    }

    /// `(name, projection)` for each projection this module has, in file order.
    fn projections(&self) -> Vec<(&'static str, &Linear)> {
        let mut out = vec![("up", self.up())];
        if let Some(gate) = self.gate() {
            out.push(("gate", gate));
        }
        out.push(("down", self.down()));
        out
    }

    fn load_from_bytes(self, bytes: &[u8], origin: &Path) -> Result<Self, Error> {
        let corrupt = |e: safetensors::SafeTensorError| Error::Corrupt {
            path: origin.to_path_buf(),
            reason: e.to_string(),
        };
        let (_, metadata) = SafeTensors::read_metadata(bytes).map_err(corrupt)?;
        let file = SafeTensors::deserialize(bytes).map_err(corrupt)?;

        // Exactly the keys this module has: first what is missing, then what is left over.
        let expected: Vec<(String, Vec<usize>)> = self
            .projections()
            .into_iter()
            .flat_map(|(name, linear)| {
                let [d_in, d_out] = linear.weight.lazy_shape().dims::<2>();
                let weight = Some((format!("{name}.weight"), vec![d_out, d_in]));
                let bias = linear
                    .bias
                    .is_some()
                    .then(|| (format!("{name}.bias"), vec![d_out]));
                [weight, bias]
            })
            .flatten()
            .collect();
        let gated = self.is_gated();
        for (key, _) in &expected {
            if file.tensor(key).is_err() {
                return Err(Error::MissingTensor {
                    hint: missing_hint(key, gated),
                    key: key.clone(),
                });
            }
        }
        let mut names = file.names();
        names.sort_unstable();
        if let Some(key) = names
            .into_iter()
            .find(|name| !expected.iter().any(|(key, _)| key == name))
        {
            return Err(Error::UnexpectedTensor {
                hint: unexpected_hint(key, gated),
                key: key.to_string(),
            });
        }

        let mut tensors = HashMap::new();
        for (key, shape) in expected {
            let view = file.tensor(&key).map_err(corrupt)?;
            if view.shape() != shape.as_slice() {
                return Err(Error::Shape {
                    key,
                    expected: shape,
                    actual: view.shape().to_vec(),
                });
            }
            tensors.insert(key.clone(), read_tensor(&key, &view)?);
        }

        let activation = match metadata
            .metadata()
            .as_ref()
            .and_then(|m| m.get(ACTIVATION_KEY))
        {
            Some(name) => Some(
                name.parse::<Activation>()
                    .map_err(|_| Error::Metadata(name.clone()))?,
            ),
            None => None,
        };

        let mut module = self;
        let (gate, up, down) = module.parts_mut();
        for (name, linear) in [("gate", gate), ("up", Some(up)), ("down", Some(down))] {
            let Some(linear) = linear else { continue };
            let weight = tensors.remove(&format!("{name}.weight")).expect("checked");
            linear.weight = load_param(&linear.weight, from_pytorch(weight));
            if let Some(bias) = linear.bias.as_mut() {
                let data = tensors.remove(&format!("{name}.bias")).expect("checked");
                *bias = load_param(bias, data.data);
            }
        }
        Ok(match activation {
            Some(activation) => module.set_activation(activation),
            None => module,
        })
    }
}

/// A safetensors file: an 8-byte little-endian header length, the JSON header (tensors in key
/// order, each `{dtype, shape, data_offsets}`, and `__metadata__`), padded with spaces to a
/// multiple of 8 bytes, then the tensors' bytes. Written here rather than by the `safetensors`
/// crate, whose metadata map is a `HashMap`: the same module gives byte-identical files.
fn serialize(tensors: &[(String, HostTensor)], metadata: &[(&str, &str)]) -> Vec<u8> {
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

/// Replaces a parameter's value, keeping its id, device, dtype and gradient setting.
fn load_param<const D: usize>(param: &Param<Tensor<D>>, data: TensorData) -> Param<Tensor<D>> {
    let current = param.val();
    let tensor = Tensor::from_data(data, (&current.device(), current.dtype()));
    param.clone().transform_for_load(tensor, param.id)
}

fn missing_hint(key: &str, gated: bool) -> String {
    if key.starts_with("gate.") && gated {
        " (is the file's network ungated? then build the module with gated = false)".into()
    } else if key.ends_with(".bias") {
        let name = key.trim_end_matches(".bias");
        format!(" (the file has no bias here: build the module with bias_{name} = false)")
    } else {
        String::new()
    }
}

fn unexpected_hint(key: &str, gated: bool) -> String {
    if key.starts_with("gate.") && !gated {
        " (the file's network is gated: build the module with gated = true)".into()
    } else if let Some(name) = key.strip_suffix(".bias") {
        format!(" (the file has a bias here: build the module with bias_{name} = true)")
    } else {
        String::new()
    }
}

/// Reads a float tensor as f32 (or f64 when stored so); F16 and BF16 widen exactly.
fn read_tensor(key: &str, view: &TensorView<'_>) -> Result<HostTensor, Error> {
    let bytes = view.data();
    let shape = view.shape().to_vec();
    let data = match view.dtype() {
        Dtype::F32 => TensorData::new(decode(bytes, f32::from_le_bytes), shape.clone()),
        Dtype::F64 => TensorData::new(decode(bytes, f64::from_le_bytes), shape.clone()),
        Dtype::F16 => TensorData::new(
            decode(bytes, |b| half::f16::from_le_bytes(b).to_f32()),
            shape.clone(),
        ),
        Dtype::BF16 => TensorData::new(
            decode(bytes, |b| half::bf16::from_le_bytes(b).to_f32()),
            shape.clone(),
        ),
        other => {
            return Err(Error::DType {
                key: key.to_string(),
                dtype: format!("{other:?}"),
            });
        }
    };
    Ok(HostTensor { shape, data })
}

fn decode<const N: usize, T>(bytes: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
    bytes
        .chunks_exact(N)
        .map(|c| f(c.try_into().expect("chunk of N")))
        .collect()
}

/// A burn tensor (`[d_input, d_output]` for a weight) to PyTorch layout (`[out, in]`), as f32
/// unless it is f64.
fn to_pytorch<const D: usize>(tensor: Tensor<D>) -> HostTensor {
    let data = tensor.into_data();
    let data = if data.dtype() == DType::F64 {
        data
    } else {
        data.convert::<f32>()
    };
    let shape = data.shape().to_vec();
    match shape.as_slice() {
        [rows, cols] => HostTensor {
            shape: vec![*cols, *rows],
            data: transpose(&data, *rows, *cols),
        },
        _ => HostTensor { shape, data },
    }
}

/// PyTorch's `[out, in]` weight to burn's `[in, out]`.
fn from_pytorch(tensor: HostTensor) -> TensorData {
    let [rows, cols] = [tensor.shape[0], tensor.shape[1]];
    transpose(&tensor.data, rows, cols)
}

/// The transpose of a row-major `[rows, cols]` matrix, copied into a new row-major buffer.
fn transpose(data: &TensorData, rows: usize, cols: usize) -> TensorData {
    fn t<E: burn::tensor::Element>(src: &[E], rows: usize, cols: usize) -> Vec<E> {
        (0..cols)
            .flat_map(|c| (0..rows).map(move |r| src[r * cols + c]))
            .collect()
    }
    match data.dtype() {
        DType::F64 => TensorData::new(
            t(data.as_slice::<f64>().expect("f64"), rows, cols),
            [cols, rows],
        ),
        _ => TensorData::new(
            t(data.as_slice::<f32>().expect("f32"), rows, cols),
            [cols, rows],
        ),
    }
}

/// Writes `bytes` to a temporary file beside `path`, syncs it, and renames it over `path`.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
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
