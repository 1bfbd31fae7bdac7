//! Tokenizers: a Hugging Face `tokenizer.json`, or a byte-level BPE built from
//! GGUF metadata (`tokenizer.ggml.*`), as llama.cpp builds it.

use std::path::Path;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use crate::error::{Error, Result};
use crate::gguf::{GgufHeader, Value};

/// Llama 3's pre-tokenizer split (llama.cpp's `llama-bpe`).
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's pattern: Llama 3's with single digits.
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GGUF token types (llama.cpp's `llama_token_type`).
const TOKEN_TYPE_CONTROL: u64 = 3;
const TOKEN_TYPE_USER_DEFINED: u64 = 4;

/// A text tokenizer with the model's special tokens.
#[derive(Clone)]
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    /// Beginning-of-sequence token, prepended by [`TextTokenizer::encode`] when
    /// the model asks for it.
    pub bos: Option<u32>,
    add_bos: bool,
    /// End-of-sequence tokens.
    pub eos: Vec<u32>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("vocab", &self.inner.get_vocab_size(true))
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish()
    }
}

fn tk_error(context: &str, e: impl std::fmt::Display) -> Error {
    Error::Format(format!("{context}: {e}"))
}

impl TextTokenizer {
    /// Loads a Hugging Face `tokenizer.json`. Special tokens are taken from the
    /// model's config: `bos`, whether to add it, and `eos`.
    pub fn from_file(path: &Path, bos: Option<u32>, add_bos: bool, eos: Vec<u32>) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_bytes(crate::files::read_config(path)?)
            .map_err(|e| tk_error(&path.display().to_string(), e))?;
        Ok(Self {
            inner,
            bos,
            add_bos,
            eos,
        })
    }

    /// Builds the tokenizer a GGUF file describes. Byte-level BPE (`gpt2`)
    /// vocabularies are supported, with the pre-tokenizers of SmolLM, GPT-2,
    /// Llama 3 and Qwen2.
    pub fn from_gguf(header: &GgufHeader) -> Result<Self> {
        let model = header.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(Error::Unsupported(format!(
                "GGUF tokenizer model {model:?}; qforge builds byte-level BPE (\"gpt2\") tokenizers \
                 from GGUF. For SentencePiece models use a Hugging Face directory with tokenizer.json"
            )));
        }
        let strings = |key: &str| -> Result<Vec<String>> {
            header
                .get(key)?
                .as_array()
                .ok_or_else(|| Error::Format(format!("GGUF {key} is not an array")))?
                .iter()
                .map(|v| {
                    v.as_str()
                        .map(str::to_owned)
                        .ok_or_else(|| Error::Format(format!("GGUF {key} holds a non-string")))
                })
                .collect()
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges = strings("tokenizer.ggml.merges")?
            .into_iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_owned(), b.to_owned()))
                    .ok_or_else(|| Error::Format(format!("GGUF merge {m:?} is not \"a b\"")))
            })
            .collect::<Result<Vec<_>>>()?;
        let types: Vec<u64> = match header.metadata.get("tokenizer.ggml.token_type") {
            Some(Value::Array(a)) => a.iter().map(|v| v.as_u64().unwrap_or(1)).collect(),
            _ => vec![1; tokens.len()],
        };
        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| tk_error("GGUF BPE vocabulary", e))?;
        let byte_level = |use_regex: bool| -> PreTokenizerWrapper {
            ByteLevel::new(false, true, use_regex).into()
        };
        let split = |pattern: &str| -> Result<PreTokenizerWrapper> {
            Ok(Split::new(
                SplitPattern::Regex(pattern.to_owned()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| tk_error("pre-tokenizer pattern", e))?
            .into())
        };
        let pre = header.get_str("tokenizer.ggml.pre").unwrap_or("default");
        let pre_tokenizer: PreTokenizerWrapper = match pre {
            "smollm" => Sequence::new(vec![Digits::new(true).into(), byte_level(true)]).into(),
            "default" | "gpt2" | "gpt-2" => byte_level(true),
            "llama-bpe" | "llama3" | "llama-v3" => {
                Sequence::new(vec![split(LLAMA3_PATTERN)?, byte_level(false)]).into()
            }
            "qwen2" => Sequence::new(vec![split(QWEN2_PATTERN)?, byte_level(false)]).into(),
            other => {
                return Err(Error::Unsupported(format!(
                    "GGUF pre-tokenizer {other:?} (supported: smollm, gpt2, llama-bpe, qwen2)"
                )));
            }
        };
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(pre_tokenizer));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        let special: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, t)| matches!(**t, TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED))
            .map(|(token, t)| AddedToken::from(token.clone(), *t == TOKEN_TYPE_CONTROL))
            .collect();
        inner
            .add_special_tokens(special)
            .map_err(|e| tk_error("GGUF special tokens", e))?;
        let id = |key: &str| header.get_u64(key).ok().map(|v| v as u32);
        Ok(Self {
            inner,
            bos: id("tokenizer.ggml.bos_token_id"),
            add_bos: header
                .metadata
                .get("tokenizer.ggml.add_bos_token")
                .is_some_and(|v| *v == Value::Bool(true)),
            eos: id("tokenizer.ggml.eos_token_id").into_iter().collect(),
        })
    }

    /// Writes `tokenizer.json` into `dir`.
    pub fn save(&self, dir: &Path) -> Result<()> {
        let path = dir.join("tokenizer.json");
        self.inner
            .save(&path, false)
            .map_err(|e| tk_error(&path.display().to_string(), e))
    }

    /// Whether [`TextTokenizer::encode`] prepends BOS.
    pub fn adds_bos(&self) -> bool {
        self.add_bos
    }

    /// Token ids of `text`; special tokens written in the text (such as
    /// `<|im_start|>`) are recognised. Prepends BOS when the model wants it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| tk_error("tokenizing", e))?;
        let mut ids = Vec::with_capacity(encoding.len() + 1);
        if self.add_bos
            && let Some(bos) = self.bos
        {
            ids.push(bos);
        }
        ids.extend_from_slice(encoding.get_ids());
        Ok(ids)
    }

    /// The text of `ids` (special tokens included as written).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| tk_error("detokenizing", e))
    }

    /// Vocabulary size, special tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}
