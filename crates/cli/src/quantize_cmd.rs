//! `qforge quantize`: calibrate → recipe → guard → native artifact, with
//! `report.json`, `report.html` and `manifest.json`, written atomically.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use qforge_calib::{Pass, Record, Sample, Target};
use qforge_core::DigestBuilder;
use qforge_model::LanguageModel;
use qforge_model::artifact::{write_language_model, write_policy};
use qforge_model::manifest::write_manifest;
use qforge_model::profile::CalibrationProfile;
use qforge_quant::pipeline::describe;
use qforge_quant::recipe::{ActivationScheme, CalibratorChoice, LmHead};
use qforge_quant::smoothing::smoothing_factors;
use qforge_quant::{
    CalibrationSummary, DeliveryEntry, FpModel, HeldOut, QuantRecipe, Report, WorkerSummary,
    quantize,
};
use serde_json::json;

use crate::calibrate_cmd::{
    BackendArgs, Calibrated, Calibration, StratifyArg, episode_tokens, run_calibration,
    transformed_pass,
};
use crate::model_cmd::{AnyModel, load_model};
use crate::output::write_dir_atomic;
use crate::{GuardRefusal, OutputFlags, UsageError};

/// The policy `qforge quantize` uses when given no model, relative to the
/// repository root.
const BUNDLED_MODEL: &str = "fixtures/policies/cartpole";
/// Its rollouts.
const BUNDLED_DATA: &str = "fixtures/policies/cartpole/rollouts.jsonl";

const SMOOTHING_NEEDS_NORMS: &str = "SmoothQuant folds its factors into RMSNorm weights: it applies to language models, not policies";

/// `--activations`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ActivationsArg {
    /// One calibrated scale per layer input.
    Static,
    /// A scale per token at run time.
    Dynamic,
}

/// Arguments of `qforge quantize`.
#[derive(Args)]
pub struct QuantizeArgs {
    /// Model: GGUF file, Hugging Face directory or policy directory
    /// (default: the bundled CartPole policy).
    #[arg(long, value_name = "PATH", requires = "data")]
    model: Option<PathBuf>,
    /// Calibration data, JSONL (default: the bundled CartPole rollouts).
    #[arg(long, value_name = "FILE.jsonl", requires = "model")]
    data: Option<PathBuf>,
    /// Recipe file (TOML; see recipes/w8a8.toml). Flags override its fields.
    #[arg(long, value_name = "FILE.toml")]
    recipe: Option<PathBuf>,
    /// Held-out data for the guard: trajectories JSONL (policies) or a UTF-8
    /// text file (language models). Default: the samples of --data that
    /// calibration did not draw.
    #[arg(long, value_name = "FILE")]
    eval_data: Option<PathBuf>,
    /// Where to write the artifact and the report (replaced atomically;
    /// an existing directory must be an earlier qforge output).
    #[arg(
        short = 'o',
        long = "output",
        value_name = "DIR",
        default_value = "qforge-out"
    )]
    output: PathBuf,
    #[command(flatten)]
    backend: BackendArgs,
    /// Count and skip invalid data lines instead of failing.
    #[arg(long)]
    skip_invalid: bool,
    /// Also check the return in this gymnasium environment (policies): the
    /// artifact and its FP source are served and driven over /v1/act by
    /// scripts/eval-return; below --min-return-consistency nothing is written
    /// and qforge exits with 3.
    #[arg(long, value_name = "ENV")]
    env: Option<String>,
    /// Episodes of the return check.
    #[arg(long, default_value_t = 20, requires = "env")]
    env_episodes: usize,
    /// Least return consistency, 1 − |int8 − fp| / |fp − random|.
    #[arg(long, default_value_t = 0.95, requires = "env")]
    min_return_consistency: f64,

    /// [calibration] samples to draw.
    #[arg(long, help_heading = "Recipe overrides")]
    samples: Option<usize>,
    /// [calibration] most tokens per sequence.
    #[arg(long, help_heading = "Recipe overrides")]
    seq_len: Option<usize>,
    /// [calibration] samples per batch.
    #[arg(long, help_heading = "Recipe overrides")]
    batch_size: Option<usize>,
    /// [calibration] seed of the sampling.
    #[arg(long, help_heading = "Recipe overrides")]
    seed: Option<u64>,
    /// [calibration] how samples are drawn.
    #[arg(long, value_enum, help_heading = "Recipe overrides")]
    stratify: Option<StratifyArg>,
    /// [calibration] least coverage for static scales.
    #[arg(long, help_heading = "Recipe overrides")]
    min_coverage: Option<f64>,
    /// [quantize] activation scheme.
    #[arg(long, value_enum, help_heading = "Recipe overrides")]
    activations: Option<ActivationsArg>,
    /// [quantize] calibrator of static scales (minmax, percentile(P),
    /// entropy, mse, sigma(K)).
    #[arg(long, help_heading = "Recipe overrides")]
    calibrator: Option<String>,
    /// [quantize] keep this layer input in full precision (repeatable;
    /// matches the name or its last components, e.g. layers.0).
    #[arg(long, value_name = "POINT", help_heading = "Recipe overrides")]
    ignore: Vec<String>,
    /// [quantize] keep a language model's lm_head in full precision.
    #[arg(long, help_heading = "Recipe overrides")]
    fp_lm_head: bool,
    /// [smoothing] run SmoothQuant (language models, embedded backend).
    #[arg(long, help_heading = "Recipe overrides")]
    smoothquant: bool,
    /// [smoothing] migration strength α in [0, 1].
    #[arg(long, help_heading = "Recipe overrides")]
    alpha: Option<f64>,
    /// [guard] largest relative perplexity increase (0.03 = +3 %).
    #[arg(long, help_heading = "Recipe overrides")]
    max_perplexity_increase: Option<f64>,
    /// [guard] smallest action agreement with the FP policy.
    #[arg(long, help_heading = "Recipe overrides")]
    min_agreement: Option<f64>,
    /// [guard] largest share of linear layers left in FP.
    #[arg(long, help_heading = "Recipe overrides")]
    max_fp_fraction: Option<f64>,
    /// [guard] tokens per perplexity chunk.
    #[arg(long, help_heading = "Recipe overrides")]
    ctx: Option<usize>,
    #[command(flatten)]
    flags: OutputFlags,
}

impl QuantizeArgs {
    /// The recipe file (or the defaults) with the flags applied.
    fn recipe(&self) -> Result<QuantRecipe> {
        let mut recipe = match &self.recipe {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("cannot read {}", path.display()))?;
                QuantRecipe::from_toml(&text)
                    .map_err(|e| UsageError(format!("{}: {e}", path.display())))?
            }
            None => QuantRecipe::default(),
        };
        let c = &mut recipe.calibration;
        c.samples = self.samples.unwrap_or(c.samples);
        c.seq_len = self.seq_len.unwrap_or(c.seq_len);
        c.batch_size = self.batch_size.unwrap_or(c.batch_size);
        c.seed = self.seed.unwrap_or(c.seed);
        c.min_coverage = self.min_coverage.unwrap_or(c.min_coverage);
        if let Some(s) = self.stratify {
            c.stratify = match s {
                StratifyArg::None => qforge_calib::Stratify::None,
                StratifyArg::Reward => qforge_calib::Stratify::Reward,
            };
        }
        let q = &mut recipe.quantize;
        if let Some(a) = self.activations {
            q.activations = match a {
                ActivationsArg::Static => ActivationScheme::Static,
                ActivationsArg::Dynamic => ActivationScheme::Dynamic,
            };
        }
        if let Some(c) = &self.calibrator {
            q.calibrator = CalibratorChoice::try_from(c.clone())
                .map_err(|e| UsageError(format!("--calibrator: {e}")))?;
        }
        q.ignore.extend(self.ignore.iter().cloned());
        if self.fp_lm_head {
            q.lm_head = LmHead::Fp;
        }
        recipe.smoothing.enabled |= self.smoothquant;
        recipe.smoothing.alpha = self.alpha.unwrap_or(recipe.smoothing.alpha);
        let g = &mut recipe.guard;
        g.max_perplexity_increase = self
            .max_perplexity_increase
            .unwrap_or(g.max_perplexity_increase);
        g.min_agreement = self.min_agreement.unwrap_or(g.min_agreement);
        g.max_fp_fraction = self.max_fp_fraction.unwrap_or(g.max_fp_fraction);
        g.ctx = self.ctx.unwrap_or(g.ctx);
        recipe.validate().map_err(|e| UsageError(e.to_string()))?;
        Ok(recipe)
    }
}

/// The bundled default: found beside the working directory (a checkout) or
/// in the source tree this binary was built from.
fn bundled(relative: &str) -> Result<PathBuf> {
    let candidates = [
        PathBuf::from(relative),
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(relative),
    ];
    candidates
        .into_iter()
        .find(|p| p.exists())
        .map(|p| std::fs::canonicalize(&p).unwrap_or(p))
        .with_context(|| {
            format!(
                "the bundled default {relative} is not here (run from a qforge checkout), or pass --model and --data"
            )
        })
}

/// Held-out data: --eval-data, or what calibration did not draw.
fn held_out(
    args: &QuantizeArgs,
    model: &AnyModel,
    calibrated: &Calibrated,
    ctx: usize,
) -> Result<(HeldOut, String)> {
    match (model, &args.eval_data) {
        (AnyModel::Policy(policy), eval) => {
            let dim = policy.config().observation_dim;
            let (records, drawn, source) = match eval {
                Some(path) => (
                    qforge_calib::load_jsonl(path, false)?.records,
                    HashSet::new(),
                    path.display().to_string(),
                ),
                None => {
                    let drawn: HashSet<Vec<u32>> = calibrated
                        .loaded
                        .plan
                        .samples()
                        .filter_map(|s| match s {
                            Sample::Observation(o) => Some(o.iter().map(|v| v.to_bits()).collect()),
                            Sample::Tokens(_) => None,
                        })
                        .collect();
                    (
                        calibrated.loaded.data.records.clone(),
                        drawn,
                        "observations of --data not drawn for calibration".to_owned(),
                    )
                }
            };
            let mut observations = Vec::new();
            for record in &records {
                let Record::Trajectory {
                    observations: rows, ..
                } = record
                else {
                    bail!("the held-out data holds LLM episodes; a policy needs trajectories");
                };
                for row in rows {
                    if row.len() != dim {
                        bail!(
                            "a held-out observation has {} values; the policy takes {dim}",
                            row.len()
                        );
                    }
                    let bits: Vec<u32> = row.iter().map(|v| v.to_bits()).collect();
                    if !drawn.contains(&bits) {
                        observations.extend_from_slice(row);
                    }
                }
            }
            if observations.is_empty() {
                bail!(
                    "no held-out observations: calibration drew all of them; lower --samples or pass --eval-data FILE"
                );
            }
            let rows = observations.len() / dim;
            Ok((
                HeldOut::Observations(observations),
                format!("{rows} {source}"),
            ))
        }
        (AnyModel::Language(lm), Some(path)) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read {} as UTF-8 text", path.display()))?;
            let tokens = lm.text.tokenizer.encode(&text)?;
            if tokens.len() < ctx {
                bail!(
                    "{} has {} tokens; the guard needs at least --ctx ({ctx})",
                    path.display(),
                    tokens.len()
                );
            }
            let n = tokens.len();
            Ok((
                HeldOut::Tokens(tokens),
                format!("{n} tokens of {}", path.display()),
            ))
        }
        (AnyModel::Language(lm), None) => {
            let drawn: HashSet<&[u32]> = calibrated
                .loaded
                .plan
                .samples()
                .filter_map(|s| match s {
                    Sample::Tokens(t) => Some(&t[..]),
                    Sample::Observation(_) => None,
                })
                .collect();
            let mut tokens = Vec::new();
            let mut episodes = 0;
            for record in &calibrated.loaded.data.records {
                if let Record::Episode { content, .. } = record {
                    let ids = episode_tokens(&lm.text, content)?;
                    let truncated = &ids[..ids.len().min(calibrated.loaded.job.recipe.seq_len)];
                    if !ids.is_empty() && !drawn.contains(truncated) {
                        tokens.extend_from_slice(&ids);
                        episodes += 1;
                    }
                }
            }
            if tokens.len() < ctx {
                bail!(
                    "only {} held-out tokens ({episodes} episodes not drawn for calibration); the guard needs at least --ctx ({ctx}): pass --eval-data TEXT or lower --samples",
                    tokens.len()
                );
            }
            let n = tokens.len();
            Ok((
                HeldOut::Tokens(tokens),
                format!("{n} tokens of {episodes} episodes not drawn for calibration"),
            ))
        }
    }
}

/// Runs scripts/eval-return on the artifact in `dir` and returns its JSON.
fn return_check(dir: &Path, env: &str, episodes: usize) -> Result<serde_json::Value> {
    let script = bundled("scripts/eval-return")?;
    let output = std::process::Command::new(&script)
        .arg(env)
        .arg(dir)
        .arg("--episodes")
        .arg(episodes.to_string())
        .env(
            "QFORGE",
            std::env::current_exe().context("cannot locate this qforge")?,
        )
        .output()
        .with_context(|| format!("cannot run {}", script.display()))?;
    if !output.status.success() {
        bail!(
            "the return check failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    serde_json::from_slice(&output.stdout).context("the return check printed no JSON")
}

/// `qforge quantize`.
pub fn quantize_command(args: QuantizeArgs) -> Result<()> {
    let recipe = args.recipe()?;
    let (model_path, data_path) = match (&args.model, &args.data) {
        (Some(m), Some(d)) => (m.clone(), d.clone()),
        _ => (bundled(BUNDLED_MODEL)?, bundled(BUNDLED_DATA)?),
    };
    let quiet = args.flags.json;
    let say = |line: &str| {
        if !quiet {
            eprintln!("{line}");
        }
    };
    say(&format!(
        "calibrating {} on {}",
        model_path.display(),
        data_path.display()
    ));
    if args.env.is_some() && !model_path.join("policy.json").exists() {
        return Err(UsageError(
            "--env checks the return of a policy; language models are guarded by perplexity".into(),
        )
        .into());
    }
    let mut calibration_recipe = recipe.calibration_recipe();
    if recipe.smoothing.enabled {
        if args.backend.cluster.is_some() {
            return Err(UsageError(
                "SmoothQuant's second pass runs on the embedded backend; drop --cluster or the smoothing"
                    .into(),
            )
            .into());
        }
        if model_path.join("policy.json").exists() {
            return Err(UsageError(SMOOTHING_NEEDS_NORMS.into()).into());
        }
        // The first pass also records each input channel's abs-max.
        calibration_recipe.pass = Pass::Smoothing;
    }
    let calibrated = run_calibration(&Calibration {
        model: &model_path,
        data: &data_path,
        recipe: &calibration_recipe,
        skip_invalid: args.skip_invalid,
        workers: args.backend.workers,
        cluster: args.backend.cluster.as_deref(),
        settings: &args.backend.settings,
        checkpoint_dir: None,
        checkpoint_every: 50,
        run: None,
        resume: None,
        // The recipe decides what low coverage means; the pass itself only
        // has to finish.
        min_coverage: 0.0,
        quiet,
    })?;
    let summary = &calibrated.summary;
    say(&format!(
        "calibrated: {}/{} batches on {} {} workers in {:.2} s",
        summary.merged, summary.planned, calibrated.workers, calibrated.backend, summary.seconds
    ));
    // A cluster coordinator did not load the weights.
    let model = match &calibrated.loaded.model {
        Some(_) => None,
        None => Some(load_model(&model_path)?),
    };
    let model = model
        .as_ref()
        .or(calibrated.loaded.model.as_ref())
        .expect("loaded above");
    let (held, held_description) = held_out(&args, model, &calibrated, recipe.guard.ctx)?;
    say(&format!("guard data: {held_description}"));
    let smoothed = match (recipe.smoothing.enabled, model) {
        (false, _) => None,
        (true, AnyModel::Policy(_)) => return Err(UsageError(SMOOTHING_NEEDS_NORMS.into()).into()),
        (true, AnyModel::Language(lm)) => {
            let alpha = recipe.smoothing.alpha;
            let factors = smoothing_factors(&lm.model, &summary.stats, alpha)?;
            let smoothed = lm.model.smoothed(&factors)?;
            // The smoothed model is named by the original and its factors.
            let mut digest = DigestBuilder::default();
            digest.update(&calibrated.loaded.job.model.0);
            digest.update(format!("qforge.smoothquant.v1 alpha={alpha}").as_bytes());
            for (point, s) in &factors {
                digest.update(point.as_bytes());
                for v in s {
                    digest.update(&v.to_le_bytes());
                }
            }
            let digest = digest.finish();
            say(&format!(
                "smoothing {} layer inputs (alpha {alpha}); calibrating the smoothed model",
                factors.len()
            ));
            let second = transformed_pass(
                &calibrated.loaded,
                Target::Language(smoothed.clone()),
                digest,
                &recipe.calibration_recipe(),
                args.backend.workers,
                quiet,
            )?;
            Some((smoothed, digest, second))
        }
    };
    let (fp, stats) = match (model, &smoothed) {
        (AnyModel::Language(_), Some((smoothed, _, second))) => {
            (FpModel::Language(smoothed), &second.stats)
        }
        (AnyModel::Language(lm), None) => (FpModel::Language(&lm.model), &summary.stats),
        (AnyModel::Policy(p), _) => (FpModel::Policy(p), &summary.stats),
    };
    let reference = match model {
        AnyModel::Policy(p) => FpModel::Policy(p),
        AnyModel::Language(lm) => FpModel::Language(&lm.model),
    };
    let decision = quantize(fp, reference, stats, &held, &recipe, &mut |line| say(line))?;

    let job = &calibrated.loaded.job;
    let report = Report {
        qforge_version: env!("CARGO_PKG_VERSION").into(),
        model: model_path.display().to_string(),
        kind: match model {
            AnyModel::Policy(_) => "policy".into(),
            AnyModel::Language(_) => "language-model".into(),
        },
        recipe: recipe.clone(),
        calibration: CalibrationSummary {
            backend: calibrated.backend.into(),
            planned: summary.planned,
            merged: summary.merged,
            duplicates: summary.duplicates,
            retries: summary.retries,
            seconds: summary.seconds,
            workers: summary
                .workers
                .iter()
                .map(|(name, w)| WorkerSummary {
                    name: name.clone(),
                    merged: w.merged,
                    duplicates: w.duplicates,
                    failures: w.failures,
                    busy_seconds: w.busy_seconds,
                })
                .collect(),
            timeline: summary
                .timeline
                .iter()
                .map(|d| DeliveryEntry {
                    worker: d.worker.clone(),
                    batch: d.batch,
                    at_seconds: d.at_seconds,
                    busy_seconds: d.busy_seconds,
                    merged: d.merged,
                })
                .collect(),
            model_sha256: job.model.to_hex(),
            data_sha256: job.data.to_hex(),
            recipe_sha256: job.recipe.digest().to_hex(),
        },
        decision,
    };
    let html = report.to_html()?;
    let d = &report.decision;
    write_dir_atomic(&args.output, |dir| {
        std::fs::write(dir.join("report.json"), report.to_json())
            .context("cannot write report.json")?;
        std::fs::write(dir.join("report.html"), &html).context("cannot write report.html")?;
        if !d.accepted {
            return Ok(());
        }
        match (model, &smoothed) {
            (AnyModel::Policy(p), _) => write_policy(dir, p, &d.points)?,
            (AnyModel::Language(lm), None) => write_language_model(dir, lm, &d.points)?,
            (AnyModel::Language(lm), Some((smoothed, _, _))) => {
                // The factors are folded into the written weights and norms.
                let smoothed_lm = LanguageModel {
                    model: smoothed.clone(),
                    text: lm.text.clone(),
                    source: lm.source.clone(),
                };
                write_language_model(dir, &smoothed_lm, &d.points)?
            }
        }
        // What the served model's inputs looked like in calibration, for
        // `qforge serve`'s drift monitor.
        CalibrationProfile::from_stats(&stats.tensors).write(dir)?;
        let mut info = json!({
                "kind": "native",
                "source_model": {
                    "path": std::fs::canonicalize(&model_path)
                        .unwrap_or(model_path.clone())
                        .display()
                        .to_string(),
                    "sha256": job.model.to_hex(),
                },
                "data_sha256": job.data.to_hex(),
                "calibration_recipe_sha256": job.recipe.digest().to_hex(),
                "recipe": recipe,
                "smoothed_model_sha256": smoothed.as_ref().map(|(_, digest, _)| digest.to_hex()),
                "coverage": d.coverage,
                "guard": {
                    "held_out": held_description,
                    "reference": d.reference,
                    "before": d.before,
                    "after": d.after,
                    "fp_layers": d.fp_layers,
                    "total_layers": d.total_layers,
                },
        });
        write_manifest(dir, info.clone())?;
        if let Some(env) = &args.env {
            // The return check needs the written artifact (and its manifest,
            // which names the FP source); the manifest is then rewritten
            // with the result.
            let result = return_check(dir, env, args.env_episodes)?;
            let consistency = result["consistency"].as_f64().unwrap_or(f64::NAN);
            say(&format!("guard: return in {env}: {result}"));
            info["guard"]["return"] = result;
            if consistency.is_nan() || consistency < args.min_return_consistency {
                return Err(GuardRefusal(format!(
                    "return consistency {consistency:.4} in {env} is below {}; no artifact written",
                    args.min_return_consistency
                ))
                .into());
            }
            write_manifest(dir, info)?;
        }
        Ok(())
    })?;

    let out = args.output.display().to_string();
    if args.flags.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "output": out,
                "accepted": d.accepted,
                "artifact": d.accepted,
                "refusal": d.refusal,
                "report_json": format!("{out}/report.json"),
                "report_html": format!("{out}/report.html"),
                "held_out": held_description,
                "reference": d.reference,
                "before": d.before,
                "after": d.after,
                "fp_layers": d.fp_layers,
                "total_layers": d.total_layers,
                "fallback_steps": d.applied_steps,
                "guard_evaluations": d.evaluations.len(),
                "coverage": d.coverage,
                "warnings": d.warnings,
            }))?
        );
    }
    for warning in &d.warnings {
        eprintln!("warning: {warning}");
    }
    if !d.accepted {
        return Err(GuardRefusal(format!(
            "{} No artifact written; the report is in {out}/report.html",
            d.refusal.as_deref().unwrap_or("the guard refused")
        ))
        .into());
    }
    if !args.flags.json {
        println!(
            "quantized {}: {}; {} of {} linear layers in FP",
            model_path.display(),
            describe(&d.after),
            d.fp_layers,
            d.total_layers
        );
        println!("artifact: {out}/  (load it with --model {out})");
        println!("report:   {out}/report.html");
    }
    Ok(())
}

/// Arguments of `qforge verify`.
#[derive(Args)]
pub struct VerifyArgs {
    /// A directory qforge wrote (artifact or export) with its manifest.json.
    #[arg(value_name = "DIR")]
    dir: PathBuf,
    #[command(flatten)]
    flags: OutputFlags,
}

/// `qforge verify`: re-hash every file the manifest lists.
pub fn verify_command(args: VerifyArgs) -> Result<()> {
    let manifest = qforge_model::manifest::verify(&args.dir)?;
    let bytes: u64 = manifest.files.values().map(|f| f.bytes).sum();
    if args.flags.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "dir": args.dir.display().to_string(),
                "ok": true,
                "files": manifest.files.len(),
                "bytes": bytes,
                "qforge_version": manifest.qforge_version,
            }))?
        );
    } else {
        println!(
            "{}: {} files ({bytes} bytes) match manifest.json (written by qforge {})",
            args.dir.display(),
            manifest.files.len(),
            manifest.qforge_version
        );
    }
    Ok(())
}
