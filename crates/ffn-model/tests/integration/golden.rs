//! Outputs and gradients against PyTorch: `tools/golden.py` wrote, for every activation ×
//! gating × bias pattern and inputs of rank 2, 3 and 4, the output of the reference network
//! and the gradients of `L = Σ y²` with respect to the input and every parameter. The weights
//! are loaded through `load_safetensors_bytes` from PyTorch layout, so the transposes are
//! checked too.
//!
//! Tolerances (error relative to the tensor's largest magnitude, see `scaled_error`):
//! f32 modules 1e-5; f64 modules 1e-12.
//!
//! Mixed precision (`precision = "bf16"`) has its own files, `golden_bf16_<activation>`, with
//! two references per input (see `tools/golden.py`):
//! - ffn's recipe emulated in f64 (operands rounded to bf16, everything else exact). A bf16
//!   module matches it within 1e-5, as an f32 module matches the f32 files: the inputs were
//!   drawn so that no rounded value lies near a rounding midpoint. The f32 module, which does
//!   not round, misses it by more (asserted per case): the test sees the rounding.
//! - PyTorch under `torch.autocast("cpu", dtype=torch.bfloat16)`, which also rounds each
//!   product's output, each activation and each gradient to bf16. With bf16's spacing
//!   `u = 2⁻⁸` (8-bit mantissa) and a rounding error of at most `u/2` each, the longest chain
//!   (`dW_up`: y, dy, dh, the activation's derivative, d(pre), the product) holds about eight
//!   roundings that ffn does not make, and a bias gradient's sum over rows cancels some of its
//!   terms: the tolerance is `8u = 2⁻⁵` of the tensor's scale (the largest seen: 2.4e-2).

use std::collections::BTreeMap;

use burn::module::Module;
use burn::tensor::{DType, Tensor, TensorData};
use ffn_model::{Activation, FeedForward, FeedForwardConfig, Memory, Precision};
use ffn_test_support::{Cast, data_file, device, read_f64, scaled_error};
use safetensors::SafeTensors;

const F32_TOLERANCE: f64 = 1e-5;
const F64_TOLERANCE: f64 = 1e-12;
/// bf16 against ffn's recipe emulated in f64: f32 arithmetic on the same rounded operands.
const RECIPE_TOLERANCE: f64 = 1e-5;
/// bf16 against PyTorch's autocast: eight bf16 spacings, `8 · 2⁻⁸` (see the module docs).
const AUTOCAST_TOLERANCE: f64 = 1.0 / 32.0;

/// gpt-oss's clamped SwiGLU against autocast: `16u = 2⁻⁴`. Its inputs are drawn six times
/// wider (so that pre-activations cross the clips at ±7), and autocast rounds
/// `ψ(u) = clamp(u, ±7) + 1` after the shift, where `u`'s own rounding (up to `2⁻⁶` at
/// `|u| ≥ 4`) is no longer small against a `ψ` near 0: two more roundings, and larger ones, on
/// the `up` path (the largest seen: 4.5e-2, in `dW_up`). Against the recipe it is held to
/// 1e-5 as every activation.
fn autocast_tolerance(activation: Activation) -> f64 {
    match activation {
        Activation::SwigluOai => 1.0 / 16.0,
        _ => AUTOCAST_TOLERANCE,
    }
}

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

/// The bytes of `tests/data/<name>.safetensors`.
fn golden_file(name: &str) -> Vec<u8> {
    std::fs::read(data_file(&format!("{name}.safetensors")))
        .expect("golden file (regenerate with tools/golden.py)")
}

/// Every case of a golden file: 4 ungated and 8 gated bias patterns.
fn cases(file: &SafeTensors<'_>) -> Vec<Case> {
    let mut names: Vec<String> = file
        .names()
        .into_iter()
        .filter_map(|k| k.strip_suffix("/up.weight").map(str::to_string))
        .filter(|k| !k.contains('/'))
        .collect();
    names.sort();
    let cases = names
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
        .collect::<Vec<_>>();
    assert_eq!(cases.len(), 12, "4 ungated + 8 gated bias patterns");
    cases
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

/// The transpose of a burn weight gradient (`[in, out]` to PyTorch's `[out, in]`).
fn to_pytorch_layout(data: TensorData) -> TensorData {
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

/// Runs one rank of one case: the output, the input's gradient and every parameter's gradient
/// of `L = Σ y²`, by PyTorch name (`y`, `dx`, `dup.weight`, ...; weights in PyTorch layout).
fn run_rank<const R: usize>(
    ffn: &FeedForward,
    file: &SafeTensors<'_>,
    case: &str,
    dtype: DType,
) -> BTreeMap<String, TensorData> {
    let device = device();
    let x = Tensor::<R>::from_data(read_f64(file, &format!("{case}/r{R}/x")), (&device, dtype))
        .require_grad();
    let y = ffn.forward(x.clone());
    let grads = (y.clone() * y.clone()).sum().backward();

    let mut out = BTreeMap::new();
    let dx = x.grad(&grads).expect("input gradient");
    out.insert("y".to_string(), y.into_data());
    out.insert("dx".to_string(), dx.into_data());

    // Gradient of every parameter, by PyTorch name ("up.weight", ...); a fused module's
    // `gate_up` gradient is split into the gate and up halves it holds.
    for (name, linear) in [
        ("up", ffn.up()),
        ("gate", ffn.gate()),
        ("down", Some(ffn.down())),
    ] {
        let Some(linear) = linear else { continue };
        let weight = linear.weight.val().grad(&grads).expect("weight gradient");
        out.insert(
            format!("d{name}.weight"),
            to_pytorch_layout(weight.into_data()),
        );
        if let Some(b) = &linear.bias {
            let bias = b.val().grad(&grads).expect("bias gradient");
            out.insert(format!("d{name}.bias"), bias.into_data());
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
            out.insert(format!("d{name}.weight"), to_pytorch_layout(w.into_data()));
            if let Some(b) = &bias {
                let b = b.clone().narrow(0, i * d_ff, d_ff);
                out.insert(format!("d{name}.bias"), b.into_data());
            }
        }
    }
    out
}

/// The largest error of each quantity of `run_rank` against the reference under `prefix`
/// (`<case>/r<rank>/` or `<case>/r<rank>/<reference>/`), which must hold the same parameters.
fn errors(
    outputs: &BTreeMap<String, TensorData>,
    file: &SafeTensors<'_>,
    prefix: &str,
) -> BTreeMap<String, f64> {
    let mut errors = BTreeMap::new();
    for (what, actual) in outputs {
        let key = match what.strip_prefix('d').filter(|p| p.contains('.')) {
            Some(param) => format!("{prefix}grad/{param}"),
            None => format!("{prefix}{what}"),
        };
        errors.insert(what.clone(), scaled_error(actual, &read_f64(file, &key)));
    }
    for p in PARAMS {
        assert_eq!(
            outputs.contains_key(&format!("d{p}")),
            file.tensor(&format!("{prefix}grad/{p}")).is_ok(),
            "{prefix}: parameter {p} in the module and in the golden file"
        );
    }
    errors
}

/// The three ranks of a case: every quantity's error against `reference` (`""` in the f32
/// files), keyed by rank.
fn case_errors(
    ffn: &FeedForward,
    file: &SafeTensors<'_>,
    case: &str,
    dtype: DType,
    references: &[&str],
) -> Vec<BTreeMap<String, f64>> {
    let ranks = [
        run_rank::<2>(ffn, file, case, dtype),
        run_rank::<3>(ffn, file, case, dtype),
        run_rank::<4>(ffn, file, case, dtype),
    ];
    references
        .iter()
        .map(|reference| {
            let mut all = BTreeMap::new();
            for (rank, outputs) in (2..).zip(&ranks) {
                for (what, error) in errors(outputs, file, &format!("{case}/r{rank}/{reference}")) {
                    all.insert(format!("r{rank} {what}"), error);
                }
            }
            all
        })
        .collect()
}

/// The configuration of a case of the golden files.
fn case_config(activation: Activation, case: &Case) -> FeedForwardConfig {
    let [bias_up, bias_gate, bias_down] = case.bias;
    FeedForwardConfig::new(5, 7)
        .with_activation(activation)
        .with_gated(case.gated)
        .with_bias_up(bias_up)
        .with_bias_gate(bias_gate)
        .with_bias_down(bias_down)
}

/// Gated networks with both or neither of the gate and up biases also run fused: they must
/// compute the same function from the same file.
fn fused_settings(case: &Case) -> &'static [bool] {
    if case.gated && case.bias[0] == case.bias[1] {
        &[false, true]
    } else {
        &[false]
    }
}

#[test]
fn outputs_and_gradients_match_pytorch() {
    let device = device();
    let mut report = Vec::new();
    let mut checked = 0;
    for activation in Activation::ALL {
        let bytes = golden_file(&format!("golden_{activation}"));
        let file = SafeTensors::deserialize(&bytes).unwrap();
        let cases = cases(&file);
        // Largest error per (ungated|gated, f32|f64).
        let mut worst: [[(f64, String); 2]; 2] = Default::default();
        for case in &cases {
            let config = case_config(activation, case);
            let weights = case_weights(&file, &case.name);
            for (slot, (dtype, tolerance)) in
                [(DType::F32, F32_TOLERANCE), (DType::F64, F64_TOLERANCE)]
                    .into_iter()
                    .enumerate()
            {
                let mut errors = BTreeMap::new();
                for &fused in fused_settings(case) {
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
                    let rank_errors = case_errors(&ffn, &file, &case.name, dtype, &[""]).remove(0);
                    for (what, error) in rank_errors {
                        errors.insert(format!("{what}{tag}"), error);
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

/// `precision = "bf16"` against ffn's recipe emulated in f64 and against PyTorch's autocast,
/// in both memory modes, fused and unfused; and the f32 module against the recipe, which it
/// must miss: the rounding is what the recipe checks.
#[test]
fn bf16_outputs_and_gradients_match_the_recipe_and_autocast() {
    let device = device();
    let mut report = Vec::new();
    let mut checked = 0;
    for activation in Activation::ALL {
        let bytes = golden_file(&format!("golden_bf16_{activation}"));
        let file = SafeTensors::deserialize(&bytes).unwrap();
        let cases = cases(&file);
        // Largest error per reference.
        let mut worst: [(f64, String); 2] = Default::default();
        for case in &cases {
            let config = case_config(activation, case);
            let weights = case_weights(&file, &case.name);
            let load = |config: FeedForwardConfig| {
                config
                    .init(&device)
                    .load_safetensors_bytes(&weights)
                    .unwrap()
            };
            for memory in [Memory::Save, Memory::Recompute] {
                for &fused in fused_settings(case) {
                    let ffn = load(
                        config
                            .clone()
                            .with_precision(Precision::Bf16)
                            .with_memory(memory)
                            .with_fused_gate_up(fused),
                    );
                    let references = ["recipe/", "autocast/"];
                    let per_reference =
                        case_errors(&ffn, &file, &case.name, DType::F32, &references);
                    for (slot, (errors, tolerance)) in per_reference
                        .into_iter()
                        .zip([RECIPE_TOLERANCE, autocast_tolerance(activation)])
                        .enumerate()
                    {
                        for (what, error) in errors {
                            checked += 1;
                            let what = format!("{} {what} {memory:?} fused {fused}", case.name);
                            assert!(
                                error <= tolerance,
                                "{activation} bf16 {what}: off by {error:e} from {} \
                                 (tolerance {tolerance:e})",
                                references[slot]
                            );
                            if error >= worst[slot].0 {
                                worst[slot] = (error, what);
                            }
                        }
                    }
                }
            }
            // The f32 module does not round: the recipe must tell it apart.
            let f32_ffn = load(config.clone());
            let errors = case_errors(&f32_ffn, &file, &case.name, DType::F32, &["recipe/"]);
            let y_error = errors[0]["r4 y"];
            assert!(
                y_error > 20.0 * RECIPE_TOLERANCE,
                "{activation} {}: the f32 module is within {y_error:e} of the bf16 recipe",
                case.name
            );
        }
        report.push(format!(
            "{:>10}: largest error vs recipe {:.1e} ({}), vs autocast {:.1e} ({})",
            activation.name(),
            worst[0].0,
            worst[0].1,
            worst[1].0,
            worst[1].1
        ));
    }
    println!("bf16 golden comparisons: {checked}\n{}", report.join("\n"));
}
