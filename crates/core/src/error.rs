//! The error type of `qforge-core`.

/// Errors of `qforge-core`. Each message names the problem and, where there is
/// one, what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The bytes are not a `.qstats` file at all.
    #[error("not a .qstats file (bad magic bytes); was the file written by `qforge stats`?")]
    NotStats,
    /// The file was written by an incompatible version of the format.
    #[error(
        ".qstats format version {found} is not supported (this build reads version 2, and version {supported} for statistics with Hessians); recompute the statistics with this build, or read them with the build that wrote them"
    )]
    Version {
        /// Version found in the file.
        found: u32,
        /// Version this build reads.
        supported: u32,
    },
    /// The file ends early.
    #[error("truncated .qstats file: {0}; the file was cut short (interrupted copy or write?)")]
    Truncated(String),
    /// The checksum does not match the content.
    #[error(
        ".qstats checksum mismatch (stored {stored:#010x}, computed {computed:#010x}): the file is corrupt; regenerate it or restore a copy"
    )]
    Checksum {
        /// Checksum stored in the file.
        stored: u32,
        /// Checksum of the bytes read.
        computed: u32,
    },
    /// The content is structurally invalid although the checksum matched.
    #[error("corrupt .qstats content: {0}")]
    Corrupt(String),
    /// Two statistics cannot be merged because they come from different sources
    /// or share batches.
    #[error(
        "refusing to merge statistics: {0}; merging them would mix different calibrations or count batches twice (pass --force to merge anyway; the result is marked as forced)"
    )]
    ProvenanceMismatch(String),
    /// Shapes disagree.
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// A textual argument could not be parsed.
    #[error("{0}")]
    Parse(String),
    /// A value that must be finite is not (NaN or infinite activations).
    #[error("{0}")]
    NonFinite(String),
    /// An exact integer sum would leave its range; it is refused, never wrapped.
    #[error("{0}")]
    Overflow(String),
    /// The requested kernel tier is not supported by this CPU.
    #[error("CPU tier {0} is not supported on this machine")]
    UnsupportedTier(String),
}

/// Result type of `qforge-core`.
pub type Result<T> = std::result::Result<T, Error>;
