//! What a trainer needs of its rollout policy, in process: batched
//! generation with the behaviour log-probability of every sampled token
//! (`generate_batch`, shaped like vLLM's `RequestOutput`), scoring that
//! reproduces those figures (`score`), and weights from the trainer's
//! memory (`load_weights`). Generation and scoring run on the serving
//! engine (`qforge_serve::engine`): continuous batching, every sequence of
//! a step in one batched forward, the samples of one prompt sharing its
//! prefill.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use numpy::PyReadonlyArrayDyn;
use numpy::{IntoPyArray, PyArray1};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use qforge_serve::engine::{Engine, Event, FinishReason, Finished, Request, Sibling};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};
use tokio::sync::oneshot;

use crate::errors::{Failure, usage};

/// One sample of a prompt, as vLLM's `CompletionOutput`.
#[pyclass(frozen, get_all, module = "qforge")]
pub struct CompletionOutput {
    /// Which of the prompt's `n` samples.
    index: usize,
    /// The tokens generated, the end of sequence included when it ended
    /// the sample.
    token_ids: Vec<u32>,
    /// Their text (stop strings cut off), `None` for a model without a
    /// tokenizer.
    text: Option<String>,
    /// float64, one per token of `token_ids`: its log-probability under the
    /// distribution it was drawn from, softmax(logits / temperature).
    logprobs: Py<PyArray1<f64>>,
    /// `"stop"` (end of sequence or a stop string) or `"length"`.
    finish_reason: &'static str,
}

#[pymethods]
impl CompletionOutput {
    fn __repr__(&self) -> String {
        format!(
            "qforge.CompletionOutput(index={}, tokens={}, finish_reason={:?})",
            self.index,
            self.token_ids.len(),
            self.finish_reason
        )
    }
}

/// The samples of one prompt, as vLLM's `RequestOutput`.
#[pyclass(frozen, get_all, module = "qforge")]
pub struct RequestOutput {
    /// The prompt as given, when it was text.
    prompt: Option<String>,
    /// Its token ids.
    prompt_token_ids: Vec<u32>,
    /// The `n` samples, in order.
    outputs: Vec<Py<CompletionOutput>>,
    /// The model version that generated every sample.
    model_version: u64,
}

#[pymethods]
impl RequestOutput {
    fn __repr__(&self) -> String {
        format!(
            "qforge.RequestOutput(prompt_tokens={}, n={}, model_version={})",
            self.prompt_token_ids.len(),
            self.outputs.len(),
            self.model_version
        )
    }
}

/// A prompt: text (tokenized with special tokens recognised) or token ids.
#[derive(FromPyObject)]
pub enum Prompt {
    /// Text.
    Text(String),
    /// Token ids.
    Ids(Vec<u32>),
}

/// How to sample.
pub struct Sampling {
    /// Samples per prompt.
    pub n: usize,
    /// Most tokens per sample.
    pub max_tokens: usize,
    /// `None`: greedy.
    pub temperature: Option<f64>,
    /// The first sample's seed (see [`generate`]).
    pub seed: u64,
    /// Strings that end a sample.
    pub stop: Vec<String>,
}

/// What one sample generated.
pub struct Sample {
    /// Its text, stop strings cut off.
    text: String,
    /// Why it ended.
    finish: FinishReason,
    /// Its tokens, their log-probabilities and the model version.
    finished: Finished,
}

/// One sample's ends: its events and what it generated.
struct Pending {
    events: UnboundedReceiver<Event>,
    finished: oneshot::Receiver<Finished>,
}

impl Pending {
    /// A sample drawn with `seed`: the ends this side keeps, and the
    /// sibling the engine gets.
    fn new(seed: u64) -> (Self, Sibling) {
        let (events, receiver) = unbounded_channel();
        let (finished, generated) = oneshot::channel();
        let pending = Pending {
            events: receiver,
            finished: generated,
        };
        let sibling = Sibling {
            seed,
            events,
            finished: Some(finished),
        };
        (pending, sibling)
    }

    /// Waits for the sample's end.
    fn wait(mut self) -> Result<Sample, String> {
        let mut text = String::new();
        let finish = loop {
            match self.events.blocking_recv() {
                Some(Event::Text { text: piece, .. }) => text.push_str(&piece),
                Some(Event::Done { finish_reason, .. }) => break finish_reason,
                Some(Event::Failed(message)) => return Err(message),
                None => return Err(ENGINE_GONE.into()),
            }
        };
        let finished = self.finished.blocking_recv().map_err(|_| ENGINE_GONE)?;
        Ok(Sample {
            text,
            finish,
            finished,
        })
    }
}

const ENGINE_GONE: &str = "the rollout engine stopped (see the log); open the model again";

/// Queues `prompt` (token ids) for `samples` samples whose seeds are
/// `seed`, `seed + 1`, …, scoring `forced` instead of sampling when given;
/// gives each sample's ends.
fn submit(
    engine: &Engine,
    prompt: Vec<u32>,
    sampling: &Sampling,
    seed: u64,
    forced: Option<Vec<u32>>,
) -> Result<Vec<Pending>, Failure> {
    let mut pending = Vec::with_capacity(sampling.n);
    let mut siblings = Vec::with_capacity(sampling.n);
    for i in 0..sampling.n {
        let (ends, sibling) = Pending::new(seed.wrapping_add(i as u64));
        pending.push(ends);
        siblings.push(sibling);
    }
    let first = siblings.remove(0);
    let request = Request {
        prompt,
        max_tokens: sampling.max_tokens,
        ignore_eos: false,
        temperature: sampling.temperature,
        seed: first.seed,
        stop: sampling.stop.clone(),
        // The behaviour log-probability of each token, no alternatives.
        log_probs: Some(0),
        events: first.events,
        forced,
        finished: first.finished,
        admitted: None,
        siblings,
    };
    if !engine.submit(request) {
        return Err(Failure::from(crate::errors::failed_with(ENGINE_GONE)));
    }
    Ok(pending)
}

/// Generates `sampling.n` samples of each prompt (token ids) on `engine`,
/// every prompt queued before the first is waited for; prompt `p`'s
/// samples draw with seeds `seed + p·n + i`. Gives each prompt's samples.
pub fn generate(
    engine: &Engine,
    prompts: &[Vec<u32>],
    sampling: &Sampling,
) -> Result<Vec<Vec<Sample>>, Failure> {
    let mut queued = Vec::with_capacity(prompts.len());
    for (p, prompt) in prompts.iter().enumerate() {
        let seed = sampling
            .seed
            .wrapping_add((p as u64).wrapping_mul(sampling.n as u64));
        queued.push(submit(engine, prompt.clone(), sampling, seed, None)?);
    }
    queued
        .into_iter()
        .map(|samples| {
            samples
                .into_iter()
                .map(|s| s.wait().map_err(|m| crate::errors::failed_with(&m).into()))
                .collect()
        })
        .collect()
}

/// The log-probability of every token of each completion after its prompt,
/// computed on `engine` as a generation that drew those tokens computed it.
pub fn score(
    engine: &Engine,
    pairs: Vec<(Vec<u32>, Vec<u32>)>,
    temperature: Option<f64>,
) -> Result<Vec<Vec<f64>>, Failure> {
    let mut queued = Vec::with_capacity(pairs.len());
    for (prompt, completion) in pairs {
        if completion.is_empty() {
            queued.push(None);
            continue;
        }
        let sampling = Sampling {
            n: 1,
            max_tokens: completion.len(),
            temperature,
            seed: 0,
            stop: Vec::new(),
        };
        queued.push(Some(submit(
            engine,
            prompt,
            &sampling,
            0,
            Some(completion),
        )?));
    }
    queued
        .into_iter()
        .map(|pending| match pending.and_then(|mut p| p.pop()) {
            None => Ok(Vec::new()),
            Some(sample) => sample
                .wait()
                .map(|sample| sample.finished.log_probs)
                .map_err(|m| crate::errors::failed_with(&m).into()),
        })
        .collect()
}

/// The Python objects of one prompt's samples.
pub fn request_output(
    py: Python<'_>,
    prompt: Option<String>,
    prompt_token_ids: Vec<u32>,
    samples: Vec<Sample>,
    reads_text: bool,
) -> PyResult<RequestOutput> {
    let model_version = samples.first().map_or(0, |s| s.finished.version);
    let outputs = samples
        .into_iter()
        .enumerate()
        .map(
            |(
                index,
                Sample {
                    text,
                    finish,
                    finished,
                },
            )| {
                Py::new(
                    py,
                    CompletionOutput {
                        index,
                        token_ids: finished.tokens,
                        text: reads_text.then_some(text),
                        logprobs: finished.log_probs.into_pyarray(py).unbind(),
                        finish_reason: match finish {
                            FinishReason::Stop => "stop",
                            FinishReason::Length => "length",
                        },
                    },
                )
            },
        )
        .collect::<PyResult<_>>()?;
    Ok(RequestOutput {
        prompt,
        prompt_token_ids,
        outputs,
        model_version,
    })
}

/// The tensors of `weights`: a dict of name → numpy array (float32,
/// float16, or bfloat16 as a uint16 view), or the path of a directory of
/// safetensors files.
pub fn tensors(weights: &Bound<'_, PyAny>) -> PyResult<BTreeMap<String, Tensor>> {
    if let Ok(dict) = weights.cast::<PyDict>() {
        let numpy = weights.py().import("numpy")?;
        let mut tensors = BTreeMap::new();
        for (name, value) in dict.iter() {
            let name: String = name
                .extract()
                .map_err(|_| usage("weights: every key must be a tensor name (str)"))?;
            let tensor = array_tensor(&numpy, &name, &value)?;
            tensors.insert(name, tensor);
        }
        return Ok(tensors);
    }
    let dir: std::path::PathBuf = weights.extract().map_err(|_| {
        usage("weights must be a dict of name → numpy array, or the path of a directory of safetensors files")
    })?;
    weights.py().detach(|| directory_tensors(&dir))
}

/// One numpy array as a tensor of its dtype (uint16 read as bfloat16),
/// copied once.
fn array_tensor(
    numpy: &Bound<'_, PyModule>,
    name: &str,
    value: &Bound<'_, PyAny>,
) -> PyResult<Tensor> {
    let not_array = || usage(format!("{name}: not a numpy array"));
    if !value.is_instance(&numpy.getattr("ndarray")?)? {
        return Err(not_array());
    }
    let array = numpy.call_method1("ascontiguousarray", (value,))?;
    let dtype = array.getattr("dtype")?;
    let kind: String = dtype.getattr("name")?.extract()?;
    let order: String = dtype.getattr("byteorder")?.extract()?;
    let dtype = match kind.as_str() {
        "float32" => DType::F32,
        "float16" => DType::F16,
        "uint16" | "bfloat16" => DType::BF16,
        other => {
            return Err(usage(format!(
                "{name}: dtype {other}; weights are float32, float16, or bfloat16 as a uint16 view (torch: t.view(torch.uint16).numpy())"
            )));
        }
    };
    if order == ">" {
        return Err(usage(format!(
            "{name}: big-endian values; give the machine's byte order"
        )));
    }
    let shape: Vec<usize> = array.getattr("shape")?.extract()?;
    let bytes = array
        .call_method0("ravel")?
        .call_method1("view", (numpy.getattr("uint8")?,))?;
    let bytes: PyReadonlyArrayDyn<'_, u8> = bytes.extract().map_err(|_| not_array())?;
    let bytes = bytes.as_slice().map_err(|_| not_array())?;
    Tensor::from_raw_buffer(bytes, dtype, &shape, &Device::Cpu)
        .map_err(|e| usage(format!("{name}: {e}")))
}

/// Every tensor of the `.safetensors` files in `dir`.
fn directory_tensors(dir: &Path) -> PyResult<BTreeMap<String, Tensor>> {
    let entries = std::fs::read_dir(dir).map_err(|e| {
        usage(format!(
            "weights: cannot read the directory {}: {e}",
            dir.display()
        ))
    })?;
    let mut files: Vec<_> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(usage(format!(
            "weights: {} holds no .safetensors file",
            dir.display()
        )));
    }
    let mut tensors = BTreeMap::new();
    for file in files {
        let loaded = candle_core::safetensors::load(&file, &Device::Cpu)
            .map_err(|e| crate::errors::failed_with(&format!("{}: {e}", file.display())))?;
        tensors.extend(loaded);
    }
    Ok(tensors)
}
