//! A language model ready to use: decoder, tokenizer and chat template, with
//! generation and evaluation (perplexity, comparison of two models).

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::{D, Tensor};
use qforge_kernels::exp::{SOFTMAX_BLOCK, softmax_weights};
use rand::{Rng, SeedableRng, rngs::StdRng};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::llama::{Decoder, HiddenState, Llama, LlamaConfig, Logits, Residency, log_softmax};
use crate::tokenizer::TextTokenizer;

/// What turns text into token ids: the tokenizer and the chat template.
/// Loading it reads no weights, so a coordinator can plan a calibration
/// without holding the model in memory.
#[derive(Debug, Clone)]
pub struct TextSide {
    /// The tokenizer.
    pub tokenizer: TextTokenizer,
    /// The chat template (Jinja), when the model ships one.
    pub chat_template: Option<String>,
}

impl TextSide {
    /// Whether `other` tokenizes and templates text exactly as this does.
    pub fn same_as(&self, other: &TextSide) -> bool {
        self.chat_template == other.chat_template && self.tokenizer.same_as(&other.tokenizer)
    }

    /// The tokenizer and chat template of a GGUF file or a Hugging Face
    /// directory (`config.json`, `tokenizer.json`, `tokenizer_config.json`).
    pub fn load(path: &Path) -> Result<Self> {
        if path.is_dir() {
            let config_path = path.join("config.json");
            let json: serde_json::Value =
                serde_json::from_slice(&crate::files::read_config(&config_path)?)
                    .map_err(|e| Error::Format(format!("{}: {e}", config_path.display())))?;
            let c = LlamaConfig::from_hf(&json).map_err(|e| e.in_file(&config_path))?;
            Self::from_hf_dir(path, &c)
        } else {
            Self::from_gguf(&GgufFile::open(path)?, path)
        }
    }

    /// A directory without `tokenizer.json` (nothing at that path, not even a
    /// broken link) gives a tokenizer that takes token ids only.
    fn from_hf_dir(dir: &Path, c: &LlamaConfig) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let (bos, add_bos, eos) = (c.bos_token_id, hf_adds_bos(dir)?, c.eos_token_ids.clone());
        let tokenizer = match path.symlink_metadata() {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                TextTokenizer::ids_only(&path, c.vocab_size, bos, add_bos, eos)
            }
            _ => TextTokenizer::from_file(&path, bos, add_bos, eos)?,
        };
        let chat_template =
            tokenizer_config(dir)?.and_then(|j| j["chat_template"].as_str().map(str::to_owned));
        Ok(Self {
            tokenizer,
            chat_template,
        })
    }

    fn from_gguf(file: &GgufFile, path: &Path) -> Result<Self> {
        let tokenizer = TextTokenizer::from_gguf(&file.header).map_err(|e| e.in_file(path))?;
        let chat_template = file
            .header
            .metadata
            .get("tokenizer.chat_template")
            .and_then(|v| v.as_str())
            .map(str::to_owned);
        Ok(Self {
            tokenizer,
            chat_template,
        })
    }

    /// Renders a prompt and a completion as one conversation with the model's
    /// chat template (a user turn and an assistant turn), or concatenates them
    /// when the model has no template.
    pub fn chat_text(&self, prompt: &str, completion: &str) -> Result<String> {
        let Some(template) = &self.chat_template else {
            return Ok(format!("{prompt}{completion}"));
        };
        let messages = [
            ChatMessage {
                role: "user".into(),
                content: prompt.into(),
            },
            ChatMessage {
                role: "assistant".into(),
                content: completion.into(),
            },
        ];
        self.render_chat(template, &messages, false)
    }

    /// The prompt that asks the model for the next assistant turn after
    /// `messages`, rendered with its chat template: text to show, not to
    /// tokenize, since a special token's string in a message would read as
    /// that token ([`Self::chat_prompt_ids`] tokenizes it safely).
    pub fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<String> {
        let Some(template) = &self.chat_template else {
            return Err(Error::Unsupported(
                "the model has no chat template; send plain text to /v1/completions".into(),
            ));
        };
        self.render_chat(template, messages, true)
    }

    /// The token ids of [`Self::chat_prompt`], with every message's content
    /// read as plain text: a special token's string in it (`<|im_end|>`)
    /// stays the characters it is made of, so no message can open or close
    /// a turn of another role. Only the roles `system`, `user` and
    /// `assistant` are taken.
    ///
    /// The template is rendered with each content between two
    /// noncharacters, which mark where the contents lie in the rendered
    /// text and are then taken out; the text is tokenized as one, special
    /// tokens recognised only outside those spans. A conversation whose
    /// messages spell no special token gets the ids its rendered text gets.
    pub fn chat_prompt_ids(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        for message in messages {
            if !CHAT_ROLES.contains(&message.role.as_str()) {
                return Err(Error::Request(format!(
                    "role {:?} is not one of {}",
                    message.role,
                    CHAT_ROLES.join(", ")
                )));
            }
            if message.content.contains([MARK_START, MARK_END]) {
                return Err(Error::Request(
                    "a message holds the noncharacter U+FDD0 or U+FDD1, which chat prompts reserve"
                        .into(),
                ));
            }
        }
        let marked: Vec<ChatMessage> = messages
            .iter()
            .map(|m| ChatMessage {
                role: m.role.clone(),
                content: format!("{MARK_START}{}{MARK_END}", m.content),
            })
            .collect();
        let rendered = self.chat_prompt(&marked)?;
        let mut text = String::with_capacity(rendered.len());
        let mut contents = Vec::new();
        let mut rest = rendered.as_str();
        while let Some((markup, marked)) = rest.split_once(MARK_START) {
            text.push_str(markup);
            let (content, after) = marked
                .split_once(MARK_END)
                .ok_or_else(|| Error::Format("chat template: it cut a message's content".into()))?;
            contents.push(text.len()..text.len() + content.len());
            text.push_str(content);
            rest = after;
        }
        if rest.contains(MARK_END) {
            return Err(Error::Format(
                "chat template: it cut a message's content".into(),
            ));
        }
        text.push_str(rest);
        let mut ids = self.tokenizer.bos_ids();
        ids.extend(self.tokenizer.encode_with_plain(&text, &contents)?);
        Ok(ids)
    }

    fn render_chat(
        &self,
        template: &str,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let mut env = minijinja::Environment::new();
        env.add_template("chat", template)
            .map_err(|e| Error::Format(format!("chat template: {e}")))?;
        let token = |id: Option<u32>| {
            id.and_then(|i| self.tokenizer.decode(&[i]).ok())
                .unwrap_or_default()
        };
        let messages: Vec<_> = messages
            .iter()
            .map(|m| minijinja::context! { role => m.role, content => m.content })
            .collect();
        let context = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => token(self.tokenizer.bos),
            eos_token => token(self.tokenizer.eos.first().copied()),
        };
        env.get_template("chat")
            .and_then(|t| t.render(context))
            .map_err(|e| Error::Format(format!("chat template: {e}")))
    }
}

/// The roles a chat message may have.
const CHAT_ROLES: [&str; 3] = ["system", "user", "assistant"];

/// Noncharacters around a message's index where the chat template puts its
/// content (see [`TextSide::chat_prompt_ids`]).
const MARK_START: char = '\u{FDD0}';
const MARK_END: char = '\u{FDD1}';

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text of the turn.
    pub content: String,
}

/// A decoder with the text side that feeds it.
#[derive(Debug, Clone)]
pub struct LanguageModel {
    /// The decoder.
    pub model: Llama,
    /// Its tokenizer and chat template.
    pub text: TextSide,
    /// Where it was loaded from.
    pub source: PathBuf,
}

impl LanguageModel {
    /// Loads a GGUF file or a Hugging Face directory (`config.json`,
    /// safetensors, `tokenizer.json`). A native artifact is not read here
    /// (the artifact loader builds on this module): open any model,
    /// artifacts included, with [`crate::open()`].
    pub fn load(path: &Path) -> Result<Self> {
        if path.is_dir() {
            let model = Llama::from_hf_dir(path)?;
            let text = TextSide::from_hf_dir(path, model.config())?;
            return Ok(Self {
                model,
                text,
                source: path.to_owned(),
            });
        }
        // One parse of the header serves the tokenizer and the decoder.
        let file = GgufFile::open(path)?;
        let text = TextSide::from_gguf(&file, path)?;
        Ok(Self {
            model: Llama::from_gguf_file(file, Residency::Auto)?,
            text,
            source: path.to_owned(),
        })
    }

    /// Generates up to `options.max_tokens` tokens after `prompt`, stopping at
    /// an end-of-sequence token.
    pub fn generate(&self, prompt: &[u32], options: &GenerateOptions) -> Result<Generation> {
        if prompt.is_empty() {
            return Err(Error::Shape("the prompt has no tokens".into()));
        }
        let mut cache = self.model.new_cache();
        cache.reserve(prompt.len() + options.max_tokens);
        let mut rng = StdRng::seed_from_u64(options.seed);
        let started = Instant::now();
        let logits =
            self.model
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
        let mut decoder = Decoder::supports(&self.model)
            .then(|| Decoder::new(rayon::current_num_threads()))
            .transpose()?;
        while tokens.len() < options.max_tokens && !self.text.tokenizer.eos.contains(&next) {
            tokens.push(next);
            if tokens.len() == options.max_tokens {
                break;
            }
            let logits = match decoder.as_mut() {
                Some(decoder) => decoder.step(&self.model, &mut [&mut cache], &[next], None)?,
                None => &self
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
}

/// A Hugging Face directory's `tokenizer_config.json`: `None` when it is
/// absent or not JSON (it is optional, and only a few of its keys are read);
/// a file that cannot be read (not a regular file, too large) is an error.
fn tokenizer_config(dir: &Path) -> Result<Option<serde_json::Value>> {
    let path = dir.join("tokenizer_config.json");
    if !path.exists() {
        return Ok(None);
    }
    Ok(serde_json::from_slice(&crate::files::read_config(&path)?).ok())
}

/// Whether a Hugging Face tokenizer config asks for BOS.
fn hf_adds_bos(dir: &Path) -> Result<bool> {
    Ok(tokenizer_config(dir)?
        .and_then(|j| j["add_bos_token"].as_bool())
        .unwrap_or(false))
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

/// Picks the next token from one position's logits: the argmax when
/// `temperature` is `None` or 0, else a draw from softmax(logits / t).
///
/// The draw is one uniform f64 from `rng` times the softmax's total, found
/// among [`SOFTMAX_BLOCK`] block sums, then among that block's weights
/// ([`softmax_weights`]: the same bits on every CPU tier), so a seed draws
/// the same tokens on every machine. A row without a finite, positive
/// total (NaN or infinite logits) gives its argmax.
pub fn sample(logits: &[f32], temperature: Option<f64>, rng: &mut StdRng) -> Result<u32> {
    let t = match temperature {
        None | Some(0.0) => return Ok(argmax(logits)),
        Some(t) if t > 0.0 && t.is_finite() => t,
        Some(t) => {
            return Err(Error::Shape(format!(
                "temperature must be ≥ 0 and finite, got {t}"
            )));
        }
    };
    let uniform = rng.random::<f64>();
    Ok(with_softmax(logits, t, |weights, block_sums| {
        let total: f64 = block_sums.iter().sum();
        if !(total > 0.0 && total.is_finite()) {
            return argmax(logits);
        }
        let mut target = uniform * total;
        for (block, &sum) in block_sums.iter().enumerate() {
            if target > sum {
                target -= sum;
                continue;
            }
            let first = block * SOFTMAX_BLOCK;
            let weights = &weights[first..(first + SOFTMAX_BLOCK).min(weights.len())];
            let mut last_drawable = None;
            for (i, &w) in weights.iter().enumerate() {
                if w > 0.0 {
                    last_drawable = Some(i);
                }
                target -= f64::from(w);
                if target <= 0.0 && w > 0.0 {
                    return (first + i) as u32;
                }
            }
            // The block's sum is its weights' in another order; what
            // rounding leaves over belongs to its last token.
            if let Some(i) = last_drawable {
                return (first + i) as u32;
            }
        }
        argmax(logits)
    }))
}

thread_local! {
    /// One vocabulary's softmax weights and block sums, per thread (the
    /// engine draws for many sequences in parallel).
    static SOFTMAX: RefCell<(Vec<f32>, Vec<f64>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Runs `f` on the weights and block sums of softmax(logits / t) (see
/// [`softmax_weights`]), in this thread's buffers: a draw allocates nothing.
fn with_softmax<T>(logits: &[f32], t: f64, f: impl FnOnce(&[f32], &[f64]) -> T) -> T {
    SOFTMAX.with(|buffers| {
        let (weights, block_sums) = &mut *buffers.borrow_mut();
        weights.resize(logits.len(), 0.0);
        block_sums.resize(logits.len().div_ceil(SOFTMAX_BLOCK), 0.0);
        // `t` > 0 and finite: a scale that overflows f32 is an infinite
        // one, whose softmax is the argmax's (as a NaN-total row falls to).
        let scale = ((1.0 / t) as f32).min(f32::MAX);
        if softmax_weights(logits, scale, weights, block_sums).is_err() {
            // Only a scale that rounds to 0 is refused: t above 1e38.
            block_sums.fill(f64::NAN);
        }
        f(weights, block_sums)
    })
}

/// A token's log-probability under the distribution it was drawn from,
/// with the likeliest tokens' beside it (OpenAI's `logprobs`).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogProb {
    /// The token.
    pub token: u32,
    /// Its log-probability.
    pub log_prob: f64,
    /// The likeliest tokens and their log-probabilities, likeliest first
    /// (ties: the lower id first).
    pub top: Vec<(u32, f64)>,
}

/// The log-probability of `token`, and of the `top` likeliest tokens, under
/// the distribution [`sample`] draws from at `temperature`:
/// log softmax(logits / t), with t = 1 when greedy (greedy draws from no
/// distribution; the model's own is the one a trainer scores against).
/// The softmax's total is [`sample`]'s (f32 weights summed in f64), the
/// rest f64, so the figures do not depend on the vocabulary's size.
pub fn token_log_prob(
    logits: &[f32],
    temperature: Option<f64>,
    token: u32,
    top: usize,
) -> TokenLogProb {
    let t = match temperature {
        Some(t) if t > 0.0 => t,
        _ => 1.0,
    };
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let shifted = |l: f32| (f64::from(l) - f64::from(max)) / t;
    let log_total = with_softmax(logits, t, |_, block_sums| {
        block_sums.iter().sum::<f64>().ln()
    });
    let log_prob = |i: usize| shifted(logits[i]) - log_total;
    // The `top` best so far, best first; the vocabulary is read once.
    let mut best: Vec<usize> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if best.len() == top && l <= logits[best[top - 1]] {
                continue;
            }
            let at = best.partition_point(|&b| logits[b] >= l);
            best.insert(at, i);
            best.truncate(top);
        }
    }
    TokenLogProb {
        token,
        log_prob: log_prob(token as usize),
        top: best.into_iter().map(|i| (i as u32, log_prob(i))).collect(),
    }
}

/// The log-probability of each token of `continuation` after `prompt`
/// (teacher forcing: one forward over both), under the distribution
/// [`token_log_prob`] describes. What a trainer computes for the tokens a
/// rollout engine sampled, and what the engine's own figures are checked
/// against.
pub fn continuation_log_probs(
    model: &Llama,
    prompt: &[u32],
    continuation: &[u32],
    temperature: Option<f64>,
) -> Result<Vec<f64>> {
    if prompt.is_empty() {
        return Err(Error::Shape("the prompt has no tokens".into()));
    }
    let Some((_, fed)) = continuation.split_last() else {
        return Ok(Vec::new());
    };
    let tokens = [prompt, fed].concat();
    let logits = model.forward(&[tokens], None, None, Logits::All)?;
    // Position j predicts token j + 1: the rows from the prompt's last on.
    let rows = logits
        .get(0)?
        .narrow(0, prompt.len() - 1, continuation.len())?
        .to_vec2::<f32>()?;
    Ok(rows
        .iter()
        .zip(continuation)
        .map(|(row, &token)| token_log_prob(row, temperature, token, 0).log_prob)
        .collect())
}

/// Index of the first maximum.
fn argmax(values: &[f32]) -> u32 {
    values
        .iter()
        .enumerate()
        .fold(0, |best, (i, &v)| if v > values[best] { i } else { best }) as u32
}

/// Perplexity with llama.cpp's method: consecutive, non-overlapping chunks of
/// `ctx` tokens; in each, only the second half is scored (every scored token
/// has at least ctx/2 tokens of context), so figures are comparable with
/// `llama-perplexity`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Perplexity {
    /// exp(mean negative log-likelihood).
    pub perplexity: f64,
    /// Number of scored tokens.
    pub tokens: usize,
    /// Number of chunks.
    pub chunks: usize,
    /// Tokens per chunk.
    pub ctx: usize,
}

impl std::fmt::Display for Perplexity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "perplexity {:.4} over {} scored tokens ({} chunks of {})",
            self.perplexity, self.tokens, self.chunks, self.ctx
        )
    }
}

/// How many chunks of `ctx` a text of `tokens` has; a text shorter than
/// one chunk (or a `ctx` too small to score) is refused.
fn chunk_count(tokens: usize, ctx: usize) -> Result<usize> {
    if ctx < 4 {
        return Err(Error::Shape(format!(
            "--ctx {ctx} is too small (at least 4)"
        )));
    }
    let chunks = tokens / ctx;
    if chunks == 0 {
        return Err(Error::Shape(format!(
            "the text has {tokens} tokens, fewer than one chunk of --ctx {ctx}; use a longer text or a smaller --ctx"
        )));
    }
    Ok(chunks)
}

/// Log-probabilities of the scored positions of chunk `c`, `[scored,
/// vocab]`, with the tokens they score. One chunk at a time: a chunk's
/// figures are ~50 MB for SmolLM2 at ctx 512, so holding every chunk's
/// (as this once did) took 6 GB for a 64 000-token text.
fn chunk_log_probs(
    model: &Llama,
    tokens: &[u32],
    ctx: usize,
    c: usize,
) -> Result<(Tensor, Vec<u32>)> {
    let chunk = &tokens[c * ctx..(c + 1) * ctx];
    let logits = model.forward(&[chunk.to_vec()], None, None, Logits::All)?;
    scored_log_probs(&logits, chunk)
}

/// Of a chunk's `logits` (`[1, ctx, vocab]`), the log-probabilities of the
/// scored positions, with the tokens they score: position j predicts token
/// j + 1, and j in [ctx / 2, ctx − 1) is scored (llama.cpp's method).
fn scored_log_probs(logits: &Tensor, chunk: &[u32]) -> Result<(Tensor, Vec<u32>)> {
    let (ctx, first) = (chunk.len(), chunk.len() / 2);
    let scored = logits.get(0)?.narrow(0, first, ctx - 1 - first)?;
    Ok((log_softmax(&scored)?, scored_targets(chunk).to_vec()))
}

/// The tokens a chunk's scored positions predict (see [`scored_log_probs`]).
fn scored_targets(chunk: &[u32]) -> &[u32] {
    &chunk[chunk.len() / 2 + 1..]
}

/// The negative log-likelihood of the scored targets, summed in the order
/// they come. Every perplexity qforge reports is summed here, so the same
/// log-probabilities give the same perplexity to the last bit.
#[derive(Default)]
struct Nll {
    sum: f64,
    count: usize,
}

impl Nll {
    /// Adds the log-probabilities `log_probs` (`[targets, vocab]`) give
    /// their `targets`; returns the values, flat.
    fn add(&mut self, log_probs: &Tensor, targets: &[u32]) -> Result<Vec<f32>> {
        let vocab = log_probs.dims2()?.1;
        let values = log_probs.flatten_all()?.to_vec1::<f32>()?;
        for (row, &t) in values.chunks_exact(vocab).zip(targets) {
            self.sum -= f64::from(row[t as usize]);
            self.count += 1;
        }
        Ok(values)
    }

    fn perplexity(&self) -> f64 {
        (self.sum / self.count as f64).exp()
    }
}

/// Perplexity of `model` on `tokens` (see [`Perplexity`]).
pub fn perplexity(model: &Llama, tokens: &[u32], ctx: usize) -> Result<Perplexity> {
    let chunks = chunk_count(tokens.len(), ctx)?;
    let mut nll = Nll::default();
    for c in 0..chunks {
        let (log_probs, targets) = chunk_log_probs(model, tokens, ctx, c)?;
        nll.add(&log_probs, &targets)?;
    }
    Ok(Perplexity {
        perplexity: nll.perplexity(),
        tokens: nll.count,
        chunks,
        ctx,
    })
}

/// Two models compared on the same text, as llama.cpp's `--kl-divergence`
/// reports.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Comparison {
    /// Perplexity of the model under test.
    pub perplexity: f64,
    /// Perplexity of the reference.
    pub reference_perplexity: f64,
    /// Mean KL(reference ‖ model) of the next-token distributions.
    pub kl_divergence: f64,
    /// Fraction of positions where both predict the same top token.
    pub top1_agreement: f64,
    /// Number of scored positions.
    pub tokens: usize,
    /// A 95 % interval of `perplexity / reference_perplexity − 1`, from the
    /// spread of that ratio over the text's chunks (see
    /// [`increase_interval`]); `None` for a text of one chunk.
    pub increase_interval: Option<[f64; 2]>,
}

impl std::fmt::Display for Comparison {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "perplexity {:.4} (reference {:.4}), mean KL {:.6}, top-1 agreement {:.2} % over {} tokens",
            self.perplexity,
            self.reference_perplexity,
            self.kl_divergence,
            100.0 * self.top1_agreement,
            self.tokens
        )?;
        if let Some([low, high]) = self.increase_interval {
            write!(
                f,
                "; increase {:+.2} % (95 % interval {:+.2} … {:+.2} %)",
                100.0 * (self.perplexity / self.reference_perplexity - 1.0),
                100.0 * low,
                100.0 * high
            )?;
        }
        Ok(())
    }
}

/// A reference model's log-probabilities on a text, computed once so that
/// many models can be compared with it ([`compare_to`]). They are kept in a
/// temporary file (see the `spill` module), one chunk read back at a time:
/// for a 128 256-token vocabulary they are 1 GB per 4 096 tokens.
pub struct ReferenceLogProbs {
    chunks: Vec<SpilledLogProbs>,
    ctx: usize,
    tokens: usize,
    /// The reference's own perplexity on the text.
    perplexity: f64,
    /// Per chunk, when kept: the hidden states entering every layer.
    states: Vec<Vec<HiddenState>>,
}

/// One chunk's log-probabilities, `[rows, vocab]` f32, in a spilled file.
struct SpilledLogProbs {
    values: std::sync::Arc<memmap2::Mmap>,
    shape: (usize, usize),
    /// The negative log-likelihood of the chunk's targets, summed.
    nll: f64,
}

impl SpilledLogProbs {
    /// Spills a chunk's `log_probs`, adding what they give their `targets`
    /// to `nll`.
    fn new(log_probs: &Tensor, targets: &[u32], nll: &mut Nll) -> Result<Self> {
        let shape = log_probs.dims2()?;
        let before = nll.sum;
        let values = nll.add(log_probs, targets)?;
        let values = crate::spill::spill(|out| crate::spill::write_f32(&values, out))?;
        Ok(Self {
            values,
            shape,
            nll: nll.sum - before,
        })
    }

    /// The log-probabilities, as they were.
    fn read(&self) -> Result<Tensor> {
        let values = crate::spill::read_f32(&self.values);
        Ok(Tensor::from_vec(
            values,
            self.shape,
            &candle_core::Device::Cpu,
        )?)
    }
}

impl ReferenceLogProbs {
    /// Runs `reference` over `tokens` in chunks of `ctx`.
    pub fn new(reference: &Llama, tokens: &[u32], ctx: usize) -> Result<Self> {
        let mut nll = Nll::default();
        let chunks = (0..chunk_count(tokens.len(), ctx)?)
            .map(|c| {
                let (log_probs, targets) = chunk_log_probs(reference, tokens, ctx, c)?;
                SpilledLogProbs::new(&log_probs, &targets, &mut nll)
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            chunks,
            ctx,
            tokens: tokens.len(),
            perplexity: nll.perplexity(),
            states: Vec::new(),
        })
    }

    /// [`ReferenceLogProbs::new`], keeping the hidden states entering every
    /// layer of every chunk, so that a model that differs from `reference`
    /// only from some layer on is compared from there ([`compare_from`]).
    /// They take `(layers + 1) × tokens × hidden` floats.
    pub fn keeping_states(reference: &Llama, tokens: &[u32], ctx: usize) -> Result<Self> {
        let (mut chunks, mut states, mut nll) = (Vec::new(), Vec::new(), Nll::default());
        for c in 0..chunk_count(tokens.len(), ctx)? {
            let chunk = &tokens[c * ctx..(c + 1) * ctx];
            let (logits, kept) = reference.forward_keeping(&[chunk.to_vec()], Logits::All)?;
            let (log_probs, targets) = scored_log_probs(&logits, chunk)?;
            chunks.push(SpilledLogProbs::new(&log_probs, &targets, &mut nll)?);
            states.push(kept);
        }
        Ok(Self {
            chunks,
            ctx,
            tokens: tokens.len(),
            perplexity: nll.perplexity(),
            states,
        })
    }

    /// The reference's own perplexity on the text it was run on, summed as
    /// it was run: bit for bit what [`perplexity`] and [`compare_to`] report
    /// for it.
    pub fn perplexity(&self) -> f64 {
        self.perplexity
    }

    /// Refuses `tokens` other than the text the reference was run on (by
    /// count: the caller holds the text).
    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        if tokens.len() != self.tokens {
            return Err(Error::Shape(format!(
                "the reference was run on {} tokens, the model on {}",
                self.tokens,
                tokens.len()
            )));
        }
        Ok(())
    }
}

/// Compares `model` against `reference` on `tokens`.
pub fn compare(model: &Llama, reference: &Llama, tokens: &[u32], ctx: usize) -> Result<Comparison> {
    compare_to(
        model,
        &ReferenceLogProbs::new(reference, tokens, ctx)?,
        tokens,
    )
}

/// Compares `model` against a reference's log-probabilities on the same
/// `tokens`.
pub fn compare_to(
    model: &Llama,
    reference: &ReferenceLogProbs,
    tokens: &[u32],
) -> Result<Comparison> {
    compare_chunks(reference, tokens, |c| {
        chunk_log_probs(model, tokens, reference.ctx, c)
    })
}

/// [`compare_to`] for a `model` whose layers before `layer` are the
/// reference's (`layer` = the layer count: only the final norm and head
/// differ): each chunk runs from the reference's hidden state entering
/// `layer`, kept by [`ReferenceLogProbs::keeping_states`]. The figures are
/// those of [`compare_to`], bit for bit, for a fraction of the work.
pub fn compare_from(
    model: &Llama,
    reference: &ReferenceLogProbs,
    tokens: &[u32],
    layer: usize,
) -> Result<Comparison> {
    let ctx = reference.ctx;
    compare_chunks(reference, tokens, |c| {
        let state = reference
            .states
            .get(c)
            .and_then(|kept| kept.get(layer))
            .ok_or_else(|| {
                Error::Shape(format!(
                    "the reference kept no hidden state entering layer {layer} of chunk {c}"
                ))
            })?;
        let chunk = &tokens[c * ctx..(c + 1) * ctx];
        let logits = model.forward_resuming(&[chunk.to_vec()], state, Logits::All)?;
        scored_log_probs(&logits, chunk)
    })
}

/// Compares the log-probabilities `chunk` gives for each chunk of `tokens`
/// with `reference`'s.
fn compare_chunks(
    reference: &ReferenceLogProbs,
    tokens: &[u32],
    chunk: impl Fn(usize) -> Result<(Tensor, Vec<u32>)>,
) -> Result<Comparison> {
    reference.check_tokens(tokens)?;
    let (mut nll, mut kl, mut agree) = (Nll::default(), 0.0, 0usize);
    let mut log_ratios = Vec::with_capacity(reference.chunks.len());
    for (c, spilled) in reference.chunks.iter().enumerate() {
        let (ours, targets) = chunk(c)?;
        let (lp, rp) = (&ours, &spilled.read()?);
        // KL(P_ref ‖ P_model) = Σ p_ref (log p_ref − log p_model), per row.
        let row_kl = (rp.exp()? * (rp - lp)?)?.sum(D::Minus1)?.to_vec1::<f32>()?;
        let our_top = lp.argmax(D::Minus1)?.to_vec1::<u32>()?;
        let ref_top = rp.argmax(D::Minus1)?.to_vec1::<u32>()?;
        let before = nll.sum;
        nll.add(lp, &targets)?;
        log_ratios.push((nll.sum - before - spilled.nll) / targets.len() as f64);
        for i in 0..targets.len() {
            kl += f64::from(row_kl[i]);
            agree += usize::from(our_top[i] == ref_top[i]);
        }
    }
    let n = nll.count as f64;
    Ok(Comparison {
        perplexity: nll.perplexity(),
        reference_perplexity: reference.perplexity,
        kl_divergence: kl / n,
        top1_agreement: agree as f64 / n,
        tokens: nll.count,
        increase_interval: increase_interval(&log_ratios),
    })
}

/// A 95 % interval of a perplexity ratio − 1 from the per-chunk log-ratios
/// `x_c = (NLL_model − NLL_reference) / tokens` of chunks scoring as many
/// tokens each, whose mean is the log of the whole text's ratio: Student's
/// t interval of that mean, `x̄ ± t(0.975, C − 1) · s / √C`, mapped through
/// `exp(·) − 1`. It treats the chunks as independent samples of text, which
/// consecutive chunks of one document are only roughly: a width, not a
/// guarantee. `None` below two chunks.
pub fn increase_interval(log_ratios: &[f64]) -> Option<[f64; 2]> {
    let chunks = log_ratios.len();
    if chunks < 2 {
        return None;
    }
    let mean = log_ratios.iter().sum::<f64>() / chunks as f64;
    let variance = log_ratios.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (chunks - 1) as f64;
    let half = student_t_975(chunks - 1) * (variance / chunks as f64).sqrt();
    Some([(mean - half).exp_m1(), (mean + half).exp_m1()])
}

/// Student's t distribution's 97.5 % quantile at `df` ≥ 1 degrees of
/// freedom: the table's values to 30 (as any statistics text prints
/// them), then the Cornish–Fisher expansion to its second term,
/// `z + (z³ + z) / (4·df) + (5z⁵ + 16z³ + 3z) / (96·df²)` with
/// z = 1.959 964, within 0.001 of the exact value from 31 on.
fn student_t_975(df: usize) -> f64 {
    const TABLE: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    const Z: f64 = 1.959_964;
    match df {
        0 => f64::INFINITY,
        1..=30 => TABLE[df - 1],
        _ => {
            let df = df as f64;
            Z + (Z.powi(3) + Z) / (4.0 * df)
                + (5.0 * Z.powi(5) + 16.0 * Z.powi(3) + 3.0 * Z) / (96.0 * df * df)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_increase_interval_is_students_t_interval_of_the_chunks_log_ratios() {
        assert_eq!(increase_interval(&[0.01]), None);
        // Two chunks: mean 0.02, s = √2 · 0.01, t(1) = 12.706.
        let [low, high] = increase_interval(&[0.01, 0.03]).unwrap();
        let half: f64 = 12.706 * 0.01;
        assert!((low - (0.02 - half).exp_m1()).abs() < 1e-12, "{low}");
        assert!((high - (0.02 + half).exp_m1()).abs() < 1e-12, "{high}");
        // The same spread over more chunks narrows it around exp(mean) − 1.
        let many: Vec<f64> = (0..64)
            .map(|i| 0.02 + 0.01 * f64::from(i % 2 * 2 - 1))
            .collect();
        let [low, high] = increase_interval(&many).unwrap();
        assert!(low < 0.02f64.exp_m1() && 0.02f64.exp_m1() < high);
        assert!(high - low < 0.006, "{low} … {high}");
        // The table meets the approximation where it ends.
        assert!((student_t_975(31) - 2.0395).abs() < 0.001);
        assert!((student_t_975(120) - 1.9799).abs() < 0.001);
        assert!(student_t_975(30) > student_t_975(31));
    }

    #[test]
    fn log_probs_are_a_distribution_at_every_temperature_and_top_is_ranked() {
        let logits = [2.0f32, -1.0, 2.0, 0.5, 30.0, -40.0];
        for temperature in [None, Some(0.0), Some(0.3), Some(1.0), Some(2.0)] {
            let all: Vec<f64> = (0..logits.len() as u32)
                .map(|t| token_log_prob(&logits, temperature, t, 0).log_prob)
                .collect();
            let total: f64 = all.iter().map(|l| l.exp()).sum();
            assert!((total - 1.0).abs() < 1e-12, "{temperature:?}: Σp = {total}");
            let entry = token_log_prob(&logits, temperature, 1, 3);
            assert_eq!(entry.log_prob, all[1]);
            // Likeliest first; the tie between 0 and 2 goes to the lower id.
            let ids: Vec<u32> = entry.top.iter().map(|&(i, _)| i).collect();
            assert_eq!(ids, [4, 0, 2], "{temperature:?}");
            for (i, lp) in entry.top {
                assert_eq!(lp, all[i as usize]);
            }
        }
        // Greedy scores under the model's own distribution (t = 1); a
        // lower temperature sharpens it.
        let greedy = token_log_prob(&logits, None, 0, 0).log_prob;
        assert_eq!(greedy, token_log_prob(&logits, Some(1.0), 0, 0).log_prob);
        assert!(token_log_prob(&logits, Some(0.3), 0, 0).log_prob < greedy);
        assert!(token_log_prob(&logits, Some(0.3), 4, 0).log_prob > greedy);
        assert!(token_log_prob(&logits, None, 0, 99).top.len() == logits.len());
    }

    #[test]
    fn sampled_tokens_come_as_often_as_their_log_probs_say() {
        let logits = [0.0f32, 1.0, 2.0];
        let temperature = Some(0.7);
        let mut rng = StdRng::seed_from_u64(7);
        let draws = 60_000;
        let mut counts = [0usize; 3];
        for _ in 0..draws {
            counts[sample(&logits, temperature, &mut rng).unwrap() as usize] += 1;
        }
        for (token, &count) in counts.iter().enumerate() {
            let p = token_log_prob(&logits, temperature, token as u32, 0)
                .log_prob
                .exp();
            let seen = count as f64 / draws as f64;
            // Five standard errors of a binomial share.
            let tolerance = 5.0 * (p * (1.0 - p) / draws as f64).sqrt();
            assert!((seen - p).abs() < tolerance, "token {token}: {seen} vs {p}");
        }
    }
}
