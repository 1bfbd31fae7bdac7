//! One node of the chain read into a layer: its output and attributes,
//! the float32 constant tensors it takes (checked against the data they
//! hold before anything is copied), and the `Gemm`, `MatMul` and bias `Add`
//! ops themselves.

use std::collections::HashMap;

use super::proto::tensor_proto::{DataLocation, DataType};
use super::proto::{NodeProto, TensorProto};
use super::{Layer, SUPPORTED, data_type_name, shown};
use crate::error::{Error, Result};

/// The constant tensors of a graph by name: initializers and `Constant`
/// nodes' outputs.
pub(super) type Constants<'a> = HashMap<&'a str, &'a TensorProto>;

pub(super) fn single_output<'a>(node: &'a NodeProto, what: &str) -> Result<&'a str> {
    match node.output.as_slice() {
        [out] if !out.is_empty() => Ok(out),
        outs => Err(Error::Unsupported(format!(
            "{what} has {} outputs; qforge reads single-output nodes only. {SUPPORTED}",
            outs.len()
        ))),
    }
}

pub(super) fn no_attributes(node: &NodeProto, what: &str) -> Result<()> {
    match node.attribute.first() {
        None => Ok(()),
        Some(a) => Err(Error::Unsupported(format!(
            "{what} has attribute `{}`, which qforge does not support",
            shown(&a.name)
        ))),
    }
}

/// Reads the integer attributes `names` (with defaults); any other
/// attribute is an error.
pub(super) fn int_attributes(
    node: &NodeProto,
    what: &str,
    names: &[(&str, i64)],
) -> Result<Vec<i64>> {
    let mut values: Vec<i64> = names.iter().map(|(_, d)| *d).collect();
    for a in &node.attribute {
        let Some(slot) = names.iter().position(|(n, _)| *n == a.name) else {
            return Err(Error::Unsupported(format!(
                "{what} has attribute `{}`, which qforge does not support",
                shown(&a.name)
            )));
        };
        values[slot] = a.i;
    }
    Ok(values)
}

/// Looks up a constant weight or bias of `what`.
fn constant<'a>(
    constants: &Constants<'a>,
    name: &str,
    what: &str,
    role: &str,
) -> Result<&'a TensorProto> {
    constants.get(name).copied().ok_or_else(|| {
        Error::Format(format!(
            "{what}: {role} `{}` is neither an initializer nor a Constant node's output \
             (missing initializer?); qforge needs constant weights",
            shown(name)
        ))
    })
}

/// A float32 tensor's dims and data. Checks the declared element count
/// against the data actually present before copying anything.
fn float_tensor(t: &TensorProto, what: &str, role: &str) -> Result<(Vec<usize>, Vec<f32>)> {
    let name = shown(&t.name);
    if t.data_location == DataLocation::External as i32 || !t.external_data.is_empty() {
        return Err(Error::Unsupported(format!(
            "{what}: {role} `{name}` keeps its data in an external file; save the model with \
             its weights embedded (onnx.save(model, path, save_as_external_data=False))"
        )));
    }
    if t.data_type != DataType::Float as i32 {
        return Err(Error::Unsupported(format!(
            "{what}: {role} `{name}` has data type {}; qforge imports float32 weights only \
             (quantize the float32 model with qforge instead)",
            data_type_name(t.data_type)
        )));
    }
    let mut dims = Vec::with_capacity(t.dims.len());
    let mut count: Option<usize> = Some(1);
    for &d in &t.dims {
        let d = usize::try_from(d).map_err(|_| {
            Error::Format(format!(
                "{what}: {role} `{name}` has a negative dim in {:?}",
                t.dims
            ))
        })?;
        count = count.and_then(|c| c.checked_mul(d));
        dims.push(d);
    }
    let mismatch = |held: String| {
        Error::Format(format!(
            "{what}: {role} `{name}` declares dims {:?} but holds {held}",
            t.dims
        ))
    };
    let data = if !t.raw_data.is_empty() {
        if count.and_then(|c| c.checked_mul(4)) != Some(t.raw_data.len()) {
            return Err(mismatch(format!("{} bytes of raw data", t.raw_data.len())));
        }
        t.raw_data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    } else {
        if count != Some(t.float_data.len()) {
            return Err(mismatch(format!("{} float values", t.float_data.len())));
        }
        t.float_data.clone()
    };
    Ok((dims, data))
}

/// A weight of shape `[out, in]` (if `transposed`) or `[in, out]`, returned
/// as `(out, in, [out, in] data)`.
fn weight(t: &TensorProto, what: &str, transposed: bool) -> Result<(usize, usize, Vec<f32>)> {
    let (dims, data) = float_tensor(t, what, "weight")?;
    let &[a, b] = dims.as_slice() else {
        return Err(Error::Shape(format!(
            "{what}: weight `{}` has dims {dims:?}; a linear layer's weight is 2-D",
            shown(&t.name)
        )));
    };
    // With a zero dim the other one is unbounded by the data (0 × 2^40 holds
    // no values), and the layer's zero bias would allocate `out` floats.
    if a == 0 || b == 0 {
        return Err(Error::Shape(format!(
            "{what}: weight `{}` has dims {dims:?}; a linear layer's weight has no zero dim",
            shown(&t.name)
        )));
    }
    if transposed {
        return Ok((a, b, data));
    }
    let (inp, out) = (a, b);
    let mut w = vec![0.0; data.len()];
    for (i, row) in data.chunks_exact(out.max(1)).enumerate() {
        for (o, &v) in row.iter().enumerate() {
            w[o * inp + i] = v;
        }
    }
    Ok((out, inp, w))
}

/// A bias of `[out]` or `[1, out]` values.
fn bias(t: &TensorProto, what: &str, out: usize) -> Result<Vec<f32>> {
    let (dims, data) = float_tensor(t, what, "bias")?;
    if dims != [out] && dims != [1, out] {
        return Err(Error::Shape(format!(
            "{what}: bias `{}` has dims {dims:?}, expected [{out}] for a layer with {out} outputs",
            shown(&t.name)
        )));
    }
    Ok(data)
}

/// The running value must be a node's first input.
fn check_first_input(node: &NodeProto, what: &str, current: &str, arity: &[usize]) -> Result<()> {
    if !arity.contains(&node.input.len()) {
        return Err(Error::Format(format!(
            "{what} has {} inputs, expected {}",
            node.input.len(),
            arity
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(" or ")
        )));
    }
    if node.input.first().map(String::as_str) != Some(current) {
        return Err(Error::Unsupported(format!(
            "{what} takes `{}` as a weight, not as its first input; qforge needs x·W layers \
             with constant W. {SUPPORTED}",
            shown(current)
        )));
    }
    Ok(())
}

pub(super) fn gemm(
    node: &NodeProto,
    what: &str,
    current: &str,
    constants: &Constants<'_>,
) -> Result<Layer> {
    check_first_input(node, what, current, &[2, 3])?;
    let (mut alpha, mut beta, mut trans_a, mut trans_b) = (1.0f32, 1.0f32, 0i64, 0i64);
    for a in &node.attribute {
        match a.name.as_str() {
            "alpha" => alpha = a.f,
            "beta" => beta = a.f,
            "transA" => trans_a = a.i,
            "transB" => trans_b = a.i,
            other => {
                return Err(Error::Unsupported(format!(
                    "{what} has attribute `{}`, which qforge does not support",
                    shown(other)
                )));
            }
        }
    }
    let c = node.input.get(2).filter(|c| !c.is_empty());
    if alpha != 1.0 || (c.is_some() && beta != 1.0) || trans_a != 0 || !(0..=1).contains(&trans_b) {
        return Err(Error::Unsupported(format!(
            "{what} has alpha={alpha}, beta={beta}, transA={trans_a}, transB={trans_b}; qforge \
             supports Gemm with alpha=1, beta=1, transA=0 and transB 0 or 1"
        )));
    }
    let w = constant(constants, &node.input[1], what, "weight")?;
    let (out, inp, weight) = weight(w, what, trans_b == 1)?;
    let bias = match c {
        Some(c) => bias(constant(constants, c, what, "bias")?, what, out)?,
        None => vec![0.0; out],
    };
    Ok(Layer {
        node: what.to_owned(),
        out,
        inp,
        weight,
        bias,
        activation: None,
    })
}

pub(super) fn matmul(
    node: &NodeProto,
    what: &str,
    current: &str,
    constants: &Constants<'_>,
) -> Result<Layer> {
    check_first_input(node, what, current, &[2])?;
    no_attributes(node, what)?;
    let w = constant(constants, &node.input[1], what, "weight")?;
    let (out, inp, weight) = weight(w, what, false)?;
    Ok(Layer {
        node: what.to_owned(),
        out,
        inp,
        weight,
        bias: vec![0.0; out],
        activation: None,
    })
}

/// The constant operand of the `Add` after a MatMul whose output is `x`.
pub(super) fn add_bias(
    node: &NodeProto,
    what: &str,
    x: &str,
    constants: &Constants<'_>,
    out: usize,
) -> Result<Vec<f32>> {
    no_attributes(node, what)?;
    let other = match node.input.as_slice() {
        [a, b] if a == x => b,
        [a, b] if b == x => a,
        _ => {
            return Err(Error::Format(format!(
                "{what} has {} inputs, expected the MatMul output and a bias",
                node.input.len()
            )));
        }
    };
    bias(constant(constants, other, what, "bias")?, what, out)
}
