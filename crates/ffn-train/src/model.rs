//! # The networks trained
//!
//! - [`TransformerLm`]: a decoder-only transformer (Radford et al. 2018, GPT-2's pre-norm
//!   layout): token and position embeddings, `n_layers` blocks
//!   `x ← x + Attention(LN(x))`, `x ← x + FFN(LN(x))` with causal multi-head self-attention
//!   (burn's) and our [`FeedForward`], a final layer norm and a linear head.
//! - [`WindowLm`]: an FFN-only language model (Bengio et al. 2003, with a residual FFN): the
//!   embeddings of the last `window` tokens, concatenated and projected to `d_model`, then
//!   `x + FFN(LN(x))` and a linear head.
//! - For regression, the [`FeedForward`] itself.
//!
//! Each of them can hold a sparse mixture of experts ([`Moe`]) in place of the
//! [`FeedForward`] (`model.ffn.moe`): see [`Mlp`]. Its auxiliary losses are added to the
//! training loss ([`Model::loss_with_aux`]), never to the reported or validation loss.

use burn::module::{Flag, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::nn::attention::{MhaInput, MultiHeadAttention, MultiHeadAttentionConfig};
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::{Bool, Device, Int, Tensor};
use ffn_model::{FeedForward, FeedForwardConfig, Moe, Precision, linear};

use crate::config::{ModelConfig, TaskConfig, TrainConfig};
use crate::data::Batch;
use crate::error::{Error, Result};

/// The feed-forward layer of a model: dense, or a sparse mixture of experts.
#[derive(Module, Debug)]
#[allow(clippy::large_enum_variant)] // a few per model
pub enum Mlp {
    /// One [`FeedForward`].
    Dense(FeedForward),
    /// A [`Moe`] of FeedForward experts.
    Sparse(Moe),
}

/// What the sparse layers of one forward pass report, in layer order.
#[derive(Debug, Default)]
pub struct Aux {
    /// The sum of their auxiliary losses (`None` without sparse layers).
    pub loss: Option<Tensor<1>>,
    /// Each layer's token–expert pairs per expert.
    pub loads: Vec<Vec<usize>>,
    /// Each layer's fraction of pairs dropped by capacity.
    pub dropped: Vec<f64>,
}

impl Mlp {
    /// The layer's output, its auxiliary loss and load noted in `aux`.
    fn forward<const D: usize>(&self, x: Tensor<D>, aux: &mut Aux) -> Tensor<D> {
        match self {
            Mlp::Dense(ffn) => ffn.forward(x),
            Mlp::Sparse(moe) => {
                let out = moe.forward(x);
                aux.loss = Some(match aux.loss.take() {
                    Some(sum) => sum + out.aux_loss,
                    None => out.aux_loss,
                });
                aux.loads.push(out.tokens_per_expert);
                aux.dropped.push(out.dropped_fraction);
                out.output
            }
        }
    }

    /// The aux-loss-free balancing update of a sparse layer with a selection bias, from the
    /// next of `loads` (one per sparse layer, in order).
    fn update_selection_bias<'a>(self, loads: &mut impl Iterator<Item = &'a Vec<usize>>) -> Self {
        match self {
            Mlp::Sparse(moe) => match loads.next() {
                Some(load) => Mlp::Sparse(moe.update_selection_bias(load)),
                None => Mlp::Sparse(moe),
            },
            dense => dense,
        }
    }
}

/// A pre-norm transformer block.
#[derive(Module, Debug)]
pub struct Block {
    norm_attention: LayerNorm,
    attention: MultiHeadAttention,
    norm_ffn: LayerNorm,
    ffn: Mlp,
    /// The matrix products' precision (the FFN's): the attention's projections and op follow it.
    #[module(skip)]
    precision: Precision,
}

impl Block {
    /// `x ← x + Attention(LN(x))`, then `x ← x + FFN(LN(x))`.
    fn forward(&self, x: Tensor<3>, causal: &Causal, aux: &mut Aux) -> Tensor<3> {
        let h = normalise(&self.norm_attention, x.clone());
        let attended = self.attend(h, causal);
        let x = x + attended;
        let h = normalise(&self.norm_ffn, x.clone());
        x + self.ffn.forward(h, aux)
    }
}

impl Block {
    /// Whether the attention op computes this block's attention of `x` (Flex, no attention
    /// dropout, plain softmax); else burn's `MultiHeadAttention` does, with the mask.
    #[cfg(feature = "flex")]
    fn uses_op(&self, x: &Tensor<3>) -> bool {
        crate::ops::attention::supported(x)
            && self.attention.dropout.prob == 0.0
            && !self.attention.quiet_softmax
    }

    /// Causal self-attention of `h`, through the op where it runs: its projections and products
    /// in the block's precision. (burn's `MultiHeadAttention`, where the op does not run,
    /// computes in f32.)
    fn attend(&self, h: Tensor<3>, causal: &Causal) -> Tensor<3> {
        #[cfg(feature = "flex")]
        if self.uses_op(&h) {
            let (a, precision) = (&self.attention, self.precision);
            let h = rounded_once(h, precision);
            let (q, k, v) = (
                linear(&a.query, h.clone(), precision),
                linear(&a.key, h.clone(), precision),
                linear(&a.value, h, precision),
            );
            let o = crate::ops::attention::causal_attention(q, k, v, a.n_heads, precision);
            return linear(&a.output, o, precision);
        }
        self.attention
            .forward(MhaInput::self_attn(h).mask_attn(causal.mask()))
            .context
    }
}

/// ε of the models' layer norms (burn's default, written out: the layer-norm op is given it, as
/// burn keeps a norm's own ε private).
const NORM_EPSILON: f64 = 1e-5;

/// A layer norm over `d_model` values, with a bias.
fn layer_norm(d_model: usize, device: &Device) -> LayerNorm {
    LayerNormConfig::new(d_model)
        .with_epsilon(NORM_EPSILON)
        .init(device)
}

/// `norm(x)`: on Flex through the layer-norm op (`ops/layer_norm.rs`: one tensor kept for the
/// backward pass instead of two, and two passes each way), elsewhere burn's `LayerNorm`.
fn normalise<const D: usize>(norm: &LayerNorm, x: Tensor<D>) -> Tensor<D> {
    #[cfg(feature = "flex")]
    return crate::ops::layer_norm::layer_norm(norm, x, NORM_EPSILON);
    #[cfg(not(feature = "flex"))]
    norm.forward(x)
}

/// `h` as the query, key and value projections take it: in bf16, rounded here once (each
/// projection would round it, and keep its copy for the backward pass, itself: three copies),
/// its gradient passed straight through to `h` as f32 (autodiff's cast). The same function: the
/// projections take an operand already bf16 as it is.
#[cfg(feature = "flex")]
fn rounded_once(h: Tensor<3>, precision: Precision) -> Tensor<3> {
    match precision {
        Precision::Bf16 => h.cast(burn::tensor::DType::BF16),
        Precision::F32 => h,
    }
}

/// The causal mask `[batch, T, T]` (true above the diagonal: position `i` attends to `j ≤ i`
/// only), built on first use: the attention op needs none.
struct Causal {
    dims: [usize; 2],
    device: Device,
    mask: std::cell::OnceCell<Tensor<3, Bool>>,
}

impl Causal {
    fn mask(&self) -> Tensor<3, Bool> {
        let [batch, seq] = self.dims;
        self.mask
            .get_or_init(|| {
                Tensor::<2, Bool>::tril_mask([seq, seq], 0, &self.device).expand([batch, seq, seq])
            })
            .clone()
    }
}

/// A decoder-only transformer language model.
#[derive(Module, Debug)]
pub struct TransformerLm {
    token_embedding: Embedding,
    position_embedding: Embedding,
    blocks: Vec<Block>,
    norm: LayerNorm,
    head: Linear,
    #[module(skip)]
    precision: Precision,
}

impl TransformerLm {
    /// Logits `[batch, seq, vocab]` of the next token after each prefix of `tokens` `[batch, seq]`.
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        self.forward_aux(tokens, &mut Aux::default())
    }

    /// [`forward`](Self::forward), noting what sparse layers report in `aux`.
    pub fn forward_aux(&self, tokens: Tensor<2, Int>, aux: &mut Aux) -> Tensor<3> {
        let [batch, seq] = tokens.dims();
        let device = tokens.device();
        let positions = Tensor::<1, Int>::arange(0..seq as i64, &device).reshape([1, seq]);
        let mut x =
            self.token_embedding.forward(tokens) + self.position_embedding.forward(positions);
        let causal = Causal {
            dims: [batch, seq],
            device,
            mask: Default::default(),
        };
        for block in &self.blocks {
            x = block.forward(x, &causal, aux);
        }
        linear(&self.head, normalise(&self.norm, x), self.precision)
    }
}

/// An FFN-only language model over a fixed window of previous tokens.
#[derive(Module, Debug)]
pub struct WindowLm {
    /// `vocab + 1` rows: the last one pads windows before the start of a sequence.
    embedding: Embedding,
    input: Linear,
    norm: LayerNorm,
    ffn: Mlp,
    head: Linear,
    #[module(skip)]
    window: usize,
    #[module(skip)]
    precision: Precision,
}

impl WindowLm {
    /// Logits `[batch, seq, vocab]` from the last `window` tokens at each position.
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        self.forward_aux(tokens, &mut Aux::default())
    }

    /// [`forward`](Self::forward), noting what a sparse layer reports in `aux`.
    pub fn forward_aux(&self, tokens: Tensor<2, Int>, aux: &mut Aux) -> Tensor<3> {
        let [batch, seq] = tokens.dims();
        let w = self.window;
        let pad_id = self.embedding.weight.lazy_shape().dims::<2>()[0] as i64 - 1;
        let pad = Tensor::<2, Int>::full([batch, w - 1], pad_id, &tokens.device());
        let padded = Tensor::cat(vec![pad, tokens], 1);
        // Column j of the window at position t is token t − (w − 1) + j.
        let columns: Vec<Tensor<3>> = (0..w)
            .map(|j| {
                self.embedding
                    .forward(padded.clone().slice([0..batch, j..j + seq]))
            })
            .collect();
        let x = linear(&self.input, Tensor::cat(columns, 2), self.precision);
        let x = x.clone() + self.ffn.forward(normalise(&self.norm, x), aux);
        linear(&self.head, x, self.precision)
    }
}

/// Numbers the parameters `1, 2, 3, …` in the model's field order.
///
/// burn gives each parameter a random id, which its records store and the optimiser's state is
/// keyed by: numbered, a checkpoint is the same bytes whichever process wrote it, so a run that
/// was killed and resumed ends with exactly the files of a run in one go.
pub fn number_params(model: Model) -> Model {
    struct Numbering(u64);
    impl Numbering {
        fn next(&mut self) -> ParamId {
            self.0 += 1;
            ParamId::from(self.0)
        }
    }
    impl ModuleMapper for Numbering {
        fn map_float<const D: usize>(&mut self, mut param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            param.id = self.next();
            param
        }
        fn map_int<const D: usize>(
            &mut self,
            mut param: Param<Tensor<D, Int>>,
        ) -> Param<Tensor<D, Int>> {
            param.id = self.next();
            param
        }
        fn map_bool<const D: usize>(
            &mut self,
            mut param: Param<Tensor<D, Bool>>,
        ) -> Param<Tensor<D, Bool>> {
            param.id = self.next();
            param
        }
        fn map_flag(&mut self, mut flag: Param<Flag>) -> Param<Flag> {
            flag.id = self.next();
            flag
        }
    }
    model.map(&mut Numbering(0))
}

/// The network of a run.
#[derive(Module, Debug)]
#[allow(clippy::large_enum_variant)] // one per run; burn's Module derive does not see through a Box
pub enum Model {
    /// A transformer language model.
    Transformer(TransformerLm),
    /// An FFN-only language model.
    Window(WindowLm),
    /// A bare FFN (regression).
    Ffn(Mlp),
}

impl Model {
    /// Builds the model of `config` (its FFN resolved: `ffn_config`, see [`TrainConfig::ffn`]) on
    /// `device` for a vocabulary of `vocab_size` tokens (unused by regression), its weights
    /// drawn from the device's RNG (seed it first for reproducible initialisation).
    pub fn new(
        config: &TrainConfig,
        ffn_config: &FeedForwardConfig,
        vocab_size: usize,
        device: &Device,
    ) -> Result<Self> {
        let moe = config.moe()?;
        let precision = ffn_config.precision;
        let ffn = || {
            match &moe {
                Some(moe) => moe.try_init(device).map(Mlp::Sparse),
                None => ffn_config.try_init(device).map(Mlp::Dense),
            }
            .map_err(|source| Error::Ffn {
                context: if moe.is_some() {
                    "model.ffn.moe"
                } else {
                    "model.ffn"
                }
                .into(),
                source,
            })
        };
        let (vocab, seq_len) = match &config.task {
            TaskConfig::Markov(m) => (vocab_size, m.seq_len),
            TaskConfig::Text(t) => (vocab_size, t.seq_len),
            TaskConfig::Teacher(_) | TaskConfig::Sine(_) => (0, 0),
        };
        Ok(match &config.model {
            ModelConfig::Transformer(m) => {
                let blocks = (0..m.n_layers)
                    .map(|_| {
                        Ok(Block {
                            norm_attention: layer_norm(m.d_model, device),
                            attention: MultiHeadAttentionConfig::new(m.d_model, m.n_heads)
                                .with_dropout(m.attention_dropout)
                                .init(device),
                            norm_ffn: layer_norm(m.d_model, device),
                            ffn: ffn()?,
                            precision,
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                Model::Transformer(TransformerLm {
                    token_embedding: EmbeddingConfig::new(vocab, m.d_model).init(device),
                    position_embedding: EmbeddingConfig::new(seq_len, m.d_model).init(device),
                    blocks,
                    norm: layer_norm(m.d_model, device),
                    head: LinearConfig::new(m.d_model, vocab).init(device),
                    precision,
                })
            }
            ModelConfig::Window(m) => Model::Window(WindowLm {
                embedding: EmbeddingConfig::new(vocab + 1, m.d_embed).init(device),
                input: LinearConfig::new(m.window * m.d_embed, m.d_model).init(device),
                norm: layer_norm(m.d_model, device),
                ffn: ffn()?,
                head: LinearConfig::new(m.d_model, vocab).init(device),
                window: m.window,
                precision,
            }),
            ModelConfig::Ffn(_) => Model::Ffn(ffn()?),
        })
    }

    /// Next-token logits `[batch, seq, vocab]` of a language model; `None` for regression.
    pub fn logits(&self, tokens: Tensor<2, Int>) -> Option<Tensor<3>> {
        match self {
            Model::Transformer(m) => Some(m.forward(tokens)),
            Model::Window(m) => Some(m.forward(tokens)),
            Model::Ffn(_) => None,
        }
    }

    /// The longest context a language model takes (the transformer's position table).
    pub fn max_context(&self) -> Option<usize> {
        match self {
            Model::Transformer(m) => Some(m.position_embedding.weight.lazy_shape().dims::<2>()[0]),
            Model::Window(_) => Some(usize::MAX),
            Model::Ffn(_) => None,
        }
    }

    /// The mean loss of a batch: cross-entropy in nats per token, or squared error per output.
    ///
    /// # Panics
    ///
    /// If the batch does not fit the model (a language batch for a regression model).
    pub fn loss(&self, batch: &Batch) -> Tensor<1> {
        self.loss_with_aux(batch).0
    }

    /// [`loss`](Self::loss), and what the sparse layers report: their auxiliary losses, for
    /// the training loss `loss + aux.loss`, and their loads.
    ///
    /// # Panics
    ///
    /// If the batch does not fit the model.
    pub fn loss_with_aux(&self, batch: &Batch) -> (Tensor<1>, Aux) {
        let mut aux = Aux::default();
        let loss = match (self, batch) {
            (Model::Ffn(ffn), Batch::Pairs { x, y }) => (ffn.forward(x.clone(), &mut aux)
                - y.clone())
            .powi_scalar(2)
            .mean(),
            (model, Batch::Tokens(tokens)) => {
                let [batch, len] = tokens.dims();
                let seq = len - 1;
                let inputs = tokens.clone().slice([0..batch, 0..seq]);
                let targets = tokens
                    .clone()
                    .slice([0..batch, 1..len])
                    .reshape([batch * seq]);
                let logits = match model {
                    Model::Transformer(m) => m.forward_aux(inputs, &mut aux),
                    Model::Window(m) => m.forward_aux(inputs, &mut aux),
                    Model::Ffn(_) => panic!("a language batch for a regression model"),
                };
                let vocab = logits.dims()[2];
                crate::ops::loss::cross_entropy(logits.reshape([batch * seq, vocab]), targets)
            }
            _ => panic!("the batch does not match the model"),
        };
        (loss, aux)
    }

    /// The aux-loss-free balancing update of every sparse layer with a selection bias
    /// (DeepSeek-V3), from each sparse layer's load of the step (`Aux::loads`, in order).
    pub fn update_selection_bias(self, loads: &[Vec<usize>]) -> Self {
        let mut loads = loads.iter();
        match self {
            Model::Transformer(mut m) => {
                m.blocks = m
                    .blocks
                    .into_iter()
                    .map(|mut b| {
                        b.ffn = b.ffn.update_selection_bias(&mut loads);
                        b
                    })
                    .collect();
                Model::Transformer(m)
            }
            Model::Window(mut m) => {
                m.ffn = m.ffn.update_selection_bias(&mut loads);
                Model::Window(m)
            }
            Model::Ffn(ffn) => Model::Ffn(ffn.update_selection_bias(&mut loads)),
        }
    }
}

/// The mean loss of a model over batches (validation mode, no autodiff).
pub fn evaluate(model: &Model, batches: &[Batch]) -> f64 {
    let model = model.valid();
    let total: f64 = batches
        .iter()
        .map(|b| model.loss(b).into_scalar::<f64>())
        .sum();
    total / batches.len() as f64
}

/// Initialises every (lazily initialised) parameter.
pub(crate) struct Materialize;

impl ModuleVisitor for Materialize {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let _ = param.val();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TrainConfig;
    use crate::data::Task;
    use burn::tensor::TensorData;

    /// A tiny language model of `kind` ("transformer" or "window") with a fixed initialisation.
    ///
    /// burn's device RNG is process-wide and the library's tests run in parallel: seeding and
    /// drawing the weights happen under one lock, so every call gets the same weights.
    fn lm(kind: &str) -> (Model, Device) {
        static INIT: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let text = format!(
            "[task]\nkind = \"markov\"\nvocab_size = 5\nseq_len = 6\n[model]\nkind = \"{kind}\"\n\
             d_model = 16\nwindow = 3\nffn = {{ preset = \"SwiGLU\" }}\n"
        )
        .replace(
            "window = 3\n",
            if kind == "window" { "window = 3\n" } else { "" },
        );
        let config = TrainConfig::from_toml(&text, &[]).unwrap();
        let device = Device::flex();
        let ffn = config.ffn().unwrap();
        let task = Task::new(&config, &ffn, &device).unwrap();
        let _guard = INIT.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        device.seed(1);
        let model = Model::new(&config, &ffn, task.vocab().unwrap().len(), &device).unwrap();
        // burn draws a parameter when it is first read, not in `init`: read them all now.
        model.visit(&mut Materialize);
        (model, device)
    }

    /// Three projections of one input rounded once (`rounded_once`) are the projections of the
    /// f32 input, each rounding it: the outputs and the gradients of the input, the weights and
    /// the biases, to f32 reordering, in bf16 and in f32.
    #[cfg(feature = "flex")]
    #[test]
    fn an_input_rounded_once_is_what_each_projection_would_round() {
        use burn::tensor::Distribution;
        let device = Device::flex().autodiff();
        for precision in [Precision::Bf16, Precision::F32] {
            device.seed(3);
            let layers =
                [true, false, true].map(|b| LinearConfig::new(12, 8).with_bias(b).init(&device));
            let h = Tensor::<3>::random([2, 5, 12], Distribution::Default, &device);
            let g = Tensor::<3>::random([2, 5, 24], Distribution::Default, &device);
            let run = |once: bool| {
                let h = h.clone().detach().require_grad();
                let input = if once {
                    rounded_once(h.clone(), precision)
                } else {
                    h.clone()
                };
                let y = Tensor::cat(
                    layers
                        .iter()
                        .map(|l| linear(l, input.clone(), precision))
                        .collect(),
                    2,
                );
                let grads = (y.clone() * g.clone()).sum().backward();
                fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
                    t.into_data().convert::<f32>().try_into_vec().unwrap()
                }
                let dh = h.grad(&grads).unwrap();
                assert_eq!(dh.dtype(), burn::tensor::DType::F32);
                let mut all = vec![values(y.inner()), values(dh)];
                for l in &layers {
                    all.push(values(l.weight.grad(&grads).unwrap()));
                    if let Some(b) = &l.bias {
                        all.push(values(b.grad(&grads).unwrap()));
                    }
                }
                all
            };
            let (once, each) = (run(true), run(false));
            assert_eq!(once.len(), each.len());
            for (o, e) in once.iter().zip(&each) {
                let worst = o
                    .iter()
                    .zip(e)
                    .map(|(o, e)| (o - e).abs())
                    .fold(0f32, f32::max);
                assert!(worst <= 1e-5, "{precision:?}: {worst:e}");
            }
        }
    }

    /// Changing a later token never changes the logits at earlier positions.
    #[test]
    fn language_models_are_causal() {
        for kind in ["transformer", "window"] {
            let (model, device) = lm(kind);
            let a = TensorData::new(vec![0i64, 1, 2, 3, 4, 0], [1, 6]);
            let b = TensorData::new(vec![0i64, 1, 2, 4, 0, 1], [1, 6]);
            let la = model.logits(Tensor::from_data(a, &device)).unwrap();
            let lb = model.logits(Tensor::from_data(b, &device)).unwrap();
            assert_eq!(la.dims(), [1, 6, 5]);
            let first = |t: Tensor<3>| t.slice([0..1, 0..3, 0..5]).into_data();
            first(la.clone()).assert_eq(&first(lb.clone()), true);
            let diff: f32 = (la - lb).abs().sum().into_scalar();
            assert!(
                diff > 0.0,
                "{kind}: later positions do depend on the changed tokens"
            );
        }
    }

    /// The loss is the mean next-token cross-entropy of the logits, and at initialisation it is
    /// close to ln V because the logits are small.
    ///
    /// Oracle: the cross-entropy `logsumexp(z) − z_target` of every position, computed here in f64
    /// from the model's own logits, with the target the next token. Per position,
    /// `logsumexp(z) ∈ [ln V + min z, ln V + max z]`, so `|CE − ln V| ≤ max z − min z`: the mean
    /// loss is within the mean logit range of ln V. The initialisation makes that range small: the
    /// final layer norm has unit-variance outputs and burn's default `Linear` init draws
    /// `U(±1/√d_model)`, so each logit has standard deviation about `√(1/3 + 1/48) ≈ 0.6`.
    #[test]
    fn loss_is_the_cross_entropy_and_starts_near_uniform() {
        let vocab = 5;
        let ln_v = (vocab as f64).ln();
        for kind in ["transformer", "window"] {
            let (model, device) = lm(kind);
            let ids: Vec<i64> = [0, 1, 2, 3, 4, 0, 1, 3, 1, 4, 2, 2, 0, 3].to_vec();
            let (batch, len) = (2, 7);
            let tokens =
                Tensor::<2, Int>::from_data(TensorData::new(ids.clone(), [batch, len]), &device);
            let loss = f64::from(
                model
                    .loss(&Batch::Tokens(tokens.clone()))
                    .into_scalar::<f32>(),
            );

            let logits: Vec<f32> = model
                .logits(tokens.slice([0..batch, 0..len - 1]))
                .unwrap()
                .into_data()
                .try_to_vec()
                .unwrap();
            let (mut expected, mut range, mut square) = (0.0, 0.0, 0.0);
            for (position, z) in logits.chunks(vocab).enumerate() {
                let z: Vec<f64> = z.iter().map(|&v| f64::from(v)).collect();
                let (b, t) = (position / (len - 1), position % (len - 1));
                let target = ids[b * len + t + 1] as usize;
                let max = z.iter().copied().fold(f64::MIN, f64::max);
                let min = z.iter().copied().fold(f64::MAX, f64::min);
                let log_sum_exp = max + z.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
                expected += log_sum_exp - z[target];
                range += max - min;
                square += z.iter().map(|v| v * v).sum::<f64>();
            }
            let positions = (batch * (len - 1)) as f64;
            let (expected, range) = (expected / positions, range / positions);
            let rms = (square / (positions * vocab as f64)).sqrt();
            assert!(
                (loss - expected).abs() < 1e-5 * expected,
                "{kind}: loss {loss} vs cross-entropy {expected}"
            );
            assert!(
                rms < 1.0,
                "{kind}: initial logits are not small (rms {rms})"
            );
            assert!(
                (loss - ln_v).abs() <= range,
                "{kind}: loss {loss} vs ln V {ln_v} (mean logit range {range})"
            );
        }
    }
}
