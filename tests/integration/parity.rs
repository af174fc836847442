//! Backend parity: the same weights and input give the same outputs and gradients on every
//! backend compiled into this build (`flex`, `ndarray`, `wgpu`), through the FFN op (its own
//! backward) in both memory modes, fused and unfused, as an f64 computation of the same network
//! composed from burn's ops and differentiated by autodiff on Flex does.
//!
//! ```text
//! cargo test -p ffn --test integration parity                          # Flex only (the default build)
//! cargo test -p ffn --test integration parity --features ndarray,wgpu  # what CI runs (wgpu on Mesa lavapipe)
//! cargo test -p ffn --test integration parity --features cuda          # on an NVIDIA GPU (.ci/setup --cuda)
//! ```
//!
//! Tolerances, on the largest error relative to the tensor's scale: 1e-5 on the CPU backends
//! (f32 products of width ≤ 48 in another summation order; seen: 3.7e-7), 1e-4 on wgpu, whose
//! `exp`/`erf` are the GPU's own approximations (seen on Mesa lavapipe: 3.6e-7).
//!
//! This test found that burn's fused `gelu` op differentiates as the tanh approximation on
//! NdArray and wgpu (3e-4 off); `Activation::Gelu` is now written out from `erf`.

// ffn-model's test helpers (`Cast`: every float parameter to a dtype, keeping ids).
use std::collections::BTreeMap;

use burn::module::Module;
use burn::tensor::{DType, Device, Distribution, Tensor, TensorData};
use ffn::model::Memory;
use ffn::{FeedForward, FeedForwardConfig, Variant};
use ffn_test_support::Cast;

const D_MODEL: usize = 16;

/// `(name, device, tolerance)` for every compiled backend.
#[allow(deprecated)] // Device::ndarray: deprecated upstream, still a supported backend here.
fn backends() -> Vec<(&'static str, Device, f64)> {
    let backends: [Option<(&str, Device, f64)>; _] = [
        #[cfg(feature = "flex")]
        Some(("flex", Device::flex(), 1e-5)),
        #[cfg(feature = "ndarray")]
        Some(("ndarray", Device::ndarray(), 1e-5)),
        #[cfg(feature = "wgpu")]
        Some((
            "wgpu",
            ffn::wgpu().unwrap_or_else(|e| panic!("the wgpu feature is on but: {e}")),
            1e-4,
        )),
        // A build with `cuda` on a machine without an NVIDIA GPU (CI) skips it, saying so.
        #[cfg(feature = "cuda")]
        ffn::cuda()
            .map_err(|e| eprintln!("cuda skipped: {e}"))
            .ok()
            .map(|device| ("cuda", device, 1e-4)),
    ];
    backends.into_iter().flatten().collect()
}

/// `y`, `∂L/∂x` and `∂L/∂θ` for every parameter θ, with `L = Σ y²`, as f64 host data.
fn run(
    ffn: &FeedForward,
    x: TensorData,
    dtype: DType,
    device: &Device,
    composed: bool,
) -> BTreeMap<String, Vec<f64>> {
    let x = Tensor::<3>::from_data(x, (device, dtype)).require_grad();
    let y = if composed {
        ffn.forward_composed(x.clone())
    } else {
        ffn.forward(x.clone())
    };
    let grads = (y.clone() * y.clone()).sum().backward();
    let host = |t: TensorData| t.iter::<f64>().collect::<Vec<f64>>();
    let mut out = BTreeMap::new();
    out.insert("y".to_string(), host(y.into_data()));
    out.insert("dx".to_string(), host(x.grad(&grads).unwrap().into_data()));
    let projections = [
        ("gate", ffn.gate()),
        ("up", ffn.up()),
        ("gate_up", ffn.gate_up()),
        ("down", Some(ffn.down())),
    ];
    for (name, linear) in projections {
        let Some(linear) = linear else { continue };
        let dw = linear.weight.val().grad(&grads).unwrap();
        out.insert(format!("d{name}.weight"), host(dw.into_data()));
        if let Some(b) = &linear.bias {
            let db = b.val().grad(&grads).unwrap();
            out.insert(format!("d{name}.bias"), host(db.into_data()));
        }
    }
    out
}

/// Weights and an input `[2, 5, d_model]` for `config`, drawn once on `device`: the weights as a
/// safetensors file and the input as data, to be moved to every backend.
fn draw(config: &FeedForwardConfig, device: &Device) -> (Vec<u8>, TensorData) {
    let weights = config.init(device).to_safetensors_bytes();
    let x = Tensor::<3>::random([2, 5, D_MODEL], Distribution::Normal(0.0, 1.0), device);
    (weights, x.into_data())
}

/// The largest `|actual − reference|`, relative to the reference's largest magnitude (at
/// least 1).
fn relative_error(actual: &[f64], reference: &[f64]) -> f64 {
    let scale = reference.iter().fold(1.0f64, |m, v| m.max(v.abs()));
    actual
        .iter()
        .zip(reference)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max)
        / scale
}

#[test]
fn every_backend_computes_the_same_outputs_and_gradients() {
    let reference_device = Device::flex().autodiff();
    let configs = Variant::ALL
        .into_iter()
        .map(|v| {
            FeedForwardConfig::preset(v, D_MODEL)
                .with_bias_up(true)
                .with_bias_down(true)
        })
        .chain([
            FeedForwardConfig::preset(Variant::SwiGlu, D_MODEL)
                .with_fused_gate_up(true)
                .with_bias_up(true)
                .with_bias_gate(true),
            FeedForwardConfig::preset(Variant::GeGlu, D_MODEL).with_memory(Memory::Recompute),
            FeedForwardConfig::preset(Variant::FfnGelu, D_MODEL)
                .with_bias_down(true)
                .with_memory(Memory::Recompute),
            FeedForwardConfig::preset(Variant::SwiGlu, D_MODEL)
                .with_fused_gate_up(true)
                .with_memory(Memory::Recompute),
        ]);
    let backends = backends();
    assert!(!backends.is_empty());
    let mut worst: BTreeMap<&str, (f64, String)> = BTreeMap::new();
    for config in configs {
        let bias_gate = config.gated && config.bias_up;
        let config = config.with_bias_gate(bias_gate);
        let name = format!(
            "{}{}{}",
            config.activation,
            if config.gated { " gated" } else { "" },
            if config.fused_gate_up { " fused" } else { "" },
        ) + if config.memory == Memory::Recompute {
            " recompute"
        } else {
            ""
        };
        let (weights, x) = draw(&config, &reference_device);

        let oracle = config
            .init(&reference_device)
            .map(&mut Cast(DType::F64))
            .load_safetensors_bytes(&weights)
            .unwrap();
        let expected = run(&oracle, x.clone(), DType::F64, &reference_device, true);

        for (backend, device, tolerance) in &backends {
            let device = device.clone().autodiff();
            let ffn = config
                .init(&device)
                .load_safetensors_bytes(&weights)
                .unwrap();
            let actual = run(&ffn, x.clone(), DType::F32, &device, false);
            assert_eq!(
                actual.keys().collect::<Vec<_>>(),
                expected.keys().collect::<Vec<_>>()
            );
            for (what, values) in &actual {
                let reference = &expected[what];
                let error = relative_error(values, reference);
                assert!(
                    error <= *tolerance,
                    "{backend} {name}: {what} off by {error:e} (tolerance {tolerance:e})"
                );
                let entry = worst.entry(backend).or_default();
                if error >= entry.0 {
                    *entry = (error, format!("{name} {what}"));
                }
            }
        }
    }
    for (backend, (error, what)) in worst {
        println!("{backend:>8}: largest error vs f64 {error:.1e} ({what})");
    }
}

/// `precision = "bf16"` on every backend, against Flex's: Flex rounds the products' operands to
/// bf16 (on its bf16 kernel or the widening fallback); a GPU to bf16 or f16, whichever it
/// computes in (wgpu on Mesa lavapipe: f16, `shader-f16`); NdArray (no bf16 tensors) computes
/// in f32 (documented: `Precision::operands_on`). Either way within bf16's rounding of Flex's
/// (2⁻⁶ of each tensor's scale: see the op's own test), and never a panic. Where the operands
/// are narrower than f32 the run is visibly not the f32 run (more than 1e-5 apart); where they
/// are f32 it is the f32 run.
#[test]
fn every_backend_runs_bf16_configs() {
    use ffn::model::Precision;
    let reference_device = Device::flex().autodiff();
    for config in [
        FeedForwardConfig::preset(Variant::GeGlu, D_MODEL).with_bias_up(true),
        FeedForwardConfig::preset(Variant::FfnGelu, D_MODEL)
            .with_bias_down(true)
            .with_memory(Memory::Recompute),
    ] {
        let bias_gate = config.gated && config.bias_up;
        let config = config.with_bias_gate(bias_gate);
        let (weights, x) = draw(&config, &reference_device);
        let on = |device: &Device, precision: Precision| {
            let device = device.clone().autodiff();
            let ffn = config
                .clone()
                .with_precision(precision)
                .init(&device)
                .load_safetensors_bytes(&weights)
                .unwrap();
            run(&ffn, x.clone(), DType::F32, &device, false)
        };
        let expected = on(&Device::flex(), Precision::Bf16);
        for (backend, device, _) in backends() {
            let (bf16, f32) = (on(&device, Precision::Bf16), on(&device, Precision::F32));
            let narrow = Precision::Bf16.operands_on(&device) != DType::F32;
            for (what, values) in &bf16 {
                let error = relative_error(values, &expected[what]);
                assert!(
                    error <= 2f64.powi(-6),
                    "{backend} {}: {what} off by {error:e}",
                    config.activation
                );
                let from_f32 = relative_error(values, &f32[what]);
                assert!(
                    if narrow {
                        from_f32 > 1e-5
                    } else {
                        from_f32 == 0.0
                    },
                    "{backend} {}: {what} {from_f32:e} from the f32 run (operands {:?})",
                    config.activation,
                    Precision::Bf16.operands_on(&device)
                );
            }
        }
    }
}

/// The mixture-of-experts layer (its grouped expert op) on every backend, against the f64
/// composed layer on Flex: output, input gradient and the gradients of the router and the
/// stacked experts, for Mixtral-, Qwen2- and DeepSeek-style layers.
#[test]
fn every_backend_computes_the_same_moe() {
    use ffn::model::{MoeConfig, Scoring};
    let reference_device = Device::flex().autodiff();
    let swiglu = FeedForwardConfig::preset(Variant::SwiGlu, D_MODEL);
    let configs = [
        MoeConfig::new(swiglu.clone(), 4, 2),
        MoeConfig::new(swiglu.clone().with_bias_up(true).with_bias_gate(true), 6, 3)
            .with_normalize_top_k(false)
            .with_shared_experts(1, Some(24), true),
        MoeConfig::new(swiglu.with_memory(Memory::Recompute), 8, 2)
            .with_scoring(Scoring::Sigmoid)
            .with_groups(4, 2)
            .with_routed_scaling(2.5)
            .with_shared_experts(1, None, false),
        MoeConfig::new(FeedForwardConfig::preset(Variant::FfnGelu, D_MODEL), 3, 1),
    ];
    for (i, config) in configs.iter().enumerate() {
        let (moe, x) = moe_and_input(config, 40 + i as u64, &reference_device);
        let oracle = moe.clone().map(&mut Cast(DType::F64));
        let expected = moe_run(&oracle, x.clone(), DType::F64, &reference_device, true);
        for (backend, device, tolerance) in &backends() {
            let moved = moe.clone().map(&mut Move(device.clone()));
            let device = device.clone().autodiff();
            let actual = moe_run(&moved, x.clone(), DType::F32, &device, false);
            assert_eq!(actual.len(), expected.len());
            for ((what, a), (_, b)) in actual.iter().zip(&expected) {
                let error = relative_error(a, b);
                assert!(
                    error <= *tolerance,
                    "{backend} MoE config {i}: {what} off by {error:e} (tolerance {tolerance:e})"
                );
            }
        }
    }
}

/// A mixture of experts from `config` and an input `[3, 7, d_model]`, drawn on `device` from
/// `seed`.
fn moe_and_input(config: &ffn::MoeConfig, seed: u64, device: &Device) -> (ffn::Moe, TensorData) {
    device.seed(seed);
    let moe = config.init(device);
    let x = Tensor::<3>::random([3, 7, D_MODEL], Distribution::Normal(0.0, 1.0), device);
    (moe, x.into_data())
}

/// The output of `moe` on `x` (as `dtype`, on the autodiff `device`; the composed layer or the
/// grouped op) and the gradients of `L = Σ y²` with respect to `x`, the router and the experts.
fn moe_run(
    moe: &ffn::Moe,
    x: TensorData,
    dtype: DType,
    device: &Device,
    composed: bool,
) -> Vec<(&'static str, Vec<f64>)> {
    let x = Tensor::<3>::from_data(x, (device, dtype)).require_grad();
    let out = if composed {
        moe.forward_composed(x.clone())
    } else {
        moe.forward(x.clone())
    };
    let y = out.output;
    let grads = (y.clone() * y.clone()).sum().backward();
    let host = |t: TensorData| t.iter::<f64>().collect::<Vec<f64>>();
    let mut all = vec![
        ("y", host(y.into_data())),
        ("dx", host(x.grad(&grads).unwrap().into_data())),
        (
            "drouter",
            host(moe.router().weight.val().grad(&grads).unwrap().into_data()),
        ),
        (
            "dw_up",
            host(moe.w_up().val().grad(&grads).unwrap().into_data()),
        ),
        (
            "dw_down",
            host(moe.w_down().val().grad(&grads).unwrap().into_data()),
        ),
    ];
    if let Some(w) = moe.w_gate() {
        all.push(("dw_gate", host(w.val().grad(&grads).unwrap().into_data())));
    }
    all
}

/// A bf16 mixture of experts on every backend (the grouped op's products in the type
/// `Precision::operands_on` gives: bf16 on Flex, f16 on lavapipe, f32 on NdArray), against
/// Flex's: within bf16's rounding (2⁻⁶ of each tensor's scale), every gradient included.
#[test]
fn every_backend_runs_a_bf16_moe() {
    use ffn::model::{MoeConfig, Precision};
    let reference_device = Device::flex().autodiff();
    let expert =
        FeedForwardConfig::preset(Variant::SwiGlu, D_MODEL).with_precision(Precision::Bf16);
    let config = MoeConfig::new(expert, 4, 2);
    let (moe, x) = moe_and_input(&config, 7, &reference_device);
    let run = |device: &Device| {
        let moved = moe.clone().map(&mut Move(device.clone()));
        moe_run(
            &moved,
            x.clone(),
            DType::F32,
            &device.clone().autodiff(),
            false,
        )
    };
    let expected = run(&Device::flex());
    for (backend, device, _) in backends() {
        for ((what, a), (_, b)) in run(&device).iter().zip(&expected) {
            let error = relative_error(a, b);
            assert!(
                error <= 2f64.powi(-6),
                "{backend} bf16 MoE: {what} off by {error:e}"
            );
        }
    }
}

/// Moves every float parameter to a device (with autodiff), keeping ids.
struct Move(Device);

impl burn::module::ModuleMapper for Move {
    fn map_float<const D: usize>(
        &mut self,
        param: burn::module::Param<Tensor<D>>,
    ) -> burn::module::Param<Tensor<D>> {
        let id = param.id;
        let t = param
            .val()
            .inner()
            .to_device(&self.0)
            .autodiff()
            .require_grad();
        burn::module::Param::initialized(id, t)
    }
}
