//! Generation of one sequence: the prompt through the tensor forward, then
//! one token a step on the INT8 [`Decoder`] where every linear layer runs
//! on the INT8 engine (the tensor forward otherwise), each token drawn by
//! [`sample`] from the seeded stream of [`GenerateOptions::seed`].

use std::time::Instant;

use qforge_model::{LanguageModel, Logits, Result};
use rand::{SeedableRng, rngs::StdRng};
use serde::Serialize;

use crate::decoder::Decoder;
use crate::sampling::sample;

/// Generates up to `options.max_tokens` tokens after `prompt`, stopping at
/// an end-of-sequence token.
pub fn generate(
    lm: &LanguageModel,
    prompt: &[u32],
    options: &GenerateOptions,
) -> Result<Generation> {
    if prompt.is_empty() {
        return Err(qforge_formats::Error::Shape("the prompt has no tokens".into()).into());
    }
    let mut cache = lm.model.new_cache();
    cache.reserve(prompt.len() + options.max_tokens);
    let mut rng = StdRng::seed_from_u64(options.seed);
    let started = Instant::now();
    let logits = lm
        .model
        .forward(&[prompt.to_vec()], Some(&mut cache), None, Logits::Last)?;
    let prefill = started.elapsed().as_secs_f64();
    let mut next = sample(
        &logits.flatten_all()?.to_vec1::<f32>()?,
        options.temperature,
        &mut rng,
    )?;
    let mut tokens = Vec::new();
    let started = Instant::now();
    // An all-INT8 model decodes on the allocation-free decoder, on every
    // thread of the current pool.
    let mut decoder = Decoder::supports(&lm.model)
        .then(|| Decoder::new(rayon::current_num_threads()))
        .transpose()?;
    while tokens.len() < options.max_tokens && !lm.text.tokenizer.eos.contains(&next) {
        tokens.push(next);
        if tokens.len() == options.max_tokens {
            break;
        }
        let logits = match decoder.as_mut() {
            Some(decoder) => decoder.step(&lm.model, &mut [&mut cache], &[next], None)?,
            None => &lm
                .model
                .forward(&[vec![next]], Some(&mut cache), None, Logits::Last)?
                .flatten_all()?
                .to_vec1::<f32>()?,
        };
        next = sample(logits, options.temperature, &mut rng)?;
    }
    Ok(Generation {
        prompt_tokens: prompt.len(),
        tokens,
        prefill_seconds: prefill,
        decode_seconds: started.elapsed().as_secs_f64(),
    })
}

/// How to generate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GenerateOptions {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// `None`: greedy; `Some(t)`: sample from softmax(logits / t).
    pub temperature: Option<f64>,
    /// Seed of the sampler.
    pub seed: u64,
}

/// The result of a generation.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// Tokens of the prompt.
    pub prompt_tokens: usize,
    /// Generated tokens (without the prompt or the final EOS).
    pub tokens: Vec<u32>,
    /// Seconds spent on the prompt.
    pub prefill_seconds: f64,
    /// Seconds spent generating.
    pub decode_seconds: f64,
}

impl Generation {
    /// Prompt tokens per second.
    pub fn prefill_tokens_per_second(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_seconds.max(1e-9)
    }

    /// Generated tokens per second (the first comes from the prefill, so
    /// `tokens − 1` decode steps are timed).
    pub fn decode_tokens_per_second(&self) -> f64 {
        self.tokens.len().saturating_sub(1) as f64 / self.decode_seconds.max(1e-9)
    }
}

/// What `qforge generate` reports: the text and how fast it came.
#[derive(Debug, Clone, Serialize)]
pub struct GenerationReport {
    /// The generated text (`None` for a model without a tokenizer, which
    /// gives token ids only).
    pub text: Option<String>,
    /// Its tokens.
    pub tokens: Vec<u32>,
    /// Tokens of the prompt.
    pub prompt_tokens: usize,
    /// Prompt tokens per second.
    pub prefill_tokens_per_s: f64,
    /// Generated tokens per second.
    pub decode_tokens_per_s: f64,
    /// Bytes every decode step reads from the linear layers' weights.
    pub linear_weight_bytes: usize,
    /// The precision the model ran in.
    pub precision: String,
}

impl GenerationReport {
    /// The report of `generation` by `lm`, run in `precision`.
    pub fn new(lm: &LanguageModel, generation: Generation, precision: String) -> Result<Self> {
        Ok(Self {
            text: if lm.text.tokenizer.reads_text() {
                Some(lm.text.tokenizer.decode(&generation.tokens)?)
            } else {
                None
            },
            prompt_tokens: generation.prompt_tokens,
            prefill_tokens_per_s: generation.prefill_tokens_per_second(),
            decode_tokens_per_s: generation.decode_tokens_per_second(),
            tokens: generation.tokens,
            linear_weight_bytes: lm.model.linear_weight_bytes(),
            precision,
        })
    }
}

/// The speed, as a line (the text is the report's `text`).
impl std::fmt::Display for GenerationReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} prompt tokens at {:.1} tok/s, {} generated at {:.1} tok/s",
            self.prompt_tokens,
            self.prefill_tokens_per_s,
            self.tokens.len(),
            self.decode_tokens_per_s
        )
    }
}
