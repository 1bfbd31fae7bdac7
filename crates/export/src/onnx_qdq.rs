//! ONNX QDQ for MLP policies (opset 13): each INT8 layer's weights are an
//! int8 initializer behind `DequantizeLinear` (per output channel, axis 0,
//! zero point 0) feeding `Gemm` (transB = 1, bias); a static input goes
//! through `QuantizeLinear` → `DequantizeLinear` with its calibrated scale.
//! QDQ has no per-token scale, so a dynamic input is quantized by the
//! explicit ops that define it — `s = max|x_row| / 127`, `q = clip(round(x ·
//! 1/s), ±127)`, `x' = q · s` — the same arithmetic as qforge's engine. FP
//! layers are plain `Gemm`s over f32 weights. The graph's input is
//! `observations` `[N, observation_dim]`, its output `outputs` `[N, head]`
//! (logits, Gaussian means before clipping, or values).

use std::path::Path;

use prost::Message;
use std::collections::BTreeMap;

use qforge_formats::onnx::proto::{
    AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TensorProto,
    TensorShapeProto, TypeProto, ValueInfoProto, attribute_proto, tensor_proto, tensor_shape_proto,
    type_proto,
};
use qforge_formats::policy::Activation;
use qforge_formats::policy::PolicyConfig;
use qforge_model::artifact::LayerPrecision;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

use crate::error::{Error, Result};

/// The opset written: the first with per-axis QuantizeLinear/DequantizeLinear.
pub const OPSET: i64 = 13;
/// ONNX IR version of opset 13 (ONNX 1.8).
const IR_VERSION: i64 = 7;

/// What an ONNX export did.
#[derive(Debug, Clone, PartialEq)]
pub struct OnnxExport {
    /// Layers with int8 weights (QDQ).
    pub int8_layers: usize,
    /// Layers left in f32.
    pub fp_layers: usize,
}

/// Builds the graph node by node.
#[derive(Default)]
struct Graph {
    nodes: Vec<NodeProto>,
    initializers: Vec<TensorProto>,
}

fn int_attribute(name: &str, value: i64) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        i: value,
        r#type: attribute_proto::AttributeType::Int as i32,
        ..Default::default()
    }
}

fn ints_attribute(name: &str, values: &[i64]) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        ints: values.to_vec(),
        r#type: attribute_proto::AttributeType::Ints as i32,
        ..Default::default()
    }
}

impl Graph {
    fn node(&mut self, op: &str, inputs: &[&str], output: &str, attributes: Vec<AttributeProto>) {
        self.nodes.push(NodeProto {
            input: inputs.iter().map(|s| (*s).to_owned()).collect(),
            output: vec![output.to_owned()],
            name: output.to_owned(),
            op_type: op.into(),
            attribute: attributes,
            ..Default::default()
        });
    }

    fn floats(&mut self, name: &str, dims: &[usize], values: &[f32]) {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.initializer(name, dims, tensor_proto::DataType::Float, bytes);
    }

    fn int8s(&mut self, name: &str, dims: &[usize], values: &[i8]) {
        let bytes = values.iter().map(|v| v.to_le_bytes()[0]).collect();
        self.initializer(name, dims, tensor_proto::DataType::Int8, bytes);
    }

    /// A constant of `dims` whose little-endian values are `raw_data`.
    fn initializer(
        &mut self,
        name: &str,
        dims: &[usize],
        data_type: tensor_proto::DataType,
        raw_data: Vec<u8>,
    ) {
        self.initializers.push(TensorProto {
            name: name.into(),
            dims: dims.iter().map(|&d| d as i64).collect(),
            data_type: data_type as i32,
            raw_data,
            ..Default::default()
        });
    }
}

fn value_info(name: &str, dims: [Option<usize>; 2]) -> ValueInfoProto {
    let dim = dims
        .iter()
        .map(|d| tensor_shape_proto::Dimension {
            value: Some(match d {
                Some(n) => tensor_shape_proto::dimension::Value::DimValue(*n as i64),
                None => tensor_shape_proto::dimension::Value::DimParam("N".into()),
            }),
            ..Default::default()
        })
        .collect();
    ValueInfoProto {
        name: name.into(),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: tensor_proto::DataType::Float as i32,
                shape: Some(TensorShapeProto { dim }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn floats_of(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// The tensors of the `model.safetensors` being exported, with errors that
/// name that file (the artifact and its `qforge.json` can disagree).
struct Weights<'a> {
    tensors: SafeTensors<'a>,
    path: &'a Path,
}

impl<'a> Weights<'a> {
    fn parse(bytes: &'a [u8], path: &'a Path) -> Result<Self> {
        let tensors = SafeTensors::deserialize(bytes)
            .map_err(|e| Error::Inconsistent(format!("{}: {e}", path.display())))?;
        Ok(Self { tensors, path })
    }

    fn tensor(&self, name: &str) -> Result<TensorView<'a>> {
        self.tensors
            .tensor(name)
            .map_err(|e| Error::Inconsistent(format!("{}: {name}: {e}", self.path.display())))
    }
}

impl Graph {
    /// Initializers that several layers read, added once and only when some
    /// layer needs them, so the graph holds no unused initializer.
    fn shared_constants(&mut self, points: &BTreeMap<String, LayerPrecision>) {
        if points
            .values()
            .any(|p| matches!(p, LayerPrecision::Int8Static { .. }))
        {
            self.int8s("qdq.zero", &[], &[0]);
        }
        if points.values().any(|p| *p == LayerPrecision::Int8Dynamic) {
            self.floats("qdq.limit_low", &[], &[-127.0]);
            self.floats("qdq.limit_high", &[], &[127.0]);
            self.floats("qdq.levels", &[], &[127.0]);
            self.floats("qdq.tiny", &[], &[f32::MIN_POSITIVE]);
        }
    }

    /// The weight `{name}.weight`, f32 `[out, in]` as the Gemm reads it: an
    /// initializer for an FP layer, the stored int8 values behind a
    /// per-channel `DequantizeLinear` for an INT8 one (never requantized).
    /// Returns whether the layer is INT8; a weight whose dtype disagrees
    /// with `qforge.json` is an error.
    fn weight(
        &mut self,
        weights: &Weights,
        name: &str,
        precision: LayerPrecision,
        (out, inp): (usize, usize),
    ) -> Result<bool> {
        let weight = format!("{name}.weight");
        let view = weights.tensor(&weight)?;
        match (precision, view.dtype()) {
            (LayerPrecision::Fp, Dtype::F32) => {
                self.floats(&weight, &[out, inp], &floats_of(view.data()));
                Ok(false)
            }
            // The artifact keeps a bf16 policy's full-precision weights in bf16.
            (LayerPrecision::Fp, Dtype::BF16) => {
                let values: Vec<f32> = qforge_model::linear::bf16_values(view.data()).collect();
                self.floats(&weight, &[out, inp], &values);
                Ok(false)
            }
            (LayerPrecision::Int8Dynamic | LayerPrecision::Int8Static { .. }, Dtype::I8) => {
                let values: Vec<i8> = view.data().iter().map(|&b| b as i8).collect();
                let scales = floats_of(weights.tensor(&format!("{name}.weight_scale"))?.data());
                self.int8s(&format!("{weight}_quantized"), &[out, inp], &values);
                self.floats(&format!("{weight}_scale"), &[out], &scales);
                self.int8s(&format!("{weight}_zero_point"), &[out], &vec![0; out]);
                self.node(
                    "DequantizeLinear",
                    &[
                        &format!("{weight}_quantized"),
                        &format!("{weight}_scale"),
                        &format!("{weight}_zero_point"),
                    ],
                    &weight,
                    vec![int_attribute("axis", 0)],
                );
                Ok(true)
            }
            (p, dtype) => Err(Error::Inconsistent(format!(
                "{name} is {} in qforge.json but its weight is {dtype:?}",
                p.name()
            ))),
        }
    }

    /// The input `x` of layer `name` as the engine quantizes it; returns the
    /// value the Gemm reads.
    fn layer_input(&mut self, name: &str, precision: LayerPrecision, x: &str) -> String {
        match precision {
            LayerPrecision::Fp => x.to_owned(),
            LayerPrecision::Int8Static { input_scale } => self.static_input(name, input_scale, x),
            LayerPrecision::Int8Dynamic => self.dynamic_input(name, x),
        }
    }

    /// A static input: QuantizeLinear → DequantizeLinear with the calibrated
    /// scale and the shared zero point.
    fn static_input(&mut self, name: &str, input_scale: f32, x: &str) -> String {
        self.floats(&format!("{name}.input_scale"), &[], &[input_scale]);
        let scale = format!("{name}.input_scale");
        self.node(
            "QuantizeLinear",
            &[x, &scale, "qdq.zero"],
            &format!("{name}.input_quantized"),
            vec![],
        );
        self.node(
            "DequantizeLinear",
            &[&format!("{name}.input_quantized"), &scale, "qdq.zero"],
            &format!("{name}.input_dq"),
            vec![],
        );
        format!("{name}.input_dq")
    }

    /// A dynamic input: QDQ has no per-token scale, so the engine's
    /// arithmetic is spelled out op by op (`s = max|x_row| / 127`, `q =
    /// clip(round(x · 1/s), ±127)`, `x' = q · s`), in the engine's order
    /// (a reciprocal, then a multiply), so the graph rounds as it does.
    fn dynamic_input(&mut self, name: &str, x: &str) -> String {
        let p = |s: &str| format!("{name}.{s}");
        self.node("Abs", &[x], &p("abs"), vec![]);
        self.node(
            "ReduceMax",
            &[&p("abs")],
            &p("row_max"),
            vec![ints_attribute("axes", &[1]), int_attribute("keepdims", 1)],
        );
        self.node(
            "Max",
            &[&p("row_max"), "qdq.tiny"],
            &p("row_max_pos"),
            vec![],
        );
        self.node(
            "Div",
            &[&p("row_max_pos"), "qdq.levels"],
            &p("row_scale"),
            vec![],
        );
        self.node("Reciprocal", &[&p("row_scale")], &p("row_inverse"), vec![]);
        self.node("Mul", &[x, &p("row_inverse")], &p("scaled"), vec![]);
        self.node(
            "Clip",
            &[&p("scaled"), "qdq.limit_low", "qdq.limit_high"],
            &p("clipped"),
            vec![],
        );
        self.node("Round", &[&p("clipped")], &p("rounded"), vec![]);
        self.node(
            "Mul",
            &[&p("rounded"), &p("row_scale")],
            &p("input_dq"),
            vec![],
        );
        p("input_dq")
    }

    /// The Gemm of layer `name` on `input`, then the policy's activation
    /// unless it is the last layer, whose Gemm writes the graph output
    /// `outputs` (the head's raw values: logits, means before clipping or
    /// values). Returns the value the next layer reads.
    fn gemm_and_activation(
        &mut self,
        name: &str,
        input: &str,
        last: bool,
        activation: Activation,
    ) -> String {
        let y = if last {
            "outputs".to_owned()
        } else {
            format!("{name}.output")
        };
        self.node(
            "Gemm",
            &[input, &format!("{name}.weight"), &format!("{name}.bias")],
            &y,
            vec![int_attribute("transB", 1)],
        );
        if last {
            return y;
        }
        let activated = format!("{name}.activated");
        let op = match activation {
            Activation::Tanh => "Tanh",
            Activation::Relu => "Relu",
        };
        self.node(op, &[&y], &activated, vec![]);
        activated
    }

    /// The finished model: opset 13, input `observations` `[N,
    /// observation_dim]`, output `outputs` `[N, head]`.
    fn into_model(self, policy: &PolicyConfig) -> ModelProto {
        ModelProto {
            ir_version: IR_VERSION,
            producer_name: "qforge".into(),
            producer_version: env!("CARGO_PKG_VERSION").into(),
            opset_import: vec![OperatorSetIdProto {
                domain: String::new(),
                version: OPSET,
            }],
            graph: Some(GraphProto {
                name: "qforge_policy".into(),
                node: self.nodes,
                initializer: self.initializers,
                input: vec![value_info(
                    "observations",
                    [None, Some(policy.observation_dim)],
                )],
                output: vec![value_info("outputs", [None, Some(policy.head.outputs())])],
                ..Default::default()
            }),
            ..Default::default()
        }
    }
}

/// Writes `dest/model.onnx` for the policy `policy` whose tensors are in
/// `weights_path` (a native artifact's, or a full-precision policy's
/// `model.safetensors`), each layer in the precision `points` gives it.
pub fn export_onnx(
    weights_path: &Path,
    points: &BTreeMap<String, LayerPrecision>,
    policy: &PolicyConfig,
    dest: &Path,
) -> Result<OnnxExport> {
    let bytes =
        std::fs::read(weights_path).map_err(|e| qforge_model::Error::io(weights_path, e))?;
    let weights = Weights::parse(&bytes, weights_path)?;
    let mut widths = vec![policy.observation_dim];
    widths.extend(&policy.hidden);
    widths.push(policy.head.outputs());

    let mut g = Graph::default();
    g.shared_constants(points);
    let (mut int8_layers, mut fp_layers) = (0, 0);
    let mut x = "observations".to_owned();
    // A smoothed policy divides each observation feature before its first
    // layer (qforge's forward does the same).
    if let Some(divisors) = &policy.observation_divisors {
        g.floats("observation_divisors", &[1, divisors.len()], divisors);
        g.node(
            "Div",
            &["observations", "observation_divisors"],
            "observations_smoothed",
            vec![],
        );
        x = "observations_smoothed".to_owned();
    }
    let last = widths.len() - 2;
    for i in 0..=last {
        let name = format!("layers.{i}");
        let (inp, out) = (widths[i], widths[i + 1]);
        let precision = points.get(&name).copied().ok_or_else(|| {
            Error::Inconsistent(format!("qforge.json gives no precision for {name}"))
        })?;
        let bias = weights.tensor(&format!("{name}.bias"))?;
        g.floats(&format!("{name}.bias"), &[out], &floats_of(bias.data()));
        if g.weight(&weights, &name, precision, (out, inp))? {
            int8_layers += 1;
        } else {
            fp_layers += 1;
        }
        let input = g.layer_input(&name, precision, &x);
        x = g.gemm_and_activation(&name, &input, i == last, policy.activation);
    }
    let path = dest.join("model.onnx");
    std::fs::write(&path, g.into_model(policy).encode_to_vec())
        .map_err(|e| qforge_model::Error::io(&path, e))?;
    Ok(OnnxExport {
        int8_layers,
        fp_layers,
    })
}
