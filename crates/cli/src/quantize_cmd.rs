//! `qforge quantize`: calibrate → recipe → guard → native artifact, with
//! `report.json`, `report.html` and `manifest.json`, written atomically.

use std::path::PathBuf;

use anyhow::{Context, Result, anyhow};
use clap::{Args, ValueEnum};
use qforge_dist::{PassEvent, PassPosition};
use qforge_model::Format;
use qforge_quant::recipe::{ActivationScheme, Overrides};
use qforge_quant::returns::{ReturnCheck, bundled};
use qforge_quant::{Inputs, Listener, Pipeline, QuantRecipe};

use crate::calibrate_cmd::{BackendArgs, PassProgress, StratifyArg};
use crate::output::{print_json, print_report};
use crate::{OutputFlags, UsageError};

/// The policy `qforge quantize` uses when given no model, relative to the
/// repository root.
const BUNDLED_MODEL: &str = "fixtures/policies/cartpole";
/// Its rollouts.
const BUNDLED_DATA: &str = "fixtures/policies/cartpole/rollouts.jsonl";

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

    /// [method] run the recipe as given (plain, unless --smoothquant,
    /// --hadamard or --gptq name a method) instead of trying plain,
    /// SmoothQuant, Hadamard and Hadamard + GPTQ in order of cost until one
    /// meets the guard before any fallback (policies: plain and SmoothQuant).
    #[arg(long, help_heading = "Recipe overrides")]
    no_method_search: bool,
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
    /// [smoothing] run SmoothQuant: a first pass records per-channel
    /// abs-max, a second calibrates the smoothed model, on any backend (for
    /// a policy, its observation is what is smoothed).
    #[arg(long, help_heading = "Recipe overrides")]
    smoothquant: bool,
    /// [smoothing] migration strength α in [0, 1], one for every input
    /// (default: each input's α searched on its layers' output error).
    #[arg(long, help_heading = "Recipe overrides")]
    alpha: Option<f64>,
    /// [rotation] rotate these linear inputs by a Hadamard matrix, online in
    /// qforge's engine (such an artifact does not export): comma-separated
    /// among q_proj, o_proj, gate_proj, down_proj, lm_head, or `all`.
    #[arg(long, value_name = "INPUTS", help_heading = "Recipe overrides")]
    hadamard: Option<String>,
    /// [gptq] round int8 weights with GPTQ: Hessian passes after the
    /// activation pass sum each layer input's exact Σ x xᵀ (on any backend,
    /// the same bytes), and weights are rounded with error compensation.
    #[arg(long, help_heading = "Recipe overrides")]
    gptq: bool,
    /// [gptq] round columns in order of decreasing Hessian diagonal.
    #[arg(long, help_heading = "Recipe overrides")]
    gptq_act_order: bool,
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
        let recipe = match &self.recipe {
            Some(path) => {
                let text = qforge_model::files::read_config_text(path)?;
                QuantRecipe::from_toml(&text)
                    .map_err(|e| UsageError(format!("{}: {e}", path.display())))?
            }
            None => QuantRecipe::default(),
        };
        let overrides = Overrides {
            no_method_search: self.no_method_search,
            samples: self.samples,
            seq_len: self.seq_len,
            batch_size: self.batch_size,
            seed: self.seed,
            stratify: self.stratify.map(StratifyArg::stratify),
            min_coverage: self.min_coverage,
            activations: self.activations.map(|a| match a {
                ActivationsArg::Static => ActivationScheme::Static,
                ActivationsArg::Dynamic => ActivationScheme::Dynamic,
            }),
            calibrator: self.calibrator.clone(),
            ignore: self.ignore.clone(),
            fp_lm_head: self.fp_lm_head,
            smoothquant: self.smoothquant,
            alpha: self.alpha,
            hadamard: self.hadamard.clone(),
            gptq: self.gptq,
            gptq_act_order: self.gptq_act_order,
            max_perplexity_increase: self.max_perplexity_increase,
            min_agreement: self.min_agreement,
            max_fp_fraction: self.max_fp_fraction,
            ctx: self.ctx,
        };
        // A flag the recipe cannot take is a usage error.
        Ok(recipe
            .with_overrides(&overrides)
            .map_err(|e| UsageError(e.to_string()))?)
    }
}

/// The pipeline's events on the terminal: progress bars per pass and lines
/// on stderr (only warnings with `--json`).
struct Terminal {
    progress: PassProgress,
    quiet: bool,
}

impl Listener for Terminal {
    fn message(&mut self, line: &str) {
        if !self.quiet || line.starts_with("warning:") {
            eprintln!("{line}");
        }
    }

    fn pass_event(&mut self, pass: PassPosition, event: &PassEvent) {
        self.progress.on_event(pass, event);
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
    let mut terminal = Terminal {
        progress: PassProgress::new(quiet),
        quiet,
    };
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

/// `qforge verify`: re-hash every file the manifest lists.
pub fn verify_command(args: VerifyArgs) -> Result<()> {
    print_report(&qforge_model::manifest::verified(&args.dir)?, args.flags)
}
