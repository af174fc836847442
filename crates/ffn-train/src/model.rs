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

use burn::module::Module;
use burn::nn::attention::{MhaInput, MultiHeadAttention, MultiHeadAttentionConfig};
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::activation::log_softmax;
use burn::tensor::{Bool, Device, Int, Tensor};
use ffn_model::{FeedForward, FeedForwardConfig};

use crate::config::{ModelConfig, TrainConfig};
use crate::data::{Batch, Task};
use crate::{Error, Result};

/// A pre-norm transformer block.
#[derive(Module, Debug)]
pub struct Block {
    norm_attention: LayerNorm,
    attention: MultiHeadAttention,
    norm_ffn: LayerNorm,
    ffn: FeedForward,
}

impl Block {
    /// `x ← x + Attention(LN(x))`, then `x ← x + FFN(LN(x))`.
    fn forward(&self, x: Tensor<3>, causal: Tensor<3, Bool>) -> Tensor<3> {
        let h = self.norm_attention.forward(x.clone());
        let attended = self
            .attention
            .forward(MhaInput::self_attn(h).mask_attn(causal))
            .context;
        let x = x + attended;
        let h = self.norm_ffn.forward(x.clone());
        x + self.ffn.forward(h)
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
}

impl TransformerLm {
    /// Logits `[batch, seq, vocab]` of the next token after each prefix of `tokens` `[batch, seq]`.
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let [batch, seq] = tokens.dims();
        let device = tokens.device();
        let positions = Tensor::<1, Int>::arange(0..seq as i64, &device).reshape([1, seq]);
        let mut x =
            self.token_embedding.forward(tokens) + self.position_embedding.forward(positions);
        // true above the diagonal: position i attends to positions ≤ i only.
        let causal = Tensor::<2, Bool>::tril_mask([seq, seq], 0, &device).expand([batch, seq, seq]);
        for block in &self.blocks {
            x = block.forward(x, causal.clone());
        }
        self.head.forward(self.norm.forward(x))
    }
}

/// An FFN-only language model over a fixed window of previous tokens.
#[derive(Module, Debug)]
pub struct WindowLm {
    /// `vocab + 1` rows: the last one pads windows before the start of a sequence.
    embedding: Embedding,
    input: Linear,
    norm: LayerNorm,
    ffn: FeedForward,
    head: Linear,
    #[module(skip)]
    window: usize,
}

impl WindowLm {
    /// Logits `[batch, seq, vocab]` from the last `window` tokens at each position.
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
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
        let x = self.input.forward(Tensor::cat(columns, 2));
        let x = x.clone() + self.ffn.forward(self.norm.forward(x));
        self.head.forward(x)
    }
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
    Ffn(FeedForward),
}

impl Model {
    /// Builds the model of `config` for `task` on `device`, its weights drawn from the device's
    /// RNG (seed it first for reproducible initialisation).
    pub fn new(config: &TrainConfig, task: &Task, device: &Device) -> Result<Self> {
        let ffn_config: FeedForwardConfig = config.ffn()?;
        let ffn = || {
            ffn_config.try_init(device).map_err(|source| Error::Ffn {
                context: "model.ffn".into(),
                source,
            })
        };
        let (vocab, seq_len) = match task {
            Task::Language { seq_len, .. } => {
                (task.vocab().map(|v| v.len()).unwrap_or_default(), *seq_len)
            }
            Task::Regression(_) => (0, 0),
        };
        Ok(match &config.model {
            ModelConfig::Transformer(m) => {
                let blocks = (0..m.n_layers)
                    .map(|_| {
                        Ok(Block {
                            norm_attention: LayerNormConfig::new(m.d_model).init(device),
                            attention: MultiHeadAttentionConfig::new(m.d_model, m.n_heads)
                                .with_dropout(m.attention_dropout)
                                .init(device),
                            norm_ffn: LayerNormConfig::new(m.d_model).init(device),
                            ffn: ffn()?,
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                Model::Transformer(TransformerLm {
                    token_embedding: EmbeddingConfig::new(vocab, m.d_model).init(device),
                    position_embedding: EmbeddingConfig::new(seq_len, m.d_model).init(device),
                    blocks,
                    norm: LayerNormConfig::new(m.d_model).init(device),
                    head: LinearConfig::new(m.d_model, vocab).init(device),
                })
            }
            ModelConfig::Window(m) => Model::Window(WindowLm {
                embedding: EmbeddingConfig::new(vocab + 1, m.d_embed).init(device),
                input: LinearConfig::new(m.window * m.d_embed, m.d_model).init(device),
                norm: LayerNormConfig::new(m.d_model).init(device),
                ffn: ffn()?,
                head: LinearConfig::new(m.d_model, vocab).init(device),
                window: m.window,
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
        match (self, batch) {
            (Model::Ffn(ffn), Batch::Pairs { x, y }) => {
                (ffn.forward(x.clone()) - y.clone()).powi_scalar(2).mean()
            }
            (model, Batch::Tokens(tokens)) => {
                let [batch, len] = tokens.dims();
                let seq = len - 1;
                let inputs = tokens.clone().slice([0..batch, 0..seq]);
                let targets = tokens
                    .clone()
                    .slice([0..batch, 1..len])
                    .reshape([batch * seq, 1]);
                let logits = model.logits(inputs).expect("a language model");
                let vocab = logits.dims()[2];
                let log_probs = log_softmax(logits.reshape([batch * seq, vocab]), 1);
                -log_probs.gather(1, targets).mean()
            }
            _ => panic!("the batch does not match the model"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TrainConfig;
    use burn::tensor::TensorData;

    fn lm(kind: &str) -> (Model, Device) {
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
        let task = Task::new(&config, &device).unwrap();
        (Model::new(&config, &task, &device).unwrap(), device)
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

    /// At initialisation the cross-entropy is close to ln V (the logits are small).
    #[test]
    fn initial_loss_is_near_uniform() {
        for kind in ["transformer", "window"] {
            let (model, device) = lm(kind);
            let tokens = TensorData::new((0..14).map(|i| i % 5).collect::<Vec<i64>>(), [2, 7]);
            let loss: f32 = model
                .loss(&Batch::Tokens(Tensor::from_data(tokens, &device)))
                .into_scalar();
            assert!((f64::from(loss) - 5f64.ln()).abs() < 0.5, "{kind}: {loss}");
        }
    }
}
