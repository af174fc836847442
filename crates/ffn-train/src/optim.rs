//! # The optimiser: AdamW whose state lives on the run's device, its schedule and clipping
//!
//! AdamW (Loshchilov & Hutter, 2019) keeps two moments per parameter θ with gradient g:
//!
//! ```text
//! m ← β₁ m + (1 − β₁) g        v ← β₂ v + (1 − β₂) g²
//! θ ← θ (1 − η λ) − η · m̂ / (√v̂ + ε),   m̂ = m / (1 − β₁ᵗ), v̂ = v / (1 − β₂ᵗ)
//! ```
//!
//! burn's AdamW computes this. What this module adds is *where* `m` and `v` are made when a
//! checkpoint is loaded: burn's `ModuleOptimizer::load_record` builds them on
//! `Device::default()`, which is whichever backend cargo compiled in first (wgpu or CUDA in a
//! GPU build), so resuming a CPU run would start a GPU runtime (and the reverse). [`Placed`]
//! wraps AdamW and builds every loaded state on the device it was given: the run's.

use burn::module::ParamGroup;
use burn::optim::{
    AdamWConfig, DynOptimizer, DynState, LearningRate, ModuleOptimizer, StateSink, StateSource,
};
use burn::tensor::Device;
use burn::tensor::kind::BridgeTensor;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;

use crate::config::TrainSettings;
use crate::model::Model;

/// The run's AdamW (β₁, β₂, ε = 1e-8, decoupled weight decay λ), whose state is built on
/// `device` when a checkpoint is loaded (see the module docs).
pub fn optimizer(t: &TrainSettings, device: &Device) -> ModuleOptimizer {
    let adamw = AdamWConfig::new()
        .with_beta_1(t.beta1 as f32)
        .with_beta_2(t.beta2 as f32)
        .with_epsilon(1e-8)
        .with_weight_decay(t.weight_decay as f32)
        .build();
    // The last group a parameter matches decides its optimiser: `all` makes it `Placed` for
    // every parameter (the first group is the fallback burn requires).
    ModuleOptimizer::from(adamw.clone()).with_group(
        ParamGroup::all(),
        Placed::new(adamw, device),
        None,
    )
}

/// An optimiser whose loaded state is built on `device`: everything else is `O`'s.
#[derive(Clone)]
pub struct Placed<O> {
    inner: O,
    /// Where the state's tensors are made: the device the parameters' gradients are on.
    device: Device,
}

impl<O> Placed<O> {
    /// `inner`, loading its state onto `device` (an autodiff device is taken without its
    /// autodiff layer: the optimiser's state is not part of the graph).
    pub fn new(inner: O, device: &Device) -> Self {
        Self {
            inner,
            device: device.clone().inner(),
        }
    }
}

impl<O: DynOptimizer> DynOptimizer for Placed<O> {
    fn step_dyn(
        &self,
        rank: usize,
        lr: LearningRate,
        tensor: BridgeTensor,
        grad: BridgeTensor,
        state: Option<DynState>,
    ) -> (BridgeTensor, Option<DynState>) {
        self.inner.step_dyn(rank, lr, tensor, grad, state)
    }

    fn to_device_dyn(&self, state: DynState, device: &Device) -> DynState {
        self.inner.to_device_dyn(state, device)
    }

    fn state_flatten(&self, prefix: &str, state: &DynState, out: &mut StateSink) {
        self.inner.state_flatten(prefix, state, out)
    }

    /// `O`'s state rebuilt on this optimiser's device, whatever device burn passes.
    fn state_unflatten(
        &self,
        rank: usize,
        prefix: &str,
        src: &mut StateSource,
        _device: &Device,
    ) -> Option<DynState> {
        self.inner.state_unflatten(rank, prefix, src, &self.device)
    }
}

#[cfg(all(test, feature = "flex"))]
mod tests {
    use super::*;
    use burn::optim::AdamWState;
    use burn::tensor::{Distribution, Tensor};

    /// A state made by a step and one rebuilt from its record are on the same device: the one
    /// the optimiser was given, never burn's default.
    #[test]
    fn loaded_state_is_built_on_the_given_device() {
        let device = Device::flex().autodiff();
        let optim = Placed::new(AdamWConfig::new().build(), &device);
        let inner = device.clone().inner();
        let param = Tensor::<2>::random([3, 4], Distribution::Default, &inner);
        let grad = Tensor::<2>::random([3, 4], Distribution::Default, &inner);
        let (_, state) = optim.step_dyn(2, 1e-3, param.into_bridge(), grad.into_bridge(), None);
        let stepped = state.expect("AdamW keeps a state");
        let moments = |s: &DynState| {
            let s = s.downcast_ref::<AdamWState<2>>();
            (s.momentum.moment_1.clone(), s.momentum.moment_2.clone())
        };
        let (m, v) = moments(&stepped);

        let mut sink = StateSink::default();
        optim.state_flatten("7", &stepped, &mut sink);
        let mut source = StateSource::new(sink.scalars.into_iter().collect());
        for (name, data) in sink.tensors {
            source.insert_tensor(name, data);
        }
        // Whatever burn passes (its default device, in a build with a GPU backend: a GPU).
        let elsewhere = Device::default();
        let loaded = optim
            .state_unflatten(2, "7", &mut source, &elsewhere)
            .expect("the state is rebuilt");
        let (m2, v2) = moments(&loaded);
        assert_eq!(m2.device(), inner);
        assert_eq!(v2.device(), inner);
        assert_eq!(m2.device(), m.device());
        m2.into_data().assert_eq(&m.into_data(), true);
        v2.into_data().assert_eq(&v.into_data(), true);
    }
}

/// The learning rate after `step` completed steps: linear warm-up from `lr / warmup` to `lr`
/// over `warmup_steps`, then cosine decay to `min_lr` at the last step.
pub fn learning_rate(t: &TrainSettings, step: usize) -> f64 {
    let warmup = t.warmup_steps.min(t.steps);
    if step < warmup {
        return t.lr * (step + 1) as f64 / warmup as f64;
    }
    let decay_steps = (t.steps - warmup).max(1) as f64;
    let progress = ((step - warmup) as f64 / decay_steps).min(1.0);
    t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + (std::f64::consts::PI * progress).cos())
}

/// `Σ ‖g‖²` over the module's parameters.
struct SquaredNorm<'a> {
    grads: &'a GradientsParams,
    total: Option<Tensor<1>>,
}

impl ModuleVisitor for SquaredNorm<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(g) = self.grads.get::<D>(param.id) {
            let s = g.square().sum();
            self.total = Some(match self.total.take() {
                Some(t) => t + s,
                None => s,
            });
        }
    }
}

/// Multiplies every gradient by a factor.
struct Scale<'a> {
    grads: &'a mut GradientsParams,
    factor: f64,
}

impl ModuleVisitor for Scale<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(g) = self.grads.remove::<D>(param.id) {
            self.grads.register(param.id, g * self.factor);
        }
    }
}

/// Clips the global gradient norm to `max_norm` (no-op for 0); returns the norm before.
pub fn clip_global_norm(model: &Model, grads: &mut GradientsParams, max_norm: f64) -> f64 {
    let mut norm = SquaredNorm { grads, total: None };
    model.visit(&mut norm);
    let norm = norm.total.map_or(0.0, |t| t.into_scalar::<f64>().sqrt());
    if max_norm > 0.0 && norm > max_norm {
        model.visit(&mut Scale {
            grads,
            factor: max_norm / norm,
        });
    }
    norm
}
