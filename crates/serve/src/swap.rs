//! The message that swaps a serving loop's model (see [`crate::reload`]):
//! the policy batcher and the completion engine take the same one.

use tokio::sync::oneshot;

use crate::drift::DriftMonitor;

/// A model for a serving loop to swap in (a policy between two batches, a
/// language model once its admitted completions are done), with the drift
/// monitor that watches it and its version.
pub(crate) struct Swap<M> {
    pub(crate) model: M,
    pub(crate) monitor: Option<DriftMonitor>,
    pub(crate) version: u64,
    /// Hears that the new model serves.
    pub(crate) done: oneshot::Sender<()>,
}

impl<M> Swap<M> {
    /// The swap to `model` as `version`, and the receiver that hears when
    /// it serves.
    pub(crate) fn new(
        model: M,
        monitor: Option<DriftMonitor>,
        version: u64,
    ) -> (Box<Self>, oneshot::Receiver<()>) {
        let (done, swapped) = oneshot::channel();
        let swap = Self {
            model,
            monitor,
            version,
            done,
        };
        (Box::new(swap), swapped)
    }
}
