//! `qforge-model`: the models qforge quantizes, loaded from real files.
//!
//! It owns the file formats in (GGUF, Hugging Face safetensors directories),
//! the architectures with a per-layer choice of linear implementation
//! ([`Linear`]), the observation hook calibration uses ([`Observer`]), and the
//! full-precision forward that is the reference for everything downstream.
//!
//! It depends on `qforge-core` only (and on `qforge-kernels` once the INT8
//! engine exists); it must not depend on calibration, distribution, serving
//! or the CLI.

pub mod error;
pub mod gguf;
pub mod linear;
pub mod llama;
pub mod mlp;
pub mod observe;

pub use error::{Error, Result};
pub use linear::Linear;
pub use llama::{KvCache, Llama, LlamaConfig, Logits};
pub use mlp::{Action, MlpPolicy, PolicyConfig};
pub use observe::{Observer, StatsObserver};
