//! The error type of `qforge-quant`.

/// Errors of `qforge-quant`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The guard refused the quantized model: no artifact was written.
    #[error("{0}")]
    Refused(String),
    /// The recipe is malformed or inconsistent.
    #[error("recipe: {0}")]
    Recipe(String),
    /// The statistics do not fit the model or the recipe.
    #[error("statistics: {0}")]
    Stats(String),
    /// The held-out data cannot drive the guard.
    #[error("held-out data: {0}")]
    HeldOut(String),
    /// A model operation failed.
    #[error(transparent)]
    Model(#[from] qforge_model::Error),
    /// Reading or writing a file format failed.
    #[error(transparent)]
    Formats(#[from] qforge_formats::Error),
    /// Loading or planning the calibration data failed.
    #[error(transparent)]
    Calib(#[from] qforge_calib::Error),
    /// A calibration pass failed (a backend, the coordinator, coverage).
    #[error(transparent)]
    Runner(#[from] qforge_runner::Error),
    /// GPTQ cannot round a layer (its Hessian or weights are unusable).
    #[error("GPTQ: {0}")]
    Gptq(String),
    /// New weights cannot be quantized like the artifact given.
    #[error("requantize: {0}")]
    Requantize(String),
    /// Writing the report failed.
    #[error("report: {0}")]
    Report(String),
}

impl Error {
    /// Whether the request itself does not fit, in the library that
    /// refused it (see `qforge_model::Error::is_request`).
    pub fn is_request(&self) -> bool {
        match self {
            Error::Model(e) => e.is_request(),
            Error::Formats(e) => e.is_request(),
            Error::Calib(e) => e.is_request(),
            Error::Runner(e) => e.is_request(),
            _ => false,
        }
    }
}

/// Result type of `qforge-quant`.
pub type Result<T> = std::result::Result<T, Error>;
