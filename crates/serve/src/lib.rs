//! `qforge-serve`: qforge's INT8 engine behind HTTP, for real-time control
//! policies: `POST /v1/act` with dynamic batching ([`batcher`]), health and
//! readiness probes, Prometheus metrics ([`metrics`]), request limits
//! ([`server`]), connections with read deadlines, a cap and a bounded drain
//! on shutdown ([`conn`]), and A/B or shadow rollout against the FP
//! reference with automatic rollback ([`rollout`]), and a drift monitor
//! comparing layer inputs with calibration ([`drift`]).
//!
//! It depends on `qforge-core` (SplitMix64's mix for the A/B split),
//! `qforge-model`, `qforge-decode` and `qforge-formats` only
//! (a native artifact or a policy directory loads in the model, completions
//! decode on `qforge-decode`'s INT8 decoder, the manifest and calibration
//! profile are read with `qforge-formats`); it must not depend on
//! calibration, quantization or the CLI.

pub mod batcher;
pub mod conn;
pub mod drift;
pub mod engine;
pub mod error;
mod feedback;
mod http;
mod logprobs;
pub mod metrics;
mod openai;
mod origin;
pub mod reload;
pub mod rollout;
pub mod served;
pub mod server;
mod state;
mod swap;
#[cfg(test)]
mod testing;
mod token;

pub use conn::ConnectionLimits;
pub use drift::DriftOptions;
pub use engine::EngineLimits;
pub use error::{Error, Result};
pub use rollout::{Arm, RolloutMode, RolloutOptions};
pub use served::{Calibration, Served, reference_for};
pub use server::{ServeOptions, serve, termination_signal};
