//! `qforge-quant`: turns merged calibration statistics into an INT8 model
//! that provably keeps its accuracy, or refuses.
//!
//! * [`recipe`]: the TOML quantization recipe (calibration pass, activation
//!   scheme, calibrators per layer input, ignore list, guard budgets).
//! * [`pipeline`]: a recipe's calibration passes run on any
//!   `qforge_runner::Executor` (worker threads or Redis), the transforms their
//!   merged results imply (SmoothQuant), the guard, and the artifact.
//! * [`guard`]: the initial per-layer plan, sensitivity ranking, the
//!   fallback ladder (static → dynamic → FP, whole fused groups) and the
//!   accuracy guard on held-out data.
//! * `ladder` (internal): the guard's demotion sequence within the FP cap
//!   and the bisection for its shortest passing prefix.
//! * [`gptq`]: GPTQ's rounding of int8 weights by each layer input's exact
//!   Hessian.
//! * [`held_out`]: the guard's data.
//! * [`report`]: `report.json` and a self-contained `report.html`.
//! * [`smoothing`]: SmoothQuant's per-channel factors.
//! * [`requantize`] and [`sync`]: new weights of a quantized model in its
//!   frozen precision, from files (`qforge requantize`) or from a trainer's
//!   memory (the Python package's `load_weights`).
//!
//! It depends on `qforge-core`, `qforge-model`, `qforge-calib` and
//! `qforge-runner` (the executor is the caller's choice: the pipeline never
//! knows where batches were observed). It must not depend on serving or the
//! CLI, and reports through return values and a [`qforge_runner::Listener`], never by
//! printing.

pub mod error;
pub mod gptq;
pub mod guard;
pub mod held_out;
mod ladder;
pub mod pipeline;
pub mod precision;
pub mod recipe;
pub mod report;
pub mod requantize;
pub mod returns;
pub mod smoothing;
pub mod sync;

pub use error::{Error, Result};
pub use guard::{Decision, GuardMetrics, HeldOut, quantize};
pub use pipeline::{Inputs, Pipeline, Quantized};
pub use recipe::{Method, QuantRecipe};
pub use report::{
    CalibrationSummary, GptqRecord, MethodSearch, MethodTrial, MostlyStatic, Outcome, PassRecord,
    Report,
};
