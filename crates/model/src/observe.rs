//! Observation of linear-layer inputs, the hook calibration uses.
//!
//! A forward pass hands every distinct linear input to an [`Observer`] under
//! the Hugging Face module name of the first linear that reads it
//! (`model.layers.3.self_attn.q_proj` stands for the input q, k and v share;
//! `model.layers.3.mlp.gate_proj` for the input gate and up share), as rows of
//! `width` values. Padding positions are never handed over.

use std::collections::BTreeMap;
use std::collections::btree_map::Entry;

use qforge_core::{Gram, TensorStats};

use crate::error::Result;

/// Receives linear-layer inputs during a forward pass.
pub trait Observer {
    /// `rows` holds whole rows of `width` values of the input named `point`.
    fn observe(&mut self, point: &str, rows: &[f32], width: usize) -> Result<()>;

    /// Whether the observer has what it wants, so that an observing pass
    /// ([`crate::Llama::observe`]) may stop before the remaining layers.
    fn finished(&self) -> bool {
        false
    }
}

/// What a [`StatsObserver`] records.
#[derive(Debug, Clone, PartialEq)]
pub enum Statistics {
    /// Every point's histogram; with `per_channel`, also each input
    /// channel's abs-max (smoothing needs it).
    Histograms {
        /// Track per-channel abs-max.
        per_channel: bool,
    },
    /// The histogram and Gram matrix `Σ x xᵀ` of the listed points only,
    /// each at its fixed-point exponent ([`qforge_core::Gram`]); other points
    /// are skipped, and the observer is finished once each listed point was
    /// seen.
    Grams(BTreeMap<String, i32>),
}

/// An observer that accumulates exact statistics per observation point.
#[derive(Debug)]
pub struct StatsObserver {
    /// Statistics per observation point.
    pub tensors: BTreeMap<String, TensorStats>,
    statistics: Statistics,
}

impl StatsObserver {
    /// An observer that records `statistics`.
    pub fn new(statistics: Statistics) -> Self {
        Self {
            tensors: BTreeMap::new(),
            statistics,
        }
    }
}

impl Observer for StatsObserver {
    fn observe(&mut self, point: &str, rows: &[f32], width: usize) -> Result<()> {
        let stats = match &self.statistics {
            Statistics::Histograms { per_channel } => {
                let per_channel = *per_channel;
                self.tensors.entry(point.to_owned()).or_insert_with(|| {
                    if per_channel {
                        TensorStats::with_channels(width)
                    } else {
                        TensorStats::new()
                    }
                })
            }
            Statistics::Grams(points) => {
                let Some(&exponent) = points.get(point) else {
                    return Ok(());
                };
                match self.tensors.entry(point.to_owned()) {
                    Entry::Occupied(e) => e.into_mut(),
                    Entry::Vacant(e) => {
                        e.insert(TensorStats::with_gram(Gram::new(width, exponent)?))
                    }
                }
            }
        };
        stats.observe(rows)?;
        Ok(())
    }

    fn finished(&self) -> bool {
        match &self.statistics {
            Statistics::Histograms { .. } => false,
            Statistics::Grams(points) => points.keys().all(|p| self.tensors.contains_key(p)),
        }
    }
}
