//! What `qforge` loads: only regular files (a FIFO or `/dev/zero` in place of
//! a model file is refused, not waited on or read forever), and an artifact
//! only as its manifest says it was written, whichever command loads it.
//!
//! A loader that blocks would block the test with it, so every run here is a
//! child process with a deadline ([`qforge_bounded`]): a regression fails
//! the test instead of hanging CI.

mod support;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;

use qforge_formats::manifest::write_manifest;
use qforge_model::MlpPolicy;
use qforge_model::artifact::{LayerPrecision, write_policy};

use support::{DEADLINE, bounded, path, qforge_bounded, root};

/// Asserts that `out` failed with exit code 1 and a message containing
/// `expected`; returns stderr.
fn fails_with(out: &Output, expected: &str) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(expected),
        "expected {expected:?} in: {stderr}"
    );
    stderr
}

fn scratch(name: &str) -> tempfile::TempDir {
    support::temp("loading", name)
}

/// A copy of the CartPole policy directory in `dir`.
fn cartpole_copy(dir: &Path) {
    for file in ["policy.json", "model.safetensors"] {
        std::fs::copy(
            root().join("fixtures/policies/cartpole").join(file),
            dir.join(file),
        )
        .unwrap();
    }
}

/// The CartPole policy written as an artifact into `dir`, as `quantize`
/// writes one (every layer int8-dynamic), with its manifest. Written through
/// the library so that the test does not depend on the guard's verdict on
/// this CPU.
fn cartpole_artifact(dir: &Path) {
    let policy = MlpPolicy::from_dir(&root().join("fixtures/policies/cartpole")).unwrap();
    let points: BTreeMap<String, LayerPrecision> = policy
        .linears()
        .iter()
        .map(|(_, point, _)| (point.clone(), LayerPrecision::Int8Dynamic))
        .collect();
    write_policy(dir, &policy, &points).unwrap();
    write_manifest(dir, serde_json::json!({"test": true})).unwrap();
}

/// `qforge args… dir` under a 4 GiB address-space limit, so that a read
/// that never ends fails an allocation instead of filling the machine.
fn with_memory_limit(args: &[&str], dir: &Path) -> Output {
    let mut command = Command::new("sh");
    command
        .arg("-c")
        .arg(r#"ulimit -v 4194304 && exec "$0" "$@""#)
        .arg(env!("CARGO_BIN_EXE_qforge"))
        .args(args)
        .arg(dir);
    bounded(
        command,
        &format!("qforge {} under a memory limit", args.join(" ")),
    )
}

/// `qforge act` on the policy `dir` under [`with_memory_limit`].
fn act_with_memory_limit(dir: &Path) -> Output {
    let observations = path("fixtures/policies/cartpole/rollouts.jsonl");
    with_memory_limit(&["act", "--observations", &observations, "--model"], dir)
}

fn mkfifo(path: &Path) {
    let name = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o644) }, 0, "mkfifo");
}

#[test]
fn a_fifo_in_place_of_the_weights_is_refused_not_waited_on() {
    let dir = scratch("fifo");
    let policy = dir.path().join("policy");
    std::fs::create_dir(&policy).unwrap();
    cartpole_copy(&policy);
    std::fs::remove_file(policy.join("model.safetensors")).unwrap();
    mkfifo(&policy.join("model.safetensors"));
    let model = policy.to_string_lossy().into_owned();
    let observations = path("fixtures/policies/cartpole/rollouts.jsonl");
    let act = qforge_bounded(&["act", "--model", &model, "--observations", &observations]);
    fails_with(&act, "model.safetensors is a FIFO");
    // `serve` loads before it binds: it exits instead of blocking forever.
    let serve = qforge_bounded(&["serve", "--model", &model, "--addr", "127.0.0.1:0"]);
    fails_with(&serve, "model.safetensors is a FIFO");
}

#[test]
fn files_linked_to_dev_zero_are_refused_not_read_until_memory_runs_out() {
    // A shard index linked to /dev/zero was read until the allocation
    // failed ("out of memory", or the machine's memory without a limit).
    let dir = scratch("dev-zero");
    let hf = dir.path().join("hf");
    std::fs::create_dir(&hf).unwrap();
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 10
    });
    std::fs::write(hf.join("config.json"), config.to_string()).unwrap();
    std::os::unix::fs::symlink("/dev/zero", hf.join("model.safetensors.index.json")).unwrap();
    let generate = with_memory_limit(&["generate", "--prompt", "hi", "--model"], &hf);
    fails_with(
        &generate,
        "model.safetensors.index.json is a character device",
    );
    // A policy.json linked to /dev/zero: the directory was "neither a policy
    // directory nor …", now the file is named for what it is.
    let policy = dir.path().join("policy");
    std::fs::create_dir(&policy).unwrap();
    cartpole_copy(&policy);
    std::fs::remove_file(policy.join("policy.json")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", policy.join("policy.json")).unwrap();
    let act = act_with_memory_limit(&policy);
    fails_with(&act, "policy.json is a character device");
}

#[test]
fn a_changed_artifact_is_refused_by_every_command_that_loads_it() {
    let dir = scratch("tampered");
    let artifact = dir.path().join("artifact");
    std::fs::create_dir(&artifact).unwrap();
    cartpole_artifact(&artifact);
    let model = artifact.to_string_lossy().into_owned();
    let observations = path("fixtures/policies/cartpole/rollouts.jsonl");
    let reference = path("fixtures/policies/cartpole");
    let act = ["act", "--model", &model, "--observations", &observations];
    assert!(qforge_bounded(&act).status.success());
    // One flipped weight byte: before, every command loaded it and served
    // the changed weights (`serve` answered 200).
    let weights = artifact.join("model.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x10;
    std::fs::write(&weights, &bytes).unwrap();
    let agreement = [
        "eval",
        "agreement",
        "--model",
        &model,
        "--reference",
        &reference,
        "--observations",
        &observations,
    ];
    let serve = ["serve", "--model", &model, "--addr", "127.0.0.1:0"];
    let fingerprint = ["fingerprint", "--model", &model];
    for args in [&act[..], &agreement, &serve, &fingerprint] {
        fails_with(&qforge_bounded(args), "model.safetensors changed");
    }
}

#[test]
fn an_artifact_whose_policy_json_links_to_dev_zero_is_refused() {
    let dir = scratch("artifact-dev-zero");
    let artifact = dir.path();
    cartpole_artifact(artifact);
    std::fs::remove_file(artifact.join("policy.json")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", artifact.join("policy.json")).unwrap();
    // Before, the artifact was taken for a language model's ("holds a
    // Policy artifact, not a LanguageModel one").
    let act = act_with_memory_limit(artifact);
    fails_with(&act, "policy.json, which resolves to /dev/zero, outside");
}

/// `qforge act --json` on `model`: its actions.
fn actions(model: &str) -> serde_json::Value {
    let observations = path("fixtures/policies/cartpole/rollouts.jsonl");
    let out = qforge_bounded(&[
        "act",
        "--model",
        model,
        "--observations",
        &observations,
        "--json",
    ]);
    support::json(&out)["actions"].clone()
}

/// Starts `qforge serve` on `model` and waits (at most [`DEADLINE`]) for it
/// to listen; returns what it printed until then. The server is killed.
fn serve_until_listening(model: &str) -> String {
    let mut child = Command::new(env!("CARGO_BIN_EXE_qforge"))
        .args(["serve", "--model", model, "--addr", "127.0.0.1:0"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run qforge serve");
    let stderr = child.stderr.take().unwrap();
    let (line_tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr).lines() {
            if line_tx.send(line.unwrap_or_default()).is_err() {
                break;
            }
        }
    });
    let deadline = std::time::Instant::now() + DEADLINE;
    let mut seen = String::new();
    let listening = loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => {
                seen.push_str(&line);
                seen.push('\n');
                if line.contains("http://") {
                    break true;
                }
            }
            Err(_) => break false,
        }
    };
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(listening, "qforge serve did not listen: {seen}");
    seen
}

#[test]
fn an_onnx_policy_loads_wherever_a_policy_directory_does() {
    let dir = scratch("onnx");
    let dir = dir.path();
    let onnx = dir.join("cartpole.onnx");
    std::fs::copy(root().join("fixtures/onnx/cartpole_sb3.onnx"), &onnx).unwrap();
    let model = onnx.to_string_lossy().into_owned();
    let observations = path("fixtures/policies/cartpole/rollouts.jsonl");
    // The graph ends in raw outputs: what they mean has to be written down,
    // and the error says where and how. Before, every command refused any
    // .onnx file ("import it with qforge_model::onnx::import_mlp").
    let act = qforge_bounded(&["act", "--model", &model, "--observations", &observations]);
    let stderr = fails_with(&act, "cartpole.policy.json");
    assert!(
        stderr.contains(r#"{"head": {"kind": "discrete", "actions": 2}}"#),
        "{stderr}"
    );
    std::fs::write(
        dir.join("cartpole.policy.json"),
        r#"{"head": {"kind": "discrete", "actions": 2}, "env": "CartPole-v1"}"#,
    )
    .unwrap();
    // The Stable-Baselines3 export holds the trained CartPole weights.
    let fp = actions(&path("fixtures/policies/cartpole"));
    assert_eq!(actions(&model), fp);
    let stats = dir.join("cartpole.qstats").to_string_lossy().into_owned();
    let calibrate = [
        "calibrate",
        "--model",
        &model,
        "--data",
        &observations,
        "-o",
        &stats,
    ];
    assert!(qforge_bounded(&calibrate).status.success());
    let artifact = dir.join("int8").to_string_lossy().into_owned();
    let quantize = [
        "quantize",
        "--model",
        &model,
        "--data",
        &observations,
        "--min-agreement",
        "0",
        "-o",
        &artifact,
    ];
    let out = qforge_bounded(&quantize);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let int8 = actions(&artifact);
    assert_eq!(int8.as_array().unwrap().len(), fp.as_array().unwrap().len());
    serve_until_listening(&model);

    // A final Softmax says the head is discrete: no head file needed.
    let softmax = dir.join("mixed.onnx");
    std::fs::copy(
        root().join("fixtures/onnx/relu_cartpole_mixed.onnx"),
        &softmax,
    )
    .unwrap();
    assert!(actions(&softmax.to_string_lossy()).is_array());
}

#[test]
fn an_error_is_printed_once() {
    let dir = scratch("printed-once");
    let policy = dir.path();
    cartpole_copy(policy);
    std::fs::remove_file(policy.join("model.safetensors")).unwrap();
    let out = qforge_bounded(&[
        "act",
        "--model",
        &policy.to_string_lossy(),
        "--observations",
        &path("fixtures/policies/cartpole/rollouts.jsonl"),
    ]);
    // It read "…/model.safetensors: No such file or directory (os error 2):
    // No such file or directory (os error 2)".
    let stderr = fails_with(&out, "model.safetensors: No such file or directory");
    assert_eq!(
        stderr.matches("No such file or directory").count(),
        1,
        "{stderr}"
    );
}
