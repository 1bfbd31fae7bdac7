//! `qforge-runner`: where calibration passes run, on worker threads in this
//! process or on a Redis cluster.
//!
//! It owns the [`Backend`] trait (the map step: batches in, outcomes out), the
//! embedded backend (worker threads in this process), the [`Executor`]s that
//! run a pipeline's passes one at a time on either, the [`coordinator`]
//! (the reduce step: each batch id merged exactly once, retries, quarantine,
//! coverage), the [`record`] of what a run did, and [`checkpoint`]s. Because merging is exact and order-free, the
//! statistics of a run are byte-identical whatever the backend, the number of
//! workers, the order results arrive in, and the failures on the way. It
//! depends on `qforge-calib`, `qforge-model`, `qforge-formats` and
//! `qforge-core`.

pub mod backend;
pub mod calibration;
pub mod checkpoint;
pub mod cluster;
pub mod coordinator;
pub mod error;
pub mod executor;
mod merger;
pub mod record;

pub use backend::{Backend, Embedded, Failure, Next, Outcome};
pub use calibration::{Calibrated, Calibration};
pub use checkpoint::CheckpointStore;
pub use coordinator::{RunOptions, run};
pub use error::{Error, Result};
pub use executor::{
    ClusterSettings, EmbeddedExecutor, Executor, Listener, PassEvent, PassPosition, RedisExecutor,
};
pub use record::{Delivery, MAX_ATTEMPTS, PassReport, Progress, RunSummary, WorkerAccount};

/// The build a worker reports when it joins a run.
pub const BUILD: &str = concat!("qforge ", env!("CARGO_PKG_VERSION"));
