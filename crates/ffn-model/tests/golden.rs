//! Outputs and gradients against PyTorch: `tools/golden.py` wrote, for every activation ×
//! gating × bias pattern and inputs of rank 2, 3 and 4, the output of the reference network
//! and the gradients of `L = Σ y²` with respect to the input and every parameter. The weights
//! are loaded through `load_safetensors_bytes` from PyTorch layout, so the transposes are
//! checked too.
//!
//! Tolerances (error relative to the tensor's largest magnitude, see `scaled_error`):
//! f32 modules 1e-5; f64 modules 1e-12.

mod common;

use std::collections::{BTreeMap, HashMap};

use burn::module::Module;
use burn::tensor::{DType, Tensor, TensorData};
use common::{Cast, data_file, device, read_f64, scaled_error};
use ffn_model::{Activation, FeedForward, FeedForwardConfig};
use safetensors::SafeTensors;

const F32_TOLERANCE: f64 = 1e-5;
const F64_TOLERANCE: f64 = 1e-12;

const PARAMS: [&str; 6] = [
    "up.weight",
    "up.bias",
    "gate.weight",
    "gate.bias",
    "down.weight",
    "down.bias",
];

/// A case of the golden files: `<plain|gated>_b<up><gate><down>`.
struct Case {
    name: String,
    gated: bool,
    bias: [bool; 3],
}

fn cases(file: &SafeTensors<'_>) -> Vec<Case> {
    let mut names: Vec<String> = file
        .names()
        .into_iter()
        .filter_map(|k| k.strip_suffix("/up.weight").map(str::to_string))
        .filter(|k| !k.contains('/'))
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|name| {
            let (kind, bits) = name.split_once("_b").expect("case name");
            let bias = [0, 1, 2].map(|i| bits.as_bytes()[i] == b'1');
            Case {
                gated: kind == "gated",
                bias,
                name,
            }
        })
        .collect()
}

/// The case's weights as a safetensors file with the module's native names (PyTorch layout,
/// f64 values that are exact in f32).
fn case_weights(file: &SafeTensors<'_>, case: &str) -> Vec<u8> {
    let tensors: Vec<(String, TensorData)> = PARAMS
        .iter()
        .filter_map(|p| {
            let key = format!("{case}/{p}");
            file.tensor(&key)
                .ok()
                .map(|_| (p.to_string(), read_f64(file, &key)))
        })
        .collect();
    let views = tensors.iter().map(|(name, data)| {
        let view = safetensors::tensor::TensorView::new(
            safetensors::Dtype::F64,
            data.shape().to_vec(),
            data.as_bytes(),
        )
        .unwrap();
        (name.clone(), view)
    });
    safetensors::serialize(views, None).unwrap()
}

/// The transpose of a PyTorch weight (`[out, in]` to burn's `[in, out]`); biases unchanged.
fn to_burn_layout(data: TensorData) -> TensorData {
    match data.shape().to_vec()[..] {
        [rows, cols] => {
            let v: Vec<f64> = data.iter::<f64>().collect();
            let t: Vec<f64> = (0..cols)
                .flat_map(|c| {
                    v.iter()
                        .skip(c)
                        .step_by(cols)
                        .take(rows)
                        .copied()
                        .collect::<Vec<_>>()
                })
                .collect();
            TensorData::new(t, [cols, rows])
        }
        _ => data,
    }
}

/// Runs one rank of one case and returns the largest error per checked quantity.
fn check_rank<const R: usize>(
    ffn: &FeedForward,
    file: &SafeTensors<'_>,
    case: &str,
    dtype: DType,
) -> BTreeMap<String, f64> {
    let device = device();
    let key = |k: &str| format!("{case}/r{R}/{k}");
    let x = Tensor::<R>::from_data(read_f64(file, &key("x")), (&device, dtype)).require_grad();
    let y = ffn.forward(x.clone());
    let grads = (y.clone() * y.clone()).sum().backward();

    let mut errors = BTreeMap::new();
    errors.insert(
        "y".into(),
        scaled_error(&y.into_data(), &read_f64(file, &key("y"))),
    );
    let dx = x.grad(&grads).expect("input gradient");
    errors.insert(
        "dx".into(),
        scaled_error(&dx.into_data(), &read_f64(file, &key("dx"))),
    );

    // Gradient of every parameter, by PyTorch name ("up.weight", ...); a fused module's
    // `gate_up` gradient is split into the gate and up halves it holds.
    let mut param_grads: HashMap<String, TensorData> = HashMap::new();
    for (name, linear) in [
        ("up", ffn.up()),
        ("gate", ffn.gate()),
        ("down", Some(ffn.down())),
    ] {
        let Some(linear) = linear else { continue };
        let weight = linear.weight.val().grad(&grads).expect("weight gradient");
        param_grads.insert(format!("{name}.weight"), weight.into_data());
        if let Some(b) = &linear.bias {
            let bias = b.val().grad(&grads).expect("bias gradient");
            param_grads.insert(format!("{name}.bias"), bias.into_data());
        }
    }
    if let Some(gate_up) = ffn.gate_up() {
        let d_ff = ffn.d_ff();
        let weight = gate_up.weight.val().grad(&grads).expect("gate_up gradient");
        let bias = gate_up
            .bias
            .as_ref()
            .map(|b| b.val().grad(&grads).expect("bias"));
        for (i, name) in ["gate", "up"].into_iter().enumerate() {
            let w = weight.clone().narrow(1, i * d_ff, d_ff);
            param_grads.insert(format!("{name}.weight"), w.into_data());
            if let Some(b) = &bias {
                let b = b.clone().narrow(0, i * d_ff, d_ff);
                param_grads.insert(format!("{name}.bias"), b.into_data());
            }
        }
    }
    for p in PARAMS {
        let golden = format!("{case}/r{R}/grad/{p}");
        let grad = param_grads.remove(p);
        match (grad, file.tensor(&golden).is_ok()) {
            (Some(grad), true) => {
                let expected = to_burn_layout(read_f64(file, &golden));
                errors.insert(format!("d{p}"), scaled_error(&grad, &expected));
            }
            (None, false) => {}
            (grad, golden) => panic!(
                "{case}: parameter {p} present in module: {}, in golden file: {golden}",
                grad.is_some()
            ),
        }
    }
    errors
}

#[test]
fn outputs_and_gradients_match_pytorch() {
    let device = device();
    let mut report = Vec::new();
    let mut checked = 0;
    for activation in Activation::ALL {
        let bytes = std::fs::read(data_file(&format!("golden_{activation}.safetensors")))
            .expect("golden file (regenerate with tools/golden.py)");
        let file = SafeTensors::deserialize(&bytes).unwrap();
        let cases = cases(&file);
        assert_eq!(
            cases.len(),
            12,
            "{activation}: 4 ungated + 8 gated bias patterns"
        );
        // Largest error per (ungated|gated, f32|f64).
        let mut worst: [[(f64, String); 2]; 2] = Default::default();
        for case in &cases {
            let [bias_up, bias_gate, bias_down] = case.bias;
            let config = FeedForwardConfig::new(5, 7)
                .with_activation(activation)
                .with_gated(case.gated)
                .with_bias_up(bias_up)
                .with_bias_gate(bias_gate)
                .with_bias_down(bias_down);
            let weights = case_weights(&file, &case.name);
            for (slot, (dtype, tolerance)) in
                [(DType::F32, F32_TOLERANCE), (DType::F64, F64_TOLERANCE)]
                    .into_iter()
                    .enumerate()
            {
                // Gated networks with both or neither of the gate and up biases also run
                // fused: it must compute the same function from the same file.
                let fusable = case.gated && bias_up == bias_gate;
                let mut errors = BTreeMap::new();
                for fused in [false, true].into_iter().take(1 + usize::from(fusable)) {
                    let ffn = config
                        .clone()
                        .with_fused_gate_up(fused)
                        .init(&device)
                        .map(&mut Cast(dtype))
                        .load_safetensors_bytes(&weights)
                        .unwrap();
                    assert_eq!(ffn.down().weight.val().dtype(), dtype);
                    assert_eq!(ffn.is_fused(), fused);
                    let tag = if fused { " (fused)" } else { "" };
                    // Keyed by rank too: every rank's every tensor is asserted.
                    let ranks = [
                        check_rank::<2>(&ffn, &file, &case.name, dtype),
                        check_rank::<3>(&ffn, &file, &case.name, dtype),
                        check_rank::<4>(&ffn, &file, &case.name, dtype),
                    ];
                    for (rank, rank_errors) in (2..).zip(ranks) {
                        for (what, error) in rank_errors {
                            errors.insert(format!("r{rank} {what}{tag}"), error);
                        }
                    }
                }
                for (what, error) in errors {
                    checked += 1;
                    assert!(
                        error <= tolerance,
                        "{activation} {} {dtype:?}: {what} off by {error:e} (tolerance {tolerance:e})",
                        case.name
                    );
                    let worst = &mut worst[usize::from(case.gated)][slot];
                    if error >= worst.0 {
                        *worst = (error, format!("{} {what}", case.name));
                    }
                }
            }
        }
        for (gated, [f32_worst, f64_worst]) in worst.iter().enumerate() {
            report.push(format!(
                "{:>10} {:>7}: largest error f32 {:.1e} ({}), f64 {:.1e} ({})",
                activation.name(),
                ["ungated", "gated"][gated],
                f32_worst.0,
                f32_worst.1,
                f64_worst.0,
                f64_worst.1
            ));
        }
    }
    println!("golden comparisons: {checked}\n{}", report.join("\n"));
}
