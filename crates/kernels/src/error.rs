//! The error type of `qforge-kernels`.

/// Errors of `qforge-kernels`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Buffers or matrices whose sizes do not fit together.
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// A CPU tier this machine lacks.
    #[error("this CPU does not support the {0} kernel tier")]
    UnsupportedTier(String),
}

/// Result type of `qforge-kernels`.
pub type Result<T> = std::result::Result<T, Error>;
