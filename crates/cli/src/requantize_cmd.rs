//! `qforge requantize`: new weights quantized like an artifact, at a weight
//! sync.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use qforge_quant::requantize::requantize;
use serde_json::json;

use crate::{OutputFlags, UsageError};
use qforge_model::output::write_dir_atomic;

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
    let w = requantized.weights;
    if args.flags.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "output": args.output.display().to_string(),
                "like": args.like.display().to_string(),
                "int8_weights": w.int8_weights,
                "changed_weights": w.changed,
                "changed_share": w.share(),
                "drift": requantized.drift,
                "drift_threshold": args.drift_threshold,
                "seconds": requantized.seconds,
            }))?
        );
    } else {
        println!(
            "requantized {} like {} in {:.3} s: {} of {} int8 weights changed ({:.3} %)",
            args.model.display(),
            args.like.display(),
            requantized.seconds,
            w.changed,
            w.int8_weights,
            100.0 * w.share()
        );
        println!("artifact: {}/", args.output.display());
    }
    for drift in &requantized.drift {
        eprintln!(
            "warning: {}: activations on the probe batch grew {:.1} % past the artifact's (threshold {:.1} %); its frozen scale clips: recalibrate with `qforge quantize`",
            drift.point,
            100.0 * (drift.ratio - 1.0),
            100.0 * args.drift_threshold
        );
    }
    Ok(())
}
