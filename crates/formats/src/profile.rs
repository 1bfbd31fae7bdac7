//! The calibration profile an artifact carries (`calibration.json`): for
//! every observation point, the largest magnitude calibration saw and the
//! share of values in each binary octave of |x|. A server compares what it
//! sees in production against it to detect drift; the full statistics stay
//! in the `.qstats` file and the report.

use std::collections::BTreeMap;
use std::path::Path;

use qforge_core::TensorStats;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The profile's file in an artifact.
pub const PROFILE_FILE: &str = "calibration.json";

/// Number of octave classes: one per f32 exponent value.
pub const OCTAVES: usize = 256;

/// The octave class of a non-zero finite magnitude: its f32 exponent field
/// (0 for subnormals), so `2^(class − 127) ≤ |x| < 2^(class − 126)` for
/// normal numbers.
pub fn octave(x: f32) -> usize {
    ((x.to_bits() >> 23) & 0xff) as usize
}

/// What calibration saw at one observation point.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PointProfile {
    /// Largest finite |x|: the calibrated range.
    pub abs_max: f32,
    /// Finite values calibration observed (rows × width): how well the
    /// range is pinned down — a fresh row from the same distribution lands
    /// beyond the largest of n rows with probability 1 / (n + 1).
    pub values: u64,
    /// Share of finite values that are exactly zero.
    pub zero_share: f64,
    /// Share of finite values per non-empty octave class ([`octave`]).
    pub octave_shares: BTreeMap<usize, f64>,
}

/// What calibration saw at every observation point.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CalibrationProfile {
    /// By observation point.
    pub points: BTreeMap<String, PointProfile>,
}

impl CalibrationProfile {
    /// The profile of merged calibration statistics; points without a finite
    /// value are left out.
    pub fn from_stats(tensors: &BTreeMap<String, TensorStats>) -> Self {
        let points = tensors
            .iter()
            .filter_map(|(point, stats)| {
                let histogram = stats.histogram();
                let abs_max = histogram.abs_max()?;
                let mut octaves: BTreeMap<usize, u64> = BTreeMap::new();
                for bin in histogram.magnitude_bins() {
                    // A bin never straddles an octave: its lower edge carries
                    // the exponent of every value in it.
                    *octaves.entry(octave(bin.lower as f32)).or_default() += bin.count;
                }
                let finite = histogram.zero() + octaves.values().sum::<u64>();
                let share = |count: u64| count as f64 / finite.max(1) as f64;
                Some((
                    point.clone(),
                    PointProfile {
                        abs_max,
                        values: finite,
                        zero_share: share(histogram.zero()),
                        octave_shares: octaves.into_iter().map(|(k, c)| (k, share(c))).collect(),
                    },
                ))
            })
            .collect();
        Self { points }
    }

    /// Writes `calibration.json` into `dir`.
    pub fn write(&self, dir: &Path) -> Result<()> {
        let path = dir.join(PROFILE_FILE);
        let text = serde_json::to_string_pretty(self).expect("plain data serializes");
        std::fs::write(&path, text + "\n").map_err(|e| Error::io(&path, e))
    }

    /// Reads `calibration.json` from `dir`; `None` when there is none (a
    /// plain model directory, or an artifact from before profiles).
    pub fn read(dir: &Path) -> Result<Option<Self>> {
        let path = dir.join(PROFILE_FILE);
        if !path.exists() {
            return Ok(None);
        }
        let profile: Self = crate::files::read_json(&path)?;
        // The drift monitor divides by these: out of range, it would alert
        // on everything or on nothing.
        let share = |s: f64| (0.0..=1.0).contains(&s);
        let bad = profile.points.iter().find(|(_, p)| {
            let in_range = p.abs_max.is_finite()
                && p.abs_max >= 0.0
                && share(p.zero_share)
                && p.octave_shares
                    .iter()
                    .all(|(&class, &s)| class < OCTAVES && share(s));
            !in_range
        });
        if let Some((point, _)) = bad {
            return Err(Error::Format(format!(
                "{}: {point} has an abs_max that is not a finite number ≥ 0, or a share outside \
                 [0, 1] or an octave class ≥ {OCTAVES}",
                path.display()
            )));
        }
        Ok(Some(profile))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn octave_classes_split_at_powers_of_two() {
        assert_eq!(octave(1.0), 127);
        assert_eq!(octave(1.999), 127);
        assert_eq!(octave(2.0), 128);
        assert_eq!(octave(0.5), 126);
        assert_eq!(octave(1e-40), 0);
    }

    #[test]
    fn a_profile_counts_shares_per_octave_and_round_trips() {
        let mut stats = TensorStats::new();
        stats.observe(&[0.0, 1.0, -1.5, 3.0, -0.25]).unwrap();
        let profile = CalibrationProfile::from_stats(&BTreeMap::from([("x".to_owned(), stats)]));
        let p = &profile.points["x"];
        assert_eq!(p.abs_max, 3.0);
        assert_eq!(p.values, 5);
        assert_eq!(p.zero_share, 0.2);
        assert_eq!(
            p.octave_shares,
            BTreeMap::from([(125, 0.2), (127, 0.4), (128, 0.2)])
        );
        let dir = std::env::temp_dir().join(format!("qforge-profile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        profile.write(&dir).unwrap();
        assert_eq!(
            CalibrationProfile::read(&dir).unwrap(),
            Some(profile.clone())
        );
        std::fs::write(dir.join(PROFILE_FILE), "{\"points\": 3}").unwrap();
        let e = CalibrationProfile::read(&dir).unwrap_err().to_string();
        assert!(e.contains(PROFILE_FILE), "{e}");
        // Well-formed but out of range: the drift monitor would divide by it.
        let mut bad = profile.clone();
        bad.points.get_mut("x").unwrap().zero_share = 2.0;
        bad.write(&dir).unwrap();
        let e = CalibrationProfile::read(&dir).unwrap_err().to_string();
        assert!(e.contains("x has an abs_max"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
