//! Per-tensor statistics, batch identities, provenance, and the merged statistics
//! of a calibration pass.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::Serialize;
use sha2::{Digest as _, Sha256};

use crate::error::{Error, Result};
use crate::gram::Gram;
use crate::histogram::Histogram;

/// Statistics of one tensor: the value histogram (with exact min/max and
/// special-value counts) and, optionally, the abs-max of each channel (the last
/// axis), which smoothing needs, and the Gram matrix `Σ x xᵀ` of its rows,
/// which GPTQ needs. Every field merges exactly.
///
/// A Gram matrix is undefined once its rows held a value it cannot sum (NaN,
/// ±∞, or a magnitude beyond its fixed-point range): it is dropped, and a
/// merge with dropped statistics drops it too, so the result is the same in
/// any merge order. The histogram keeps counting such values, so the pass
/// goes on and the cause can be told from it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TensorStats {
    histogram: Histogram,
    /// Bit patterns of per-channel abs-max over finite values. Non-negative
    /// floats order like their bit patterns, so an integer max is exact.
    channel_abs_max: Option<Vec<u32>>,
    gram: Option<Gram>,
}

impl TensorStats {
    /// Empty statistics without per-channel tracking.
    pub fn new() -> Self {
        Self::default()
    }

    /// Empty statistics that also track the abs-max of `channels` channels.
    pub fn with_channels(channels: usize) -> Self {
        Self {
            channel_abs_max: Some(vec![0; channels]),
            ..Self::default()
        }
    }

    /// Empty statistics that also sum the Gram matrix of rows of `gram`'s
    /// width (at its exponent).
    pub fn with_gram(gram: Gram) -> Self {
        Self {
            gram: Some(gram),
            ..Self::default()
        }
    }

    /// Records `values`. With per-channel tracking or a Gram matrix, `values`
    /// is a row-major `[rows, channels]` block and its length must be a
    /// multiple of the channel count. Values the Gram matrix cannot sum
    /// (non-finite, beyond its range) drop it; the rest is recorded.
    pub fn observe(&mut self, values: &[f32]) -> Result<()> {
        if let Some(gram) = &mut self.gram {
            match gram.observe(values) {
                Ok(()) => {}
                Err(Error::NonFinite(_) | Error::Overflow(_)) => self.gram = None,
                Err(e) => return Err(e),
            }
        }
        if let Some(channels) = &mut self.channel_abs_max {
            let width = channels.len();
            if width == 0 || !values.len().is_multiple_of(width) {
                return Err(Error::Shape(format!(
                    "{} values do not form rows of {width} channels",
                    values.len()
                )));
            }
            for row in values.chunks_exact(width) {
                for (slot, value) in channels.iter_mut().zip(row) {
                    let magnitude = value.to_bits() & 0x7FFF_FFFF;
                    // NaN and ±∞ patterns are ≥ 0x7F80_0000: not finite, skipped.
                    if magnitude < 0x7F80_0000 {
                        *slot = (*slot).max(magnitude);
                    }
                }
            }
        }
        self.histogram.observe(values);
        Ok(())
    }

    /// Merges `other` into `self`. Both must track the same number of channels
    /// (or neither).
    pub fn merge(&mut self, other: &TensorStats) -> Result<()> {
        self.check_merge(other)?;
        self.add_checked(other)
    }

    /// [`TensorStats::merge`] once [`TensorStats::check_merge`] has
    /// accepted `other`: the Gram matrices are not scanned again.
    fn add_checked(&mut self, other: &TensorStats) -> Result<()> {
        self.histogram.merge(&other.histogram)?;
        if let (Some(a), Some(b)) = (&mut self.channel_abs_max, &other.channel_abs_max) {
            for (x, y) in a.iter_mut().zip(b) {
                *x = (*x).max(*y);
            }
        }
        match (&mut self.gram, &other.gram) {
            (Some(a), Some(b)) => a.add_checked(b),
            // A dropped (undefined) Gram matrix stays dropped.
            (Some(_), None) => self.gram = None,
            _ => {}
        }
        Ok(())
    }

    /// Fails if `other` cannot be merged into `self`: different channel
    /// tracking or Gram matrices, or counts or sums that would overflow.
    /// Statistics without a Gram matrix merge with statistics with one: the
    /// matrix was dropped from one side, and the merge has none.
    pub fn check_merge(&self, other: &TensorStats) -> Result<()> {
        if let (Some(a), Some(b)) = (&self.gram, &other.gram) {
            a.check_merge(b)?;
        }
        let (a, b) = (&self.channel_abs_max, &other.channel_abs_max);
        if a.as_ref().map(Vec::len) != b.as_ref().map(Vec::len) {
            return Err(Error::Shape(format!(
                "cannot merge per-channel stats of {} channels with {} channels",
                a.as_ref().map_or(0, Vec::len),
                b.as_ref().map_or(0, Vec::len)
            )));
        }
        self.histogram.check_merge(&other.histogram)
    }

    /// The value histogram.
    pub fn histogram(&self) -> &Histogram {
        &self.histogram
    }

    /// Per-channel abs-max over finite values, if tracked.
    pub fn channel_abs_max(&self) -> Option<Vec<f32>> {
        self.channel_abs_max
            .as_ref()
            .map(|c| c.iter().map(|&b| f32::from_bits(b)).collect())
    }

    pub(crate) fn channel_abs_max_bits(&self) -> Option<&[u32]> {
        self.channel_abs_max.as_deref()
    }

    /// The Gram matrix of the rows, if summed.
    pub fn gram(&self) -> Option<&Gram> {
        self.gram.as_ref()
    }

    /// Moves the Gram matrix out, leaving the other statistics.
    pub fn take_gram(&mut self) -> Option<Gram> {
        self.gram.take()
    }

    pub(crate) fn from_parts(
        histogram: Histogram,
        channels: Option<Vec<u32>>,
        gram: Option<Gram>,
    ) -> Result<Self> {
        if let Some(c) = &channels
            && let Some(bad) = c.iter().find(|&&b| b >= 0x7F80_0000)
        {
            return Err(Error::Corrupt(format!(
                "channel abs-max pattern {bad:#010x} is not a finite magnitude"
            )));
        }
        Ok(Self {
            histogram,
            channel_abs_max: channels,
            gram,
        })
    }
}

/// A SHA-256 digest.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Digest(pub [u8; 32]);

impl Digest {
    /// SHA-256 of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        Self(Sha256::digest(bytes).into())
    }

    /// Lower-case hex.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses 64 hex digits.
    pub fn from_hex(hex: &str) -> Result<Self> {
        let bad = || Error::Parse(format!("{hex:?} is not a 64-digit hex SHA-256"));
        if hex.len() != 64 || !hex.is_ascii() {
            return Err(bad());
        }
        let mut out = [0u8; 32];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(Self(out))
    }
}

/// Incremental SHA-256, for hashing data too large to hold at once.
#[derive(Default, Clone)]
pub struct DigestBuilder(Sha256);

impl DigestBuilder {
    /// Feeds bytes.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    /// The digest of everything fed.
    pub fn finish(self) -> Digest {
        Digest(self.0.finalize().into())
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.to_hex())
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.to_hex())
    }
}

impl Serialize for Digest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> serde::Deserialize<'de> for Digest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let hex = String::deserialize(d)?;
        Digest::from_hex(&hex).map_err(serde::de::Error::custom)
    }
}

/// Stable identity of a calibration batch: its index in the plan and a hash of
/// its content. Two batches are the same batch iff both agree, so a retried or
/// speculatively re-run batch is recognised and a reordered data set is not.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct BatchId {
    /// Position of the batch in the plan.
    pub index: u64,
    /// SHA-256 of the batch's content.
    pub content: Digest,
}

impl fmt::Display for BatchId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.index, &self.content.to_hex()[..16])
    }
}

impl Serialize for BatchId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{}:{}", self.index, self.content.to_hex()))
    }
}

/// Where statistics came from. Every field is a set so that a forced merge of
/// statistics from different sources stays exact and order-free (the union);
/// statistics from one source have exactly one model, data, recipe and pass.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Provenance {
    /// Hashes of the model(s); empty when no model was involved (raw values).
    pub models: BTreeSet<Digest>,
    /// Hashes of the calibration data.
    pub data: BTreeSet<Digest>,
    /// Hashes of the calibration recipe(s).
    pub recipes: BTreeSet<Digest>,
    /// Names of the passes (e.g. `activation`, `smoothing`, `observe`).
    pub passes: BTreeSet<String>,
    /// Every batch merged into these statistics.
    pub batches: BTreeSet<BatchId>,
    /// Batches the calibration planned: coverage is `batches / planned`.
    pub planned: u64,
    /// True once statistics of different provenance or overlapping batches were
    /// merged with `force`: they are no longer the result of one calibration.
    pub forced: bool,
    /// True when some batches were observed by workers whose determinism
    /// fingerprints differed (a run that allowed mixed hardware): the merge is
    /// still exact, but the statistics equal a single-machine run only up to
    /// forward-pass rounding.
    pub mixed_hardware: bool,
}

impl Provenance {
    /// Provenance of a single batch of a single source.
    pub fn single(
        model: Option<Digest>,
        data: Digest,
        recipe: Digest,
        pass: &str,
        batch: BatchId,
        planned: u64,
    ) -> Self {
        Self {
            models: model.into_iter().collect(),
            data: BTreeSet::from([data]),
            recipes: BTreeSet::from([recipe]),
            passes: BTreeSet::from([pass.to_owned()]),
            batches: BTreeSet::from([batch]),
            planned,
            forced: false,
            mixed_hardware: false,
        }
    }

    /// Fraction of the planned batches these statistics hold (1 when the plan
    /// is unknown, i.e. `planned` is 0).
    pub fn coverage(&self) -> f64 {
        if self.planned == 0 {
            1.0
        } else {
            self.batches.len() as f64 / self.planned as f64
        }
    }

    /// True for the provenance of no statistics at all, the identity of merge.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// Why `self` and `other` cannot be merged without force, if they cannot.
    pub fn conflict(&self, other: &Provenance) -> Option<String> {
        if self.is_empty() || other.is_empty() {
            return None;
        }
        let mut reasons = Vec::new();
        let differs = |name: &str, a: String, b: String, reasons: &mut Vec<String>| {
            if a != b {
                reasons.push(format!("{name} {a} vs {b}"));
            }
        };
        let list = |set: &BTreeSet<Digest>| {
            set.iter()
                .map(|d| d.to_hex()[..12].to_owned())
                .collect::<Vec<_>>()
                .join(",")
        };
        differs(
            "model",
            list(&self.models),
            list(&other.models),
            &mut reasons,
        );
        differs("data", list(&self.data), list(&other.data), &mut reasons);
        differs(
            "recipe",
            list(&self.recipes),
            list(&other.recipes),
            &mut reasons,
        );
        let passes = |s: &BTreeSet<String>| s.iter().cloned().collect::<Vec<_>>().join(",");
        differs(
            "pass",
            passes(&self.passes),
            passes(&other.passes),
            &mut reasons,
        );
        differs(
            "planned batch count",
            self.planned.to_string(),
            other.planned.to_string(),
            &mut reasons,
        );
        let overlap: Vec<_> = self.batches.intersection(&other.batches).collect();
        if !overlap.is_empty() {
            reasons.push(format!(
                "{} batch id(s) present in both, first {}",
                overlap.len(),
                overlap[0]
            ));
        }
        (!reasons.is_empty()).then(|| reasons.join("; "))
    }

    fn absorb(&mut self, other: &Provenance, forced: bool) {
        self.models.extend(other.models.iter().copied());
        self.data.extend(other.data.iter().copied());
        self.recipes.extend(other.recipes.iter().copied());
        self.passes.extend(other.passes.iter().cloned());
        self.batches.extend(other.batches.iter().copied());
        self.planned = self.planned.max(other.planned);
        self.forced |= other.forced || forced;
        self.mixed_hardware |= other.mixed_hardware;
    }
}

/// Whether a merge may override provenance conflicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MergePolicy {
    /// Refuse different provenance and overlapping batch ids.
    Strict,
    /// Merge anyway and mark the result as forced.
    Force,
}

/// Statistics of a calibration pass (or a part of it): provenance and the
/// statistics of every observed tensor, by name.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Stats {
    /// Where the statistics came from.
    pub provenance: Provenance,
    /// Statistics per tensor name, in name order.
    pub tensors: BTreeMap<String, TensorStats>,
}

impl Stats {
    /// Merges `other` into `self`. Under [`MergePolicy::Strict`] a provenance
    /// conflict or an overlapping batch id is an error and `self` is unchanged.
    pub fn merge(&mut self, other: &Stats, policy: MergePolicy) -> Result<()> {
        let conflict = self.provenance.conflict(&other.provenance);
        if let (Some(reason), MergePolicy::Strict) = (&conflict, policy) {
            return Err(Error::ProvenanceMismatch(reason.clone()));
        }
        // Check everything before touching anything, so a failed merge leaves
        // `self` as it was.
        for (name, theirs) in &other.tensors {
            if let Some(ours) = self.tensors.get(name) {
                ours.check_merge(theirs)
                    .map_err(|e| Error::Shape(format!("tensor {name}: {e}")))?;
            }
        }
        for (name, theirs) in &other.tensors {
            match self.tensors.get_mut(name) {
                Some(ours) => ours.add_checked(theirs)?,
                None => {
                    self.tensors.insert(name.clone(), theirs.clone());
                }
            }
        }
        self.provenance
            .absorb(&other.provenance, conflict.is_some());
        Ok(())
    }
}
