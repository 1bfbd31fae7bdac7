//! The response objects of both endpoints: a whole answer once every choice
//! is complete ([`collected`]), and the pieces a stream sends, built by
//! [`Meta`], which holds what every object of one request repeats (its id,
//! model, the log-prob spelling, the token ids still to give).
//!
//! Apart from the streaming because a collected answer and a streamed
//! chunk are the same fields in two shapes: keeping OpenAI's field names
//! in one file keeps the two in step.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::response::{IntoResponse, Response};
use qforge_decode::sampling::TokenLogProb;
use qforge_formats::text::TextSide;
use serde_json::{Value, json};
use tokio::sync::OwnedSemaphorePermit;
use tokio::sync::mpsc::UnboundedReceiver;

use super::{Kind, server_error};
use crate::engine::{Event, FinishReason};
use crate::http::{with_arm, worker_stopped};
use crate::logprobs;

/// The whole completion, once the engine is done.
struct Completion {
    text: String,
    tokens: Vec<u32>,
    /// Per token, when asked for.
    log_probs: Vec<TokenLogProb>,
    finish: FinishReason,
    prompt_tokens: usize,
    completion_tokens: usize,
}

/// A whole answer: every choice's completion in one response object.
pub(super) async fn collected(
    mut meta: Meta,
    receivers: Vec<UnboundedReceiver<Event>>,
    permit: OwnedSemaphorePermit,
    label: &'static str,
) -> Response {
    // The choices run side by side in the engine; this waits for each.
    let mut completions = Vec::with_capacity(receivers.len());
    for mut receiver in receivers {
        match collect(&mut receiver).await {
            Ok(c) => completions.push(c),
            Err(Some(message)) => return server_error(message),
            Err(None) => return worker_stopped(),
        }
    }
    drop(permit);
    with_arm(axum::Json(meta.full(&completions)).into_response(), label)
}

/// Reads a request's events to the end: the completion, or the engine's
/// failure message (`None`: the engine stopped without one).
async fn collect(
    receiver: &mut UnboundedReceiver<Event>,
) -> std::result::Result<Completion, Option<String>> {
    let mut text = String::new();
    let mut tokens = Vec::new();
    let mut log_probs = Vec::new();
    while let Some(event) = receiver.recv().await {
        match event {
            Event::Text {
                text: piece,
                tokens: ids,
                log_probs: entries,
            } => {
                text.push_str(&piece);
                tokens.extend(ids);
                log_probs.extend(entries);
            }
            Event::Done {
                finish_reason,
                prompt_tokens,
                completion_tokens,
            } => {
                return Ok(Completion {
                    text,
                    tokens,
                    log_probs,
                    finish: finish_reason,
                    prompt_tokens,
                    completion_tokens,
                });
            }
            Event::Failed(message) => return Err(Some(message)),
        }
    }
    Err(None)
}

/// A streamed piece of the completion.
pub(super) struct Piece {
    pub(super) text: String,
    pub(super) tokens: Vec<u32>,
    pub(super) log_probs: Vec<TokenLogProb>,
}

/// What every response object of one request repeats.
pub(super) struct Meta {
    id: String,
    created: u64,
    model: String,
    pub(super) kind: Kind,
    /// Set when the request asks for log-probs.
    spelling: Option<Spelling>,
    /// Whether choices give token ids.
    token_ids: bool,
    /// The prompt's token ids, when asked for.
    prompt_ids: Option<Vec<u32>>,
    /// Per choice: whether its prompt ids went out (a stream gives them in
    /// the choice's first chunk).
    pub(super) prompt_ids_sent: Vec<bool>,
}

/// How a request's log-probs are spelled: the served tokenizer, and per
/// choice the characters of its completion sent so far
/// (`/v1/completions`' `text_offset` counts on from one streamed chunk to
/// the next).
struct Spelling {
    text: Arc<TextSide>,
    offsets: Vec<usize>,
}

pub(super) fn usage(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    })
}

impl Meta {
    pub(super) fn new(
        kind: Kind,
        number: u64,
        model: &str,
        spelling: Option<Arc<TextSide>>,
        prompt_ids: Option<Vec<u32>>,
        choices: usize,
    ) -> Self {
        Self {
            id: match kind {
                Kind::Completion => format!("cmpl-{number}"),
                Kind::Chat => format!("chatcmpl-{number}"),
            },
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            model: model.to_owned(),
            kind,
            spelling: spelling.map(|text| Spelling {
                text,
                offsets: vec![0; choices],
            }),
            token_ids: prompt_ids.is_some(),
            prompt_ids,
            prompt_ids_sent: vec![false; choices],
        }
    }

    /// Adds the token ids to choice `index` when the request asks for
    /// them: the completion's `tokens`, and the prompt's if not given yet.
    fn add_token_ids(&mut self, index: usize, choice: &mut Value, tokens: &[u32]) {
        if !self.token_ids {
            return;
        }
        if let Some(prompt) = &self.prompt_ids
            && !std::mem::replace(&mut self.prompt_ids_sent[index], true)
        {
            choice["prompt_token_ids"] = json!(prompt);
        }
        choice["token_ids"] = json!(tokens);
    }

    /// The `logprobs` of choice `index`: `null` unless asked for.
    fn log_probs(&mut self, index: usize, entries: &[TokenLogProb]) -> Value {
        let Some(spelling) = &mut self.spelling else {
            return Value::Null;
        };
        let tokenizer = &spelling.text.tokenizer;
        match self.kind {
            Kind::Completion => logprobs::legacy(tokenizer, entries, &mut spelling.offsets[index]),
            Kind::Chat => logprobs::chat(tokenizer, entries),
        }
    }

    /// The response to a request whose choices are all complete: OpenAI's
    /// usage counts the prompt once and every choice's tokens.
    fn full(&mut self, completions: &[Completion]) -> Value {
        let mut choices = Vec::with_capacity(completions.len());
        for (index, completion) in completions.iter().enumerate() {
            let log_probs = self.log_probs(index, &completion.log_probs);
            let (text, finish) = (&completion.text, completion.finish);
            let mut choice = match self.kind {
                Kind::Completion => json!({
                    "index": index, "text": text, "logprobs": log_probs, "finish_reason": finish
                }),
                Kind::Chat => json!({
                    "index": index,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": log_probs,
                    "finish_reason": finish,
                }),
            };
            self.add_token_ids(index, &mut choice, &completion.tokens);
            choices.push(choice);
        }
        let prompt_tokens = completions.first().map_or(0, |c| c.prompt_tokens);
        let completion_tokens = completions.iter().map(|c| c.completion_tokens).sum();
        json!({
            "id": self.id,
            "object": match self.kind { Kind::Completion => "text_completion", Kind::Chat => "chat.completion" },
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens),
        })
    }

    /// One streamed chunk of choice `index`: a text piece with its tokens
    /// and their log-probs, or (with `finish`) the last one.
    pub(super) fn chunk(
        &mut self,
        index: usize,
        piece: Option<&Piece>,
        finish: Option<FinishReason>,
    ) -> Value {
        let log_probs = match piece {
            Some(piece) => self.log_probs(index, &piece.log_probs),
            None => Value::Null,
        };
        let text = piece.map(|piece| piece.text.as_str());
        let mut choice = match self.kind {
            Kind::Completion => json!({
                "index": index, "text": text.unwrap_or(""), "logprobs": log_probs, "finish_reason": finish
            }),
            Kind::Chat => json!({
                "index": index,
                "delta": text.map_or(json!({}), |p| json!({"content": p})),
                "logprobs": log_probs,
                "finish_reason": finish,
            }),
        };
        self.add_token_ids(index, &mut choice, piece.map_or(&[], |p| &p.tokens));
        self.wrap(vec![choice], None)
    }

    pub(super) fn wrap(&self, choices: Vec<Value>, usage: Option<Value>) -> Value {
        let mut chunk = json!({
            "id": self.id,
            "object": match self.kind { Kind::Completion => "text_completion", Kind::Chat => "chat.completion.chunk" },
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if let Some(usage) = usage {
            chunk["usage"] = usage;
        }
        chunk
    }
}
