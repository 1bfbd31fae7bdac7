//! `qforge serve` of a policy: `/v1/act` answers what `qforge act`
//! computes, batching concurrent requests, with log-probabilities and
//! seeded samples; A/B and shadow rollouts, reward feedback and rollback;
//! the drift monitor; hot reload between batches.

#[path = "support/server.rs"]
mod server;
mod support;

use std::path::Path;
use std::process::Command;

use serde_json::Value;
use server::{Server, cartpole, model_version, wait_until};
use support::{json, path, qforge_in};

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
        // The engine's limits are checked with the others, before any
        // model is read.
        (vec!["--kv-budget-tokens", "1"], "KV budget of at least 2"),
        (vec!["--engine-threads", "0"], "at least 1 thread"),
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
