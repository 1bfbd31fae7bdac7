//! compressed-tensors' online transforms (`quantization_config.transform_config`)
//! read into the online Hadamard rotations qforge's forward applies.
//!
//! A transform group (a "scheme") names a matrix type and where it applies:
//! `targets` and `ignore` as the quantization groups have them, and a
//! `location`. An `input` location is online: the runtime multiplies each
//! input row `x` of a targeted linear layer by the stored matrix `H`
//! (`NAME.SCHEME_input.weight`, `[n, n]`) divided by `√n`, `x H / √n`
//! (`x Hᵀ / √n` with `inverse`), as vLLM's `HadamardTransform` and
//! compressed-tensors' own hooks do. The `weight_input` and `weight_output`
//! locations are offline: a compressed checkpoint holds their product in its
//! weights already, so a reader has nothing left to do for them.
//!
//! qforge rotates an input by its own Hadamard construction for every layer
//! that reads it ([`RotatedInput`]), so it reads a transform configuration
//! when it says exactly that: every consumer of an input in every decoder
//! layer carries the same online input transform, whose matrix is qforge's
//! ([`Hadamard::signs`]), and nothing else is transformed online. This is
//! what `qforge export --format compressed-tensors` writes for an artifact
//! with online rotations. Anything else (another matrix, a block size
//! (`head_dim`), a random permutation, output or attention locations, a
//! rotation of some consumers of an input but not all) is refused naming
//! it: running such a checkpoint without its transforms gives a model that
//! loads and answers garbage.

use std::path::Path;

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device};
use qforge_kernels::Hadamard;
use serde_json::Value;

use super::Target;
use crate::error::{Error, Result};
use crate::llama::RotatedInput;
use qforge_formats::llama_config::LlamaConfig;

/// The checkpoint tensor holding scheme `scheme`'s matrix for the input of
/// module `module`: vLLM and compressed-tensors register the transform as
/// a submodule named `{scheme}_{location}` of the module it transforms.
pub fn input_transform_key(module: &str, scheme: &str) -> String {
    format!("{module}.{scheme}_input.weight")
}

/// The ±1 matrix `H` a compressed-tensors input transform stores for
/// `input` rotated by qforge in a model of config `config` (applied as
/// `x H / √n`): qforge's Hadamard construction of the input's width.
pub fn input_transform_matrix(input: RotatedInput, config: &LlamaConfig) -> Result<Vec<f32>> {
    let rotation = Hadamard::new(input.width(config)).map_err(|e| {
        qforge_formats::Error::Unsupported(format!("rotating the {} inputs: {e}", input.name()))
    })?;
    Ok(rotation.signs())
}

/// One online input transform of a scheme.
struct Online {
    scheme: String,
    targets: Vec<Target>,
    ignore: Vec<Target>,
    /// `x Hᵀ / √n` rather than `x H / √n`.
    inverse: bool,
}

impl Online {
    fn applies_to(&self, module: &str) -> bool {
        self.targets.iter().any(|t| t.matches(module))
            && !self.ignore.iter().any(|t| t.matches(module))
    }
}

/// The online rotations the checkpoint's transform configuration (in
/// `quantization`, the `quantization_config` of `config.json` at `path`)
/// declares, checked against the matrices in `tensors`; empty when it
/// declares none. An error names what qforge cannot run.
pub(crate) fn online_rotations(
    quantization: &Value,
    config: &LlamaConfig,
    tensors: &MmapedSafetensors,
    path: &Path,
) -> Result<Vec<RotatedInput>> {
    let refuse = |why: String| {
        Error::Format(format!(
            "{}: quantization_config.transform_config {why}; qforge runs online transforms \
             that rotate an input of every decoder layer by its own Hadamard matrix, as \
             `qforge export --format compressed-tensors` writes them. To run this model on \
             qforge, quantize its unquantized checkpoint with `qforge quantize` (its \
             `--hadamard` rotations are of that kind), or serve this checkpoint with vLLM",
            path.display()
        ))
    };
    let transforms = online_transforms(quantization).map_err(&refuse)?;
    let mut rotations = Vec::new();
    let mut used = vec![false; transforms.len()];
    for input in RotatedInput::ALL {
        let modules = consumer_modules(input, config);
        // vLLM keeps the last scheme that matches a layer and
        // compressed-tensors applies every one: two on one input have no
        // meaning both agree on.
        for module in &modules {
            let mut matching = transforms.iter().filter(|t| t.applies_to(module));
            if let (Some(a), Some(b)) = (matching.next(), matching.next()) {
                return Err(refuse(format!(
                    "transforms the input of {module} twice (schemes {} and {})",
                    a.scheme, b.scheme
                )));
            }
        }
        let chosen: Vec<Option<usize>> = modules
            .iter()
            .map(|m| transforms.iter().position(|t| t.applies_to(m)))
            .collect();
        let Some(first) = chosen.iter().flatten().next().copied() else {
            continue;
        };
        if input == RotatedInput::Head {
            return Err(refuse(format!(
                "transforms lm_head's input (scheme {}), which qforge's exports never write \
                 and its reader does not apply",
                transforms[first].scheme
            )));
        }
        if let Some(i) = chosen.iter().position(|c| *c != Some(first)) {
            return Err(refuse(format!(
                "transforms the input of {} (scheme {}) but not that of {} the same way",
                modules[chosen.iter().position(|c| c.is_some()).expect("one is")],
                transforms[first].scheme,
                modules[i]
            )));
        }
        used[first] = true;
        let transform = &transforms[first];
        let expected = input_transform_matrix(input, config)?;
        for module in &modules {
            check_matrix(tensors, module, transform, &expected).map_err(&refuse)?;
        }
        rotations.push(input);
    }
    if let Some(unused) = used.iter().position(|u| !u) {
        return Err(refuse(format!(
            "has scheme {}, whose online input transform reaches no linear layer input \
             qforge rotates",
            transforms[unused].scheme
        )));
    }
    Ok(rotations)
}

/// Every module reading `input`, in layer order.
fn consumer_modules(input: RotatedInput, config: &LlamaConfig) -> Vec<String> {
    if input == RotatedInput::Head {
        return vec!["lm_head".to_owned()];
    }
    (0..config.num_layers)
        .flat_map(|i| {
            input
                .consumers()
                .iter()
                .map(move |m| format!("model.layers.{i}.{m}"))
        })
        .collect()
}

/// The online input transforms of `quantization`'s `transform_config`
/// (none when it has none); an error says what else it holds.
fn online_transforms(quantization: &Value) -> std::result::Result<Vec<Online>, String> {
    let Some(groups) = quantization
        .get("transform_config")
        .filter(|t| !t.is_null())
        .and_then(|t| t.get("config_groups"))
        .filter(|g| !g.is_null())
    else {
        return Ok(Vec::new());
    };
    let groups = groups
        .as_object()
        .ok_or_else(|| format!("has config_groups {groups}, not an object"))?;
    let mut online = Vec::new();
    for (scheme, group) in groups {
        let field = |name: &str| group.get(name).filter(|v| !v.is_null());
        let kind = field("type").and_then(Value::as_str).unwrap_or("");
        if !matches!(kind, "hadamard" | "random-hadamard") {
            return Err(format!("has scheme {scheme} of type {kind:?}"));
        }
        if let Some(head_dim) = field("head_dim") {
            return Err(format!(
                "has scheme {scheme} in blocks of {head_dim} (head_dim)"
            ));
        }
        if field("randomize").and_then(Value::as_bool) == Some(true) {
            return Err(format!("has scheme {scheme} with randomized permutations"));
        }
        let apply = field("apply")
            .and_then(Value::as_array)
            .ok_or_else(|| format!("has scheme {scheme} without an apply list"))?;
        for args in apply {
            let location = args.get("location").and_then(Value::as_str).unwrap_or("");
            match location {
                "input" => {}
                // Offline: already in the stored weights.
                "weight_input" | "weight_output" => continue,
                other => return Err(format!("has scheme {scheme} at location {other:?}")),
            }
            let targets = |key: &str| -> std::result::Result<Vec<Target>, String> {
                match args.get(key) {
                    None | Some(Value::Null) => Ok(Vec::new()),
                    Some(Value::String(_)) => Ok(vec![target(&args[key], scheme)?]),
                    Some(Value::Array(entries)) => {
                        entries.iter().map(|e| target(e, scheme)).collect()
                    }
                    Some(other) => Err(format!("has scheme {scheme} with {key} {other}")),
                }
            };
            online.push(Online {
                scheme: scheme.clone(),
                targets: targets("targets")?,
                ignore: targets("ignore")?,
                inverse: args.get("inverse").and_then(Value::as_bool) == Some(true),
            });
        }
    }
    Ok(online)
}

fn target(entry: &Value, scheme: &str) -> std::result::Result<Target, String> {
    Target::parse(entry, &format!("scheme {scheme}")).map_err(|e| e.to_string())
}

/// Checks that `module`'s stored matrix for `transform` applies `expected`
/// (qforge's ±1 matrix `H`, applied as `x H / √n`).
fn check_matrix(
    tensors: &MmapedSafetensors,
    module: &str,
    transform: &Online,
    expected: &[f32],
) -> std::result::Result<(), String> {
    let key = input_transform_key(module, &transform.scheme);
    let n = (expected.len() as f64).sqrt() as usize;
    let stored = tensors
        .load(&key, &Device::Cpu)
        .and_then(|t| t.to_dtype(DType::F32))
        .map_err(|e| {
            format!(
                "has scheme {} for {module}, but {key}: {e}",
                transform.scheme
            )
        })?;
    if stored.dims() != [n, n] {
        return Err(format!(
            "has scheme {}: {key} is {:?}, not the [{n}, {n}] of {module}'s input",
            transform.scheme,
            stored.dims()
        ));
    }
    let stored = stored
        .flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(|e| format!("{key}: {e}"))?;
    let applied = |i: usize, j: usize| {
        if transform.inverse {
            stored[j * n + i]
        } else {
            stored[i * n + j]
        }
    };
    let same = (0..n).all(|i| (0..n).all(|j| applied(i, j) == expected[i * n + j]));
    if !same {
        return Err(format!(
            "has scheme {}: {key} is not qforge's Hadamard matrix of size {n} (its \
             construction H_m ⊗ H_2^k, entries ±1), which is the only one qforge's engine \
             applies online",
            transform.scheme
        ));
    }
    Ok(())
}
