//! The error type of `qforge-export`.

/// Errors of `qforge-export`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading the artifact or writing the export failed.
    #[error(transparent)]
    Model(#[from] qforge_model::Error),
    /// Reading the artifact's files or writing the export's failed.
    #[error(transparent)]
    Formats(#[from] qforge_formats::Error),
    /// The artifact cannot be expressed in the target format.
    #[error("{0}")]
    Unsupported(String),
    /// The artifact's files disagree with each other.
    #[error("{0}")]
    Inconsistent(String),
}

/// Result type of `qforge-export`.
pub type Result<T> = std::result::Result<T, Error>;
