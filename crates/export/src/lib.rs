//! `qforge-export`: the native INT8 artifact (written by `qforge quantize`,
//! defined in `qforge-model`) converted to what serving stacks load.
//!
//! * [`compressed_tensors`]: vLLM's INT8 checkpoint format (W8A8,
//!   `quant_method: compressed-tensors`, `format: int-quantized`).
//! * [`onnx_qdq`]: ONNX with QuantizeLinear/DequantizeLinear for MLP
//!   policies.
//!
//! It reads artifacts and writes directories; it depends on `qforge-model`
//! and `qforge-formats` only and never requantizes: the exported int8
//! values are the ones the guard measured.

pub mod compressed_tensors;
pub mod error;
pub mod onnx_qdq;

use std::fmt;
use std::path::{Path, PathBuf};

pub use compressed_tensors::{CompressedTensors, export_compressed_tensors};
pub use error::{Error, Result};
pub use onnx_qdq::{OnnxExport, export_onnx};
use qforge_formats::manifest::{Manifest, hash_file, verify, write_manifest};
use qforge_formats::output::write_dir_atomic;
use qforge_formats::policy::PolicyConfig;
use qforge_model::artifact::{LayerPrecision, ModelKind, WEIGHTS_FILE, check_numbers, read_config};
use qforge_model::open::recorded_source;
use serde::Serialize;

/// The format to export to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// vLLM's INT8 checkpoint (W8A8), for language models.
    CompressedTensors,
    /// ONNX QDQ, for policies: the artifact as quantized (`f32: false`) or
    /// its full-precision source policy, for side-by-side comparison.
    Onnx {
        /// Export the source policy in f32 instead of the artifact.
        f32: bool,
    },
}

/// What an export wrote; its manifest records the same fields.
#[derive(Debug, Serialize)]
pub struct ExportReport {
    /// The destination directory.
    pub output: PathBuf,
    /// What was written.
    #[serde(flatten)]
    pub exported: Exported,
}

/// What was written, by format.
#[derive(Debug, Serialize)]
#[serde(tag = "format", rename_all = "kebab-case")]
pub enum Exported {
    /// See [`CompressedTensors`].
    CompressedTensors {
        /// Linear layers written as int8.
        quantized_layers: usize,
        /// Layers left unquantized, `lm_head` included.
        ignore: Vec<String>,
        /// How `lm_head` was written.
        lm_head: &'static str,
        /// The checkpoint's `torch_dtype`.
        dtype: &'static str,
        /// Inputs rotated online, written as compressed-tensors transforms.
        online_rotations: Vec<&'static str>,
    },
    /// See [`OnnxExport`].
    Onnx {
        /// `int8` (the artifact) or `f32` (its source).
        precision: &'static str,
        /// The ONNX opset.
        opset: i64,
        /// Layers with QDQ int8 weights.
        int8_layers: usize,
        /// Layers in f32.
        fp_layers: usize,
    },
}

/// Exports the native artifact at `artifact` to `dest` (replaced
/// atomically; an existing `dest` must be an earlier qforge output), with a
/// manifest naming the source artifact, its manifest's SHA-256 and its
/// provenance and guard results. Only what the guard checked is exported:
/// an artifact that no longer matches its manifest is refused, and so is one
/// whose numbers the loader refuses ([`check_numbers`]: the export reads the
/// tensors raw, so a NaN scale or an infinite bias went straight into it).
pub fn export(artifact: &Path, target: Target, dest: &Path) -> Result<ExportReport> {
    let source = verify(artifact).map_err(|e| {
        Error::Inconsistent(format!(
            "the artifact does not match its manifest; re-run `qforge quantize`: {e}"
        ))
    })?;
    check_numbers(artifact)?;
    let source_manifest = hash_file(&artifact.join("manifest.json"))?.sha256;
    let mut exported = None;
    write_dir_atomic(dest, |staging| -> Result<()> {
        let written = match target {
            Target::CompressedTensors => {
                let result = export_compressed_tensors(artifact, staging)?;
                Exported::CompressedTensors {
                    quantized_layers: result.quantized_layers,
                    ignore: result.ignored,
                    lm_head: result.lm_head,
                    dtype: result.dtype,
                    online_rotations: result.online_rotations,
                }
            }
            Target::Onnx { f32 } => onnx(artifact, &source, f32, staging)?,
        };
        let mut info = serde_json::to_value(&written).expect("plain data serializes");
        let canonical = std::fs::canonicalize(artifact).unwrap_or(artifact.to_owned());
        info["source_artifact"] = canonical.display().to_string().into();
        info["source_manifest_sha256"] = source_manifest.into();
        info["artifact"] = source.info.clone();
        write_manifest(staging, info)?;
        exported = Some(written);
        Ok(())
    })?;
    Ok(ExportReport {
        output: dest.to_owned(),
        exported: exported.expect("filled by the export"),
    })
}

/// The ONNX export of the policy artifact at `artifact`, or (`f32`) of its
/// source policy, into `dest`.
fn onnx(artifact: &Path, source: &Manifest, f32: bool, dest: &Path) -> Result<Exported> {
    let config = read_config(artifact)?;
    if config.kind != ModelKind::Policy {
        return Err(Error::Unsupported(
            "ONNX QDQ export is for MLP policies; export a language model as compressed-tensors"
                .into(),
        ));
    }
    // The f32 graph is the full-precision source's, with the source's own
    // config: a smoothed artifact's first layer and observation divisors
    // belong to its int8 weights, not to the source's f32 ones.
    let (dir, points) = if f32 {
        let points = config
            .points
            .keys()
            .map(|p| (p.clone(), LayerPrecision::Fp));
        (recorded_source(source)?, points.collect())
    } else {
        (artifact.to_owned(), config.points)
    };
    let policy_path = dir.join("policy.json");
    let policy: PolicyConfig =
        serde_json::from_slice(&qforge_formats::files::read_config(&policy_path)?)
            .map_err(|e| Error::Inconsistent(format!("{}: {e}", policy_path.display())))?;
    let result = export_onnx(&dir.join(WEIGHTS_FILE), &points, &policy, dest)?;
    Ok(Exported::Onnx {
        precision: if f32 { "f32" } else { "int8" },
        opset: onnx_qdq::OPSET,
        int8_layers: result.int8_layers,
        fp_layers: result.fp_layers,
    })
}

impl fmt::Display for ExportReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dest = self.output.display();
        match &self.exported {
            Exported::CompressedTensors {
                quantized_layers,
                ignore,
                lm_head,
                dtype,
                online_rotations,
            } => {
                write!(
                    f,
                    "wrote {dest} (compressed-tensors, {dtype}): {quantized_layers} int8 layers, {} left unquantized (lm_head {lm_head})",
                    ignore.len()
                )?;
                if !online_rotations.is_empty() {
                    write!(
                        f,
                        "; inputs rotated online by transforms: {}",
                        online_rotations.join(", ")
                    )?;
                }
                Ok(())
            }
            Exported::Onnx {
                opset,
                int8_layers,
                fp_layers,
                ..
            } => write!(
                f,
                "wrote {dest}/model.onnx (opset {opset}): {int8_layers} QDQ layers, {fp_layers} f32 layers"
            ),
        }
    }
}
