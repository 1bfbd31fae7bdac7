//! The error type of `qforge-serve`.

use std::net::SocketAddr;

/// Errors of `qforge-serve`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The options are inconsistent.
    #[error("{0}")]
    Options(String),
    /// The address could not be bound.
    #[error("cannot listen on {0}: {1} (is another server using the port?)")]
    Bind(SocketAddr, std::io::Error),
    /// The model (or its reference or calibration profile) did not load.
    #[error(transparent)]
    Model(#[from] qforge_model::Error),
    /// The artifact's manifest or calibration profile did not read.
    #[error(transparent)]
    Formats(#[from] qforge_formats::Error),
    /// A thread the server needs could not start.
    #[error("cannot start {0}")]
    Start(String),
}

/// Result type of `qforge-serve`.
pub type Result<T> = std::result::Result<T, Error>;
