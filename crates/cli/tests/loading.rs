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
use std::time::Duration;

use qforge_model::MlpPolicy;
use qforge_model::artifact::{LayerPrecision, write_policy};
use qforge_model::manifest::write_manifest;

use support::{path, root};

/// Long enough for any of these commands on a loaded CI machine; they take
/// well under a second when they work.
const DEADLINE: Duration = Duration::from_secs(120);

/// Runs `command` to completion, or kills it at [`DEADLINE`] and fails the
/// test, naming what it ran.
fn bounded(mut command: Command, what: &str) -> Output {
    let child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run qforge");
    let pid = child.id();
    let (done, finished) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(child.wait_with_output());
    });
    match finished.recv_timeout(DEADLINE) {
        Ok(output) => output.expect("wait for qforge"),
        Err(_) => {
            // The child is not reaped until `wait_with_output` returns, so
            // the pid is still ours to kill.
            // SAFETY: kill(2) on a pid we spawned; no memory is involved.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            let output = finished.recv().expect("the waiting thread reports");
            let stderr = output.map(|o| o.stderr).unwrap_or_default();
            panic!(
                "{what} did not finish within {DEADLINE:?} (killed); stderr: {}",
                String::from_utf8_lossy(&stderr)
            );
        }
    }
}

/// `qforge args…` under [`bounded`].
fn qforge_bounded(args: &[&str]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_qforge"));
    command.args(args);
    bounded(command, &format!("qforge {}", args.join(" ")))
}

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

/// `qforge act` on `dir` under a 4 GiB address-space limit, so that a read
/// that never ends fails an allocation instead of filling the machine.
fn act_with_memory_limit(dir: &Path) -> Output {
    let mut command = Command::new("sh");
    command
        .arg("-c")
        .arg(r#"ulimit -v 4194304 && exec "$0" "$@""#)
        .arg(env!("CARGO_BIN_EXE_qforge"))
        .args(["act", "--model"])
        .arg(dir)
        .arg("--observations")
        .arg(path("fixtures/policies/cartpole/rollouts.jsonl"));
    bounded(command, "qforge act under a memory limit")
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
fn a_policy_json_linked_to_dev_zero_is_refused_not_read_until_memory_runs_out() {
    let dir = scratch("dev-zero");
    let policy = dir.path();
    cartpole_copy(policy);
    std::fs::remove_file(policy.join("policy.json")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", policy.join("policy.json")).unwrap();
    let act = act_with_memory_limit(policy);
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
    // Before, the loader read /dev/zero until the allocation failed.
    let act = act_with_memory_limit(artifact);
    fails_with(&act, "policy.json, which resolves to /dev/zero, outside");
}
