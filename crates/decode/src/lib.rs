//! `qforge-decode`: decoding on qforge's INT8 engine.
//!
//! It owns the batched, allocation-free INT8 [`Decoder`] (one step advances
//! any number of sequences, each on its own [`qforge_model::KvCache`]; the
//! serving engine, `qforge generate` and the Python rollouts run on it),
//! the drawing of tokens and their log-probabilities from one softmax
//! ([`sampling`]), and the generation of one sequence ([`generate()`]). The
//! tensor forward of `qforge-model` stays the observable reference the
//! decoder is tested against and calibration observes.
//!
//! It depends on `qforge-kernels` (the INT8 GEMM, attention and the
//! decoder's thread team), `qforge-formats` and `qforge-model` (the model
//! whose weights and caches it reads); it must not depend on evaluation,
//! calibration, quantization, serving or the CLI. Its errors are the
//! model's ([`qforge_model::Error`]).

pub mod decoder;
pub mod generate;
pub mod sampling;

pub use decoder::Decoder;
pub use generate::{GenerateOptions, Generation, GenerationReport, generate};
