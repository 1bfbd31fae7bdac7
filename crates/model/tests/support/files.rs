//! Paths and scratch directories the model crate's tests share.

#![allow(dead_code)] // each test file uses its own subset

use std::path::{Path, PathBuf};

/// A scratch directory named for the test file and `name`, removed when
/// dropped.
pub fn fresh_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("qforge-{}-{name}-", env!("CARGO_CRATE_NAME")))
        .tempdir()
        .unwrap()
}

/// `path` under the repository root.
pub fn fixture(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path)
}
