//! `qforge serve` of a language model: OpenAI's completions answer what
//! `qforge generate` computes, batched continuously and streamed; requests
//! are checked and queue for the KV budget; a client that hangs up frees
//! its sequence; A/B and shadow rollouts and hot reload of the model.

#[path = "support/server.rs"]
mod server;
mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;

use serde_json::Value;
use server::{Server, model_version, read_until, wait_until};
use support::{json, path, qforge_in};

const SMOLLM2: &str = "models/smollm2-135m-instruct-q4_1.gguf";

/// What `qforge generate` prints for `prompt` (greedy).
fn generate(prompt: &str, max_tokens: usize) -> String {
    let out = json(&support::qforge(&[
        "generate",
        "--model",
        &path(SMOLLM2),
        "--prompt",
        prompt,
        "--max-tokens",
        &max_tokens.to_string(),
        "--json",
    ]));
    out["text"].as_str().unwrap().to_owned()
}

/// The `data:` payloads of an SSE body.
fn sse_payloads(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(str::to_owned)
        .collect()
}

#[test]
fn completions_match_qforge_generate_batch_continuously_and_stream() {
    let server = Server::start(Path::new(&path(SMOLLM2)), &[], None);
    let prompts = [
        "The capital of France is",
        "1, 2, 3, 4,",
        "Water boils at",
        "The opposite of hot is",
    ];
    let expected: Vec<String> = prompts.iter().map(|p| generate(p, 12)).collect();
    let complete = |prompt: &str| -> Value {
        let body = serde_json::json!({"prompt": prompt, "max_tokens": 12, "temperature": 0});
        let (status, v) = server.post("/v1/completions", &[], &body.to_string());
        assert_eq!(status, 200, "{v}");
        v
    };
    // Alone, each answer is what `qforge generate` says.
    let v = complete(prompts[0]);
    assert_eq!(v["choices"][0]["text"], expected[0].as_str(), "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["completion_tokens"], 12);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    // Concurrently, still the same answers, from shared decode steps.
    let texts: Vec<Value> = std::thread::scope(|scope| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| scope.spawn(|| complete(p)["choices"][0]["text"].clone()))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(
        texts,
        expected
            .iter()
            .map(|t| Value::from(t.as_str()))
            .collect::<Vec<_>>()
    );
    let steps = server.metric("qforge_batch_rows_count").unwrap();
    let rows = server.metric("qforge_batch_rows_sum").unwrap();
    assert!(
        rows > steps,
        "{rows} sequence-steps in {steps} steps: nothing shared a step"
    );
    assert_eq!(
        server.metric("qforge_generated_tokens_total"),
        Some(5.0 * 12.0)
    );
    // The engine updates its gauges after the step that sent the last
    // answer, so a client can read /metrics in between: wait for the event.
    wait_until("the finished sequences to leave the gauges", || {
        server.metric("qforge_running_sequences") == Some(0.0)
            && server.metric("qforge_kv_reserved_tokens") == Some(0.0)
    });

    // Streaming sends the same text in pieces, then [DONE].
    let body = serde_json::json!({"prompt": prompts[1], "max_tokens": 12, "temperature": 0, "stream": true});
    let (status, head, text) = server.request("POST", "/v1/completions", &[], &body.to_string());
    assert_eq!(status, 200);
    assert!(head.to_lowercase().contains("text/event-stream"), "{head}");
    let payloads = sse_payloads(&text);
    assert_eq!(payloads.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = payloads[..payloads.len() - 1]
        .iter()
        .map(|p| serde_json::from_str(p).unwrap())
        .collect();
    assert!(chunks.len() > 3, "{text}");
    let streamed: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(streamed, expected[1]);
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );

    // Chat: the template's prompt, an answer, streamed as deltas with usage.
    let chat = serde_json::json!({
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 24, "temperature": 0,
    });
    let (status, v) = server.post("/v1/chat/completions", &[], &chat.to_string());
    assert_eq!(status, 200, "{v}");
    let answer = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(answer.contains("Paris"), "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let mut streaming = chat.clone();
    streaming["stream"] = true.into();
    streaming["stream_options"] = serde_json::json!({"include_usage": true});
    let (_, _, text) = server.request("POST", "/v1/chat/completions", &[], &streaming.to_string());
    let payloads = sse_payloads(&text);
    let chunks: Vec<Value> = payloads[..payloads.len() - 1]
        .iter()
        .map(|p| serde_json::from_str(p).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, answer);
    assert_eq!(chunks.last().unwrap()["usage"], v["usage"]);

    // A stop string ends the text before it.
    let body = serde_json::json!({"prompt": prompts[1], "max_tokens": 12, "temperature": 0, "stop": [" 6"]});
    let (_, v) = server.post("/v1/completions", &[], &body.to_string());
    let cut = &expected[1][..expected[1].find(" 6").expect("the model counts on")];
    assert_eq!(v["choices"][0]["text"], cut, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    // Seeded sampling repeats itself.
    let body =
        serde_json::json!({"prompt": prompts[0], "max_tokens": 8, "temperature": 1.0, "seed": 7});
    let a = server.post("/v1/completions", &[], &body.to_string()).1;
    let b = server.post("/v1/completions", &[], &body.to_string()).1;
    assert_eq!(a["choices"], b["choices"]);
}

#[test]
fn completion_requests_are_checked_and_the_kv_budget_queues_them() {
    let server = Server::start(
        Path::new(&path(SMOLLM2)),
        &[
            "--kv-budget-tokens",
            "64",
            "--served-model-name",
            "smol",
            "--timeout-ms",
            "120000",
            "--max-tokens",
            "40",
        ],
        None,
    );
    for (target, body, param) in [
        ("/v1/completions", r#"{"prompt": "hi", "n": 0}"#, "n"),
        (
            "/v1/completions",
            r#"{"prompt": "hi", "n": 4, "max_tokens": 20}"#,
            "n",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "hi", "top_p": 0.5}"#,
            "top_p",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "hi", "temperature": 3}"#,
            "temperature",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "hi", "max_tokens": 0}"#,
            "max_tokens",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "hi", "max_tokens": 100}"#,
            "max_tokens",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "hi", "max_tokens": 50}"#,
            "max_tokens",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "hi", "stop": ["", "x"]}"#,
            "stop",
        ),
        ("/v1/completions", r#"{"messages": []}"#, "prompt"),
        ("/v1/chat/completions", r#"{"messages": []}"#, "messages"),
        ("/v1/chat/completions", r#"{"prompt": "hi"}"#, "messages"),
    ] {
        let (status, v) = server.post(target, &[], body);
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
        assert!(!v["error"]["message"].as_str().unwrap().is_empty());
    }
    let (status, v) = server.post("/v1/completions", &[], r#"{"prompt": "hi", "best_of": 2}"#);
    assert_eq!(status, 400);
    assert!(
        v["error"]["message"].as_str().unwrap().contains("best_of"),
        "{v}"
    );
    let long = "word ".repeat(80);
    let (status, v) = server.post(
        "/v1/completions",
        &[],
        &serde_json::json!({ "prompt": long }).to_string(),
    );
    assert_eq!(status, 400);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("KV budget 64"),
        "{v}"
    );
    // A prompt far beyond what 63 tokens can hold is refused on its length
    // in bytes, before it is tokenized.
    let huge = "word ".repeat(60_000);
    let (status, v) = server.post(
        "/v1/completions",
        &[],
        &serde_json::json!({ "prompt": huge }).to_string(),
    );
    assert_eq!(status, 400);
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("the prompt is 300000 bytes") && message.contains("KV budget 64"),
        "{v}"
    );
    let (status, v) = server.post(
        "/v1/completions",
        &[],
        r#"{"prompt": "hi", "model": "gpt-4"}"#,
    );
    assert_eq!(status, 404, "{v}");
    let (_, v) = server.post(
        "/v1/completions",
        &[],
        r#"{"prompt": "hi", "model": "smol", "max_tokens": 2}"#,
    );
    assert_eq!(v["model"], "smol");
    let (status, _, models) = server.request("GET", "/v1/models", &[], "");
    assert_eq!(status, 200);
    assert!(models.contains("\"smol\""), "{models}");
    assert_eq!(server.act(r#"{"observations": [[0]]}"#).0, 404);

    // Each request reserves its prompt + 30 of 64 positions: they run one
    // at a time (queued, not refused), and every one completes.
    let body = serde_json::json!({"prompt": "Count: 1, 2, 3,", "max_tokens": 30, "temperature": 0});
    let done: Vec<u16> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..3)
            .map(|_| scope.spawn(|| server.post("/v1/completions", &[], &body.to_string()).0))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(done, [200, 200, 200]);
    // Never two sequences in one step.
    assert_eq!(
        server.metric("qforge_batch_rows_bucket{le=\"1.0\"}"),
        server.metric("qforge_batch_rows_count")
    );
}

#[test]
fn a_client_that_hangs_up_frees_its_sequence() {
    let server = Server::start(Path::new(&path(SMOLLM2)), &[], None);
    let body = serde_json::json!({"prompt": "Tell me a long story.", "max_tokens": 400, "temperature": 0, "stream": true}).to_string();
    let mut stream = TcpStream::connect(&server.addr).unwrap();
    write!(
        stream,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut first = [0u8; 512];
    let n = stream.read(&mut first).unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).contains("200 OK"));
    drop(stream);
    wait_until("the hung-up client's sequence to be freed", || {
        server.metric("qforge_running_sequences") == Some(0.0)
    });
    let generated = server.metric("qforge_generated_tokens_total").unwrap();
    assert!(
        generated < 400.0,
        "{generated} tokens for a client that left"
    );
}

#[test]
fn a_language_model_rollout_splits_sessions_and_rolls_back_a_bad_int8_model() {
    let dir = support::temp("serve", "lm-rollout");
    let dir = dir.path();
    // A genuinely bad INT8 model: every static scale clips at the 20th
    // percentile, and the guard is told to accept anything.
    let bad = json(&qforge_in(
        dir,
        &[
            "quantize",
            "--model",
            &path(SMOLLM2),
            "--data",
            &path("fixtures/episodes/arithmetic.jsonl"),
            "--calibrator",
            "percentile(20)",
            "--max-perplexity-increase",
            "1e12",
            "--samples",
            "4",
            "--seq-len",
            "32",
            "-o",
            "bad",
            "--json",
        ],
    ));
    assert!(
        bad["after"]["top1_agreement"].as_f64().unwrap() < 0.5,
        "{bad}"
    );
    let prompt = "The capital of France is";
    let fp_text = generate(prompt, 12);
    let body =
        serde_json::json!({"prompt": prompt, "max_tokens": 12, "temperature": 0}).to_string();
    let complete = |server: &Server, session: &str| -> (String, String) {
        let header = format!("X-Session-Id: {session}");
        let (status, head, text) = server.request("POST", "/v1/completions", &[&header], &body);
        assert_eq!(status, 200, "{text}");
        let arm = head
            .lines()
            .find_map(|l| {
                l.to_lowercase()
                    .strip_prefix("x-qforge-arm: ")
                    .map(str::to_owned)
            })
            .unwrap_or_else(|| panic!("no arm header in {head}"));
        let v: Value = serde_json::from_str(&text).unwrap();
        (arm, v["choices"][0]["text"].as_str().unwrap().to_owned())
    };

    // A/B: sessions keep their arm; the FP arm (the manifest's source)
    // answers what `qforge generate` does.
    let server = Server::start(&dir.join("bad"), &["--ab", "int8=0.5,fp=0.5"], None);
    let arms: Vec<(String, String)> = (0..8)
        .map(|i| complete(&server, &format!("s{i}")))
        .collect();
    for (i, (arm, text)) in arms.iter().enumerate() {
        assert_eq!(
            &complete(&server, &format!("s{i}")).0,
            arm,
            "session s{i} moved"
        );
        if arm == "fp" {
            assert_eq!(text, &fp_text);
        } else {
            assert_ne!(text, &fp_text, "the bad model should not match FP");
        }
    }
    assert!(
        arms.iter().any(|a| a.0 == "fp") && arms.iter().any(|a| a.0 == "int8"),
        "{arms:?}"
    );
    drop(server);

    // Shadow: the reference runs every request alongside; once 30 tokens
    // agree < 95 %, traffic rolls back and FP answers.
    let server = Server::start(
        &dir.join("bad"),
        &[
            "--shadow",
            "--shadow-sample",
            "1",
            "--agreement-window",
            "30",
        ],
        None,
    );
    for _ in 0..3 {
        assert_eq!(complete(&server, "x").0, "int8");
    }
    wait_until("the rollback", || {
        server.metric("qforge_rolled_back") == Some(1.0)
    });
    assert!(server.metric("qforge_shadow_agreement").unwrap() < 0.95);
    // Every token the reference scored has its log-prob mismatch: the bad
    // model's tokens are ones FP finds far less likely.
    wait_until("the gaps of 30 tokens", || {
        server
            .metric("qforge_logprob_mismatch_count")
            .is_some_and(|n| n >= 30.0)
    });
    let gap = server.metric("qforge_logprob_mismatch_sum").unwrap()
        / server.metric("qforge_logprob_mismatch_count").unwrap();
    assert!(gap > 1.0, "mean log-prob mismatch {gap}");
    // The alert follows the mean over the last 30 tokens (default 0.1 nats).
    let window_mean = server.metric("qforge_logprob_mismatch_mean").unwrap();
    assert!(window_mean > 0.0);
    assert_eq!(
        server.metric("qforge_logprob_mismatch_alert"),
        Some(f64::from(u8::from(window_mean > 0.1)))
    );
    assert_eq!(complete(&server, "x"), ("fp".to_owned(), fp_text));
}

/// A weight sync of a language model: `POST /admin/reload` swaps the served
/// INT8 artifact once the completions already admitted are done (each runs
/// on one version), every answer names its version, and after the swap the
/// server answers as one started on the new artifact does.
#[test]
fn a_language_model_reload_swaps_after_admitted_completions_and_answers_name_their_version() {
    let dir = support::temp("serve", "lm-reload");
    let dir = dir.path();
    let (model, data) = (path(SMOLLM2), path("fixtures/episodes/arithmetic.jsonl"));
    // The guard is not under test: a short held-out text (the first 2 000
    // characters of the committed evaluation fixture, a few hundred tokens)
    // and one method keep the two quantizations quick.
    let eval = dir.join("eval.txt");
    let text = std::fs::read_to_string(path("fixtures/text/eval.txt")).unwrap();
    std::fs::write(&eval, text.chars().take(2000).collect::<String>()).unwrap();
    let eval = eval.to_str().unwrap();
    let quantize = |out: &str, extra: &[&str]| {
        let mut args = vec![
            "quantize",
            "--model",
            &model,
            "--data",
            &data,
            "--eval-data",
            eval,
            "--no-method-search",
            "--max-perplexity-increase",
            "1e12",
            "--samples",
            "4",
            "--seq-len",
            "32",
            "-o",
            out,
            "--json",
        ];
        args.extend_from_slice(extra);
        json(&qforge_in(dir, &args));
    };
    // Version 1 clips every static scale at the 20th percentile; version 2
    // is the default recipe: their greedy completions differ.
    quantize("v1", &["--calibrator", "percentile(20)"]);
    quantize("v2", &[]);
    let token = "sync-token";
    let auth = format!("Authorization: Bearer {token}");
    let complete = |server: &Server, prompt: &str, max_tokens: usize| -> (u64, String) {
        let body =
            serde_json::json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
                .to_string();
        let (status, head, text) = server.request("POST", "/v1/completions", &[&auth], &body);
        assert_eq!(status, 200, "{text}");
        let version = model_version(&head);
        let v: Value = serde_json::from_str(&text).unwrap();
        (
            version,
            v["choices"][0]["text"].as_str().unwrap().to_owned(),
        )
    };
    let (short, long) = ("The capital of France is", "Once upon a time");
    let fresh = Server::start(&dir.join("v2"), &[], Some(token));
    let v2_short = complete(&fresh, short, 12).1;
    drop(fresh);

    let server = Server::start(&dir.join("v1"), &[], Some(token));
    let (version, v1_short) = complete(&server, short, 12);
    assert_eq!(version, 1);
    assert_ne!(v1_short, v2_short, "the two artifacts complete alike");
    let v1_long = complete(&server, long, 64);
    let reload = |model: &Path| {
        let body = serde_json::json!({ "model": model }).to_string();
        server.request("POST", "/admin/reload", &[&auth], &body)
    };
    // A policy is not a language model's weights.
    json(&qforge_in(
        dir,
        &[
            "quantize",
            "--model",
            &path("fixtures/policies/pendulum"),
            "--data",
            &path("fixtures/policies/pendulum/rollouts.jsonl"),
            "-o",
            "pendulum",
            "--json",
        ],
    ));
    let (status, _, text) = reload(&dir.join("pendulum"));
    assert_eq!(status, 409, "{text}");
    assert!(text.contains("control policy"), "{text}");

    let running = || {
        let (_, _, metrics) = server.request("GET", "/metrics", &[&auth], "");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix("qforge_running_sequences "))
            .is_some_and(|v| v.trim() != "0")
    };
    std::thread::scope(|scope| {
        // A completion admitted before the reload finishes on version 1.
        let in_flight = scope.spawn(|| complete(&server, long, 64));
        wait_until("the completion's admission (or its end)", || {
            running() || in_flight.is_finished()
        });
        let (status, _, text) = reload(&dir.join("v2"));
        assert_eq!(status, 200, "{text}");
        let answer: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(answer["version"], 2);
        assert_eq!(in_flight.join().unwrap(), v1_long);
    });
    assert_eq!(complete(&server, short, 12), (2, v2_short));
    let (_, _, metrics) = server.request("GET", "/metrics", &[&auth], "");
    assert!(metrics.contains("qforge_model_version 2"), "{metrics}");
    assert!(
        metrics.contains(r#"qforge_reloads_total{outcome="swapped"} 1"#),
        "{metrics}"
    );
}

#[test]
fn a_completion_outlasting_the_timeout_finishes_and_queued_ones_wait_at_most_the_timeout() {
    let server = Server::start(
        Path::new(&path(SMOLLM2)),
        &["--timeout-ms", "1000", "--max-batch", "1"],
        None,
    );
    // 100 tokens take this model seconds on a CPU: longer than the timeout,
    // which bounds the wait for the engine, not the generation. (Counting
    // never reaches an end of sequence.)
    let body =
        serde_json::json!({"prompt": "Count: 1, 2, 3,", "max_tokens": 100, "temperature": 0});
    let (status, v) = server.post("/v1/completions", &[], &body.to_string());
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 100, "{v}");

    // A long stream holds the only sequence slot; a request behind it waits
    // the timeout in the queue, then gets 503 saying so.
    let long = serde_json::json!({"prompt": "Count: 1, 2, 3,", "max_tokens": 1000, "temperature": 0, "stream": true}).to_string();
    let mut stream = server.connect();
    write!(
        stream,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{long}",
        long.len()
    )
    .unwrap();
    read_until(&mut stream, "data: ", "the first event of the long stream");
    let short = serde_json::json!({"prompt": "Hi", "max_tokens": 2}).to_string();
    let (status, head, text) = server.request("POST", "/v1/completions", &[], &short);
    assert_eq!(status, 503, "{text}");
    assert!(head.to_lowercase().contains("retry-after: 1"), "{head}");
    assert!(text.contains("not admitted within 1000 ms"), "{text}");
    // Once the stream's client hangs up, the slot frees and requests run.
    drop(stream);
    wait_until("the hung-up stream's sequence to be freed", || {
        server.metric("qforge_running_sequences") == Some(0.0)
    });
    let (status, v) = server.post("/v1/completions", &[], &short);
    assert_eq!(status, 200, "{v}");
}
