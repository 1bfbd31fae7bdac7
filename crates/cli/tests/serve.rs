//! `qforge serve` as a real process on a loopback port, spoken to over raw
//! HTTP/1.1: `/v1/act` answers what `qforge act` computes, batching
//! concurrent requests; bad requests get clear 4xx errors; the bearer token
//! is enforced; metrics count what happened; SIGTERM stops it cleanly.

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use support::{json, path, qforge_in};

struct Server {
    child: Child,
    addr: String,
}

impl Server {
    fn start(model: &Path, extra: &[&str], token: Option<&str>) -> Server {
        let mut command = Command::new(env!("CARGO_BIN_EXE_qforge"));
        command
            .args([
                "serve",
                "--model",
                model.to_str().unwrap(),
                "--addr",
                "127.0.0.1:0",
            ])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Some(token) = token {
            command.env("QFORGE_SERVE_TOKEN", token);
        }
        let mut child = command.spawn().unwrap();
        let mut stderr = BufReader::new(child.stderr.take().unwrap());
        let mut line = String::new();
        stderr.read_line(&mut line).unwrap();
        let addr = line
            .split("http://")
            .nth(1)
            .unwrap_or_else(|| panic!("no address in {line:?}"))
            .trim()
            .to_owned();
        // Keep draining stderr so the server never blocks on a full pipe.
        std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
        Server { child, addr }
    }

    /// One request; returns the status, the headers and the body.
    fn request(
        &self,
        method: &str,
        target: &str,
        headers: &[&str],
        body: &str,
    ) -> (u16, String, String) {
        let mut stream = TcpStream::connect(&self.addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let mut request = format!(
            "{method} {target} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
            self.addr,
            body.len()
        );
        for h in headers {
            request.push_str(h);
            request.push_str("\r\n");
        }
        request.push_str("\r\n");
        stream.write_all(request.as_bytes()).unwrap();
        stream.write_all(body.as_bytes()).unwrap();
        let mut response = String::new();
        // The server may close early on an oversized body; read what came.
        let _ = stream.read_to_string(&mut response);
        let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no status in {head:?}"));
        (status, head.to_owned(), body.to_owned())
    }

    fn act(&self, body: &str) -> (u16, Value) {
        let (status, _, body) = self.request("POST", "/v1/act", &[], body);
        (status, serde_json::from_str(&body).unwrap_or(Value::Null))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn observations(n: usize) -> Vec<Vec<f64>> {
    let text = std::fs::read_to_string(path("fixtures/policies/cartpole/rollouts.jsonl")).unwrap();
    let first: Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    first["observations"].as_array().unwrap()[..n]
        .iter()
        .map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect()
        })
        .collect()
}

#[test]
fn act_answers_like_qforge_act_batches_and_counts() {
    let dir = support::temp("serve", "act");
    json(&qforge_in(&dir, &["quantize", "--json"]));
    let artifact = dir.join("qforge-out");
    // A generous batching window, so concurrent requests surely share forwards.
    let server = Server::start(&artifact, &["--max-wait-ms", "50"], None);
    assert_eq!(server.request("GET", "/health", &[], "").0, 200);
    assert_eq!(server.request("GET", "/ready", &[], "").0, 200);
    let (status, _, api) = server.request("GET", "/openapi.json", &[], "");
    assert_eq!(status, 200);
    let api: Value = serde_json::from_str(&api).unwrap();
    assert!(api["paths"]["/v1/act"]["post"].is_object(), "{api}");

    // What `qforge act` says for the first 40 observations of episode 0.
    let rows = observations(40);
    let file = dir.join("obs.jsonl");
    std::fs::write(&file, serde_json::json!({"observations": rows}).to_string()).unwrap();
    let expected = json(&qforge_in(
        &dir,
        &[
            "act",
            "--model",
            "qforge-out",
            "--observations",
            file.to_str().unwrap(),
            "--json",
        ],
    ))["actions"]
        .clone();

    // One request with all of them, and 40 concurrent single-row requests.
    let (status, all) = server.act(&serde_json::json!({"observations": rows}).to_string());
    assert_eq!(status, 200, "{all}");
    assert_eq!(all["actions"], expected);
    let singles: Vec<Value> = std::thread::scope(|scope| {
        let handles: Vec<_> = rows
            .iter()
            .map(|row| {
                let server = &server;
                scope.spawn(move || {
                    let (status, v) =
                        server.act(&serde_json::json!({"observations": [row]}).to_string());
                    assert_eq!(status, 200, "{v}");
                    v["actions"][0].clone()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(Value::Array(singles), expected);

    let (_, _, metrics) = server.request("GET", "/metrics", &[], "");
    assert!(
        metrics.contains("qforge_requests_total{endpoint=\"/v1/act\",status=\"200\"} 41"),
        "{metrics}"
    );
    assert!(
        metrics.contains("qforge_observations_total 80"),
        "{metrics}"
    );
    // 41 requests went through fewer forwards: concurrent ones were batched.
    let value = |name: &str| -> f64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .unwrap_or_else(|| panic!("no {name} in {metrics}"))
            .trim()
            .parse()
            .unwrap()
    };
    let forwards = value("qforge_batch_rows_count ");
    assert!(forwards < 41.0, "{forwards} forwards for 41 requests");
    assert_eq!(value("qforge_batch_rows_sum "), 80.0);
    assert!(
        metrics.contains("qforge_resident_memory_bytes"),
        "{metrics}"
    );

    // SIGTERM: a clean stop.
    let mut server = server;
    Command::new("kill")
        .args(["-TERM", &server.child.id().to_string()])
        .status()
        .unwrap();
    assert!(server.child.wait().unwrap().success());
}

#[test]
fn bad_requests_get_clear_errors_and_the_token_is_enforced() {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/policies/cartpole");
    let server = Server::start(
        &model,
        &["--max-rows", "8", "--max-body-bytes", "2000"],
        Some("s3cret"),
    );
    let auth = "Authorization: Bearer s3cret";
    let ok = r#"{"observations": [[0.0, 0.1, 0.0, -0.1]]}"#;
    assert_eq!(server.request("POST", "/v1/act", &[], ok).0, 401);
    assert_eq!(
        server
            .request("POST", "/v1/act", &["Authorization: Bearer wrong"], ok)
            .0,
        401
    );
    let (status, _, body) = server.request("POST", "/v1/act", &[auth], ok);
    assert_eq!(status, 200, "{body}");

    for (body, status, needle) in [
        ("not json", 400, "expected {"),
        (r#"{"observations": []}"#, 400, "empty"),
        (r#"{"observations": [[1, 2, 3]]}"#, 400, "takes 4"),
        (
            r#"{"observations": [[1, 2, 3, 1e39]]}"#,
            400,
            "not a finite number",
        ),
        (
            r#"{"observations": [[1, 2, 3, 4]], "extra": 1}"#,
            400,
            "unknown field",
        ),
        (
            r#"{"observations": [[0,0,0,0],[0,0,0,0],[0,0,0,0],[0,0,0,0],[0,0,0,0],[0,0,0,0],[0,0,0,0],[0,0,0,0],[0,0,0,0]]}"#,
            413,
            "limit is 8",
        ),
    ] {
        let (got, _, text) = server.request("POST", "/v1/act", &[auth], body);
        assert_eq!(got, status, "{body}: {text}");
        assert!(text.contains(needle), "{body}: {text}");
    }
    // A body over --max-body-bytes is refused before it is parsed.
    let big = format!(r#"{{"observations": [[{}]]}}"#, vec!["0.5"; 1000].join(","));
    assert_eq!(server.request("POST", "/v1/act", &[auth], &big).0, 413);
}

#[test]
fn a_language_model_is_not_served_yet() {
    let out = Command::new(env!("CARGO_BIN_EXE_qforge"))
        .args([
            "serve",
            "--model",
            &path("models/smollm2-135m-instruct-q4_1.gguf"),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("runs policies"));
}

#[test]
fn random_bodies_never_break_the_server() {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/policies/cartpole");
    let server = Server::start(&model, &["--max-body-bytes", "65536"], None);
    let mut rng = StdRng::seed_from_u64(7);
    let number = |rng: &mut StdRng| -> String {
        match rng.random_range(0..6) {
            0 => "1e999".into(),
            1 => "-0".into(),
            2 => "null".into(),
            3 => "\"x\"".into(),
            _ => format!("{}", rng.random_range(-1e6..1e6f64)),
        }
    };
    for case in 0..300 {
        let body = match case % 4 {
            // Raw bytes, valid UTF-8 only so the request line stays intact.
            0 => (0..rng.random_range(0..200))
                .map(|_| char::from(rng.random_range(32u8..127)))
                .collect::<String>(),
            // Observations of random widths and contents.
            1 | 2 => {
                let rows: Vec<String> = (0..rng.random_range(0..6))
                    .map(|_| {
                        let width = rng.random_range(0..7);
                        let values: Vec<String> = (0..width).map(|_| number(&mut rng)).collect();
                        format!("[{}]", values.join(","))
                    })
                    .collect();
                format!(r#"{{"observations": [{}]}}"#, rows.join(","))
            }
            // Other shapes of JSON.
            _ => [
                "[]",
                "{}",
                "null",
                r#"{"observations": 3}"#,
                r#"{"observations": [3]}"#,
                "\"\"",
            ][rng.random_range(0..6)]
            .to_owned(),
        };
        let (status, _, text) = server.request("POST", "/v1/act", &[], &body);
        assert!(
            [200, 400, 413].contains(&status),
            "{body:?} → {status} {text}"
        );
    }
    assert_eq!(server.request("GET", "/health", &[], "").0, 200);
}
