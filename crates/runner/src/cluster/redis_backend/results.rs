//! Turning a results entry into an [`Outcome`] for the coordinator: its
//! seal, the batches and ids it claims against the plan, the fingerprint
//! it was computed under; or dropping it, with the reason counted for the
//! run's warnings. The holders of its batches (where the next pass routes
//! them) and the workers' time per batch are recorded here too.

use std::time::Duration;

use qforge_calib::Plan;
use redis::streams::StreamId;

use super::{RedisBackend, UNSEALED_NAMED};
use crate::backend::{Failure, Outcome};
use crate::cluster::keys::{joined, named_batches};
use crate::cluster::link::Link;
use crate::cluster::policy;
use crate::cluster::receive::Received;
use crate::error::Result;

impl RedisBackend {
    /// Turns a results entry, as it was `received`, into an outcome; `None`
    /// (with the reason counted) for one that must not reach the merge.
    pub(super) fn outcome(
        &self,
        link: &mut Link,
        plan: &Plan,
        entry: &StreamId,
        received: Received,
    ) -> Result<Option<Outcome>> {
        let text = |field: &str| entry.get::<String>(field).unwrap_or_default();
        let worker = text("worker");
        if let Received::Unsealed = received {
            let mut book = self.book.borrow_mut();
            if book.unsealed.len() < UNSEALED_NAMED {
                book.unsealed.push(format!(
                    "entry {} (claiming worker {worker:?}, batches {:?})",
                    entry.id,
                    text("batches")
                ));
            }
            drop(book);
            return self.drop_as(
                "fails its MAC under this run's key: something that does not hold the cluster \
                 key wrote it to Redis; check who can write to it",
            );
        }
        let Some(batches) =
            named_batches(entry).filter(|batches| batches.iter().all(|&b| b < plan.batches.len()))
        else {
            return self.drop_as("names no batch of this plan");
        };
        if text("ids") != joined(batches.iter().map(|&b| plan.batches[b].id)) {
            return self.drop_as("has batch ids that differ from the plan's");
        }
        if let Some(message) = entry.get::<String>("error") {
            let kind = entry.get::<String>("failure");
            return Ok(Some(Outcome::Failed {
                batches,
                worker,
                error: Failure::from_parts(kind.as_deref(), message),
            }));
        }
        if self.book.borrow().reference.is_none() {
            let reference: Option<String> =
                link.call(|c| redis::cmd("GET").arg(self.keys.reference()).query(c))?;
            self.book.borrow_mut().reference = reference;
        }
        let mixed = self.book.borrow().reference.as_deref() != Some(text("fingerprint").as_str());
        if mixed && !self.spec.allow_mixed_hardware {
            return self.drop_as("came from a worker whose determinism fingerprint differs");
        }
        let Received::Stats { decoded, digest } = received else {
            return self.drop_as("carries neither statistics nor an error");
        };
        let mut stats = match decoded {
            Ok(stats) => stats,
            Err(e) => {
                return Ok(Some(Outcome::Failed {
                    batches,
                    worker,
                    error: Failure::Worker(format!("the result does not decode: {e}")),
                }));
            }
        };
        stats.provenance.mixed_hardware |= mixed;
        let mut book = self.book.borrow_mut();
        book.reporting.insert(worker.clone());
        for &batch in &batches {
            book.holders.insert(batch, worker.clone());
        }
        drop(book);
        let elapsed = Duration::from_micros(entry.get::<u64>("elapsed_us").unwrap_or(0));
        policy::smooth(
            &mut self.book.borrow_mut().batch_seconds,
            elapsed.as_secs_f64() / batches.len() as f64,
        );
        Ok(Some(Outcome::Done {
            batches,
            stats: Box::new(stats),
            worker,
            elapsed,
            speculative: text("speculative") == "1",
            // Results computed under another fingerprint may differ in
            // their last bits: only same-fingerprint copies must agree.
            digest: (!mixed).then_some(digest),
        }))
    }

    /// Counts a result dropped for `why` (the warning reads "dropped N
    /// result(s) that `why`").
    fn drop_as(&self, why: &str) -> Result<Option<Outcome>> {
        *self
            .book
            .borrow_mut()
            .dropped
            .entry(why.to_owned())
            .or_default() += 1;
        Ok(None)
    }
}
