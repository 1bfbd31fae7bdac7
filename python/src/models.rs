//! `qforge.open(path)` and the two kinds of model it returns: a `Policy`
//! (`act`, `forward`) and a `LanguageModel` (`generate`, `logprobs`,
//! `perplexity`, `encode`, `decode`).

use std::path::PathBuf;

use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1, PyArray2, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;
use qforge_core::Calibrator;
use qforge_model::lm::GenerationReport;
use qforge_model::lm::{continuation_log_probs, perplexity};
use qforge_model::mlp::Action;
use qforge_model::precision::RunPrecision;
use qforge_model::{GenerateOptions, MlpPolicy, Model};
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::errors::{Failure, usage};
use crate::to_python;

/// Opens the model at `path` (a GGUF file, a Hugging Face directory, a
/// policy directory, an ONNX policy or a native artifact) in `precision`:
/// `f32` (an artifact: its stored precisions), `int8-dynamic`, or
/// `int8-static` with the statistics `stats` of a `qforge calibrate` run and
/// a `calibrator`. Returns a `Policy` or a `LanguageModel`.
#[pyfunction]
#[pyo3(signature = (path, precision = "f32", stats = None, calibrator = "minmax"))]
pub fn open(
    py: Python<'_>,
    path: PathBuf,
    precision: &str,
    stats: Option<PathBuf>,
    calibrator: &str,
) -> PyResult<Py<PyAny>> {
    let calibrator: Calibrator = calibrator
        .parse()
        .map_err(|e| usage(format!("calibrator: {e}")))?;
    let (model, precision) = py.detach(|| -> Result<_, Failure> {
        let precision = RunPrecision::named(precision, &path, stats.as_deref(), calibrator)?;
        let model = match qforge_model::open(&path)? {
            Model::Policy(p) => Model::Policy(Box::new(precision.apply_policy(*p)?)),
            Model::Language(lm) => Model::Language(Box::new(precision.apply_language(*lm)?)),
        };
        Ok((model, precision.to_string()))
    })?;
    Ok(match model {
        Model::Policy(policy) => Py::new(
            py,
            Policy {
                policy: *policy,
                precision,
            },
        )?
        .into_any(),
        Model::Language(lm) => Py::new(py, LanguageModel { lm: *lm, precision })?.into_any(),
    })
}

/// What `act` returns: the actions, and their log-probabilities where the
/// head defines a distribution.
type Acted<'py> = (Bound<'py, PyAny>, Option<Bound<'py, PyArray1<f64>>>);

/// A control policy: observations in, actions and their log-probabilities
/// out.
#[pyclass(frozen, module = "qforge")]
pub struct Policy {
    policy: MlpPolicy,
    precision: String,
}

impl Policy {
    /// The rows of `observations`, checked against the policy's width.
    fn rows(&self, observations: &PyReadonlyArray2<'_, f32>) -> PyResult<Vec<f32>> {
        let width = self.policy.config().observation_dim;
        let shape = observations.shape();
        if shape[1] != width || shape[0] == 0 {
            return Err(usage(format!(
                "observations of shape {shape:?}: this policy takes rows of {width} values (n × {width}, n ≥ 1)"
            )));
        }
        Ok(observations.as_array().iter().copied().collect())
    }
}

#[pymethods]
impl Policy {
    /// Values per observation row.
    #[getter]
    fn observation_dim(&self) -> usize {
        self.policy.config().observation_dim
    }

    /// The precision it runs in (`f32`, `int8-dynamic`, …).
    #[getter]
    fn precision(&self) -> &str {
        &self.precision
    }

    fn __repr__(&self) -> String {
        let c = self.policy.config();
        format!(
            "qforge.Policy(observation_dim={}, outputs={}, precision={:?})",
            c.observation_dim,
            c.head.outputs(),
            self.precision
        )
    }

    /// The raw head outputs for `observations` (float32, n × observation
    /// dim): float32, n × outputs.
    fn forward<'py>(
        &self,
        py: Python<'py>,
        observations: PyReadonlyArray2<'py, f32>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let rows = self.rows(&observations)?;
        let n = observations.shape()[0];
        let outputs = py
            .detach(|| self.policy.forward(&rows, None))
            .map_err(Failure::from)?;
        let width = outputs.len() / n;
        let outputs = Array2::from_shape_vec((n, width), outputs).expect("whole rows");
        Ok(outputs.into_pyarray(py))
    }

    /// `(actions, log_probs)` for `observations` (float32, n × observation
    /// dim). Greedy by default (argmax, or the clipped mean); with `sample`,
    /// drawn from the policy's distribution by a generator seeded with
    /// `seed`. Actions are int64 (n,) for a discrete head, float32 (n ×
    /// action dim) otherwise. `log_probs` (float64, n) are each action's
    /// log-probability under the policy (log-softmax; Gaussian log-density),
    /// `None` for a head that defines no distribution.
    #[pyo3(signature = (observations, sample = false, seed = 0))]
    fn act<'py>(
        &self,
        py: Python<'py>,
        observations: PyReadonlyArray2<'py, f32>,
        sample: bool,
        seed: u64,
    ) -> PyResult<Acted<'py>> {
        let rows = self.rows(&observations)?;
        let head = &self.policy.config().head;
        if sample && !head.is_stochastic() {
            return Err(usage(
                "this policy's head defines no distribution to sample from (a Gaussian head needs log_std)",
            ));
        }
        let outputs = py
            .detach(|| self.policy.forward(&rows, None))
            .map_err(Failure::from)?;
        let mut rng = StdRng::seed_from_u64(seed);
        let actions: Vec<Action> = outputs
            .chunks_exact(head.outputs())
            .map(|row| {
                if sample {
                    head.sample(row, &mut rng)
                        .expect("a stochastic head samples")
                } else {
                    head.greedy(row)
                }
            })
            .collect();
        let log_probs: Option<Vec<f64>> = head.is_stochastic().then(|| {
            outputs
                .chunks_exact(head.outputs())
                .zip(&actions)
                .map(|(row, action)| head.log_prob(row, action).unwrap_or(f64::NAN))
                .collect()
        });
        Ok((
            actions_array(py, &actions)?,
            log_probs.map(|l| l.into_pyarray(py)),
        ))
    }
}

/// Actions as numpy: int64 (n,) of indices, or float32 (n × dim) of
/// continuous actions (one head gives one kind).
fn actions_array<'py>(py: Python<'py>, actions: &[Action]) -> PyResult<Bound<'py, PyAny>> {
    let mut indices = Vec::new();
    let mut values = Vec::new();
    for action in actions {
        match action {
            Action::Discrete(i) => indices.push(*i as i64),
            Action::Continuous(v) => values.extend_from_slice(v),
        }
    }
    if values.is_empty() {
        return Ok(indices.into_pyarray(py).into_any());
    }
    let array = Array2::from_shape_vec((actions.len(), values.len() / actions.len()), values)
        .map_err(|e| usage(format!("actions of unequal width: {e}")))?;
    Ok(array.into_pyarray(py).into_any())
}

/// A Llama-family language model with its tokenizer.
#[pyclass(frozen, module = "qforge")]
pub struct LanguageModel {
    lm: qforge_model::LanguageModel,
    precision: String,
}

#[pymethods]
impl LanguageModel {
    /// The precision it runs in (`f32`, `int8-dynamic`, …).
    #[getter]
    fn precision(&self) -> &str {
        &self.precision
    }

    fn __repr__(&self) -> String {
        let c = self.lm.model.config();
        format!(
            "qforge.LanguageModel(layers={}, hidden={}, vocab={}, precision={:?})",
            c.num_layers,
            c.hidden_size,
            self.lm.text.tokenizer.vocab_size(),
            self.precision
        )
    }

    /// The token ids of `text` (special tokens such as <|im_start|> are
    /// recognised).
    fn encode(&self, text: &str) -> PyResult<Vec<u32>> {
        Ok(self.lm.text.tokenizer.encode(text).map_err(Failure::from)?)
    }

    /// The text of `tokens`.
    fn decode(&self, tokens: Vec<u32>) -> PyResult<String> {
        Ok(self
            .lm
            .text
            .tokenizer
            .decode(&tokens)
            .map_err(Failure::from)?)
    }

    /// Generates after `prompt` (text): greedy unless `temperature`. Returns
    /// `qforge generate --json`'s dict: `text`, `tokens`, `prompt_tokens`,
    /// `prefill_tokens_per_s`, `decode_tokens_per_s`, `linear_weight_bytes`,
    /// `precision`.
    #[pyo3(signature = (prompt, max_tokens = 64, temperature = None, seed = 0))]
    fn generate<'py>(
        &self,
        py: Python<'py>,
        prompt: &str,
        max_tokens: usize,
        temperature: Option<f64>,
        seed: u64,
    ) -> PyResult<Bound<'py, PyAny>> {
        if let Some(t) = temperature
            && !(t >= 0.0 && t.is_finite())
        {
            return Err(usage(format!("temperature must be ≥ 0, got {t}")));
        }
        let options = GenerateOptions {
            max_tokens,
            temperature,
            seed,
        };
        let report = py.detach(|| -> Result<_, Failure> {
            let prompt = self.lm.text.tokenizer.encode(prompt)?;
            let generation = self.lm.generate(&prompt, &options)?;
            Ok(GenerationReport::new(
                &self.lm,
                generation,
                self.precision.clone(),
            )?)
        })?;
        to_python(py, &report)
    }

    /// The log-probability (float64) of each token of `completion` after
    /// `prompt` (token ids), under softmax(logits / temperature) (t = 1
    /// when `None`): what a trainer's importance weights need of the
    /// rollout policy. One forward over both (teacher forcing).
    #[pyo3(signature = (prompt, completion, temperature = None))]
    fn logprobs<'py>(
        &self,
        py: Python<'py>,
        prompt: Vec<u32>,
        completion: Vec<u32>,
        temperature: Option<f64>,
    ) -> PyResult<Bound<'py, PyArray1<f64>>> {
        let log_probs = py
            .detach(|| continuation_log_probs(&self.lm.model, &prompt, &completion, temperature))
            .map_err(Failure::from)?;
        Ok(log_probs.into_pyarray(py))
    }

    /// Perplexity over `text` with llama.cpp's method (chunks of `ctx`
    /// tokens, the second half of each scored): a dict of `perplexity`,
    /// `tokens`, `chunks`, `ctx`.
    #[pyo3(signature = (text, ctx = 512))]
    fn perplexity<'py>(
        &self,
        py: Python<'py>,
        text: &str,
        ctx: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let result = py.detach(|| -> Result<_, Failure> {
            let tokens = self.lm.text.tokenizer.encode(text)?;
            Ok(perplexity(&self.lm.model, &tokens, ctx)?)
        })?;
        to_python(py, &result)
    }
}
