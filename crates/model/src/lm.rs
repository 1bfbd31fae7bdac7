//! A language model ready to use: decoder, tokenizer and chat template
//! (the text side is `qforge-formats`' [`TextSide`]).
//! (Generation and sampling live in `qforge-decode`, perplexity and the
//! comparison of two models in `qforge-eval`.)

use std::path::{Path, PathBuf};

use crate::error::Result;
use crate::llama::{Llama, Residency};
use qforge_formats::gguf::GgufFile;
use qforge_formats::text::TextSide;

/// A decoder with the text side that feeds it.
#[derive(Debug, Clone)]
pub struct LanguageModel {
    /// The decoder.
    pub model: Llama,
    /// Its tokenizer and chat template.
    pub text: TextSide,
    /// Where it was loaded from.
    pub source: PathBuf,
}

impl LanguageModel {
    /// Loads a GGUF file or a Hugging Face directory (`config.json`,
    /// safetensors, `tokenizer.json`). A native artifact is not read here
    /// (the artifact loader builds on this module): open any model,
    /// artifacts included, with [`crate::open()`].
    pub fn load(path: &Path) -> Result<Self> {
        if path.is_dir() {
            let model = Llama::from_hf_dir(path)?;
            let text = TextSide::from_hf_dir(path, model.config())?;
            return Ok(Self {
                model,
                text,
                source: path.to_owned(),
            });
        }
        // One parse of the header serves the tokenizer and the decoder.
        let file = GgufFile::open(path)?;
        let text = TextSide::from_gguf(&file, path)?;
        Ok(Self {
            model: Llama::from_gguf_file(file, Residency::Auto)?,
            text,
            source: path.to_owned(),
        })
    }
}
