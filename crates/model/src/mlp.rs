//! MLP control policies (game AI, robots): a stack of linear layers with one
//! activation, and a head that turns the last layer's output into an action.
//!
//! On disk a policy is a directory with `policy.json` and `model.safetensors`
//! (`layers.{i}.weight` `[out, in]` and `layers.{i}.bias` `[out]`, f32); see
//! `fixtures/policies/README.md`. The observation point of layer `i` is its
//! input, named `layers.{i}`.

use std::path::Path;

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};
use crate::linear::{Linear, check_finite_tensor};
use crate::observe::Observer;
use qforge_formats::policy::{Action, Activation, Head, PolicyConfig};

/// `log_std` beyond ±this is refused: exp(±20) already spans a standard
/// deviation from 2e-9 to 5e8, far past any trained policy's.
const LOG_STD_LIMIT: f32 = 20.0;

/// The observation point of a policy's first layer, the one input that
/// smoothing can rescale exactly: the hidden layers' inputs come out of a
/// tanh or ReLU, which no per-channel factor commutes with for tanh.
pub const SMOOTHABLE_POINT: &str = "layers.0";

/// An MLP policy.
#[derive(Debug, Clone)]
pub struct MlpPolicy {
    config: PolicyConfig,
    layers: Vec<Linear>,
}

/// Why the bytes of a policy did not load, by the input at fault.
enum Malformed {
    /// `policy.json` does not parse.
    Config(serde_json::Error),
    /// `model.safetensors` does not parse.
    Weights(candle_core::Error),
    /// Both parse but do not make a policy.
    Policy(Error),
}

impl MlpPolicy {
    /// Loads `policy.json` and `model.safetensors` (f32) from the policy
    /// directory `dir`. A native artifact is not read here (the artifact
    /// loader builds on this module): open any model, artifacts included,
    /// with [`crate::open()`].
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let config_path = dir.join("policy.json");
        let config = qforge_formats::files::read_config(&config_path)?;
        let weights_path = dir.join("model.safetensors");
        let weights = qforge_formats::files::read_regular(&weights_path)?;
        Self::parse(&config, &weights, &weights_path).map_err(|e| match e {
            Malformed::Config(e) => Error::Format(format!("{}: {e}", config_path.display())),
            Malformed::Weights(e) => Error::Format(format!("{}: {e}", weights_path.display())),
            Malformed::Policy(e) => e.in_file(dir),
        })
    }

    /// Builds a policy from the bytes of `policy.json` and of
    /// `model.safetensors`.
    ///
    /// Never panics on any input, and memory stays proportional to the
    /// input: every layer's shape must match a tensor the safetensors bytes
    /// actually hold (the `policy` fuzz target checks both).
    pub fn from_bytes(config_json: &[u8], safetensors: &[u8]) -> Result<Self> {
        Self::parse(config_json, safetensors, Path::new("model.safetensors")).map_err(|e| match e {
            Malformed::Config(e) => Error::Format(format!("policy.json: {e}")),
            Malformed::Weights(e) => Error::Format(format!("model.safetensors: {e}")),
            Malformed::Policy(e) => e,
        })
    }

    /// [`Self::from_bytes`] with errors tagged by the input at fault, so
    /// [`Self::from_dir`] can name the file; `weights_file` names the
    /// safetensors in missing-tensor errors.
    fn parse(
        config_json: &[u8],
        safetensors: &[u8],
        weights_file: &Path,
    ) -> std::result::Result<Self, Malformed> {
        let config: PolicyConfig =
            serde_json::from_slice(config_json).map_err(Malformed::Config)?;
        let tensors = candle_core::safetensors::load_buffer(safetensors, &Device::Cpu)
            .map_err(Malformed::Weights)?;
        if tensors.contains_key("log_std") {
            return Err(Malformed::Policy(Error::Format(
                "model.safetensors holds log_std; qforge reads a Gaussian head's log_std from policy.json's head (\"log_std\": [one per action dimension])".into(),
            )));
        }
        Self::new(config, |name| {
            tensors.get(name).cloned().ok_or_else(|| {
                qforge_formats::Error::MissingTensor {
                    name: name.to_owned(),
                    file: weights_file.to_owned(),
                }
                .into()
            })
        })
        .map_err(Malformed::Policy)
    }

    /// Builds a full-precision policy from its config and a tensor lookup;
    /// every weight and bias must be finite.
    pub fn new(config: PolicyConfig, tensor: impl Fn(&str) -> Result<Tensor>) -> Result<Self> {
        Self::from_linears(config, |name, shape| {
            let load = |tensor_name: String| -> Result<Tensor> {
                let values = tensor(&tensor_name)?;
                check_finite_tensor(&tensor_name, &values)?;
                Ok(values)
            };
            let weight = load(format!("{name}.weight"))?;
            let bias = load(format!("{name}.bias"))?;
            Linear::fp(name, weight, Some(bias), shape)
        })
    }

    /// Builds a policy from its config and a builder of each layer
    /// (`layers.{i}`, `(out, in)`), which must return a layer of that shape.
    pub fn from_linears(
        config: PolicyConfig,
        linear: impl Fn(&str, (usize, usize)) -> Result<Linear>,
    ) -> Result<Self> {
        if config.format != "qforge-mlp-policy" || config.version != 1 {
            return Err(qforge_formats::Error::Unsupported(format!(
                "policy format {:?} version {} (expected qforge-mlp-policy version 1)",
                config.format, config.version
            ))
            .into());
        }
        if let Some(d) = &config.observation_divisors
            && (d.len() != config.observation_dim || d.iter().any(|v| !(v.is_finite() && *v > 0.0)))
        {
            return Err(Error::Format(format!(
                "observation_divisors must be {} finite positive numbers, one per observation feature",
                config.observation_dim
            )));
        }
        if let Head::Gaussian {
            action_dim,
            log_std: Some(log_std),
            ..
        } = &config.head
            && (log_std.len() != *action_dim
                || log_std
                    .iter()
                    .any(|v| !(v.is_finite() && v.abs() <= LOG_STD_LIMIT)))
        {
            return Err(Error::Format(format!(
                "gaussian head: log_std {log_std:?} must have {action_dim} finite entries within ±{LOG_STD_LIMIT}"
            )));
        }
        if let Head::Gaussian {
            action_dim,
            low,
            high,
            ..
        } = &config.head
            && (low.len() != *action_dim
                || high.len() != *action_dim
                || low
                    .iter()
                    .zip(high)
                    .any(|(l, h)| !(l.is_finite() && h.is_finite() && l < h)))
        {
            return Err(Error::Format(format!(
                "gaussian head: low {low:?} and high {high:?} must both have {action_dim} finite entries with low < high"
            )));
        }
        let mut widths = vec![config.observation_dim];
        widths.extend(&config.hidden);
        widths.push(config.head.outputs());
        if widths.contains(&0) {
            return Err(Error::Format(format!(
                "layer widths {widths:?} include zero"
            )));
        }
        let layers = widths
            .windows(2)
            .enumerate()
            .map(|(i, w)| {
                let name = format!("layers.{i}");
                let layer = linear(&name, (w[1], w[0]))?;
                if layer.shape() != (w[1], w[0]) {
                    return Err(qforge_formats::Error::Shape(format!(
                        "{name} is {:?}, expected ({}, {})",
                        layer.shape(),
                        w[1],
                        w[0]
                    ))
                    .into());
                }
                Ok(layer)
            })
            .collect::<Result<_>>()?;
        Ok(Self { config, layers })
    }

    /// The same policy with every layer replaced by `convert(name, layer)`
    /// (names `layers.{i}`, as observed).
    pub fn with_linears(&self, convert: impl Fn(&str, &Linear) -> Result<Linear>) -> Result<Self> {
        let layers = self
            .layers
            .iter()
            .enumerate()
            .map(|(i, layer)| convert(&format!("layers.{i}"), layer))
            .collect::<Result<_>>()?;
        Ok(Self {
            config: self.config.clone(),
            layers,
        })
    }

    /// The same policy with each layer `replacements` names (`layers.{i}`)
    /// replaced by `replace(layer, its replacement)`; a name that is no
    /// layer of this policy is an error.
    pub fn with_replaced<T>(
        &self,
        replacements: &std::collections::BTreeMap<String, T>,
        replace: impl Fn(&Linear, &T) -> Result<Linear>,
    ) -> Result<Self> {
        if let Some(unknown) = replacements
            .keys()
            .find(|n| !self.linears().iter().any(|(name, _, _)| name == *n))
        {
            return Err(qforge_formats::Error::Shape(format!(
                "{unknown} is not a layer of this policy"
            ))
            .into());
        }
        self.with_linears(|name, layer| match replacements.get(name) {
            Some(replacement) => replace(layer, replacement),
            None => Ok(layer.clone()),
        })
    }

    /// The same policy with its first layer's input divided by `factors`
    /// (one per observation feature) and the first layer's weight columns
    /// multiplied by them: the same function, up to rounding, whose first
    /// layer sees features of more even ranges (SmoothQuant, Xiao et al.
    /// 2023). Only [`SMOOTHABLE_POINT`] may have factors.
    pub fn smoothed(&self, factors: &std::collections::BTreeMap<String, Vec<f32>>) -> Result<Self> {
        if let Some(other) = factors.keys().find(|p| *p != SMOOTHABLE_POINT) {
            return Err(qforge_formats::Error::Unsupported(format!(
                "{other} of a policy cannot be smoothed: only {SMOOTHABLE_POINT}, the observation, can"
            )).into());
        }
        let Some(s) = factors.get(SMOOTHABLE_POINT) else {
            return Ok(self.clone());
        };
        let dim = self.config.observation_dim;
        if s.len() != dim || s.iter().any(|v| !(v.is_finite() && *v > 0.0)) {
            return Err(qforge_formats::Error::Shape(format!(
                "{SMOOTHABLE_POINT} needs {dim} finite positive smoothing factors, got {}",
                s.len()
            ))
            .into());
        }
        let mut config = self.config.clone();
        config.observation_divisors = Some(match &self.config.observation_divisors {
            Some(d) => d.iter().zip(s).map(|(a, b)| a * b).collect(),
            None => s.clone(),
        });
        let mut layers = self.layers.clone();
        layers[0] = self.layers[0].scale_inputs(s)?;
        Ok(Self { config, layers })
    }

    /// Every layer as (name, observation point, layer); for a policy the two
    /// are the same, `layers.{i}`.
    pub fn linears(&self) -> Vec<(String, String, &Linear)> {
        self.layers
            .iter()
            .enumerate()
            .map(|(i, layer)| (format!("layers.{i}"), format!("layers.{i}"), layer))
            .collect()
    }

    /// The policy's configuration.
    pub fn config(&self) -> &PolicyConfig {
        &self.config
    }

    /// Raw head outputs for `observations` (row-major, `observation_dim` per
    /// row): `[rows, head outputs]`. Each layer's input goes to `observer`.
    pub fn forward(
        &self,
        observations: &[f32],
        mut observer: Option<&mut dyn Observer>,
    ) -> Result<Vec<f32>> {
        let dim = self.config.observation_dim;
        if observations.is_empty() || !observations.len().is_multiple_of(dim) {
            return Err(qforge_formats::Error::Shape(format!(
                "{} observation values are not whole rows of {dim}",
                observations.len()
            ))
            .into());
        }
        let rows = observations.len() / dim;
        let mut x = Tensor::from_slice(observations, (rows, dim), &Device::Cpu)?;
        if let Some(d) = &self.config.observation_divisors {
            x = x.broadcast_div(&Tensor::from_slice(d, (1, dim), &Device::Cpu)?)?;
        }
        let last = self.layers.len() - 1;
        for (i, layer) in self.layers.iter().enumerate() {
            if let Some(o) = observer.as_deref_mut() {
                let width = x.dim(1)?;
                o.observe(
                    &format!("layers.{i}"),
                    &x.flatten_all()?.to_vec1::<f32>()?,
                    width,
                )?;
            }
            x = layer.forward(&x)?;
            if i < last {
                x = match self.config.activation {
                    Activation::Tanh => x.tanh()?,
                    Activation::Relu => x.relu()?,
                };
            }
        }
        Ok(x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
    }

    /// The action for each observation row.
    pub fn act(&self, observations: &[f32]) -> Result<Vec<Action>> {
        let outputs = self.forward(observations, None)?;
        Ok(self.actions_from_outputs(&outputs))
    }

    /// Turns raw head outputs into actions ([`Head::greedy`]).
    pub fn actions_from_outputs(&self, outputs: &[f32]) -> Vec<Action> {
        let head = &self.config.head;
        outputs
            .chunks_exact(head.outputs())
            .map(|row| head.greedy(row))
            .collect()
    }

    /// Whether two actions agree (see [`Head::actions_agree`]).
    pub fn actions_agree(&self, a: &Action, b: &Action) -> bool {
        self.config.head.actions_agree(a, b)
    }

    /// The share of pairs of `ours` and `theirs` (the actions of two
    /// policies for the same observations) that agree; 0 for none.
    pub fn agreement(&self, ours: &[Action], theirs: &[Action]) -> f64 {
        let agreeing = ours
            .iter()
            .zip(theirs)
            .filter(|(a, b)| self.actions_agree(a, b))
            .count();
        agreeing as f64 / ours.len().max(1) as f64
    }
}
