//! `qforge.LanguageModel`: a Llama-family language model with its
//! tokenizer, for evaluators (`generate`, `logprobs`, `perplexity`) and for
//! RL trainers (`generate_batch`, `score`, `load_weights`; see `rollouts`).

use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Instant;

use numpy::{IntoPyArray, PyArray1};
use pyo3::prelude::*;
use qforge_decode::GenerateOptions;
use qforge_decode::GenerationReport;
use qforge_decode::sampling::continuation_log_probs;
use qforge_eval::perplexity;
use qforge_model::llama::MAX_POSITIONS;
use qforge_quant::precision::RunPrecision;
use qforge_quant::sync::WeightSync;
use qforge_serve::EngineLimits;
use qforge_serve::engine::Engine;
use qforge_serve::metrics::Metrics;
use serde::Serialize;

use crate::errors::{Failure, failed_with, usage};
use crate::rollouts::{self, Prompt, RequestOutput, Sampling};
use crate::to_python;

/// How many sequences and KV positions the rollout engine holds at once.
pub struct EngineSize {
    pub max_sequences: usize,
    pub kv_budget_tokens: usize,
}

/// The model being served and its version (1 as opened, one more per
/// `load_weights`).
struct Served {
    lm: Arc<qforge_model::LanguageModel>,
    version: u64,
}

/// A Llama-family language model with its tokenizer.
#[pyclass(frozen, module = "qforge")]
pub struct LanguageModel {
    served: RwLock<Served>,
    /// The rollout engine; it holds its own handle on the served weights.
    engine: Engine,
    sync: WeightSync,
    /// One weight sync at a time: each builds on the model before it.
    syncing: Mutex<()>,
    precision: String,
    /// Most positions a prompt and its completion may take.
    context: usize,
}

impl LanguageModel {
    /// `opened` (the model at `path` as opened) in `precision`, with its
    /// rollout engine.
    pub fn new(
        opened: qforge_model::LanguageModel,
        path: &Path,
        precision: RunPrecision,
        size: EngineSize,
    ) -> Result<Self, Failure> {
        let name = precision.to_string();
        let sync = WeightSync::new(path, precision, &opened)?;
        let lm = sync.to_served(opened)?;
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let limits = EngineLimits {
            max_sequences: size.max_sequences,
            kv_budget_tokens: size.kv_budget_tokens,
            threads,
            prefill_threads: threads,
            prefill_chunk: 512,
        };
        let engine = Engine::start(lm.clone(), None, limits, Arc::new(Metrics::default()))
            .map_err(|e| failed_with(&e.to_string()))?;
        let context = lm.model.config().max_position_embeddings.min(MAX_POSITIONS);
        Ok(Self {
            sync,
            served: RwLock::new(Served {
                lm: Arc::new(lm),
                version: 1,
            }),
            engine,
            syncing: Mutex::new(()),
            precision: name,
            context,
        })
    }

    /// The model served now.
    fn current(&self) -> Arc<qforge_model::LanguageModel> {
        let served = self.served.read().unwrap_or_else(PoisonError::into_inner);
        Arc::clone(&served.lm)
    }

    /// Prompt `index` as token ids of `lm`, checked to leave room for
    /// `max_tokens` more.
    fn prompt_ids(
        &self,
        lm: &qforge_model::LanguageModel,
        index: usize,
        prompt: Prompt,
        max_tokens: usize,
    ) -> PyResult<Vec<u32>> {
        let ids = match prompt {
            Prompt::Text(text) => lm.text.tokenizer.encode(&text).map_err(Failure::from)?,
            Prompt::Ids(ids) => ids,
        };
        check_ids(lm, &format!("prompt {index}"), &ids)?;
        if ids.is_empty() {
            return Err(usage(format!("prompt {index} has no tokens")));
        }
        if ids.len() + max_tokens > self.context {
            return Err(usage(format!(
                "prompt {index}: {} tokens and {max_tokens} to generate exceed the context of {} positions",
                ids.len(),
                self.context
            )));
        }
        Ok(ids)
    }
}

/// Refuses a token id outside `lm`'s vocabulary, naming `what`.
fn check_ids(lm: &qforge_model::LanguageModel, what: &str, ids: &[u32]) -> PyResult<()> {
    let vocab = lm.model.config().vocab_size;
    match ids.iter().find(|&&id| id as usize >= vocab) {
        Some(id) => Err(usage(format!(
            "{what}: token id {id} is outside the vocabulary of {vocab}"
        ))),
        None => Ok(()),
    }
}

/// `temperature` as the engine takes it: `None` (greedy) for 0.
fn temperature_of(t: f64) -> PyResult<Option<f64>> {
    if !(t >= 0.0 && t.is_finite()) {
        return Err(usage(format!(
            "temperature must be a finite number ≥ 0, got {t}"
        )));
    }
    Ok((t > 0.0).then_some(t))
}

/// What `load_weights` returns.
#[derive(Serialize)]
struct SyncReport {
    /// The version now served.
    model_version: u64,
    /// Seconds from the call to the new weights serving.
    seconds: f64,
    /// Int8 values in the model, and how many changed.
    int8_weights: u64,
    changed: u64,
    /// `changed / int8_weights` (0 for a model with no int8 layer).
    changed_share: f64,
    /// Per int8 weight, the share of its values that changed.
    tensors: std::collections::BTreeMap<String, f64>,
}

#[pymethods]
impl LanguageModel {
    /// The precision it runs in (`f32`, `int8-dynamic`, …).
    #[getter]
    fn precision(&self) -> &str {
        &self.precision
    }

    /// The version of the weights served: 1 as opened, one more per
    /// `load_weights`.
    #[getter]
    fn model_version(&self) -> u64 {
        self.served
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .version
    }

    fn __repr__(&self) -> String {
        let lm = self.current();
        let c = lm.model.config();
        format!(
            "qforge.LanguageModel(layers={}, hidden={}, vocab={}, precision={:?}, model_version={})",
            c.num_layers,
            c.hidden_size,
            lm.text.tokenizer.vocab_size(),
            self.precision,
            self.model_version()
        )
    }

    /// The token ids of `text` (special tokens such as <|im_start|> are
    /// recognised).
    fn encode(&self, text: &str) -> PyResult<Vec<u32>> {
        Ok(self
            .current()
            .text
            .tokenizer
            .encode(text)
            .map_err(Failure::from)?)
    }

    /// The text of `tokens`.
    fn decode(&self, tokens: Vec<u32>) -> PyResult<String> {
        Ok(self
            .current()
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
        let lm = self.current();
        let report = py.detach(|| -> Result<_, Failure> {
            let prompt = lm.text.tokenizer.encode(prompt)?;
            let generation = qforge_decode::generate(&lm, &prompt, &options)?;
            Ok(GenerationReport::new(
                &lm,
                generation,
                self.precision.clone(),
            )?)
        })?;
        to_python(py, &report)
    }

    /// Samples `n` completions of every prompt (a str, tokenized with
    /// special tokens recognised, or a list of token ids) on the continuous
    /// batching engine, every prompt and sample in flight together, the
    /// samples of a prompt sharing its prefill. `temperature` 0 is greedy;
    /// `stop` strings end a sample (cut from its text, their tokens kept).
    /// Prompt `p`'s sample `i` draws with the seed `seed + p·n + i`, the
    /// same draw whatever else runs beside it. Returns one
    /// `RequestOutput` per prompt, in order, shaped like vLLM's:
    /// `.outputs[i]` has `.token_ids`, `.text`, `.logprobs` (float64, the
    /// behaviour log-probability of every token, under softmax(logits /
    /// temperature); t = 1 when greedy) and `.finish_reason`. The GIL is
    /// released while it runs.
    #[pyo3(signature = (prompts, n = 1, max_tokens = 64, temperature = 1.0, top_p = 1.0, seed = 0, stop = None))]
    #[allow(clippy::too_many_arguments)]
    fn generate_batch(
        &self,
        py: Python<'_>,
        prompts: Vec<Prompt>,
        n: usize,
        max_tokens: usize,
        temperature: f64,
        top_p: f64,
        seed: u64,
        stop: Option<Vec<String>>,
    ) -> PyResult<Vec<RequestOutput>> {
        if n == 0 || max_tokens == 0 {
            return Err(usage("n and max_tokens must each be ≥ 1"));
        }
        if top_p != 1.0 {
            return Err(usage(
                "only top_p = 1 is supported (as in `qforge serve`); shape the distribution with temperature",
            ));
        }
        let stop = stop.unwrap_or_default();
        if stop.iter().any(String::is_empty) {
            return Err(usage("a stop string must not be empty"));
        }
        let sampling = Sampling {
            n,
            max_tokens,
            temperature: temperature_of(temperature)?,
            seed,
            stop,
        };
        let lm = self.current();
        let mut texts = Vec::with_capacity(prompts.len());
        let mut ids = Vec::with_capacity(prompts.len());
        for (index, prompt) in prompts.into_iter().enumerate() {
            texts.push(match &prompt {
                Prompt::Text(text) => Some(text.clone()),
                Prompt::Ids(_) => None,
            });
            ids.push(self.prompt_ids(&lm, index, prompt, max_tokens)?);
        }
        let generated = py.detach(|| rollouts::generate(&self.engine, &ids, &sampling))?;
        let reads_text = lm.text.tokenizer.reads_text();
        texts
            .into_iter()
            .zip(ids)
            .zip(generated)
            .map(|((text, ids), samples)| {
                rollouts::request_output(py, text, ids, samples, reads_text)
            })
            .collect()
    }

    /// The log-probabilities (float64, one array per pair) that the policy
    /// gives each completion's tokens after its prompt (two lists of
    /// token-id lists), under softmax(logits / temperature): computed on
    /// the rollout engine, step by step as generation computed them, so
    /// they equal `generate_batch`'s `.logprobs` for the tokens it drew,
    /// bit for bit, whatever ran beside either call. A completion may end
    /// with the end-of-sequence token, not hold one before its end.
    #[pyo3(signature = (prompt_token_ids, completion_token_ids, temperature = 1.0))]
    fn score<'py>(
        &self,
        py: Python<'py>,
        prompt_token_ids: Vec<Vec<u32>>,
        completion_token_ids: Vec<Vec<u32>>,
        temperature: f64,
    ) -> PyResult<Vec<Bound<'py, PyArray1<f64>>>> {
        if prompt_token_ids.len() != completion_token_ids.len() {
            return Err(usage(format!(
                "{} prompts and {} completions: score takes one completion per prompt",
                prompt_token_ids.len(),
                completion_token_ids.len()
            )));
        }
        let lm = self.current();
        let eos = &lm.text.tokenizer.eos;
        let mut pairs = Vec::with_capacity(prompt_token_ids.len());
        for (index, (prompt, completion)) in prompt_token_ids
            .into_iter()
            .zip(completion_token_ids)
            .enumerate()
        {
            let prompt = self.prompt_ids(&lm, index, Prompt::Ids(prompt), completion.len())?;
            check_ids(&lm, &format!("completion {index}"), &completion)?;
            let body = completion.split_last().map_or(&[][..], |(_, body)| body);
            if let Some(at) = body.iter().position(|t| eos.contains(t)) {
                return Err(usage(format!(
                    "completion {index} holds the end-of-sequence token at position {at}, before its end: a completion ends at its first end of sequence"
                )));
            }
            pairs.push((prompt, completion));
        }
        let temperature = temperature_of(temperature)?;
        let scored = py.detach(|| rollouts::score(&self.engine, pairs, temperature))?;
        Ok(scored.into_iter().map(|s| s.into_pyarray(py)).collect())
    }

    /// Serves new weights, given as a dict of numpy arrays (float32,
    /// float16, or bfloat16 as uint16 views) or a directory of safetensors
    /// files, named as the Hugging Face checkpoint names them, every tensor
    /// of the model: quantized with this model's frozen decisions (an
    /// artifact's transforms, per-layer precisions and activation scales; a
    /// run precision's scheme), swapped in once the sequences in flight
    /// finish on the old weights. No file is written. A missing, unknown,
    /// misshapen or non-finite tensor raises `QforgeError` naming it, and
    /// the old weights keep serving. Returns a dict: `model_version`,
    /// `seconds`, `int8_weights`, `changed`, `changed_share`, and `tensors`
    /// (each int8 weight's share of changed values).
    fn load_weights<'py>(
        &self,
        py: Python<'py>,
        weights: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let started = Instant::now();
        let tensors = rollouts::tensors(weights)?;
        // Without the GIL from here on, the wait for another sync's lock
        // included: a thread holding the GIL while it waits would block the
        // sync it waits for, which needs the GIL to return.
        let report = py.detach(|| -> Result<SyncReport, Failure> {
            let _one_at_a_time = self.syncing.lock().unwrap_or_else(PoisonError::into_inner);
            let current = self.current();
            let version = self.model_version() + 1;
            let synced = self.sync.apply(&current, tensors)?;
            let lm = Arc::new(synced.lm);
            let swapped = self
                .engine
                .swap((*lm).clone(), None, version)
                .ok_or_else(|| failed_with("the rollout engine stopped; open the model again"))?;
            swapped
                .blocking_recv()
                .map_err(|_| failed_with("the rollout engine stopped during the swap"))?;
            *self.served.write().unwrap_or_else(PoisonError::into_inner) = Served { lm, version };
            let change = synced.change;
            Ok(SyncReport {
                model_version: version,
                seconds: started.elapsed().as_secs_f64(),
                int8_weights: change.total.int8_weights,
                changed: change.total.changed,
                changed_share: change.total.share(),
                tensors: change
                    .tensors
                    .iter()
                    .map(|(name, c)| (name.clone(), c.share()))
                    .collect(),
            })
        })?;
        to_python(py, &report)
    }

    /// The log-probability (float64) of each token of `completion` after
    /// `prompt` (token ids), under softmax(logits / temperature) (t = 1
    /// when `None`), by one forward over both (teacher forcing). `score`
    /// gives the figures of the rollout engine itself.
    #[pyo3(signature = (prompt, completion, temperature = None))]
    fn logprobs<'py>(
        &self,
        py: Python<'py>,
        prompt: Vec<u32>,
        completion: Vec<u32>,
        temperature: Option<f64>,
    ) -> PyResult<Bound<'py, PyArray1<f64>>> {
        let lm = self.current();
        let log_probs = py
            .detach(|| continuation_log_probs(&lm.model, &prompt, &completion, temperature))
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
        let lm = self.current();
        let result = py.detach(|| -> Result<_, Failure> {
            let tokens = lm.text.tokenizer.encode(text)?;
            Ok(perplexity(&lm.model, &tokens, ctx)?)
        })?;
        to_python(py, &result)
    }
}
