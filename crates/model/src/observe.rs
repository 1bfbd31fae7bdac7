//! Observation of linear-layer inputs, the hook calibration uses.
//!
//! A forward pass hands every distinct linear input to an [`Observer`] under
//! the Hugging Face module name of the first linear that reads it
//! (`model.layers.3.self_attn.q_proj` stands for the input q, k and v share;
//! `model.layers.3.mlp.gate_proj` for the input gate and up share), as rows of
//! `width` values. Padding positions are never handed over.

use std::collections::BTreeMap;

use qforge_core::TensorStats;

use crate::error::Result;

/// Receives linear-layer inputs during a forward pass.
pub trait Observer {
    /// `rows` holds whole rows of `width` values of the input named `point`.
    fn observe(&mut self, point: &str, rows: &[f32], width: usize) -> Result<()>;
}

/// An observer that accumulates exact statistics per observation point:
/// histograms, and per-channel abs-max when `channels` is set (smoothing needs
/// it).
#[derive(Debug, Default)]
pub struct StatsObserver {
    /// Statistics per observation point.
    pub tensors: BTreeMap<String, TensorStats>,
    per_channel: bool,
}

impl StatsObserver {
    /// An observer; `per_channel` also tracks each input channel's abs-max.
    pub fn new(per_channel: bool) -> Self {
        Self {
            tensors: BTreeMap::new(),
            per_channel,
        }
    }
}

impl Observer for StatsObserver {
    fn observe(&mut self, point: &str, rows: &[f32], width: usize) -> Result<()> {
        let per_channel = self.per_channel;
        let stats = self.tensors.entry(point.to_owned()).or_insert_with(|| {
            if per_channel {
                TensorStats::with_channels(width)
            } else {
                TensorStats::new()
            }
        });
        stats.observe(rows)?;
        Ok(())
    }
}
