//! Reading W8A8 INT8 compressed-tensors checkpoints (what llm-compressor
//! writes, and what `qforge export --format compressed-tensors` writes) into
//! qforge's INT8 engine.
//!
//! A Hugging Face directory whose `config.json` carries a
//! `quantization_config` with `quant_method: compressed-tensors` and `format:
//! int-quantized` stores each quantized linear layer as `NAME.weight` (int8,
//! `[out, in]`), `NAME.weight_scale` (per output channel, `[out, 1]`, or per
//! tensor) and, for static activations, `NAME.input_scale`. Its config groups
//! say which layers they quantize (`targets`: the class `Linear`, module
//! names, or `re:` patterns matched from the start of a module's name, as
//! Python's `re.match` does) and how their inputs are quantized; `ignore`
//! lists the layers left in floating point. Each group maps onto an engine
//! qforge has:
//!
//! | weights                          | input activations                 | qforge layer              |
//! |----------------------------------|-----------------------------------|---------------------------|
//! | int8, symmetric, channel/tensor  | int8, symmetric, dynamic, token   | INT8, per-token dynamic   |
//! | int8, symmetric, channel/tensor  | int8, symmetric, static, tensor   | INT8, static scale        |
//! | int8, symmetric, channel/tensor  | none (W8A16)                      | floating point, dequantized once |
//!
//! Anything else (4-bit or float8 formats, groups, asymmetric zero points,
//! output or KV-cache quantization) is refused naming what the checkpoint
//! holds, rather than run with other numerics than its writer meant. Online
//! Hadamard transforms (`transform_config`) are read by `compressed/transforms.rs`.

mod transforms;

use std::path::Path;
use std::sync::Arc;

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use qforge_kernels::{Activations, Int8Linear};
use regex::Regex;
use safetensors::Dtype;
use serde_json::Value;

use crate::error::{Error, Result};
use crate::linear::{Linear, bf16_values};
use crate::linear::{scale_rule, usable_scale};
pub(crate) use transforms::online_rotations;
pub use transforms::{input_transform_key, input_transform_matrix};

/// Levels of a symmetric int8 quantizer.
const QMAX: f32 = 127.0;

/// The quantization a checkpoint's `config.json` declares.
pub(crate) struct Scheme {
    groups: Vec<Group>,
    ignore: Vec<Target>,
}

/// One config group: the layers it targets and how their inputs are
/// quantized (`None`: weight-only).
struct Group {
    targets: Vec<Target>,
    inputs: Option<InputScheme>,
}

#[derive(Clone, Copy)]
enum InputScheme {
    /// Per token, at run time.
    Dynamic,
    /// One calibrated scale, `NAME.input_scale`.
    Static,
}

/// What a `targets` or `ignore` entry names.
enum Target {
    /// Every linear layer (the module class `Linear`).
    AnyLinear,
    /// One module, by its full name.
    Module(String),
    /// Modules whose names match from their start (`re:PATTERN`).
    Pattern(Regex),
}

impl Target {
    fn parse(entry: &Value, at: &str) -> Result<Self> {
        let text = entry
            .as_str()
            .ok_or_else(|| Error::Format(format!("{at} holds {entry}, not a module name")))?;
        if text == "Linear" {
            return Ok(Target::AnyLinear);
        }
        match text.strip_prefix("re:") {
            Some(pattern) => Regex::new(&format!("^(?:{pattern})"))
                .map(Target::Pattern)
                .map_err(|e| Error::Format(format!("{at}: pattern {pattern:?}: {e}"))),
            None => Ok(Target::Module(text.to_owned())),
        }
    }

    fn matches(&self, module: &str) -> bool {
        match self {
            Target::AnyLinear => true,
            Target::Module(name) => name == module,
            Target::Pattern(pattern) => pattern.is_match(module),
        }
    }
}

impl Scheme {
    /// The scheme `config` (`config.json` at `path`) declares; `None` when
    /// it declares no quantization. An error names what qforge cannot run.
    pub(crate) fn from_config(config: &Value, path: &Path) -> Result<Option<Self>> {
        let Some(q) = config.get("quantization_config").filter(|q| !q.is_null()) else {
            return Ok(None);
        };
        let refuse = |why: String| {
            Err(Error::Format(format!(
                "{}: quantization_config {why}; qforge reads W8A8 INT8 compressed-tensors \
                 checkpoints (int8 symmetric weights per channel or tensor; inputs int8 \
                 symmetric per token dynamic or per tensor static, or none)",
                path.display()
            )))
        };
        let field = |name: &str| q.get(name).and_then(Value::as_str).unwrap_or("");
        if field("quant_method") != "compressed-tensors" {
            return refuse(format!("has quant_method {:?}", field("quant_method")));
        }
        if field("format") != "int-quantized" {
            return refuse(format!("has format {:?}", field("format")));
        }
        if field("quantization_status") != "compressed" {
            return refuse(format!(
                "has quantization_status {:?}, not compressed",
                field("quantization_status")
            ));
        }
        if q.get("kv_cache_scheme").is_some_and(|s| !s.is_null()) {
            return refuse("quantizes the KV cache".into());
        }
        let groups = q
            .get("config_groups")
            .and_then(Value::as_object)
            .ok_or_else(|| Error::Format(format!("{}: no config_groups", path.display())))?;
        let mut parsed = Vec::with_capacity(groups.len());
        for (name, group) in groups {
            match Group::parse(group, name) {
                Ok(group) => parsed.push(group),
                Err(why) => return refuse(format!("group {name} {why}")),
            }
        }
        let ignore = match q.get("ignore") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(entries)) => entries
                .iter()
                .map(|e| Target::parse(e, "quantization_config.ignore"))
                .collect::<Result<_>>()?,
            Some(other) => return refuse(format!("has ignore {other}, not a list")),
        };
        Ok(Some(Self {
            groups: parsed,
            ignore,
        }))
    }

    /// The group quantizing linear layer `name`; `None` when it is ignored
    /// or no group targets it.
    fn group_of(&self, name: &str) -> Option<&Group> {
        if self.ignore.iter().any(|t| t.matches(name)) {
            return None;
        }
        self.groups
            .iter()
            .find(|g| g.targets.iter().any(|t| t.matches(name)))
    }

    /// Linear layer `name` of the checkpoint in `tensors`, if the scheme
    /// quantizes it; `None`: it is stored in floating point.
    pub(crate) fn linear(
        &self,
        tensors: &MmapedSafetensors,
        name: &str,
        bias: Option<Tensor>,
        (out, inp): (usize, usize),
    ) -> Result<Option<Linear>> {
        let weight_name = format!("{name}.weight");
        let Some(group) = self.group_of(name) else {
            if tensors.get(&weight_name)?.dtype() == Dtype::I8 {
                return Err(Error::Format(format!(
                    "{weight_name} is int8 but quantization_config ignores {name} or targets \
                     it in no group; the checkpoint is inconsistent"
                )));
            }
            return Ok(None);
        };
        let view = tensors.get(&weight_name)?;
        if view.dtype() != Dtype::I8 || view.shape() != [out, inp] {
            return Err(Error::Format(format!(
                "{weight_name} is {:?} {:?}; a layer quantization_config quantizes holds I8 \
                 [{out}, {inp}]",
                view.dtype(),
                view.shape()
            )));
        }
        let values: Vec<i8> = view.data().iter().map(|&b| b as i8).collect();
        let scales = weight_scales(tensors, name, out)?;
        check_no_zero_points(tensors, name)?;
        let bias = bias
            .map(|b| b.to_dtype(DType::F32)?.to_vec1::<f32>())
            .transpose()?;
        let activations = match group.inputs {
            None => return dequantized(name, &values, &scales, bias, (out, inp)).map(Some),
            Some(InputScheme::Dynamic) => Activations::Dynamic,
            Some(InputScheme::Static) => Activations::Static(input_scale(tensors, name)?),
        };
        Ok(Some(Linear::Int8(Arc::new(Int8Linear::from_quantized(
            &values,
            scales,
            (out, inp),
            bias.as_deref(),
            activations,
        )?))))
    }
}

impl Group {
    /// The group `group`; the error (a phrase after "group NAME") says what
    /// qforge cannot run.
    fn parse(group: &Value, name: &str) -> std::result::Result<Self, String> {
        let targets = group
            .get("targets")
            .and_then(Value::as_array)
            .ok_or("has no targets")?
            .iter()
            .map(|t| Target::parse(t, &format!("group {name}'s targets")))
            .collect::<Result<Vec<_>>>()
            .map_err(|e| e.to_string())?;
        if group
            .get("output_activations")
            .is_some_and(|a| !a.is_null())
        {
            return Err("quantizes output activations".into());
        }
        let weights = group.get("weights").ok_or("has no weights")?;
        check_int8_symmetric(weights, "weights")?;
        let strategy = weights.get("strategy").and_then(Value::as_str);
        if !matches!(strategy, Some("channel" | "tensor")) {
            return Err(format!("has weights by strategy {strategy:?}"));
        }
        if weights.get("dynamic").and_then(Value::as_bool) == Some(true) {
            return Err("has dynamic weights".into());
        }
        let inputs = match group.get("input_activations") {
            None | Some(Value::Null) => None,
            Some(inputs) => {
                check_int8_symmetric(inputs, "input activations")?;
                let dynamic = inputs.get("dynamic").and_then(Value::as_bool);
                let strategy = inputs.get("strategy").and_then(Value::as_str);
                Some(match (dynamic, strategy) {
                    (Some(true), Some("token")) => InputScheme::Dynamic,
                    (Some(false) | None, Some("tensor")) => InputScheme::Static,
                    _ => {
                        return Err(format!(
                            "has input activations dynamic {dynamic:?} by strategy {strategy:?}"
                        ));
                    }
                })
            }
        };
        Ok(Self { targets, inputs })
    }
}

/// Refuses a quantization args object that is not 8-bit symmetric integers
/// without groups.
fn check_int8_symmetric(args: &Value, what: &str) -> std::result::Result<(), String> {
    let bits = args.get("num_bits").and_then(Value::as_u64);
    let kind = args.get("type").and_then(Value::as_str).unwrap_or("int");
    let symmetric = args.get("symmetric").and_then(Value::as_bool);
    let grouped = args.get("group_size").is_some_and(|g| !g.is_null());
    if bits != Some(8) || kind != "int" || symmetric == Some(false) || grouped {
        return Err(format!(
            "has {what} of {bits:?} bits, type {kind:?}, symmetric {symmetric:?}, group size {}",
            args.get("group_size").unwrap_or(&Value::Null)
        ));
    }
    Ok(())
}

/// The float values of tensor `name` (F32, BF16 or F16).
fn floats(tensors: &MmapedSafetensors, name: &str) -> Result<(Vec<f32>, Vec<usize>)> {
    let view = tensors.get(name)?;
    let data = view.data();
    let values = match view.dtype() {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::BF16 => bf16_values(data).collect(),
        Dtype::F16 => Tensor::from_raw_buffer(data, DType::F16, &[data.len() / 2], &Device::Cpu)?
            .to_dtype(DType::F32)?
            .to_vec1()?,
        other => {
            return Err(Error::Format(format!(
                "{name} is {other:?}; a scale is F32, BF16 or F16"
            )));
        }
    };
    Ok((values, view.shape().to_vec()))
}

/// Refuses a scale the INT8 engine cannot step by (the rule every artifact
/// scale follows).
fn check_scale(name: &str, scale: f32) -> Result<()> {
    if usable_scale(scale, QMAX) {
        return Ok(());
    }
    Err(Error::Format(format!(
        "{name} holds {scale:?}; {}",
        scale_rule(QMAX)
    )))
}

/// `NAME.weight_scale`, one per output channel (a per-tensor scale repeated).
fn weight_scales(tensors: &MmapedSafetensors, name: &str, out: usize) -> Result<Vec<f32>> {
    let scale_name = format!("{name}.weight_scale");
    let (scales, shape) = floats(tensors, &scale_name)?;
    let scales = match scales.len() {
        n if n == out && matches!(shape[..], [o, 1] | [o] if o == out) => scales,
        1 => vec![scales[0]; out],
        _ => {
            return Err(Error::Format(format!(
                "{scale_name} is {shape:?}, expected [{out}, 1] (per channel) or [1] (per tensor)"
            )));
        }
    };
    for &scale in &scales {
        check_scale(&scale_name, scale)?;
    }
    Ok(scales)
}

/// `NAME.input_scale`, one for the tensor.
fn input_scale(tensors: &MmapedSafetensors, name: &str) -> Result<f32> {
    let scale_name = format!("{name}.input_scale");
    let (scales, shape) = floats(tensors, &scale_name).map_err(|e| {
        Error::Format(format!(
            "{name} has static input activations but no readable {scale_name}: {e}"
        ))
    })?;
    let [scale] = scales[..] else {
        return Err(Error::Format(format!(
            "{scale_name} is {shape:?}; a per-tensor scale holds one value"
        )));
    };
    check_scale(&scale_name, scale)?;
    Ok(scale)
}

/// Refuses nonzero zero points: qforge's engine is symmetric. Writers store
/// zeros for symmetric schemes, or nothing.
fn check_no_zero_points(tensors: &MmapedSafetensors, name: &str) -> Result<()> {
    for which in ["weight_zero_point", "input_zero_point"] {
        let zero_name = format!("{name}.{which}");
        let Ok(view) = tensors.get(&zero_name) else {
            continue;
        };
        if view.data().iter().any(|&b| b != 0) {
            return Err(Error::Format(format!(
                "{zero_name} holds nonzero zero points; qforge runs symmetric int8 only"
            )));
        }
    }
    Ok(())
}

/// A weight-only (W8A16) layer: its int8 weights times their scales, in
/// floating point once, as the writer's runtime computes them.
fn dequantized(
    name: &str,
    values: &[i8],
    scales: &[f32],
    bias: Option<Vec<f32>>,
    (out, inp): (usize, usize),
) -> Result<Linear> {
    let weight: Vec<f32> = values
        .chunks_exact(inp)
        .zip(scales)
        .flat_map(|(row, &s)| row.iter().map(move |&v| f32::from(v) * s))
        .collect();
    let bias = bias
        .map(|b| Tensor::from_vec(b, out, &Device::Cpu))
        .transpose()?;
    Linear::fp(
        name,
        Tensor::from_vec(weight, (out, inp), &Device::Cpu)?,
        bias,
        (out, inp),
    )
}
