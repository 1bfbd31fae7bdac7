//! `qforge.calibrate`, `qforge.quantize` and `qforge.requantize`: the CLI's
//! commands with its defaults, run on this machine's threads, returning the
//! CLI's `--json` reports as dicts.

use std::path::{Path, PathBuf};

use pyo3::prelude::*;
use qforge_calib::{Pass, Recipe, Stratify};
use qforge_quant::recipe::{ActivationScheme, Overrides};
use qforge_quant::returns::bundled;
use qforge_quant::{Inputs, Pipeline, QuantRecipe};
use qforge_runner::{Calibration, EmbeddedExecutor};
use serde::Serialize;

use crate::errors::{Failure, usage};
use crate::to_python;

/// A report of something written to `output` (its `"output"` added), as a
/// dict.
fn written<'py>(
    py: Python<'py>,
    output: &Path,
    report: &impl Serialize,
) -> PyResult<Bound<'py, PyAny>> {
    let dict = to_python(py, report)?;
    dict.set_item("output", output.to_string_lossy())?;
    Ok(dict)
}

/// Worker threads: `workers`, or one per core.
fn executor(workers: Option<usize>) -> PyResult<EmbeddedExecutor> {
    match workers {
        Some(0) => Err(usage("workers must be at least 1")),
        Some(threads) => Ok(EmbeddedExecutor { threads }),
        None => Ok(EmbeddedExecutor::per_core()),
    }
}

/// A value among `names` (as the CLI spells them).
fn choice<T: Clone>(what: &str, text: &str, names: &[(&str, T)]) -> PyResult<T> {
    names
        .iter()
        .find(|(name, _)| *name == text)
        .map(|(_, value)| value.clone())
        .ok_or_else(|| {
            let names: Vec<&str> = names.iter().map(|(name, _)| *name).collect();
            usage(format!("{what} {text:?}: one of {}", names.join(", ")))
        })
}

const STRATIFY: [(&str, Stratify); 2] = [("none", Stratify::None), ("reward", Stratify::Reward)];

/// `qforge calibrate`: samples `data`, observes every batch on worker
/// threads, merges the statistics exactly and writes them to `output`
/// (`.qstats`). Returns the calibration report.
#[pyfunction]
#[pyo3(signature = (
    model, data, output, *, samples = 512, seq_len = 512, batch_size = 8, seed = 0,
    stratify = "none", pass_ = "activation", workers = None, min_coverage = 1.0,
    skip_invalid = false,
))]
#[allow(clippy::too_many_arguments)] // Python's keywords, one per CLI flag.
pub fn calibrate<'py>(
    py: Python<'py>,
    model: PathBuf,
    data: PathBuf,
    output: PathBuf,
    samples: usize,
    seq_len: usize,
    batch_size: usize,
    seed: u64,
    stratify: &str,
    pass_: &str,
    workers: Option<usize>,
    min_coverage: f64,
    skip_invalid: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let recipe = Recipe {
        samples,
        seq_len,
        batch_size,
        seed,
        stratify: choice("stratify", stratify, &STRATIFY)?,
        pass: choice(
            "pass_",
            pass_,
            &[
                ("activation", Pass::Activation),
                ("smoothing", Pass::Smoothing),
            ],
        )?,
    };
    let calibration = Calibration {
        skip_invalid,
        min_coverage,
        ..Calibration::new(model, data, recipe)
    };
    let executor = executor(workers)?;
    let calibrated =
        (py.detach(|| calibration.run(&executor, &output, &mut ()))).map_err(Failure::from)?;
    written(py, &output, &calibrated.report())
}

/// `qforge quantize`: calibrates `model` on `data`, applies the recipe (the
/// file `recipe`, or the defaults, with the keywords applied), checks
/// accuracy on held-out data with fallback to higher precision, and writes
/// the native artifact with its reports into `output`. With no model and
/// data it quantizes the bundled CartPole policy (from a qforge checkout).
/// Returns the outcome; raises `GuardRefused` (after writing the report)
/// when the guard refuses.
#[pyfunction]
#[pyo3(signature = (
    model = None, data = None, output = PathBuf::from("qforge-out"), *, recipe = None,
    eval_data = None, workers = None, skip_invalid = false, no_method_search = false,
    samples = None, seq_len = None, batch_size = None, seed = None, stratify = None,
    min_coverage = None, activations = None, calibrator = None, ignore = Vec::new(),
    fp_lm_head = false, smoothquant = false, alpha = None, hadamard = None, gptq = false,
    gptq_act_order = false, sequential = false, max_perplexity_increase = None, min_agreement = None,
    max_fp_fraction = None, ctx = None,
))]
#[allow(clippy::too_many_arguments)] // Python's keywords, one per CLI flag.
pub fn quantize<'py>(
    py: Python<'py>,
    model: Option<PathBuf>,
    data: Option<PathBuf>,
    output: PathBuf,
    recipe: Option<PathBuf>,
    eval_data: Option<PathBuf>,
    workers: Option<usize>,
    skip_invalid: bool,
    no_method_search: bool,
    samples: Option<usize>,
    seq_len: Option<usize>,
    batch_size: Option<usize>,
    seed: Option<u64>,
    stratify: Option<&str>,
    min_coverage: Option<f64>,
    activations: Option<&str>,
    calibrator: Option<String>,
    ignore: Vec<String>,
    fp_lm_head: bool,
    smoothquant: bool,
    alpha: Option<f64>,
    hadamard: Option<String>,
    gptq: bool,
    gptq_act_order: bool,
    sequential: bool,
    max_perplexity_increase: Option<f64>,
    min_agreement: Option<f64>,
    max_fp_fraction: Option<f64>,
    ctx: Option<usize>,
) -> PyResult<Bound<'py, PyAny>> {
    let overrides = Overrides {
        no_method_search,
        samples,
        seq_len,
        batch_size,
        seed,
        stratify: stratify
            .map(|s| choice("stratify", s, &STRATIFY))
            .transpose()?,
        min_coverage,
        activations: activations
            .map(|a| {
                let schemes = [
                    ("static", ActivationScheme::Static),
                    ("dynamic", ActivationScheme::Dynamic),
                ];
                choice("activations", a, &schemes)
            })
            .transpose()?,
        calibrator,
        ignore,
        fp_lm_head,
        smoothquant,
        alpha,
        hadamard,
        gptq,
        gptq_act_order,
        sequential,
        max_perplexity_increase,
        min_agreement,
        max_fp_fraction,
        ctx,
    };
    let recipe = recipe_with(recipe, &overrides)?;
    let inputs = match (model, data) {
        (Some(model), Some(data)) => (model, data),
        (None, None) => (
            bundled("fixtures/policies/cartpole").map_err(Failure::from)?,
            bundled("fixtures/policies/cartpole/rollouts.jsonl").map_err(Failure::from)?,
        ),
        _ => {
            return Err(usage(
                "give both model and data, or neither (the bundled CartPole)",
            ));
        }
    };
    let inputs = Inputs {
        model: inputs.0,
        data: inputs.1,
        eval_data,
        skip_invalid,
    };
    let executor = executor(workers)?;
    let quantized = py.detach(|| -> Result<_, Failure> {
        let quantized = Pipeline::new(recipe, &executor)?.run(&inputs, &mut ())?;
        quantized.write_to(&output, None)?;
        Ok(quantized)
    })?;
    if let Some(refusal) = quantized.refusal(&output) {
        return Err(Failure::from(refusal).into());
    }
    let outcome = quantized
        .report
        .outcome(&inputs.model, &quantized.held_out, &output);
    to_python(py, &outcome)
}

/// The recipe file `path` (the defaults without one) with `overrides`
/// applied, as `qforge quantize` reads it.
fn recipe_with(path: Option<PathBuf>, overrides: &Overrides) -> PyResult<QuantRecipe> {
    let recipe = match path {
        Some(path) => {
            let text = qforge_formats::files::read_config_text(&path).map_err(Failure::from)?;
            QuantRecipe::from_toml(&text).map_err(Failure::from)?
        }
        None => QuantRecipe::default(),
    };
    Ok(recipe.with_overrides(overrides).map_err(Failure::from)?)
}

/// `qforge requantize`: the new weights `model` quantized like the artifact
/// `like` (its frozen activation scales, smoothing, rotations and
/// precisions), written to `output`. Returns the report: how many int8
/// weights changed, and the inputs whose activations grew past
/// `drift_threshold` (a recalibration is then due).
#[pyfunction]
#[pyo3(signature = (model, like, output, *, drift_threshold = 0.1))]
pub fn requantize<'py>(
    py: Python<'py>,
    model: PathBuf,
    like: PathBuf,
    output: PathBuf,
    drift_threshold: f64,
) -> PyResult<Bound<'py, PyAny>> {
    let requantized = py.detach(|| -> Result<_, Failure> {
        let requantized = qforge_quant::requantize::requantize(&model, &like, drift_threshold)?;
        qforge_formats::output::write_dir_atomic(&output, |dir| requantized.write(dir).map(drop))?;
        Ok(requantized)
    })?;
    written(py, &output, &requantized.report())
}
