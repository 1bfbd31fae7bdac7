//! Model transforms implied by earlier passes of a pipeline.
//!
//! A pass's merged result can change the model the next pass observes
//! (SmoothQuant's factors are folded into the weights). The transform travels
//! with the next pass's job, bit for bit, and every worker applies it to the
//! model it loaded before observing, so pass 2 sees exactly the model pass 1
//! produced on every worker, whichever backend runs it.

use std::collections::BTreeMap;
use std::path::Path;

use qforge_core::{Digest, DigestBuilder};
use qforge_model::{LanguageModel, Llama, Model, RotatedInput};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// A deterministic change to the model, applied before observing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Transform {
    /// SmoothQuant (Xiao et al. 2023): per smoothable layer input, the
    /// factors its channels are divided by (folded into the preceding norm or
    /// layer, and multiplied into the consuming layers' weights).
    /// How the factors were chosen (α per input) is the report's; the
    /// factors alone are the transform.
    Smooth {
        /// Factors per layer input, carried as f32 bit patterns so that JSON
        /// round trips them exactly.
        #[serde(with = "f32_bits")]
        factors: BTreeMap<String, Vec<f32>>,
    },
    /// The residual stream rotated offline by a randomized Hadamard matrix
    /// of the hidden width, the norms' gains folded into the linears they
    /// feed (`Llama::residual_rotated`): still a plain Llama. Like
    /// [`Transform::Rotate`] it needs no statistics, and it comes before it.
    RotateResidual {
        /// Seed of the rotation's ±1 signs.
        seed: u64,
    },
    /// Linear inputs rotated by the normalized Hadamard matrix of their
    /// width, online in the forward and offline in the weights
    /// (`Llama::rotated`). It needs no statistics: a recipe asks for it and
    /// every pass observes the rotated model.
    Rotate {
        /// The rotated inputs.
        inputs: Vec<RotatedInput>,
    },
}

impl Transform {
    /// Applies the transform to `model`; the weights of the original are
    /// shared where the transform leaves them unchanged.
    pub fn apply(&self, model: &Model) -> Result<Model> {
        match (self, model) {
            (Transform::Smooth { factors }, model) => {
                if let Some((point, _)) = factors
                    .iter()
                    .find(|(_, s)| s.iter().any(|v| !v.is_finite() || *v <= 0.0))
                {
                    return Err(Error::Data(format!(
                        "smoothing factors of {point} are not all finite and positive; the job is corrupt"
                    )));
                }
                Ok(match model {
                    Model::Language(lm) => with_decoder(lm, lm.model.smoothed(factors)?),
                    Model::Policy(policy) => Model::Policy(Box::new(policy.smoothed(factors)?)),
                })
            }
            (Transform::Rotate { inputs }, Model::Language(lm)) => {
                Ok(with_decoder(lm, lm.model.rotated(inputs)?))
            }
            (Transform::RotateResidual { seed }, Model::Language(lm)) => {
                Ok(with_decoder(lm, lm.model.residual_rotated(*seed)?))
            }
            (Transform::Rotate { .. } | Transform::RotateResidual { .. }, Model::Policy(_)) => {
                Err(Error::Data(
                    "Hadamard rotations fold into a decoder's layers: they apply to language models, not policies"
                        .into(),
                ))
            }
        }
    }

    /// The digest of the model this transform makes out of the model whose
    /// digest is `base`.
    pub fn digest(&self, base: Digest) -> Digest {
        let mut digest = DigestBuilder::default();
        digest.update(&base.0);
        match self {
            Transform::Smooth { factors } => {
                digest.update(b"qforge.smoothquant.v2");
                for (point, s) in factors {
                    digest.update(point.as_bytes());
                    for v in s {
                        digest.update(&v.to_le_bytes());
                    }
                }
            }
            Transform::RotateResidual { seed } => {
                digest.update(b"qforge.residual-hadamard.v1");
                digest.update(&seed.to_le_bytes());
            }
            Transform::Rotate { inputs } => {
                digest.update(b"qforge.hadamard.v1");
                for input in inputs {
                    digest.update(input.name().as_bytes());
                    digest.update(b"\0");
                }
            }
        }
        digest.finish()
    }

    /// `smoothquant`, as progress lines name it.
    pub fn name(&self) -> &'static str {
        match self {
            Transform::Smooth { .. } => "smoothquant",
            Transform::RotateResidual { .. } => "residual-hadamard",
            Transform::Rotate { .. } => "hadamard",
        }
    }
}

/// `lm` with its decoder replaced by `model` (same tokenizer and source).
fn with_decoder(lm: &LanguageModel, model: Llama) -> Model {
    Model::Language(Box::new(LanguageModel {
        model,
        text: lm.text.clone(),
        source: lm.source.clone(),
    }))
}

/// The digest of `base` after `transforms`, in order.
pub fn transformed_digest(base: Digest, transforms: &[Transform]) -> Digest {
    transforms.iter().fold(base, |digest, t| t.digest(digest))
}

/// `model` after `transforms`, in order.
pub fn apply_all(model: &Model, transforms: &[Transform]) -> Result<Model> {
    transforms
        .iter()
        .try_fold(model.clone(), |model, t| t.apply(&model))
}

/// The file of an artifact that records the transforms its weights went
/// through, in order, so that new weights can go through the same ones
/// (`qforge requantize`): SmoothQuant's factors folded into a decoder's
/// norms are otherwise nowhere to be read back.
pub const TRANSFORMS_FILE: &str = "transforms.json";

/// Writes `transforms` into the artifact directory `dir`.
pub fn write_transforms(dir: &Path, transforms: &[Transform]) -> Result<()> {
    let path = dir.join(TRANSFORMS_FILE);
    let text = serde_json::to_string(transforms).expect("transforms serialize");
    std::fs::write(&path, text).map_err(|source| qforge_formats::Error::io(&path, source).into())
}

/// The transforms an artifact directory records, or `None` for an artifact
/// written before they were recorded.
pub fn read_transforms(dir: &Path) -> Result<Option<Vec<Transform>>> {
    let path = dir.join(TRANSFORMS_FILE);
    if !path.exists() {
        return Ok(None);
    }
    let bytes = qforge_formats::files::read_config(&path)?;
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| Error::Data(format!("{}: {e}", path.display())))
}

/// Serde of f32 vectors as their bit patterns: exact through JSON.
mod f32_bits {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(
        factors: &BTreeMap<String, Vec<f32>>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        let bits: BTreeMap<&String, Vec<u32>> = factors
            .iter()
            .map(|(point, s)| (point, s.iter().map(|v| v.to_bits()).collect()))
            .collect();
        bits.serialize(serializer)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<BTreeMap<String, Vec<f32>>, D::Error> {
        let bits = BTreeMap::<String, Vec<u32>>::deserialize(deserializer)?;
        Ok(bits
            .into_iter()
            .map(|(point, s)| (point, s.into_iter().map(f32::from_bits).collect()))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn factors_round_trip_json_bit_for_bit() {
        let awkward = [
            0.1f32,
            f32::MIN_POSITIVE,
            1.0e-45,
            3.402_823_5e38,
            1.000_000_1,
        ];
        let t = Transform::Smooth {
            factors: BTreeMap::from([("model.layers.0.mlp.gate_proj".into(), awkward.to_vec())]),
        };
        let json = serde_json::to_string(&t).unwrap();
        let back: Transform = serde_json::from_str(&json).unwrap();
        assert_eq!(back, t);
        let base = Digest::of(b"model");
        assert_eq!(back.digest(base), t.digest(base));
        assert_ne!(t.digest(base), base);
    }

    #[test]
    fn rotations_round_trip_and_each_set_is_its_own_model() {
        let down = Transform::Rotate {
            inputs: vec![RotatedInput::MlpProduct],
        };
        let json = serde_json::to_string(&down).unwrap();
        assert!(json.contains("mlp.down_proj"), "{json}");
        assert_eq!(serde_json::from_str::<Transform>(&json).unwrap(), down);
        let every = Transform::Rotate {
            inputs: RotatedInput::ALL.to_vec(),
        };
        let base = Digest::of(b"model");
        let digests = [base, down.digest(base), every.digest(base)];
        assert!(digests[0] != digests[1] && digests[1] != digests[2] && digests[0] != digests[2]);
        let seeded = |seed| Transform::RotateResidual { seed };
        let residual = serde_json::to_string(&seeded(u64::MAX)).unwrap();
        assert_eq!(
            residual,
            r#"{"kind":"rotate-residual","seed":18446744073709551615}"#
        );
        assert_eq!(
            serde_json::from_str::<Transform>(&residual).unwrap(),
            seeded(u64::MAX)
        );
        assert_ne!(seeded(0).digest(base), seeded(1).digest(base));
        let quarot = [seeded(0), down.clone()];
        assert_ne!(transformed_digest(base, &quarot), down.digest(base));
        // Smoothing then rotating is another model than rotating alone.
        let smooth = Transform::Smooth {
            factors: BTreeMap::new(),
        };
        assert_ne!(
            transformed_digest(base, &[smooth, down.clone()]),
            transformed_digest(base, &[down])
        );
    }
}
