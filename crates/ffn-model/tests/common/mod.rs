//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

use burn::module::{ModuleMapper, Param};
use burn::tensor::{DType, Device, Tensor, TensorData};
use safetensors::SafeTensors;

/// The CPU device the tests run on, with autodiff.
pub fn device() -> Device {
    Device::flex().autodiff()
}

/// A file of `tests/data`.
pub fn data_file(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
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

/// The same safetensors file without its header metadata.
pub fn strip_metadata(bytes: &[u8]) -> Vec<u8> {
    let file = SafeTensors::deserialize(bytes).unwrap();
    safetensors::serialize(file.tensors(), None).unwrap()
}

/// xorshift64*: a reproducible stream without a dependency (gradient checks, property tests).
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform().max(1e-300), self.uniform());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }

    /// An `f64` tensor of standard normals.
    pub fn data(&mut self, shape: &[usize]) -> TensorData {
        let n = shape.iter().product();
        TensorData::new(
            (0..n).map(|_| self.normal()).collect::<Vec<f64>>(),
            shape.to_vec(),
        )
    }
}
