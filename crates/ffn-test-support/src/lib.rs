//! What the integration tests of every crate in the workspace share: the oracle's files (golden
//! outputs and gradients written by PyTorch, tiny checkpoints written by `transformers`, in
//! `data/`), comparisons against them, module mappers for casts and finite differences, a seeded
//! random stream with property tests, and scratch folders.
//!
//! A `publish = false` crate: no test includes another crate's files by path.

use std::path::PathBuf;

use burn::module::{ModuleMapper, Param};
use burn::tensor::{DType, Device, Tensor, TensorData};
use safetensors::SafeTensors;

mod process;
mod random;
mod scratch;

pub use process::alone;
pub use random::{Rng, property};
pub use scratch::{Scratch, scratch};

/// The CPU device the tests run on, with autodiff.
pub fn device() -> Device {
    Device::flex().autodiff()
}

/// A file of the oracle's folder, `crates/ffn-test-support/data`: `golden_*.safetensors` from
/// `tools/golden.py` and `tools/golden_train_ops.py`, and `hf/<model>/` from
/// `tools/hf_fixtures.py` and `tools/moe_fixtures.py`.
pub fn data_file(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("data")
        .join(name)
}

/// A tensor of a safetensors file as f64 data.
pub fn read_f64(file: &SafeTensors<'_>, key: &str) -> TensorData {
    let view = file
        .tensor(key)
        .unwrap_or_else(|e| panic!("golden key {key}: {e}"));
    assert_eq!(view.dtype(), safetensors::Dtype::F64, "{key}");
    let values: Vec<f64> = view
        .data()
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    TensorData::new(values, view.shape().to_vec())
}

/// The largest `|a - b|`, divided by `max(1, max |b|)`: an error relative to the tensor's
/// scale, which stays meaningful for entries near zero.
pub fn scaled_error(actual: &TensorData, expected: &TensorData) -> f64 {
    assert_eq!(actual.shape(), expected.shape());
    let a: Vec<f64> = actual.iter::<f64>().collect();
    let b: Vec<f64> = expected.iter::<f64>().collect();
    let scale = b.iter().fold(1.0f64, |m, v| m.max(v.abs()));
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
        / scale
}

/// Casts every float parameter of a module to `dtype`.
pub struct Cast(pub DType);

impl ModuleMapper for Cast {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let dtype = self.0;
        let id = param.id;
        let tensor = param.val().inner().cast(dtype).autodiff().require_grad();
        Param::initialized(id, tensor)
    }
}

/// Adds `delta` (f64, any shape with the parameter's number of values) to the parameter at
/// `target`, a record path such as `gate.weight` or `router.weight`: finite differences.
pub struct Perturb {
    /// The path of the module being visited (start empty).
    pub path: Vec<String>,
    /// The record path of the parameter to change.
    pub target: String,
    /// What to add to it.
    pub delta: TensorData,
}

impl ModuleMapper for Perturb {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if self.path.join(".") != self.target {
            return param;
        }
        let values: Vec<f64> = self.delta.iter::<f64>().collect();
        param.map(|t| {
            let delta = TensorData::new(values, t.dims().to_vec());
            let delta = Tensor::from_data(delta, (&t.device(), DType::F64));
            t + delta
        })
    }
}

/// Replaces every float parameter with seeded normals of standard deviation `scale /
/// √(its last dimension)`: parameters that do not depend on burn's process-wide RNG (which the
/// tests of one binary share, in whatever order they run).
pub struct Redraw {
    /// The stream the values come from.
    pub rng: Rng,
    /// The standard deviation at a last dimension of 1.
    pub scale: f64,
}

impl ModuleMapper for Redraw {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let rng = &mut self.rng;
        let scale = self.scale;
        param.map(|t| {
            let dims = t.dims();
            let std = scale / (dims[D - 1].max(1) as f64).sqrt();
            let values: Vec<f64> = rng.data(&dims).iter::<f64>().map(|v| v * std).collect();
            let data = TensorData::new(values, dims.to_vec());
            Tensor::from_data(data, (&t.device(), t.dtype()))
        })
    }
}

/// The same safetensors file without its header metadata.
pub fn strip_metadata(bytes: &[u8]) -> Vec<u8> {
    let file = SafeTensors::deserialize(bytes).unwrap();
    safetensors::serialize(file.tensors(), None).unwrap()
}

impl Rng {
    /// An `f64` tensor of standard normals.
    pub fn data(&mut self, shape: &[usize]) -> TensorData {
        let n = shape.iter().product();
        TensorData::new(
            (0..n).map(|_| self.normal()).collect::<Vec<f64>>(),
            shape.to_vec(),
        )
    }
}
