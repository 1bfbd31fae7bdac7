//! How noisy each layer input is at each integer rung: the sensitivity
//! rankings (output SQNR per point, and for language models the output KL
//! with only that point quantized) that order the guard's ladder.

use std::collections::BTreeMap;

use qforge_eval::sensitivity::{LayerSqnr, llm_layer_sqnr, policy_layer_sqnr};
use qforge_eval::{ReferenceLogProbs, compare_from};
use qforge_model::{Activations, Llama, Model};
use rayon::prelude::*;

use super::{HeldOut, LadderStep, PointReport};
use crate::error::Result;
use crate::ladder::{Ladder, Rung};

/// Per-point worst layer SQNR with activations chosen by `activations`.
fn sensitivity(
    model: &Model,
    held_out: &HeldOut,
    activations: &dyn Fn(&str) -> qforge_model::Result<Activations>,
) -> Result<BTreeMap<String, Option<f64>>> {
    // Sensitivity needs a few hundred tokens or observations, not the whole
    // held-out set: it ranks, it does not judge.
    let layers: Vec<LayerSqnr> = match (model, held_out) {
        (Model::Policy(p), HeldOut::Observations(obs)) => {
            let dim = p.config().observation_dim;
            let rows = (obs.len() / dim).min(1024);
            policy_layer_sqnr(p, &obs[..rows * dim], activations)?
        }
        (Model::Language(lm), HeldOut::Tokens(tokens)) => {
            llm_layer_sqnr(&lm.model, &tokens[..tokens.len().min(256)], activations)?
        }
        _ => unreachable!("checked in Guard::new"),
    };
    let mut worst: BTreeMap<String, Option<f64>> = BTreeMap::new();
    for layer in layers {
        let entry = worst.entry(layer.point).or_insert(layer.sqnr_db);
        // None is exact (infinite SQNR): any finite value is worse.
        *entry = match (*entry, layer.sqnr_db) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }
    Ok(worst)
}

/// Tokens the KL sensitivity runs on: a few chunks' worth ranks reliably
/// (measured on SmolLM2: the ladder it orders is monotone in perplexity where
/// the SQNR order was not), at one forward per layer input and rung.
const SENSITIVITY_TOKENS: usize = 128;

/// KL trials run side by side in groups of this many, progress said after
/// each.
const RANKED_TOGETHER: usize = 20;

/// Language models' second ranking: the mean KL(FP ‖ model with only one
/// point's layers quantized) on the first [`SENSITIVITY_TOKENS`] held-out
/// tokens, one forward per point and rung, computed as the ladder needs
/// them. The end-to-end effect of one group, which a layer's own SQNR does
/// not see (a noisy `v_proj` can matter less than a cleaner `down_proj`).
pub(super) struct KlRanker<'m> {
    model: &'m Llama,
    tokens: &'m [u32],
    /// The FP model's log-probabilities, with the hidden state entering
    /// each layer: only the point's own layer on differs from it, so each
    /// run resumes there.
    reference: ReferenceLogProbs,
}

impl<'m> KlRanker<'m> {
    /// Runs the FP model once over the first tokens of `tokens`.
    pub(super) fn new(model: &'m Llama, tokens: &'m [u32]) -> Result<Self> {
        let tokens = &tokens[..tokens.len().min(SENSITIVITY_TOKENS)];
        let reference = ReferenceLogProbs::keeping_states(model, tokens, tokens.len())?;
        Ok(Self {
            model,
            tokens,
            reference,
        })
    }

    /// Every layer input, in the model's order.
    fn points(&self) -> Vec<String> {
        let mut points: Vec<String> = self
            .model
            .linears()
            .into_iter()
            .map(|(_, p, _)| p)
            .collect();
        points.dedup();
        points
    }

    /// The output KL with only `point`'s layers quantized with `activations`.
    fn kl(&self, point: &str, activations: Activations) -> Result<f64> {
        let single = self.model.with_linears(|p, layer| {
            if p == point {
                layer.to_int8(activations)
            } else {
                Ok(layer.clone())
            }
        })?;
        let layer = Llama::layer_of(point).unwrap_or(self.model.config().num_layers);
        Ok(compare_from(&single, &self.reference, self.tokens, layer)?.kl_divergence)
    }
}

/// How noisy each point is at each integer rung: worst layer output SQNR
/// (`None`: exact) and, for language models whose plan fails the guard, the
/// output KL with only that point quantized.
pub(super) struct Noise {
    is_language: bool,
    static_sqnr: BTreeMap<String, Option<f64>>,
    dynamic_sqnr: BTreeMap<String, Option<f64>>,
    static_kl: BTreeMap<String, f64>,
    dynamic_kl: BTreeMap<String, f64>,
}

impl Noise {
    /// The SQNR ranking, at the static rung only where some point has a
    /// static scale.
    pub(super) fn rank_sqnr(
        model: &Model,
        held_out: &HeldOut,
        static_scales: &BTreeMap<String, f32>,
    ) -> Result<Self> {
        let dynamic_sqnr = sensitivity(model, held_out, &|_| Ok(Activations::Dynamic))?;
        let static_sqnr = if static_scales.is_empty() {
            BTreeMap::new()
        } else {
            sensitivity(model, held_out, &|point| {
                Ok(static_scales
                    .get(point)
                    .map_or(Activations::Dynamic, |&s| Activations::Static(s)))
            })?
        };
        Ok(Self {
            is_language: matches!(model, Model::Language(_)),
            static_sqnr,
            dynamic_sqnr,
            static_kl: BTreeMap::new(),
            dynamic_kl: BTreeMap::new(),
        })
    }

    /// Adds the KL ranking: dynamic for every point, static for the points
    /// `rungs` has static; points ranked already are not run again.
    pub(super) fn rank_kl(
        &mut self,
        ranker: &KlRanker<'_>,
        rungs: &BTreeMap<String, Rung>,
        progress: &mut dyn FnMut(&str),
    ) -> Result<()> {
        let points = ranker.points();
        let dynamic: Vec<(String, Rung)> =
            points.iter().map(|p| (p.clone(), Rung::Dynamic)).collect();
        let what = "ranking layer inputs by output KL (dynamic activations)";
        self.rank_kl_at(ranker, &dynamic, what, progress)?;
        let scaled: Vec<(String, Rung)> = points
            .iter()
            .filter_map(|p| match rungs.get(p) {
                Some(&rung @ Rung::Static(_)) => Some((p.clone(), rung)),
                _ => None,
            })
            .collect();
        let what = "ranking layer inputs by output KL (static scales)";
        self.rank_kl_at(ranker, &scaled, what, progress)
    }

    /// Adds the KL of each point of `wanted` at its rung (an integer one)
    /// where it is not ranked yet, saying `what` it does and how far it is
    /// when there is any to rank (a search that ranked them all before
    /// says nothing).
    pub(super) fn rank_kl_at(
        &mut self,
        ranker: &KlRanker<'_>,
        wanted: &[(String, Rung)],
        what: &str,
        progress: &mut dyn FnMut(&str),
    ) -> Result<()> {
        let unranked: Vec<&(String, Rung)> = wanted
            .iter()
            .filter(|(point, rung)| !self.has_kl(point, *rung))
            .collect();
        if !unranked.is_empty() {
            progress(what);
        }
        let mut ranked = 0;
        for group in unranked.chunks(RANKED_TOGETHER) {
            // The trials are independent forwards, each the same bits on
            // any thread, so they run side by side: one forward of 128
            // tokens ran only 1.6x faster on two cores than on one
            // (SmolLM2), two at a time rank 1.25x faster.
            let kls: Vec<f64> = group
                .par_iter()
                .map(|(point, rung)| {
                    let activations = rung
                        .precision()
                        .activations()
                        .expect("an FP rung needs no ranking (has_kl)");
                    ranker.kl(point, activations)
                })
                .collect::<Result<_>>()?;
            for ((point, rung), kl) in group.iter().zip(kls) {
                let ranking = match rung {
                    Rung::Static(_) => &mut self.static_kl,
                    _ => &mut self.dynamic_kl,
                };
                ranking.insert(point.clone(), kl);
            }
            ranked += group.len();
            if group.len() == RANKED_TOGETHER {
                progress(&format!(
                    "  {ranked}/{} layer inputs ranked",
                    unranked.len()
                ));
            }
        }
        Ok(())
    }

    /// Whether `point`'s KL at `rung` is known (FP needs none).
    pub(super) fn has_kl(&self, point: &str, rung: Rung) -> bool {
        match rung {
            Rung::Static(_) => self.static_kl.contains_key(point),
            Rung::Dynamic => self.dynamic_kl.contains_key(point),
            Rung::Fp => true,
        }
    }

    /// Copies the rankings into the reports.
    pub(super) fn annotate(&self, reports: &mut BTreeMap<String, PointReport>) {
        for (point, report) in reports {
            report.sqnr_dynamic_db = self.dynamic_sqnr.get(point).copied().flatten();
            report.sqnr_static_db = self.static_sqnr.get(point).copied().flatten();
            report.kl_dynamic = self.dynamic_kl.get(point).copied();
            report.kl_static = self.static_kl.get(point).copied();
        }
    }

    pub(super) fn sqnr_at(&self, point: &str, rung: Rung) -> Option<f64> {
        match rung {
            Rung::Static(_) => self.static_sqnr.get(point).copied().flatten(),
            Rung::Dynamic => self.dynamic_sqnr.get(point).copied().flatten(),
            Rung::Fp => None,
        }
    }

    fn kl_at(&self, point: &str, rung: Rung) -> Option<f64> {
        match rung {
            Rung::Static(_) => self.static_kl.get(point).copied(),
            Rung::Dynamic => self.dynamic_kl.get(point).copied(),
            Rung::Fp => None,
        }
    }

    /// How noisy `point` is at `rung`, higher worse: output KL for language
    /// models, −SQNR for policies (an exact layer is the least noisy).
    pub(super) fn at(&self, point: &str, rung: Rung) -> f64 {
        if self.is_language {
            self.kl_at(point, rung).unwrap_or(0.0)
        } else {
            self.sqnr_at(point, rung)
                .map_or(f64::NEG_INFINITY, |db| -db)
        }
    }

    /// The report's view of the ladder: each step with the noise of the rung
    /// it left.
    pub(super) fn ladder_steps(&self, ladder: &Ladder) -> Vec<LadderStep> {
        ladder
            .demotions()
            .iter()
            .map(|d| LadderStep {
                point: d.point.clone(),
                from: d.from.name(),
                to: d.to.name(),
                sqnr_db: self.sqnr_at(&d.point, d.from),
                kl: self.kl_at(&d.point, d.from),
            })
            .collect()
    }
}
