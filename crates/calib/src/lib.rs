//! `qforge-calib`: what a calibration pass computes, independent of where it
//! runs.
//!
//! It owns calibration data ([`data`]: JSONL rollouts of LLM episodes and
//! policy trajectories), the hashed [`Recipe`], the [`plan`] of batches with
//! stable ids, the [`Session`] that coordinator and workers both build from
//! model + data + recipe, the [`Transform`]s earlier passes imply, and the
//! map step of a pass ([`observe_batch`]: one batch → `Stats`). The reduce
//! step is `qforge_core::Stats::merge`, exact and order-free. It depends on
//! `qforge-core`, `qforge-formats` and `qforge-model`; it must not
//! know about workers, queues or files other than the data it reads.

pub mod data;
pub mod error;
pub mod observe;
pub mod plan;
pub mod session;
pub mod transform;
pub mod values;

pub use data::{Dataset, EpisodeContent, Record, load_jsonl};
pub use error::{Error, Result};
pub use observe::{
    HIDDEN_STATE_BUDGET, HiddenStates, Job, RoundedLayers, forward_samples, observe_batch,
};
pub use plan::{Batch, HessianPass, Pass, Plan, Recipe, Sample, Stratify, Stratum, plan};
pub use session::{Session, Weights, episode_tokens};
pub use transform::{
    TRANSFORMS_FILE, Transform, apply_all, read_transforms, transformed_digest, write_transforms,
};
pub use values::observe_value_file;
