//! OpenAI's `logprobs` of the completion endpoints: what a request asks
//! for, and the engine's per-token figures in the two shapes OpenAI's
//! clients read (`/v1/completions`' legacy lists, `/v1/chat/completions`'
//! `content` entries).
//!
//! The figures are the served model's own: the log-probability of each
//! generated token under the distribution it was drawn from,
//! log softmax(logits / temperature), temperature 1 for greedy requests
//! ([`qforge_decode::sampling::token_log_prob`]). That is the behaviour policy
//! an RL trainer's importance weights divide by. The end-of-sequence token
//! is reported too (it is part of the sampled sequence) though it adds no
//! text.

use qforge_decode::sampling::TokenLogProb;
use qforge_formats::tokenizer::TextTokenizer;
use serde::{Deserialize, Deserializer};
use serde_json::{Map, Value, json};

/// Most alternatives per token (vLLM's default `max_logprobs`; OpenAI's
/// chat allows as many).
pub(crate) const MAX_TOP_LOGPROBS: usize = 20;

/// `logprobs` as either endpoint spells it: `/v1/completions` a count of
/// alternatives, `/v1/chat/completions` a switch (with `top_logprobs`).
#[derive(Deserialize)]
#[serde(untagged)]
pub(crate) enum Field {
    Count(usize),
    Switch(bool),
}

/// A field that tells `null` from absent: `Some(None)` is an explicit
/// `null` (`top_logprobs: null` without `logprobs: true` is refused, as the
/// published schema says).
pub(crate) fn present<'de, D, T>(deserializer: D) -> Result<Option<Option<T>>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(deserializer).map(Some)
}

/// Why a request's log-prob fields are refused: the field and the message.
pub(crate) type Refused = (&'static str, String);

/// The alternatives per token a `/v1/completions` request asks for
/// (`None`: no log-probs).
pub(crate) fn completion_ask(
    logprobs: Option<Field>,
    top_logprobs: Option<Option<usize>>,
) -> Result<Option<usize>, Refused> {
    if top_logprobs.is_some() {
        return Err((
            "top_logprobs",
            "top_logprobs is a /v1/chat/completions field; /v1/completions takes \"logprobs\": N alternatives".into(),
        ));
    }
    match logprobs {
        None => Ok(None),
        Some(Field::Count(n)) => within_limit("logprobs", n).map(Some),
        Some(Field::Switch(_)) => Err((
            "logprobs",
            format!(
                "/v1/completions takes \"logprobs\" as the number of alternatives per token (0 to {MAX_TOP_LOGPROBS}), not a boolean"
            ),
        )),
    }
}

/// The alternatives per token a `/v1/chat/completions` request asks for
/// (`None`: no log-probs).
pub(crate) fn chat_ask(
    logprobs: Option<Field>,
    top_logprobs: Option<Option<usize>>,
) -> Result<Option<usize>, Refused> {
    match (logprobs, top_logprobs) {
        (Some(Field::Switch(true)), top) => {
            within_limit("top_logprobs", top.flatten().unwrap_or(0)).map(Some)
        }
        (Some(Field::Count(_)), _) => Err((
            "logprobs",
            "/v1/chat/completions takes \"logprobs\": true (and \"top_logprobs\": N alternatives), not a number".into(),
        )),
        (_, Some(_)) => Err((
            "top_logprobs",
            "top_logprobs needs \"logprobs\": true".into(),
        )),
        (None | Some(Field::Switch(false)), None) => Ok(None),
    }
}

fn within_limit(field: &'static str, n: usize) -> Result<usize, Refused> {
    if n > MAX_TOP_LOGPROBS {
        return Err((
            field,
            format!(
                "{field} is {n}; this server gives at most {MAX_TOP_LOGPROBS} alternatives per token"
            ),
        ));
    }
    Ok(n)
}

/// One token's text as OpenAI shows it: its bytes read as UTF-8, a partial
/// character replaced by U+FFFD (the exact bytes are in `bytes`).
fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// `/v1/completions`' `logprobs` for `entries`: `tokens`, `token_logprobs`,
/// `top_logprobs` (token → log-prob, likeliest first) and `text_offset`
/// (the character of the completion each token starts at; `offset` carries
/// the count from one streamed chunk to the next). A token that starts
/// inside a character counts from the character after it.
pub(crate) fn legacy(
    tokenizer: &TextTokenizer,
    entries: &[TokenLogProb],
    offset: &mut usize,
) -> Value {
    let mut tokens = Vec::with_capacity(entries.len());
    let mut offsets = Vec::with_capacity(entries.len());
    let mut top = Vec::with_capacity(entries.len());
    for entry in entries {
        let bytes = tokenizer.token_bytes(entry.token);
        offsets.push(*offset);
        // Characters begin at every byte that is not a continuation byte.
        *offset += bytes.iter().filter(|&&b| b & 0xC0 != 0x80).count();
        let alternatives: Map<String, Value> = entry
            .top
            .iter()
            .map(|&(id, lp)| (text(&tokenizer.token_bytes(id)), json!(lp)))
            .collect();
        top.push(Value::Object(alternatives));
        tokens.push(text(&bytes));
    }
    json!({
        "tokens": tokens,
        "token_logprobs": entries.iter().map(|e| e.log_prob).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": offsets,
    })
}

/// `/v1/chat/completions`' `logprobs` for `entries`: one `content` entry
/// per token with its text, log-prob, bytes and alternatives.
pub(crate) fn chat(tokenizer: &TextTokenizer, entries: &[TokenLogProb]) -> Value {
    let spelled = |id: u32, log_prob: f64| {
        let bytes = tokenizer.token_bytes(id);
        json!({"token": text(&bytes), "logprob": log_prob, "bytes": bytes})
    };
    let content: Vec<Value> = entries
        .iter()
        .map(|entry| {
            let mut item = spelled(entry.token, entry.log_prob);
            item["top_logprobs"] = entry.top.iter().map(|&(id, lp)| spelled(id, lp)).collect();
            item
        })
        .collect();
    json!({ "content": content })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(body: &str) -> (Option<Field>, Option<Option<usize>>) {
        #[derive(Deserialize)]
        struct Body {
            #[serde(default)]
            logprobs: Option<Field>,
            #[serde(default, deserialize_with = "present")]
            top_logprobs: Option<Option<usize>>,
        }
        let body: Body = serde_json::from_str(body).unwrap();
        (body.logprobs, body.top_logprobs)
    }

    fn completion(body: &str) -> Result<Option<usize>, Refused> {
        let (l, t) = ask(body);
        completion_ask(l, t)
    }

    fn chat_(body: &str) -> Result<Option<usize>, Refused> {
        let (l, t) = ask(body);
        chat_ask(l, t)
    }

    #[test]
    fn each_endpoint_takes_its_own_spelling_and_refuses_the_other() {
        assert_eq!(completion("{}"), Ok(None));
        assert_eq!(completion(r#"{"logprobs": null}"#), Ok(None));
        assert_eq!(completion(r#"{"logprobs": 0}"#), Ok(Some(0)));
        assert_eq!(completion(r#"{"logprobs": 20}"#), Ok(Some(20)));
        assert_eq!(completion(r#"{"logprobs": 21}"#).unwrap_err().0, "logprobs");
        assert_eq!(
            completion(r#"{"logprobs": true}"#).unwrap_err().0,
            "logprobs"
        );
        assert_eq!(
            completion(r#"{"logprobs": 2, "top_logprobs": 2}"#)
                .unwrap_err()
                .0,
            "top_logprobs"
        );

        assert_eq!(chat_("{}"), Ok(None));
        assert_eq!(chat_(r#"{"logprobs": false}"#), Ok(None));
        assert_eq!(chat_(r#"{"logprobs": true}"#), Ok(Some(0)));
        assert_eq!(
            chat_(r#"{"logprobs": true, "top_logprobs": null}"#),
            Ok(Some(0))
        );
        assert_eq!(
            chat_(r#"{"logprobs": true, "top_logprobs": 5}"#),
            Ok(Some(5))
        );
        assert_eq!(
            chat_(r#"{"logprobs": true, "top_logprobs": 21}"#)
                .unwrap_err()
                .0,
            "top_logprobs"
        );
        for orphan in [
            r#"{"top_logprobs": 3}"#,
            r#"{"top_logprobs": null}"#,
            r#"{"logprobs": false, "top_logprobs": 0}"#,
        ] {
            assert_eq!(chat_(orphan).unwrap_err().0, "top_logprobs", "{orphan}");
        }
        assert_eq!(chat_(r#"{"logprobs": 3}"#).unwrap_err().0, "logprobs");
    }

    use std::collections::HashMap;

    use qforge_decode::sampling::continuation_log_probs;
    use qforge_formats::text::ChatMessage;
    use qforge_model::{Activations, LanguageModel};

    use crate::rollout::{RolloutMode, RolloutOptions};
    use crate::server::ServeOptions;
    use crate::testing::{TestServer, options, smollm2};

    /// SmolLM2 with every linear in INT8 (dynamic activations): the
    /// distribution the figures must be is the quantized model's own.
    fn int8_smollm2() -> LanguageModel {
        let mut lm = smollm2();
        lm.model = lm
            .model
            .with_linears(|_, layer| layer.to_int8(Activations::Dynamic))
            .unwrap();
        lm
    }

    /// Every token id by how `spell` writes its bytes; a spelling two
    /// tokens share names neither.
    fn vocabulary<K: AsRef<[u8]>>(
        lm: &LanguageModel,
        spell: impl Fn(&[u8]) -> K,
    ) -> HashMap<Vec<u8>, u32> {
        let tokenizer = &lm.text.tokenizer;
        let mut ids: HashMap<Vec<u8>, Option<u32>> = HashMap::new();
        for id in 0..tokenizer.vocab_size() as u32 {
            let key = spell(&tokenizer.token_bytes(id)).as_ref().to_vec();
            ids.entry(key).and_modify(|e| *e = None).or_insert(Some(id));
        }
        ids.into_iter()
            .filter_map(|(k, id)| Some((k, id?)))
            .collect()
    }

    fn post(server: &TestServer, path: &str, body: &Value) -> Value {
        let (status, answer) = server.request("POST", path, &body.to_string());
        assert_eq!(status, 200, "{answer}");
        serde_json::from_str(&answer).unwrap()
    }

    /// The library's figures for `tokens` after `prompt` are the server's:
    /// INT8 linears sum exactly and attention is per query, so the engine's
    /// prefill and decode steps compute what one teacher-forced pass does,
    /// to the bit. The last bit is all the comparison allows, because
    /// serde_json's default float parser (without `float_roundtrip`) may
    /// round it differently from the shortest representation the server
    /// wrote.
    fn assert_the_models_own(
        lm: &LanguageModel,
        prompt: &[u32],
        tokens: &[u32],
        temperature: Option<f64>,
        served: &[f64],
    ) {
        let expected = continuation_log_probs(&lm.model, prompt, tokens, temperature).unwrap();
        assert_eq!(served.len(), expected.len());
        for (i, (s, e)) in served.iter().zip(&expected).enumerate() {
            assert!(
                (s - e).abs() <= 2.0 * f64::EPSILON * e.abs(),
                "token {i}: served {s}, library {e}"
            );
        }
    }

    #[test]
    fn completion_log_probs_are_the_int8_models_own_streamed_or_not() {
        let lm = int8_smollm2();
        let server = TestServer::serving(lm.clone(), options());
        let text = "The three primary colours are";
        let body = json!({"prompt": text, "max_tokens": 12, "temperature": 0, "logprobs": 3});
        let answer = post(&server, "/v1/completions", &body);
        let choice = &answer["choices"][0];
        let log_probs = &choice["logprobs"];
        // The served tokens, named by their text (no two of these spell
        // alike: English words, whole characters).
        let prompt = lm.text.tokenizer.encode(text).unwrap();
        let spelled: Vec<String> = serde_json::from_value(log_probs["tokens"].clone()).unwrap();
        let ids = vocabulary(&lm, super::text);
        let tokens: Vec<u32> = spelled.iter().map(|t| ids[t.as_bytes()]).collect();
        let served: Vec<f64> = serde_json::from_value(log_probs["token_logprobs"].clone()).unwrap();
        assert_the_models_own(&lm, &prompt, &tokens, None, &served);
        assert_eq!(spelled.concat(), choice["text"].as_str().unwrap());
        // Greedy: the chosen token is the likeliest, first of the three.
        for (i, top) in log_probs["top_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
        {
            let top = top.as_object().unwrap();
            assert_eq!(top.len(), 3);
            assert_eq!(top.get(&spelled[i]), Some(&json!(served[i])), "token {i}");
        }
        let offsets: Vec<usize> = serde_json::from_value(log_probs["text_offset"].clone()).unwrap();
        let mut at = 0;
        for (offset, token) in offsets.iter().zip(&spelled) {
            assert_eq!(*offset, at);
            at += token.chars().count();
        }

        // Streamed: the chunks' figures, put together, are the same.
        let streamed = json!({"prompt": text, "max_tokens": 12, "temperature": 0, "logprobs": 3, "stream": true});
        let (status, events) = server.request("POST", "/v1/completions", &streamed.to_string());
        assert_eq!(status, 200, "{events}");
        let (mut tokens_seen, mut figures, mut offsets_seen) = (Vec::new(), Vec::new(), Vec::new());
        for line in events.lines().filter_map(|l| l.strip_prefix("data: ")) {
            let Ok(chunk) = serde_json::from_str::<Value>(line) else {
                continue;
            };
            let part = &chunk["choices"][0]["logprobs"];
            if part.is_null() {
                continue;
            }
            tokens_seen.extend(part["tokens"].as_array().unwrap().iter().cloned());
            figures.extend(part["token_logprobs"].as_array().unwrap().iter().cloned());
            offsets_seen.extend(part["text_offset"].as_array().unwrap().iter().cloned());
        }
        assert_eq!(Value::Array(tokens_seen), log_probs["tokens"]);
        assert_eq!(Value::Array(figures), log_probs["token_logprobs"]);
        assert_eq!(Value::Array(offsets_seen), log_probs["text_offset"]);
    }

    #[test]
    fn sampled_chat_log_probs_are_those_of_the_distribution_sampled_from() {
        let lm = int8_smollm2();
        let server = TestServer::serving(lm.clone(), options());
        let messages = [ChatMessage {
            role: "user".into(),
            content: "Name a fruit.".into(),
        }];
        let body = json!({
            "messages": messages, "max_tokens": 16, "temperature": 0.8, "seed": 3,
            "logprobs": true, "top_logprobs": 2,
        });
        let answer = post(&server, "/v1/chat/completions", &body);
        let content = answer["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap()
            .clone();
        assert!(!content.is_empty());
        // A token's bytes name it: byte-level BPE spells no two alike.
        let ids = vocabulary(&lm, <[u8]>::to_vec);
        let bytes =
            |item: &Value| -> Vec<u8> { serde_json::from_value(item["bytes"].clone()).unwrap() };
        let tokens: Vec<u32> = content.iter().map(|item| ids[&bytes(item)]).collect();
        let served: Vec<f64> = content
            .iter()
            .map(|item| item["logprob"].as_f64().unwrap())
            .collect();
        let prompt = lm.text.chat_prompt_ids(&messages).unwrap();
        assert_the_models_own(&lm, &prompt, &tokens, Some(0.8), &served);
        for item in &content {
            let top = item["top_logprobs"].as_array().unwrap();
            assert_eq!(top.len(), 2);
            assert!(top[0]["logprob"].as_f64() >= top[1]["logprob"].as_f64());
            assert_eq!(item["token"], json!(text(&bytes(item))));
        }
        // The same seed gives the same tokens and figures.
        assert_eq!(
            post(&server, "/v1/chat/completions", &body)["choices"],
            answer["choices"]
        );
        // Without the switch: no figures.
        let plain = json!({"messages": messages, "max_tokens": 2});
        assert!(post(&server, "/v1/chat/completions", &plain)["choices"][0]["logprobs"].is_null());
    }

    #[test]
    fn a_misspelled_log_prob_request_is_refused_naming_the_field() {
        let server = TestServer::language_model();
        for (path, body, param) in [
            (
                "/v1/completions",
                json!({"prompt": "Hi", "logprobs": true}),
                "logprobs",
            ),
            (
                "/v1/completions",
                json!({"prompt": "Hi", "logprobs": 21}),
                "logprobs",
            ),
            (
                "/v1/chat/completions",
                json!({"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2}),
                "top_logprobs",
            ),
        ] {
            let (status, answer) = server.request("POST", path, &body.to_string());
            assert_eq!(status, 400, "{answer}");
            let answer: Value = serde_json::from_str(&answer).unwrap();
            assert_eq!(answer["error"]["param"], param, "{answer}");
        }
    }

    #[test]
    fn a_shadow_of_the_same_model_scores_every_token_alike() {
        // INT8 against itself: the reference's teacher-forced scoring of
        // INT8's tokens must give the very draws and log-probs INT8 had, at
        // every position; a token scored one place off, a missed end of
        // sequence or a prompt chunked differently would show.
        let lm = int8_smollm2();
        let options = ServeOptions {
            rollout: RolloutOptions {
                mode: RolloutMode::Shadow { sample: 1.0 },
                ..options().rollout
            },
            ..options()
        };
        let server = TestServer::serving_with_reference(lm.clone(), Some(lm), options);
        let mut tokens = 0;
        for (prompt, temperature) in [
            ("The three primary colours are", 0.0),
            ("Once upon a time", 0.9),
        ] {
            let body =
                json!({"prompt": prompt, "max_tokens": 24, "temperature": temperature, "seed": 5});
            let answer = post(&server, "/v1/completions", &body);
            assert!(
                answer["choices"][0]["logprobs"].is_null(),
                "log-probs were not asked for"
            );
            tokens += answer["usage"]["completion_tokens"].as_u64().unwrap();
            if answer["choices"][0]["finish_reason"] == "stop" {
                tokens += 1;
            }
        }
        server.wait_for_metric("qforge_logprob_mismatch_count", tokens as f64);
        assert_eq!(
            server.metric("qforge_logprob_mismatch_count"),
            Some(tokens as f64)
        );
        assert_eq!(server.metric("qforge_logprob_mismatch_sum"), Some(0.0));
        assert_eq!(server.metric("qforge_logprob_mismatch_mean"), Some(0.0));
        assert_eq!(server.metric("qforge_logprob_mismatch_alert"), Some(0.0));
        assert_eq!(
            server.metric("qforge_shadow_observations_total"),
            Some(tokens as f64)
        );
        assert_eq!(server.metric("qforge_shadow_agreement"), Some(1.0));
    }
}
