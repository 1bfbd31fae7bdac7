//! From merged statistics to per-layer precisions the guard accepts.
//!
//! 1. **Initial plan**: every layer input (observation point: q/k/v share
//!    one, gate/up share one, so whole fused groups move together) gets the
//!    recipe's scheme — static per-tensor with its calibrator's threshold,
//!    or dynamic per-token — unless ignored; static scales are not used when
//!    calibration coverage is below the recipe's minimum.
//! 2. **Sensitivity**: each point's output SQNR on held-out inputs, at each
//!    rung it could run at (one forward); for language models also the
//!    output KL with only that point quantized, on a short held-out text
//!    (one forward per point and rung), which orders their ladder.
//! 3. **Ladder**: the sequence of one-rung demotions (static → dynamic → FP),
//!    always demoting the point whose current rung is noisiest; the guard
//!    then finds the shortest prefix of that sequence that meets the budget,
//!    by bisection (O(log n) evaluations; it assumes demoting more never
//!    hurts, and every evaluation it made is in the report). Demotions to FP
//!    that would exceed the cap on FP layers are left out of the ladder; if
//!    even the whole ladder fails the guard, the run is refused. The
//!    sequence and the bisection live in `crate::ladder`, which sees the
//!    noise ranking and the guard only as closures.

use std::collections::BTreeMap;

use qforge_core::{Calibrator, Stats};
use qforge_eval::{ReferenceLogProbs, compare_to};
use qforge_formats::policy::Action;
use qforge_model::artifact::{LayerPrecision, in_precision};
use qforge_model::{Linear, Model};
use serde::Serialize;

use crate::error::{Error, Result};
use crate::ladder::{Caps, Ladder, Rung, Search, Start};
use crate::recipe::{ActivationScheme, LmHead, LowCoverage, QuantRecipe};

mod noise;
mod probe;

use noise::{KlRanker, Noise};
pub use probe::{BoundedLadder, OFF_STATIC, Probed, probe};

/// Data the guard evaluates on; never seen by calibration.
pub enum HeldOut {
    /// Observations, row-major, `observation_dim` per row.
    Observations(Vec<f32>),
    /// Token ids of held-out text.
    Tokens(Vec<u32>),
}

/// The guard's measurements of one configuration.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GuardMetrics {
    /// Policies: share of held-out observations whose action equals the FP
    /// policy's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agreement: Option<f64>,
    /// Language models: perplexity on the held-out text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub perplexity: Option<f64>,
    /// Language models: relative perplexity increase over FP.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub perplexity_increase: Option<f64>,
    /// Language models: a 95 % interval of that increase from its spread
    /// over the held-out chunks ([`qforge_eval::increase_interval`]),
    /// when the text has two chunks or more: how far the held-out text
    /// alone lets the guard trust its figure.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub perplexity_increase_interval: Option<[f64; 2]>,
    /// Language models: mean KL(FP ‖ quantized) of next-token distributions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kl_divergence: Option<f64>,
    /// Language models: top-1 agreement with FP.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top1_agreement: Option<f64>,
    /// Whether the budget is met.
    pub passes: bool,
}

impl GuardMetrics {
    /// How far the configuration is from full precision, lower is closer:
    /// the relative perplexity increase (language models) or the share of
    /// actions that differ (policies).
    pub fn shortfall(&self) -> f64 {
        match (self.agreement, self.perplexity_increase) {
            (Some(agreement), _) => 1.0 - agreement,
            (_, Some(increase)) => increase,
            _ => f64::INFINITY,
        }
    }
}

/// One demotion of the ladder.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LadderStep {
    /// The layer input demoted (its whole fused group).
    pub point: String,
    /// Rung before.
    pub from: &'static str,
    /// Rung after.
    pub to: &'static str,
    /// Output SQNR of the group at the rung it left (dB; `None`: exact).
    pub sqnr_db: Option<f64>,
    /// Language models: the output KL of the group at the rung it left (what
    /// orders a language model's ladder).
    pub kl: Option<f64>,
}

/// One configuration the guard measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Evaluation {
    /// Ladder steps applied.
    pub steps: usize,
    /// Linear layers in FP.
    pub fp_layers: usize,
    /// The measurements.
    pub metrics: GuardMetrics,
}

/// Everything known about one layer input.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PointReport {
    /// Observation point.
    pub point: String,
    /// Linear layers fed by it.
    pub layers: Vec<String>,
    /// Final precision.
    pub precision: &'static str,
    /// Static activation scale, when static.
    pub input_scale: Option<f32>,
    /// The calibrator the recipe gives it.
    pub calibrator: String,
    /// Threshold of every calibrator on its histogram (for the report).
    pub thresholds: BTreeMap<String, Option<f32>>,
    /// Worst layer output SQNR with a static scale (dB).
    pub sqnr_static_db: Option<f64>,
    /// Worst layer output SQNR with dynamic activations (dB).
    pub sqnr_dynamic_db: Option<f64>,
    /// Language models: mean KL(FP ‖ model with only this input's layers
    /// quantized, static scale) of next-token distributions.
    pub kl_static: Option<f64>,
    /// The same with dynamic activations.
    pub kl_dynamic: Option<f64>,
    /// |x| histogram in eighth-octave bins: (lower, upper, count) of every
    /// non-empty one. (The statistics' own bins are far finer, as exact
    /// merging needs; the report needs the shape.)
    pub histogram: Vec<(f64, f64, u64)>,
    /// Values observed.
    pub count: u64,
    /// Ignored by the recipe.
    pub ignored: bool,
}

/// The outcome of [`quantize`].
#[derive(Debug, Clone, Serialize)]
pub struct Decision {
    /// Whether the guard accepted a configuration within the FP cap.
    pub accepted: bool,
    /// Why not, when refused.
    pub refusal: Option<String>,
    /// The precisions to write (the best within the cap, when refused).
    pub points: BTreeMap<String, LayerPrecision>,
    /// Per layer input.
    pub point_reports: Vec<PointReport>,
    /// Metrics of the full-precision model on the held-out data.
    pub reference: GuardMetrics,
    /// Metrics of the recipe's plan before any fallback.
    pub before: GuardMetrics,
    /// Metrics of the chosen configuration.
    pub after: GuardMetrics,
    /// The whole demotion sequence, in order.
    pub ladder: Vec<LadderStep>,
    /// Steps of it applied.
    pub applied_steps: usize,
    /// Every configuration the guard measured, in order.
    pub evaluations: Vec<Evaluation>,
    /// Linear layers in FP, of all of them.
    pub fp_layers: usize,
    /// All linear layers.
    pub total_layers: usize,
    /// Largest allowed `fp_layers`.
    pub max_fp_layers: usize,
    /// Calibration coverage of the statistics.
    pub coverage: f64,
    /// Things the user should know (low coverage, empty histograms).
    pub warnings: Vec<String>,
}

/// The calibrators drawn in the report beside the recipe's choice.
const REPORTED_CALIBRATORS: [Calibrator; 5] = [
    Calibrator::MinMax,
    Calibrator::Percentile { percentile: 99.99 },
    Calibrator::Entropy,
    Calibrator::Mse,
    Calibrator::Sigma { k: 3.0 },
];

/// The full-precision reference's behaviour on the held-out data: its
/// actions, or its log-probabilities and perplexity. Measured once per run
/// and shared by every guard that judges a quantization of it (each method
/// of a search, and the decision): at Llama-3-8B's size one forward over the
/// held-out text takes minutes.
pub struct Reference<'a> {
    held_out: &'a HeldOut,
    measured: Measured,
}

/// What the full-precision model did on the held-out data, by kind of model.
enum Measured {
    /// A policy's actions, one per observation.
    Actions(Vec<Action>),
    /// A language model's log-probabilities over the held-out tokens.
    LogProbs(ReferenceLogProbs),
}

impl<'a> Reference<'a> {
    /// Runs `reference` over `held_out` (language models in chunks of
    /// `ctx` tokens).
    pub fn new(reference: &'_ Model, held_out: &'a HeldOut, ctx: usize) -> Result<Self> {
        let measured = match (reference, held_out) {
            (Model::Policy(p), HeldOut::Observations(obs)) => Measured::Actions(p.act(obs)?),
            (Model::Language(lm), HeldOut::Tokens(tokens)) => {
                Measured::LogProbs(ReferenceLogProbs::new(&lm.model, tokens, ctx)?)
            }
            _ => {
                return Err(Error::HeldOut(
                    "policies are checked on observations, language models on text".into(),
                ));
            }
        };
        Ok(Self { held_out, measured })
    }
}

/// The guard: configurations of `model` measured against the reference.
struct Guard<'a> {
    /// What gets quantized.
    model: &'a Model,
    reference: &'a Reference<'a>,
    recipe: &'a QuantRecipe,
}

impl<'a> Guard<'a> {
    fn new(
        model: &'a Model,
        reference: &'a Reference<'a>,
        recipe: &'a QuantRecipe,
    ) -> Result<Self> {
        let fits = matches!(
            (model, reference.held_out),
            (Model::Policy(_), HeldOut::Observations(_)) | (Model::Language(_), HeldOut::Tokens(_))
        );
        if !fits {
            return Err(Error::HeldOut(
                "a policy's reference cannot judge a language model, nor the reverse".into(),
            ));
        }
        Ok(Self {
            model,
            reference,
            recipe,
        })
    }

    fn reference(&self) -> GuardMetrics {
        match &self.reference.measured {
            Measured::Actions(_) => GuardMetrics {
                agreement: Some(1.0),
                perplexity: None,
                perplexity_increase: None,
                perplexity_increase_interval: None,
                kl_divergence: None,
                top1_agreement: None,
                passes: true,
            },
            Measured::LogProbs(log_probs) => GuardMetrics {
                agreement: None,
                perplexity: Some(log_probs.perplexity()),
                perplexity_increase: Some(0.0),
                perplexity_increase_interval: None,
                kl_divergence: Some(0.0),
                top1_agreement: Some(1.0),
                passes: true,
            },
        }
    }

    /// Measures `points`.
    fn measure(&self, points: &BTreeMap<String, LayerPrecision>) -> Result<GuardMetrics> {
        let convert = |point: &str, layer: &Linear| in_precision(points, point, layer);
        match (
            self.model,
            self.reference.held_out,
            &self.reference.measured,
        ) {
            (Model::Policy(p), HeldOut::Observations(obs), Measured::Actions(reference)) => {
                let quantized = p.with_linears(convert)?;
                let actions = quantized.act(obs)?;
                let agreement = p.agreement(&actions, reference);
                Ok(GuardMetrics {
                    agreement: Some(agreement),
                    perplexity: None,
                    perplexity_increase: None,
                    perplexity_increase_interval: None,
                    kl_divergence: None,
                    top1_agreement: None,
                    passes: agreement >= self.recipe.guard.min_agreement,
                })
            }
            (Model::Language(lm), HeldOut::Tokens(tokens), Measured::LogProbs(log_probs)) => {
                let quantized = lm.model.with_linears(convert)?;
                let c = compare_to(&quantized, log_probs, tokens)?;
                let increase = c.perplexity / c.reference_perplexity - 1.0;
                Ok(GuardMetrics {
                    agreement: None,
                    perplexity: Some(c.perplexity),
                    perplexity_increase: Some(increase),
                    perplexity_increase_interval: c.increase_interval,
                    kl_divergence: Some(c.kl_divergence),
                    top1_agreement: Some(c.top1_agreement),
                    passes: increase <= self.recipe.guard.max_perplexity_increase,
                })
            }
            _ => unreachable!("checked in Guard::new"),
        }
    }
}

/// Quantizes `model` with `stats` (its own statistics) under `recipe`,
/// checking each candidate against `reference`: the same model's, or the
/// original's of a transformed (smoothed) `model`. `probed` is what
/// [`probe`] measured of the same model, statistics and recipe, if it ran
/// (nothing is measured or ranked again; a bounded ladder whose end met the
/// budget is the one walked). `progress` hears about every evaluation.
pub fn quantize(
    model: &'_ Model,
    reference: &Reference<'_>,
    stats: &Stats,
    recipe: &QuantRecipe,
    probed: Option<Probed>,
    progress: &mut dyn FnMut(&str),
) -> Result<Decision> {
    recipe.validate()?;
    let guard = Guard::new(model, reference, recipe)?;
    let held_out = reference.held_out;
    let linears = model.linears();
    let layers_of = layers_by_point(&linears);
    let total_layers = linears.len();
    let coverage = stats.provenance.coverage();
    let static_allowed = coverage >= recipe.calibration.min_coverage;
    let mut warnings: Vec<String> = coverage_warning(recipe, coverage, static_allowed)
        .into_iter()
        .collect();

    // 1. The recipe's plan, and the report's view of every point. When the
    // guard accepts it, no ladder (and no costly KL ranking) is needed.
    let mut plan = initial_plan(&layers_of, stats, recipe, static_allowed, &mut warnings)?;
    let (before, bounded) = match probed {
        Some(probed) => (probed.before, probed.bounded),
        None => (guard.measure(&plan.precisions())?, None),
    };
    let max_fp_layers = max_fp_layers(recipe, total_layers);

    // 2. The ladder, worst rung first, within the caps.
    let Walk {
        noise,
        ladder,
        known,
    } = ladder_to_walk(
        model,
        held_out,
        &plan,
        &layers_of,
        &before,
        bounded,
        max_fp_layers,
        progress,
    )?;
    noise.annotate(&mut plan.reports);

    // 3. The guard.
    let verdict = run_guard(
        &guard,
        &ladder,
        &before,
        known,
        total_layers,
        max_fp_layers,
        progress,
    )?;
    let points = ladder.precisions_at(verdict.applied_steps);
    // The guard measured the chosen step already (a measurement depends on
    // the precisions alone); only a refusal's "after" may be new.
    let after = match verdict
        .evaluations
        .iter()
        .find(|e| e.steps == verdict.applied_steps)
    {
        Some(evaluation) => evaluation.metrics.clone(),
        None => guard.measure(&points)?,
    };
    plan.settle(&points);
    Ok(Decision {
        accepted: verdict.accepted,
        refusal: verdict.refusal,
        points,
        point_reports: plan.reports.into_values().collect(),
        reference: guard.reference(),
        before,
        after,
        ladder: noise.ladder_steps(&ladder),
        applied_steps: verdict.applied_steps,
        evaluations: verdict.evaluations,
        fp_layers: ladder.fp_layers_at(verdict.applied_steps),
        total_layers,
        max_fp_layers,
        coverage,
        warnings,
    })
}

/// The ladder the guard walks and what it knows of it already.
struct Walk {
    /// The rankings that ordered it.
    noise: Noise,
    ladder: Ladder,
    /// A prefix's length and its measurement, taken already (the method
    /// search's bounded ladder's end).
    known: Option<(usize, GuardMetrics)>,
}

/// The ladder the guard walks, with the rankings that ordered it and, when
/// it is the method search's, the measurement of its end: the search's
/// bounded ladder where its end met the budget, else the whole one, ordered
/// by sensitivity at both integer rungs (the KL ranking only where the plan,
/// measured as `before`, fails; what the search ranked is not run again).
#[allow(clippy::too_many_arguments)]
fn ladder_to_walk(
    model: &Model,
    held_out: &HeldOut,
    plan: &Plan,
    layers_of: &BTreeMap<String, Vec<String>>,
    before: &GuardMetrics,
    bounded: Option<BoundedLadder>,
    max_fp_layers: usize,
    progress: &mut dyn FnMut(&str),
) -> Result<Walk> {
    match bounded {
        Some(bounded) if bounded.metrics.passes => {
            progress(&format!(
                "guard: walking the method search's bounded ladder ({} steps, {} layers moved off their static scales at its end)",
                bounded.steps(),
                bounded.moved_layers()
            ));
            Ok(Walk {
                known: Some((bounded.ladder.len(), bounded.metrics)),
                noise: bounded.noise,
                ladder: bounded.ladder,
            })
        }
        unmet => {
            progress("ranking layer sensitivity");
            let mut noise = match unmet {
                Some(bounded) => bounded.noise,
                None => Noise::rank_sqnr(model, held_out, &plan.static_scales)?,
            };
            if let (Model::Language(lm), HeldOut::Tokens(tokens), false) =
                (model, held_out, before.passes)
            {
                noise.rank_kl(&KlRanker::new(&lm.model, tokens)?, &plan.rungs, progress)?;
            }
            let ladder = Ladder::build(
                &plan.starts(layers_of),
                Caps::fp(max_fp_layers),
                |point, rung| noise.at(point, rung),
            );
            Ok(Walk {
                noise,
                ladder,
                known: None,
            })
        }
    }
}

/// The cap on linear layers in FP, of `total_layers`.
fn max_fp_layers(recipe: &QuantRecipe, total_layers: usize) -> usize {
    (recipe.guard.max_fp_fraction * total_layers as f64).floor() as usize
}

/// The linear layers fed by each observation point (a fused group).
fn layers_by_point(linears: &[(String, String, &Linear)]) -> BTreeMap<String, Vec<String>> {
    let mut layers_of: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (name, point, _) in linears {
        layers_of
            .entry(point.clone())
            .or_default()
            .push(name.clone());
    }
    layers_of
}

/// The warning when the recipe asks for static scales but calibration
/// covered too little of its plan for them to be trusted.
fn coverage_warning(recipe: &QuantRecipe, coverage: f64, static_allowed: bool) -> Option<String> {
    if recipe.quantize.activations != ActivationScheme::Static || static_allowed {
        return None;
    }
    Some(format!(
        "calibration covered {:.1} % of its batches, below the recipe's {:.1} %: static scales are not used ({})",
        100.0 * coverage,
        100.0 * recipe.calibration.min_coverage,
        match recipe.calibration.low_coverage {
            LowCoverage::Dynamic => "dynamic activations instead",
            LowCoverage::Fp => "those layers stay in full precision",
        }
    ))
}

/// The recipe's plan before any fallback.
struct Plan {
    /// Every point's rung.
    rungs: BTreeMap<String, Rung>,
    /// The static scale of every point whose calibrator found a threshold
    /// (whether or not the plan uses it: the SQNR ranking does).
    static_scales: BTreeMap<String, f32>,
    /// The report's view of every point, filled in as the run goes.
    reports: BTreeMap<String, PointReport>,
}

impl Plan {
    /// Every point's precision in the plan.
    fn precisions(&self) -> BTreeMap<String, LayerPrecision> {
        self.rungs
            .iter()
            .map(|(p, r)| (p.clone(), r.precision()))
            .collect()
    }

    /// Where each point starts on the ladder.
    fn starts(&self, layers_of: &BTreeMap<String, Vec<String>>) -> BTreeMap<String, Start> {
        self.rungs
            .iter()
            .map(|(point, &rung)| {
                let start = Start {
                    rung,
                    layers: layers_of[point].len(),
                    ignored: self.reports[point].ignored,
                };
                (point.clone(), start)
            })
            .collect()
    }

    /// Records the chosen precisions in the reports.
    fn settle(&mut self, points: &BTreeMap<String, LayerPrecision>) {
        for (point, precision) in points {
            let report = self
                .reports
                .get_mut(point)
                .expect("every point has a report");
            report.precision = precision.name();
            if let LayerPrecision::Int8Static { input_scale } = precision {
                report.input_scale = Some(*input_scale);
            }
        }
    }
}

/// The recipe's plan for every point of `layers_of`, with the warnings it
/// raises.
fn initial_plan(
    layers_of: &BTreeMap<String, Vec<String>>,
    stats: &Stats,
    recipe: &QuantRecipe,
    static_allowed: bool,
    warnings: &mut Vec<String>,
) -> Result<Plan> {
    let mut plan = Plan {
        rungs: BTreeMap::new(),
        static_scales: BTreeMap::new(),
        reports: BTreeMap::new(),
    };
    for (point, layers) in layers_of {
        let tensor = stats.tensors.get(point).ok_or_else(|| {
            Error::Stats(format!(
                "no statistics for {point}: were they calibrated on this model?"
            ))
        })?;
        let histogram = tensor.histogram();
        let calibrator = recipe.calibrator_for(point);
        let scale = calibrator.static_scale(histogram);
        if let Some(scale) = scale {
            plan.static_scales.insert(point.clone(), scale);
        }
        let ignored = recipe.ignores(point);
        let rung = initial_rung(point, ignored, scale, recipe, static_allowed, warnings);
        plan.rungs.insert(point.clone(), rung);
        let report = PointReport {
            point: point.clone(),
            layers: layers.clone(),
            precision: rung.name(),
            input_scale: None,
            calibrator: calibrator.to_string(),
            thresholds: REPORTED_CALIBRATORS
                .iter()
                .map(|c| (c.to_string(), c.threshold(histogram)))
                .collect(),
            sqnr_static_db: None,
            sqnr_dynamic_db: None,
            kl_static: None,
            kl_dynamic: None,
            histogram: eighth_octaves(histogram),
            count: histogram.count(),
            ignored,
        };
        plan.reports.insert(point.clone(), report);
    }
    Ok(plan)
}

/// The rung the recipe gives `point`: FP when ignored (or an `lm_head` the
/// recipe keeps in FP), dynamic for `lm_head` and dynamic recipes, the
/// low-coverage choice when static scales are not trusted, else static with
/// `scale` (dynamic, with a warning, when calibration saw nothing finite).
fn initial_rung(
    point: &str,
    ignored: bool,
    scale: Option<f32>,
    recipe: &QuantRecipe,
    static_allowed: bool,
    warnings: &mut Vec<String>,
) -> Rung {
    if ignored || (point == "lm_head" && recipe.quantize.lm_head == LmHead::Fp) {
        Rung::Fp
    } else if point == "lm_head" || recipe.quantize.activations == ActivationScheme::Dynamic {
        Rung::Dynamic
    } else if !static_allowed {
        match recipe.calibration.low_coverage {
            LowCoverage::Dynamic => Rung::Dynamic,
            LowCoverage::Fp => Rung::Fp,
        }
    } else if let Some(scale) = scale {
        Rung::Static(scale)
    } else {
        warnings.push(format!(
            "{point} saw no finite value in calibration; it runs with dynamic activations"
        ));
        Rung::Dynamic
    }
}

/// What the guard settled on.
struct Verdict {
    accepted: bool,
    refusal: Option<String>,
    applied_steps: usize,
    /// Every configuration measured, in order, the plan's (`before`) first.
    evaluations: Vec<Evaluation>,
}

/// Runs the guard: the plan (`before`, already measured) when it is within
/// the FP cap and passes, else the shortest passing prefix of `ladder`
/// (`known`: a prefix's length and its measurement, taken already).
fn run_guard(
    guard: &Guard<'_>,
    ladder: &Ladder,
    before: &GuardMetrics,
    mut known: Option<(usize, GuardMetrics)>,
    total_layers: usize,
    max_fp_layers: usize,
    progress: &mut dyn FnMut(&str),
) -> Result<Verdict> {
    let initial_fp = ladder.fp_layers_at(0);
    progress(&format!(
        "guard: 0 fallback steps, {initial_fp} FP layers: {}",
        describe(before)
    ));
    let mut verdict = Verdict {
        accepted: false,
        refusal: None,
        applied_steps: 0,
        evaluations: vec![Evaluation {
            steps: 0,
            fp_layers: initial_fp,
            metrics: before.clone(),
        }],
    };
    if initial_fp > max_fp_layers {
        verdict.refusal = Some(format!(
            "the recipe alone keeps {initial_fp} of {total_layers} linear layers in FP, above the cap of {max_fp_layers}."
        ));
        return Ok(verdict);
    }
    if before.passes {
        verdict.accepted = true;
        return Ok(verdict);
    }
    let evaluations = &mut verdict.evaluations;
    let evaluate = |steps: usize| -> Result<GuardMetrics> {
        let metrics = match known.take_if(|(known_steps, _)| *known_steps == steps) {
            Some((_, metrics)) => metrics,
            None => guard.measure(&ladder.precisions_at(steps))?,
        };
        let fp_layers = ladder.fp_layers_at(steps);
        progress(&format!(
            "guard: {steps} fallback steps, {fp_layers} FP layers: {}",
            describe(&metrics)
        ));
        evaluations.push(Evaluation {
            steps,
            fp_layers,
            metrics: metrics.clone(),
        });
        Ok(metrics)
    };
    match ladder.shortest_passing(evaluate, |m| m.passes)? {
        Search::Passes(steps) => {
            verdict.accepted = true;
            verdict.applied_steps = steps;
        }
        Search::Exhausted(most) => {
            verdict.applied_steps = ladder.len();
            verdict.refusal = Some(format!(
                "the guard fails even after the whole fallback ladder, with {} of {total_layers} linear layers in FP (cap {max_fp_layers}, guard.max_fp_fraction = {}): {}.",
                ladder.fp_layers_at(ladder.len()),
                guard.recipe.guard.max_fp_fraction,
                describe(&most)
            ));
        }
    }
    Ok(verdict)
}

/// |x| of `histogram` summed into bins [2^(k/8), 2^((k+1)/8)).
fn eighth_octaves(histogram: &qforge_core::Histogram) -> Vec<(f64, f64, u64)> {
    let mut bins: BTreeMap<i64, u64> = BTreeMap::new();
    for bin in histogram.magnitude_bins() {
        if bin.lower > 0.0 && bin.upper > bin.lower {
            let key = ((bin.lower * bin.upper).sqrt().log2() * 8.0).floor() as i64;
            *bins.entry(key).or_default() += bin.count;
        }
    }
    bins.into_iter()
        .map(|(k, count)| {
            (
                (k as f64 / 8.0).exp2(),
                ((k + 1) as f64 / 8.0).exp2(),
                count,
            )
        })
        .collect()
}

/// One line for a progress message.
pub fn describe(metrics: &GuardMetrics) -> String {
    let verdict = if metrics.passes { "passes" } else { "fails" };
    match (metrics.agreement, metrics.perplexity_increase) {
        (Some(a), _) => format!("action agreement {:.2} % ({verdict})", 100.0 * a),
        (_, Some(p)) => format!(
            "perplexity {:.4} ({:+.2} %{}, {verdict})",
            metrics.perplexity.unwrap_or(f64::NAN),
            100.0 * p,
            metrics
                .perplexity_increase_interval
                .map_or(String::new(), |[low, high]| format!(
                    "; 95 % interval {:+.2} … {:+.2} %",
                    100.0 * low,
                    100.0 * high
                ))
        ),
        _ => verdict.into(),
    }
}
