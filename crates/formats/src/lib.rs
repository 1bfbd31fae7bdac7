//! `qforge-formats`: the on-disk formats and files that need no model.
//!
//! It owns reading regular files within limits and inside their directory
//! ([`files`]), writing results atomically ([`output`]), the GGUF parser
//! ([`gguf`]), tokenizers from `tokenizer.json` or a GGUF header
//! ([`tokenizer`]), an artifact's `manifest.json` ([`manifest`]) and its
//! `calibration.json` ([`profile`]).
//!
//! It depends on `qforge-core` only; it must not depend on the models
//! (`qforge-model`: `Llama`, `MlpPolicy`, `Linear`, `LanguageModel`),
//! the INT8 kernels, calibration, distribution, serving or the CLI.

pub mod error;
pub mod files;
pub mod gguf;
pub mod manifest;
pub mod output;
pub mod profile;
pub mod tokenizer;

pub use error::{Error, Result};
