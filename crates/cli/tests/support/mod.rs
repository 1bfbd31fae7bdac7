//! Helpers the CLI test files share: fixture paths, running `qforge`, JSON
//! output, scratch directories.

#![allow(dead_code)] // each test file uses its own subset

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::Value;

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A path under the repository root, as an argument.
pub fn path(relative: &str) -> String {
    root().join(relative).to_string_lossy().into_owned()
}

/// Runs `qforge` with `args` in the current directory.
pub fn qforge(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_qforge"))
        .args(args)
        .output()
        .expect("run qforge")
}

/// Runs `qforge` with `args` in `dir`.
pub fn qforge_in(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_qforge"))
        .current_dir(dir)
        .args(args)
        .output()
        .expect("run qforge")
}

/// How long [`bounded`] waits: long enough for any command the tests run
/// this way on a loaded CI machine (each takes well under a second when it
/// works).
pub const DEADLINE: Duration = Duration::from_secs(120);

/// Runs `command` to completion, or kills it at [`DEADLINE`] and fails the
/// test, naming what it ran.
pub fn bounded(mut command: Command, what: &str) -> Output {
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
pub fn qforge_bounded(args: &[&str]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_qforge"));
    command.args(args);
    bounded(command, &format!("qforge {}", args.join(" ")))
}

/// The JSON a successful run printed.
pub fn json(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "qforge failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}

/// A fresh scratch directory, removed with everything in it when dropped
/// (artifacts of SmolLM2 are hundreds of MB each; CI's disk is shared).
pub fn temp(prefix: &str, name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("qforge-{prefix}-{name}-"))
        .tempdir()
        .expect("create a scratch directory")
}
