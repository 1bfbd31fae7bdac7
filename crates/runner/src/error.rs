//! The error type of `qforge-runner`.

/// Errors of `qforge-runner`. Each says whether retrying can help.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Observing a batch failed.
    #[error(transparent)]
    Calib(#[from] qforge_calib::Error),
    /// The model failed (loading it, or its forward pass).
    #[error(transparent)]
    Model(#[from] qforge_model::Error),
    /// Reading or writing a file format failed.
    #[error(transparent)]
    Formats(#[from] qforge_formats::Error),
    /// Merging or decoding statistics failed.
    #[error(transparent)]
    Core(#[from] qforge_core::Error),
    /// A checkpoint could not be written or read.
    #[error("checkpoint {path}: {reason}")]
    Checkpoint {
        /// The file or directory.
        path: String,
        /// What went wrong.
        reason: String,
    },
    /// The run merged too few batches.
    #[error(
        "coverage {merged}/{planned} batches is below the required {required:.3}; missing batch ids: {missing}; \
         rerun (or --resume) to compute them, or lower --min-coverage to accept partial statistics"
    )]
    Coverage {
        /// Batches merged.
        merged: usize,
        /// Batches planned.
        planned: usize,
        /// Required fraction.
        required: f64,
        /// The first missing ids.
        missing: String,
    },
    /// A worker returned statistics that do not belong to the run.
    #[error("worker {worker} returned statistics for an unknown batch {batch}")]
    ForeignResult {
        /// The worker.
        worker: String,
        /// The batch id it claimed.
        batch: String,
    },
    /// Redis (or the run in it) could not be used.
    #[error("{0}")]
    Cluster(String),
    /// The run refused this worker.
    #[error("refused: {0}")]
    Refused(String),
    /// What the caller asked for does not fit: a setting out of range, or
    /// settings that contradict each other.
    #[error("{0}")]
    Request(String),
    /// A worker thread died.
    #[error("worker {0} panicked")]
    WorkerPanic(String),
}

impl Error {
    /// Whether the request itself does not fit, here or in the library
    /// that refused it (see `qforge_model::Error::is_request`).
    pub fn is_request(&self) -> bool {
        match self {
            Error::Request(_) => true,
            Error::Model(e) => e.is_request(),
            Error::Formats(e) => e.is_request(),
            Error::Calib(e) => e.is_request(),
            _ => false,
        }
    }

    /// Whether running the same thing again can succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Checkpoint { .. }
            | Error::Coverage { .. }
            | Error::WorkerPanic(_)
            | Error::Cluster(_) => true,
            Error::Calib(_)
            | Error::Model(_)
            | Error::Formats(_)
            | Error::Core(_)
            | Error::ForeignResult { .. }
            | Error::Refused(_)
            | Error::Request(_) => false,
        }
    }
}

/// Result type of `qforge-runner`.
pub type Result<T> = std::result::Result<T, Error>;
