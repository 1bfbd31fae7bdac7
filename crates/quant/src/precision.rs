//! The precisions a full-precision model runs in on the INT8 engine
//! without the quantization pipeline (`qforge generate/eval/act
//! --precision`): dynamic activations, with or without the data-free
//! residual rotation, and static activation scales from calibration
//! statistics.

use std::path::Path;

use qforge_core::codec::decode;
use qforge_core::{Calibrator, Stats};
use qforge_kernels::Hadamard;
use qforge_kernels::hadamard::SMALL_ORDERS;

use qforge_model::{Activations, Error, LanguageModel, Linear, Llama, MlpPolicy, Result};

/// The precision a model runs in outside the quantization pipeline
/// (`qforge generate/eval/act --precision`).
pub enum RunPrecision {
    /// Full precision: every weight as loaded, dequantized to f32.
    F32,
    /// A native artifact's own per-layer precisions, as stored.
    Stored,
    /// Every linear layer (lm_head included) int8, activations quantized
    /// per token at run time; a language model's residual stream first
    /// rotated offline by the randomized Hadamard matrix of signs
    /// [`RESIDUAL_SIGNS_SEED`] (`Llama::residual_rotated`). The rotation
    /// needs no data and costs nothing at run time, and spreads the
    /// residual's massive channels that a per-token scale otherwise
    /// flattens the rest under: on SmolLM2-135M it took the perplexity cost
    /// on 31 875 held-out tokens (ctx 512) from +3.83 % to +0.96 %. A
    /// policy has no residual stream and runs as
    /// [`RunPrecision::Int8DynamicPlain`].
    Int8Dynamic,
    /// [`RunPrecision::Int8Dynamic`] without the rotation: every weight
    /// quantized as loaded (what `int8-dynamic` was before it rotated).
    Int8DynamicPlain,
    /// Every linear layer int8, one activation scale per layer input.
    Int8Static(StaticScales),
}

/// The precisions a model can be asked to run in, by name.
pub const PRECISION_NAMES: [&str; 4] = ["f32", "int8-dynamic", "int8-dynamic-plain", "int8-static"];

/// Seed of [`RunPrecision::Int8Dynamic`]'s rotation signs: fixed, so a
/// model runs the same in every process (and a weight sync rotates new
/// weights as the served ones were); 0 is also a quantize recipe's default
/// (`[rotation] seed`), whose artifacts BENCHMARKS.md measured.
pub const RESIDUAL_SIGNS_SEED: u64 = 0;

impl RunPrecision {
    /// The precision `name` (one of [`PRECISION_NAMES`]) for the model at
    /// `model`: int8-static with the scales `calibrator` picks from `stats`
    /// (a calibration of this model). A native artifact runs in its stored
    /// precisions, so it takes only `f32` (meaning: as stored).
    pub fn named(
        name: &str,
        model: &Path,
        stats: Option<&Path>,
        calibrator: Calibrator,
    ) -> Result<Self> {
        let refuse = |why: String| Err(qforge_formats::Error::Request(why).into());
        let artifact = qforge_model::artifact::is_artifact(model);
        if artifact && (name != "f32" || stats.is_some()) {
            return refuse(format!(
                "{} is a quantized artifact and runs in the precisions stored in it; drop --precision/--stats (or point --model at its full-precision source)",
                model.display()
            ));
        }
        match (name, stats) {
            ("f32", None) if artifact => Ok(RunPrecision::Stored),
            ("f32", None) => Ok(RunPrecision::F32),
            ("int8-dynamic", None) => Ok(RunPrecision::Int8Dynamic),
            ("int8-dynamic-plain", None) => Ok(RunPrecision::Int8DynamicPlain),
            ("int8-static", Some(path)) => Ok(RunPrecision::Int8Static(StaticScales::read(
                path, model, calibrator,
            )?)),
            ("int8-static", None) => refuse(
                "int8-static needs --stats FILE.qstats (stats= in Python), from `qforge calibrate`"
                    .into(),
            ),
            (name, _) if !PRECISION_NAMES.contains(&name) => refuse(format!(
                "no precision {name:?}: the precisions are {}",
                PRECISION_NAMES.join(", ")
            )),
            _ => refuse("--stats is only used with --precision int8-static".into()),
        }
    }

    /// How the input at `point` is quantized; `None` when the model runs as
    /// loaded.
    pub fn activations(&self, point: &str) -> Option<Result<Activations>> {
        match self {
            RunPrecision::F32 | RunPrecision::Stored => None,
            RunPrecision::Int8Dynamic | RunPrecision::Int8DynamicPlain => {
                Some(Ok(Activations::Dynamic))
            }
            RunPrecision::Int8Static(scales) => Some(scales.activations(point)),
        }
    }

    /// The input quantization of every point, for the INT8 precisions.
    pub fn int8_activations(&self) -> Option<impl Fn(&str) -> Result<Activations> + '_> {
        let int8 = !matches!(self, RunPrecision::F32 | RunPrecision::Stored);
        int8.then_some(|point: &str| self.activations(point).expect("an INT8 precision"))
    }

    /// `lm` still in full precision, transformed as this precision's INT8
    /// layers take it: residual rotated for [`RunPrecision::Int8Dynamic`],
    /// as given otherwise (what `eval layers` measures the INT8 layers
    /// against).
    pub fn transform_language(&self, mut lm: LanguageModel) -> Result<LanguageModel> {
        if matches!(self, RunPrecision::Int8Dynamic) {
            lm.model = residual_rotated(&lm.model, |layer| Ok(layer.clone()))?;
        }
        Ok(lm)
    }

    /// `lm` in this precision.
    pub fn apply_language(&self, mut lm: LanguageModel) -> Result<LanguageModel> {
        lm.model = match (self, self.int8_activations()) {
            (_, None) => return Ok(lm),
            // Each layer goes to int8 as soon as it is rotated, so the
            // rotated f32 copies never all exist at once.
            (RunPrecision::Int8Dynamic, _) => {
                residual_rotated(&lm.model, |layer| layer.to_int8(Activations::Dynamic))?
            }
            (_, Some(activations)) => lm
                .model
                .with_linears(|point, layer| layer.to_int8(activations(point)?))?,
        };
        Ok(lm)
    }

    /// `policy` in this precision; int8-dynamic runs it as
    /// int8-dynamic-plain does (an MLP has no residual stream to rotate).
    pub fn apply_policy(&self, policy: MlpPolicy) -> Result<MlpPolicy> {
        match self.int8_activations() {
            None => Ok(policy),
            Some(activations) => {
                policy.with_linears(|point, layer| layer.to_int8(activations(point)?))
            }
        }
    }
}

/// `model` with its residual stream rotated by [`RunPrecision::Int8Dynamic`]'s
/// fixed signs, each linear layer then `convert`ed. A hidden width with no
/// Hadamard construction is refused, not silently left unrotated.
fn residual_rotated(
    model: &Llama,
    convert: impl Fn(&Linear) -> Result<Linear> + Sync,
) -> Result<Llama> {
    let width = model.config().hidden_size;
    if !Hadamard::supports(width) {
        return Err(qforge_formats::Error::Unsupported(format!(
            "int8-dynamic rotates the residual stream first, and there is no Hadamard rotation of its {width} channels (widths m · 2^k, m in {SMALL_ORDERS:?}); int8-dynamic-plain runs without the rotation"
        )).into());
    }
    model.residual_rotated_into(RESIDUAL_SIGNS_SEED, convert)
}

impl std::fmt::Display for RunPrecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RunPrecision::F32 => f.write_str("f32"),
            RunPrecision::Stored => f.write_str("artifact (stored precisions)"),
            RunPrecision::Int8Dynamic => f.write_str("int8-dynamic"),
            RunPrecision::Int8DynamicPlain => f.write_str("int8-dynamic-plain"),
            RunPrecision::Int8Static(scales) => write!(f, "int8-static ({})", scales.calibrator),
        }
    }
}

/// One static (per-tensor) activation scale per observation point, chosen by
/// a calibrator from the statistics a calibration of this very model wrote.
pub struct StaticScales {
    stats: Stats,
    calibrator: Calibrator,
    /// Where the statistics came from, for error messages.
    source: String,
}

impl StaticScales {
    /// Reads a `.qstats` file and checks it was calibrated on `model`
    /// (the statistics' provenance names the model's content hash).
    pub fn read(stats_path: &Path, model: &Path, calibrator: Calibrator) -> Result<Self> {
        let bytes = std::fs::read(stats_path).map_err(|e| Error::io(stats_path, e))?;
        let stats = decode(&bytes).map_err(|e| Error::from(e).in_file(stats_path))?;
        let digest = qforge_model::open::digest(model)?;
        if !stats.provenance.models.contains(&digest) {
            return Err(Error::Format(format!(
                "{} was calibrated on another model than {}; run `qforge calibrate --model {}` first",
                stats_path.display(),
                model.display(),
                model.display()
            )));
        }
        Ok(Self {
            stats,
            calibrator,
            source: stats_path.display().to_string(),
        })
    }

    /// The static activations of the linear layer fed at `point`.
    pub fn activations(&self, point: &str) -> Result<Activations> {
        let tensor = self.stats.tensors.get(point).ok_or_else(|| {
            Error::Format(format!(
                "{} has no statistics for {point}; calibrate this model again",
                self.source
            ))
        })?;
        let scale = self
            .calibrator
            .static_scale(tensor.histogram())
            .ok_or_else(|| {
                Error::Format(format!(
                    "{}: {point} saw no finite value; its scale is undefined",
                    self.source
                ))
            })?;
        Ok(Activations::Static(scale))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use qforge_core::TensorStats;

    fn scales_of(values: &[f32]) -> StaticScales {
        let mut tensor = TensorStats::with_channels(1);
        tensor.observe(values).unwrap();
        let mut stats = Stats::default();
        stats.tensors.insert("layers.0".into(), tensor);
        StaticScales {
            stats,
            calibrator: Calibrator::MinMax,
            source: "test.qstats".into(),
        }
    }

    #[test]
    fn a_point_gets_its_calibrators_scale_and_an_unknown_point_is_named() {
        let scales = scales_of(&[-2.54, 1.0, 0.5]);
        let Activations::Static(scale) = scales.activations("layers.0").unwrap() else {
            panic!("static activations expected");
        };
        assert_eq!(
            scale,
            Calibrator::MinMax
                .static_scale(scales.stats.tensors["layers.0"].histogram())
                .unwrap()
        );
        assert!((scale - 2.54 / 127.0).abs() < 1e-4, "{scale}");
        let missing = scales.activations("layers.1").unwrap_err().to_string();
        assert!(
            missing.contains("test.qstats has no statistics for layers.1"),
            "{missing}"
        );
    }

    #[test]
    fn a_point_that_saw_no_finite_value_has_no_scale() {
        let scales = scales_of(&[f32::NAN]);
        let err = scales.activations("layers.0").unwrap_err().to_string();
        assert!(err.contains("saw no finite value"), "{err}");
    }
}
