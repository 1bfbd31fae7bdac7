//! `qforge requantize`: new weights quantized like an artifact, at a weight
//! sync.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use qforge_formats::output::write_dir_atomic;
use qforge_quant::requantize::requantize;

use crate::output::{Written, print_json};
use crate::{OutputFlags, UsageError};

/// Arguments of `qforge requantize`.
#[derive(Args)]
pub struct RequantizeArgs {
    /// The new full-precision weights: the artifact's source format and
    /// architecture (a policy directory, GGUF file or Hugging Face
    /// directory).
    #[arg(long, value_name = "PATH")]
    model: PathBuf,
    /// The artifact whose activation scales, smoothing, rotations and
    /// per-layer precisions are kept (the output of `qforge quantize`).
    #[arg(long, value_name = "ARTIFACT")]
    like: PathBuf,
    /// Where to write the new artifact (replaced atomically; an existing
    /// directory must be an earlier qforge output).
    #[arg(short = 'o', long = "output", value_name = "DIR")]
    output: PathBuf,
    /// Warn when a statically quantized input's activations on the fixed
    /// probe batch grow by more than this fraction over the artifact's: its
    /// frozen scale then clips, and a recalibration (`qforge quantize`) is
    /// due.
    #[arg(long, default_value_t = 0.1, value_name = "FRACTION")]
    drift_threshold: f64,
    #[command(flatten)]
    flags: OutputFlags,
}

/// `qforge requantize`.
pub fn requantize_command(args: RequantizeArgs) -> Result<()> {
    if !(args.drift_threshold.is_finite() && args.drift_threshold >= 0.0) {
        return Err(UsageError("--drift-threshold must be a number ≥ 0".into()).into());
    }
    let requantized = requantize(&args.model, &args.like, args.drift_threshold)?;
    write_dir_atomic(&args.output, |dir| -> Result<()> {
        requantized.write(dir)?;
        Ok(())
    })?;
    let report = requantized.report();
    if args.flags.json {
        print_json(&Written::new(&args.output, &report))?;
    } else {
        println!("{report}\nartifact: {}/", args.output.display());
    }
    for drift in &requantized.drift {
        eprintln!("warning: {}", drift.warning(args.drift_threshold));
    }
    Ok(())
}
