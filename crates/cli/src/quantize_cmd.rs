//! `qforge quantize`: calibrate → recipe → guard → native artifact, with
//! `report.json`, `report.html` and `manifest.json`, written atomically.

use std::path::PathBuf;

use anyhow::{Context, Result, anyhow};
use clap::Args;
use qforge_model::Format;
use qforge_quant::recipe::Overrides;
use qforge_quant::returns::{ReturnCheck, bundled};
use qforge_quant::{Inputs, Pipeline, QuantRecipe};
use qforge_runner::Listener;

use crate::calibrate_cmd::BackendArgs;
use crate::output::{print_json, print_report};
use crate::terminal::Terminal;
use crate::{OutputFlags, UsageError};

/// The policy `qforge quantize` uses when given no model, relative to the
/// repository root.
const BUNDLED_MODEL: &str = "fixtures/policies/cartpole";
/// Its rollouts.
const BUNDLED_DATA: &str = "fixtures/policies/cartpole/rollouts.jsonl";

/// Arguments of `qforge quantize`.
#[derive(Args)]
pub struct QuantizeArgs {
    /// Model: GGUF file, Hugging Face directory, policy directory or ONNX
    /// policy (NAME.onnx, its head in NAME.policy.json; default: the bundled
    /// CartPole policy).
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
    /// Name of the Redis run, for `qforge worker --run NAME` (a recipe's
    /// later passes run as NAME.pass2, …, and its workers follow them);
    /// default: derived from the model, data and recipe hashes.
    #[arg(long, requires = "cluster")]
    run: Option<String>,
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
    #[command(flatten)]
    flags: OutputFlags,
    // Last: its help heading would take in the flags after it.
    #[command(flatten)]
    overrides: Overrides,
}

impl QuantizeArgs {
    /// The recipe file (or the defaults) with the flags applied.
    fn recipe(&self) -> Result<QuantRecipe> {
        let recipe = match &self.recipe {
            Some(path) => {
                let text = qforge_formats::files::read_config_text(path)?;
                QuantRecipe::from_toml(&text)
                    .map_err(|e| UsageError(format!("{}: {e}", path.display())))?
            }
            None => QuantRecipe::default(),
        };
        // A flag the recipe cannot take is a usage error.
        Ok(recipe
            .with_overrides(&self.overrides)
            .map_err(|e| UsageError(e.to_string()))?)
    }
}

/// `qforge quantize`.
pub fn quantize_command(args: QuantizeArgs) -> Result<()> {
    let recipe = args.recipe()?;
    let (model, data) = match (&args.model, &args.data) {
        (Some(m), Some(d)) => (m.clone(), d.clone()),
        _ => {
            let default =
                |path| bundled(path).map_err(|e| anyhow!("{e}, or pass --model and --data"));
            (default(BUNDLED_MODEL)?, default(BUNDLED_DATA)?)
        }
    };
    let is_policy = Format::is_policy(&model)?;
    if args.env.is_some() && !is_policy {
        return Err(UsageError(
            "--env checks the return of a policy; language models are guarded by perplexity".into(),
        )
        .into());
    }
    if let Some(why) = recipe.needs_language_model()
        && is_policy
    {
        return Err(UsageError(why.into()).into());
    }
    let executor = args.backend.executor(args.run.clone(), false)?;
    let pipeline = Pipeline::new(recipe, executor.as_ref())?;
    let quiet = args.flags.json;
    let mut terminal = Terminal::new(quiet);
    terminal.message(&format!(
        "calibrating {} on {}",
        model.display(),
        data.display()
    ));
    let inputs = Inputs {
        model,
        data,
        eval_data: args.eval_data.clone(),
        skip_invalid: args.skip_invalid,
    };
    let quantized = pipeline.run(&inputs, &mut terminal)?;
    drop(terminal);
    let returns = match &args.env {
        Some(env) => Some(ReturnCheck {
            env: env.clone(),
            episodes: args.env_episodes,
            min_consistency: args.min_return_consistency,
            qforge: std::env::current_exe().context("cannot locate this qforge")?,
        }),
        None => None,
    };
    if let Some(result) = quantized.write_to(&args.output, returns.as_ref())?
        && !quiet
    {
        eprintln!(
            "guard: return in {}: {result}",
            args.env.as_deref().unwrap_or("")
        );
    }
    let outcome = quantized
        .report
        .outcome(&inputs.model, &quantized.held_out, &args.output);
    if args.flags.json {
        print_json(&outcome)?;
    }
    for warning in &quantized.report.decision.warnings {
        eprintln!("warning: {warning}");
    }
    if let Some(refusal) = quantized.refusal(&args.output) {
        return Err(refusal.into());
    }
    if !args.flags.json {
        println!("{outcome}");
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

/// `qforge verify`: re-hash every file the manifest lists, and check an
/// artifact's numbers as every loader does: a manifest rewritten along with
/// an edited scale passes the hashes.
pub fn verify_command(args: VerifyArgs) -> Result<()> {
    let verified = qforge_formats::manifest::verified(&args.dir)?;
    if qforge_model::artifact::is_artifact(&args.dir) {
        qforge_model::artifact::check_numbers(&args.dir)?;
    }
    print_report(&verified, args.flags)
}
