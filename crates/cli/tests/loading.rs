//! What `qforge` loads: only regular files (a FIFO or `/dev/zero` in place of
//! a model file is refused, not waited on or read forever).
//!
//! A loader that blocks would block the test with it, so every run here is a
//! child process with a deadline ([`qforge_bounded`]): a regression fails
//! the test instead of hanging CI.

mod support;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

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
    // Under a 4 GiB address-space limit, so that without the check the
    // read ends in a failed allocation, not in the machine's memory.
    let mut command = Command::new("sh");
    command
        .arg("-c")
        .arg(r#"ulimit -v 4194304 && exec "$0" "$@""#)
        .arg(env!("CARGO_BIN_EXE_qforge"))
        .args(["act", "--model"])
        .arg(policy)
        .arg("--observations")
        .arg(path("fixtures/policies/cartpole/rollouts.jsonl"));
    let act = bounded(command, "qforge act on a policy.json linked to /dev/zero");
    fails_with(&act, "policy.json is a character device");
}
