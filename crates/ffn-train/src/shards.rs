//! # Data-parallel steps on the CPU
//!
//! A step's batch is split into shards, one per rayon thread (`train.shards`); each computes
//! its loss and gradients with its own dropout masks, and the gradients are summed, so that the
//! step is the same whatever the number of shards. Also the sparse layers' routing statistics
//! of a step, for the metrics.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor};
use rayon::prelude::*;

use crate::config::{ModelConfig, TrainConfig};
use crate::data::Batch;
use crate::model::Model;
use crate::rng::Rng;

/// Adds the gradients of `from` into `into`, parameter by parameter.
struct Accumulate<'a> {
    into: &'a mut GradientsParams,
    from: GradientsParams,
}

impl ModuleVisitor for Accumulate<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(g) = self.from.remove::<D>(param.id) {
            let sum = match self.into.remove::<D>(param.id) {
                Some(total) => total + g,
                None => g,
            };
            self.into.register(param.id, sum);
        }
    }
}

/// The same parameters as new autodiff leaves: a shard's copy of the model, whose graph
/// shares no node with another shard's.
struct Leaves;

impl ModuleMapper for Leaves {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let id = param.id;
        let tracked = param.is_require_grad();
        let t = param.val().detach();
        Param::initialized(id, if tracked { t.require_grad() } else { t })
    }
}

/// The shards a batch is cut into on `device` (see [`TrainSettings::shards`]).
pub fn shards(config: &TrainConfig, device: &Device) -> usize {
    match config.train.shards {
        0 if is_cpu(device) => rayon::current_num_threads(),
        0 => 1,
        n => n,
    }
}

/// Whether `device` is one of the CPU backends.
fn is_cpu(device: &Device) -> bool {
    match device.clone().without_autodiff().as_dispatch() {
        #[cfg(feature = "flex")]
        burn::backend::DispatchDevice::Flex(_) => true,
        #[cfg(feature = "ndarray")]
        burn::backend::DispatchDevice::NdArray(_) => true,
        #[allow(unreachable_patterns)]
        _ => false,
    }
}

/// Where the dropout masks of a training step come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Masks {
    /// The model has no dropout.
    None,
    /// The FFNs' dropout only: each shard's from its own stream, seeded from this one
    /// ([`ffn_model::dropout::with_seed`]).
    PerShard(u64),
    /// Dropout outside the FFNs too (burn's attention): the device's random stream.
    Device,
}

impl Masks {
    /// The masks of step `step` of a run of `config` with seed `seed`.
    pub fn of(config: &TrainConfig, seed: u64, step: usize) -> Masks {
        let attention =
            matches!(&config.model, ModelConfig::Transformer(m) if m.attention_dropout > 0.0);
        if !config.uses_dropout() {
            Masks::None
        } else if attention {
            Masks::Device
        } else {
            Masks::PerShard(Rng::derive_seed(seed, "ffn-dropout", step as u64))
        }
    }
}

/// The mean loss of `batch` and its gradients, the batch cut into `shards` parts computed at
/// once (data parallelism over the CPU's threads).
///
/// Shard `i` holds `n_i` of the batch's `n` examples; it runs forward and backward on its own
/// copy of the parameters (the same values, new autodiff leaves) and
///
/// ```text
/// L = Σ_i (n_i / n) L_i          ∇L = Σ_i (n_i / n) ∇L_i
/// ```
///
/// which is the batch's mean loss and gradient up to the order of float additions (every loss
/// here is a mean over independent examples). The shards are summed in order, so a run stays
/// reproducible for a given shard count.
///
/// Dropout masks (see [`Masks`]): with [`Masks::PerShard`] and more than one shard, shard `i`
/// draws the FFNs' masks from its own seeded stream, so the shards run at once and a run stays reproducible; with
/// [`Masks::Device`] the shards' forward passes run one after another on this thread, in shard
/// order, so that they draw from the device's one random stream in the same order on every
/// run, and only their backward passes run at once.
pub fn loss_and_gradients(
    model: &Model,
    batch: &Batch,
    shards: usize,
    masks: Masks,
) -> (f64, GradientsParams, Routing) {
    let n = batch.len().max(1) as f64;
    let parts = batch.split(shards);
    // Shard `i`'s forward pass, in its dropout stream: its loss, and the loss it trains on
    // (with the sparse layers' auxiliary losses), both weighted by its share of the batch.
    let forward = |copy: &Model, part: &Batch, i: usize, weight: f64| {
        let (loss, aux) = match masks {
            Masks::PerShard(seed) => {
                let seed = Rng::derive_seed(seed, "shard", i as u64);
                ffn_model::dropout::with_seed(seed, || copy.loss_with_aux(part))
            }
            Masks::None | Masks::Device => copy.loss_with_aux(part),
        };
        let loss = loss * weight;
        let objective = match &aux.loss {
            Some(extra) => loss.clone() + extra.clone() * weight,
            None => loss.clone(),
        };
        (loss, objective, Routing::of(aux, weight))
    };
    let backward = |copy: &Model, (loss, objective, routing): (Tensor<1>, Tensor<1>, Routing)| {
        let value = loss.into_scalar::<f64>();
        (
            value,
            GradientsParams::from_grads(objective.backward(), copy),
            routing,
        )
    };
    if parts.len() == 1 {
        // One shard (a GPU, or `train.shards = 1`): the device's stream, where the masks are
        // drawn on the device.
        return backward(model, forward(model, batch, 0, 1.0));
    }
    let copies: Vec<Model> = parts
        .iter()
        .map(|_| model.clone().map(&mut Leaves))
        .collect();
    let results: Vec<(f64, GradientsParams, Routing)> = if matches!(masks, Masks::Device) {
        let losses: Vec<_> = copies
            .iter()
            .zip(&parts)
            .enumerate()
            .map(|(i, (copy, part))| forward(copy, part, i, part.len() as f64 / n))
            .collect();
        copies
            .into_par_iter()
            .zip(losses)
            .with_max_len(1)
            .map(|(copy, loss)| backward(&copy, loss))
            .collect()
    } else {
        copies
            .into_par_iter()
            .zip(parts.into_par_iter())
            .enumerate()
            .with_max_len(1)
            .map(|(i, (copy, part))| {
                let weight = part.len() as f64 / n;
                backward(&copy, forward(&copy, &part, i, weight))
            })
            .collect()
    };
    let mut results = results.into_iter();
    let (mut loss, mut grads, mut routing) = results.next().expect("at least one shard");
    for (value, from, shard) in results {
        loss += value;
        routing.add(shard);
        model.visit(&mut Accumulate {
            into: &mut grads,
            from,
        });
    }
    (loss, grads, routing)
}

/// How the sparse layers routed one step's batch, in layer order (empty without them).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Routing {
    /// Each layer's token–expert pairs per expert, summed over the shards.
    pub loads: Vec<Vec<usize>>,
    /// Each layer's fraction of pairs dropped by capacity, over the batch.
    pub dropped: Vec<f64>,
}

impl Routing {
    /// A shard's routing, its dropped fractions weighted by its share of the batch.
    fn of(aux: crate::model::Aux, weight: f64) -> Self {
        Self {
            loads: aux.loads,
            dropped: aux.dropped.into_iter().map(|d| d * weight).collect(),
        }
    }

    fn add(&mut self, other: Routing) {
        for (mine, theirs) in self.loads.iter_mut().zip(other.loads) {
            for (a, b) in mine.iter_mut().zip(theirs) {
                *a += b;
            }
        }
        for (a, b) in self.dropped.iter_mut().zip(other.dropped) {
            *a += b;
        }
    }

    /// Over all sparse layers: the largest expert load over the mean load (1 when balanced),
    /// the loads' coefficient of variation (0 when balanced), and the mean dropped fraction;
    /// `None` without sparse layers.
    pub fn summary(&self) -> Option<(f64, f64, f64)> {
        if self.loads.is_empty() {
            return None;
        }
        let (mut max_over_mean, mut cv) = (0f64, 0f64);
        for load in &self.loads {
            let n = load.len().max(1) as f64;
            let mean = load.iter().sum::<usize>() as f64 / n;
            let max = load.iter().copied().max().unwrap_or(0) as f64;
            let var = load.iter().map(|&l| (l as f64 - mean).powi(2)).sum::<f64>() / n;
            if mean > 0.0 {
                max_over_mean = max_over_mean.max(max / mean);
                cv = cv.max(var.sqrt() / mean);
            }
        }
        let dropped = self.dropped.iter().sum::<f64>() / self.dropped.len() as f64;
        Some((max_over_mean, cv, dropped))
    }
}
