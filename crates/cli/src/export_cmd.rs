//! `qforge export`: a native artifact in a serving stack's format, with its
//! own manifest.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use qforge_export::export_compressed_tensors;
use qforge_model::artifact::is_artifact;
use qforge_model::manifest::{read_manifest, verify, write_manifest};
use serde_json::json;

use crate::output::write_dir_atomic;
use crate::{OutputFlags, UsageError};

/// `--format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// vLLM's INT8 checkpoint (W8A8, compressed-tensors), language models.
    CompressedTensors,
    /// ONNX with QuantizeLinear/DequantizeLinear, policies.
    Onnx,
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
    /// Destination directory (written atomically; an existing one must be an
    /// earlier qforge output).
    #[arg(short = 'o', long = "output", value_name = "DEST")]
    output: PathBuf,
    #[command(flatten)]
    flags: OutputFlags,
}

/// `qforge export`.
pub fn export(args: ExportArgs) -> Result<()> {
    if !is_artifact(&args.model) {
        return Err(UsageError(format!(
            "{} is not a native artifact (no qforge.json); make one with `qforge quantize`",
            args.model.display()
        ))
        .into());
    }
    // Export only what the guard checked: the source must be intact.
    verify(&args.model)
        .context("the artifact does not match its manifest; re-run `qforge quantize`")?;
    if args.format == Format::Onnx {
        anyhow::bail!("ONNX QDQ export is not built yet; compressed-tensors is");
    }
    let source = read_manifest(&args.model)?;
    let source_manifest = std::fs::read(args.model.join("manifest.json"))?;
    let mut summary = None;
    write_dir_atomic(&args.output, |dest| {
        let result = export_compressed_tensors(&args.model, dest)?;
        write_manifest(
            dest,
            json!({
                "kind": "compressed-tensors",
                "source_artifact": std::fs::canonicalize(&args.model)
                    .unwrap_or(args.model.clone())
                    .display()
                    .to_string(),
                "source_manifest_sha256": qforge_core::Digest::of(&source_manifest).to_hex(),
                "lm_head": result.lm_head,
                "ignore": result.ignored,
                "quantized_layers": result.quantized_layers,
                "artifact": source.info,
            }),
        )?;
        summary = Some(result);
        Ok(())
    })?;
    let summary = summary.expect("filled by the export");
    if args.flags.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "output": args.output.display().to_string(),
                "format": "compressed-tensors",
                "quantized_layers": summary.quantized_layers,
                "ignore": summary.ignored,
                "lm_head": summary.lm_head,
            }))?
        );
    } else {
        println!(
            "wrote {} (compressed-tensors): {} int8 layers, {} left unquantized (lm_head {})",
            args.output.display(),
            summary.quantized_layers,
            summary.ignored.len(),
            summary.lm_head
        );
    }
    Ok(())
}
