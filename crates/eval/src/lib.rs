//! `qforge-eval`: what qforge measures of a model, above the models
//! themselves. The action agreement of two policies ([`agreement()`]),
//! perplexity with llama.cpp's method ([`perplexity()`]), two
//! models compared on one text against a reference computed once
//! ([`compare`](mod@compare): KL divergence, top-1 agreement, the perplexity increase
//! and its interval), how much each linear layer's output moves on the INT8
//! engine ([`sensitivity`]) and LLM episodes scored by a verifiable reward
//! ([`rollouts`]).
//!
//! It depends on `qforge-formats`, `qforge-kernels`, `qforge-model` (the
//! forwards it measures) and `qforge-decode` (the generation its rollouts
//! run) and is used by
//! the guard (`qforge-quant`), the CLI and the Python package; serving does
//! not need it.

pub mod agreement;
pub mod compare;
pub mod perplexity;
pub mod rollouts;
pub mod sensitivity;

pub use agreement::{AgreementReport, agreement};
pub use compare::{
    Comparison, ReferenceLogProbs, compare, compare_from, compare_to, increase_interval,
};
pub use perplexity::{Perplexity, perplexity};
