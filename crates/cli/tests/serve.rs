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

/// Waits for `condition` (polled every 20 ms), failing after a deadline
/// generous enough for a machine whose cores are all busy.
fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(180);
    while !condition() {
        assert!(
            std::time::Instant::now() < deadline,
            "gave up waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

struct Server {
    child: Child,
    addr: String,
}

impl Server {
    fn start(model: &Path, extra: &[&str], token: Option<&str>) -> Server {
        Server::launch(Server::command(model, extra, token))
    }

    /// `qforge serve` of `model` on a free loopback port.
    fn command(model: &Path, extra: &[&str], token: Option<&str>) -> Command {
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
        // A loaded machine (CI runs the suites side by side on two cores)
        // can take longer than the default 10 s to answer; only the test of
        // the timeout itself sets one.
        if !extra.contains(&"--timeout-ms") {
            command.args(["--timeout-ms", "300000"]);
        }
        if let Some(token) = token {
            command.env("QFORGE_SERVE_TOKEN", token);
        }
        command
    }

    /// Starts `command` and waits until it listens.
    fn launch(mut command: Command) -> Server {
        let mut child = command.spawn().unwrap();
        let mut stderr = BufReader::new(child.stderr.take().unwrap());
        let mut seen = String::new();
        let addr = loop {
            let mut line = String::new();
            if stderr.read_line(&mut line).unwrap() == 0 {
                panic!("the server stopped before listening: {seen}");
            }
            if let Some(addr) = line.split("http://").nth(1) {
                break addr.trim().to_owned();
            }
            seen.push_str(&line);
        };
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
            .set_read_timeout(Some(Duration::from_secs(300)))
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
        self.post("/v1/act", &[], body)
    }

    fn post(&self, target: &str, headers: &[&str], body: &str) -> (u16, Value) {
        let (status, _, body) = self.request("POST", target, headers, body);
        (status, serde_json::from_str(&body).unwrap_or(Value::Null))
    }

    /// The value of the metric line starting with `name ` (labels included).
    fn metric(&self, name: &str) -> Option<f64> {
        let (_, _, text) = self.request("GET", "/metrics", &[], "");
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .map(|v| v.trim().parse().unwrap())
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
    let dir = dir.path();
    json(&qforge_in(dir, &["quantize", "--json"]));
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
        dir,
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
        // The limit is checked while parsing: nothing after the ninth row
        // is read (here it is not even JSON).
        (
            r#"{"observations": [[0,0,0,0],[0,0,0,0],[0,0,0,0],[0,0,0,0],[0,0,0,0],[0,0,0,0],[0,0,0,0],[0,0,0,0],[0,0,0,0], !!!"#,
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
    // Refusals before the handler runs are counted too.
    let (_, _, metrics) = server.request("GET", "/metrics", &[auth], "");
    assert!(
        metrics.contains("qforge_requests_total{endpoint=\"/v1/act\",status=\"413\"} 3"),
        "{metrics}"
    );
}

#[test]
fn the_token_guards_all_but_the_probes_and_is_checked_before_the_body() {
    let server = Server::start(&cartpole(), &[], Some("s3cret"));
    // The probes stay open; everything else needs the token.
    for target in ["/health", "/ready"] {
        assert_eq!(server.request("GET", target, &[], "").0, 200, "{target}");
    }
    for target in ["/metrics", "/openapi.json"] {
        let (status, head, _) = server.request("GET", target, &[], "");
        assert_eq!(status, 401, "{target}");
        assert!(
            head.to_lowercase().contains("www-authenticate: bearer"),
            "{head}"
        );
        assert_eq!(
            server
                .request("GET", target, &["Authorization: Bearer s3cre"], "")
                .0,
            401,
            "{target}"
        );
        // RFC 7235: the scheme's name is case-insensitive.
        for auth in [
            "Authorization: bearer s3cret",
            "Authorization: BEARER s3cret",
        ] {
            assert_eq!(server.request("GET", target, &[auth], "").0, 200, "{auth}");
        }
    }
    let ok = r#"{"reward": 1}"#;
    assert_eq!(server.post("/v1/feedback", &[], ok).0, 401);
    // A request without the token is refused on its head: the server
    // neither reads nor waits for the 1 000 bytes it announces.
    let mut stream = server.connect();
    stream
        .write_all(
            b"POST /v1/act HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n",
        )
        .unwrap();
    let answer = read_until_closed(&mut stream, "a request with the wrong token");
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
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

/// What `qforge act` answers for `rows` on `model`.
fn qforge_act(dir: &Path, model: &str, rows: &[Vec<f64>]) -> Value {
    let file = dir.join("act-input.json");
    std::fs::write(&file, serde_json::json!({"observations": rows}).to_string()).unwrap();
    json(&qforge_in(
        dir,
        &[
            "act",
            "--model",
            model,
            "--observations",
            file.to_str().unwrap(),
            "--json",
        ],
    ))["actions"]
        .clone()
}

/// `/v1/act` gives each action's log-probability under the served policy:
/// a greedy discrete action is the likeliest of two (log p ≥ ln ½), a
/// sampled one scores what was drawn, and one seed draws the same actions
/// twice. A Gaussian head scores and samples once it has `log_std`; without
/// it the log-probabilities are null and sampling is refused.
#[test]
fn act_gives_log_probabilities_and_samples_reproducibly_by_seed() {
    let dir = support::temp("serve", "logprobs");
    let dir = dir.path();
    let rows = observations(40);
    let request = |server: &Server, extra: Value| -> Value {
        let mut body = serde_json::json!({"observations": rows});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let (status, v) = server.act(&body.to_string());
        assert_eq!(status, 200, "{v}");
        v
    };
    let log_probs = |v: &Value| -> Vec<f64> {
        let lp = v["log_probs"].as_array().unwrap();
        assert_eq!(lp.len(), rows.len(), "{v}");
        lp.iter().map(|l| l.as_f64().unwrap()).collect()
    };

    let cartpole = Server::start(Path::new(&path("fixtures/policies/cartpole")), &[], None);
    let greedy = request(&cartpole, serde_json::json!({}));
    let greedy_lp = log_probs(&greedy);
    assert!(
        greedy_lp
            .iter()
            .all(|&l| (-std::f64::consts::LN_2..=0.0).contains(&l)),
        "{greedy}"
    );
    let seeded = serde_json::json!({"sample": true, "seed": 11});
    let sampled = request(&cartpole, seeded.clone());
    assert_eq!(request(&cartpole, seeded), sampled, "one seed, one draw");
    let sampled_lp = log_probs(&sampled);
    for i in 0..rows.len() {
        // The greedy action's probability p, or the other one's 1 − p.
        let p = greedy_lp[i].exp();
        let expected = if sampled["actions"][i] == greedy["actions"][i] {
            p.ln()
        } else {
            (1.0 - p).ln()
        };
        assert!(
            (sampled_lp[i] - expected).abs() < 1e-4,
            "row {i}: {sampled}"
        );
    }
    drop(cartpole);

    let pendulum = std::path::PathBuf::from(path("fixtures/policies/pendulum"));
    let mean_only = Server::start(&pendulum, &[], None);
    let v = request(
        &mean_only,
        serde_json::json!({"observations": [[1.0, 0.0, 0.5]]}),
    );
    assert!(
        v["log_probs"]
            .as_array()
            .unwrap()
            .iter()
            .all(Value::is_null),
        "{v}"
    );
    let (status, v) = mean_only.act(r#"{"observations": [[1.0, 0.0, 0.5]], "sample": true}"#);
    assert_eq!(status, 400, "{v}");
    assert!(v["error"].as_str().unwrap().contains("log_std"), "{v}");
    drop(mean_only);

    let stochastic = dir.join("pendulum");
    std::fs::create_dir_all(&stochastic).unwrap();
    std::fs::copy(
        pendulum.join("model.safetensors"),
        stochastic.join("model.safetensors"),
    )
    .unwrap();
    let config = std::fs::read_to_string(pendulum.join("policy.json")).unwrap();
    let config = config.replace(
        "\"action_dim\": 1",
        "\"action_dim\": 1, \"log_std\": [-0.5]",
    );
    std::fs::write(stochastic.join("policy.json"), config).unwrap();
    let server = Server::start(&stochastic, &[], None);
    let body = serde_json::json!({"observations": [[1.0, 0.0, 0.5], [-0.5, 0.8, -2.0]], "sample": true, "seed": 3});
    let (status, first) = server.act(&body.to_string());
    assert_eq!(status, 200, "{first}");
    assert_eq!(server.act(&body.to_string()).1, first);
    for (action, log_prob) in first["actions"]
        .as_array()
        .unwrap()
        .iter()
        .zip(first["log_probs"].as_array().unwrap())
    {
        let a = action[0].as_f64().unwrap();
        assert!((-2.0..=2.0).contains(&a), "{first}");
        // A density of σ = e^−0.5 peaks at −ln σ − ½ ln 2π ≈ −0.42.
        assert!(log_prob.as_f64().unwrap() <= -0.41, "{first}");
    }
}

#[test]
fn shadow_rollout_keeps_a_good_int8_model_and_rolls_back_a_bad_one() {
    let dir = support::temp("serve", "shadow");
    let dir = dir.path();
    json(&qforge_in(dir, &["quantize", "--json"]));
    // A genuinely bad INT8 model: every static scale clips at the 20th
    // percentile, and the guard is told to accept it (≈ 50 % agreement).
    let bad = json(&qforge_in(
        dir,
        &[
            "quantize",
            "-o",
            "bad",
            "--calibrator",
            "percentile(20)",
            "--min-agreement",
            "0",
            "--json",
        ],
    ));
    assert!(bad["after"]["agreement"].as_f64().unwrap() < 0.9, "{bad}");
    let rows = observations(40);
    let body = serde_json::json!({"observations": rows}).to_string();
    let shadow = [
        "--shadow",
        "--shadow-sample",
        "1",
        "--agreement-window",
        "200",
    ];
    let wait_for = |server: &Server, name: &str, at_least: f64| {
        wait_until(&format!("{name} reaching {at_least}"), || {
            server.metric(name).is_some_and(|v| v >= at_least)
        });
    };

    // The good artifact: the reference (found through the manifest) shadows
    // every request; agreement stays high; INT8 keeps answering.
    let good = Server::start(&dir.join("qforge-out"), &shadow, None);
    let int8 = qforge_act(dir, "qforge-out", &rows);
    for _ in 0..10 {
        let (status, v) = good.act(&body);
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["arm"], "int8");
        assert_eq!(v["actions"], int8);
    }
    wait_for(&good, "qforge_shadow_observations_total", 400.0);
    assert!(good.metric("qforge_shadow_agreement").unwrap() >= 0.95);
    // Every shadowed action's log-probability gap is recorded.
    wait_for(&good, "qforge_logprob_mismatch_count", 400.0);
    let good_gap = good.metric("qforge_logprob_mismatch_sum").unwrap()
        / good.metric("qforge_logprob_mismatch_count").unwrap();
    assert_eq!(good.metric("qforge_rolled_back"), Some(0.0));
    // Its mean gap over the window stays under the default alert (0.1 nats).
    assert!(good.metric("qforge_logprob_mismatch_mean").unwrap() < 0.1);
    assert_eq!(good.metric("qforge_logprob_mismatch_alert"), Some(0.0));
    drop(good);

    // The bad one: once 200 shadowed observations agree < 95 %, traffic
    // rolls back and the FP reference answers.
    let fp_dir = path("fixtures/policies/cartpole");
    let fp = qforge_act(dir, &fp_dir, &rows);
    let server = Server::start(&dir.join("bad"), &shadow, None);
    for _ in 0..5 {
        assert_eq!(server.act(&body).1["arm"], "int8");
    }
    wait_for(&server, "qforge_rolled_back", 1.0);
    assert!(server.metric("qforge_shadow_agreement").unwrap() < 0.95);
    let bad_gap = server.metric("qforge_logprob_mismatch_sum").unwrap()
        / server.metric("qforge_logprob_mismatch_count").unwrap();
    assert!(
        bad_gap > 10.0 * good_gap,
        "mean gap: bad {bad_gap}, good {good_gap}"
    );
    let (status, v) = server.act(&body);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["arm"], "fp");
    assert_eq!(v["actions"], fp);
    assert_eq!(
        server.metric("qforge_arm_requests_total{arm=\"fp\"}"),
        Some(1.0)
    );
}

#[test]
fn ab_split_is_sticky_by_session_and_reward_feedback_rolls_back() {
    let dir = support::temp("serve", "ab");
    let dir = dir.path();
    json(&qforge_in(dir, &["quantize", "--json"]));
    let server = Server::start(
        &dir.join("qforge-out"),
        // Sessions report several rewards in a row here, and the verdict
        // comes from a few episodes in a burst: this tests the consistency.
        &[
            "--ab",
            "int8=0.5,fp=0.5",
            "--reward-window",
            "3",
            "--feedback-interval-ms",
            "0",
            "--rollback-min-sessions",
            "3",
            "--rollback-min-span-ms",
            "0",
        ],
        None,
    );
    let body = serde_json::json!({"observations": observations(2)}).to_string();
    let arm_of = |session: &str| -> String {
        let header = format!("X-Session-Id: {session}");
        let (status, _, text) = server.request("POST", "/v1/act", &[&header], &body);
        assert_eq!(status, 200, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        v["arm"].as_str().unwrap().to_owned()
    };
    let sessions: Vec<String> = (0..20).map(|i| format!("episode-{i}")).collect();
    let arms: Vec<String> = sessions.iter().map(|s| arm_of(s)).collect();
    assert_eq!(
        arms,
        sessions.iter().map(|s| arm_of(s)).collect::<Vec<_>>(),
        "sessions keep their arm"
    );
    let int8_sessions: Vec<&String> = sessions
        .iter()
        .zip(&arms)
        .filter_map(|(s, a)| (a == "int8").then_some(s))
        .collect();
    let fp_sessions: Vec<&String> = sessions
        .iter()
        .zip(&arms)
        .filter_map(|(s, a)| (a == "fp").then_some(s))
        .collect();
    assert!(
        int8_sessions.len() >= 3 && fp_sessions.len() >= 3,
        "{arms:?}"
    );

    // Bad feedback is refused with a reason.
    for (headers, body, needle) in [
        (vec![], r#"{"reward": 1}"#, "X-Session-Id"),
        (vec!["X-Session-Id: a"], r#"{"reward": "high"}"#, "reward"),
        (
            vec!["X-Session-Id: a"],
            r#"{"reward": 1, "arm": "bf16"}"#,
            "arm",
        ),
        // Finite, but a mean of two is not.
        (
            vec!["X-Session-Id: a"],
            r#"{"reward": 1e308}"#,
            "within ±1e9",
        ),
    ] {
        let (status, v) = server.post("/v1/feedback", &headers, body);
        assert_eq!(status, 400, "{body}: {v}");
        assert!(v["error"].as_str().unwrap().contains(needle), "{v}");
    }

    // Three FP episodes return 500; INT8 episodes return 480 (96 %: kept),
    // then 300 (rolled back once the window's mean drops below 95 %).
    let feedback = |session: &str, reward: f64| -> Value {
        let header = format!("X-Session-Id: {session}");
        let (status, v) = server.post(
            "/v1/feedback",
            &[&header],
            &serde_json::json!({ "reward": reward }).to_string(),
        );
        assert_eq!(status, 200, "{v}");
        v
    };
    for s in &fp_sessions[..3] {
        assert_eq!(feedback(s, 500.0)["arm"], "fp");
    }
    for s in &int8_sessions[..3] {
        assert_eq!(feedback(s, 480.0)["arm"], "int8");
    }
    let v = feedback(int8_sessions[0], 480.0);
    assert!(
        (v["reward_consistency"].as_f64().unwrap() - 0.96).abs() < 1e-9,
        "{v}"
    );
    assert_eq!(v["rolled_back"], false);
    assert_eq!(arm_of(int8_sessions[0]), "int8");
    let v = feedback(int8_sessions[1], 300.0);
    assert_eq!(v["rolled_back"], true, "{v}");
    assert_eq!(server.metric("qforge_rolled_back"), Some(1.0));
    // Every session now goes to FP.
    for s in &int8_sessions {
        assert_eq!(arm_of(s), "fp");
    }
}

#[test]
fn rollout_flags_are_checked() {
    let cartpole = path("fixtures/policies/cartpole");
    for (args, needle) in [
        (vec!["--ab", "int8=0.5,bf16=0.5"], "unknown arm"),
        (vec!["--ab", "int8=0,fp=0"], "must not all be 0"),
        (vec!["--ab", "int8=1"], "need --reference"),
        (vec!["--shadow", "--shadow-sample", "0"], "(0, 1]"),
        // The default of 10 sessions per arm cannot fit a window of 5 (the
        // options are checked before the missing reference).
        (
            vec!["--ab", "int8=1", "--reward-window", "5"],
            "--rollback-min-sessions",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_qforge"))
            .args(["serve", "--model", &cartpole])
            .args(&args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
}

#[test]
fn the_drift_monitor_stays_quiet_on_rollouts_and_alerts_on_shifted_observations() {
    let dir = support::temp("serve", "drift");
    let dir = dir.path();
    json(&qforge_in(dir, &["quantize", "--json"]));
    let profile: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("qforge-out/calibration.json")).unwrap(),
    )
    .unwrap();
    assert!(profile["points"]["layers.0"]["abs_max"].as_f64().unwrap() > 0.0);
    let server = Server::start(
        &dir.join("qforge-out"),
        &["--drift-sample", "1", "--drift-window", "4000"],
        None,
    );
    // All 4 000 recorded observations (calibration drew 512 of them): one
    // full window, within what calibration's sample size explains.
    let text = std::fs::read_to_string(path("fixtures/policies/cartpole/rollouts.jsonl")).unwrap();
    let rows: Vec<Value> = text
        .lines()
        .flat_map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["observations"]
                .as_array()
                .unwrap()
                .clone()
        })
        .collect();
    assert_eq!(rows.len(), 4000);
    let send = |rows: &[Value]| {
        for chunk in rows.chunks(500) {
            let (status, v) = server.act(&serde_json::json!({ "observations": chunk }).to_string());
            assert_eq!(status, 200, "{v}");
        }
    };
    let windows = "qforge_drift_windows_total{point=\"layers.0\"}";
    send(&rows);
    assert_eq!(server.metric(windows), Some(1.0));
    assert_eq!(server.metric("qforge_drift_alert"), Some(0.0));
    let calm = server
        .metric("qforge_activation_drift{point=\"layers.1\"}")
        .unwrap();
    // The same states seen by a sensor with three times the gain.
    let shifted: Vec<Value> = rows
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap() * 3.0)
                .collect()
        })
        .collect();
    send(&shifted);
    assert_eq!(server.metric(windows), Some(2.0));
    assert_eq!(server.metric("qforge_drift_alert"), Some(1.0));
    assert!(
        server
            .metric("qforge_activation_out_of_range_ratio{point=\"layers.0\"}")
            .unwrap()
            > 0.01
    );
    let drifted = server
        .metric("qforge_activation_drift{point=\"layers.1\"}")
        .unwrap();
    assert!(drifted > 3.0 * calm, "octave distance {calm} → {drifted}");
    // Back to normal: the alert clears on the next window.
    send(&rows);
    assert_eq!(server.metric("qforge_drift_alert"), Some(0.0));
}

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

/// The model version a response's headers name (`X-Qforge-Model-Version`).
fn model_version(head: &str) -> u64 {
    head.lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("x-qforge-model-version: ")
                .map(|v| v.trim().parse().unwrap())
        })
        .unwrap_or_else(|| panic!("no version header in {head}"))
}

/// The CartPole policy directory, which serves without quantizing.
fn cartpole() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/policies/cartpole")
}

/// How long a test waits for the server to act on a connection before it
/// calls the server stuck: generous, for a machine whose cores are busy.
const CONNECTION_DEADLINE: Duration = Duration::from_secs(120);

impl Server {
    fn connect(&self) -> TcpStream {
        let stream = TcpStream::connect(&self.addr).unwrap();
        // Short reads, so a waiting test checks its deadline often.
        stream
            .set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        stream
    }

    /// Waits until the process exits; its status.
    fn wait_exit(&mut self, what: &str) -> std::process::ExitStatus {
        let mut status = None;
        wait_until(what, || {
            status = self.child.try_wait().unwrap();
            status.is_some()
        });
        status.unwrap()
    }
}

/// Reads `stream` until the server closes it; what it sent before. Panics
/// when the server keeps it open past the deadline.
fn read_until_closed(stream: &mut TcpStream, what: &str) -> String {
    let deadline = std::time::Instant::now() + CONNECTION_DEADLINE;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                assert!(
                    std::time::Instant::now() < deadline,
                    "{what}: the server kept the connection open; it sent {:?}",
                    String::from_utf8_lossy(&got)
                );
            }
            // A reset is a close too.
            Err(_) => break,
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// Reads `stream` until what arrived contains `needle`; what arrived.
fn read_until(stream: &mut TcpStream, needle: &str, what: &str) -> String {
    let deadline = std::time::Instant::now() + CONNECTION_DEADLINE;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains(needle) {
        match stream.read(&mut buf) {
            Ok(0) => panic!(
                "{what}: closed before {needle:?}; it sent {:?}",
                String::from_utf8_lossy(&got)
            ),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                assert!(
                    std::time::Instant::now() < deadline,
                    "{what}: no {needle:?} yet; it sent {:?}",
                    String::from_utf8_lossy(&got)
                );
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// A slowloris client: sends a request line, then one byte of a header
/// that never ends every 100 ms, until the server closes the connection.
/// (The pace is the attack's, not a wait the test decides on.)
fn trickle(mut stream: TcpStream) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        if stream
            .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Trickle: ")
            .is_err()
        {
            return;
        }
        while stream.write_all(b"a").is_ok() {
            std::thread::sleep(Duration::from_millis(100));
        }
    })
}

/// Sends the head of a POST to /v1/act with `Expect: 100-continue` and the
/// first bytes of a 100-byte body, and waits for the server's `100
/// Continue`: from then on the request is in flight on the server.
fn start_slow_act(server: &Server) -> TcpStream {
    let mut stream = server.connect();
    stream
        .write_all(
            b"POST /v1/act HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\nExpect: 100-continue\r\n\r\n",
        )
        .unwrap();
    read_until(&mut stream, "100 Continue\r\n\r\n", "a request in flight");
    stream.write_all(b"{\"observations\": ").unwrap();
    stream
}

#[test]
fn a_client_trickling_its_head_is_cut_off_at_the_header_timeout() {
    let server = Server::start(
        &cartpole(),
        &[
            "--header-timeout-ms",
            "1000",
            "--keep-alive-timeout-ms",
            "600000",
        ],
        None,
    );
    let mut stream = server.connect();
    let client = trickle(stream.try_clone().unwrap());
    read_until_closed(&mut stream, "a client trickling its head");
    client.join().unwrap();
    assert_eq!(
        server.metric("qforge_connections_closed_total{reason=\"header_timeout\"}"),
        Some(1.0)
    );
    assert_eq!(server.request("GET", "/health", &[], "").0, 200);
}

#[test]
fn idle_connections_are_closed_after_the_keep_alive_timeout() {
    let server = Server::start(
        &cartpole(),
        &[
            "--keep-alive-timeout-ms",
            "500",
            "--header-timeout-ms",
            "600000",
        ],
        None,
    );
    // A connection that never sends anything.
    let mut silent = server.connect();
    read_until_closed(&mut silent, "a connection that never sent a byte");
    // A keep-alive connection after its answer.
    let mut kept = server.connect();
    kept.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    read_until(&mut kept, "{\"status\":\"ok\"}", "the answer");
    read_until_closed(&mut kept, "a keep-alive connection after its answer");
    assert_eq!(
        server.metric("qforge_connections_closed_total{reason=\"idle_timeout\"}"),
        Some(2.0)
    );
}

#[test]
fn a_body_that_does_not_arrive_in_time_gets_408() {
    let server = Server::start(&cartpole(), &["--body-timeout-ms", "1000"], None);
    let mut stream = server.connect();
    stream
        .write_all(
            b"POST /v1/act HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"observations\": ",
        )
        .unwrap();
    let answer = read_until_closed(&mut stream, "a body that stopped half-way");
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("did not arrive within 1000 ms"), "{answer}");
}

#[test]
fn at_the_connection_cap_idle_connections_make_room_and_busy_ones_refuse() {
    let server = Server::start(
        &cartpole(),
        &[
            "--max-connections",
            "4",
            "--body-timeout-ms",
            "600000",
            "--keep-alive-timeout-ms",
            "600000",
            "--header-timeout-ms",
            "600000",
        ],
        None,
    );
    // Four idle connections fill the cap; a fifth closes the oldest and is
    // answered (the kernel hands connections over in the order they came).
    let mut idle: Vec<TcpStream> = (0..4).map(|_| server.connect()).collect();
    assert_eq!(server.request("GET", "/health", &[], "").0, 200);
    read_until_closed(&mut idle[0], "the oldest idle connection");
    drop(idle);

    // Four requests in flight: nothing to close, so a fifth gets 503.
    let server = Server::start(
        &cartpole(),
        &["--max-connections", "4", "--body-timeout-ms", "600000"],
        None,
    );
    let busy: Vec<TcpStream> = (0..4).map(|_| start_slow_act(&server)).collect();
    let mut refused = server.connect();
    refused
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let answer = read_until_closed(&mut refused, "a connection beyond the cap");
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 503"),
        "{answer}"
    );
    // Every request in flight still finishes.
    let observation = b"[[0.0, 0.1, 0.0, -0.1]]}";
    for mut stream in busy {
        let pad = 100 - b"{\"observations\": ".len() - observation.len();
        stream.write_all(observation).unwrap();
        stream.write_all(&vec![b' '; pad]).unwrap();
        let answer = read_until(&mut stream, "\"actions\"", "a request in flight");
        assert!(answer.contains("200 OK"), "{answer}");
    }
    assert_eq!(
        server.metric("qforge_connections_closed_total{reason=\"refused\"}"),
        Some(1.0)
    );
}

#[test]
fn a_flood_of_idle_connections_at_a_low_descriptor_limit_locks_nobody_out() {
    use std::os::unix::process::CommandExt;
    let mut command = Server::command(&cartpole(), &[], None);
    // SAFETY: setrlimit is async-signal-safe and touches only the child.
    unsafe {
        command.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: 256,
                rlim_max: 256,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    let server = Server::launch(command);
    // More idle connections than the server may hold descriptors.
    let flood: Vec<TcpStream> = (0..320).map(|_| server.connect()).collect();
    let (status, _, body) = server.request("GET", "/health", &[], "");
    assert_eq!(status, 200, "{body}");
    let (status, v) = server.act(r#"{"observations": [[0.0, 0.1, 0.0, -0.1]]}"#);
    assert_eq!(status, 200, "{v}");
    drop(flood);
}

#[test]
fn sigterm_stops_the_server_within_the_drain_bound_while_clients_trickle() {
    let mut server = Server::start(
        &cartpole(),
        &[
            "--shutdown-timeout-ms",
            "3000",
            "--header-timeout-ms",
            "600000",
            "--body-timeout-ms",
            "600000",
            "--keep-alive-timeout-ms",
            "600000",
        ],
        None,
    );
    let tricklers: Vec<_> = (0..3).map(|_| trickle(server.connect())).collect();
    // One request in flight that will finish, one that never will.
    let mut finishing = start_slow_act(&server);
    let mut stuck = start_slow_act(&server);
    Command::new("kill")
        .args(["-TERM", &server.child.id().to_string()])
        .status()
        .unwrap();
    // The request in flight still gets its answer.
    let observation = b"[[0.0, 0.1, 0.0, -0.1]]}";
    let pad = 100 - b"{\"observations\": ".len() - observation.len();
    finishing.write_all(observation).unwrap();
    finishing.write_all(&vec![b' '; pad]).unwrap();
    let answer = read_until_closed(&mut finishing, "a request in flight at SIGTERM");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    // The one that never finishes is cut at the drain bound, the trickling
    // clients at once, and the server exits.
    let status = server.wait_exit("the server to exit after SIGTERM");
    assert!(status.success(), "{status}");
    read_until_closed(&mut stuck, "a request still in flight at the drain bound");
    for t in tricklers {
        t.join().unwrap();
    }
}

#[test]
fn unknown_paths_get_404_and_are_counted() {
    let server = Server::start(&cartpole(), &[], None);
    for target in ["/nope", "/v1/act/../../etc/passwd", "/v1/%00", "/v2/act"] {
        let (status, _, body) = server.request("GET", target, &[], "");
        assert_eq!(status, 404, "{target}: {body}");
        assert!(body.contains("no such endpoint"), "{body}");
    }
    // One fixed label, whatever the path: a scanner cannot grow the metrics.
    assert_eq!(
        server.metric("qforge_requests_total{endpoint=\"unmatched\",status=\"404\"}"),
        Some(4.0)
    );
}

#[test]
fn one_session_cannot_force_a_rollback_through_feedback() {
    let cartpole = cartpole();
    let reference = cartpole.to_str().unwrap();
    let server = Server::start(
        &cartpole,
        &["--ab", "int8=0.5,fp=0.5", "--reference", reference],
        None,
    );
    // The attack: 20 terrible INT8 episodes and 20 perfect FP ones (the
    // default window), all from one session.
    let started = std::time::Instant::now();
    let mut accepted = 0;
    for i in 0..40 {
        let (arm, reward) = if i % 2 == 0 {
            ("int8", 0.0)
        } else {
            ("fp", 500.0)
        };
        let body = serde_json::json!({"reward": reward, "arm": arm}).to_string();
        let (status, head, text) =
            server.request("POST", "/v1/feedback", &["X-Session-Id: attacker"], &body);
        match status {
            200 => accepted += 1,
            429 => {
                assert!(head.to_lowercase().contains("retry-after: 1"), "{head}");
                assert!(
                    text.contains("an episode reports its return once"),
                    "{text}"
                );
            }
            other => panic!("{other}: {text}"),
        }
    }
    // One reward per second at most, however slow this machine is.
    let seconds = started.elapsed().as_secs_f64();
    assert!(
        (1..=1 + seconds as usize).contains(&accepted),
        "{accepted} rewards accepted in {seconds:.1} s"
    );
    assert_eq!(server.metric("qforge_rolled_back"), Some(0.0));
    // Other sessions still report, and a malformed report spends no turn.
    let (status, v) = server.post(
        "/v1/feedback",
        &["X-Session-Id: episode-7"],
        r#"{"reward": "high"}"#,
    );
    assert_eq!(status, 400, "{v}");
    let (status, v) = server.post(
        "/v1/feedback",
        &["X-Session-Id: episode-7"],
        r#"{"reward": 480, "arm": "int8"}"#,
    );
    assert_eq!(status, 200, "{v}");
}

#[test]
fn a_burst_of_feedback_from_many_sessions_cannot_force_a_rollback() {
    let cartpole = cartpole();
    let reference = cartpole.to_str().unwrap();
    let server = Server::start(
        &cartpole,
        &["--ab", "int8=0.5,fp=0.5", "--reference", reference],
        None,
    );
    // The attack: 20 terrible INT8 episodes and 20 perfect FP ones (the
    // default window), each from a session of its own, in one burst.
    let mut last = Value::Null;
    for i in 0..40 {
        let (arm, reward) = if i % 2 == 0 {
            ("int8", 0.0)
        } else {
            ("fp", 500.0)
        };
        let session = format!("X-Session-Id: attacker-{i}");
        let body = serde_json::json!({"reward": reward, "arm": arm}).to_string();
        let (status, v) = server.post("/v1/feedback", &[&session], &body);
        assert_eq!(status, 200, "{v}");
        last = v;
    }
    // Both windows are full and disagree completely, but their episodes
    // span far less than the default minute.
    assert_eq!(last["reward_consistency"], 0.0, "{last}");
    assert_eq!(last["rolled_back"], false, "{last}");
    let why = last["rollback_withheld"].as_str().unwrap();
    assert!(why.contains("a rollback needs 60000 ms"), "{why}");
    assert_eq!(server.metric("qforge_rolled_back"), Some(0.0));
}

#[test]
fn an_unquantized_policy_answers_as_fp32_and_its_feedback_takes_that_name() {
    let server = Server::start(&cartpole(), &[], None);
    let body = serde_json::json!({"observations": observations(1)}).to_string();
    let (status, head, text) = server.request("POST", "/v1/act", &[], &body);
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(answer["arm"], "fp32", "{text}");
    assert!(head.to_lowercase().contains("x-qforge-arm: fp32"), "{head}");
    // A client reports the episode under the arm its answers named.
    let (status, v) = server.post(
        "/v1/feedback",
        &["X-Session-Id: episode-1"],
        r#"{"reward": 200, "arm": "fp32"}"#,
    );
    assert_eq!(status, 200, "{v}");
}

/// Sends `request` (head and body, as written) and reads the answer.
fn raw(server: &Server, request: &str) -> String {
    let mut stream = server.connect();
    stream.write_all(request.as_bytes()).unwrap();
    read_until_closed(&mut stream, request)
}

#[test]
fn a_web_page_cannot_drive_a_server_without_a_token() {
    let act = r#"{"observations": [[0, 0.1, 0, -0.1]]}"#;
    let post = |target: &str, headers: &str, body: &str| {
        format!(
            "POST {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    let open = Server::start(&cartpole(), &[], None);
    // What a page's form or `fetch` of a string posts without a preflight.
    for kind in [
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
    ] {
        let answer = raw(
            &open,
            &post("/v1/act", &format!("Content-Type: {kind}\r\n"), act),
        );
        assert!(answer.starts_with("HTTP/1.1 415"), "{kind}: {answer}");
        assert!(
            answer.contains("send Content-Type: application/json"),
            "{answer}"
        );
    }
    // A page's script sending JSON carries its Origin.
    let page = "Origin: https://attacker.example\r\nContent-Type: application/json\r\n";
    for (target, body) in [("/v1/act", act), ("/v1/feedback", r#"{"reward": 0}"#)] {
        let answer = raw(&open, &post(target, page, body));
        assert!(answer.starts_with("HTTP/1.1 403"), "{target}: {answer}");
        assert!(answer.contains("QFORGE_SERVE_TOKEN"), "{answer}");
    }
    let local = "Origin: http://127.0.0.1:5173\r\nContent-Type: application/json\r\n";
    assert!(raw(&open, &post("/v1/act", local, act)).starts_with("HTTP/1.1 200"));
    // With a token a page has nothing to send: any Origin that has the
    // token is served, and the content type is still checked.
    let guarded = Server::start(&cartpole(), &[], Some("s3cret"));
    let bearer = "Authorization: Bearer s3cret\r\n";
    let answer = raw(&guarded, &post("/v1/act", &format!("{bearer}{page}"), act));
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let plain = format!("{bearer}Content-Type: text/plain\r\n");
    assert!(raw(&guarded, &post("/v1/act", &plain, act)).starts_with("HTTP/1.1 415"));
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

/// Every observation of the CartPole rollouts.
fn all_observations() -> Vec<Vec<f64>> {
    let text = std::fs::read_to_string(path("fixtures/policies/cartpole/rollouts.jsonl")).unwrap();
    text.lines()
        .flat_map(|line| {
            let episode: Value = serde_json::from_str(line).unwrap();
            episode["observations"]
                .as_array()
                .unwrap()
                .iter()
                .map(|row| {
                    row.as_array()
                        .unwrap()
                        .iter()
                        .map(|v| v.as_f64().unwrap())
                        .collect()
                })
                .collect::<Vec<Vec<f64>>>()
        })
        .collect()
}

/// A weight sync without a restart: `POST /admin/reload` swaps the served
/// artifact between batches. Every `/v1/act` answer names the version that
/// computed it and is exactly what `qforge act` gives on that version's
/// artifact, also for requests racing the swap. A reload needs the token,
/// an artifact that acts like the served one and a loadable directory;
/// anything else is refused and the served version stays.
#[test]
fn reload_swaps_the_policy_between_batches_and_every_answer_names_its_version() {
    let dir = support::temp("serve", "reload");
    let dir = dir.path();
    // Version 1: the default (smoothed) artifact; version 2: plain static.
    json(&qforge_in(dir, &["quantize", "--json"]));
    json(&qforge_in(
        dir,
        &["quantize", "--no-method-search", "-o", "plain", "--json"],
    ));
    // Rows on which the two artifacts act differently, so the answers tell
    // the versions apart.
    let rows = all_observations();
    let (old, new) = (
        qforge_act(dir, "qforge-out", &rows),
        qforge_act(dir, "plain", &rows),
    );
    let differing: Vec<Vec<f64>> = rows
        .iter()
        .enumerate()
        .filter(|(i, _)| old[*i] != new[*i])
        .map(|(_, row)| row.clone())
        .collect();
    assert!(
        !differing.is_empty(),
        "the two artifacts act alike everywhere"
    );
    let expected = |version: u64| {
        let model = if version == 1 { "qforge-out" } else { "plain" };
        qforge_act(dir, model, &differing)
    };
    let (v1, v2) = (expected(1), expected(2));
    assert_ne!(v1, v2);

    let token = "sync-token";
    let auth = format!("Authorization: Bearer {token}");
    let server = Server::start(&dir.join("qforge-out"), &[], Some(token));
    let body = serde_json::json!({ "observations": differing }).to_string();
    let act = |server: &Server| -> (u64, Value) {
        let (status, headers, text) = server.request("POST", "/v1/act", &[&auth], &body);
        assert_eq!(status, 200, "{text}");
        let version = model_version(&headers);
        let answer: Value = serde_json::from_str(&text).unwrap();
        (version, answer["actions"].clone())
    };
    assert_eq!(act(&server), (1, v1.clone()));

    let reload = |model: &str, headers: &[&str]| {
        let body = serde_json::json!({ "model": dir.join(model) }).to_string();
        server.request("POST", "/admin/reload", headers, &body)
    };
    assert_eq!(reload("plain", &[]).0, 401);
    let (status, _, text) = reload("missing", &[&auth]);
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("is not a qforge artifact"), "{text}");
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
    let (status, _, text) = reload("pendulum", &[&auth]);
    assert_eq!(status, 409, "{text}");
    assert!(text.contains("not swapped in"), "{text}");
    assert_eq!(act(&server), (1, v1.clone()));

    // Requests racing the swap: each answer is its version's.
    let racing: Vec<(u64, Value)> = std::thread::scope(|scope| {
        let clients: Vec<_> = (0..4)
            .map(|_| scope.spawn(|| (0..10).map(|_| act(&server)).collect::<Vec<_>>()))
            .collect();
        let (status, _, text) = reload("plain", &[&auth]);
        assert_eq!(status, 200, "{text}");
        let answer: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(answer["version"], 2);
        clients
            .into_iter()
            .flat_map(|c| c.join().unwrap())
            .collect()
    });
    for (version, actions) in &racing {
        assert_eq!(
            actions,
            if *version == 1 { &v1 } else { &v2 },
            "version {version}"
        );
    }
    assert_eq!(act(&server), (2, v2.clone()));
    let (_, _, metrics) = server.request("GET", "/metrics", &[&auth], "");
    assert!(metrics.contains("qforge_model_version 2"), "{metrics}");
    assert!(
        metrics.contains(r#"qforge_reloads_total{outcome="swapped"} 1"#),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"qforge_reloads_total{outcome="refused"} 2"#),
        "{metrics}"
    );

    // The published contract lists the operation only where it can succeed.
    let listed = |server: &Server, headers: &[&str]| {
        let (_, _, doc) = server.request("GET", "/openapi.json", headers, "");
        let doc: Value = serde_json::from_str(&doc).unwrap();
        doc["paths"].get("/admin/reload").is_some()
    };
    assert!(listed(&server, &[&auth]));
    // A server without a token takes no reload.
    let open = Server::start(&dir.join("qforge-out"), &[], None);
    assert!(!listed(&open, &[]));
    let body = serde_json::json!({ "model": dir.join("plain") }).to_string();
    let (status, _, text) = open.request("POST", "/admin/reload", &[], &body);
    assert_eq!(status, 403, "{text}");
}
