//! Helpers the CLI test files share: fixture paths, running `qforge`, JSON
//! output, scratch directories.

#![allow(dead_code)] // each test file uses its own subset

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

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
