//! The error type of `qforge-calib`.

/// Errors of `qforge-calib`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A line of the calibration data is not a valid record.
    #[error(
        "{path}:{line}: {reason} (fix the line, or pass --skip-invalid to count and skip such lines)"
    )]
    InvalidLine {
        /// The data file.
        path: String,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        reason: String,
    },
    /// The data cannot serve the model or recipe.
    #[error("{0}")]
    Data(String),
    /// A recipe value is invalid.
    #[error("invalid calibration recipe: {0}")]
    Recipe(String),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] qforge_model::Error),
    /// Reading or writing a file, or a file format, failed.
    #[error(transparent)]
    Formats(#[from] qforge_formats::Error),
    /// Statistics failed.
    #[error(transparent)]
    Core(#[from] qforge_core::Error),
}

impl Error {
    /// Whether the request itself does not fit, in the library that
    /// refused it (see `qforge_model::Error::is_request`).
    pub fn is_request(&self) -> bool {
        match self {
            Error::Model(e) => e.is_request(),
            Error::Formats(e) => e.is_request(),
            _ => false,
        }
    }
}

/// Result type of `qforge-calib`.
pub type Result<T> = std::result::Result<T, Error>;
