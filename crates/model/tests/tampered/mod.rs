//! The attacks of issue 55, point 5, shared by the tests of every crate
//! whose commands read an artifact (`#[path]`-included there): the CartPole
//! policy as an artifact, one number edited, and the manifest rewritten to
//! match, as anyone who can edit an artifact can. The hashes then pass, so
//! whatever refuses the artifact refuses it for its numbers.

#![allow(dead_code)] // each test file uses its own subset

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use qforge_formats::manifest::{read_manifest, write_manifest};
use qforge_formats::profile::{CalibrationProfile, PointProfile};
use qforge_model::MlpPolicy;
use qforge_model::artifact::{LayerPrecision, write_policy};

/// The repository root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `layers.0`'s activation scale in [`cartpole_artifact`]: exact in JSON,
/// and within the range its `calibration.json` records (abs-max 2).
pub const INPUT_SCALE: &str = "0.015625";

/// The CartPole policy written as an artifact into `dir`: `layers.0` int8
/// with a static activation scale, `layers.1` int8 with dynamic ones,
/// `layers.2` in full precision; `calibration.json` recording `layers.0`'s
/// range, and a manifest.
pub fn cartpole_artifact(dir: &Path) {
    let policy = MlpPolicy::from_dir(&root().join("fixtures/policies/cartpole")).unwrap();
    let points: BTreeMap<String, LayerPrecision> = [
        (
            "layers.0",
            LayerPrecision::Int8Static {
                input_scale: INPUT_SCALE.parse().unwrap(),
            },
        ),
        ("layers.1", LayerPrecision::Int8Dynamic),
        ("layers.2", LayerPrecision::Fp),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    write_policy(dir, &policy, &points).unwrap();
    let recorded = PointProfile {
        abs_max: 2.0,
        values: 1000,
        zero_share: 0.0,
        octave_shares: BTreeMap::from([(120, 0.5), (127, 0.5)]),
    };
    CalibrationProfile {
        points: BTreeMap::from([("layers.0".to_owned(), recorded)]),
    }
    .write(dir)
    .unwrap();
    write_manifest(dir, serde_json::json!({"test": true})).unwrap();
}

/// One edit of an artifact.
#[derive(Debug, Clone, Copy)]
pub enum Edit {
    /// The first value of an F32 tensor of `model.safetensors`.
    Tensor { name: &'static str, value: f32 },
    /// `layers.0`'s `input_scale` in `qforge.json`, as written in JSON.
    InputScale(&'static str),
}

/// An edit and what the refusal of it says.
#[derive(Debug, Clone, Copy)]
pub struct Attack {
    pub edit: Edit,
    pub expected: &'static str,
}

/// Every attack: scales whose reciprocal is infinite (1e-40, subnormal),
/// whose top level overflows (3e38), that are NaN, or that saturate every
/// calibrated activation (1e-30), and an infinite bias.
pub const ATTACKS: [Attack; 7] = [
    Attack {
        edit: Edit::Tensor {
            name: "layers.1.weight_scale",
            value: 1e-40,
        },
        expected: "layers.1.weight_scale holds 1e-40 at index 0",
    },
    Attack {
        edit: Edit::Tensor {
            name: "layers.1.weight_scale",
            value: 3e38,
        },
        expected: "layers.1.weight_scale holds 3e38 at index 0",
    },
    Attack {
        edit: Edit::Tensor {
            name: "layers.0.weight_scale",
            value: f32::NAN,
        },
        expected: "layers.0.weight_scale holds NaN at index 0",
    },
    Attack {
        edit: Edit::Tensor {
            name: "layers.0.bias",
            value: f32::INFINITY,
        },
        expected: "layers.0.bias holds inf at index 0",
    },
    Attack {
        edit: Edit::InputScale("1e-40"),
        expected: "layers.0 has input_scale 1e-40",
    },
    Attack {
        edit: Edit::InputScale("1e-30"),
        expected: "layers.0 has input_scale 1e-30, outside",
    },
    Attack {
        edit: Edit::InputScale("3e38"),
        expected: "layers.0 has input_scale 3e38",
    },
];

/// What every refusal tells the user to do.
pub const REMEDY: &str = "write it again with `qforge quantize`";

impl Attack {
    /// Edits the artifact in `dir` and rewrites its manifest to match.
    pub fn apply(&self, dir: &Path) {
        match self.edit {
            Edit::Tensor { name, value } => {
                let path = dir.join("model.safetensors");
                let mut bytes = std::fs::read(&path).unwrap();
                let start = tensor_start(&bytes, name);
                bytes[start..start + 4].copy_from_slice(&value.to_le_bytes());
                std::fs::write(&path, bytes).unwrap();
            }
            Edit::InputScale(scale) => {
                let path = dir.join("qforge.json");
                let text = std::fs::read_to_string(&path).unwrap();
                let old = format!("\"input_scale\": {INPUT_SCALE}");
                assert!(text.contains(&old), "{text}");
                let new = format!("\"input_scale\": {scale}");
                std::fs::write(&path, text.replace(&old, &new)).unwrap();
            }
        }
        let info = read_manifest(dir).unwrap().info;
        write_manifest(dir, info).unwrap();
    }
}

/// Where tensor `name`'s bytes start in the safetensors file `bytes`: after
/// the 8-byte header length and the JSON header, at its first data offset.
fn tensor_start(bytes: &[u8], name: &str) -> usize {
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let json: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header]).unwrap();
    let offset = json[name]["data_offsets"][0].as_u64().unwrap();
    8 + header + offset as usize
}
