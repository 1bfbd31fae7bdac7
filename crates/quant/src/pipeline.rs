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

use qforge_calib::{Job, Pass, Session, Transform};
use qforge_core::Stats;
use qforge_dist::{Executor, PassEvent, PassPosition, RunOptions, RunSummary};
use qforge_model::Model;
use qforge_model::artifact::{write_language_model, write_policy};
use qforge_model::manifest::write_manifest;
use qforge_model::profile::CalibrationProfile;
use serde_json::{Value, json};

use crate::error::{Error, Result};
use crate::guard::{Decision, FpModel, quantize};
use crate::held_out::held_out;
use crate::recipe::QuantRecipe;
use crate::report::{CalibrationSummary, PassRecord, Report};
use crate::smoothing::smoothing_factors;

/// What the pipeline reports while it runs. Every method has a default that
/// ignores the event, so `()` listens to nothing.
pub trait Listener {
    /// A line of progress for a person.
    fn message(&mut self, _line: &str) {}
    /// An event of calibration pass `pass`.
    fn pass_event(&mut self, _pass: PassPosition, _event: &PassEvent) {}
}

impl Listener for () {}

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

    /// The calibration passes of the recipe, in order.
    pub fn passes(&self) -> Vec<Pass> {
        if self.recipe.smoothing.enabled {
            vec![Pass::Smoothing, Pass::Activation]
        } else {
            vec![Pass::Activation]
        }
    }

    /// Runs every pass, then the guard. A refused decision is a result
    /// (`report.decision.accepted` is false), not an error.
    pub fn run(&self, inputs: &Inputs, listener: &mut dyn Listener) -> Result<Quantized> {
        let passes = self.passes();
        let rotation = &self.recipe.rotation.inputs;
        if let Some(why) = self.recipe.needs_language_model()
            && qforge_model::Format::is_policy(&inputs.model)?
        {
            return Err(Error::Recipe(why.into()));
        }
        let first = qforge_calib::Recipe {
            pass: passes[0],
            ..self.recipe.calibration_recipe()
        };
        let mut session = Session::open(
            &inputs.model,
            &inputs.data,
            &first,
            inputs.skip_invalid,
            self.executor.weights(),
        )?;
        if session.plan.samples < first.samples {
            listener.message(&format!(
                "warning: the data holds {} samples, fewer than the {} asked for; calibrating on all of them",
                session.plan.samples, first.samples
            ));
        }
        let mut transforms = Vec::new();
        let mut summaries = Vec::new();
        for (i, &pass) in passes.iter().enumerate() {
            let position = PassPosition {
                index: i + 1,
                count: passes.len(),
            };
            let recipe = qforge_calib::Recipe {
                pass,
                ..first.clone()
            };
            // The smoothing pass measures the unrotated model (a rotated
            // input is not smoothable); the rotation comes after smoothing,
            // before the pass that chooses the scales.
            if !rotation.is_empty() && pass == Pass::Activation {
                transforms.push(Transform::Rotate {
                    inputs: rotation.clone(),
                });
            }
            let job = session.job(&recipe, &transforms);
            let summary = self.run_pass(&session, &job, position, listener)?;
            if pass == Pass::Smoothing {
                let alpha = self.recipe.smoothing.alpha;
                let factors = self.smoothing_factors(&mut session, &summary.stats)?;
                listener.message(&format!(
                    "smoothing {} layer inputs (alpha {alpha}); calibrating the smoothed model",
                    factors.len(),
                ));
                transforms.push(Transform::Smooth { alpha, factors });
            }
            summaries.push(summary);
        }
        let original = session.load_model()?.clone();
        let model = session.target(&transforms)?;
        let last = summaries.last().expect("a recipe has at least one pass");
        let (held, held_description) = held_out(
            &session,
            &original,
            inputs.eval_data.as_deref(),
            self.recipe.guard.ctx,
        )?;
        listener.message(&format!("guard data: {held_description}"));
        let decision = quantize(
            fp_model(&model),
            fp_model(&original),
            &last.stats,
            &held,
            &self.recipe,
            &mut |line| listener.message(line),
        )?;
        let report = self.report(&session, &original, &summaries, decision);
        let stats = summaries
            .pop()
            .expect("a recipe has at least one pass")
            .stats;
        Ok(Quantized {
            session,
            model,
            transforms,
            stats,
            report,
            held_out: held_description,
        })
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

    /// SmoothQuant's factors from the smoothing pass's statistics.
    fn smoothing_factors(
        &self,
        session: &mut Session,
        stats: &Stats,
    ) -> Result<BTreeMap<String, Vec<f32>>> {
        let Model::Language(lm) = session.load_model()? else {
            return Err(Error::Recipe(
                "SmoothQuant folds its factors into RMSNorm weights: a policy has none".into(),
            ));
        };
        smoothing_factors(&lm.model, stats, self.recipe.smoothing.alpha)
    }

    fn report(
        &self,
        session: &Session,
        model: &Model,
        summaries: &[RunSummary],
        decision: Decision,
    ) -> Report {
        let first = &summaries[0];
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
                passes: summaries
                    .iter()
                    .zip(self.passes())
                    .map(|(s, pass)| PassRecord {
                        pass: pass.name().into(),
                        merged: s.merged,
                        planned: s.planned,
                        duplicates: s.duplicates,
                        retries: s.retries,
                        seconds: s.seconds,
                    })
                    .collect(),
            },
            decision,
        }
    }
}

fn fp_model(model: &Model) -> FpModel<'_> {
    match model {
        Model::Policy(p) => FpModel::Policy(p),
        Model::Language(lm) => FpModel::Language(&lm.model),
    }
}

impl Quantized {
    /// Whether the guard accepted the quantized model.
    pub fn accepted(&self) -> bool {
        self.report.decision.accepted
    }

    /// Writes `report.json` and `report.html` into the directory `dir`, and,
    /// when the guard accepted, the native artifact: weights, `qforge.json`,
    /// the calibration profile the server's drift monitor compares against,
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
        CalibrationProfile::from_stats(&self.stats.tensors).write(dir)?;
        let info = self.manifest_info();
        write_manifest(dir, info.clone())?;
        Ok(info)
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
