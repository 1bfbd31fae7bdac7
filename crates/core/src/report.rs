//! A statistics file as people and programs read it: `qforge stats show`
//! (its `Display`) and `--json` (its `Serialize`), with the threshold each
//! calibrator chooses.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::{self, Write};

use serde::Serialize;

use crate::{Calibrator, Digest, Provenance, QuantParams, Stats};

/// `stats` seen through `calibrators`.
#[derive(Serialize)]
pub struct StatsReport<'a> {
    provenance: &'a Provenance,
    /// Share of the planned batches merged.
    coverage: f64,
    tensors: BTreeMap<&'a str, TensorReport>,
}

/// One tensor's counts and each calibrator's choice. Floats are f32, so
/// JSON shows their shortest round-tripping digits (`3.3002303`); a
/// threshold no calibrator could choose (no finite values) is `null`.
#[derive(Serialize)]
struct TensorReport {
    count: u64,
    zero: u64,
    min: Option<f32>,
    max: Option<f32>,
    nan: u64,
    pos_inf: u64,
    neg_inf: u64,
    thresholds: BTreeMap<&'static str, Option<f32>>,
    ranges: BTreeMap<&'static str, [f32; 2]>,
    calibrators: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    channel_abs_max: Option<Vec<f32>>,
    /// Each calibrator as given and its threshold, in the given order.
    #[serde(skip)]
    shown: Vec<(String, Option<f32>)>,
}

impl<'a> StatsReport<'a> {
    /// The report of `stats` under `calibrators`.
    pub fn new(stats: &'a Stats, calibrators: &[Calibrator]) -> Self {
        let tensors = stats
            .tensors
            .iter()
            .map(|(name, tensor)| {
                let h = tensor.histogram();
                let report = TensorReport {
                    count: h.count(),
                    zero: h.zero(),
                    min: h.min(),
                    max: h.max(),
                    nan: h.nan(),
                    pos_inf: h.pos_inf(),
                    neg_inf: h.neg_inf(),
                    thresholds: calibrators
                        .iter()
                        .map(|c| (c.name(), c.threshold(h)))
                        .collect(),
                    ranges: calibrators
                        .iter()
                        .filter_map(|c| c.range(h).map(|(lo, hi)| (c.name(), [lo, hi])))
                        .collect(),
                    calibrators: calibrators.iter().map(Calibrator::to_string).collect(),
                    channel_abs_max: tensor.channel_abs_max(),
                    shown: calibrators
                        .iter()
                        .map(|c| (c.to_string(), c.threshold(h)))
                        .collect(),
                };
                (name.as_str(), report)
            })
            .collect();
        Self {
            provenance: &stats.provenance,
            coverage: stats.provenance.coverage(),
            tensors,
        }
    }
}

impl Stats {
    /// A warning per tensor whose values would quantize badly (a range
    /// `QuantParams` warns about) or that saw no finite value.
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        for (name, tensor) in &self.tensors {
            let h = tensor.histogram();
            if let Some(t) = Calibrator::MinMax.threshold(h)
                && let Some(warning) = QuantParams::symmetric(t).warning
            {
                warnings.push(format!("tensor {name}: {warning}"));
            } else if h.count() == 0 {
                warnings.push(format!(
                    "tensor {name}: no finite values; thresholds are null"
                ));
            }
        }
        warnings
    }

    /// One line on what these statistics hold: tensors, finite values,
    /// batches, and whether a merge was forced.
    pub fn describe(&self) -> String {
        let values: u64 = self.tensors.values().map(|t| t.histogram().count()).sum();
        let forced = if self.provenance.forced {
            " (forced merge)"
        } else {
            ""
        };
        format!(
            "{} tensor(s), {values} finite value(s), {} batch(es){forced}",
            self.tensors.len(),
            self.provenance.batches.len(),
        )
    }
}

/// The first 16 hex digits of each hash, or `-`.
fn short_hashes(set: &BTreeSet<Digest>) -> String {
    if set.is_empty() {
        return "-".into();
    }
    let short: Vec<String> = set.iter().map(|d| d.to_hex()[..16].to_owned()).collect();
    short.join(", ")
}

impl fmt::Display for StatsReport<'_> {
    fn fmt(&self, out: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Written line by line, shown without the last line's newline (as
        // every report's `Display`: the printer ends the line).
        let mut text = String::new();
        let f = &mut text;
        let p = self.provenance;
        writeln!(f, "model:   {}", short_hashes(&p.models))?;
        writeln!(f, "data:    {}", short_hashes(&p.data))?;
        writeln!(f, "recipe:  {}", short_hashes(&p.recipes))?;
        let passes: Vec<&str> = p.passes.iter().map(String::as_str).collect();
        writeln!(f, "pass:    {}", passes.join(", "))?;
        let forced = if p.forced { " (forced merge)" } else { "" };
        writeln!(
            f,
            "batches: {} of {} planned ({:.1} % coverage){forced}",
            p.batches.len(),
            p.planned,
            100.0 * self.coverage,
        )?;
        if p.mixed_hardware {
            writeln!(
                f,
                "note:    observed on workers with different determinism fingerprints; \
                 exact only up to forward-pass rounding"
            )?;
        }
        let value = |v: Option<f32>| v.map_or("-".to_owned(), |v| format!("{v:.6e}"));
        writeln!(f)?;
        for (name, t) in &self.tensors {
            writeln!(f, "{name}")?;
            writeln!(
                f,
                "  count {}  zero {}  min {}  max {}  nan {}  +inf {}  -inf {}",
                t.count,
                t.zero,
                value(t.min),
                value(t.max),
                t.nan,
                t.pos_inf,
                t.neg_inf
            )?;
            for (calibrator, threshold) in &t.shown {
                writeln!(f, "  {calibrator:<18} {}", value(*threshold))?;
            }
            if let Some(channels) = &t.channel_abs_max {
                writeln!(f, "  {} channels with abs-max", channels.len())?;
            }
        }
        out.write_str(text.trim_end_matches('\n'))
    }
}
