//! The error type of `qforge-formats`.

use std::path::{Path, PathBuf};

/// Errors of `qforge-formats`. Messages name the file or tensor at fault
/// and, where there is one, what to do.
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
    /// What the caller asked for does not fit: an output path that is a
    /// directory, text from a tokenizer that has only ids.
    #[error("{0}")]
    Request(String),
    /// An output location cannot be written as asked (it holds something
    /// qforge did not write).
    #[error("{0}")]
    Output(String),
    /// A well-formed input uses something qforge does not support.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A tensor the caller asked for is absent.
    #[error("{file}: missing tensor {name}; is this the right model file for the architecture?")]
    MissingTensor {
        /// Tensor name.
        name: String,
        /// File or directory searched.
        file: PathBuf,
    },
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
}

impl Error {
    /// Whether the request itself does not fit (an output path that is a
    /// directory), through the file it happened in: a usage error, not a
    /// failure.
    pub fn is_request(&self) -> bool {
        match self {
            Error::Request(_) => true,
            Error::InFile { source, .. } => source.is_request(),
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
            other => Error::InFile {
                path: path.to_owned(),
                source: Box::new(other),
            },
        }
    }
}

/// Result type of `qforge-formats`.
pub type Result<T> = std::result::Result<T, Error>;
