//! The mixture-of-experts layer against independent references, in f64:
//!
//! - a dense reference written here: every expert on every token, `y = Σ_e w_te FFN_e(x_t)`
//!   with the routing weights `w_te` computed from the router's scores by this file's own
//!   top-k (zero for experts a token did not choose), differentiated by autodiff;
//! - finite differences of `L = Σ y ⊙ g` along random directions, for the input, the router
//!   and every expert tensor;
//! - hand-computed auxiliary losses and capacity drops on small cases;
//! - a one-expert, top-1 layer is its expert exactly.

use burn::module::{Module, Param};
use burn::tensor::activation::{sigmoid, softmax};
use burn::tensor::{DType, Device, Tensor, TensorData};
use ffn_model::{Activation, ConfigError, FeedForwardConfig, Memory, Moe, MoeConfig, Scoring};
use ffn_test_support::{Cast, Perturb, Redraw, Rng, device, property};

const D: usize = 6;

fn tensor<const R: usize>(data: TensorData, device: &Device) -> Tensor<R> {
    Tensor::from_data(data, (device, DType::F64))
}

fn values<const R: usize>(t: Tensor<R>) -> Vec<f64> {
    t.into_data().iter::<f64>().collect()
}

/// The largest `|a − b|` over `max(1, max |b|)`.
fn error(a: &[f64], b: &[f64]) -> f64 {
    differences(a, b).fold(0.0, f64::max)
}

/// `|aᵢ − bᵢ|` relative to `b`'s scale (its largest magnitude, at least 1), element by element.
fn differences<'a>(a: &'a [f64], b: &'a [f64]) -> impl Iterator<Item = f64> + 'a {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(1.0f64, |m, v| m.max(v.abs()));
    a.iter().zip(b).map(move |(x, y)| (x - y).abs() / scale)
}

/// The experts each token uses, by this file's own rule: the `k` largest of `p + bias` within
/// the `topk_group` best groups (a group scores the sum of its two best), ties to the lower
/// index.
fn choose(p: &[f64], bias: &[f64], config: &MoeConfig) -> Vec<usize> {
    let s: Vec<f64> = p.iter().zip(bias).map(|(p, b)| p + b).collect();
    let rank = |mut idx: Vec<usize>, score: &dyn Fn(usize) -> f64| {
        idx.sort_by(|&a, &b| score(b).partial_cmp(&score(a)).unwrap().then(a.cmp(&b)));
        idx
    };
    let size = config.n_experts / config.n_group;
    let group_score = |g: usize| {
        let members = rank((g * size..(g + 1) * size).collect(), &|i| s[i]);
        members.iter().take(2).map(|&i| s[i]).sum::<f64>()
    };
    let allowed: Vec<usize> = rank((0..config.n_group).collect(), &group_score)
        .into_iter()
        .take(config.topk_group)
        .flat_map(|g| g * size..(g + 1) * size)
        .collect();
    rank(allowed, &|i| s[i])
        .into_iter()
        .take(config.top_k)
        .collect()
}

/// `FFN_e(x)` for every token, composed from burn's ops on expert `e`'s slices of the
/// stacked weights.
fn expert_output(moe: &Moe, e: usize, x: Tensor<2>) -> Tensor<2> {
    let mat = |p: &Param<Tensor<3>>| p.val().narrow(0, e, 1).squeeze_dim::<2>(0);
    let row = |p: Option<&Param<Tensor<2>>>| p.map(|p| p.val().narrow(0, e, 1));
    let linear = |x: Tensor<2>, w: Tensor<2>, b: Option<Tensor<2>>| match b {
        Some(b) => x.matmul(w) + b,
        None => x.matmul(w),
    };
    let phi = |t| moe.activation().forward(t);
    let up = linear(x.clone(), mat(moe.w_up()), row(moe.b_up()));
    let h = match moe.w_gate() {
        Some(w_gate) => phi(linear(x, mat(w_gate), row(moe.b_gate()))) * up,
        None => phi(up),
    };
    linear(h, mat(moe.w_down()), row(moe.b_down()))
}

/// The dense reference: `y = Σ_e w_te FFN_e(x_t) (+ shared)`, every expert on every token,
/// `w_te = 0` for experts not chosen. No capacity.
fn dense(moe: &Moe, x: Tensor<2>) -> Tensor<2> {
    let config = moe.config();
    let device = x.device();
    let [tokens, _] = x.dims();
    let e_count = config.n_experts;
    let logits = moe.router().forward(x.clone());
    let p = match config.scoring {
        Scoring::Softmax | Scoring::SparseMixer => softmax(logits.clone(), 1),
        Scoring::Sigmoid => sigmoid(logits.clone()),
    };
    let bias = moe
        .selection_bias()
        .map(values)
        .unwrap_or_else(|| vec![0.0; e_count]);
    let host = values(p.clone());
    let mut mask = vec![0.0; tokens * e_count];
    for t in 0..tokens {
        for e in choose(&host[t * e_count..(t + 1) * e_count], &bias, &config) {
            mask[t * e_count + e] = 1.0;
        }
    }
    let mask = tensor::<2>(TensorData::new(mask, [tokens, e_count]), &device);
    let mut w = if config.scoring == Scoring::SparseMixer {
        sparse_mixer_weights(logits, &config)
    } else {
        p * mask
    };
    if config.normalize_top_k {
        w = w.clone() / w.sum_dim(1);
    }
    w = w * config.routed_scaling;
    let mut y = Tensor::<2>::zeros([tokens, config.d_model()], (&device, DType::F64));
    for e in 0..e_count {
        y = y + expert_output(moe, e, x.clone()) * w.clone().narrow(1, e, 1);
    }
    if let Some(shared) = moe.shared() {
        let s = shared.forward_composed(x.clone());
        y = y + match moe.shared_gate() {
            Some(gate) => s * sigmoid(gate.forward(x)),
            None => s,
        };
    }
    y
}

/// SparseMixer's weights as a `[T, E]` matrix, slot by slot: the `s`-th best expert `e_s` of
/// a token gets `exp(z_{e_s}) / Σ_{j ∈ B_s} exp(z_j)`, `B_s` the experts not taken by an earlier
/// slot whose logits lie within `2ε` of `z_{e_s}`, relative to `max(|z_j|, z_{e_s})`.
fn sparse_mixer_weights(logits: Tensor<2>, config: &MoeConfig) -> Tensor<2> {
    use std::cmp::Ordering;
    let device = logits.device();
    let [tokens, e_count] = logits.dims();
    let z = values(logits.clone());
    let exp = logits.exp();
    let mut w = Tensor::<2>::zeros([tokens, e_count], (&device, DType::F64));
    let mut taken = vec![Vec::new(); tokens];
    for _slot in 0..config.top_k {
        let (mut band, mut chosen) = (vec![0.0; tokens * e_count], vec![0.0; tokens * e_count]);
        for t in 0..tokens {
            let z = &z[t * e_count..(t + 1) * e_count];
            let best = (0..e_count)
                .filter(|e| !taken[t].contains(e))
                .fold(None, |b: Option<usize>, e| match b {
                    Some(b) if z[b] >= z[e] => Some(b),
                    _ => Some(e),
                })
                .unwrap();
            for j in 0..e_count {
                let ratio = (z[best] - z[j]) / z[j].abs().max(z[best]);
                // A NaN ratio (0 / 0) is inside, as PhiMoE computes it.
                let outside = ratio.partial_cmp(&(2.0 * config.jitter)) == Some(Ordering::Greater);
                let inside = !outside && !taken[t].contains(&j);
                band[t * e_count + j] = if inside { 1.0 } else { 0.0 };
            }
            chosen[t * e_count + best] = 1.0;
            taken[t].push(best);
        }
        let band = tensor::<2>(TensorData::new(band, [tokens, e_count]), &device);
        let chosen = tensor::<2>(TensorData::new(chosen, [tokens, e_count]), &device);
        w = w + chosen * exp.clone() / (band * exp.clone()).sum_dim(1);
    }
    w
}

/// Every parameter's gradient, by record path, flattened.
struct Grads<'a> {
    grads: &'a burn::tensor::Gradients,
    path: Vec<String>,
    out: Vec<(String, Vec<f64>)>,
}

impl burn::module::ModuleVisitor for Grads<'_> {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }

    fn visit_float<const R: usize>(&mut self, param: &Param<Tensor<R>>) {
        if let Some(g) = param.val().grad(self.grads) {
            self.out
                .push((self.path.join("."), g.into_data().iter::<f64>().collect()));
        }
    }
}

fn param_grads(moe: &Moe, grads: &burn::tensor::Gradients) -> Vec<(String, Vec<f64>)> {
    let mut visitor = Grads {
        grads,
        path: Vec::new(),
        out: Vec::new(),
    };
    moe.visit(&mut visitor);
    visitor.out
}

/// The configs the references are compared on: both scorings, gated and not, biases, groups,
/// selection bias, scaling, shared experts gated and not, both memory modes.
fn configs() -> Vec<(&'static str, MoeConfig)> {
    let swiglu = FeedForwardConfig::new(D, 5)
        .with_activation(Activation::Silu)
        .with_gated(true);
    let gelu = FeedForwardConfig::new(D, 7)
        .with_bias_up(true)
        .with_bias_down(true);
    vec![
        ("mixtral", MoeConfig::new(swiglu.clone(), 4, 2)),
        (
            "qwen2",
            MoeConfig::new(swiglu.clone().with_bias_gate(true).with_bias_up(true), 6, 3)
                .with_normalize_top_k(false)
                .with_shared_experts(1, Some(9), true),
        ),
        (
            "deepseek",
            MoeConfig::new(swiglu.clone().with_memory(Memory::Recompute), 8, 2)
                .with_scoring(Scoring::Sigmoid)
                .with_groups(4, 2)
                .with_selection_bias(true, 0.01)
                .with_routed_scaling(2.5)
                .with_router_bias(true)
                .with_shared_experts(2, None, false),
        ),
        ("gelu-top1", MoeConfig::new(gelu, 3, 1)),
        (
            "phimoe",
            MoeConfig::new(swiglu.clone(), 5, 2)
                .with_scoring(Scoring::SparseMixer)
                .with_normalize_top_k(false)
                .with_jitter(0.3),
        ),
    ]
}

/// A layer in f64 on the autodiff Flex device, with a selection bias that is not zero.
fn layer(config: &MoeConfig, seed: u64) -> Moe {
    let device = device();
    device.seed(seed);
    let mut moe = config.init(&device).map(&mut Cast(DType::F64));
    if config.selection_bias {
        // Three updates from an uneven load give a bias with three distinct values.
        let load: Vec<usize> = (0..config.n_experts).map(|e| e % 3).collect();
        for _ in 0..3 {
            moe = moe.update_selection_bias(&load);
        }
    }
    moe
}

/// Output, input gradient and every parameter's gradient of `L = Σ y ⊙ g`.
fn run(
    moe: &Moe,
    x: &TensorData,
    g: &TensorData,
    reference: bool,
    composed: bool,
) -> Vec<(String, Vec<f64>)> {
    let device = device();
    let x = tensor::<2>(x.clone(), &device).require_grad();
    let y = if reference {
        dense(moe, x.clone())
    } else if composed {
        moe.forward_composed(x.clone()).output
    } else {
        moe.forward(x.clone()).output
    };
    let grads = (y.clone() * tensor::<2>(g.clone(), &device))
        .sum()
        .backward();
    let mut all = vec![
        ("y".to_string(), values(y)),
        ("x".to_string(), values(x.grad(&grads).unwrap())),
    ];
    all.extend(param_grads(moe, &grads));
    all
}

/// The op (its own backward) and the composed path both equal the dense reference: output,
/// input gradient, and the gradient of every parameter, to f64 rounding.
#[test]
fn the_layer_equals_a_dense_reference() {
    for (name, config) in configs() {
        let moe = layer(&config, 7);
        let mut rng = Rng(11);
        let (x, g) = (rng.data(&[13, D]), rng.data(&[13, D]));
        let reference = run(&moe, &x, &g, true, false);
        for composed in [false, true] {
            let got = run(&moe, &x, &g, false, composed);
            let names =
                |v: &[(String, Vec<f64>)]| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
            assert_eq!(names(&got), names(&reference), "{name}: the same gradients");
            for ((tensor, a), (_, b)) in got.iter().zip(&reference) {
                let e = error(a, b);
                assert!(e < 1e-12, "{name} composed={composed} {tensor}: {e:e}");
            }
        }
        // Every expert took part (13 tokens), and every stacked tensor has its gradient.
        let got = run(&moe, &x, &g, false, false);
        for stacked in ["w_up", "w_down"] {
            assert!(got.iter().any(|(n, _)| n == stacked), "{name}: {stacked}");
        }
    }
}

/// `precision = "bf16"` in a mixture's experts, on f32 layers (every config: both scorings,
/// biases, shared experts, both memory modes): the op and the composed path compute the same
/// rounded forward pass (at least 98 % of the outputs within 1e-5, all within bf16's
/// precision: see below; their backward passes differ by the op's rounding of `dy` and
/// `d(pre)`, within bf16's precision); the rounding shows against the f32 layer, within bf16's
/// precision; and the router stays f32: its logits are the f32 layer's, bit for bit.
#[test]
fn bf16_experts_round_their_products_and_the_router_stays_f32() {
    let device = device();
    for (name, config) in configs() {
        let mut bf16_config = config.clone();
        bf16_config.expert.precision = ffn_model::Precision::Bf16;
        // The same parameters, in two precisions, drawn from a seeded stream: the rounding
        // this test counts depends on them, and burn's own RNG is shared by the binary's tests.
        let f32_moe = config.init(&device).map(&mut Redraw {
            rng: Rng(23),
            scale: 1.0,
        });
        let bf16_moe = bf16_config
            .init(&device)
            .load_record(f32_moe.clone().into_record());
        let mut rng = Rng(11);
        let (x, g) = (rng.data(&[13, D]), rng.data(&[13, D]));
        let f32_tensor =
            |data: &TensorData| Tensor::<2>::from_data(data.clone(), (&device, DType::F32));
        let run = |moe: &Moe, composed: bool| {
            let x = f32_tensor(&x).require_grad();
            let out = if composed {
                moe.forward_composed(x.clone())
            } else {
                moe.forward(x.clone())
            };
            let logits = values(out.router_logits);
            let y = out.output;
            let grads = (y.clone() * f32_tensor(&g)).sum().backward();
            let mut all = vec![
                ("y".to_string(), values(y)),
                ("x".to_string(), values(x.grad(&grads).unwrap())),
            ];
            all.extend(param_grads(moe, &grads));
            (all, logits)
        };
        let (op, logits) = run(&bf16_moe, false);
        let (composed, _) = run(&bf16_moe, true);
        let (f32_op, f32_logits) = run(&f32_moe, false);
        assert_eq!(logits, f32_logits, "{name}: the router computes in f32");
        let bf16_scale = 2f64.powi(-6);
        for (((tensor, a), (_, c)), (_, f)) in op.iter().zip(&composed).zip(&f32_op) {
            let (vs_composed, vs_f32) = (error(a, c), error(a, f));
            if tensor == "y" {
                // The same rounded products in both, up to f32 reordering: an operand that the
                // two paths compute a few ulp apart can round to either side of a bf16
                // midpoint (1 in ~10⁴ near one), and move the outputs it feeds by ~2⁻⁹ of
                // its term. So nearly every output agrees within 1e-5; skipping a rounding
                // would move nearly all of them.
                let apart = differences(a, c).filter(|d| *d > 1e-5).count();
                assert!(
                    apart * 50 <= a.len(),
                    "{name} {tensor}: op vs composed: {apart} of {} outputs apart by more \
                     than 1e-5 (largest {vs_composed:e})",
                    a.len()
                );
                assert!(
                    vs_f32 > 1e-5,
                    "{name}: bf16 hardly differs from f32: {vs_f32:e}"
                );
            }
            assert!(
                vs_composed < bf16_scale,
                "{name} {tensor}: op vs composed {vs_composed:e}"
            );
            assert!(
                vs_f32 < bf16_scale,
                "{name} {tensor}: bf16 vs f32 {vs_f32:e}"
            );
        }
        // One token: experts without tokens get zero gradients, in f32 like the others.
        let x = f32_tensor(&x).narrow(0, 0, 1).require_grad();
        let y = bf16_moe.forward(x.clone()).output;
        let grads = y.sum().backward();
        let w_up = bf16_moe.w_up().val().grad(&grads).expect("w_up's gradient");
        assert_eq!(w_up.dtype(), DType::F32, "{name}");
        assert!(values(w_up).contains(&0.0), "{name}: an idle expert");
    }
}

/// Finite differences along random directions, for `x`, the router and every expert tensor
/// (routing is piecewise constant: ε = 1e-6 does not move a token across a choice here).
#[test]
fn gradients_match_finite_differences() {
    const EPS: f64 = 1e-6;
    let device = device();
    for (name, config) in configs() {
        let moe = layer(&config, 3);
        let mut rng = Rng(5);
        let (x, g) = (rng.data(&[9, D]), rng.data(&[9, D]));
        let loss = |moe: &Moe, x: TensorData| -> f64 {
            let y = moe.forward(tensor::<2>(x, &device)).output;
            values((y * tensor::<2>(g.clone(), &device)).sum())[0]
        };
        let analytic = run(&moe, &x, &g, false, false);
        let mut checked = Vec::new();
        for (tensor_name, grad) in analytic.iter().skip(1) {
            let direction: Vec<f64> = (0..grad.len()).map(|_| rng.normal()).collect();
            let along: f64 = grad.iter().zip(&direction).map(|(a, b)| a * b).sum();
            let at = |sign: f64| {
                let delta: Vec<f64> = direction.iter().map(|v| v * sign * EPS).collect();
                if tensor_name == "x" {
                    let shifted: Vec<f64> =
                        x.iter::<f64>().zip(&delta).map(|(a, b)| a + b).collect();
                    loss(&moe, TensorData::new(shifted, [9, D]))
                } else {
                    let n = delta.len();
                    let mut perturb = Perturb {
                        path: Vec::new(),
                        target: tensor_name.clone(),
                        delta: TensorData::new(delta, [n]),
                    };
                    loss(&moe.clone().map(&mut perturb), x.clone())
                }
            };
            let numeric = (at(1.0) - at(-1.0)) / (2.0 * EPS);
            let e = (along - numeric).abs() / along.abs().max(numeric.abs()).max(1.0);
            assert!(
                e < 1e-6,
                "{name} {tensor_name}: autodiff {along} vs finite difference {numeric} ({e:e})"
            );
            checked.push(tensor_name.clone());
        }
        for required in ["x", "router.weight", "w_up", "w_down"] {
            assert!(checked.iter().any(|n| n == required), "{name}: {required}");
        }
    }
}

/// With one expert and top-1, the layer is that expert: the same output as the expert taken
/// out as a `FeedForward`, and the router gets no gradient from the output (its weight is 1).
#[test]
fn one_expert_top_one_is_its_feed_forward() {
    let device = device();
    for expert in [
        FeedForwardConfig::new(D, 11).with_activation(Activation::Relu),
        FeedForwardConfig::new(D, 8)
            .with_activation(Activation::Silu)
            .with_gated(true)
            .with_bias_up(true)
            .with_bias_gate(true)
            .with_bias_down(true),
    ] {
        device.seed(1);
        let moe = MoeConfig::new(expert, 1, 1).init(&device);
        let ffn = moe.expert(0);
        let x = Tensor::<3>::random([2, 5, D], burn::tensor::Distribution::Default, &device);
        let a = moe.forward(x.clone()).output.into_data();
        let b = ffn.forward(x).into_data();
        a.assert_eq(&b, true);
    }
}

/// `L_b = E Σ_e f_e P_e` and `L_z = mean_t (logsumexp z_t)²` on four tokens whose logits are
/// set by hand (the router is the identity on the first two inputs).
#[test]
fn auxiliary_losses_by_hand() {
    let device = device();
    let config = MoeConfig::new(FeedForwardConfig::new(2, 3), 2, 1);
    let moe = config.init(&device).map(&mut Cast(DType::F64));
    let identity = tensor::<2>(TensorData::new(vec![1.0, 0.0, 0.0, 1.0], [2, 2]), &device);
    let delta = TensorData::new(values(identity - moe.router().weight.val()), [4]);
    let moe = moe.map(&mut Perturb {
        path: Vec::new(),
        target: "router.weight".into(),
        delta,
    });
    let z = [[1.0, 0.0], [0.0, 2.0], [3.0, 0.0], [0.5, 0.5]];
    let x = tensor::<2>(
        TensorData::new(z.iter().flatten().copied().collect::<Vec<f64>>(), [4, 2]),
        &device,
    );
    let out = moe.forward(x);
    assert_eq!(
        values(out.router_logits.clone()),
        z.iter().flatten().copied().collect::<Vec<_>>()
    );
    // Choices: 0, 1, 0, 0 (the tie at token 3 goes to expert 0): f = (3/4, 1/4).
    assert_eq!(out.tokens_per_expert, vec![3, 1]);
    let p0 = |a: f64, b: f64| 1.0 / (1.0 + (b - a).exp());
    let p_mean0 = (p0(1.0, 0.0) + p0(0.0, 2.0) + p0(3.0, 0.0) + 0.5) / 4.0;
    let expected_b = 2.0 * (0.75 * p_mean0 + 0.25 * (1.0 - p_mean0));
    let lse = |a: f64, b: f64| (a.exp() + b.exp()).ln();
    let expected_z = z.iter().map(|r| lse(r[0], r[1]).powi(2)).sum::<f64>() / 4.0;
    let b = values(out.load_balancing_loss)[0];
    let zl = values(out.z_loss)[0];
    assert!((b - expected_b).abs() < 1e-14, "{b} vs {expected_b}");
    assert!((zl - expected_z).abs() < 1e-14, "{zl} vs {expected_z}");
    let aux = values(out.aux_loss)[0];
    assert!(
        (aux - 0.01 * expected_b).abs() < 1e-15,
        "default weights: 0.01 and 0"
    );
    assert_eq!(out.dropped_fraction, 0.0);
}

/// Capacity ⌈c T k / E⌉ admits first choices before second choices, tokens in order; a
/// dropped pair adds nothing to its token, the other weights unchanged.
#[test]
fn capacity_drops_exactly_the_pairs_the_rule_says() {
    let device = device();
    device.seed(9);
    // 8 tokens, 4 experts, top-2, c = 0.5: capacity ⌈0.5 · 8 · 2 / 4⌉ = 2.
    let config = MoeConfig::new(FeedForwardConfig::new(D, 4), 4, 2).with_capacity_factor(Some(0.5));
    assert_eq!(config.capacity(8), Some(2));
    let moe = config.init(&device).map(&mut Cast(DType::F64));
    let mut rng = Rng(21);
    let x = tensor::<2>(rng.data(&[8, D]), &device);
    let out = moe.forward(x.clone());

    // The rule, here: choices from the scores, then admission slot by slot, token by token.
    let p = values(softmax(moe.router().forward(x.clone()), 1));
    let choices: Vec<Vec<usize>> = (0..8)
        .map(|t| choose(&p[t * 4..t * 4 + 4], &[0.0; 4], &config))
        .collect();
    let mut load = [0usize; 4];
    let mut admitted = [[false; 2]; 8];
    for j in 0..2 {
        for t in 0..8 {
            let e = choices[t][j];
            if load[e] < 2 {
                load[e] += 1;
                admitted[t][j] = true;
            }
        }
    }
    let dropped = admitted.iter().flatten().filter(|a| !**a).count();
    assert!(dropped > 0, "the case drops something");
    assert_eq!(out.tokens_per_expert, load.to_vec());
    assert_eq!(out.dropped_fraction, dropped as f64 / 16.0);

    // Each token's output: its admitted experts, weighted by the renormalised top-2 scores.
    let experts: Vec<Vec<f64>> = (0..4)
        .map(|e| values(expert_output(&moe, e, x.clone())))
        .collect();
    let y = values(out.output);
    for t in 0..8 {
        let (a, b) = (p[t * 4 + choices[t][0]], p[t * 4 + choices[t][1]]);
        for i in 0..D {
            let mut expected = 0.0;
            for (j, w) in [a / (a + b), b / (a + b)].into_iter().enumerate() {
                if admitted[t][j] {
                    expected += w * experts[choices[t][j]][t * D + i];
                }
            }
            assert!((y[t * D + i] - expected).abs() < 1e-12, "token {t}");
        }
    }
}

/// The aux-loss-free update moves each expert's selection bias by the rate, against its load,
/// and changes which experts are chosen but not the weights of those chosen.
#[test]
fn the_selection_bias_balances_without_weighting() {
    let device = device();
    let config = MoeConfig::new(FeedForwardConfig::new(D, 4), 4, 1)
        .with_scoring(Scoring::Sigmoid)
        .with_selection_bias(true, 0.25);
    let moe = config.init(&device).map(&mut Cast(DType::F64));
    assert_eq!(values(moe.selection_bias().unwrap()), vec![0.0; 4]);
    let moe = moe.update_selection_bias(&[5, 1, 3, 3]); // mean 3
    assert_eq!(
        values(moe.selection_bias().unwrap()),
        vec![-0.25, 0.25, 0.0, 0.0]
    );

    // A bias of 10 on expert 2 sends every token there, with weight p_2 / p_2 = 1 (normalised).
    let moe = moe.update_selection_bias(&[1, 1, 0, 1]);
    let moe = (0..39).fold(moe, |m, _| m.update_selection_bias(&[1, 1, 0, 1]));
    assert_eq!(values(moe.selection_bias().unwrap())[2], 10.0);
    let mut rng = Rng(2);
    let x = tensor::<2>(rng.data(&[5, D]), &device);
    let out = moe.forward(x.clone());
    assert_eq!(out.tokens_per_expert, vec![0, 0, 5, 0]);
    let expected = values(expert_output(&moe, 2, x));
    assert!(error(&values(out.output), &expected) < 1e-14);
}

/// Any rank in, the same rank out; an empty batch gives an empty output and zero losses.
#[test]
fn any_rank_and_empty_batches() {
    let device = device();
    let moe = MoeConfig::new(FeedForwardConfig::new(D, 4), 4, 2).init(&device);
    let x = Tensor::<4>::ones([2, 3, 1, D], &device);
    let out = moe.forward(x);
    assert_eq!(out.output.dims(), [2, 3, 1, D]);
    assert_eq!(out.router_logits.dims(), [6, 4]);
    let out = moe.forward(Tensor::<3>::zeros([0, 5, D], &device));
    assert_eq!(out.output.dims(), [0, 5, D]);
    assert_eq!(out.tokens_per_expert, vec![0; 4]);
    assert_eq!(values(out.load_balancing_loss.cast(DType::F64)), vec![0.0]);
}

/// Every invalid value is a typed error naming its field; nothing panics.
#[test]
fn invalid_configs_are_typed_errors() {
    let base = || MoeConfig::new(FeedForwardConfig::new(8, 16), 8, 2);
    let moe_field = |c: MoeConfig| match c.validate() {
        Err(ConfigError::Moe { field, .. }) => field,
        other => panic!("{other:?}"),
    };
    let zero = |c: MoeConfig| match c.validate() {
        Err(ConfigError::ZeroSize { field }) => field,
        other => panic!("{other:?}"),
    };
    assert_eq!(zero(MoeConfig { top_k: 0, ..base() }), "top_k");
    assert_eq!(
        zero(MoeConfig {
            n_experts: 0,
            ..base()
        }),
        "n_experts"
    );
    assert_eq!(moe_field(MoeConfig { top_k: 9, ..base() }), "top_k");
    assert_eq!(moe_field(base().with_groups(3, 1)), "n_group");
    assert_eq!(moe_field(base().with_groups(4, 5)), "topk_group");
    assert_eq!(
        moe_field(MoeConfig { top_k: 3, ..base() }.with_groups(4, 1)),
        "top_k"
    );
    for c in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        assert_eq!(
            moe_field(base().with_capacity_factor(Some(c))),
            "capacity_factor"
        );
    }
    assert_eq!(moe_field(base().with_routed_scaling(0.0)), "routed_scaling");
    assert_eq!(moe_field(base().with_jitter(1.0)), "jitter");
    assert_eq!(
        moe_field(base().with_loss_coefs(f64::NAN, 0.0)),
        "load_balancing_coef"
    );
    assert_eq!(
        moe_field(base().with_shared_experts(0, Some(4), false)),
        "n_shared_experts"
    );
    let mut dropout = base();
    dropout.expert.dropout = 0.1;
    assert_eq!(moe_field(dropout), "expert.dropout");
    // bf16 experts are valid (the grouped op rounds their products).
    let mut bf16 = base();
    bf16.expert.precision = ffn_model::Precision::Bf16;
    bf16.validate().unwrap();
    assert!(matches!(
        MoeConfig {
            n_experts: 1 << 20,
            top_k: 1,
            ..base()
        }
        .validate(),
        Err(ConfigError::TooLarge {
            field: "n_experts",
            ..
        })
    ));
    assert!(base().try_init(&Device::flex()).is_ok());
    assert!(
        MoeConfig { top_k: 9, ..base() }
            .try_init(&Device::flex())
            .is_err()
    );

    // Text: an unknown key, a bad activation, a bad value: one error each.
    let toml = "n_experts = 4\ntop_k = 2\n[expert]\nd_model = 8\nd_ff = 16\n";
    let parsed = MoeConfig::from_toml(toml).unwrap();
    assert_eq!(parsed, MoeConfig::new(FeedForwardConfig::new(8, 16), 4, 2));
    assert_eq!(MoeConfig::from_json(&parsed.to_json()).unwrap(), parsed);
    assert_eq!(MoeConfig::from_toml(&parsed.to_toml()).unwrap(), parsed);
    assert!(matches!(
        MoeConfig::from_toml(&format!("{toml}topk = 2\n")),
        Err(ConfigError::Parse { .. })
    ));
    assert!(matches!(
        MoeConfig::from_toml(&toml.replace("d_ff = 16", "d_ff = 16\nactivation = \"swoosh\"")),
        Err(ConfigError::UnknownActivation { .. })
    ));
    assert!(matches!(
        MoeConfig::from_toml(&toml.replace("top_k = 2", "top_k = 5")),
        Err(ConfigError::Moe { field: "top_k", .. })
    ));
}

/// Random configs: `validate` never panics, and every config it accepts builds and runs
/// (small sizes), with dropless routing giving every token `top_k` experts.
#[test]
fn random_configs_validate_or_run() {
    let device = Device::flex();
    property("moe configs", 0x30e, 200, |rng| {
        let pick = |rng: &mut Rng, options: &[usize]| options[rng.below(options.len())];
        let expert = FeedForwardConfig::new(pick(rng, &[0, 1, 4, 8]), pick(rng, &[0, 1, 3, 8]))
            .with_gated(rng.below(2) == 0);
        let mut config = MoeConfig::new(
            expert,
            pick(rng, &[0, 1, 2, 4, 6, 8]),
            pick(rng, &[0, 1, 2, 3, 9]),
        )
        .with_scoring(if rng.below(2) == 0 {
            Scoring::Softmax
        } else {
            Scoring::Sigmoid
        })
        .with_groups(pick(rng, &[0, 1, 2, 3, 4]), pick(rng, &[0, 1, 2, 5]))
        .with_selection_bias(rng.below(2) == 0, 0.01)
        .with_shared_experts(pick(rng, &[0, 0, 1, 2]), None, rng.below(3) == 0);
        let factors = [
            None,
            Some(0.0),
            Some(-1.0),
            Some(f64::NAN),
            Some(0.5),
            Some(1.0),
            Some(2.0),
        ];
        config.capacity_factor = factors[rng.below(factors.len())];
        config.jitter = [0.0, 0.01, 1.5, f64::NAN][rng.below(4)];
        if config.validate().is_err() {
            assert!(config.try_init(&device).is_err());
            return;
        }
        let moe = config.try_init(&device).unwrap();
        let tokens = rng.below(12);
        let out = moe.forward(Tensor::<2>::ones([tokens, config.d_model()], &device));
        assert_eq!(out.output.dims(), [tokens, config.d_model()]);
        let pairs: usize = out.tokens_per_expert.iter().sum();
        match config.capacity(tokens) {
            None => assert_eq!(pairs, tokens * config.top_k),
            Some(cap) => assert!(out.tokens_per_expert.iter().all(|&n| n <= cap)),
        }
    });
}

/// Every MoE fixture (`tools/moe_fixtures.py`): its layer 1's block prefix, the scheme its
/// keys follow (the model type's own where one is named after it; `None`: no scheme writes its
/// names), and its sparse layers. The last sixteen are families the reader was not written
/// against.
const SPARSE: [(&str, &str, Option<&str>, &[usize]); 28] = [
    (
        "mixtral",
        "model.layers.1.block_sparse_moe.",
        Some("mixtral"),
        &[0, 1],
    ),
    (
        "qwen2_moe",
        "model.layers.1.mlp.",
        Some("qwen2_moe"),
        &[0, 1],
    ),
    (
        "qwen3_moe",
        "model.layers.1.mlp.",
        Some("qwen3_moe"),
        &[0, 1],
    ),
    ("olmoe", "model.layers.1.mlp.", Some("olmoe"), &[0, 1]),
    (
        "granitemoe",
        "model.layers.1.block_sparse_moe.",
        Some("granitemoe"),
        &[0, 1],
    ),
    (
        "qwen3_next",
        "model.layers.1.mlp.",
        Some("qwen3_next"),
        &[0, 1],
    ),
    (
        "deepseek_v2",
        "model.layers.1.mlp.",
        Some("deepseek_v2"),
        &[1],
    ),
    (
        "deepseek_v3",
        "model.layers.1.mlp.",
        Some("deepseek_v3"),
        &[1],
    ),
    ("gpt_oss", "model.layers.1.mlp.", Some("gpt_oss"), &[0, 1]),
    ("dbrx", "transformer.blocks.1.ffn.", Some("dbrx"), &[0, 1]),
    (
        "llama4_text",
        "model.layers.1.feed_forward.",
        Some("llama4_text"),
        &[1],
    ),
    (
        "llama4",
        "language_model.model.layers.1.feed_forward.",
        Some("llama4"),
        &[1],
    ),
    (
        "qwen3_5_moe",
        "model.language_model.layers.1.mlp.",
        Some("qwen2_moe"),
        &[0, 1],
    ),
    ("glm4_moe", "model.layers.1.mlp.", Some("deepseek_v3"), &[1]),
    ("dots1", "model.layers.1.mlp.", Some("deepseek_v3"), &[1]),
    (
        "minimax",
        "model.layers.1.block_sparse_moe.",
        Some("mixtral"),
        &[0, 1],
    ),
    (
        "flex_olmo",
        "model.layers.1.mlp.",
        Some("qwen3_moe"),
        &[0, 1],
    ),
    ("exaone_moe", "model.layers.1.mlp.", None, &[1]),
    ("jamba", "model.layers.1.feed_forward.", None, &[0, 1]),
    (
        "granitemoeshared",
        "model.layers.1.block_sparse_moe.",
        Some("granitemoe"),
        &[0, 1],
    ),
    (
        "glm4_moe_lite",
        "model.layers.1.mlp.",
        Some("deepseek_v3"),
        &[1],
    ),
    (
        "cohere2_moe",
        "model.layers.1.mlp.",
        Some("deepseek_v2"),
        &[0, 1],
    ),
    (
        "ernie4_5_moe",
        "model.layers.1.mlp.",
        Some("ernie4_5_moe"),
        &[1],
    ),
    (
        "hunyuan_v1_moe",
        "model.layers.1.mlp.",
        Some("hunyuan_v1_moe"),
        &[0, 1],
    ),
    (
        "minimax_m2",
        "model.layers.1.block_sparse_moe.",
        Some("minimax_m2"),
        &[0, 1],
    ),
    (
        "lfm2_moe",
        "model.layers.1.feed_forward.",
        Some("lfm2_moe"),
        &[1],
    ),
    ("afmoe", "model.layers.1.mlp.", Some("afmoe"), &[1]),
    // SparseMixer routing in Mixtral's names.
    (
        "phimoe",
        "model.layers.1.block_sparse_moe.",
        Some("mixtral"),
        &[0, 1],
    ),
];

/// Families whose block the MoE layer has no form for, refused with the tensor that shows it
/// (`tools/moe_fixtures.py`): JetMoE's output bias.
const REFUSED: [&str; 1] = ["jetmoe"];

/// The sparse block of tiny `transformers` models (`tools/moe_fixtures.py`) loaded with
/// `HfModel::load_moe_layer`: output, router logits and the gradients of the input, the router
/// and expert 1, against `transformers` run in f64 on the same (f32) weights: within 2e-5 in
/// f32 and 1e-6 in f64 (`transformers` computes the routing scores in f32 even then, which
/// leaves 1e-7 differences). Families the reader was not written against load by their keys
/// and fields (Jamba needed one table entry: it does not renormalise its top k, and no field
/// says so). LFM2-MoE adds 1e-6 to the sum it renormalises the top k by, which ffn does not:
/// its outputs and gradients agree within 2e-6 of their scale (1.2e-6 measured).
#[test]
fn hugging_face_moe_layers_match_transformers() {
    use ffn_model::HfModel;
    use ffn_test_support::read_f64;
    for (name, ..) in SPARSE {
        let folder = ffn_test_support::data_file(&format!("hf/{name}"));
        let mut model = HfModel::open(&folder).unwrap();
        let bytes = std::fs::read(folder.join("moe_io.safetensors")).unwrap();
        let golden = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let expected = |key: &str| read_f64(&golden, key).iter::<f64>().collect::<Vec<f64>>();
        let epsilon = if name == "lfm2_moe" { 2e-6 } else { 0.0 };
        for (dtype, tolerance) in [(DType::F64, 1e-6), (DType::F32, 2e-5)] {
            let tolerance = f64::max(tolerance, epsilon);
            let device = device();
            let moe = model
                .load_moe_layer(1, &device)
                .unwrap()
                .map(&mut Cast(dtype));
            let x = Tensor::<3>::from_data(read_f64(&golden, "x"), (&device, dtype)).require_grad();
            let g = Tensor::<3>::from_data(read_f64(&golden, "g"), (&device, dtype));
            let out = moe.forward(x.clone());
            let grads = (out.output.clone() * g).sum().backward();
            let f64s = |t: Tensor<2>| values(t.cast(DType::F64));
            let expert = |p: &Param<Tensor<3>>| {
                let grad = p.val().grad(&grads).unwrap();
                f64s(grad.narrow(0, 1, 1).squeeze_dim::<2>(0).transpose())
            };
            let got = [
                ("y", f64s(out.output.reshape([10, -1]))),
                ("router_logits", f64s(out.router_logits)),
                ("dx", f64s(x.grad(&grads).unwrap().reshape([10, -1]))),
                (
                    "d_router",
                    f64s(moe.router().weight.val().grad(&grads).unwrap().transpose()),
                ),
                ("d_gate", expert(moe.w_gate().unwrap())),
                ("d_up", expert(moe.w_up())),
                ("d_down", expert(moe.w_down())),
            ];
            for (key, actual) in got {
                let e = error(&actual, &expected(key));
                println!("{name} {dtype:?} {key}: {e:.1e}");
                assert!(e < tolerance, "{name} {dtype:?} {key}: {e:e}");
            }
        }
    }
}

/// A tensor of a file being edited: name, shape, values.
type Named = (String, Vec<usize>, Vec<f32>);

/// An f32 safetensors file with `edit` applied to its tensors.
fn edit_tensors(weights: &[u8], edit: &dyn Fn(&mut Vec<Named>)) -> Vec<u8> {
    let file = safetensors::SafeTensors::deserialize(weights).unwrap();
    let mut tensors: Vec<Named> = file
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let data = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            (name, view.shape().to_vec(), data)
        })
        .collect();
    edit(&mut tensors);
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(n, s, d)| (n, s, d.iter().flat_map(|v| v.to_le_bytes()).collect()))
        .collect();
    let views = bytes.iter().map(|(n, s, d)| {
        let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), d);
        (n.clone(), view.unwrap())
    });
    safetensors::serialize(views, None).unwrap()
}

/// A scratch copy of fixture `name` with `edit` applied to its `config.json`.
fn with_config(name: &str, edit: impl Fn(&mut serde_json::Value)) -> ffn_test_support::Scratch {
    let source = ffn_test_support::data_file(&format!("hf/{name}"));
    let text = std::fs::read_to_string(source.join("config.json")).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&text).unwrap();
    edit(&mut config);
    let dir = ffn_test_support::scratch(&format!("config-{name}"));
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    std::fs::copy(
        source.join("model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    dir
}

/// Layer 1's sparse block loaded from a folder of `config` and `weights`.
fn load_layer_1(config: &str, weights: &[u8]) -> Result<(), ffn_model::Error> {
    let dir = ffn_test_support::scratch("moe-broken");
    std::fs::write(dir.join("config.json"), config).unwrap();
    std::fs::write(dir.join("model.safetensors"), weights).unwrap();
    let model = ffn_model::HfModel::open(&*dir);
    model.and_then(|mut m| m.load_moe_layer(1, &Device::flex()).map(drop))
}

/// Edited MoE checkpoints and configs: each a typed error, never a panic.
#[test]
fn broken_moe_checkpoints_are_typed_errors() {
    use ffn_model::{Error, HfModel};
    let source = ffn_test_support::data_file("hf/mixtral");
    let config = std::fs::read_to_string(source.join("config.json")).unwrap();
    let weights = std::fs::read(source.join("model.safetensors")).unwrap();
    let prefix = "model.layers.1.block_sparse_moe.";
    let edited = |edit: &dyn Fn(&mut Vec<Named>)| edit_tensors(&weights, edit);
    let load = load_layer_1;
    assert!(load(&config, &weights).is_ok());
    let expert = |e: usize, w: &str| format!("{prefix}experts.{e}.{w}.weight");
    // An expert missing.
    let missing = edited(&|t| t.retain(|(n, ..)| *n != expert(3, "w2")));
    assert!(
        matches!(load(&config, &missing), Err(Error::MissingTensor { key, .. }) if key == expert(3, "w2"))
    );
    // An extra expert.
    let extra = edited(&|t| {
        let copy = t
            .iter()
            .find(|(n, ..)| *n == expert(0, "w1"))
            .unwrap()
            .clone();
        t.push((expert(4, "w1"), copy.1, copy.2));
    });
    assert!(
        matches!(load(&config, &extra), Err(Error::UnexpectedTensor { key, .. }) if key == expert(4, "w1"))
    );
    // Experts of unequal shapes.
    let unequal = edited(&|t| {
        let w = t.iter_mut().find(|(n, ..)| *n == expert(2, "w3")).unwrap();
        w.1 = vec![11, 16];
        w.2.truncate(11 * 16);
    });
    assert!(
        matches!(load(&config, &unequal), Err(Error::Shape { key, .. }) if key == expert(2, "w3"))
    );
    // A router of the wrong width.
    let router = edited(&|t| {
        let w = t
            .iter_mut()
            .find(|(n, ..)| *n == format!("{prefix}gate.weight"))
            .unwrap();
        w.1 = vec![3, 16];
        w.2.truncate(3 * 16);
    });
    assert!(matches!(load(&config, &router), Err(Error::Shape { .. })));
    // top-k above the expert count; no experts at all.
    for (from, to) in [
        ("\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 5"),
        ("\"num_local_experts\": 4", "\"num_local_experts\": 0"),
    ] {
        assert!(config.contains(from), "{from}");
        let bad = config.replace(from, to);
        assert!(
            matches!(load(&bad, &weights), Err(Error::HfConfig { .. })),
            "{to}"
        );
    }
    // A dense layer asked for as sparse, and a dense model asked for its MoE config.
    let deepseek = ffn_test_support::data_file("hf/deepseek_v3");
    let mut model = HfModel::open(&deepseek).unwrap();
    assert!(matches!(
        model.load_moe_layer(0, &Device::flex()),
        Err(Error::MissingTensor { .. })
    ));
    assert!(model.load_layer(0, &Device::flex()).is_ok());
    let llama = HfModel::open(ffn_test_support::data_file("hf/llama")).unwrap();
    assert!(matches!(llama.moe_config(), Err(Error::HfConfig { .. })));
}

/// Routings the MoE layer has no form for are typed errors that name what shows them, never a
/// layer that computes another function: JetMoE's output bias (the tensor), Cohere2-MoE's
/// averaged shared output (`shared_expert_combination_strategy = "average"`), a scoring
/// function other than softmax or sigmoid. A stated scoring is honoured: Cohere2-MoE's
/// `expert_selection_fn = "sigmoid"` and DeepSeek's `scoring_func` make sigmoid or softmax
/// scores, with or without a selection bias (ERNIE 4.5 chooses by softmax scores plus its
/// bias, the others by sigmoid ones); PhiMoE routes with SparseMixer, its
/// `router_jitter_noise` the band's `ε`.
#[test]
fn routings_without_a_form_are_refused_and_stated_scoring_is_honoured() {
    use ffn_model::{Error, HfModel, Scoring};
    let open = |name: &str| HfModel::open(ffn_test_support::data_file(&format!("hf/{name}")));
    for name in REFUSED {
        let mut model = open(name).unwrap();
        let result = model.load_moe_layer(1, &Device::flex()).map(drop);
        assert!(
            matches!(&result, Err(Error::UnexpectedTensor { key, .. })
                if key == "model.layers.1.mlp.bias"),
            "{name}: {result:?}"
        );
    }
    let refused = |name: &str, field: &str, value: serde_json::Value| {
        let dir = with_config(name, |c| c[field] = value.clone());
        let result = HfModel::open(&*dir).unwrap().moe_config();
        assert!(
            matches!(&result, Err(Error::HfConfig { field: f, .. }) if f == field),
            "{name} {field} = {value}: {result:?}"
        );
    };
    refused(
        "cohere2_moe",
        "shared_expert_combination_strategy",
        "average".into(),
    );
    refused("cohere2_moe", "expert_selection_fn", "sparsemixer".into());
    refused("deepseek_v3", "scoring_func", "tanh".into());
    refused("deepseek_v3", "scoring_func", 1.into());

    let scoring = |name: &str, field: &str, value: Option<&str>| {
        let dir = with_config(name, |c| {
            if let Some(v) = value {
                c[field] = v.into();
            }
        });
        let config = HfModel::open(&*dir).unwrap().moe_config().unwrap();
        (
            config.scoring,
            config.selection_bias,
            config.normalize_top_k,
        )
    };
    use Scoring::{Sigmoid, Softmax};
    let f = "expert_selection_fn";
    assert_eq!(scoring("cohere2_moe", f, None), (Softmax, false, true));
    assert_eq!(
        scoring("cohere2_moe", f, Some("sigmoid")),
        (Sigmoid, false, true)
    );
    assert_eq!(
        scoring("deepseek_v3", "scoring_func", None),
        (Sigmoid, true, true)
    );
    let stated = scoring("deepseek_v3", "scoring_func", Some("softmax"));
    assert_eq!(stated, (Softmax, true, true));
    assert_eq!(
        scoring("deepseek_v2", "scoring_func", Some("softmax")).0,
        Softmax
    );
    assert_eq!(scoring("ernie4_5_moe", "", None), (Softmax, true, true));
    for name in ["minimax_m2", "lfm2_moe", "afmoe"] {
        assert_eq!(scoring(name, "", None).0, Sigmoid, "{name}");
    }
    let phimoe = open("phimoe").unwrap().moe_config().unwrap();
    assert_eq!(
        (phimoe.scoring, phimoe.normalize_top_k, phimoe.jitter),
        (Scoring::SparseMixer, false, 0.3)
    );
}

/// A sparse layer loaded from a `transformers` checkpoint and saved back in its model type's
/// names holds exactly (bit for bit) the tensors `save_pretrained` wrote under its prefix;
/// a type that cannot hold the layer is refused.
#[test]
fn moe_layers_save_back_to_their_checkpoint_names() {
    use ffn_model::{Error, HfModel};
    for (name, prefix, follows, _) in SPARSE {
        let folder = ffn_test_support::data_file(&format!("hf/{name}"));
        let mut model = HfModel::open(&folder).unwrap();
        assert_eq!(model.moe_layer_prefix(1).unwrap(), prefix, "{name}");
        let Some(follows) = follows else { continue };
        // The scheme the keys show (OLMoE's is Qwen3-MoE's).
        let scheme = model.moe_scheme().unwrap();
        assert_eq!(
            scheme,
            follows.parse::<ffn_model::MoeScheme>().unwrap(),
            "{name}"
        );
        let moe = model.load_moe_layer(1, &Device::flex()).unwrap();
        let saved = moe.to_safetensors_bytes_as(scheme, prefix).unwrap();
        let saved = safetensors::SafeTensors::deserialize(&saved).unwrap();
        let original = std::fs::read(folder.join("model.safetensors")).unwrap();
        let original = safetensors::SafeTensors::deserialize(&original).unwrap();
        let mut expected: Vec<String> = original
            .names()
            .into_iter()
            .filter(|k| k.starts_with(prefix))
            .map(str::to_string)
            .collect();
        expected.sort();
        let mut got: Vec<String> = saved.names().into_iter().map(str::to_string).collect();
        got.sort();
        assert_eq!(got, expected, "{name}");
        for key in &got {
            let (a, b) = (saved.tensor(key).unwrap(), original.tensor(key).unwrap());
            assert_eq!(
                (a.shape(), a.dtype()),
                (b.shape(), b.dtype()),
                "{name} {key}"
            );
            assert!(a.data() == b.data(), "{name} {key}: values differ");
        }
        // A scheme of the other kind: with a selection bias where the layer has none, and
        // the reverse.
        let other = if moe.config().selection_bias {
            ffn_model::MoeScheme::Mixtral
        } else {
            ffn_model::MoeScheme::DeepseekV3
        };
        assert!(
            matches!(
                moe.to_safetensors_bytes_as(other, prefix),
                Err(Error::Scheme(_))
            ),
            "{name} as {other}"
        );
    }
}

/// `HfModel::moe_layers` finds each fixture's sparse layers by their keys, and they agree with
/// the config fields that state them (`first_k_dense_replace`, `moe_layers`,
/// `decoder_sparse_step`); a config that disagrees with the file is a typed error naming the
/// field. Llama 4's dense layer loads with `load_layer`, at its own width
/// (`intermediate_size_mlp`, not the experts' `intermediate_size`).
#[test]
fn sparse_layers_are_found_and_agree_with_the_config() {
    use ffn_model::{Error, HfModel};
    let dense: (&str, &str, Option<&str>, &[usize]) = ("llama", "", None, &[]);
    for (name, _, _, sparse) in SPARSE.into_iter().chain([dense]) {
        let model = HfModel::open(ffn_test_support::data_file(&format!("hf/{name}"))).unwrap();
        assert_eq!(model.moe_layers().unwrap(), sparse, "{name}");
    }

    // Configs edited to disagree with their files.
    for (name, field, value) in [
        ("deepseek_v3", "first_k_dense_replace", serde_json::json!(0)),
        ("llama4_text", "moe_layers", serde_json::json!([0, 1])),
        ("llama4_text", "moe_layers", serde_json::json!(["one"])),
        ("qwen2_moe", "decoder_sparse_step", serde_json::json!(2)),
        ("qwen2_moe", "decoder_sparse_step", serde_json::json!(0)),
    ] {
        let dir = with_config(name, |c| c[field] = value.clone());
        let result = HfModel::open(&*dir).unwrap().moe_layers();
        assert!(
            matches!(&result, Err(Error::HfConfig { field: f, .. }) if f == field),
            "{name} {field} = {value}: {result:?}"
        );
    }

    // Llama 4's dense layer: the width of `intermediate_size_mlp`, the file's weights. In the
    // multimodal model, the language model's (its fields in `text_config`), not the vision
    // tower's, which has more layers (and FFNs of another width).
    let multimodal = HfModel::open(ffn_test_support::data_file("hf/llama4")).unwrap();
    assert_eq!(
        multimodal.layer_prefix(0).unwrap(),
        "language_model.model.layers.0.feed_forward."
    );
    assert_eq!(multimodal.ffn_config().unwrap().d_ff, 20);
    assert_eq!(multimodal.num_layers().unwrap(), 2);
    let folder = ffn_test_support::data_file("hf/llama4_text");
    let mut model = HfModel::open(&folder).unwrap();
    let dense = model.load_layer(0, &Device::flex()).unwrap();
    assert_eq!((dense.d_model(), dense.d_ff()), (16, 20));
    let bytes = std::fs::read(folder.join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let stored: Vec<f64> = file
        .tensor("model.layers.0.feed_forward.down_proj.weight")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
        .collect();
    assert_eq!(values(dense.down().weight.val().transpose()), stored);
}

/// gpt-oss's packed layouts, edited: an interleaved `gate_up_proj` of odd width, an extra or a
/// missing expert in a packed tensor, a bias of the wrong width, a bias one layer lacks, a
/// `swiglu_limit` other than 7. Each is a typed error naming the key or field.
#[test]
fn broken_gpt_oss_checkpoints_are_typed_errors() {
    use ffn_model::Error;
    let source = ffn_test_support::data_file("hf/gpt_oss");
    let config = std::fs::read_to_string(source.join("config.json")).unwrap();
    let weights = std::fs::read(source.join("model.safetensors")).unwrap();
    let prefix = "model.layers.1.mlp.";
    // The file with tensor `key` reshaped to `shape` (values cut or padded with zeros), or
    // dropped.
    let edited = |key: &str, shape: Option<Vec<usize>>| {
        let key = format!("{prefix}{key}");
        edit_tensors(&weights, &|tensors| {
            tensors.retain(|(name, ..)| *name != key || shape.is_some());
            if let Some((_, s, values)) = tensors.iter_mut().find(|(name, ..)| *name == key) {
                *s = shape.clone().expect("kept");
                values.resize(s.iter().product(), 0.0);
            }
        })
    };
    let load = load_layer_1;
    assert!(load(&config, &weights).is_ok());
    let key = |k: &str| format!("{prefix}{k}");
    for (tensor, shape) in [
        ("experts.gate_up_proj", vec![4, 16, 23]),
        // An extra expert, a missing one: in the packed tensors, a shape error.
        ("experts.gate_up_proj", vec![5, 16, 24]),
        ("experts.down_proj", vec![3, 12, 16]),
        ("experts.gate_up_proj_bias", vec![4, 23]),
        ("experts.down_proj_bias", vec![4, 15]),
        ("router.bias", vec![5]),
    ] {
        let result = load(&config, &edited(tensor, Some(shape.clone())));
        assert!(
            matches!(&result, Err(Error::Shape { key: k, .. }) if *k == key(tensor)),
            "{tensor} {shape:?}: {result:?}"
        );
    }
    // A bias dropped from layer 1 but held by layer 0 (whose keys set the config).
    for tensor in [
        "experts.down_proj_bias",
        "experts.gate_up_proj_bias",
        "router.bias",
    ] {
        let result = load(&config, &edited(tensor, None));
        assert!(
            matches!(&result, Err(Error::MissingTensor { key: k, .. }) if *k == key(tensor)),
            "{tensor} dropped: {result:?}"
        );
    }
    // A clip this activation does not have.
    let other = config.replace("\"swiglu_limit\": 7.0", "\"swiglu_limit\": 10.0");
    assert_ne!(other, config);
    assert!(matches!(
        load(&other, &weights),
        Err(Error::HfConfig { field, .. }) if field == "swiglu_limit"
    ));
}

/// DBRX keeps its FFN's fields in `ffn_config`: one the reader cannot follow is a typed error
/// naming it there (a 2-norm of the top-k weights, an activation object without a name, more
/// experts per token than experts).
#[test]
fn broken_dbrx_configs_name_their_ffn_config_field() {
    use ffn_model::{Error, HfModel};
    for (field, value) in [
        ("moe_normalize_expert_weights", serde_json::json!(2.0)),
        ("ffn_act_fn", serde_json::json!({"kind": "silu"})),
        ("moe_top_k", serde_json::json!(5)),
    ] {
        let dir = with_config("dbrx", |c| c["ffn_config"][field] = value.clone());
        let result = HfModel::open(&*dir).and_then(|m| m.moe_config());
        let expected = format!("ffn_config.{field}");
        assert!(
            matches!(&result, Err(Error::HfConfig { field: f, .. }) if *f == expected),
            "{field}: {result:?}"
        );
    }
}
