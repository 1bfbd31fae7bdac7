//! The error type of `qforge-model`.

use std::path::{Path, PathBuf};

/// Errors of `qforge-model`. Messages name the file or tensor at fault and,
/// where there is one, what to do. What a file, a shape or a request can get
/// wrong is said by [`qforge_formats::Error`] (the `Formats` variant), which
/// the model's code shares with the formats it reads.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file's content is malformed.
    #[error("{0}")]
    Format(String),
    /// An INT8 kernel failed.
    #[error(transparent)]
    Kernel(#[from] qforge_kernels::Error),
    /// Any error, with the file it happened in.
    #[error("{path}: {source}")]
    InFile {
        /// The file.
        path: PathBuf,
        /// The error.
        source: Box<Error>,
    },
    /// Statistics failed.
    #[error(transparent)]
    Core(#[from] qforge_core::Error),
    /// A file could not be read or was malformed, a tensor is missing or its
    /// shape is wrong, the request does not fit the model, a tensor
    /// operation failed.
    #[error(transparent)]
    Formats(#[from] qforge_formats::Error),
}

/// A tensor operation failed; said as [`qforge_formats::Error::Candle`], as
/// every file and shape error is.
impl From<candle_core::Error> for Error {
    fn from(error: candle_core::Error) -> Self {
        Error::Formats(error.into())
    }
}

impl Error {
    /// Whether the request itself does not fit (a setting out of range, a
    /// policy where a language model is needed), through the file it
    /// happened in: a usage error, not a failure.
    pub fn is_request(&self) -> bool {
        match self {
            Error::InFile { source, .. } => source.is_request(),
            Error::Formats(e) => e.is_request(),
            _ => false,
        }
    }

    /// An I/O error on `path`.
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        Error::Formats(qforge_formats::Error::io(path, source))
    }

    /// Attaches the file the error happened in.
    pub fn in_file(self, path: &Path) -> Self {
        match self {
            already @ Error::InFile { .. } => already,
            Error::Formats(e) => Error::Formats(e.in_file(path)),
            other => Error::InFile {
                path: path.to_owned(),
                source: Box::new(other),
            },
        }
    }
}

/// Result type of `qforge-model`.
pub type Result<T> = std::result::Result<T, Error>;
