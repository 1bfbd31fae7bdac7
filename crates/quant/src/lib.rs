//! `qforge-quant`: turns merged calibration statistics into an INT8 model
//! that provably keeps its accuracy, or refuses.
//!
//! * [`recipe`]: the TOML quantization recipe (calibration pass, activation
//!   scheme, calibrators per layer input, ignore list, guard budgets).
//! * [`pipeline`]: the initial per-layer plan, sensitivity ranking, the
//!   fallback ladder (static → dynamic → FP, whole fused groups) and the
//!   accuracy guard on held-out data.
//! * [`report`]: `report.json` and a self-contained `report.html`.
//! * [`smoothing`]: SmoothQuant's per-channel factors.
//!
//! It depends on `qforge-core`, `qforge-calib` and `qforge-model`; the
//! calibration run itself (embedded or Redis backend) is the caller's, so
//! this crate never knows where batches were observed. It must not depend on
//! serving or the CLI.

pub mod error;
pub mod pipeline;
pub mod recipe;
pub mod report;
pub mod smoothing;

pub use error::{Error, Result};
pub use pipeline::{Decision, FpModel, GuardMetrics, HeldOut, quantize};
pub use recipe::QuantRecipe;
pub use report::{CalibrationSummary, DeliveryEntry, Report, WorkerSummary};
