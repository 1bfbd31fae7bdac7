//! What the method search measures of each method before the guard's
//! fallback: the recipe's plan as it stands and, for a static plan that
//! misses the budget, the guard's own ladder bounded to keep the plan mostly
//! static, measured where it ends. The guard then starts from these
//! measurements instead of taking them again.

use qforge_model::Model;

use super::noise::{KlRanker, Noise};
use super::{
    Guard, GuardMetrics, HeldOut, Reference, initial_plan, layers_by_point, max_fp_layers,
};
use crate::error::Result;
use crate::ladder::{Caps, Ladder, Rung};
use crate::recipe::{ActivationScheme, QuantRecipe};

/// The largest share of linear layers a mostly static plan runs otherwise
/// than with static scales (dynamic or FP, the plan's own such layers
/// included): the bound on the ladder the method search measures a static
/// plan by ([`probe`]). A plan that meets the budget within it is still
/// mostly a static plan, and exports as one.
pub const OFF_STATIC: f64 = 0.1;

/// What [`probe`] measured of one method's plan.
pub struct Probed {
    /// The plan as it stands.
    pub before: GuardMetrics,
    /// A static plan that missed the budget as it stands: the guard's ladder
    /// bounded by [`OFF_STATIC`] and the FP cap, measured at its end.
    pub bounded: Option<BoundedLadder>,
}

/// The guard's ladder of a static plan, bounded so that at most
/// [`OFF_STATIC`] of the linear layers leave their static scales (and the
/// FP layers stay within the cap), with its rankings and the measurement of
/// its end. When the end meets the budget, the guard's fallback walks this
/// ladder: whatever prefix it settles on is within the bound.
pub struct BoundedLadder {
    pub(super) ladder: Ladder,
    pub(super) noise: Noise,
    /// The guard's measurement of the plan at the ladder's end.
    pub metrics: GuardMetrics,
}

impl BoundedLadder {
    /// Linear layers moved off their static scales at the ladder's end.
    pub fn moved_layers(&self) -> usize {
        self.ladder.moved_off_static_at(self.ladder.len())
    }

    /// Linear layers in FP at the ladder's end, the plan's own included.
    pub fn fp_layers(&self) -> usize {
        self.ladder.fp_layers_at(self.ladder.len())
    }

    /// Demotions in the ladder.
    pub fn steps(&self) -> usize {
        self.ladder.len()
    }
}

/// The guard's measurement of `recipe`'s plan for `model` (with `stats`, its
/// own statistics) before any fallback, as [`super::quantize`] takes it
/// first; for a static plan that misses the budget, also the end of its
/// bounded ladder ([`BoundedLadder`]). What the method search compares: one
/// method's miss may be a few inputs that dynamic scales or FP fix, another's
/// spread over every layer, which only a ladder past the bound fixes. The
/// bounded ladder costs the ranking of every static input by output KL (one
/// forward each, from its own layer on, for language models), the dynamic
/// ranking of only the inputs the ladder brings to that rung, and one
/// measurement.
pub fn probe(
    model: &Model,
    reference: &Reference<'_>,
    stats: &qforge_core::Stats,
    recipe: &QuantRecipe,
    progress: &mut dyn FnMut(&str),
) -> Result<Probed> {
    recipe.validate()?;
    let guard = Guard::new(model, reference, recipe)?;
    let linears = model.linears();
    let layers_of = layers_by_point(&linears);
    let static_allowed = stats.provenance.coverage() >= recipe.calibration.min_coverage;
    let plan = initial_plan(&layers_of, stats, recipe, static_allowed, &mut Vec::new())?;
    let before = guard.measure(&plan.precisions())?;
    // A plan with no static scale (coverage too low to trust them) has no
    // static layers to keep.
    let has_static = plan.rungs.values().any(|r| matches!(r, Rung::Static(_)));
    if before.passes || recipe.quantize.activations != ActivationScheme::Static || !has_static {
        return Ok(Probed {
            before,
            bounded: None,
        });
    }
    let total = linears.len();
    let off_static_in_plan: usize = plan
        .rungs
        .iter()
        .filter(|(_, rung)| !matches!(rung, Rung::Static(_)))
        .map(|(point, _)| layers_of[point].len())
        .sum();
    let caps = Caps {
        fp_layers: max_fp_layers(recipe, total),
        moved_off_static: ((OFF_STATIC * total as f64).floor() as usize)
            .saturating_sub(off_static_in_plan),
    };
    let starts = plan.starts(&layers_of);
    let mut noise = Noise::rank_sqnr(model, reference.held_out, &plan.static_scales)?;
    let ladder = match (model, reference.held_out) {
        (Model::Language(lm), HeldOut::Tokens(tokens)) => {
            let ranker = KlRanker::new(&lm.model, tokens)?;
            let scaled: Vec<(String, Rung)> = plan
                .rungs
                .iter()
                .filter(|(_, rung)| matches!(rung, Rung::Static(_)))
                .map(|(point, &rung)| (point.clone(), rung))
                .collect();
            let what = "ranking static layer inputs by output KL";
            noise.rank_kl_at(&ranker, &scaled, what, progress)?;
            // The dynamic rung's ranking only where the bounded ladder goes.
            Ladder::build_ranking_as_needed(
                &starts,
                caps,
                &mut noise,
                |noise, point, rung| noise.has_kl(point, rung).then(|| noise.at(point, rung)),
                |noise, lacking| {
                    let what = "ranking layer inputs by output KL where the ladder goes";
                    noise.rank_kl_at(&ranker, lacking, what, progress)
                },
            )?
        }
        _ => Ladder::build(&starts, caps, |point, rung| noise.at(point, rung)),
    };
    if ladder.len() == 0 {
        return Ok(Probed {
            before,
            bounded: None,
        });
    }
    let metrics = guard.measure(&ladder.precisions_at(ladder.len()))?;
    Ok(Probed {
        before,
        bounded: Some(BoundedLadder {
            ladder,
            noise,
            metrics,
        }),
    })
}
