//! `qforge export`: a native artifact in a serving stack's format, with its
//! own manifest.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, ValueEnum};
use qforge_export::{Target, export};
use qforge_model::artifact::is_artifact;

use crate::output::print_report;
use crate::{OutputFlags, UsageError};

/// `--format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// vLLM's INT8 checkpoint (W8A8, compressed-tensors), language models.
    CompressedTensors,
    /// ONNX with QuantizeLinear/DequantizeLinear, policies.
    Onnx,
}

/// `--precision` of an ONNX export.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OnnxPrecision {
    /// The artifact's precisions (QDQ where INT8).
    Int8,
    /// The full-precision source policy.
    F32,
}

/// Arguments of `qforge export`.
#[derive(Args)]
pub struct ExportArgs {
    /// The native artifact (`qforge quantize`'s output directory).
    #[arg(long, value_name = "DIR")]
    model: PathBuf,
    /// Target format.
    #[arg(long, value_enum)]
    format: Format,
    /// ONNX only: `int8` exports the artifact as quantized; `f32` exports its
    /// full-precision source policy (found through the manifest, checked
    /// against its hash) for side-by-side comparison.
    #[arg(long, value_enum, default_value_t = OnnxPrecision::Int8)]
    precision: OnnxPrecision,
    /// Destination directory (written atomically; an existing one must be an
    /// earlier qforge output).
    #[arg(short = 'o', long = "output", value_name = "DEST")]
    output: PathBuf,
    #[command(flatten)]
    flags: OutputFlags,
}

/// `qforge export`.
pub fn export_command(args: ExportArgs) -> Result<()> {
    if !is_artifact(&args.model) {
        return Err(UsageError(format!(
            "{} is not a native artifact (no qforge.json); make one with `qforge quantize`",
            args.model.display()
        ))
        .into());
    }
    let target = match (args.format, args.precision) {
        (Format::CompressedTensors, OnnxPrecision::Int8) => Target::CompressedTensors,
        (Format::CompressedTensors, OnnxPrecision::F32) => {
            return Err(UsageError("--precision applies to --format onnx".into()).into());
        }
        (Format::Onnx, precision) => Target::Onnx {
            f32: precision == OnnxPrecision::F32,
        },
    };
    print_report(&export(&args.model, target, &args.output)?, args.flags)
}
