//! qforge's errors as Python exceptions, with the library's message.
//!
//! * `qforge.QforgeError`: anything that failed (bad data, I/O, a refused
//!   merge); the base of the others.
//! * `qforge.UsageError`: the call asked for something
//!   that does not fit (a policy where a language model is needed, an
//!   observation of the wrong width, a recipe value out of range).
//! * `qforge.GuardRefused`: the accuracy guard refused the quantized model;
//!   the report was written, the artifact was not.

use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::{PyErr, create_exception};

create_exception!(
    qforge,
    QforgeError,
    PyException,
    "A qforge operation failed."
);
create_exception!(
    qforge,
    GuardRefused,
    QforgeError,
    "The accuracy guard refused the quantized model; no artifact was written."
);

create_exception!(
    qforge,
    UsageError,
    QforgeError,
    "The call asked for something that does not fit (see the message)."
);

/// Adds the exception classes to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("QforgeError", py.get_type::<QforgeError>())?;
    m.add("GuardRefused", py.get_type::<GuardRefused>())?;
    m.add("UsageError", py.get_type::<UsageError>())?;
    Ok(())
}

/// A usage error with `message`.
pub fn usage(message: impl Into<String>) -> PyErr {
    UsageError::new_err(message.into())
}

/// A failure with `message`.
pub fn failed_with(message: &str) -> PyErr {
    QforgeError::new_err(message.to_owned())
}

/// A library error as the exception its kind calls for.
pub struct Failure(PyErr);

impl From<Failure> for PyErr {
    fn from(failure: Failure) -> PyErr {
        failure.0
    }
}

impl From<PyErr> for Failure {
    fn from(error: PyErr) -> Self {
        Failure(error)
    }
}

fn failed(error: &impl std::fmt::Display) -> Failure {
    Failure(QforgeError::new_err(error.to_string()))
}

impl From<qforge_formats::Error> for Failure {
    fn from(error: qforge_formats::Error) -> Self {
        match error {
            qforge_formats::Error::Request(why) => Failure(usage(why)),
            other => failed(&other),
        }
    }
}

impl From<qforge_model::Error> for Failure {
    fn from(error: qforge_model::Error) -> Self {
        match error {
            qforge_model::Error::Formats(e) => e.into(),
            other => failed(&other),
        }
    }
}

impl From<qforge_quant::Error> for Failure {
    fn from(error: qforge_quant::Error) -> Self {
        match error {
            qforge_quant::Error::Refused(why) => Failure(GuardRefused::new_err(why)),
            qforge_quant::Error::Recipe(_) => Failure(usage(error.to_string())),
            qforge_quant::Error::Model(e) => e.into(),
            qforge_quant::Error::Formats(e) => e.into(),
            other => failed(&other),
        }
    }
}

impl From<qforge_calib::Error> for Failure {
    fn from(error: qforge_calib::Error) -> Self {
        failed(&error)
    }
}

impl From<qforge_runner::Error> for Failure {
    fn from(error: qforge_runner::Error) -> Self {
        match error {
            qforge_runner::Error::Request(why) => Failure(usage(why)),
            qforge_runner::Error::Model(e) => e.into(),
            qforge_runner::Error::Formats(e) => e.into(),
            other => failed(&other),
        }
    }
}

impl From<serde_json::Error> for Failure {
    fn from(error: serde_json::Error) -> Self {
        failed(&error)
    }
}
