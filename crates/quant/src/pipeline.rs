//! The quantization pipeline: a recipe's calibration passes run through an
//! executor (worker threads here, or `qforge worker`s on Redis), the
//! transforms their merged results imply, then the guard's ladder and the
//! native artifact.
//!
//! A pass computes, per batch, an exact mergeable result (activation
//! histograms; with the smoothing pass also per-channel abs-max). What is
//! done with the merged result is the pipeline's: SmoothQuant's factors
//! become a [`Transform`] that the next pass's job carries, so every worker
//! of that pass observes exactly the smoothed model, on any backend; the last
//! pass's statistics choose the scales.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use qforge_calib::{HessianPass, Job, Pass, Session, Transform, write_transforms};
use qforge_core::{Gram, Stats, TensorStats};
use qforge_formats::manifest::write_manifest;
use qforge_formats::output::write_dir_atomic;
use qforge_formats::profile::CalibrationProfile;
use qforge_model::artifact::{check_numbers, write_language_model, write_policy};
use qforge_model::{Int8Weight, Model};
use qforge_runner::{Executor, Listener, PassPosition, RunOptions, RunSummary};
use rayon::prelude::*;
use serde_json::{Value, json};

use crate::error::{Error, Result};
use crate::gptq::{Gptq, GptqOptions};
use crate::guard::{Decision, HeldOut, Probed, Reference, quantize};
use crate::held_out::held_out;
use crate::recipe::ActivationScheme;
use crate::recipe::QuantRecipe;
use crate::report::{CalibrationSummary, GptqRecord, PassRecord, Report};
use crate::returns::ReturnCheck;
use crate::smoothing::{Smoothing, SmoothingRecord};

mod search;

/// Where the pipeline reads its inputs.
#[derive(Debug, Clone)]
pub struct Inputs {
    /// The model: GGUF file, Hugging Face directory or policy directory.
    pub model: PathBuf,
    /// Calibration data (JSONL).
    pub data: PathBuf,
    /// Held-out data for the guard (trajectories JSONL for a policy, UTF-8
    /// text for a language model); `None`: the samples of `data` that
    /// calibration did not draw.
    pub eval_data: Option<PathBuf>,
    /// Count and skip invalid data lines instead of failing.
    pub skip_invalid: bool,
}

impl Inputs {
    /// `model` calibrated on `data`, guarded on what calibration did not draw.
    pub fn new(model: impl Into<PathBuf>, data: impl Into<PathBuf>) -> Self {
        Self {
            model: model.into(),
            data: data.into(),
            eval_data: None,
            skip_invalid: false,
        }
    }
}

/// A recipe, run on an executor.
pub struct Pipeline<'a> {
    recipe: QuantRecipe,
    executor: &'a dyn Executor,
}

/// A finished pipeline: the guard's decision and everything an artifact is
/// written from.
pub struct Quantized {
    /// The inputs as loaded and planned.
    pub session: Session,
    /// The full-precision model the decision quantizes: the original after
    /// `transforms` (smoothed, when SmoothQuant ran).
    pub model: Model,
    /// What the passes changed in the model.
    pub transforms: Vec<Transform>,
    /// The last pass's merged statistics (the scales' source).
    pub stats: Stats,
    /// The report (`report.json`, `report.html`), with the decision.
    pub report: Report,
    /// What the guard evaluated on.
    pub held_out: String,
}

impl<'a> Pipeline<'a> {
    /// `recipe` (validated here), with its passes run on `executor`.
    pub fn new(recipe: QuantRecipe, executor: &'a dyn Executor) -> Result<Self> {
        recipe.validate()?;
        Ok(Self { recipe, executor })
    }

    /// The calibration passes of the recipe that run before any transform
    /// is chosen, in order: SmoothQuant's (if enabled), then the activation
    /// pass. With GPTQ, the activation pass also sums the Hessians of the
    /// first group of layer inputs, and a Hessian pass follows for each
    /// further group; how many depends on the model ([`hessian_groups`]).
    pub fn passes(&self) -> Vec<Pass> {
        if self.recipe.smoothing.enabled {
            vec![Pass::Smoothing, Pass::Activation]
        } else {
            vec![Pass::Activation]
        }
    }

    /// How many passes the recipe runs when GPTQ's inputs fall into `groups`
    /// (none without GPTQ): the first group's Hessians are summed by the
    /// activation pass.
    fn pass_count(&self, groups: &[Vec<(String, usize)>]) -> usize {
        self.passes().len() + groups.len().saturating_sub(1)
    }

    /// Runs every pass, then GPTQ (if enabled), then the guard. When the
    /// recipe searches for its method, each method runs its passes in turn
    /// (cheapest first) until one's plan meets the guard's budget before any
    /// fallback. A refused decision is a result
    /// (`report.decision.accepted` is false), not an error.
    pub fn run(&self, inputs: &Inputs, listener: &mut dyn Listener) -> Result<Quantized> {
        let policy = qforge_model::Format::is_policy(&inputs.model)?;
        if let Some(why) = self.recipe.needs_language_model()
            && policy
        {
            return Err(Error::Recipe(why.into()));
        }
        let candidates = self.recipe.candidates(policy);
        if candidates.len() > 1 {
            return self.search(candidates, inputs, listener);
        }
        let first = qforge_calib::Recipe {
            pass: self.passes()[0].clone(),
            ..self.recipe.calibration_recipe()
        };
        let mut session = self.open_session(inputs, &first, listener)?;
        // The held-out data are read before any pass runs, so that data the
        // guard cannot use are refused before hours of calibration.
        let original = session.load_model()?.clone();
        let (held, held_description) = self.held_out(&session, &original, inputs, listener)?;
        // The Hessian passes cut the model's inputs by their widths, so the
        // count of passes is known before the first one runs.
        let groups = self.hessian_groups(&mut session)?;
        let count = self.pass_count(&groups);
        let prepared = self.prepare(&mut session, &groups, 0, count, listener)?;
        let reference = self.reference(&original, &held, listener)?;
        let judged = Judged {
            reference: &reference,
            probed: None,
            held_description,
        };
        self.finish(session, original, prepared, judged, listener)
    }

    /// Tells the workers following the pipeline, who wait for the pass after
    /// the last one run, that none comes after pass `done` of `count` (the
    /// search stopped before its last method).
    fn skip_passes_after(
        &self,
        session: &Session,
        first: &qforge_calib::Recipe,
        done: usize,
        count: usize,
    ) -> Result<()> {
        if done < count {
            let job = session.job(first, &[]);
            let next = PassPosition {
                index: done + 1,
                count,
            };
            self.executor.skip_pass(session, &job, next)?;
        }
        Ok(())
    }

    /// Opens the session over `inputs` with `first` (the first pass's
    /// recipe), with its warnings (skipped lines, too few samples).
    fn open_session(
        &self,
        inputs: &Inputs,
        first: &qforge_calib::Recipe,
        listener: &mut dyn Listener,
    ) -> Result<Session> {
        let session = Session::open(
            &inputs.model,
            &inputs.data,
            first,
            inputs.skip_invalid,
            self.executor.weights(),
        )?;
        for warning in session.warnings() {
            listener.message(&format!("warning: {warning}"));
        }
        Ok(session)
    }

    /// GPTQ's groups of layer inputs when the recipe runs GPTQ, else none.
    fn hessian_groups(&self, session: &mut Session) -> Result<Vec<Vec<(String, usize)>>> {
        if self.recipe.gptq.enabled {
            self.hessian_groups_for(session)
        } else {
            Ok(Vec::new())
        }
    }

    /// GPTQ's groups of the session's model under this recipe's memory
    /// budget.
    fn hessian_groups_for(&self, session: &mut Session) -> Result<Vec<Vec<(String, usize)>>> {
        let model = session.load_model()?;
        if self.recipe.gptq.sequential {
            return Ok(layer_inputs(model).into_iter().map(|i| vec![i]).collect());
        }
        let budget = self.recipe.gptq.hessian_memory_mib as u64 * (1 << 20);
        Ok(hessian_groups(model, budget))
    }

    /// The guard's held-out data and what they are.
    fn held_out(
        &self,
        session: &Session,
        original: &Model,
        inputs: &Inputs,
        listener: &mut dyn Listener,
    ) -> Result<(HeldOut, String)> {
        let held = held_out(
            session,
            original,
            inputs.eval_data.as_deref(),
            self.recipe.guard.ctx,
        )?;
        listener.message(&format!("guard data: {}", held.1));
        Ok(held)
    }

    /// The recipe's calibration passes, numbered from `done + 1` of `count`,
    /// then GPTQ's: the model they leave, its statistics and the records.
    fn prepare(
        &self,
        session: &mut Session,
        groups: &[Vec<(String, usize)>],
        done: usize,
        count: usize,
        listener: &mut dyn Listener,
    ) -> Result<Prepared> {
        let first = session.recipe.clone();
        // Every Hessian sums at the exponent the plan's row count implies, so
        // the first group's can be summed beside the activation histograms.
        let exponent = Gram::run_exponent(session.plan.rows as u64);
        let mut transforms = Vec::new();
        let mut records = Vec::new();
        let mut activation = None;
        let mut first_hessians = None;
        let mut smoothing = None;
        for (i, pass) in self.passes().into_iter().enumerate() {
            let position = PassPosition {
                index: done + i + 1,
                count,
            };
            // The smoothing pass measures the unrotated model (a rotated
            // input is not smoothable); the rotation comes after smoothing,
            // before the pass that chooses the scales.
            if pass == Pass::Activation {
                transforms.extend(self.rotations());
            }
            let pass = match (pass, groups.first()) {
                (Pass::Activation, Some(group)) => {
                    Pass::ActivationAndHessian(hessian_pass(group, exponent))
                }
                (pass, _) => pass,
            };
            let recipe = qforge_calib::Recipe {
                pass: pass.clone(),
                ..first.clone()
            };
            let job = session.job(&recipe, &transforms);
            let mut summary = self.run_pass(session, &job, position, listener)?;
            match &pass {
                Pass::Smoothing => {
                    let chosen = self.smoothing(session, &summary.stats, listener)?;
                    transforms.push(Transform::Smooth {
                        factors: chosen.factors,
                    });
                    smoothing = Some(chosen.record);
                }
                Pass::Activation => activation = Some(std::mem::take(&mut summary.stats)),
                Pass::ActivationAndHessian(hessian) => {
                    let mut stats = std::mem::take(&mut summary.stats);
                    first_hessians = Some(Hessians::take(&mut stats, hessian, summary.coverage));
                    activation = Some(stats);
                }
                Pass::Hessian(_) => unreachable!("Hessian passes follow the calibration passes"),
            }
            records.push((pass.name(), summary));
        }
        let stats = activation.expect("every recipe runs the activation pass");
        let mut model = session.target(&transforms)?;
        let mut gptq = None;
        if let Some(first_hessians) = first_hessians {
            let rounding = Rounding {
                session,
                transforms: &transforms,
                first: &first,
                exponent,
                done: done + records.len(),
                count,
            };
            let (weights, seconds) = self.gptq(
                &rounding,
                &model,
                groups,
                first_hessians,
                &mut records,
                listener,
            )?;
            model = model.with_int8_weights(&weights)?;
            gptq = Some(GptqRecord {
                layers: weights.len(),
                seconds,
            });
        }
        Ok(Prepared {
            model,
            transforms,
            stats,
            records,
            gptq,
            smoothing,
        })
    }

    /// The recipe's rotations, as the transforms that apply them.
    fn rotations(&self) -> Vec<Transform> {
        let rotation = &self.recipe.rotation;
        let mut transforms = Vec::new();
        if rotation.residual {
            transforms.push(Transform::RotateResidual {
                seed: rotation.seed,
            });
        }
        if !rotation.inputs.is_empty() {
            transforms.push(Transform::Rotate {
                inputs: rotation.inputs.clone(),
            });
        }
        transforms
    }

    /// The full-precision `original`'s behaviour on the held-out data, which
    /// every guard of this run measures against.
    fn reference<'h>(
        &self,
        original: &Model,
        held: &'h HeldOut,
        listener: &mut dyn Listener,
    ) -> Result<Reference<'h>> {
        listener.message("guard: running the full-precision model on the held-out data");
        Reference::new(original, held, self.recipe.guard.ctx)
    }

    /// The guard's decision on a prepared model, and the report.
    fn finish(
        &self,
        session: Session,
        original: Model,
        prepared: Prepared,
        judged: Judged<'_>,
        listener: &mut dyn Listener,
    ) -> Result<Quantized> {
        let decision = quantize(
            &prepared.model,
            judged.reference,
            &prepared.stats,
            &self.recipe,
            judged.probed,
            &mut |line| listener.message(line),
        )?;
        let mut report = self.report(&session, &original, &prepared.records, decision);
        report.gptq = prepared.gptq;
        report.smoothing = prepared.smoothing;
        Ok(Quantized {
            session,
            model: prepared.model,
            transforms: prepared.transforms,
            stats: prepared.stats,
            report,
            held_out: judged.held_description,
        })
    }

    /// GPTQ: the Hessians of each group of layer inputs (the first group's
    /// summed by the activation pass, `first`; one Hessian pass for each
    /// further group), each input's merged Gram matrix rounding the weights
    /// of every layer that reads it; returns the int8 weights by layer name
    /// and the seconds spent solving. An input whose pass covered too few
    /// batches, or whose activations could not be summed (NaN, ±∞, beyond
    /// the fixed-point range), keeps rounding to nearest (with a warning);
    /// the guard judges the result either way. With `gptq.sequential`, each
    /// pass runs the layers rounded before it with their rounding (a layer
    /// left to nearest runs at full precision there).
    fn gptq(
        &self,
        rounding: &Rounding<'_>,
        model: &Model,
        groups: &[Vec<(String, usize)>],
        first: Hessians,
        records: &mut Vec<(&'static str, RunSummary)>,
        listener: &mut dyn Listener,
    ) -> Result<(BTreeMap<String, Int8Weight>, f64)> {
        let g = &self.recipe.gptq;
        let options = GptqOptions {
            block_size: g.block_size,
            dampening: g.dampening,
            act_order: g.act_order,
        };
        let mut weights = BTreeMap::new();
        let mut solving = 0.0;
        let mut hessians = Some(first);
        // The layers the next passes run rounded, by their rounding's digest.
        let mut propagated = BTreeMap::new();
        for (i, group) in groups.iter().enumerate() {
            let hessians = match hessians.take() {
                Some(first) => first,
                None => {
                    let pass = HessianPass {
                        rounded: propagated.clone(),
                        ..hessian_pass(group, rounding.exponent)
                    };
                    let recipe = qforge_calib::Recipe {
                        pass: Pass::Hessian(pass.clone()),
                        ..rounding.first.clone()
                    };
                    let job = rounding.session.job(&recipe, rounding.transforms);
                    let position = PassPosition {
                        // The first group's pass was the activation pass.
                        index: rounding.done + i,
                        count: rounding.count,
                    };
                    let mut summary = self.run_pass(rounding.session, &job, position, listener)?;
                    let hessians = Hessians::take(&mut summary.stats, &pass, summary.coverage);
                    records.push(("hessian", summary));
                    hessians
                }
            };
            for (point, why) in &hessians.missing {
                listener.message(&format!("warning: {point} rounds to nearest: {why}"));
            }
            if hessians.coverage < self.recipe.calibration.min_coverage {
                listener.message(&format!(
                    "warning: the Hessians' pass covered {:.1} % of its batches, below calibration.min_coverage; its {} inputs round to nearest",
                    100.0 * hessians.coverage,
                    group.len()
                ));
                continue;
            }
            let started = std::time::Instant::now();
            let rounded = round_group(model, hessians.grams, &options)?;
            let seconds = started.elapsed().as_secs_f64();
            solving += seconds;
            listener.message(&format!(
                "gptq: {} layers rounded in {seconds:.2} s",
                rounded.len()
            ));
            if g.sequential {
                // Spilled: each clone shares the mapped values.
                for (name, int8) in &rounded {
                    let digest = int8.digest();
                    rounding
                        .session
                        .rounded
                        .insert(name.clone(), digest, int8.clone());
                    propagated.insert(name.clone(), digest);
                }
            }
            weights.extend(rounded);
        }
        // No later pass resumes from them or runs them: free the memory for
        // the guard.
        rounding.session.hidden_states.clear();
        rounding.session.rounded.clear();
        Ok((weights, solving))
    }

    fn run_pass(
        &self,
        session: &Session,
        job: &Job,
        position: PassPosition,
        listener: &mut dyn Listener,
    ) -> Result<RunSummary> {
        // The recipe decides what low coverage means (static scales are not
        // used below its minimum); the pass itself only has to finish.
        let options = RunOptions {
            min_coverage: 0.0,
            ..RunOptions::default()
        };
        let summary = self
            .executor
            .run_pass(session, job, position, &options, &mut |e| {
                listener.pass_event(position, &e)
            })?;
        for warning in &summary.warnings {
            listener.message(&format!("warning: {warning}"));
        }
        listener.message(&format!(
            "pass {}/{} ({}): {}/{} batches on the {} backend in {:.2} s",
            position.index,
            position.count,
            job.recipe.pass.name(),
            summary.merged,
            summary.planned,
            self.executor.name(),
            summary.seconds
        ));
        Ok(summary)
    }

    /// SmoothQuant's factors from the smoothing pass's statistics: the
    /// recipe's α, or α searched per input on the plan's first batches.
    fn smoothing(
        &self,
        session: &mut Session,
        stats: &Stats,
        listener: &mut dyn Listener,
    ) -> Result<Smoothing> {
        let model = session.load_model()?.clone();
        let chosen = match self.recipe.smoothing.alpha {
            Some(alpha) => Smoothing::fixed(&model, stats, alpha)?,
            None => {
                let wanted = self.recipe.smoothing.search_rows;
                let mut samples = Vec::new();
                let mut rows = 0;
                for sample in session.plan.batches.iter().flat_map(|b| &b.samples) {
                    if rows >= wanted {
                        break;
                    }
                    rows += match sample {
                        qforge_calib::Sample::Tokens(ids) => ids.len(),
                        qforge_calib::Sample::Observation(_) => 1,
                    };
                    samples.push(sample.clone());
                }
                let recipe = &self.recipe;
                let choice = |point: &str| match recipe.quantize.activations {
                    ActivationScheme::Static => Some(recipe.calibrator_for(point)),
                    ActivationScheme::Dynamic => None,
                };
                Smoothing::search(&model, stats, &samples, &choice)?
            }
        };
        listener.message(&format!(
            "smoothing {} layer inputs ({}); calibrating the smoothed model",
            chosen.factors.len(),
            chosen.record.describe()
        ));
        Ok(chosen)
    }

    fn report(
        &self,
        session: &Session,
        model: &Model,
        records: &[(&'static str, RunSummary)],
        decision: Decision,
    ) -> Report {
        let first = &records[0].1;
        Report {
            qforge_version: env!("CARGO_PKG_VERSION").into(),
            model: session.model_path.display().to_string(),
            kind: model.kind().into(),
            recipe: self.recipe.clone(),
            calibration: CalibrationSummary {
                backend: self.executor.name().into(),
                planned: first.planned,
                merged: first.merged,
                duplicates: first.duplicates,
                retries: first.retries,
                seconds: first.seconds,
                workers: first.workers.clone(),
                timeline: first.timeline.clone(),
                model_sha256: session.model_digest.to_hex(),
                data_sha256: session.data.digest.to_hex(),
                recipe_sha256: session.recipe.digest().to_hex(),
                passes: records
                    .iter()
                    .map(|(pass, s)| PassRecord {
                        pass: (*pass).into(),
                        merged: s.merged,
                        planned: s.planned,
                        duplicates: s.duplicates,
                        retries: s.retries,
                        seconds: s.seconds,
                    })
                    .collect(),
            },
            gptq: None,
            smoothing: None,
            method: None,
            decision,
        }
    }
}

/// What a recipe's passes leave for the guard.
struct Prepared {
    /// The full-precision model after the transforms (and GPTQ's weights).
    model: Model,
    transforms: Vec<Transform>,
    /// The activation pass's merged statistics.
    stats: Stats,
    records: Vec<(&'static str, RunSummary)>,
    gptq: Option<GptqRecord>,
    smoothing: Option<SmoothingRecord>,
}

/// What the guard judges a prepared model against.
struct Judged<'a> {
    /// The original model on the held-out data.
    reference: &'a Reference<'a>,
    /// The method search's measurements of the prepared model's plan.
    probed: Option<Probed>,
    /// What the held-out data are, for the report.
    held_description: String,
}

/// What GPTQ's passes share with the calibration passes before them.
struct Rounding<'a> {
    session: &'a Session,
    transforms: &'a [Transform],
    /// The recipe of the first pass (the plan's sampling).
    first: &'a qforge_calib::Recipe,
    /// The Gram matrices' fixed-point exponent.
    exponent: i32,
    /// Passes run before the Hessian passes.
    done: usize,
    /// Passes of the pipeline.
    count: usize,
}

/// One group's merged Hessians, taken out of its pass's statistics.
struct Hessians {
    /// Layer input → its Gram matrix.
    grams: BTreeMap<String, Gram>,
    /// Inputs of the group without one, with the reason.
    missing: Vec<(String, String)>,
    /// The fraction of the plan's batches the pass merged.
    coverage: f64,
}

impl Hessians {
    /// Moves the Gram matrices of `pass`'s inputs out of `stats` (the merged
    /// statistics of a pass that covered `coverage` of its batches), so that
    /// statistics kept for the guard and the artifact do not carry them.
    fn take(stats: &mut Stats, pass: &HessianPass, coverage: f64) -> Self {
        let mut grams = BTreeMap::new();
        let mut missing = Vec::new();
        for point in pass.points.keys() {
            match stats.tensors.get_mut(point) {
                Some(tensor) => match tensor.take_gram() {
                    Some(gram) => {
                        grams.insert(point.clone(), gram);
                    }
                    None => missing.push((point.clone(), unsummed(tensor))),
                },
                None => missing.push((point.clone(), "the pass never saw it".into())),
            }
        }
        Self {
            grams,
            missing,
            coverage,
        }
    }
}

/// Why an input's statistics hold no Gram matrix, from the histogram of the
/// values that dropped it.
fn unsummed(tensor: &TensorStats) -> String {
    let h = tensor.histogram();
    if h.nan() + h.pos_inf() + h.neg_inf() > 0 {
        return "its activations include NaN or infinite values".into();
    }
    match h.abs_max() {
        Some(max) => format!(
            "its activations reach {max:e}, beyond the Hessian's fixed-point range (values up to {:e} are summed exactly)",
            qforge_core::gram::ACTIVATION_BOUND
        ),
        None => "it saw no finite activation".into(),
    }
}

/// The Hessian pass over `group`'s inputs, at `exponent`.
fn hessian_pass(group: &[(String, usize)], exponent: i32) -> HessianPass {
    HessianPass {
        points: group
            .iter()
            .map(|(point, _)| (point.clone(), exponent))
            .collect(),
        rounded: BTreeMap::new(),
    }
}

/// The model's linear inputs (observation point, width) in forward order.
fn layer_inputs(model: &Model) -> Vec<(String, usize)> {
    let mut inputs: Vec<(String, usize)> = Vec::new();
    for (_, point, layer) in model.linears() {
        if !inputs.iter().any(|(p, _)| *p == point) {
            inputs.push((point, layer.shape().1));
        }
    }
    inputs
}

/// The model's linear inputs (observation point, width) in forward order,
/// cut into groups whose exact Hessians (16 bytes per entry of each upper
/// triangle) fit in `budget` bytes; an input larger than the budget is a
/// group of its own.
pub fn hessian_groups(model: &Model, budget: u64) -> Vec<Vec<(String, usize)>> {
    let inputs = layer_inputs(model);
    let bytes = |width: usize| 16 * (width * (width + 1) / 2) as u64;
    let mut groups: Vec<Vec<(String, usize)>> = Vec::new();
    let mut used = 0;
    for (point, width) in inputs {
        let size = bytes(width);
        match groups.last_mut() {
            Some(group) if used + size <= budget => group.push((point, width)),
            _ => {
                groups.push(vec![(point, width)]);
                used = 0;
            }
        }
        used += size;
    }
    groups
}

/// GPTQ's int8 weights for every layer of `model` that reads an input of
/// `grams`, from its merged Hessian, spilled to files in the temporary
/// directory ([`Int8Weight::spill`]); layers run in parallel. Each Gram
/// matrix is consumed on the way: at Llama-3-8B's `down_proj` (14 336 wide)
/// each copy of it is 1.64 GB.
fn round_group(
    model: &Model,
    grams: BTreeMap<String, Gram>,
    options: &GptqOptions,
) -> Result<BTreeMap<String, Int8Weight>> {
    // Every input's solve is its own, so inputs run side by side on the
    // rayon pool (as do the blocks of one factorization, the layers of one
    // input and the rows of one layer), and the result does not depend on
    // the thread count.
    let linears = model.linears();
    let spill_dir = std::env::temp_dir();
    let rounded = grams
        .into_par_iter()
        .map(|(point, gram)| {
            let width = gram.width();
            let solver = Gptq::new(gram.into_matrix(), width, options)
                .map_err(|e| Error::Gptq(format!("{point}: {e}")))?;
            linears
                .par_iter()
                .filter(|(_, p, _)| *p == point)
                .map(|(name, _, layer)| {
                    let (weight, _) = layer.full_precision()?;
                    let values = weight.flatten_all().map_err(qforge_model::Error::from)?;
                    let values = values.to_vec1::<f32>().map_err(qforge_model::Error::from)?;
                    let int8 = solver
                        .round(&values, layer.shape().0)
                        .map_err(|e| Error::Gptq(format!("{name}: {e}")))?;
                    Ok((name.clone(), int8.spill(&spill_dir)?))
                })
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(rounded.into_iter().flatten().collect())
}

impl Quantized {
    /// Whether the guard accepted the quantized model.
    pub fn accepted(&self) -> bool {
        self.report.decision.accepted
    }

    /// Writes `report.json` and `report.html` into the directory `dir`, and,
    /// when the guard accepted, the native artifact: weights, `qforge.json`,
    /// the transforms the weights went through (`transforms.json`), the
    /// calibration profile the server's drift monitor compares against,
    /// and `manifest.json` (provenance, coverage, guard; every file hashed).
    /// Returns the manifest's information (`Value::Null` when refused), for
    /// a caller that adds to it and rewrites the manifest.
    pub fn write(&self, dir: &Path) -> Result<Value> {
        let report_error = |what: &str, e: std::io::Error| Error::Report(format!("{what}: {e}"));
        std::fs::write(dir.join("report.json"), self.report.to_json())
            .map_err(|e| report_error("cannot write report.json", e))?;
        std::fs::write(dir.join("report.html"), self.report.to_html()?)
            .map_err(|e| report_error("cannot write report.html", e))?;
        let d = &self.report.decision;
        if !d.accepted {
            return Ok(Value::Null);
        }
        match &self.model {
            Model::Policy(p) => write_policy(dir, p, &d.points)?,
            // Transforms are folded into the written weights and norms.
            Model::Language(lm) => write_language_model(dir, lm, &d.points)?,
        }
        // And recorded, for new weights to go through the same ones.
        write_transforms(dir, &self.transforms)?;
        CalibrationProfile::from_stats(&self.stats.tensors).write(dir)?;
        check_numbers(dir)?; // what every reader refuses is not written either
        let info = self.manifest_info();
        write_manifest(dir, info.clone())?;
        Ok(info)
    }

    /// Writes the report into `output` (replaced atomically; an existing
    /// one must be an earlier qforge output) and, when the guard accepted,
    /// the artifact. With `returns`, the written policy artifact's return
    /// is checked too and recorded in its manifest (the check's JSON is
    /// returned); below its least consistency nothing is written.
    pub fn write_to(&self, output: &Path, returns: Option<&ReturnCheck>) -> Result<Option<Value>> {
        let mut checked = None;
        write_dir_atomic(output, |dir| -> Result<()> {
            let mut info = self.write(dir)?;
            if let Some(check) = returns.filter(|_| self.accepted()) {
                // The check serves the written artifact, whose manifest
                // names the FP source; the manifest then records the result.
                let result = check.run(dir)?;
                info["guard"]["return"] = result.clone();
                write_manifest(dir, info)?;
                checked = Some(result);
            }
            Ok(())
        })?;
        Ok(checked)
    }

    /// A refusal when the guard refused, naming where the report is.
    pub fn refusal(&self, output: &Path) -> Option<Error> {
        let d = &self.report.decision;
        (!d.accepted).then(|| {
            Error::Refused(format!(
                "{} No artifact written; the report is in {}",
                d.refusal.as_deref().unwrap_or("the guard refused"),
                output.join("report.html").display()
            ))
        })
    }

    /// What `manifest.json` records besides the file hashes.
    fn manifest_info(&self) -> Value {
        let session = &self.session;
        let d = &self.report.decision;
        let smoothed = (!self.transforms.is_empty()).then(|| {
            qforge_calib::transformed_digest(session.model_digest, &self.transforms).to_hex()
        });
        json!({
            "kind": "native",
            "source_model": {
                "path": std::fs::canonicalize(&session.model_path)
                    .unwrap_or(session.model_path.clone())
                    .display()
                    .to_string(),
                "sha256": session.model_digest.to_hex(),
            },
            "data_sha256": session.data.digest.to_hex(),
            "calibration_recipe_sha256": session.recipe.digest().to_hex(),
            "recipe": self.report.recipe,
            "smoothed_model_sha256": smoothed,
            "coverage": d.coverage,
            "guard": {
                "held_out": self.held_out,
                "reference": d.reference,
                "before": d.before,
                "after": d.after,
                "fp_layers": d.fp_layers,
                "total_layers": d.total_layers,
            },
        })
    }
}
