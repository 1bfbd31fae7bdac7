//! `qforge export`: a native artifact in a serving stack's format, with its
//! own manifest.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use qforge_export::{export_compressed_tensors, export_onnx};
use qforge_model::PolicyConfig;
use qforge_model::artifact::{LayerPrecision, ModelKind, WEIGHTS_FILE, is_artifact, read_config};
use qforge_model::manifest::{Manifest, read_manifest, verify, write_manifest};
use serde_json::json;

use crate::output::write_dir_atomic;
use crate::{OutputFlags, UsageError};
use qforge_model::open::recorded_source;

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
    let source = read_manifest(&args.model)?;
    let source_manifest = qforge_model::files::read_config(&args.model.join("manifest.json"))?;
    if args.format == Format::Onnx {
        return export_onnx_command(&args, &source, &source_manifest);
    }
    if args.precision != OnnxPrecision::Int8 {
        return Err(UsageError("--precision applies to --format onnx".into()).into());
    }
    write_export(&args, &source, &source_manifest, |dest| {
        let result = export_compressed_tensors(&args.model, dest)?;
        let line = format!(
            "wrote {} (compressed-tensors): {} int8 layers, {} left unquantized (lm_head {})",
            args.output.display(),
            result.quantized_layers,
            result.ignored.len(),
            result.lm_head
        );
        let summary = json!({
            "format": "compressed-tensors",
            "quantized_layers": result.quantized_layers,
            "ignore": result.ignored,
            "lm_head": result.lm_head,
        });
        Ok((summary, line))
    })
}

/// Writes an export atomically through `fill` (which returns its JSON
/// summary and a human line), adds the manifest — the summary, the source
/// artifact and its manifest's hash, and the artifact's own provenance and
/// guard results — and prints the outcome.
fn write_export(
    args: &ExportArgs,
    source: &Manifest,
    source_manifest: &[u8],
    fill: impl FnOnce(&std::path::Path) -> Result<(serde_json::Value, String)>,
) -> Result<()> {
    let mut outcome = None;
    write_dir_atomic(&args.output, |dest| {
        let (summary, line) = fill(dest)?;
        let mut info = summary.clone();
        info["source_artifact"] = std::fs::canonicalize(&args.model)
            .unwrap_or(args.model.clone())
            .display()
            .to_string()
            .into();
        info["source_manifest_sha256"] = qforge_core::Digest::of(source_manifest).to_hex().into();
        info["artifact"] = source.info.clone();
        write_manifest(dest, info)?;
        outcome = Some((summary, line));
        Ok(())
    })?;
    let (mut summary, line) = outcome.expect("filled by the export");
    if args.flags.json {
        summary["output"] = args.output.display().to_string().into();
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        println!("{line}");
    }
    Ok(())
}

/// `qforge export --format onnx`.
fn export_onnx_command(args: &ExportArgs, source: &Manifest, source_manifest: &[u8]) -> Result<()> {
    let config = read_config(&args.model)?;
    if config.kind != ModelKind::Policy {
        return Err(UsageError(
            "ONNX QDQ export is for MLP policies; export a language model with --format compressed-tensors"
                .into(),
        )
        .into());
    }
    // The f32 graph is the full-precision source's, with the source's own
    // config: a smoothed artifact's first layer and observation divisors
    // belong to its int8 weights, not to the source's f32 ones.
    let (dir, points) = match args.precision {
        OnnxPrecision::Int8 => (args.model.clone(), config.points.clone()),
        OnnxPrecision::F32 => {
            let points = config
                .points
                .keys()
                .map(|p| (p.clone(), LayerPrecision::Fp))
                .collect();
            (recorded_source(source)?, points)
        }
    };
    let policy_path = dir.join("policy.json");
    let policy: PolicyConfig =
        serde_json::from_slice(&qforge_model::files::read_config(&policy_path)?)
            .with_context(|| format!("{}", policy_path.display()))?;
    let weights = dir.join(WEIGHTS_FILE);
    write_export(args, source, source_manifest, |dest| {
        let result = export_onnx(&weights, &points, &policy, dest)?;
        let line = format!(
            "wrote {}/model.onnx (opset 13): {} QDQ layers, {} f32 layers",
            args.output.display(),
            result.int8_layers,
            result.fp_layers
        );
        let summary = json!({
            "format": "onnx",
            "precision": match args.precision {
                OnnxPrecision::Int8 => "int8",
                OnnxPrecision::F32 => "f32",
            },
            "opset": 13,
            "int8_layers": result.int8_layers,
            "fp_layers": result.fp_layers,
        });
        Ok((summary, line))
    })
}
