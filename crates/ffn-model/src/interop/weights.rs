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
use std::path::Path;

use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::{Tensor, TensorData};

use crate::files::write_atomically;
use crate::interop::host::{HostTensor, concat_rows, rows, to_pytorch, transpose};
use crate::interop::safetensors::{TensorFile, TensorFiles, serialize};
use crate::interop::scheme::{Role, Slot};
use crate::{Activation, Error, FeedForward, Scheme};

const ACTIVATION_KEY: &str = "ffn.activation";

impl FeedForward {
    /// Loads weights from a safetensors file with this crate's names in PyTorch layout (see
    /// [Weight files](FeedForward#weight-files)), keeping this module's device and dtype.
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
            None => match Scheme::detect(files.keys(), prefix)?.0 {
                // The same keys as GPT-BigCode's `nn.Linear`: the shape tells (see
                // `c_fc_layout`), else GPT-2's `Conv1D`.
                Scheme::Gpt2 => files
                    .info(&format!("{prefix}c_fc.weight"))
                    .and_then(|info| {
                        crate::interop::scheme::c_fc_layout(&info.shape, self.d_model())
                    })
                    .unwrap_or(Scheme::Gpt2),
                scheme => scheme,
            },
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
        let mut out = Writer::default();
        for (role, linear) in self.roles() {
            let projection = Projection {
                weight: to_pytorch(linear.weight.val()),
                bias: linear.bias.as_ref().map(|b| to_pytorch(b.val())),
            };
            scheme
                .slot(role, self.is_gated())?
                .expect("the module has this projection")
                .write(prefix, projection, &mut out);
        }
        let metadata = [("format", "pt"), (ACTIVATION_KEY, self.activation().name())];
        Ok(serialize(&out.finish(prefix)?, &metadata))
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
        let mut reader = Reader {
            files,
            prefix,
            used: BTreeSet::new(),
        };
        // PyTorch-layout weight [out, in] and bias [out] of each role.
        let mut loaded: Vec<(Role, TensorData, Option<TensorData>)> = Vec::new();
        for (role, linear) in self.roles() {
            let [d_in, d_out] = linear.weight.lazy_shape().dims::<2>();
            let (weight, bias) = scheme
                .slot(role, gated)?
                .expect("the module has this projection")
                .read(role, [d_out, d_in], linear.bias.is_some(), &mut reader)?;
            loaded.push((role, weight, bias));
        }

        // Every key of the scheme under the prefix (without a prefix: every key of the file)
        // must have been used.
        let Reader { files, used, .. } = reader;
        let unexpected = files.keys().find(|key| {
            !used.contains(*key)
                && key.starts_with(prefix)
                && (prefix.is_empty() || scheme.owns(key, prefix))
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

/// One projection in PyTorch's layout: `weight` `[out, in]`, `bias` `[out]`.
struct Projection {
    weight: HostTensor,
    bias: Option<HostTensor>,
}

/// The tensors of a file being written: whole ones, and the halves of each packed pair (gate,
/// up) until both have come.
#[derive(Default)]
struct Writer {
    tensors: Vec<(String, HostTensor)>,
    halves: BTreeMap<&'static str, [Option<Projection>; 2]>,
}

impl Writer {
    /// `{prefix}{name}.weight` and, if present, `{prefix}{name}.bias`.
    fn put(&mut self, prefix: &str, name: &str, weight: HostTensor, bias: Option<HostTensor>) {
        self.tensors
            .push((format!("{prefix}{name}.weight"), weight));
        self.tensors
            .extend(bias.map(|b| (format!("{prefix}{name}.bias"), b)));
    }

    /// Every tensor, each packed pair joined: `[W_gate; W_up]`, `[b_gate; b_up]`.
    fn finish(mut self, prefix: &str) -> Result<Vec<(String, HostTensor)>, Error> {
        for (name, [gate, up]) in std::mem::take(&mut self.halves) {
            let (gate, up) = (gate.expect("gate"), up.expect("up"));
            let bias = match (gate.bias, up.bias) {
                (Some(g), Some(u)) => Some(concat_rows(&g, &u)),
                (None, None) => None,
                _ => {
                    return Err(Error::Scheme(format!(
                        "`{name}` packs gate and up: their biases must both be present or both absent"
                    )));
                }
            };
            self.put(prefix, name, concat_rows(&gate.weight, &up.weight), bias);
        }
        Ok(self.tensors)
    }
}

/// Reads the tensors under a prefix, checking each one's shape and noting the keys used.
struct Reader<'a> {
    files: &'a mut TensorFiles,
    prefix: &'a str,
    used: BTreeSet<String>,
}

impl Reader<'_> {
    /// `{prefix}{name}.{suffix}`, which must have `shape`.
    fn take(
        &mut self,
        role: Role,
        name: &str,
        suffix: &str,
        shape: &[usize],
    ) -> Result<TensorData, Error> {
        let key = format!("{}{name}.{suffix}", self.prefix);
        let info = self.files.info(&key).ok_or_else(|| Error::MissingTensor {
            hint: missing_hint(role, suffix),
            key: key.clone(),
        })?;
        if info.shape != shape {
            return Err(Error::Shape {
                key,
                expected: shape.to_vec(),
                actual: info.shape.clone(),
            });
        }
        let data = self.files.read_float(&key)?;
        self.used.insert(key);
        Ok(data)
    }
}

/// Each storage kind's one read and one write.
impl Slot {
    /// Reads projection `role`, `[d_out, d_in]`, with its bias if `bias`, in PyTorch's layout:
    /// a Linear as it is, a Conv1D transposed, a half of a packed pair cut from its rows.
    fn read(
        self,
        role: Role,
        [d_out, d_in]: [usize; 2],
        bias: bool,
        from: &mut Reader,
    ) -> Result<(TensorData, Option<TensorData>), Error> {
        // The stored weight's shape, and the rows of the stored bias that are this projection's.
        let (name, stored, bias_len, start) = match self {
            Slot::Linear(name) => (name, [d_out, d_in], d_out, 0),
            Slot::Conv1d(name) => (name, [d_in, d_out], d_out, 0),
            Slot::Half(name, half) => (name, [2 * d_out, d_in], 2 * d_out, half * d_out),
        };
        let weight = from.take(role, name, "weight", &stored)?;
        let weight = match self {
            Slot::Linear(_) => weight,
            Slot::Conv1d(_) => transpose(&weight, d_in, d_out),
            Slot::Half(..) => rows(&weight, start, d_out, d_in),
        };
        let bias = match bias {
            true => Some(from.take(role, name, "bias", &[bias_len])?),
            false => None,
        };
        let bias = bias.map(|b| match self {
            Slot::Half(..) => rows(&b, start, d_out, 1),
            _ => b,
        });
        Ok((weight, bias))
    }

    /// Writes `projection` (PyTorch's layout) the way this slot stores it; a half waits in
    /// `out` for the other half of its pair.
    fn write(self, prefix: &str, projection: Projection, out: &mut Writer) {
        let Projection { weight, bias } = projection;
        match self {
            Slot::Linear(name) => out.put(prefix, name, weight, bias),
            Slot::Conv1d(name) => {
                let [rows, cols] = [weight.shape[0], weight.shape[1]];
                let data = transpose(&weight.data, rows, cols);
                let weight = HostTensor {
                    shape: vec![cols, rows],
                    data,
                };
                out.put(prefix, name, weight, bias)
            }
            Slot::Half(name, half) => {
                out.halves.entry(name).or_default()[half] = Some(Projection { weight, bias })
            }
        }
    }
}

/// Replaces a parameter's value, keeping its id, device, dtype and gradient setting.
pub(crate) fn load_param<const D: usize>(
    param: &Param<Tensor<D>>,
    data: TensorData,
) -> Param<Tensor<D>> {
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
