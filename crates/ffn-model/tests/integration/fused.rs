//! The fused `[W_gate | W_up]` projection: the same function, parameters and files as the
//! unfused network, with its own errors.

use burn::module::Module;
use burn::tensor::{Distribution, Tensor, TensorData};
use ffn_model::{ConfigError, FeedForward, FeedForwardConfig, Scheme, Variant};
use ffn_test_support::{device, scaled_error};

const TOLERANCE: f64 = 1e-5;

fn gated_configs() -> impl Iterator<Item = FeedForwardConfig> {
    Variant::ALL
        .into_iter()
        .filter(|v| v.gated())
        .flat_map(|v| {
            [false, true].map(|bias| {
                FeedForwardConfig::preset(v, 12)
                    .with_bias_up(bias)
                    .with_bias_gate(bias)
                    .with_bias_down(bias)
            })
        })
}

/// A network drawn from `config`, its safetensors file, and that file loaded into the fused form.
fn unfused_and_fused(
    config: &FeedForwardConfig,
    device: &burn::tensor::Device,
) -> (FeedForward, Vec<u8>, FeedForward) {
    let unfused = config.init(device);
    let bytes = unfused.to_safetensors_bytes();
    let fused = config
        .clone()
        .with_fused_gate_up(true)
        .init(device)
        .load_safetensors_bytes(&bytes)
        .unwrap();
    (unfused, bytes, fused)
}

#[test]
fn fused_computes_the_unfused_function_and_gradients() {
    let device = device();
    for config in gated_configs() {
        let (unfused, _, fused) = unfused_and_fused(&config, &device);
        assert!(fused.is_fused() && fused.is_gated());
        assert!(fused.up().is_none() && fused.gate().is_none());
        assert_eq!(
            fused.gate_up().unwrap().weight.dims(),
            [12, 2 * config.d_ff]
        );
        assert_eq!(fused.num_params(), unfused.num_params());
        assert_eq!(fused.num_params(), config.num_params());
        assert!(fused.config().fused_gate_up);

        let x = Tensor::<3>::random([2, 3, 12], Distribution::Normal(0.0, 1.0), &device);
        let run = |ffn: &FeedForward| {
            let x = x.clone().require_grad();
            let y = ffn.forward(x.clone());
            let grads = (y.clone() * y.clone()).sum().backward();
            (y, x.grad(&grads).unwrap(), grads)
        };
        let (y0, dx0, g0) = run(&unfused);
        let (y1, dx1, g1) = run(&fused);
        let what = format!("{} bias={}", config.activation, config.bias_up);
        let close = |a: TensorData, b: TensorData, name: &str| {
            let e = scaled_error(&a, &b);
            assert!(e <= TOLERANCE, "{what}: {name} off by {e:e}");
        };
        close(y1.into_data(), y0.into_data(), "y");
        close(dx1.into_data(), dx0.into_data(), "dx");

        // ∂L/∂[W_gate | W_up] = [∂L/∂W_gate | ∂L/∂W_up], and likewise for the biases.
        let d_ff = config.d_ff;
        let gate_up = fused.gate_up().unwrap();
        let dw = gate_up.weight.val().grad(&g1).unwrap();
        for (i, half) in [unfused.gate().unwrap(), unfused.up().unwrap()]
            .into_iter()
            .enumerate()
        {
            let expected = half.weight.val().grad(&g0).unwrap().into_data();
            close(
                dw.clone().narrow(1, i * d_ff, d_ff).into_data(),
                expected,
                "dW",
            );
            if let (Some(b), Some(fb)) = (&half.bias, &gate_up.bias) {
                let expected = b.val().grad(&g0).unwrap().into_data();
                let actual = fb.val().grad(&g1).unwrap().narrow(0, i * d_ff, d_ff);
                close(actual.into_data(), expected, "db");
            }
        }
        let expected = unfused.down().weight.val().grad(&g0).unwrap().into_data();
        let actual = fused.down().weight.val().grad(&g1).unwrap().into_data();
        close(actual, expected, "dW_down");
    }
}

#[test]
fn fused_files_keep_the_separate_names() {
    let device = device();
    for config in gated_configs() {
        let (unfused, bytes, fused) = unfused_and_fused(&config, &device);
        // Byte for byte the file of the unfused network: `gate.weight`, `up.weight`, …
        assert_eq!(fused.to_safetensors_bytes(), bytes);
        // Loading keeps the fused parameters' ids (an optimizer's state stays attached).
        let template = config.clone().with_fused_gate_up(true).init(&device);
        let ids = |f: &FeedForward| {
            let l = f.gate_up().unwrap();
            (l.weight.id, l.bias.as_ref().map(|b| b.id))
        };
        let before = ids(&template);
        let loaded = template.load_safetensors_bytes(&bytes).unwrap();
        assert_eq!(ids(&loaded), before);
        for scheme in [Scheme::Llama, Scheme::GateUpProj, Scheme::W12] {
            assert_eq!(
                fused.to_safetensors_bytes_as(scheme, "mlp.").unwrap(),
                unfused.to_safetensors_bytes_as(scheme, "mlp.").unwrap(),
                "{scheme:?}"
            );
        }
        // An unfused network reads a fused network's file, and back.
        let again = config
            .init(&device)
            .load_safetensors_bytes(&fused.to_safetensors_bytes())
            .unwrap();
        assert_eq!(again.to_safetensors_bytes(), bytes);
    }
}

#[test]
fn fused_modules_round_trip_through_burn_records() {
    let device = device();
    let config = FeedForwardConfig::preset(Variant::SwiGlu, 12).with_fused_gate_up(true);
    let ffn = config.init(&device);
    let dir = ffn_test_support::scratch("fused");
    let path = dir.join("model");
    ffn.clone().save_file(&path).unwrap();
    let loaded = config.init(&device).load_file(&path);
    assert!(loaded.is_fused());
    assert_eq!(loaded.to_safetensors_bytes(), ffn.to_safetensors_bytes());
}

#[test]
fn fusing_needs_a_gate_and_matching_biases() {
    let ungated = FeedForwardConfig::preset(Variant::FfnRelu, 8).with_fused_gate_up(true);
    assert_eq!(ungated.validate(), Err(ConfigError::FusedWithoutGating));
    let mismatched = FeedForwardConfig::preset(Variant::SwiGlu, 8)
        .with_fused_gate_up(true)
        .with_bias_up(true);
    assert_eq!(mismatched.validate(), Err(ConfigError::FusedBiasMismatch));
    let err = FeedForwardConfig::from_toml(
        "d_model = 8\nd_ff = 16\nactivation = \"silu\"\nfused_gate_up = true\n",
    )
    .unwrap_err();
    assert_eq!(err.to_string(), ConfigError::FusedWithoutGating.to_string());
    let config = FeedForwardConfig::from_toml(
        "d_model = 8\nd_ff = 16\nactivation = \"silu\"\ngated = true\nfused_gate_up = true\n",
    )
    .unwrap();
    assert!(config.fused_gate_up);
    assert_eq!(
        FeedForwardConfig::from_toml(&config.to_toml()).unwrap(),
        config
    );
}
