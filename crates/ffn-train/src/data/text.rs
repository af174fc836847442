//! A text file the user points at: its tokeniser (bytes or characters) and its training and
//! validation parts. Its optimum is unknown.

use std::path::Path;

use crate::config::{TextConfig, TextLevel};
use crate::error::{Error, Result};

/// The tokeniser of a language task, in its run folder.
pub const VOCAB: &str = "vocab.json";

/// The tokeniser a run wrote when it started, its `vocab.json`.
pub fn read_vocab(run: &Path) -> Result<Vocab> {
    let path = run.join(VOCAB);
    let text = ffn_model::files::read_text(&path, 64 << 20).map_err(Error::io(&path))?;
    serde_json::from_str(&text).map_err(|e| Error::Checkpoint {
        path,
        message: format!("corrupt: {e}"),
    })
}

/// Token ↔ text.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Vocab {
    /// Token `i` is byte `i`.
    Bytes,
    /// Token `i` is the `i`-th character.
    Chars {
        /// The characters, in token order.
        chars: Vec<char>,
    },
}

impl Vocab {
    /// The number of tokens.
    pub fn len(&self) -> usize {
        match self {
            Vocab::Bytes => 256,
            Vocab::Chars { chars } => chars.len(),
        }
    }

    /// Whether there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tokenises `text`; a character outside the vocabulary is an error naming it.
    pub fn encode(&self, text: &str) -> std::result::Result<Vec<u32>, String> {
        match self {
            Vocab::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Vocab::Chars { chars } => text
                .chars()
                .map(|c| {
                    chars
                        .iter()
                        .position(|&x| x == c)
                        .map(|i| i as u32)
                        .ok_or_else(|| {
                            format!(
                                "the character {c:?} is not in the vocabulary ({})",
                                chars.iter().collect::<String>().escape_debug()
                            )
                        })
                })
                .collect(),
        }
    }

    /// The text of `tokens` (invalid UTF-8 from a byte model is replaced by `�`).
    pub fn decode(&self, tokens: &[u32]) -> String {
        match self {
            Vocab::Bytes => {
                String::from_utf8_lossy(&tokens.iter().map(|&t| t as u8).collect::<Vec<_>>())
                    .into_owned()
            }
            Vocab::Chars { chars } => tokens
                .iter()
                .map(|&t| chars.get(t as usize).copied().unwrap_or('\u{fffd}'))
                .collect(),
        }
    }

    /// [`decode`](Self::decode), or `None` while `tokens` end inside a UTF-8 character that
    /// more bytes could complete (for streaming a byte model's output).
    pub fn decode_complete(&self, tokens: &[u32]) -> Option<String> {
        if let Vocab::Bytes = self {
            let bytes: Vec<u8> = tokens.iter().map(|&t| t as u8).collect();
            if let Err(e) = std::str::from_utf8(&bytes)
                && e.error_len().is_none()
                && bytes.len() < 4
            {
                return None;
            }
        }
        Some(self.decode(tokens))
    }
}

/// The largest text file a run trains on (256 MiB: its tokens take 4× that in memory).
pub const MAX_TEXT: u64 = 256 << 20;

/// A text file, tokenised and split: the first `1 − valid_fraction` for training, the rest for
/// validation.
#[derive(Debug, Clone)]
pub struct TextCorpus {
    pub(super) train: Vec<u32>,
    pub(super) valid: Vec<u32>,
    vocab: Vocab,
}

impl TextCorpus {
    /// Reads and splits the file, tokenised with `vocab` if given (a run's own), else with the
    /// file's own characters.
    pub fn load(config: &TextConfig, vocab: Option<Vocab>) -> Result<Self> {
        let path = &config.path;
        let bytes = ffn_model::files::read_regular(path, MAX_TEXT).map_err(Error::io(path))?;
        let data_error = |message: String| Error::Data {
            path: path.clone(),
            message,
        };
        if bytes.is_empty() {
            return Err(data_error("the file is empty".into()));
        }
        let (tokens, vocab) = match config.level {
            TextLevel::Byte if matches!(vocab, None | Some(Vocab::Bytes)) => {
                (bytes.iter().map(|&b| u32::from(b)).collect(), Vocab::Bytes)
            }
            TextLevel::Byte => {
                return Err(data_error(
                    "the run's vocab.json is not a byte vocabulary; the run folder was edited"
                        .into(),
                ));
            }
            TextLevel::Char => {
                let text = String::from_utf8(bytes).map_err(|e| {
                    data_error(format!(
                        "not UTF-8 (invalid byte at offset {}); use task.level = \"byte\"",
                        e.utf8_error().valid_up_to()
                    ))
                })?;
                let vocab = vocab.unwrap_or_else(|| {
                    let mut chars: Vec<char> = text.chars().collect();
                    chars.sort_unstable();
                    chars.dedup();
                    Vocab::Chars { chars }
                });
                (vocab.encode(&text).map_err(data_error)?, vocab)
            }
        };
        let tokens: Vec<u32> = tokens;
        let n_valid = ((tokens.len() as f64) * config.valid_fraction).round() as usize;
        let need = config.seq_len + 1;
        let n_train = tokens.len() - n_valid;
        if n_valid < need || n_train < need {
            return Err(data_error(format!(
                "too short: {} tokens split into {n_train} for training and {n_valid} for \
                 validation, but each part needs at least seq_len + 1 = {need}; use a longer \
                 file or a smaller task.seq_len",
                tokens.len()
            )));
        }
        Ok(Self {
            valid: tokens[n_train..].to_vec(),
            train: tokens[..n_train].to_vec(),
            vocab,
        })
    }

    /// The tokeniser.
    pub fn vocab(&self) -> &Vocab {
        &self.vocab
    }
}
