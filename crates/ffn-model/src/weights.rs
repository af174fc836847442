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
//! or in any other [`Scheme`] (Hugging Face BERT, T5, LLaMA, GPT-2, Meta's LLaMA, labml, the
//! packed `w12` and `gate_up_proj` layouts), under a key prefix such as `model.layers.3.mlp.`.
//!
//! Loading is strict: the file must hold exactly the tensors the module has (under a prefix:
//! exactly those of the scheme's names), with these shapes. F32 and F64 are read as they are,
//! F16 and BF16 widened exactly; other dtypes are refused. Files written here carry the header
//! metadata `ffn.activation` (and `format = pt`, as `transformers` writes); loading such a file
//! adopts its activation, as burn records do.
//!
//! burn-store's `SafetensorsStore` is not used: its adapters and regex remapping cannot give a
//! typed error per key, nor split and join the packed layouts.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Write;
use std::path::Path;

use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::{DType, Tensor, TensorData};

use crate::reader::{TensorFile, TensorFiles};
use crate::scheme::{Role, Slot};
use crate::{Activation, Error, FeedForward, Scheme};

const ACTIVATION_KEY: &str = "ffn.activation";

/// One tensor on its way to a file: its shape and data (f32 or f64).
struct HostTensor {
    shape: Vec<usize>,
    data: TensorData,
}

impl FeedForward {
    /// Loads weights from a safetensors file with this crate's names in PyTorch layout (see the
    /// [module docs](crate::weights)), keeping this module's device and dtype.
    ///
    /// Call it on a module built from the matching config, as with burn's `load_file`.
    ///
    /// # Errors
    ///
    /// [`Error::Io`] if the file cannot be read, [`Error::Corrupt`] if it is not a valid
    /// safetensors file, and [`Error::MissingTensor`], [`Error::UnexpectedTensor`],
    /// [`Error::Shape`] or [`Error::DType`] naming the first offending key.
    pub fn load_safetensors(self, path: impl AsRef<Path>) -> Result<Self, Error> {
        let mut files = TensorFiles::single(TensorFile::open(path.as_ref())?);
        self.load_from(&mut files, Scheme::Native, "")
    }

    /// [`load_safetensors`](Self::load_safetensors) from bytes in memory.
    pub fn load_safetensors_bytes(self, bytes: &[u8]) -> Result<Self, Error> {
        let mut files = TensorFiles::single(TensorFile::from_bytes(bytes)?);
        self.load_from(&mut files, Scheme::Native, "")
    }

    /// Loads the FFN stored under `prefix` (for example `model.layers.3.mlp.`, or `""`) in a
    /// safetensors file, in the given naming scheme, or the one its keys show when `None`.
    pub fn load_safetensors_as(
        self,
        path: impl AsRef<Path>,
        scheme: Option<Scheme>,
        prefix: &str,
    ) -> Result<Self, Error> {
        let mut files = TensorFiles::single(TensorFile::open(path.as_ref())?);
        let scheme = match scheme {
            Some(scheme) => scheme,
            None => Scheme::detect(files.keys(), prefix)?.0,
        };
        self.load_from(&mut files, scheme, prefix)
    }

    /// Writes the weights to a safetensors file with this crate's names in PyTorch layout,
    /// atomically: the data goes to a temporary file beside `path`, which then replaces `path`,
    /// so a failure leaves any earlier file intact.
    pub fn save_safetensors(&self, path: impl AsRef<Path>) -> Result<(), Error> {
        self.save_safetensors_as(path, Scheme::Native, "")
    }

    /// [`save_safetensors`](Self::save_safetensors) in another naming scheme, each key prefixed
    /// by `prefix`: a file that `load_state_dict(strict=True)` of the matching PyTorch module
    /// accepts (with `prefix = ""`).
    pub fn save_safetensors_as(
        &self,
        path: impl AsRef<Path>,
        scheme: Scheme,
        prefix: &str,
    ) -> Result<(), Error> {
        let path = path.as_ref();
        let bytes = self.to_safetensors_bytes_as(scheme, prefix)?;
        write_atomically(path, &bytes).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })
    }

    /// The bytes [`save_safetensors`](Self::save_safetensors) writes.
    pub fn to_safetensors_bytes(&self) -> Vec<u8> {
        self.to_safetensors_bytes_as(Scheme::Native, "")
            .expect("the native scheme holds every network")
    }

    /// The bytes [`save_safetensors_as`](Self::save_safetensors_as) writes.
    ///
    /// # Errors
    ///
    /// [`Error::Scheme`] if the scheme cannot hold this network: a gated one in `bert` or
    /// `gpt2`, an ungated one in a packed layout, a packed pair with one bias but not the other.
    pub fn to_safetensors_bytes_as(&self, scheme: Scheme, prefix: &str) -> Result<Vec<u8>, Error> {
        // A fused network is stored as the unfused one it computes.
        if self.is_fused() {
            return self
                .clone()
                .unfused()
                .to_safetensors_bytes_as(scheme, prefix);
        }
        let gated = self.is_gated();
        let mut tensors: Vec<(String, HostTensor)> = Vec::new();
        // Packed halves, by key stem: [gate, up] each (weight, bias).
        type Half = Option<(HostTensor, Option<HostTensor>)>;
        let mut packs: BTreeMap<&str, [Half; 2]> = BTreeMap::new();
        for (role, linear) in self.roles() {
            let slot = scheme
                .slot(role, gated)?
                .expect("the module has this projection");
            let weight = to_pytorch(linear.weight.val());
            let bias = linear.bias.as_ref().map(|b| to_pytorch(b.val()));
            let key = |suffix: &str| format!("{prefix}{}.{suffix}", slot.name());
            match slot {
                Slot::Linear(_) => {
                    tensors.push((key("weight"), weight));
                    tensors.extend(bias.map(|b| (key("bias"), b)));
                }
                Slot::Conv1d(_) => {
                    let [out, inp] = [weight.shape[0], weight.shape[1]];
                    let data = transpose(&weight.data, out, inp);
                    tensors.push((
                        key("weight"),
                        HostTensor {
                            shape: vec![inp, out],
                            data,
                        },
                    ));
                    tensors.extend(bias.map(|b| (key("bias"), b)));
                }
                Slot::Half(name, half) => {
                    packs.entry(name).or_default()[half] = Some((weight, bias));
                }
            }
        }
        for (name, [gate, up]) in packs {
            let ((gate_w, gate_b), (up_w, up_b)) = (gate.expect("gate"), up.expect("up"));
            tensors.push((
                format!("{prefix}{name}.weight"),
                concat_rows(&gate_w, &up_w),
            ));
            match (gate_b, up_b) {
                (Some(g), Some(u)) => {
                    tensors.push((format!("{prefix}{name}.bias"), concat_rows(&g, &u)))
                }
                (None, None) => {}
                _ => {
                    return Err(Error::Scheme(format!(
                        "`{name}` packs gate and up: their biases must both be present or both absent"
                    )));
                }
            }
        }
        let metadata = [("format", "pt"), (ACTIVATION_KEY, self.activation().name())];
        Ok(serialize(&tensors, &metadata))
    }

    /// `(role, projection)` for each projection this module has.
    fn roles(&self) -> Vec<(Role, &Linear)> {
        let mut out = Vec::new();
        if let Some(gate) = self.gate() {
            out.push((Role::Gate, gate));
        }
        out.push((Role::Up, self.up().expect("an unfused network has `up`")));
        out.push((Role::Down, self.down()));
        out
    }

    /// Loads the FFN under `prefix` in `scheme` from `files`.
    pub(crate) fn load_from(
        self,
        files: &mut TensorFiles,
        scheme: Scheme,
        prefix: &str,
    ) -> Result<Self, Error> {
        // A fused network loads the unfused names, then joins them again.
        if let Some(ids) = self.gate_up_ids() {
            return Ok(self.unfused().load_from(files, scheme, prefix)?.fused(ids));
        }
        let gated = self.is_gated();
        let mut consumed = BTreeSet::new();
        // PyTorch-layout weight [out, in] and bias [out] of each role.
        let mut loaded: Vec<(Role, TensorData, Option<TensorData>)> = Vec::new();
        for (role, linear) in self.roles() {
            let slot = scheme
                .slot(role, gated)?
                .expect("the module has this projection");
            let [d_in, d_out] = linear.weight.lazy_shape().dims::<2>();
            let key = |suffix: &str| format!("{prefix}{}.{suffix}", slot.name());
            let mut read = |suffix: &str, shape: Vec<usize>| -> Result<TensorData, Error> {
                let key = key(suffix);
                let info = files.info(&key).ok_or_else(|| Error::MissingTensor {
                    hint: missing_hint(role, suffix),
                    key: key.clone(),
                })?;
                if info.shape != shape {
                    return Err(Error::Shape {
                        key,
                        expected: shape,
                        actual: info.shape.clone(),
                    });
                }
                consumed.insert(key.clone());
                files.read_float(&key)
            };
            let (weight, bias) = match slot {
                Slot::Linear(_) => (
                    read("weight", vec![d_out, d_in])?,
                    linear
                        .bias
                        .as_ref()
                        .map(|_| read("bias", vec![d_out]))
                        .transpose()?,
                ),
                Slot::Conv1d(_) => (
                    transpose(&read("weight", vec![d_in, d_out])?, d_in, d_out),
                    linear
                        .bias
                        .as_ref()
                        .map(|_| read("bias", vec![d_out]))
                        .transpose()?,
                ),
                Slot::Half(_, half) => (
                    rows(
                        &read("weight", vec![2 * d_out, d_in])?,
                        half * d_out,
                        d_out,
                        d_in,
                    ),
                    linear
                        .bias
                        .as_ref()
                        .map(|_| {
                            Ok::<_, Error>(rows(
                                &read("bias", vec![2 * d_out])?,
                                half * d_out,
                                d_out,
                                1,
                            ))
                        })
                        .transpose()?,
                ),
            };
            loaded.push((role, weight, bias));
        }

        // Under the prefix, every key with one of the scheme's names must have been used
        // (without a prefix: every key of the file).
        let stems = scheme.stems();
        let unexpected = files.keys().find(|key| {
            !consumed.contains(*key)
                && key.strip_prefix(prefix).is_some_and(|rest| {
                    prefix.is_empty() || stems.iter().any(|s| rest.starts_with(&format!("{s}.")))
                })
        });
        if let Some(key) = unexpected {
            return Err(Error::UnexpectedTensor {
                hint: unexpected_hint(scheme, key.strip_prefix(prefix).unwrap_or(key), gated),
                key: key.to_string(),
            });
        }

        let activation = match files.metadata(ACTIVATION_KEY) {
            Some(name) => Some(
                name.parse::<Activation>()
                    .map_err(|_| Error::Metadata(name.to_string()))?,
            ),
            None => None,
        };

        let mut module = self;
        let (gate, up, down) = module.parts_mut();
        let mut targets = [
            (Role::Gate, gate),
            (Role::Up, Some(up)),
            (Role::Down, Some(down)),
        ];
        for (role, weight, bias) in loaded {
            let linear = targets
                .iter_mut()
                .find(|(r, _)| *r == role)
                .and_then(|(_, l)| l.as_deref_mut())
                .expect("every loaded role has a projection");
            let [out, inp] = [weight.shape()[0], weight.shape()[1]];
            linear.weight = load_param(&linear.weight, transpose(&weight, out, inp));
            if let (Some(param), Some(bias)) = (linear.bias.as_mut(), bias) {
                *param = load_param(param, bias);
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

fn missing_hint(role: Role, suffix: &str) -> String {
    if suffix == "bias" {
        format!(
            " (the file has no bias here: build the module with bias_{} = false)",
            role.native()
        )
    } else if role == Role::Gate {
        " (is the file's network ungated? then build the module with gated = false)".into()
    } else {
        String::new()
    }
}

fn unexpected_hint(scheme: Scheme, key: &str, gated: bool) -> String {
    let gate_only = |stem: &str| {
        let in_gated = [Role::Gate, Role::Up, Role::Down]
            .iter()
            .any(|&r| matches!(scheme.slot(r, true), Ok(Some(s)) if s.name() == stem));
        let in_ungated = [Role::Up, Role::Down]
            .iter()
            .any(|&r| matches!(scheme.slot(r, false), Ok(Some(s)) if s.name() == stem));
        in_gated && !in_ungated
    };
    let stem = key.rsplit_once('.').map_or(key, |(stem, _)| stem);
    if !gated && gate_only(stem) {
        " (the file's network is gated: build the module with gated = true)".into()
    } else if key.ends_with(".bias") {
        " (the file has a bias here: build the module with that bias on)".into()
    } else {
        String::new()
    }
}

/// A burn tensor to a host tensor in PyTorch layout (`[out, in]` for a weight), as f32 unless
/// it is f64.
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

/// Applies `f` to the values of f32 or f64 data.
fn with_values(
    data: &TensorData,
    f32s: impl FnOnce(&[f32]) -> (Vec<f32>, Vec<usize>),
    f64s: impl FnOnce(&[f64]) -> (Vec<f64>, Vec<usize>),
) -> TensorData {
    match data.dtype() {
        DType::F64 => {
            let (v, shape) = f64s(data.as_slice::<f64>().expect("f64"));
            TensorData::new(v, shape)
        }
        _ => {
            let (v, shape) = f32s(data.as_slice::<f32>().expect("f32"));
            TensorData::new(v, shape)
        }
    }
}

/// The transpose of a row-major `[rows, cols]` matrix, copied into a new row-major buffer.
fn transpose(data: &TensorData, rows: usize, cols: usize) -> TensorData {
    fn t<E: Copy>(src: &[E], rows: usize, cols: usize) -> (Vec<E>, Vec<usize>) {
        let v = (0..cols)
            .flat_map(|c| (0..rows).map(move |r| src[r * cols + c]))
            .collect();
        (v, vec![cols, rows])
    }
    with_values(data, |s| t(s, rows, cols), |s| t(s, rows, cols))
}

/// Rows `start..start + count` of a row-major matrix with `cols` columns (a vector: `cols = 1`).
fn rows(data: &TensorData, start: usize, count: usize, cols: usize) -> TensorData {
    let shape = if data.shape().len() == 1 {
        vec![count]
    } else {
        vec![count, cols]
    };
    let (s1, s2) = (shape.clone(), shape);
    with_values(
        data,
        |s| (s[start * cols..(start + count) * cols].to_vec(), s1),
        |s| (s[start * cols..(start + count) * cols].to_vec(), s2),
    )
}

/// `[a; b]`: the rows of `a` then those of `b`.
fn concat_rows(a: &HostTensor, b: &HostTensor) -> HostTensor {
    let mut shape = a.shape.clone();
    shape[0] += b.shape[0];
    let (s1, s2) = (shape.clone(), shape.clone());
    let data = with_values(
        &a.data,
        |x| {
            (
                [x, b.data.as_slice::<f32>().expect("same dtype")].concat(),
                s1,
            )
        },
        |x| {
            (
                [x, b.data.as_slice::<f64>().expect("same dtype")].concat(),
                s2,
            )
        },
    );
    HostTensor { shape, data }
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
