//! GPTQ's roundings through Redis, for `gptq.sequential` on a cluster (see
//! the module's "Roundings"): the coordinator publishes each rounding a pass
//! runs with, once, under the pipeline's run; workers fetch the ones they
//! lack and check each against the digest the pass names.
//!
//! On the wire a rounding is its row count (u64, little-endian), one f32
//! scale per row (little-endian), then the int8 values, row-major. The
//! digest the pass names covers all of it, so a value that a stale key, a
//! bit flip or a forger changed is refused, never computed with.

use std::collections::BTreeMap;

use qforge_calib::RoundedLayers;
use qforge_core::Digest;
use qforge_model::{Int8Values, Int8Weight};

use super::keys::RunKeys;
use super::link::Link;
use crate::error::{Error, Result};

/// Roundings expire this long after the last pass that named them (a
/// pipeline that stopped early leaves them behind).
const EXPIRY_S: u64 = 24 * 3600;

/// Makes Redis hold every rounding `rounded` names under the pipeline's
/// keys, publishing each it lacks from `held` (the coordinator's), and
/// gives them all another day before they expire.
pub(super) fn publish(
    link: &mut Link,
    pipeline: &RunKeys,
    rounded: &BTreeMap<String, Digest>,
    held: &RoundedLayers,
) -> Result<()> {
    for (name, rounding) in rounded {
        let key = pipeline.rounding(rounding);
        let present: bool = link.call(|c| redis::cmd("EXPIRE").arg(&key).arg(EXPIRY_S).query(c))?;
        if present {
            continue;
        }
        let int8 = held.get(name, rounding).ok_or_else(|| {
            Error::Cluster(format!(
                "the pass runs {name} with the rounding {rounding}, which this coordinator does not hold"
            ))
        })?;
        let bytes = encode(&int8);
        link.call(|c| {
            redis::cmd("SET")
                .arg(&key)
                .arg(&bytes[..])
                .arg("EX")
                .arg(EXPIRY_S)
                .query::<()>(c)
        })?;
    }
    Ok(())
}

/// Deletes the roundings `rounded` names (the pipeline's last pass is over).
pub(super) fn release(
    link: &mut Link,
    pipeline: &RunKeys,
    rounded: &BTreeMap<String, Digest>,
) -> Result<()> {
    // One key per command: on a Redis Cluster they share a slot, but a
    // command naming hundreds of 60 MB keys gains nothing over a loop.
    for rounding in rounded.values() {
        let key = pipeline.rounding(rounding);
        link.call(|c| redis::cmd("DEL").arg(&key).query::<i64>(c))?;
    }
    Ok(())
}

/// Fetches into `held` (a worker's) every rounding `rounded` names that it
/// lacks, each checked against its digest and moved to a mapped file as
/// the coordinator's are; drops the roundings `rounded` no longer names.
/// Returns how many it fetched.
pub(super) fn fetch(
    link: &mut Link,
    pipeline: &RunKeys,
    rounded: &BTreeMap<String, Digest>,
    held: &RoundedLayers,
) -> Result<usize> {
    held.retain(rounded);
    let missing = held.missing(rounded);
    for (name, rounding) in &missing {
        let key = pipeline.rounding(rounding);
        let bytes: Option<Vec<u8>> = link.call(|c| redis::cmd("GET").arg(&key).query(c))?;
        let bytes = bytes.ok_or_else(|| {
            Error::Cluster(format!(
                "Redis holds no rounding of {name} (key {key}): the coordinator publishes each before the pass that runs it, so it was deleted or expired; restart the run"
            ))
        })?;
        let int8 = decode(&bytes, rounding)
            .map_err(|why| Error::Cluster(format!("the rounding of {name} at {key} {why}")))?;
        held.insert(name.clone(), *rounding, int8.spill(&std::env::temp_dir())?);
    }
    Ok(missing.len())
}

/// A rounding's bytes on the wire.
fn encode(int8: &Int8Weight) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(8 + 4 * int8.scales.len() + int8.values.len());
    bytes.extend_from_slice(&(int8.scales.len() as u64).to_le_bytes());
    for scale in &int8.scales {
        bytes.extend_from_slice(&scale.to_le_bytes());
    }
    bytes.extend(int8.values.iter().map(|v| v.to_le_bytes()[0]));
    bytes
}

/// The rounding `bytes` hold, if they are one and hash to `expected`; the
/// error completes "the rounding of LAYER at KEY …".
fn decode(bytes: &[u8], expected: &Digest) -> std::result::Result<Int8Weight, String> {
    let (rows, rest) = bytes
        .split_first_chunk::<8>()
        .ok_or_else(|| format!("is {} bytes, too short to name its rows", bytes.len()))?;
    let rows = u64::from_le_bytes(*rows);
    let scale_bytes = usize::try_from(rows)
        .ok()
        .and_then(|r| r.checked_mul(4))
        .filter(|&n| rows > 0 && n <= rest.len())
        .ok_or_else(|| {
            format!(
                "names {rows} rows, which its {} bytes do not hold",
                bytes.len()
            )
        })?;
    let (scales, values) = rest.split_at(scale_bytes);
    if values.is_empty() || values.len() % rows as usize != 0 {
        return Err(format!(
            "holds {} int8 values, not a whole number of its {rows} rows",
            values.len()
        ));
    }
    let int8 = Int8Weight {
        values: Int8Values::Owned(values.iter().map(|&b| b as i8).collect()),
        scales: scales
            .chunks_exact(4)
            .map(|s| f32::from_le_bytes(s.try_into().expect("chunks of 4")))
            .collect(),
    };
    let found = int8.digest();
    if found != *expected {
        return Err(format!(
            "hashes to {found}, not to the {expected} the pass names"
        ));
    }
    Ok(int8)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rounding() -> Int8Weight {
        Int8Weight {
            values: Int8Values::Owned((0..12).map(|i| i as i8 * 10 - 60).collect()),
            scales: vec![0.5, 0.25, 0.125],
        }
    }

    #[test]
    fn a_rounding_crosses_the_wire_exactly_and_damage_is_refused() {
        let int8 = rounding();
        let digest = int8.digest();
        let bytes = encode(&int8);
        assert_eq!(bytes.len(), 8 + 3 * 4 + 12);
        let back = decode(&bytes, &digest).unwrap();
        assert_eq!(back.scales, int8.scales);
        assert_eq!(*back.values, *int8.values);

        // Another rounding's digest: a stale or forged key.
        let other = Digest::of(b"another rounding");
        let err = decode(&bytes, &other).unwrap_err();
        assert!(err.contains("not to the"), "{err}");
        // One value flipped.
        let mut flipped = bytes.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(decode(&flipped, &digest).unwrap_err().contains("hashes to"));
        // Cut anywhere: never a panic, always a reason.
        for len in [0, 7, 8, 19, 20, 23] {
            let err = decode(&bytes[..len], &digest).unwrap_err();
            assert!(!err.is_empty(), "{len}");
        }
        // A row count beyond the bytes, or absurd.
        for rows in [0u64, 7, u64::MAX] {
            let mut forged = bytes.clone();
            forged[..8].copy_from_slice(&rows.to_le_bytes());
            assert!(
                decode(&forged, &digest).unwrap_err().contains("rows"),
                "{rows}"
            );
        }
    }
}
