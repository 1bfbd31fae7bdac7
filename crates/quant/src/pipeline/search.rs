//! The method search: every candidate recipe calibrated in one session and
//! measured by the guard before any fallback, the cheapest that meets the
//! budget (or the closest) going on to the guard's ladder.

use qforge_runner::Listener;

use super::{Inputs, Judged, Pipeline, Prepared, Quantized};
use crate::error::Result;
use crate::guard::{GuardMetrics, OFF_STATIC, Probed, Reference, describe, probe};
use crate::recipe::{Method, QuantRecipe};
use crate::report::{MethodSearch, MethodTrial, MostlyStatic};

impl Pipeline<'_> {
    /// The method search: every candidate recipe's passes and the guard's
    /// measurement of its plan, until one meets the budget; the chosen one
    /// then goes through the guard's fallback. The candidates share one
    /// session and number their passes on from each other, so the workers of
    /// a cluster follow from one method's passes into the next.
    pub(super) fn search(
        &self,
        candidates: Vec<(Method, QuantRecipe)>,
        inputs: &Inputs,
        listener: &mut dyn Listener,
    ) -> Result<Quantized> {
        let first = self.recipe.calibration_recipe();
        let mut session = self.open_session(inputs, &first, listener)?;
        let stages: Vec<(Method, Pipeline<'_>)> = candidates
            .into_iter()
            .map(|(method, recipe)| Pipeline::new(recipe, self.executor).map(|p| (method, p)))
            .collect::<Result<_>>()?;
        let mut groups = Vec::new();
        if stages.iter().any(|(_, stage)| stage.recipe.gptq.enabled) {
            groups = stages[0].1.hessian_groups_for(&mut session)?;
        }
        let groups_of = |stage: &Pipeline<'_>| {
            if stage.recipe.gptq.enabled {
                &groups[..]
            } else {
                &[]
            }
        };
        let count: usize = stages
            .iter()
            .map(|(_, stage)| stage.pass_count(groups_of(stage)))
            .sum();
        let original = session.load_model()?.clone();
        let (held, held_description) = self.held_out(&session, &original, inputs, listener)?;
        // Measured after the first method's passes, so that a cluster's
        // workers start calibrating at once.
        let mut reference = None;
        let mut trials: Vec<MethodTrial> = Vec::new();
        let mut best: Option<(usize, Prepared, Probed)> = None;
        let mut done = 0;
        for (i, (method, stage)) in stages.iter().enumerate() {
            listener.message(&format!("method {}: calibrating", method.name()));
            let started = std::time::Instant::now();
            let stage_groups = groups_of(stage);
            let prepared = stage.prepare(&mut session, stage_groups, done, count, listener)?;
            done += stage.pass_count(stage_groups);
            if reference.is_none() {
                reference = Some(self.reference(&original, &held, listener)?);
            }
            let reference = reference.as_ref().expect("measured above");
            let (trial, probed) = stage.trial(*method, &prepared, reference, started, listener)?;
            let closer = best
                .as_ref()
                .is_none_or(|(b, ..)| trial.best().shortfall() < trials[*b].best().shortfall());
            trials.push(trial);
            if closer {
                best = Some((i, prepared, probed));
            }
            if trials[i].best().passes {
                break;
            }
        }
        self.skip_passes_after(&session, &first, done, count)?;
        let (chosen, prepared, probed) = best.expect("the search runs at least one method");
        let (method, stage) = &stages[chosen];
        let budget = stage.recipe.guard.max_perplexity_increase;
        let reason = search_reason(*method, &trials[chosen], budget, listener);
        let judged = Judged {
            reference: reference.as_ref().expect("measured with the first method"),
            probed: Some(probed),
            held_description,
        };
        let mut quantized = stage.finish(session, original, prepared, judged, listener)?;
        quantized.report.method = Some(MethodSearch {
            chosen: method.name().into(),
            reason,
            tried: trials,
        });
        Ok(quantized)
    }
}

impl Pipeline<'_> {
    /// The guard's measurement of this method's plan (`prepared`, its
    /// calibration having started at `started`) before any fallback, and,
    /// for a static recipe whose plan misses the budget, of the end of its
    /// bounded ladder; the trial as the report shows it, and the
    /// measurements as the guard takes them.
    fn trial(
        &self,
        method: Method,
        prepared: &Prepared,
        reference: &Reference<'_>,
        started: std::time::Instant,
        listener: &mut dyn Listener,
    ) -> Result<(MethodTrial, Probed)> {
        let name = method.name();
        let probed = probe(
            &prepared.model,
            reference,
            &prepared.stats,
            &self.recipe,
            &mut |line| listener.message(line),
        )?;
        listener.message(&format!(
            "method {name}: before any fallback, {}",
            describe(&probed.before)
        ));
        let mostly_static = probed.bounded.as_ref().map(|bounded| {
            listener.message(&format!(
                "method {name}: with {} linear layers moved off their static scales by the bounded ladder ({} FP), {}",
                bounded.moved_layers(),
                bounded.fp_layers(),
                describe(&bounded.metrics)
            ));
            MostlyStatic {
                moved_layers: bounded.moved_layers(),
                fp_layers: bounded.fp_layers(),
                metrics: bounded.metrics.clone(),
            }
        });
        let trial = MethodTrial {
            method: name.into(),
            before: probed.before.clone(),
            mostly_static,
            seconds: started.elapsed().as_secs_f64(),
        };
        Ok((trial, probed))
    }
}

/// Why the search chose `method`, whose `trial` it was, also told to the
/// listener: its plan met the budget first, or did so with its noisiest
/// inputs dynamic, or came closest; with the caution of an interval that
/// reaches past the budget.
fn search_reason(
    method: Method,
    trial: &MethodTrial,
    budget: f64,
    listener: &mut dyn Listener,
) -> String {
    let name = method.name();
    let best = trial.best();
    let mut reason = match &trial.mostly_static {
        _ if trial.before.passes => {
            "the cheapest method whose plan met the guard's budget before any fallback".to_string()
        }
        Some(mostly) if mostly.metrics.passes => format!(
            "the cheapest method whose plan met the guard's budget once its ladder, bounded to keep {:.0} % of the linear layers static, moved {} layers off their static scales ({} FP); the guard then walked that ladder",
            100.0 * (1.0 - OFF_STATIC),
            mostly.moved_layers,
            mostly.fp_layers
        ),
        _ => "no method met the guard's budget before fallback; the one that came closest, then the fallback"
            .to_string(),
    };
    if let Some(caution) = interval_caution(best, budget) {
        listener.message(&format!("warning: method {name}: {caution}"));
        reason = format!("{reason}; {caution}");
    }
    listener.message(&format!("method: {name} ({reason})"));
    reason
}

/// What to say when a plan that meets the perplexity budget does so only
/// by its point estimate: the guard's 95 % interval reaches past the
/// budget, so the held-out text is too short to tell whether it holds.
fn interval_caution(metrics: &GuardMetrics, budget: f64) -> Option<String> {
    let [low, high] = metrics.perplexity_increase_interval?;
    (metrics.passes && high > budget).then(|| {
        format!(
            "its perplexity increase's 95 % interval ({:+.2} … {:+.2} %) reaches past the budget ({:+.2} %): the held-out text cannot tell whether the budget holds (a longer --eval-data text narrows the interval)",
            100.0 * low,
            100.0 * high,
            100.0 * budget
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn measured(increase: f64, interval: Option<[f64; 2]>, passes: bool) -> GuardMetrics {
        GuardMetrics {
            agreement: None,
            perplexity: Some(20.0),
            perplexity_increase: Some(increase),
            perplexity_increase_interval: interval,
            kl_divergence: Some(0.01),
            top1_agreement: Some(0.9),
            passes,
        }
    }

    #[test]
    fn a_pass_whose_interval_reaches_past_the_budget_is_said_to_be_uncertain() {
        let budget = 0.01;
        let uncertain = measured(0.008, Some([0.004, 0.012]), true);
        let caution = interval_caution(&uncertain, budget).unwrap();
        assert!(caution.contains("+0.40 … +1.20 %"), "{caution}");
        assert!(caution.contains("budget (+1.00 %)"), "{caution}");
        assert_eq!(
            interval_caution(&measured(0.008, Some([0.006, 0.0099]), true), budget),
            None
        );
        // A failing plan, or one measured on a single chunk, has nothing to add.
        assert_eq!(
            interval_caution(&measured(0.02, Some([0.015, 0.025]), false), budget),
            None
        );
        assert_eq!(interval_caution(&measured(0.008, None, true), budget), None);
    }
}
