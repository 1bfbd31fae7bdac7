//! The graph of an ONNX model read as a chain: the checks on the model,
//! its one input and output, and the walk from the input to the output
//! that reads each node in turn (see `super::ops`).

use std::collections::HashMap;

use super::ops::{Constants, add_bias, gemm, int_attributes, matmul, no_attributes, single_output};
use super::proto::tensor_proto::DataType;
use super::proto::{AttributeProto, GraphProto, ModelProto, NodeProto, ValueInfoProto};
use super::{Chain, Layer, SUPPORTED, data_type_name, describe, quoted_names, shown};
use crate::error::{Error, Result};
use crate::policy::Activation;

/// Reads the graph of `model` as a chain of layers.
pub(super) fn read_chain(model: &ModelProto) -> Result<Chain> {
    let graph = default_domain_graph(model)?;
    let (constants, ops) = constants_and_ops(graph)?;
    let input = single_input(graph, &constants)?;
    let output = single_output_value(graph)?;
    check_float_type(output, "output")?;
    let input_dims = check_float_type(input, "input")?;
    let mut walk = Walk::new(&constants, &ops, &input.name);
    walk.run()?;
    walk.check_complete(input, output)?;
    let input_features = input_features(input, input_dims, walk.flattened_first)?;
    Ok(Chain {
        layers: walk.layers,
        softmax: walk.softmax,
        input_features,
        input_name: input.name.clone(),
    })
}

/// The graph of `model`, which must import the default ONNX domain: a
/// decoder accepts truncated or foreign bytes as an empty model, and these
/// two fields are what such bytes lack.
fn default_domain_graph(model: &ModelProto) -> Result<&GraphProto> {
    if !model
        .opset_import
        .iter()
        .any(|o| o.domain.is_empty() || o.domain == "ai.onnx")
    {
        return Err(Error::Format(
            "the model imports no opset of the default ONNX domain; the file is truncated or \
             not an ONNX model"
                .into(),
        ));
    }
    model.graph.as_ref().ok_or_else(|| {
        Error::Format("the model has no graph; the file is truncated or not an ONNX model".into())
    })
}

/// The graph's one output: a policy network has exactly one (an exported
/// actor-critic with a value output too must be exported actor only).
fn single_output_value(graph: &GraphProto) -> Result<&ValueInfoProto> {
    match graph.output.as_slice() {
        [one] => Ok(one),
        many => Err(Error::Unsupported(format!(
            "the graph has {} outputs ({}); export only the actor network (one output: \
             logits, action mean or value). {SUPPORTED}",
            many.len(),
            quoted_names(many.iter().map(|v| v.name.as_str()))
        ))),
    }
}

/// The observation input's feature dims (after the batch dim), from its
/// declared dims: rank 2, or higher when a Flatten(axis=1) precedes the
/// first layer; `None` when the shape is not declared.
fn input_features(
    input: &ValueInfoProto,
    input_dims: Option<Vec<Option<i64>>>,
    flattened_first: bool,
) -> Result<Option<Vec<Option<i64>>>> {
    match input_dims {
        Some(dims) if dims.len() == 2 => Ok(Some(dims[1..].to_vec())),
        Some(dims) if dims.len() > 2 && flattened_first => Ok(Some(dims[1..].to_vec())),
        Some(dims) => Err(Error::Unsupported(format!(
            "input `{}` has rank {}; qforge policies take observations of shape \
             [batch, observation_dim] (a higher rank needs a Flatten(axis=1) before the \
             first layer)",
            shown(&input.name),
            dims.len()
        ))),
        None => Ok(None),
    }
}

/// The walk along the chain from the graph input: each value must feed at
/// most one node, which is read into `layers` (or marks an activation,
/// Flatten or Softmax) before moving on to its output.
struct Walk<'a> {
    constants: &'a Constants<'a>,
    /// The non-constant nodes, with their index in the graph.
    ops: &'a [(usize, &'a NodeProto)],
    /// Which of `ops` read each value.
    consumers: HashMap<&'a str, Vec<usize>>,
    /// The `ops` the walk has read, to detect cycles and nodes off the chain.
    visited: Vec<bool>,
    layers: Vec<Layer>,
    /// The final Softmax node, once seen: nothing may follow it.
    softmax: Option<String>,
    /// Whether a Flatten came before the first layer (it admits an input of
    /// higher rank).
    flattened_first: bool,
    /// The value the chain has reached.
    current: &'a str,
}

impl<'a> Walk<'a> {
    fn new(
        constants: &'a Constants<'a>,
        ops: &'a [(usize, &'a NodeProto)],
        input: &'a str,
    ) -> Self {
        // Which nodes read each value. A node reading one value twice counts once.
        let mut consumers: HashMap<&str, Vec<usize>> = HashMap::new();
        for (k, (_, node)) in ops.iter().enumerate() {
            for name in &node.input {
                if name.is_empty() || constants.contains_key(name.as_str()) {
                    continue;
                }
                let users = consumers.entry(name.as_str()).or_default();
                if users.last() != Some(&k) {
                    users.push(k);
                }
            }
        }
        Self {
            constants,
            ops,
            consumers,
            visited: vec![false; ops.len()],
            layers: Vec::new(),
            softmax: None,
            flattened_first: false,
            current: input,
        }
    }

    /// Follows the chain until a value no node reads.
    fn run(&mut self) -> Result<()> {
        while let Some(k) = self.next_node()? {
            let (index, node) = self.ops[k];
            let what = describe(node, index);
            if self.visited[k] {
                return Err(Error::Format(format!(
                    "the graph has a cycle through {what}"
                )));
            }
            self.visited[k] = true;
            let out = single_output(node, &what)?;
            if let Some(sm) = &self.softmax {
                return Err(Error::Unsupported(format!(
                    "{what} follows {sm}; Softmax must be the last node. {SUPPORTED}"
                )));
            }
            self.current = self.step(node, what, out)?;
        }
        Ok(())
    }

    /// The one node that reads the current value, `None` at the end of the
    /// chain; a value read by several nodes is a branch, which an MLP lacks.
    fn next_node(&self) -> Result<Option<usize>> {
        match self
            .consumers
            .get(self.current)
            .map(Vec::as_slice)
            .unwrap_or(&[])
        {
            [] => Ok(None),
            [k] => Ok(Some(*k)),
            many => Err(Error::Unsupported(format!(
                "value `{}` feeds {} nodes ({}); the graph branches. {SUPPORTED}",
                shown(self.current),
                many.len(),
                many.iter()
                    .take(8)
                    .map(|&k| describe(self.ops[k].1, self.ops[k].0))
                    .collect::<Vec<_>>()
                    .join(", ")
            ))),
        }
    }

    /// Reads `node` (described as `what`, with the one output `out`);
    /// returns the value the chain continues from.
    fn step(&mut self, node: &'a NodeProto, what: String, out: &'a str) -> Result<&'a str> {
        match node.op_type.as_str() {
            "Gemm" => self
                .layers
                .push(gemm(node, &what, self.current, self.constants)?),
            "MatMul" => return self.matmul_layer(node, &what, out),
            "Relu" | "Tanh" => self.activation(node, what)?,
            "Identity" => no_attributes(node, &what)?,
            "Flatten" => self.flatten(node, &what)?,
            "Softmax" => self.softmax(node, what)?,
            "Add" => {
                return Err(Error::Unsupported(format!(
                    "{what} does not directly follow a MatMul; qforge reads Add only as the \
                     bias of a MatMul layer. {SUPPORTED}"
                )));
            }
            _ => {
                return Err(Error::Unsupported(format!(
                    "{what} (op {}) is not an MLP op. {SUPPORTED}",
                    shown(&node.op_type)
                )));
            }
        }
        Ok(out)
    }

    /// A MatMul layer, with the Add that follows it as its bias when that
    /// Add is the MatMul's only consumer (torch and Stable-Baselines3 write
    /// `Linear` this way); returns the value after the bias.
    fn matmul_layer(&mut self, node: &NodeProto, what: &str, out: &'a str) -> Result<&'a str> {
        let mut layer = matmul(node, what, self.current, self.constants)?;
        let mut next = out;
        if let Some(&[a]) = self.consumers.get(out).map(Vec::as_slice)
            && self.ops[a].1.op_type == "Add"
        {
            let (add_index, add) = self.ops[a];
            let add_what = describe(add, add_index);
            self.visited[a] = true;
            next = single_output(add, &add_what)?;
            layer.bias = add_bias(add, &add_what, out, self.constants, layer.out)?;
        }
        self.layers.push(layer);
        Ok(next)
    }

    /// Relu or Tanh: the activation of the layer before it, which must not
    /// have one yet (a policy applies one activation per hidden layer).
    fn activation(&mut self, node: &NodeProto, what: String) -> Result<()> {
        no_attributes(node, &what)?;
        let activation = if node.op_type == "Relu" {
            Activation::Relu
        } else {
            Activation::Tanh
        };
        let Some(last) = self.layers.last_mut() else {
            return Err(Error::Unsupported(format!(
                "{what} comes before the first linear layer. {SUPPORTED}"
            )));
        };
        if let Some((_, previous)) = &last.activation {
            return Err(Error::Unsupported(format!(
                "{what} directly follows the activation {previous}; exactly one \
                 activation may follow a layer. {SUPPORTED}"
            )));
        }
        last.activation = Some((activation, what));
        Ok(())
    }

    /// Flatten(axis=1) keeps the batch dimension, so it changes nothing for
    /// a rank-2 value; before the first layer it admits a higher-rank input.
    fn flatten(&mut self, node: &NodeProto, what: &str) -> Result<()> {
        let axis = int_attributes(node, what, &[("axis", 1)])?[0];
        if axis != 1 {
            return Err(Error::Unsupported(format!(
                "{what} has axis={axis}; only Flatten(axis=1), which keeps the batch \
                 dimension, is supported"
            )));
        }
        if self.layers.is_empty() {
            self.flattened_first = true;
        }
        Ok(())
    }

    /// A Softmax over the logits right after the last layer; the model's
    /// policy builder decides whether the head lets it be dropped.
    fn softmax(&mut self, node: &NodeProto, what: String) -> Result<()> {
        let axis = int_attributes(node, &what, &[("axis", -1)])?[0];
        if axis != -1 && axis != 1 {
            return Err(Error::Unsupported(format!(
                "{what} has axis={axis}; only a Softmax over the action logits \
                 (axis -1 or 1) is supported"
            )));
        }
        match self.layers.last() {
            Some(last) if last.activation.is_none() => {
                self.softmax = Some(what);
                Ok(())
            }
            _ => Err(Error::Unsupported(format!(
                "{what} does not directly follow the last linear layer. {SUPPORTED}"
            ))),
        }
    }

    /// After the walk: it must have reached the graph output through every
    /// node, and read at least one layer.
    fn check_complete(&self, input: &ValueInfoProto, output: &ValueInfoProto) -> Result<()> {
        if self.current != output.name {
            return Err(Error::Format(format!(
                "the chain from input `{}` ends at `{}`, which is not the graph output `{}`",
                shown(&input.name),
                shown(self.current),
                shown(&output.name)
            )));
        }
        if let Some(k) = self.visited.iter().position(|v| !v) {
            let (index, node) = self.ops[k];
            return Err(Error::Unsupported(format!(
                "{} is not on the path from input `{}` to output `{}`; the graph is not a single \
                 chain. {SUPPORTED}",
                describe(node, index),
                shown(&input.name),
                shown(&output.name)
            )));
        }
        if self.layers.is_empty() {
            return Err(Error::Unsupported(format!(
                "the graph has no Gemm or MatMul layer. {SUPPORTED}"
            )));
        }
        Ok(())
    }
}

/// Splits the graph into constant tensors (initializers and `Constant`
/// nodes' outputs, by name) and the remaining nodes with their indices.
fn constants_and_ops(graph: &GraphProto) -> Result<(Constants<'_>, Vec<(usize, &NodeProto)>)> {
    let mut constants: Constants<'_> = HashMap::new();
    for t in &graph.initializer {
        if constants.insert(t.name.as_str(), t).is_some() {
            return Err(Error::Format(format!(
                "two initializers are named `{}`",
                shown(&t.name)
            )));
        }
    }
    let mut ops = Vec::new();
    for (index, node) in graph.node.iter().enumerate() {
        let what = describe(node, index);
        if !(node.domain.is_empty() || node.domain == "ai.onnx") {
            return Err(Error::Unsupported(format!(
                "{what} is from operator domain `{}`; only the default ONNX domain is \
                 supported. {SUPPORTED}",
                shown(&node.domain)
            )));
        }
        if node.op_type != "Constant" {
            ops.push((index, node));
            continue;
        }
        let out = single_output(node, &what)?;
        let value = match node.attribute.as_slice() {
            [
                AttributeProto {
                    name, t: Some(t), ..
                },
            ] if name == "value" => t,
            _ => {
                return Err(Error::Unsupported(format!(
                    "{what}: only Constant nodes with a `value` tensor attribute are supported"
                )));
            }
        };
        if constants.insert(out, value).is_some() {
            return Err(Error::Format(format!(
                "{what} defines `{}`, which is already defined",
                shown(out)
            )));
        }
    }
    Ok((constants, ops))
}

/// The graph's one non-constant input (older exporters also list the
/// initializers as inputs).
fn single_input<'a>(
    graph: &'a GraphProto,
    constants: &Constants<'_>,
) -> Result<&'a ValueInfoProto> {
    let inputs: Vec<&ValueInfoProto> = graph
        .input
        .iter()
        .filter(|v| !constants.contains_key(v.name.as_str()))
        .collect();
    match inputs.as_slice() {
        [one] => Ok(one),
        many => Err(Error::Unsupported(format!(
            "the graph has {} non-constant inputs ({}); qforge policies take one observation \
             input and constant weights. {SUPPORTED}",
            many.len(),
            quoted_names(many.iter().map(|v| v.name.as_str()))
        ))),
    }
}

/// Checks that a graph input or output, where its type is declared, is a
/// float32 tensor; returns its declared dims (`None` per unknown dim), if
/// its shape is declared.
fn check_float_type(value: &ValueInfoProto, role: &str) -> Result<Option<Vec<Option<i64>>>> {
    use super::proto::tensor_shape_proto::dimension::Value as Dim;
    use super::proto::type_proto::Value;
    let Some(ty) = &value.r#type else {
        return Ok(None);
    };
    let Some(Value::TensorType(tensor)) = &ty.value else {
        return Err(Error::Unsupported(format!(
            "{role} `{}` is not a tensor; qforge policies map a float32 tensor to a float32 \
             tensor",
            shown(&value.name)
        )));
    };
    if tensor.elem_type != DataType::Undefined as i32 && tensor.elem_type != DataType::Float as i32
    {
        return Err(Error::Unsupported(format!(
            "{role} `{}` has element type {}; qforge imports float32 policies only",
            shown(&value.name),
            data_type_name(tensor.elem_type)
        )));
    }
    Ok(tensor.shape.as_ref().map(|shape| {
        shape
            .dim
            .iter()
            .map(|d| match d.value {
                Some(Dim::DimValue(v)) if v >= 0 => Some(v),
                _ => None,
            })
            .collect()
    }))
}
