//! Hidden-layer dropout through the FFN op draws the composed path's masks: with the same seed
//! (the device's, or a scope's of `ffn_model::dropout::with_seed`), `forward` (the op, the mask
//! an input of it) and `forward_composed` give the same outputs and gradients.
//!
//! The test runs in a process of its own (`ffn_test_support::alone`): burn's random stream is
//! process-wide, and another test drawing between the seed and the draw would change the masks.

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{Device, Distribution, Gradients, Tensor};
use ffn_model::{Activation, FeedForward, FeedForwardConfig, Memory};

/// The output, the input's gradient and every parameter's gradient of `L = Σ y ⊙ g`, after
/// seeding the device with `seed`.
fn run(
    ffn: &FeedForward,
    composed: bool,
    x: &Tensor<3>,
    g: &Tensor<3>,
    seed: u64,
) -> Vec<Tensor<2>> {
    let x = x.clone().require_grad();
    x.device().seed(seed);
    let y = if composed {
        ffn.forward_composed(x.clone())
    } else {
        ffn.forward(x.clone())
    };
    let grads = (y.clone() * g.clone()).sum().backward();
    let mut all = vec![
        y.inner().reshape([1, -1]),
        x.grad(&grads).unwrap().reshape([1, -1]),
    ];
    ffn.visit(&mut Grads(&grads, &mut all));
    all
}

struct Grads<'a>(&'a Gradients, &'a mut Vec<Tensor<2>>);

impl ModuleVisitor for Grads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let g = param.val().grad(self.0).expect("a gradient");
        self.1.push(g.reshape([1, -1]));
    }
}

fn largest_difference(a: &[Tensor<2>], b: &[Tensor<2>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(a, b)| (a.clone() - b.clone()).abs().max().into_scalar::<f32>())
        .fold(0.0, f32::max)
}

#[test]
fn the_op_draws_the_composed_paths_dropout_masks() {
    ffn_test_support::alone(
        module_path!(),
        "the_op_draws_the_composed_paths_dropout_masks",
        the_masks_agree,
    );
}

fn the_masks_agree() {
    let device = Device::flex().autodiff();
    for (activation, gated, fused) in [
        (Activation::Relu, false, false),
        (Activation::Silu, true, false),
        (Activation::Gelu, true, true),
    ] {
        for memory in [Memory::Save, Memory::Recompute] {
            let config = FeedForwardConfig::new(16, 48)
                .with_activation(activation)
                .with_gated(gated)
                .with_fused_gate_up(fused)
                .with_bias_up(true)
                .with_bias_gate(gated)
                .with_bias_down(true)
                .with_dropout(0.3)
                .with_memory(memory);
            let ffn = config.init(&device);
            let x = Tensor::<3>::random([3, 5, 16], Distribution::Normal(0.0, 1.0), &device);
            let g = Tensor::<3>::random([3, 5, 16], Distribution::Normal(0.0, 1.0), &device);
            // burn draws a parameter when it is first read: read them all before seeding.
            let _ = run(&ffn, true, &x, &g, 0);

            let op = run(&ffn, false, &x, &g, 11);
            let composed = run(&ffn, true, &x, &g, 11);
            let what = format!("{activation:?}, gated {gated}, fused {fused}, {memory:?}");
            let error = largest_difference(&op, &composed);
            assert!(error < 1e-5, "{what}: op vs composed {error}");

            // Inside a seeded scope too, and the scope's masks do not depend on the device's
            // stream.
            let scoped = |composed, device_seed| {
                ffn_model::dropout::with_seed(5, || run(&ffn, composed, &x, &g, device_seed))
            };
            let op_scoped = scoped(false, 1);
            let error = largest_difference(&op_scoped, &scoped(true, 2));
            assert!(error < 1e-5, "{what}: seeded op vs composed {error}");
            assert!(
                largest_difference(&op_scoped, &op) > 1e-2,
                "{what}: scope ignored"
            );

            // The masks are really applied: another seed, other masks, another output; and
            // without dropout (validation mode) another output again.
            let other = run(&ffn, false, &x, &g, 12);
            assert!(
                largest_difference(&op, &other) > 1e-2,
                "{what}: seed ignored"
            );
            let x_valid = x.clone().inner();
            let y_valid = ffn.valid().forward(x_valid).reshape([1, -1]);
            let d: f32 = (op[0].clone().inner() - y_valid).abs().max().into_scalar();
            assert!(d > 1e-2, "{what}: no dropout applied");
        }
    }
}
