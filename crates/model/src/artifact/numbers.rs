//! The one check of an artifact's numbers, run by every command that reads
//! an artifact: loading (`serve`, `/admin/reload`, `act`, `eval`,
//! `generate`, `requantize`, the Python package), `verify` and `export`.
//!
//! The manifest proves the files are as written, but whoever edits a scale
//! can rewrite the manifest too, and `export` and `verify` read numbers the
//! loader never ran. So the numbers themselves are checked, once, here:
//!
//! * every scale (`NAME.weight_scale` in `model.safetensors`, every
//!   `input_scale` in `qforge.json`) is a positive, finite, *normal* f32
//!   whose top level (scale × the int8 range) is finite. A subnormal scale
//!   (1e-40) has an infinite reciprocal, so quantizing by it made every
//!   activation saturate and every answer action 0; 3e38 × 127 overflows;
//! * a static `input_scale` lies within what `calibration.json` records for
//!   its point ([`static_scale_bounds`]): 1e-30 is a normal number, but as
//!   a static scale it saturates every activation above 1.3e-28, which no
//!   calibrator chooses;
//! * every other float tensor (biases, norms, full-precision weights) is
//!   finite.

use std::path::Path;

use safetensors::{Dtype, SafeTensors};

use super::{ARTIFACT_FILE, ArtifactConfig, LayerPrecision, WEIGHTS_FILE, read_config};
use crate::error::{Error, Result};
use crate::linear::{scale_rule, usable_scale};
use qforge_formats::profile::{CalibrationProfile, PROFILE_FILE, PointProfile};

/// What to do about an artifact whose numbers are refused.
const REWRITE: &str = "the artifact was edited or corrupted; write it again with `qforge quantize`";

/// Levels of a symmetric int8 activation quantizer: a static scale is its
/// clipping threshold / 127 (`QuantParams::symmetric`).
const ACTIVATION_QMAX: f32 = 127.0;

/// Checks every number of the artifact in `dir` (see the module doc); an
/// error names the file, the tensor or point, the value, and what to do.
pub fn check_numbers(dir: &Path) -> Result<()> {
    let config = read_config(dir)?;
    check_static_ranges(dir, &config)?;
    check_tensors(dir, f32::from(config.weight_qmax))
}

/// Checks the activation scale `input_scale` of `point`, read from `path`
/// (`qforge.json`), on its own: [`usable_scale`].
pub(super) fn check_input_scale(path: &Path, point: &str, input_scale: f32) -> Result<()> {
    if usable_scale(input_scale, ACTIVATION_QMAX) {
        return Ok(());
    }
    Err(Error::Format(format!(
        "{}: {point} has input_scale {input_scale:?}; {}; {REWRITE}",
        path.display(),
        scale_rule(ACTIVATION_QMAX)
    )))
}

/// The static activation scales a calibrator can give a point whose
/// calibration `calibration.json` records as `recorded`, as `[low, high]`;
/// 1 is possible besides (a zero clipping threshold, `RangeWarning::ZeroRange`).
///
/// A static scale is `symmetric(T).scale`: T / 127, computed in f64 and
/// rounded to f32, raised to `f32::MIN_POSITIVE` when smaller, where the
/// calibrator's threshold T is at most the recorded abs-max. The rounding is
/// monotonic and the abs-max round-trips through JSON exactly, so `high`
/// needs no tolerance. T is at least the smallest of: a bin edge at or
/// above the lowest recorded octave (percentile, and MSE's bin edges),
/// abs-max / 1024 (MSE's grid; entropy stops at abs-max / 16), and, for
/// sigma clipping, |mean| + k·sd ≥ k · abs-max / √n ≥ abs-max / n for any
/// k ≥ 1 / √n. `low` halves that least threshold, so that no rounding
/// decides.
fn static_scale_bounds(recorded: &PointProfile) -> (f32, f32) {
    let abs_max = f64::from(recorded.abs_max);
    let high = ((abs_max / 127.0) as f32).max(f32::MIN_POSITIVE);
    // Octave class c holds 2^(c − 127) ≤ |x|; class 0 holds subnormals.
    let lowest_edge = match recorded.octave_shares.keys().next() {
        Some(0) => 0.0,
        Some(&class) => 2f64.powi(class as i32 - 127),
        None => abs_max,
    };
    let least = lowest_edge
        .min(abs_max / 1024.0)
        .min(abs_max / recorded.values.max(1) as f64);
    let low = (least / 2.0 / 127.0) as f32;
    (low, high)
}

/// Checks each static `input_scale` of `config` against the range
/// `calibration.json` records for its point. An artifact without a profile
/// (written before profiles) is checked by [`check_input_scale`] alone.
fn check_static_ranges(dir: &Path, config: &ArtifactConfig) -> Result<()> {
    let Some(profile) = CalibrationProfile::read(dir)? else {
        return Ok(());
    };
    let path = dir.join(ARTIFACT_FILE);
    for (point, precision) in &config.points {
        let LayerPrecision::Int8Static { input_scale } = *precision else {
            continue;
        };
        let Some(recorded) = profile.points.get(point) else {
            return Err(Error::Format(format!(
                "{}: {point} has input_scale {input_scale:?}, but {PROFILE_FILE} records no \
                 calibrated range for {point}; {REWRITE}",
                path.display()
            )));
        };
        let (low, high) = static_scale_bounds(recorded);
        if input_scale != 1.0 && !(low..=high).contains(&input_scale) {
            return Err(Error::Format(format!(
                "{}: {point} has input_scale {input_scale:?}, outside [{low:?}, {high:?}], the \
                 scales a calibrator gives the range {PROFILE_FILE} records (abs_max {}); {REWRITE}",
                path.display(),
                recorded.abs_max
            )));
        }
    }
    Ok(())
}

/// Checks every tensor of `model.safetensors`: weight scales are usable
/// with int8 weights up to `weight_qmax`, float tensors are finite.
fn check_tensors(dir: &Path, weight_qmax: f32) -> Result<()> {
    let path = dir.join(WEIGHTS_FILE);
    let file = qforge_formats::files::open_regular(&path)?;
    // SAFETY: a read-only map of a file qforge does not modify (artifacts
    // are written once, then renamed into place).
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
    let tensors = SafeTensors::deserialize(&map)
        .map_err(|e| Error::Format(format!("{}: {e}", path.display())))?;
    for (name, view) in tensors.iter() {
        let data = view.data();
        let f32s = || {
            data.chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        };
        if name.ends_with(".weight_scale") {
            if view.dtype() != Dtype::F32 {
                return Err(Error::Format(format!(
                    "{}: {name} is {:?}; weight scales are stored in F32; {REWRITE}",
                    path.display(),
                    view.dtype()
                )));
            }
            let bad = f32s()
                .enumerate()
                .find(|(_, s)| !usable_scale(*s, weight_qmax));
            if let Some((index, scale)) = bad {
                return Err(Error::Format(format!(
                    "{}: {name} holds {scale:?} at index {index}; {}; {REWRITE}",
                    path.display(),
                    scale_rule(weight_qmax)
                )));
            }
            continue;
        }
        let values: Box<dyn Iterator<Item = f32>> = match view.dtype() {
            Dtype::F32 => Box::new(f32s()),
            Dtype::BF16 => Box::new(crate::linear::bf16_values(data)),
            // An int8 value is always a number; other dtypes the loader refuses.
            _ => continue,
        };
        if let Some((index, value)) = values.enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(Error::Format(format!(
                "{}: {name} holds {value:?} at index {index}; biases, norms and full-precision \
                 weights must be finite; {REWRITE}",
                path.display()
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn recorded(abs_max: f32, values: u64, octaves: &[usize]) -> PointProfile {
        PointProfile {
            abs_max,
            values,
            zero_share: 0.0,
            octave_shares: octaves
                .iter()
                .map(|&c| (c, 1.0 / octaves.len() as f64))
                .collect(),
        }
    }

    #[test]
    fn scales_are_normal_with_a_finite_top_level() {
        for good in [f32::MIN_POSITIVE, 1e-30, 0.015625, 1.0, f32::MAX / 128.0] {
            assert!(usable_scale(good, 127.0), "{good}");
        }
        for bad in [0.0, -0.5, 1e-40, 3e38, f32::NAN, f32::INFINITY] {
            assert!(!usable_scale(bad, 127.0), "{bad}");
        }
        assert!((1.0 / f32::MIN_POSITIVE).is_finite());
    }

    #[test]
    fn every_calibrator_scale_of_a_range_is_within_its_bounds() {
        use qforge_core::{Calibrator, Histogram};
        let values: Vec<f32> = (0..4000)
            .map(|i| ((i * 7919) % 4001) as f32 / 1000.0 - 2.0)
            .chain([-40.0, 1e-6])
            .collect();
        let mut histogram = Histogram::new();
        histogram.observe(&values);
        let mut stats = qforge_core::TensorStats::new();
        stats.observe(&values).unwrap();
        let profile = CalibrationProfile::from_stats(&BTreeMap::from([("x".to_owned(), stats)]));
        let (low, high) = static_scale_bounds(&profile.points["x"]);
        let calibrators = Calibrator::defaults().into_iter().chain([
            Calibrator::Percentile { percentile: 1.0 },
            Calibrator::Sigma { k: 0.05 },
        ]);
        for calibrator in calibrators {
            let scale = calibrator.static_scale(&histogram).unwrap();
            assert!((low..=high).contains(&scale), "{calibrator}: {scale}");
        }
        assert!(!(low..=high).contains(&1e-30) && !(low..=high).contains(&1.0));
    }

    #[test]
    fn the_bounds_follow_the_recorded_range() {
        let (low, high) = static_scale_bounds(&recorded(2.0, 1000, &[120, 127]));
        assert_eq!(high, (2.0f64 / 127.0) as f32);
        assert!(low > 1e-8 && low < 2.0 / 1000.0 / 127.0, "{low}");
        // Subnormal activations were seen: anything up to the top is possible.
        let (low, _) = static_scale_bounds(&recorded(2.0, 1000, &[0, 127]));
        assert_eq!(low, 0.0);
        // All zero: 1 (the zero-range scale) aside, only the smallest.
        let (_, high) = static_scale_bounds(&recorded(0.0, 10, &[]));
        assert_eq!(high, f32::MIN_POSITIVE);
    }
}
