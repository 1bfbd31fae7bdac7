//! Tokenizers: a Hugging Face `tokenizer.json`, or a byte-level BPE built from
//! GGUF metadata (`tokenizer.ggml.*`), as llama.cpp builds it; or none, for a
//! model directory that ships no tokenizer and takes token ids only.

use std::ops::Range;
use std::path::{Path, PathBuf};

use tokenizers::decoders::DecoderWrapper;
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

/// The byte a byte-level BPE vocabulary character spells (GPT-2's
/// `bytes_to_unicode`: the printable Latin-1 bytes spell themselves, the
/// other 68 are U+0100 onwards in byte order).
fn byte_of(c: char) -> Option<u8> {
    let printable = |b: u32| matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
    let code = u32::from(c);
    if code < 0x100 {
        return printable(code).then_some(code as u8);
    }
    (0..=0xFFu32)
        .filter(|&b| !printable(b))
        .nth((code - 0x100) as usize)
        .map(|b| b as u8)
}

/// GGUF token types (llama.cpp's `llama_token_type`).
const TOKEN_TYPE_CONTROL: u64 = 3;
const TOKEN_TYPE_USER_DEFINED: u64 = 4;

/// A text tokenizer with the model's special tokens.
#[derive(Clone)]
pub struct TextTokenizer {
    vocabulary: Vocabulary,
    /// Beginning-of-sequence token, prepended by [`TextTokenizer::encode`] when
    /// the model asks for it.
    pub bos: Option<u32>,
    add_bos: bool,
    /// End-of-sequence tokens.
    pub eos: Vec<u32>,
}

/// What turns text into ids and back, if anything does.
#[derive(Clone)]
enum Vocabulary {
    Text(Box<tokenizers::Tokenizer>),
    /// The model shipped no tokenizer (a synthetic model, a checkpoint saved
    /// without one): `size` token ids go in and out, text cannot.
    IdsOnly {
        size: usize,
        /// The `tokenizer.json` that was not there, for the error message.
        missing: PathBuf,
    },
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("reads_text", &self.reads_text())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish()
    }
}

fn tk_error(context: &str, e: impl std::fmt::Display) -> Error {
    Error::Format(format!("{context}: {e}"))
}

impl TextTokenizer {
    /// Whether `other` turns every text into the same tokens and back: the
    /// same vocabulary, merges, normalization and special tokens.
    /// Two tokenizers that read no text are the same when they take the
    /// same ids.
    pub fn same_as(&self, other: &TextTokenizer) -> bool {
        let vocabulary = match (&self.vocabulary, &other.vocabulary) {
            (Vocabulary::Text(a), Vocabulary::Text(b)) => {
                let spelled = |t: &tokenizers::Tokenizer| t.to_string(false).ok();
                spelled(a).is_some() && spelled(a) == spelled(b)
            }
            (Vocabulary::IdsOnly { size: a, .. }, Vocabulary::IdsOnly { size: b, .. }) => a == b,
            _ => false,
        };
        vocabulary && (self.bos, self.add_bos, &self.eos) == (other.bos, other.add_bos, &other.eos)
    }

    /// Loads a Hugging Face `tokenizer.json`. Special tokens are taken from the
    /// model's config: `bos`, whether to add it, and `eos`.
    pub fn from_file(path: &Path, bos: Option<u32>, add_bos: bool, eos: Vec<u32>) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_bytes(crate::files::read_config(path)?)
            .map_err(|e| tk_error(&path.display().to_string(), e))?;
        Ok(Self {
            vocabulary: Vocabulary::Text(Box::new(inner)),
            bos,
            add_bos,
            eos,
        })
    }

    /// The tokenizer of a model that ships none (`missing` is the
    /// `tokenizer.json` looked for): it takes the `vocab_size` token ids of
    /// the model's embedding and refuses text, naming the missing file.
    pub fn ids_only(
        missing: &Path,
        vocab_size: usize,
        bos: Option<u32>,
        add_bos: bool,
        eos: Vec<u32>,
    ) -> Self {
        Self {
            vocabulary: Vocabulary::IdsOnly {
                size: vocab_size,
                missing: missing.to_owned(),
            },
            bos,
            add_bos,
            eos,
        }
    }

    /// Whether this tokenizer turns text into ids (a model without one
    /// takes token ids only).
    pub fn reads_text(&self) -> bool {
        matches!(self.vocabulary, Vocabulary::Text(_))
    }

    /// The text tokenizer, or the error that says there is none and what to
    /// do instead.
    fn text(&self) -> Result<&tokenizers::Tokenizer> {
        match &self.vocabulary {
            Vocabulary::Text(inner) => Ok(inner),
            Vocabulary::IdsOnly { missing, .. } => Err(Error::Request(format!(
                "{} does not exist, so this model reads token ids, not text: add the model's \
                 tokenizer.json to give it text (calibration data can be `token_ids` records, \
                 and the guard then holds out some of them instead of reading --eval-data)",
                missing.display()
            ))),
        }
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
        let mut inner = Box::new(tokenizers::Tokenizer::new(bpe));
        inner.with_pre_tokenizer(Some(pre_tokenizer));
        inner.with_decoder(Some(tokenizers::decoders::byte_level::ByteLevel::default()));
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
            vocabulary: Vocabulary::Text(inner),
            bos: id("tokenizer.ggml.bos_token_id"),
            add_bos: header
                .metadata
                .get("tokenizer.ggml.add_bos_token")
                .is_some_and(|v| *v == Value::Bool(true)),
            eos: id("tokenizer.ggml.eos_token_id").into_iter().collect(),
        })
    }

    /// Writes `tokenizer.json` into `dir` (nothing, for a model without one:
    /// what is written from it takes token ids as the model did).
    pub fn save(&self, dir: &Path) -> Result<()> {
        let Vocabulary::Text(inner) = &self.vocabulary else {
            return Ok(());
        };
        let path = dir.join("tokenizer.json");
        inner
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
            .text()?
            .encode(text, false)
            .map_err(|e| tk_error("tokenizing", e))?;
        let mut ids = self.bos_ids();
        ids.extend_from_slice(encoding.get_ids());
        Ok(ids)
    }

    /// BOS when the model wants it prepended, else nothing.
    pub fn bos_ids(&self) -> Vec<u32> {
        self.bos.filter(|_| self.add_bos).into_iter().collect()
    }

    /// Token ids of `text`, and no BOS, where the strings of special and
    /// added tokens (`<|im_end|>`) are recognised outside the byte ranges
    /// `plain` (sorted, disjoint) and read as the characters they are made
    /// of inside them. Between two recognised tokens the text is one piece,
    /// whatever ranges it crosses, so where no added token's string lies
    /// inside `plain` the ids are [`Self::encode`]'s.
    pub fn encode_with_plain(&self, text: &str, plain: &[Range<usize>]) -> Result<Vec<u32>> {
        let mut added: Vec<(String, u32)> = self
            .text()?
            .get_added_tokens_decoder()
            .into_iter()
            .map(|(id, token)| (token.content, id))
            .filter(|(content, _)| !content.is_empty())
            .collect();
        // Leftmost, then longest, as the tokenizer's own matching.
        added.sort_by_key(|(content, _)| std::cmp::Reverse(content.len()));
        let mut ids = Vec::new();
        let (mut piece, mut at) = (0, 0);
        let mut ranges = plain.iter().peekable();
        while at < text.len() {
            while ranges.next_if(|r| r.end <= at).is_some() {}
            if let Some(range) = ranges.peek()
                && range.contains(&at)
            {
                at = range.end;
                continue;
            }
            let found = added
                .iter()
                .find(|(content, _)| text[at..].starts_with(content.as_str()));
            match found {
                Some((content, id)) => {
                    ids.extend(self.encode_plain(&text[piece..at])?);
                    ids.push(*id);
                    at += content.len();
                    piece = at;
                }
                None => at += text[at..].chars().next().map_or(1, char::len_utf8),
            }
        }
        ids.extend(self.encode_plain(&text[piece..])?);
        Ok(ids)
    }

    /// Token ids of `text` read as plain text, and no BOS: the string of a
    /// special or added token in it (`<|im_end|>`) is tokenized as the
    /// characters it is made of, never as that token. The tokenizer's
    /// normalizer, pre-tokenizer and model run as [`Self::encode`] runs
    /// them, without the added vocabulary, so text that spells no added
    /// token gets the same ids either way.
    fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        if text.is_empty() {
            return Ok(Vec::new());
        }
        use tokenizers::{
            Model, NormalizedString, Normalizer, OffsetType, PreTokenizedString, PreTokenizer,
        };
        let inner = self.text()?;
        let failed = |e| tk_error("tokenizing", e);
        let mut normalized = NormalizedString::from(text);
        if let Some(normalizer) = inner.get_normalizer() {
            normalizer.normalize(&mut normalized).map_err(failed)?;
        }
        let mut pieces = PreTokenizedString::from(normalized);
        if let Some(pre_tokenizer) = inner.get_pre_tokenizer() {
            pre_tokenizer.pre_tokenize(&mut pieces).map_err(failed)?;
        }
        pieces
            .tokenize(|piece| inner.get_model().tokenize(piece.get()))
            .map_err(failed)?;
        let encoding = pieces
            .into_encoding(None, 0, OffsetType::Byte)
            .map_err(failed)?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text of `ids` (special tokens included as written).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.text()?
            .decode(ids, false)
            .map_err(|e| tk_error("detokenizing", e))
    }

    /// The bytes one token stands for, which may be part of a UTF-8
    /// character (OpenAI's `bytes` of a log-prob entry): a special token's
    /// text; a byte-level BPE token's bytes; otherwise the token decoded
    /// alone. Nothing, for a model without a tokenizer.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let Vocabulary::Text(inner) = &self.vocabulary else {
            return Vec::new();
        };
        let added = inner
            .get_added_vocabulary()
            .get_added_tokens_decoder()
            .get(&id);
        if let Some(added) = added {
            return added.content.clone().into_bytes();
        }
        if matches!(inner.get_decoder(), Some(DecoderWrapper::ByteLevel(_)))
            && let Some(spelled) = inner.id_to_token(id)
            && let Some(bytes) = spelled.chars().map(byte_of).collect::<Option<Vec<u8>>>()
        {
            return bytes;
        }
        self.decode(&[id]).unwrap_or_default().into_bytes()
    }

    /// Vocabulary size, special tokens included.
    pub fn vocab_size(&self) -> usize {
        match &self.vocabulary {
            Vocabulary::Text(inner) => inner.get_vocab_size(true),
            Vocabulary::IdsOnly { size, .. } => *size,
        }
    }

    /// The most bytes of text one token can stand for, where that is
    /// provable: a text longer than `n` times this then has more than `n`
    /// tokens, so a server can refuse an over-long prompt before
    /// tokenizing it. It holds when every byte of the text ends up in one
    /// token whose vocabulary string is at least as long, that is when
    /// nothing on the way shortens the text: no normalizer that may (NFC,
    /// strip, lowercase, …; prepending and replacing by something no
    /// shorter are fine), no pre-tokenizer that drops text (whitespace
    /// splitters), no truncation, and a BPE model that does not fuse runs
    /// of unknown characters into one token. `None` otherwise, and for a
    /// model without a tokenizer.
    pub fn max_bytes_per_token(&self) -> Option<usize> {
        let Vocabulary::Text(inner) = &self.vocabulary else {
            return None;
        };
        if inner.get_truncation().is_some() {
            return None;
        }
        let normalizer = serde_json::to_value(inner.get_normalizer()).ok()?;
        let pre_tokenizer = serde_json::to_value(inner.get_pre_tokenizer()).ok()?;
        if !never_shortens(&normalizer) || !keeps_every_byte(&pre_tokenizer) {
            return None;
        }
        let tokenizers::ModelWrapper::BPE(bpe) = inner.get_model() else {
            return None;
        };
        if bpe.fuse_unk && bpe.unk_token.is_some() && !bpe.byte_fallback {
            return None;
        }
        // Byte-level BPE spells each byte of text as one character (of one
        // or two UTF-8 bytes), so its vocabulary counts in characters;
        // otherwise in the UTF-8 bytes of each entry (normalized text, or
        // `<0xNN>` for one byte). Added tokens match their text as written.
        let byte_level = names_byte_level(&normalizer) || names_byte_level(&pre_tokenizer);
        let length = |entry: &String| {
            if byte_level {
                entry.chars().count()
            } else {
                entry.len()
            }
        };
        let model = inner.get_vocab(false).keys().map(length).max()?;
        let added = inner
            .get_added_tokens_decoder()
            .values()
            .map(|t| t.content.len())
            .max()
            .unwrap_or(0);
        // An unknown character (at most 4 bytes) becomes the unknown token,
        // whatever its string.
        let unknown = if bpe.unk_token.is_some() { 4 } else { 0 };
        Some(model.max(added).max(unknown))
    }
}

/// Whether a normalizer (in its `tokenizer.json` form) never makes a text
/// shorter in bytes.
fn never_shortens(normalizer: &serde_json::Value) -> bool {
    every_step(normalizer, "normalizers", &|kind, step| match kind {
        "Prepend" | "ByteLevel" => true,
        // Each occurrence of a literal becomes something no shorter.
        "Replace" => {
            let literal = step
                .get("pattern")
                .and_then(|p| p.get("String"))
                .and_then(serde_json::Value::as_str);
            let content = step.get("content").and_then(serde_json::Value::as_str);
            matches!((literal, content), (Some(l), Some(c)) if c.len() >= l.len())
        }
        _ => false,
    })
}

/// Whether every step of a normalizer or pre-tokenizer (in its
/// `tokenizer.json` form: none, one step, or a `Sequence` listing its steps
/// under `list`) passes `passes(type, step)`.
fn every_step(
    value: &serde_json::Value,
    list: &str,
    passes: &dyn Fn(&str, &serde_json::Map<String, serde_json::Value>) -> bool,
) -> bool {
    use serde_json::Value;
    match value {
        Value::Null => true,
        Value::Object(step) => match step.get("type").and_then(Value::as_str) {
            Some("Sequence") => step
                .get(list)
                .and_then(Value::as_array)
                .is_some_and(|all| all.iter().all(|s| every_step(s, list, passes))),
            Some(kind) => passes(kind, step),
            None => false,
        },
        _ => false,
    }
}

/// Whether a normalizer or pre-tokenizer (in its `tokenizer.json` form)
/// has a byte-level step.
fn names_byte_level(step: &serde_json::Value) -> bool {
    match step {
        serde_json::Value::Object(m) => {
            m.get("type").and_then(serde_json::Value::as_str) == Some("ByteLevel")
                || m.values().any(names_byte_level)
        }
        serde_json::Value::Array(all) => all.iter().any(names_byte_level),
        _ => false,
    }
}

/// Whether a pre-tokenizer (in its `tokenizer.json` form) passes every
/// byte of its input on to some piece.
fn keeps_every_byte(pre_tokenizer: &serde_json::Value) -> bool {
    every_step(pre_tokenizer, "pretokenizers", &|kind, step| match kind {
        "ByteLevel" | "Metaspace" | "Digits" => true,
        "Split" => step.get("behavior").and_then(serde_json::Value::as_str) != Some("Removed"),
        _ => false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level-free BPE tokenizer over "a", "b", "ab", "▁", with
    /// `normalizer` and `pre_tokenizer` (JSON, as in tokenizer.json).
    fn tokenizer(normalizer: &str, pre_tokenizer: &str, truncation: &str) -> TextTokenizer {
        let json = format!(
            r#"{{"version": "1.0", "truncation": {truncation}, "padding": null, "added_tokens": [],
              "normalizer": {normalizer}, "pre_tokenizer": {pre_tokenizer}, "post_processor": null,
              "decoder": null,
              "model": {{"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
                "byte_fallback": false, "ignore_merges": false,
                "vocab": {{"a": 0, "b": 1, "ab": 2, "▁": 3, "▁ab": 4}},
                "merges": [["a", "b"], ["▁", "ab"]]}}}}"#
        );
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, json).unwrap();
        TextTokenizer::from_file(&path, None, false, Vec::new()).unwrap()
    }

    #[test]
    fn a_byte_bound_is_given_only_where_nothing_shortens_the_text() {
        let plain = tokenizer("null", "null", "null");
        // "▁ab" is 5 bytes, the longest entry.
        assert_eq!(plain.max_bytes_per_token(), Some(5));
        let sentencepiece = tokenizer(
            r#"{"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}"#,
            r#"{"type": "Split", "pattern": {"String": "▁"}, "behavior": "MergedWithNext", "invert": false}"#,
            "null",
        );
        assert_eq!(sentencepiece.max_bytes_per_token(), Some(5));
        for (normalizer, pre_tokenizer, truncation) in [
            (r#"{"type": "NFC"}"#, "null", "null"),
            (
                r#"{"type": "Strip", "strip_left": true, "strip_right": true}"#,
                "null",
                "null",
            ),
            (
                r#"{"type": "Replace", "pattern": {"String": "ab"}, "content": "a"}"#,
                "null",
                "null",
            ),
            ("null", r#"{"type": "Whitespace"}"#, "null"),
            (
                "null",
                r#"{"type": "Split", "pattern": {"String": "b"}, "behavior": "Removed", "invert": false}"#,
                "null",
            ),
            (
                "null",
                "null",
                r#"{"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}"#,
            ),
        ] {
            let t = tokenizer(normalizer, pre_tokenizer, truncation);
            assert_eq!(
                t.max_bytes_per_token(),
                None,
                "{normalizer} {pre_tokenizer} {truncation}"
            );
        }
    }

    #[test]
    fn a_byte_level_vocabulary_counts_characters() {
        let t = tokenizer(
            "null",
            r#"{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}"#,
            "null",
        );
        // "▁ab" is 3 characters (5 bytes); under byte-level BPE each
        // character stands for one byte of text.
        assert_eq!(t.max_bytes_per_token(), Some(3));
    }

    #[test]
    fn the_byte_bound_holds_for_texts_of_every_kind() {
        let t = tokenizer("null", "null", "null");
        let per_token = t.max_bytes_per_token().unwrap();
        for text in ["ab", "abababab", "ba", "▁ab▁ab", "aaaa"] {
            let tokens = t.encode(text).unwrap().len();
            assert!(tokens * per_token >= text.len(), "{text}: {tokens} tokens");
        }
    }
}
