//! The error type of `qforge-model`.

use std::path::{Path, PathBuf};

/// Errors of `qforge-model`. Messages name the file or tensor at fault and,
/// where there is one, what to do.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A file's content is malformed.
    #[error("{0}")]
    Format(String),
    /// What the caller asked for does not fit the model: a policy where a
    /// language model is needed (or the reverse), a precision an artifact
    /// does not run in.
    #[error("{0}")]
    Request(String),
    /// An output location cannot be written as asked (it holds something
    /// qforge did not write).
    #[error("{0}")]
    Output(String),
    /// A well-formed input uses something qforge does not support.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A tensor the architecture needs is absent.
    #[error("{file}: missing tensor {name}; is this the right model file for the architecture?")]
    MissingTensor {
        /// Tensor name.
        name: String,
        /// File or directory searched.
        file: PathBuf,
    },
    /// An INT8 kernel failed.
    #[error(transparent)]
    Kernel(#[from] qforge_kernels::Error),
    /// Shapes disagree.
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// Any error, with the file it happened in.
    #[error("{path}: {source}")]
    InFile {
        /// The file.
        path: PathBuf,
        /// The error.
        source: Box<Error>,
    },
    /// A tensor operation failed.
    #[error("tensor operation failed: {0}")]
    Candle(#[from] candle_core::Error),
    /// Statistics failed.
    #[error(transparent)]
    Core(#[from] qforge_core::Error),
    /// Reading or writing a file format failed.
    #[error(transparent)]
    Formats(#[from] qforge_formats::Error),
}

impl Error {
    /// Whether the request itself does not fit (a setting out of range, a
    /// policy where a language model is needed), through the file it
    /// happened in: a usage error, not a failure.
    pub fn is_request(&self) -> bool {
        match self {
            Error::Request(_) => true,
            Error::InFile { source, .. } => source.is_request(),
            Error::Formats(e) => e.is_request(),
            _ => false,
        }
    }

    /// An I/O error on `path`.
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        Error::Io {
            path: path.to_owned(),
            source,
        }
    }

    /// Attaches the file the error happened in.
    pub fn in_file(self, path: &Path) -> Self {
        match self {
            already @ (Error::Io { .. } | Error::InFile { .. } | Error::MissingTensor { .. }) => {
                already
            }
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
