//! `qforge` for Python: the library behind the CLI, for trainers and
//! evaluators that live in Python. Policies and language models open from
//! the same paths the CLI takes; observations, actions, log-probabilities
//! and logits are numpy arrays; `calibrate`, `quantize` and `requantize`
//! take the CLI's defaults and return the CLI's `--json` reports as dicts
//! (the same library types print both). The GIL is released while qforge
//! computes, so Python threads (an environment stepping beside a policy)
//! run meanwhile.

mod errors;
mod language;
mod models;
mod pipeline;
mod rollouts;

use pyo3::prelude::*;

use crate::errors::Failure;

/// `value` (a library report) as a Python object, through JSON: the same
/// fields, under the same names, as the CLI's `--json` prints.
fn to_python<'py>(py: Python<'py>, value: &impl serde::Serialize) -> PyResult<Bound<'py, PyAny>> {
    let text = serde_json::to_string(value).map_err(Failure::from)?;
    py.import("json")?.call_method1("loads", (text,))
}

/// The Python module `qforge`.
#[pymodule]
fn qforge(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    m.add_class::<models::Policy>()?;
    m.add_class::<language::LanguageModel>()?;
    m.add_class::<rollouts::RequestOutput>()?;
    m.add_class::<rollouts::CompletionOutput>()?;
    m.add_function(wrap_pyfunction!(models::open, m)?)?;
    m.add_function(wrap_pyfunction!(pipeline::calibrate, m)?)?;
    m.add_function(wrap_pyfunction!(pipeline::quantize, m)?)?;
    m.add_function(wrap_pyfunction!(pipeline::requantize, m)?)?;
    Ok(())
}
