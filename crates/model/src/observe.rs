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
    /// Every point's histogram, and the Gram matrix of the listed points at
    /// their exponents: the activation pass and GPTQ's first Hessian pass in
    /// one forward.
    HistogramsAndGrams(BTreeMap<String, i32>),
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
        let stats = match self.tensors.entry(point.to_owned()) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => {
                let fresh = match &self.statistics {
                    Statistics::Histograms { per_channel: true } => {
                        TensorStats::with_channels(width)
                    }
                    Statistics::Histograms { per_channel: false } => TensorStats::new(),
                    Statistics::Grams(points) => match points.get(point) {
                        Some(&exponent) => TensorStats::with_gram(Gram::new(width, exponent)?),
                        None => return Ok(()),
                    },
                    Statistics::HistogramsAndGrams(points) => match points.get(point) {
                        Some(&exponent) => TensorStats::with_gram(Gram::new(width, exponent)?),
                        None => TensorStats::new(),
                    },
                };
                e.insert(fresh)
            }
        };
        stats.observe(rows)?;
        Ok(())
    }

    fn finished(&self) -> bool {
        match &self.statistics {
            Statistics::Histograms { .. } | Statistics::HistogramsAndGrams(_) => false,
            Statistics::Grams(points) => points.keys().all(|p| self.tensors.contains_key(p)),
        }
    }
}
