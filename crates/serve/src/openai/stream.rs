//! Server-sent events: a streamed answer's SSE stream, with every choice's
//! pieces interleaved as the engine produces them, each choice's finish,
//! the usage once all are finished, then `[DONE]`; the in-flight permit
//! travels with the stream until its last event.
//!
//! Apart from the collected answer because a stream has its own rules: its
//! status is decided by the first event (once the headers are out it can no
//! longer say 500), and one failed choice ends it.

use std::convert::Infallible;

use axum::response::sse::{self, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::{Value, json};
use tokio::sync::OwnedSemaphorePermit;
use tokio::sync::mpsc::UnboundedReceiver;

use super::response::{Meta, Piece, usage};
use super::{Kind, server_error};
use crate::engine::Event;
use crate::http::{with_arm, worker_stopped};

/// A streamed answer: SSE events as the engine produces them, the
/// choices' events interleaved as they come.
pub(super) async fn streamed(
    meta: Meta,
    receivers: Vec<UnboundedReceiver<Event>>,
    include_usage: bool,
    permit: OwnedSemaphorePermit,
    label: &'static str,
) -> Response {
    let mut events = stream::select_all(receivers.into_iter().enumerate().map(|(index, r)| {
        stream::unfold(r, |mut r| async move { r.recv().await.map(|e| (e, r)) })
            .map(move |event| (index, event))
            .boxed()
    }));
    // The first event (the prompt's) decides the status: once the
    // stream's headers are out, it can no longer say 500.
    let Some(first) = events.next().await else {
        return worker_stopped();
    };
    if let (_, Event::Failed(message)) = first {
        return server_error(message);
    }
    // The permit travels with the stream: a streaming request counts
    // as in flight until its last event.
    let stream = sse_stream(
        meta,
        stream::once(std::future::ready(first)).chain(events),
        include_usage,
        permit,
    );
    with_arm(Sse::new(stream).into_response(), label)
}

/// The SSE events of one streamed request: (for chat) each choice's
/// assistant role, every text piece of every choice as it comes, each
/// choice's finish, (when asked) the usage once all are finished, then
/// `[DONE]`.
fn sse_stream(
    mut meta: Meta,
    events: impl Stream<Item = (usize, Event)> + Send + 'static,
    include_usage: bool,
    permit: OwnedSemaphorePermit,
) -> impl Stream<Item = std::result::Result<sse::Event, Infallible>> {
    let choices = meta.prompt_ids_sent.len();
    let opening: Vec<Value> = if meta.kind == Kind::Chat {
        (0..choices)
            .map(|index| {
                let mut role = meta.chunk(index, None, None);
                role["choices"][0]["delta"] = json!({"role": "assistant", "content": ""});
                role
            })
            .collect()
    } else {
        Vec::new()
    };
    let data = |v: &Value| sse::Event::default().data(v.to_string());
    let head = stream::iter(opening.iter().map(data).collect::<Vec<_>>());
    let progress = Progress {
        unfinished: choices,
        prompt_tokens: 0,
        completion_tokens: 0,
        permit: Some(permit),
    };
    let events = events
        .scan((meta, progress), move |(meta, progress), (index, event)| {
            let out: Vec<Value> = match event {
                Event::Text {
                    text,
                    tokens,
                    log_probs,
                } => vec![meta.chunk(
                    index,
                    Some(&Piece {
                        text,
                        tokens,
                        log_probs,
                    }),
                    None,
                )],
                Event::Done {
                    finish_reason,
                    prompt_tokens,
                    completion_tokens,
                } => {
                    progress.unfinished -= 1;
                    progress.prompt_tokens = prompt_tokens;
                    progress.completion_tokens += completion_tokens;
                    let mut out = vec![meta.chunk(index, None, Some(finish_reason))];
                    if progress.unfinished == 0 {
                        progress.permit.take();
                        if include_usage {
                            let usage = usage(progress.prompt_tokens, progress.completion_tokens);
                            out.push(meta.wrap(Vec::new(), Some(usage)));
                        }
                    }
                    out
                }
                Event::Failed(message) => {
                    // One failed choice ends the stream.
                    progress.permit.take();
                    vec![json!({"error": {"message": message, "type": "server_error", "param": null, "code": null}})]
                }
            };
            let done = progress.permit.is_none();
            std::future::ready(Some((out, done)))
        })
        // Nothing after the end (a failure's other choices go on in the
        // engine until their client, this stream, is dropped).
        .scan(false, |ended, (out, done)| {
            let pass = (!*ended).then_some((out, done));
            *ended |= done;
            std::future::ready(pass)
        })
        .flat_map(move |(out, done)| {
            let mut events: Vec<sse::Event> = out.iter().map(data).collect();
            if done {
                events.push(sse::Event::default().data("[DONE]"));
            }
            stream::iter(events)
        });
    head.chain(events).map(Ok)
}

/// Where a stream's choices stand.
struct Progress {
    /// Choices not finished yet.
    unfinished: usize,
    prompt_tokens: usize,
    /// Tokens of the finished choices.
    completion_tokens: usize,
    /// Released when the last choice finishes (or one fails).
    permit: Option<OwnedSemaphorePermit>,
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use crate::testing::{TestServer, options, smollm2_int8};

    #[test]
    fn a_client_hanging_up_mid_stream_frees_its_sequences_and_kv() {
        let server = TestServer::serving(smollm2_int8(), options());
        let body = json!({"prompt": "Once upon a time", "max_tokens": 200, "temperature": 1.0,
                          "n": 2, "stream": true, "seed": 1});
        let stream = server.stream_opened("/v1/completions", &body.to_string());
        // Both choices run, each holding prompt + 200 positions of KV.
        server.wait_for_metric("qforge_running_sequences", 2.0);
        server.wait_for_metric("qforge_kv_reserved_tokens", 400.0);
        drop(stream);
        server.wait_for_metric_to_fall("qforge_running_sequences", 0.0);
        server.wait_for_metric_to_fall("qforge_kv_reserved_tokens", 0.0);
        // Neither choice finished (seed 1's draws run far past the hang-up
        // without an end of sequence): they were dropped.
        let generated = server.metric("qforge_generated_tokens_total").unwrap();
        assert!(generated < 380.0, "{generated} tokens generated");
        assert_eq!(
            server.metric("qforge_completion_duration_seconds_count"),
            Some(0.0)
        );
    }

    /// The samples of an `n` request store their prompt's KV once: four
    /// samples of a 101-token prompt with 100 completion tokens each are
    /// admitted under a budget of 512 positions (four copies of the prompt
    /// would need 804), and reserve 501 while they run.
    #[test]
    fn the_samples_of_a_request_reserve_their_prompt_once() {
        let lm = smollm2_int8();
        let prompt: Vec<u32> = (0..101).map(|i| 1000 + i * 37).collect();
        let server = TestServer::serving(lm, options());
        let body = json!({"prompt": prompt, "max_tokens": 100, "temperature": 1.0,
                          "ignore_eos": true, "n": 4, "stream": true, "seed": 5});
        let stream = server.stream_opened("/v1/completions", &body.to_string());
        server.wait_for_metric("qforge_running_sequences", 4.0);
        assert_eq!(server.metric("qforge_kv_reserved_tokens"), Some(501.0));
        drop(stream);
        server.wait_for_metric_to_fall("qforge_kv_reserved_tokens", 0.0);
    }
}
