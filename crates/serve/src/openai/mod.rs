//! OpenAI-compatible text generation: `POST /v1/completions`,
//! `POST /v1/chat/completions` (both with SSE streaming) and `GET
//! /v1/models`, over the continuous-batching
//! [`Engine`](crate::engine::Engine).
//!
//! `n` samples of one prompt share its prefill: the engine prefills the
//! prompt once and each sample continues from its own copy of the KV cache
//! with a sampler of its own (seed `seed + i` for choice `i`), so choice `i`
//! is what a request of its own with that seed would return.
//!
//! Requests are checked before they reach the engine: fields this server
//! does not implement (`top_p` ≠ 1, anything unknown) are refused
//! rather than ignored, a prompt that cannot fit the context or the KV
//! budget is refused with the numbers, and errors use OpenAI's shape
//! (`{"error": {"message", "type", "param", "code"}}`) so its clients show
//! them.
//!
//! This file routes the three endpoints and runs one request from its body
//! to its response; the parts of that path have files of their own:
//! checking the body (`check.rs`), handing it to the engine with the FP
//! shadow (`submit.rs`), the response objects (`response.rs`) and SSE
//! streaming (`stream.rs`).

mod check;
mod response;
mod stream;
mod submit;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::http::{api_error, session, too_many_requests, with_version, worker_stopped};
use crate::state::{AppState, Backend};
use check::check;
use response::{Meta, collected};
use stream::streamed;
use submit::submit;

/// Most choices per request (OpenAI's limit of `n`).
pub(crate) const MAX_CHOICES: usize = 128;

/// Which endpoint, for the response shapes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

pub(crate) async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    generate(&state, &headers, &body, Kind::Completion).await
}

pub(crate) async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    generate(&state, &headers, &body, Kind::Chat).await
}

pub(crate) async fn models(State(state): State<Arc<AppState>>) -> Response {
    let data = match &state.backend {
        Backend::Language(lm) => vec![json!({
            "id": lm.name, "object": "model", "created": 0, "owned_by": "qforge"
        })],
        Backend::Policy(_) => Vec::new(),
    };
    axum::Json(json!({ "object": "list", "data": data })).into_response()
}

/// 500 in OpenAI's shape: the model failed on the request.
fn server_error(message: String) -> Response {
    api_error(
        StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        None,
        message,
    )
}

async fn generate(state: &Arc<AppState>, headers: &HeaderMap, body: &[u8], kind: Kind) -> Response {
    let Backend::Language(lm) = &state.backend else {
        return api_error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            None,
            "this server runs a control policy: use /v1/act".into(),
        );
    };
    let Ok(permit) = Arc::clone(&state.in_flight).try_acquire_owned() else {
        return too_many_requests();
    };
    let checked = match check(lm, body, kind) {
        Ok(c) => c,
        Err(refusal) => return refusal.into_response(),
    };
    let number = lm.requests.fetch_add(1, Ordering::Relaxed);
    let arm = lm.rollout.arm_for(session(headers));
    let (stream, include_usage) = (checked.stream, checked.include_usage);
    let spelling = checked.log_probs.map(|_| Arc::clone(&lm.text));
    let prompt_ids = checked.token_ids.then(|| checked.prompt.clone());
    let choices = checked.choices;
    let Some((receivers, admitted)) = submit(state, lm, checked, number, arm) else {
        return worker_stopped();
    };
    // The timeout bounds the wait for a place in the engine (a sequence
    // slot and KV budget), not the generation: an admitted completion runs
    // to its end, which max_tokens (at most --max-tokens) bounds. A timeout
    // on the whole request cut the server's own default completion (1 024
    // tokens at ~23 tokens/s) at 10 s. Queueing is bounded rather than
    // endless because a client that waited the timeout is better told to
    // retry (or try another replica) than kept on an open connection.
    let timeout = state.options.timeout;
    let version = match tokio::time::timeout(timeout, admitted).await {
        Ok(Ok(version)) => version,
        // The engine let go of the request unadmitted: it has stopped.
        Ok(Err(_)) => return worker_stopped(),
        // Dropping the receiver takes the request out of the queue.
        Err(_) => return not_admitted(timeout),
    };
    let meta = Meta::new(kind, number, &lm.name, spelling, prompt_ids, choices);
    let label = lm.rollout.label(arm, version);
    let response = if stream {
        streamed(meta, receivers, include_usage, permit, label).await
    } else {
        collected(meta, receivers, permit, label).await
    };
    with_version(response, version)
}

/// 503 in OpenAI's shape, with Retry-After: the request waited the
/// timeout in the queue.
fn not_admitted(timeout: Duration) -> Response {
    let mut response = api_error(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        None,
        format!(
            "not admitted within {} ms: every sequence slot or the KV budget is taken by running completions; retry shortly",
            timeout.as_millis()
        ),
    );
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response
}

#[cfg(test)]
mod tests {
    use qforge_formats::tokenizer::TextTokenizer;
    use serde_json::{Value, json};

    use crate::testing::{TestServer, options, smollm2, smollm2_int8};

    /// The token ids of every chunk of a streamed completion, and the
    /// prompt's ids wherever a chunk gave them.
    fn streamed_ids(server: &TestServer, body: &Value) -> (Vec<Value>, Vec<Value>) {
        let (status, events) = server.request("POST", "/v1/completions", &body.to_string());
        assert_eq!(status, 200, "{events}");
        let (mut tokens, mut prompts) = (Vec::new(), Vec::new());
        for line in events.lines().filter_map(|l| l.strip_prefix("data: ")) {
            let Ok(chunk) = serde_json::from_str::<Value>(line) else {
                continue;
            };
            let choice = &chunk["choices"][0];
            tokens.extend(
                choice["token_ids"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .cloned(),
            );
            prompts.extend(choice.get("prompt_token_ids").cloned());
        }
        (tokens, prompts)
    }

    /// Per choice index of a streamed response: its token ids put
    /// together, its finish reason, and the usage chunk if any.
    fn streamed_choices(events: &str) -> (Vec<(Vec<u32>, Value)>, Option<Value>) {
        let mut choices: Vec<(Vec<u32>, Value)> = Vec::new();
        let mut usage = None;
        let mut done = 0;
        for line in events.lines().filter_map(|l| l.strip_prefix("data: ")) {
            if line == "[DONE]" {
                done += 1;
                continue;
            }
            let chunk: Value = serde_json::from_str(line).unwrap();
            if let Some(u) = chunk.get("usage") {
                usage = Some(u.clone());
            }
            for choice in chunk["choices"].as_array().unwrap() {
                let index = choice["index"].as_u64().unwrap() as usize;
                if choices.len() <= index {
                    choices.resize(index + 1, (Vec::new(), Value::Null));
                }
                let ids: Vec<u32> =
                    serde_json::from_value(choice["token_ids"].clone()).unwrap_or_default();
                choices[index].0.extend(ids);
                if !choice["finish_reason"].is_null() {
                    choices[index].1 = choice["finish_reason"].clone();
                }
            }
        }
        assert_eq!(done, 1, "one [DONE] ends the stream: {events}");
        (choices, usage)
    }

    #[test]
    fn n_choices_share_the_prompt_and_each_is_its_seeds_own_request() {
        let server = TestServer::serving(smollm2_int8(), options());
        let request = |n: usize, seed: u64, stream: bool| {
            json!({"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0,
                   "seed": seed, "n": n, "return_token_ids": true, "stream": stream,
                   "logprobs": 1, "stream_options": if stream { json!({"include_usage": true}) } else { Value::Null }})
        };
        let (status, all) = server.post_completion(&request(3, 11, false));
        assert_eq!(status, 200, "{all}");
        let choices = all["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 3, "{all}");
        let mut completion_tokens = 0;
        for (i, choice) in choices.iter().enumerate() {
            assert_eq!(choice["index"], json!(i));
            let (_, alone) = server.post_completion(&request(1, 11 + i as u64, false));
            let alone = &alone["choices"][0];
            assert_eq!(choice["token_ids"], alone["token_ids"], "choice {i}");
            assert_eq!(choice["text"], alone["text"], "choice {i}");
            assert_eq!(choice["logprobs"], alone["logprobs"], "choice {i}");
            assert_eq!(choice["prompt_token_ids"], alone["prompt_token_ids"]);
            completion_tokens += choice["token_ids"].as_array().unwrap().len();
        }
        assert!(
            choices[0]["token_ids"] != choices[1]["token_ids"]
                || choices[1]["token_ids"] != choices[2]["token_ids"],
            "three draws at temperature 1 are not all the same: {all}"
        );
        let prompt_tokens = choices[0]["prompt_token_ids"].as_array().unwrap().len();
        assert_eq!(all["usage"]["prompt_tokens"], json!(prompt_tokens));
        assert_eq!(all["usage"]["completion_tokens"], json!(completion_tokens));
        // Streamed: every choice's pieces, interleaved, add up to its
        // collected completion; usage once, after the last finish.
        let (status, events) =
            server.request("POST", "/v1/completions", &request(3, 11, true).to_string());
        assert_eq!(status, 200, "{events}");
        let (streamed, usage) = streamed_choices(&events);
        assert_eq!(streamed.len(), 3, "{events}");
        for (i, (ids, finish)) in streamed.iter().enumerate() {
            assert_eq!(json!(ids), choices[i]["token_ids"], "choice {i}");
            assert_eq!(*finish, choices[i]["finish_reason"], "choice {i}");
        }
        assert_eq!(usage, Some(all["usage"].clone()), "{events}");
        // Chat takes n too.
        let chat = json!({"messages": [{"role": "user", "content": "Say hi"}], "n": 2,
                          "max_tokens": 4, "seed": 3});
        let (status, text) = server.request("POST", "/v1/chat/completions", &chat.to_string());
        assert_eq!(status, 200, "{text}");
        let chat: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(chat["choices"][1]["index"], json!(1), "{chat}");
        // Out of range, or more KV than the budget holds: refused by name.
        for n in [0, 129, 100] {
            let (status, refused) =
                server.post_completion(&json!({"prompt": "hi", "n": n, "max_tokens": 1000}));
            assert_eq!(status, 400, "n = {n}: {refused}");
            assert_eq!(refused["error"]["param"], "n", "n = {n}: {refused}");
        }
    }

    #[test]
    fn a_prompt_of_token_ids_completes_as_its_text_does() {
        let lm = smollm2();
        let text = "The capital of France is";
        let ids = lm.text.tokenizer.encode(text).unwrap();
        let server = TestServer::serving(lm.clone(), options());
        let by_text =
            json!({"prompt": text, "max_tokens": 8, "temperature": 0, "return_token_ids": true});
        let (status, by_text) = server.post_completion(&by_text);
        assert_eq!(status, 200, "{by_text}");
        let by_ids =
            json!({"prompt": ids, "max_tokens": 8, "temperature": 0, "return_token_ids": true});
        let (status, by_ids) = server.post_completion(&by_ids);
        assert_eq!(status, 200, "{by_ids}");
        let (a, b) = (&by_text["choices"][0], &by_ids["choices"][0]);
        assert_eq!(a["text"], b["text"]);
        assert_eq!(a["token_ids"], b["token_ids"]);
        assert_eq!(a["prompt_token_ids"], json!(ids));
        assert_eq!(b["prompt_token_ids"], json!(ids));
        let generated: Vec<u32> = serde_json::from_value(b["token_ids"].clone()).unwrap();
        assert_eq!(generated.len(), 8, "{by_ids}");
        assert_eq!(
            lm.text.tokenizer.decode(&generated).unwrap(),
            b["text"].as_str().unwrap()
        );
        assert_eq!(by_ids["usage"]["prompt_tokens"], json!(ids.len()));
        // Not asked for: a model with a tokenizer answers in text only.
        let (_, plain) = server.post_completion(&json!({"prompt": ids, "max_tokens": 2}));
        assert!(plain["choices"][0].get("token_ids").is_none(), "{plain}");
        // Streamed: the chunks' ids put together, the prompt's given once.
        let streamed = json!({"prompt": ids, "max_tokens": 8, "temperature": 0, "stream": true, "return_token_ids": true});
        let (tokens, prompts) = streamed_ids(&server, &streamed);
        assert_eq!(Value::Array(tokens), b["token_ids"]);
        assert_eq!(prompts, [json!(ids)]);
    }

    /// A model without a tokenizer (a synthetic model, a checkpoint saved
    /// without one) is served on token ids: they come back as they are
    /// generated, the same as the model with its tokenizer gives; text
    /// prompts are refused naming the missing file.
    #[test]
    fn a_model_without_a_tokenizer_is_served_on_token_ids() {
        let lm = smollm2();
        let ids = lm
            .text
            .tokenizer
            .encode("The capital of France is")
            .unwrap();
        let with_text = TestServer::serving(lm.clone(), options());
        let body =
            json!({"prompt": ids, "max_tokens": 6, "temperature": 0, "return_token_ids": true});
        let (_, expected) = with_text.post_completion(&body);
        drop(with_text);

        let mut ids_only = lm;
        let tokenizer = &ids_only.text.tokenizer;
        ids_only.text.tokenizer = TextTokenizer::ids_only(
            std::path::Path::new("synthetic/tokenizer.json"),
            ids_only.model.config().vocab_size,
            tokenizer.bos,
            false,
            tokenizer.eos.clone(),
        );
        let server = TestServer::serving(ids_only, options());
        let body = json!({"prompt": ids, "max_tokens": 6, "temperature": 0});
        let (status, answer) = server.post_completion(&body);
        assert_eq!(status, 200, "{answer}");
        let choice = &answer["choices"][0];
        assert_eq!(choice["token_ids"], expected["choices"][0]["token_ids"]);
        assert_eq!(choice["text"], "");
        // Streamed, one chunk per token.
        let (tokens, _) = streamed_ids(
            &server,
            &json!({"prompt": ids, "max_tokens": 6, "temperature": 0, "stream": true}),
        );
        assert_eq!(Value::Array(tokens), choice["token_ids"]);
        let (status, answer) = server.post_completion(&json!({"prompt": "Hello", "max_tokens": 1}));
        assert_eq!(status, 400, "{answer}");
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(message.contains("synthetic/tokenizer.json"), "{message}");
    }

    /// `ignore_eos` takes the end of sequence as an ordinary token: a
    /// greedy answer that ends early goes on, through it, to exactly
    /// `max_tokens` tokens (the same tokens up to it), streamed or not, on
    /// both endpoints.
    #[test]
    fn ignore_eos_generates_max_tokens_past_the_end_of_sequence() {
        let lm = smollm2();
        let eos = lm.text.tokenizer.eos.clone();
        let server = TestServer::serving(lm, options());
        let max_tokens = 64;
        let chat = |ignore_eos: bool| {
            let body = json!({"messages": [{"role": "user", "content": "Say hi"}],
                              "max_tokens": max_tokens, "temperature": 0,
                              "return_token_ids": true, "ignore_eos": ignore_eos});
            let (status, text) = server.request("POST", "/v1/chat/completions", &body.to_string());
            assert_eq!(status, 200, "{text}");
            serde_json::from_str::<Value>(&text).unwrap()
        };
        let (ended, full) = (chat(false), chat(true));
        assert_eq!(ended["choices"][0]["finish_reason"], "stop", "{ended}");
        let early = ended["usage"]["completion_tokens"].as_u64().unwrap();
        assert!(early < max_tokens - 1, "the answer ends early: {ended}");
        assert_eq!(full["choices"][0]["finish_reason"], "length", "{full}");
        assert_eq!(full["usage"]["completion_tokens"], json!(max_tokens));
        let content = |answer: &Value| answer["choices"][0]["message"]["content"].clone();
        assert!(
            content(&full)
                .as_str()
                .unwrap()
                .starts_with(content(&ended).as_str().unwrap())
        );

        // The same prompt as ids on /v1/completions, scored: the ended
        // answer's ids, then an end of sequence, then more, each scored.
        let prompt = ended["choices"][0]["prompt_token_ids"].clone();
        let completion = |ignore_eos: bool| {
            json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                   "return_token_ids": true, "logprobs": 0, "ignore_eos": ignore_eos})
        };
        let (status, ended) = server.post_completion(&completion(false));
        assert_eq!(status, 200, "{ended}");
        let (status, full) = server.post_completion(&completion(true));
        assert_eq!(status, 200, "{full}");
        let ids = |answer: &Value| -> Vec<u32> {
            serde_json::from_value(answer["choices"][0]["token_ids"].clone()).unwrap()
        };
        let (ended_ids, full_ids) = (ids(&ended), ids(&full));
        assert_eq!(ended["choices"][0]["finish_reason"], "stop", "{ended}");
        assert_eq!(ended_ids.len() as u64, early, "{ended}");
        assert_eq!(full["choices"][0]["finish_reason"], "length", "{full}");
        assert_eq!(full_ids.len() as u64, max_tokens, "{full}");
        assert_eq!(full["usage"]["completion_tokens"], json!(max_tokens));
        assert_eq!(full_ids[..ended_ids.len()], ended_ids[..]);
        assert!(eos.contains(&full_ids[ended_ids.len()]), "{full_ids:?}");
        let scored = full["choices"][0]["logprobs"]["token_logprobs"].as_array();
        assert_eq!(scored.map(Vec::len), Some(max_tokens as usize), "{full}");
        let mut streamed = completion(true);
        streamed["stream"] = json!(true);
        let (status, events) = server.request("POST", "/v1/completions", &streamed.to_string());
        assert_eq!(status, 200, "{events}");
        let (choices, _) = streamed_choices(&events);
        assert_eq!(choices, [(full_ids, json!("length"))]);

        // Checked like the other fields.
        let mut refused = completion(true);
        refused["ignore_eos"] = json!("yes");
        let (status, answer) = server.post_completion(&refused);
        assert_eq!(status, 400, "{answer}");
    }
}
