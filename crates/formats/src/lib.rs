//! `qforge-formats`: the on-disk formats and files that need no model.
//!
//! It owns reading regular files within limits and inside their directory
//! ([`files`]), writing results atomically ([`output`]), the GGUF parser
//! ([`gguf`]), a language model's tokenizer and chat template ([`text`]),
//! the protobuf types of qforge's ONNX subset and the reading
//! of MLP graphs as chains of layers ([`onnx`]), the hyper-parameters of a Llama-family decoder from a
//! Hugging Face `config.json` or GGUF metadata ([`llama_config`]), tokenizers from `tokenizer.json` or a GGUF header
//! ([`tokenizer`]), an artifact's `manifest.json` ([`manifest`]) and its
//! `calibration.json` ([`profile`]), safetensors files written a tensor at a
//! time ([`safetensors_file`]), a policy's `policy.json` with what its
//! head's outputs mean ([`policy`]), and data spilled to unnamed temporary
//! files, mapped read-only ([`spill`]).
//!
//! It depends on `qforge-core` only; it must not depend on the models
//! (`qforge-model`: `Llama`, `MlpPolicy`, `Linear`, `LanguageModel`),
//! the INT8 kernels, decoding, evaluation, calibration, the runner, serving
//! or the CLI.

pub mod error;
pub mod files;
pub mod gguf;
pub mod llama_config;
pub mod manifest;
pub mod onnx;
pub mod output;
pub mod policy;
pub mod profile;
pub mod safetensors_file;
pub mod spill;
pub mod text;
pub mod tokenizer;

pub use error::{Error, Result};
