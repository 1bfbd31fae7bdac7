//! `qforge-model`: the models qforge quantizes, loaded from real files.
//!
//! It owns loading models from their formats (GGUF models, Hugging Face
//! safetensors directories, MLP policy directories, ONNX MLPs) and the
//! native artifact, the architectures with a per-layer choice of linear
//! implementation ([`Linear`]) and their tensor forwards, the observation
//! hook calibration uses ([`Observer`]), a language model with its text side
//! ([`LanguageModel`]) and the determinism fingerprint. The INT8 decoder,
//! sampling and generation live above it, in `qforge-decode`; what is
//! measured of a model (perplexity, the comparison of two models, action
//! agreement, sensitivity, rollouts) in `qforge-eval`.
//!
//! It depends on `qforge-core`, on `qforge-kernels` (the INT8 engine
//! behind [`Linear::Int8`]) and on `qforge-formats` (the files and formats
//! that need no model: GGUF, the ONNX subset, Llama configs, `policy.json`,
//! tokenizers and chat templates, `manifest.json`, `calibration.json`,
//! bounded reads, spilled data and atomic writes); it must not depend on
//! decoding, evaluation, calibration, the runner, serving or the CLI.

pub mod artifact;
pub mod error;
pub mod fingerprint;
pub mod linear;
pub mod llama;
pub mod lm;
pub mod mlp;
pub mod observe;
pub mod onnx;
pub mod open;

pub use error::{Error, Result};
pub use linear::{Int8Values, Int8Weight, Linear};
pub use llama::{
    CachedHead, HiddenState, KvCache, Llama, Logits, Residency, RotatedInput, SharedPrefix,
};
pub use lm::LanguageModel;
pub use mlp::MlpPolicy;
pub use observe::{Observer, Statistics, StatsObserver};
pub use onnx::import_mlp;
pub use open::{Format, Model, open};
pub use qforge_kernels::Activations;
