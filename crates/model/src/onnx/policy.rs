//! The chain read from the graph checked against the head (widths, the
//! declared input, activations, a final Softmax) and built into an
//! [`MlpPolicy`].

use std::collections::HashMap;

use candle_core::{Device, Tensor};

use crate::error::{Error, Result};
use crate::mlp::MlpPolicy;
use qforge_formats::onnx::{Chain, Layer, SUPPORTED, shown};
use qforge_formats::policy::{Activation, Head, PolicyConfig};

/// Checks the chain's shapes and activations against `head` and builds the
/// policy.
pub(super) fn build_policy(chain: Chain, head: Head, env: Option<String>) -> Result<MlpPolicy> {
    let Chain {
        layers,
        softmax,
        input_features,
        input_name,
    } = chain;
    check_widths(&layers)?;
    if let Some(features) = input_features {
        check_input_features(&features, &input_name, &layers[0])?;
    }
    let n = layers.len();
    check_last_layer(&layers[n - 1], softmax.as_deref(), &head)?;
    let activation = hidden_activation(&layers[..n - 1])?;
    let config = PolicyConfig {
        format: "qforge-mlp-policy".into(),
        version: 1,
        env,
        observation_dim: layers[0].inp,
        hidden: layers[..n - 1].iter().map(|l| l.out).collect(),
        // A single-layer (linear) policy applies no activation; any will do.
        activation: activation.unwrap_or(Activation::Tanh),
        head,
        observation_divisors: None,
    };
    policy_from_layers(config, layers)
}

/// Each layer must take as many inputs as the one before produces: the
/// widths come from the weights alone, so nothing else ensures they chain.
fn check_widths(layers: &[Layer]) -> Result<()> {
    for pair in layers.windows(2) {
        if pair[1].inp != pair[0].out {
            return Err(qforge_formats::Error::Shape(format!(
                "{} takes {} inputs but the previous layer ({}) produces {}",
                pair[1].node, pair[1].inp, pair[0].node, pair[0].out
            ))
            .into());
        }
    }
    Ok(())
}

/// Where the input declares all its feature dims, their product must be
/// the first layer's width (a graph whose declared input disagrees with its
/// weights would be fed observations of the wrong size).
fn check_input_features(features: &[Option<i64>], input_name: &str, first: &Layer) -> Result<()> {
    if !features.iter().all(Option::is_some) {
        return Ok(());
    }
    let declared = features
        .iter()
        .flatten()
        .try_fold(1usize, |n, &d| n.checked_mul(usize::try_from(d).ok()?));
    if declared != Some(first.inp) {
        return Err(qforge_formats::Error::Shape(format!(
            "input `{}` declares {:?} features per observation but the first layer ({}) \
             takes {}",
            shown(input_name),
            features.iter().flatten().collect::<Vec<_>>(),
            first.node,
            first.inp
        ))
        .into());
    }
    Ok(())
}

/// The last layer feeds the head: as many outputs as the head needs, no
/// activation (heads are linear), and a final Softmax only for a discrete
/// head, whose argmax it leaves unchanged.
fn check_last_layer(last: &Layer, softmax: Option<&str>, head: &Head) -> Result<()> {
    if last.out != head.outputs() {
        return Err(qforge_formats::Error::Shape(format!(
            "the last layer ({}) has {} outputs but the {} head needs {}",
            last.node,
            last.out,
            head_kind(head),
            head.outputs()
        ))
        .into());
    }
    if let Some((_, act)) = &last.activation {
        return Err(qforge_formats::Error::Unsupported(format!(
            "{act} follows the last layer ({}); qforge MLP heads are linear. {SUPPORTED}",
            last.node
        ))
        .into());
    }
    if let Some(sm) = softmax
        && !matches!(head, Head::Discrete { .. })
    {
        return Err(qforge_formats::Error::Unsupported(format!(
            "{sm} ends the graph, but a {} head uses the raw outputs; only a discrete head's \
             argmax is unchanged by Softmax",
            head_kind(head)
        ))
        .into());
    }
    Ok(())
}

/// The one activation every hidden layer applies (an [`MlpPolicy`] has a
/// single activation); `None` when there is no hidden layer.
fn hidden_activation(hidden: &[Layer]) -> Result<Option<Activation>> {
    let mut activation: Option<(Activation, &str)> = None;
    for (i, layer) in hidden.iter().enumerate() {
        let Some((act, node)) = &layer.activation else {
            return Err(qforge_formats::Error::Unsupported(format!(
                "hidden layer {i} ({}) has no Relu or Tanh before the next layer. {SUPPORTED}",
                layer.node
            ))
            .into());
        };
        match activation {
            None => activation = Some((*act, node)),
            Some((first, first_node)) if first != *act => {
                return Err(qforge_formats::Error::Unsupported(format!(
                    "mixed activations: {first_node} applies {first:?} but {node} applies \
                     {act:?}; qforge MLPs use one activation after every hidden layer"
                ))
                .into());
            }
            Some(_) => {}
        }
    }
    Ok(activation.map(|(a, _)| a))
}

/// The policy `config` with the layers' weights, named as a policy
/// directory names them, so [`MlpPolicy::new`] checks them as it checks a
/// loaded one.
fn policy_from_layers(config: PolicyConfig, layers: Vec<Layer>) -> Result<MlpPolicy> {
    let mut tensors = HashMap::new();
    for (i, layer) in layers.into_iter().enumerate() {
        let (out, inp) = (layer.out, layer.inp);
        tensors.insert(
            format!("layers.{i}.weight"),
            Tensor::from_vec(layer.weight, (out, inp), &Device::Cpu)?,
        );
        tensors.insert(
            format!("layers.{i}.bias"),
            Tensor::from_vec(layer.bias, out, &Device::Cpu)?,
        );
    }
    MlpPolicy::new(config, |name| {
        tensors
            .get(name)
            .cloned()
            .ok_or_else(|| Error::Format(format!("internal: no tensor {name}")))
    })
}

fn head_kind(head: &Head) -> &'static str {
    match head {
        Head::Discrete { .. } => "discrete",
        Head::Gaussian { .. } => "gaussian",
        Head::Value => "value",
    }
}
