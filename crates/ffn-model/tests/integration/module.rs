//! The module's behaviour: any input rank, shape errors, dropout, counts and display.

use burn::module::Module;
use burn::tensor::{Device, Distribution, Tensor};
use ffn_model::{Activation, DropoutAt, FeedForwardConfig, Variant};
use ffn_test_support::device;

#[test]
fn acts_on_the_last_dimension_of_any_rank() {
    let device = device();
    for variant in Variant::ALL {
        let ffn = FeedForwardConfig::preset(variant, 8)
            .with_bias_down(true)
            .init(&device);
        let x3 = Tensor::<3>::random([2, 3, 8], Distribution::Normal(0.0, 1.0), &device);
        let y3 = ffn.forward(x3.clone());
        assert_eq!(y3.dims(), [2, 3, 8]);

        // Every rank gives the same numbers as the flattened [tokens, d_model] input.
        let y2 = ffn.forward(x3.clone().reshape([6, 8]));
        let y4 = ffn.forward(x3.clone().reshape([1, 2, 3, 8]));
        let y5 = ffn.forward(x3.clone().reshape([1, 2, 1, 3, 8]));
        let y1: Vec<Tensor<1>> = (0..6)
            .map(|i| {
                ffn.forward(
                    x3.clone()
                        .reshape([6, 8])
                        .slice([i..i + 1, 0..8])
                        .reshape([8]),
                )
            })
            .collect();
        let flat = y3.reshape([6, 8]);
        flat.clone()
            .into_data()
            .assert_approx_eq::<f32>(&y2.into_data(), Default::default());
        flat.clone()
            .into_data()
            .assert_approx_eq::<f32>(&y4.reshape([6, 8]).into_data(), Default::default());
        flat.clone()
            .into_data()
            .assert_approx_eq::<f32>(&y5.reshape([6, 8]).into_data(), Default::default());
        flat.into_data()
            .assert_approx_eq::<f32>(&Tensor::stack::<2>(y1, 0).into_data(), Default::default());
    }
}

#[test]
#[should_panic(
    expected = "FeedForward: the input's last dimension must be d_model = 8, got shape [2, 3, 7]"
)]
fn a_wrong_width_panics_naming_both_sizes() {
    let device = Device::flex();
    let ffn = FeedForwardConfig::new(8, 16).init(&device);
    ffn.forward(Tensor::<3>::zeros([2, 3, 7], &device));
}

#[test]
fn parameter_counts_and_flops_agree_with_the_config() {
    let device = Device::flex();
    for activation in Activation::ALL {
        for gated in [false, true] {
            for bits in 0..8u8 {
                let config = FeedForwardConfig::new(6, 10)
                    .with_activation(activation)
                    .with_gated(gated)
                    .with_bias_up(bits & 1 != 0)
                    .with_bias_gate(gated && bits & 2 != 0)
                    .with_bias_down(bits & 4 != 0);
                let ffn = config.init(&device);
                assert_eq!(ffn.num_params(), config.num_params(), "{config:?}");
                assert_eq!(ffn.flops_per_token(), config.flops_per_token());
                assert_eq!(ffn.config(), config);
                assert_eq!((ffn.d_model(), ffn.d_ff()), (6, 10));
                assert_eq!((ffn.activation(), ffn.is_gated()), (activation, gated));
                assert_eq!(ffn.gate().is_some(), gated);
            }
        }
    }
}

#[test]
fn display_reads_like_the_config() {
    let ffn = FeedForwardConfig::preset(Variant::SwiGlu, 12).init(&Device::flex());
    let text = ffn.to_string();
    for expected in [
        "FeedForward",
        "d_model: 12",
        "d_ff: 32",
        "activation: silu",
        "gated: true",
        "bias_up: false",
        "dropout: 0",
        "dropout_at: hidden",
        "params: 1152",
    ] {
        assert!(text.contains(expected), "`{expected}` not in:\n{text}");
    }
}

#[test]
fn dropout_on_the_output_zeroes_and_rescales() {
    let device = device();
    let p = 0.3;
    let config = FeedForwardConfig::new(64, 128)
        .with_bias_down(true)
        .with_dropout(p)
        .with_dropout_at(DropoutAt::Output);
    let ffn = config.init(&device);
    let x = Tensor::<2>::random([256, 64], Distribution::Normal(0.0, 1.0), &device);

    let eval: Vec<f32> = ffn
        .valid()
        .forward(x.clone().inner())
        .into_data()
        .try_to_vec()
        .unwrap();
    let train: Vec<f32> = ffn.forward(x.clone()).into_data().try_to_vec().unwrap();
    let mut dropped = 0usize;
    for (t, e) in train.iter().zip(&eval) {
        if *t == 0.0 {
            dropped += 1;
        } else {
            let kept = e / (1.0 - p as f32);
            assert!(
                (t - kept).abs() <= 1e-5 * kept.abs().max(1.0),
                "{t} vs {kept}"
            );
        }
    }
    // 16384 Bernoulli(0.3) draws: the fraction is within 0.3 ± 0.02 (about 5 standard deviations).
    let fraction = dropped as f64 / train.len() as f64;
    assert!((fraction - p).abs() < 0.02, "dropped {fraction}");

    // Without autodiff, or in validation mode, dropout is the identity.
    let plain = ffn.valid();
    let a: Vec<f32> = plain
        .forward(x.clone().inner())
        .into_data()
        .try_to_vec()
        .unwrap();
    assert_eq!(a, eval);
}

#[test]
fn dropout_on_the_hidden_layer_changes_training_outputs_only() {
    let device = device();
    let config = FeedForwardConfig::new(16, 64)
        .with_activation(Activation::Identity)
        .with_dropout(0.5);
    let ffn = config.init(&device);
    let x = Tensor::<2>::random([32, 16], Distribution::Normal(0.0, 1.0), &device);
    let eval = ffn.valid().forward(x.clone().inner());
    let train = ffn.forward(x.clone());
    // With an identity activation and no bias, y = ((x W_up) ⊙ m / (1 - p)) W_down: no output
    // is zeroed, but the outputs differ from evaluation mode.
    let diff: f32 = (train.inner() - eval.clone()).abs().max().into_scalar();
    assert!(diff > 1e-3, "{diff}");
    // Zero dropout is exactly the evaluation output.
    let no_dropout = FeedForwardConfig::new(16, 64).with_activation(Activation::Identity);
    let ffn0 = no_dropout
        .init(&device)
        .load_record(ffn.clone().into_record());
    let same = ffn0.forward(x).inner();
    same.into_data().assert_eq(&eval.into_data(), true);
}

#[test]
fn gradients_flow_to_every_parameter() {
    let device = device();
    for variant in Variant::ALL {
        let config = FeedForwardConfig::preset(variant, 8);
        let gated = config.gated;
        let ffn = config
            .with_bias_up(true)
            .with_bias_gate(gated)
            .with_bias_down(true)
            .init(&device);
        let x = Tensor::<3>::random([2, 3, 8], Distribution::Normal(0.0, 1.0), &device);
        let grads = ffn.forward(x).powi_scalar(2).sum().backward();
        let mut count = 0;
        for linear in [ffn.up(), ffn.gate(), Some(ffn.down())]
            .into_iter()
            .flatten()
        {
            assert!(linear.weight.val().grad(&grads).is_some(), "{variant}");
            assert!(
                linear.bias.as_ref().unwrap().val().grad(&grads).is_some(),
                "{variant}"
            );
            count += 2;
        }
        assert_eq!(count, if gated { 6 } else { 4 });
    }
}

/// An input with no tokens gives empty outputs and zero weight gradients (burn's `reshape`
/// reads a 0 as "keep this dimension", so such an input must not be flattened for the op).
#[test]
fn an_input_without_tokens_gives_empty_outputs_and_zero_gradients() {
    let device = device();
    for fused in [false, true] {
        let ffn = FeedForwardConfig::preset(Variant::SwiGlu, 8)
            .with_fused_gate_up(fused)
            .with_bias_down(true)
            .init(&device);
        let x = Tensor::<3>::zeros([2, 0, 8], &device).require_grad();
        let y = ffn.forward(x.clone());
        assert_eq!(y.dims(), [2, 0, 8]);
        let grads = y.sum().backward();
        let dw = ffn.down().weight.val().grad(&grads).expect("dW_down");
        assert_eq!(dw.dims(), [ffn.d_ff(), 8]);
        let largest: f32 = dw.abs().max().into_scalar();
        assert_eq!(largest, 0.0);
        // burn's autodiff may leave the empty input without a gradient; never a wrong shape.
        if let Some(dx) = x.grad(&grads) {
            assert_eq!(dx.dims(), [2, 0, 8]);
        }
    }
}
