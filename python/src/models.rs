//! `qforge.open(path)` and the two kinds of model it returns: a `Policy`
//! (`act`, `forward`) and a `LanguageModel` (see `language`).

use std::path::PathBuf;

use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1, PyArray2, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;
use qforge_core::Calibrator;
use qforge_formats::policy::Action;
use qforge_model::{MlpPolicy, Model};
use qforge_quant::precision::RunPrecision;
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::errors::{Failure, usage};
use crate::language::{EngineSize, LanguageModel};

/// Opens the model at `path` (a GGUF file, a Hugging Face directory, a
/// policy directory, an ONNX policy or a native artifact) in `precision`:
/// `f32` (an artifact: its stored precisions), `int8-dynamic` (a language
/// model's residual stream rotated first, with fixed signs and no data),
/// `int8-dynamic-plain` (without the rotation), or `int8-static` with the
/// statistics `stats` of a `qforge calibrate` run and a `calibrator`. Returns a `Policy` or a `LanguageModel`; a language
/// model's rollout engine (`generate_batch`, `score`) runs at most
/// `max_sequences` sequences and `kv_budget_tokens` KV-cache positions at
/// once.
#[pyfunction]
#[pyo3(signature = (path, precision = "f32", stats = None, calibrator = "minmax", *, max_sequences = 256, kv_budget_tokens = 65536))]
pub fn open(
    py: Python<'_>,
    path: PathBuf,
    precision: &str,
    stats: Option<PathBuf>,
    calibrator: &str,
    max_sequences: usize,
    kv_budget_tokens: usize,
) -> PyResult<Py<PyAny>> {
    let calibrator: Calibrator = calibrator
        .parse()
        .map_err(|e| usage(format!("calibrator: {e}")))?;
    if max_sequences == 0 || kv_budget_tokens < 2 {
        return Err(usage(
            "max_sequences must be ≥ 1 and kv_budget_tokens ≥ 2 (a prompt token and one to generate)",
        ));
    }
    let limits = EngineSize {
        max_sequences,
        kv_budget_tokens,
    };
    let opened = py.detach(|| -> Result<_, Failure> {
        let precision = RunPrecision::named(precision, &path, stats.as_deref(), calibrator)?;
        Ok(match qforge_model::open(&path)? {
            Model::Policy(p) => Opened::Policy(Box::new(Policy {
                policy: precision.apply_policy(*p)?,
                precision: precision.to_string(),
            })),
            Model::Language(lm) => {
                Opened::Language(Box::new(LanguageModel::new(*lm, &path, precision, limits)?))
            }
        })
    })?;
    Ok(match opened {
        Opened::Policy(policy) => Py::new(py, *policy)?.into_any(),
        Opened::Language(lm) => Py::new(py, *lm)?.into_any(),
    })
}

/// What `open` made.
enum Opened {
    Policy(Box<Policy>),
    Language(Box<LanguageModel>),
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

    /// The head outputs for `rows`, refused when any is not finite.
    fn outputs(&self, rows: &[f32]) -> qforge_model::Result<Vec<f32>> {
        let outputs = self.policy.forward(rows, None)?;
        self.policy.config().head.check_finite(&outputs)?;
        Ok(outputs)
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
        let outputs = py.detach(|| self.outputs(&rows)).map_err(Failure::from)?;
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
        let outputs = py.detach(|| self.outputs(&rows)).map_err(Failure::from)?;
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
