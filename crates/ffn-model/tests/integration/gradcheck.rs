//! Finite-difference gradient checks, in f64, for every activation, gated and ungated, with
//! every bias on.
//!
//! For the loss `L = Σ y²` and each tensor `T` (the input and every parameter) the autodiff
//! directional derivative `⟨∂L/∂T, V⟩` along a random direction `V` is compared with the
//! central difference `(L(T + εV) − L(T − εV)) / 2ε`, whose error is `O(ε²)` plus rounding
//! `O(u·L/ε)`. With ε = 1e-6 both are far below the tolerance of 1e-6 (relative), while a wrong
//! derivative (a missing factor, a dropped term) is off by order one.

use burn::module::Module;
use burn::tensor::{DType, Tensor, TensorData};
use ffn_model::{Activation, FeedForward, FeedForwardConfig, Memory};
use ffn_test_support::{Cast, Perturb, Rng, device, strip_metadata};

const EPS: f64 = 1e-6;
const TOLERANCE: f64 = 1e-6;

fn loss(ffn: &FeedForward, x: Tensor<3>) -> Tensor<1> {
    let y = ffn.forward(x);
    (y.clone() * y).sum()
}

fn scalar(t: Tensor<1>) -> f64 {
    t.into_data().iter::<f64>().next().unwrap()
}

fn dot(a: &TensorData, b: &TensorData) -> f64 {
    a.iter::<f64>()
        .zip(b.iter::<f64>())
        .map(|(x, y)| x * y)
        .sum()
}

fn scaled(data: &TensorData, factor: f64) -> TensorData {
    TensorData::new(
        data.iter::<f64>().map(|v| v * factor).collect::<Vec<_>>(),
        data.shape().clone(),
    )
}

/// Returns the largest relative error over the input and every parameter.
fn check(config: &FeedForwardConfig, rng: &mut Rng) -> f64 {
    let device = device();
    // The weights come from the device's stream: seeded, so that a run is reproducible.
    device.seed(rng.next_u64());
    let ffn = config.init(&device).map(&mut Cast(DType::F64));
    let x_data = rng.data(&[2, 3, config.d_model]);
    let x = Tensor::<3>::from_data(x_data.clone(), (&device, DType::F64)).require_grad();
    let grads = loss(&ffn, x.clone()).backward();

    // (name, analytic gradient) for the input and every parameter.
    let mut tensors = vec![("x".to_string(), x.grad(&grads).unwrap().into_data())];
    let projections = [
        ("up", ffn.up()),
        ("gate", ffn.gate()),
        ("gate_up", ffn.gate_up()),
        ("down", Some(ffn.down())),
    ];
    for (name, linear) in projections {
        let Some(linear) = linear else { continue };
        let grad = linear.weight.val().grad(&grads).unwrap().into_data();
        tensors.push((format!("{name}.weight"), grad));
        if let Some(bias) = &linear.bias {
            tensors.push((
                format!("{name}.bias"),
                bias.val().grad(&grads).unwrap().into_data(),
            ));
        }
    }
    // x, up.{w,b}, gate.{w,b} (or gate_up.{w,b}), down.{w,b}
    let expected = 5 + usize::from(config.gated && !config.fused_gate_up) * 2;
    assert_eq!(tensors.len(), expected, "every parameter has a gradient");

    let mut worst = 0.0f64;
    for (name, grad) in tensors {
        let mut checked = 0;
        let mut redrawn = 0;
        while checked < 2 {
            let direction = rng.data(&grad.shape().to_vec());
            let analytic = dot(&grad, &direction);
            // The loss, and the activated pre-activations, at the point moved by ±ε along
            // `direction`.
            let at = |sign: f64| {
                let delta = scaled(&direction, sign * EPS);
                let x = Tensor::<3>::from_data(x_data.clone(), (&device, DType::F64));
                let (ffn, x) = if name == "x" {
                    (
                        ffn.clone(),
                        x + Tensor::<3>::from_data(delta, (&device, DType::F64)),
                    )
                } else {
                    let mut perturb = Perturb {
                        path: Vec::new(),
                        target: name.clone(),
                        delta,
                    };
                    (ffn.clone().map(&mut perturb), x)
                };
                (scalar(loss(&ffn, x.clone())), activated(&ffn, x))
            };
            let ((plus, a_plus), (minus, a_minus)) = (at(1.0), at(-1.0));
            // ReLU has a kink at 0: across it a central difference is no derivative, so a
            // direction that moves a pre-activation of `φ` across 0 is drawn again.
            let kinked = matches!(config.activation, Activation::Relu);
            if kinked
                && a_plus
                    .iter()
                    .zip(&a_minus)
                    .any(|(p, m)| (p > &0.0) != (m > &0.0))
            {
                redrawn += 1;
                assert!(redrawn < 20, "{name}: every direction crosses a kink");
                continue;
            }
            checked += 1;
            let numeric = (plus - minus) / (2.0 * EPS);
            let error = (analytic - numeric).abs() / analytic.abs().max(numeric.abs()).max(1.0);
            assert!(
                error < TOLERANCE,
                "{} gated={} {name}: autodiff {analytic} vs finite difference {numeric} \
                 (relative error {error:e})",
                config.activation,
                config.gated
            );
            worst = worst.max(error);
        }
    }
    worst
}

/// The pre-activations `φ` is applied to: `x W_up + b_up` ungated, `x W_gate + b_gate` gated
/// (the first half of `[g | u]` when fused).
fn activated(ffn: &FeedForward, x: Tensor<3>) -> Vec<f64> {
    let pre = match (ffn.gate_up(), ffn.gate(), ffn.up()) {
        (Some(gate_up), _, _) => gate_up.forward(x).narrow(2, 0, ffn.d_ff()),
        (None, Some(gate), _) => gate.forward(x),
        (None, None, Some(up)) => up.forward(x),
        (None, None, None) => unreachable!("a network has `up` or `gate_up`"),
    };
    pre.into_data().iter::<f64>().collect()
}

/// Through the FFN op (its own backward) on Flex, in both memory modes, unfused and fused.
#[test]
fn gradients_match_finite_differences() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for activation in Activation::ALL {
        for (gated, fused) in [(false, false), (true, false), (true, true)] {
            for memory in [Memory::Save, Memory::Recompute] {
                let config = FeedForwardConfig::new(6, 10)
                    .with_activation(activation)
                    .with_gated(gated)
                    .with_fused_gate_up(fused)
                    .with_memory(memory)
                    .with_bias_up(true)
                    .with_bias_gate(gated)
                    .with_bias_down(true)
                    // Pre-activations of order one reach the nonlinear parts of every φ.
                    .with_initializer(burn::nn::Initializer::Normal {
                        mean: 0.0,
                        std: 0.6,
                    });
                let worst = check(&config, &mut rng);
                println!(
                    "{activation:>10} gated={gated:<5} fused={fused:<5} {memory:?}: \
                     largest relative error {worst:.1e}"
                );
            }
        }
    }
}

/// The check is sharp: the gradient of one network does not pass as the derivative of
/// another that differs only in its activation.
#[test]
fn a_wrong_gradient_is_caught() {
    let device = device();
    // Seeded weights: with unseeded ones, one process in ~100 drew a network whose ReLU and
    // SiLU gradients differ by only 3e-4 along the direction.
    device.seed(7);
    let mut rng = Rng(7);
    let weights = FeedForwardConfig::new(4, 8)
        .init(&device)
        .to_safetensors_bytes();
    // Without the `ffn.activation` metadata, loading keeps each module's own activation.
    let weights = strip_metadata(&weights);
    let network = |activation| {
        FeedForwardConfig::new(4, 8)
            .with_activation(activation)
            .init(&device)
            .map(&mut Cast(DType::F64))
            .load_safetensors_bytes(&weights)
            .unwrap()
    };
    let (relu, silu) = (network(Activation::Relu), network(Activation::Silu));
    let x_data = rng.data(&[1, 2, 4]);
    let x = Tensor::<3>::from_data(x_data.clone(), (&device, DType::F64)).require_grad();
    let grads = loss(&relu, x.clone()).backward();
    let direction = rng.data(&[1, 2, 4]);
    let analytic = dot(&x.grad(&grads).unwrap().into_data(), &direction);

    let at = |sign: f64| {
        let shifted = Tensor::<3>::from_data(x_data.clone(), (&device, DType::F64))
            + Tensor::<3>::from_data(scaled(&direction, sign * EPS), (&device, DType::F64));
        scalar(loss(&silu, shifted))
    };
    let numeric = (at(1.0) - at(-1.0)) / (2.0 * EPS);
    let error = (analytic - numeric).abs() / analytic.abs().max(numeric.abs()).max(1.0);
    println!("ReLU's gradient against SiLU's finite difference: relative error {error:.1e}");
    assert!(error > 1e3 * TOLERANCE, "mismatch not detected: {error:e}");
}
