//! `qforge-core`: the numeric heart of qforge.
//!
//! It owns the calibration statistics and everything computed from them:
//!
//! - [`Histogram`] and [`TensorStats`]: exact, mergeable statistics of f32
//!   activations (data-independent log-linear bins, integer counts, min/max,
//!   per-channel abs-max). Merging is integer addition or max, so statistics of
//!   any sharding of the same data are identical bit for bit.
//! - [`Stats`], [`Provenance`], [`BatchId`]: the merged statistics of a pass,
//!   where they came from, and which batches they contain.
//! - [`Gram`]: exact Gram matrices `Σ x xᵀ` of layer inputs (GPTQ's
//!   Hessians), f32 chunk sums scaled to a run-wide fixed point, rounded and
//!   merged as `i128`.
//! - [`Calibrator`]: minmax, percentile, entropy (KL), mse and sigma clipping.
//! - [`QuantParams`]: int8 quantization parameters (symmetric, asymmetric)
//!   and (de)quantization; the engine's per-row weight quantizer is
//!   `qforge_kernels::quantize_rows_symmetric`, the only one.
//! - [`error_metrics`]: MSE, SQNR and max-abs error.
//! - [`codec`]: the `.qstats` file format, bytes in and bytes out.
//! - [`demo`]: the exactness promise shown on seeded synthetic activations.
//! - [`SplitMix64`]: the seeded stream for draws that are part of qforge's
//!   output (plan order, fingerprint probes, rotation signs), fixed forever.
//!
//! It must not depend on any other qforge crate, and performs no file or network
//! I/O and no async: callers hand it bytes and slices.

pub mod calibrate;
pub mod codec;
pub mod cpu;
pub mod demo;
pub mod error;
pub mod gram;
pub mod histogram;
pub mod metrics;
pub mod params;
pub mod report;
pub mod splitmix;
pub mod stats;

pub use calibrate::Calibrator;
pub use cpu::{CpuFeatures, CpuTier, VectorTier};
pub use error::{Error, Result};
pub use gram::Gram;
pub use histogram::{Histogram, ObserveTier};
pub use metrics::{ErrorMetrics, error_metrics};
pub use params::{Fit, QuantParams, RangeWarning};
pub use report::StatsReport;
pub use splitmix::SplitMix64;
pub use stats::{BatchId, Digest, DigestBuilder, MergePolicy, Provenance, Stats, TensorStats};
