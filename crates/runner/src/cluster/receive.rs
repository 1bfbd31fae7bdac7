//! What the coordinator makes of a results entry before anything of it
//! reaches the merge: whether its MAC verifies (see [`super::auth`]), its
//! statistics decoded against the shapes the pass produces, and whether its
//! id is one a worker could have written.

use qforge_core::codec::{self, Shapes};
use qforge_core::{Digest, Stats};
use redis::Value;
use redis::streams::StreamId;

use super::auth::RunKey;
use super::keys::{entry_id, now_ms};
use crate::error::{Error, Result};

/// A results entry as the coordinator first reads it.
pub(crate) enum Received {
    /// Its MAC does not verify under the run key: refused, never decoded.
    Unsealed,
    /// Sealed, without statistics (a batch's error).
    Sealed,
    /// Sealed statistics, decoded (or why not), with the SHA-256 of their
    /// bytes, by which a duplicate is compared with the merged copy.
    Stats {
        decoded: qforge_core::Result<Stats>,
        digest: Digest,
    },
}

/// Each results entry checked against `run_key` and, if sealed, its
/// statistics decoded against `shapes`, the pass's, which the first sealed
/// statistics that decode set when unknown. Nothing of an unsealed entry is
/// decoded, and nothing of a sealed one is allocated beyond the shapes the
/// pass produces.
pub(crate) fn receive_all(
    entries: &[StreamId],
    run_key: &RunKey,
    shapes: &mut Option<Shapes>,
) -> Vec<Received> {
    let mut received = Vec::with_capacity(entries.len());
    let mut rest = entries;
    while shapes.is_none()
        && let Some((entry, after)) = rest.split_first()
    {
        let first = receive_one(entry, run_key, None);
        if let Received::Stats {
            decoded: Ok(stats), ..
        } = &first
        {
            *shapes = Some(codec::shapes(stats));
        }
        received.push(first);
        rest = after;
    }
    received.extend(receive_in_parallel(rest, run_key, shapes.as_ref()));
    received
}

/// One entry checked against `run_key`, its statistics decoded against
/// `shapes` if known.
fn receive_one(entry: &StreamId, run_key: &RunKey, shapes: Option<&Shapes>) -> Received {
    if !run_key.verifies(&entry.map) {
        return Received::Unsealed;
    }
    match entry.map.get("stats") {
        Some(Value::BulkString(bytes)) => Received::Stats {
            decoded: match shapes {
                Some(shapes) => codec::decode_shaped(bytes, shapes),
                None => codec::decode(bytes),
            },
            digest: Digest::of(bytes),
        },
        _ => Received::Sealed,
    }
}

/// [`receive_one`] for each of `entries`, on every core the machine has, in
/// the entries' order: decoding is most of what the coordinator spends on a
/// result (5 of 7 ms for a SmolLM2 batch's 1 MB), while merging them stays
/// in order on one thread.
fn receive_in_parallel(
    entries: &[StreamId],
    run_key: &RunKey,
    shapes: Option<&Shapes>,
) -> Vec<Received> {
    let decode_one = |entry: &StreamId| receive_one(entry, run_key, shapes);
    let threads = std::thread::available_parallelism().map_or(1, usize::from);
    if threads < 2 || entries.len() < 2 {
        return entries.iter().map(decode_one).collect();
    }
    let per_thread = entries.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let parts: Vec<_> = entries
            .chunks(per_thread)
            .map(|part| scope.spawn(move || part.iter().map(decode_one).collect::<Vec<_>>()))
            .collect();
        parts
            .into_iter()
            .flat_map(|part| {
                part.join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect()
    })
}

/// An entry id dated further ahead of this machine's clock than any clock
/// skew explains was not appended by a worker (Redis numbers entries by its
/// clock). Ids only grow, so once one reaches
/// `18446744073709551615-18446744073709551615` no worker can append a
/// result again: the run fails now, saying why, rather than waiting for
/// results that cannot come.
pub(crate) fn refuse_future_id(stream: &str, id: &str) -> Result<()> {
    const FUTURE: u128 = 24 * 3600 * 1000;
    match entry_id(id) {
        Some((ms, _)) if u128::from(ms) <= now_ms() + FUTURE => Ok(()),
        _ => Err(Error::Cluster(format!(
            "the results stream {stream} holds entry {id}, which no worker wrote: it lies more \
             than a day ahead of this machine's clock, and once an id reaches \
             18446744073709551615-18446744073709551615 no worker can append a result. \
             Something that is not a worker writes to this run's keys: check who can write to \
             Redis, then start the calibration again under another --run"
        ))),
    }
}
