//! Loading files qforge did not write, or that changed since it wrote them:
//! only regular files are read and JSON is read only up to a limit. (A FIFO
//! blocks the process that opens it, so the FIFO cases run the CLI as a
//! child with a deadline: `crates/cli/tests/loading.rs`.)

use std::path::{Path, PathBuf};

use qforge_model::MlpPolicy;
use qforge_model::files::MAX_CONFIG_BYTES;

/// A scratch directory, removed when dropped.
fn fresh_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("qforge-loading-{name}-"))
        .tempdir()
        .unwrap()
}

fn fixture(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path)
}

/// A copy of the CartPole policy directory in `dir`.
fn cartpole_copy(dir: &Path) {
    for file in ["policy.json", "model.safetensors"] {
        std::fs::copy(
            fixture("fixtures/policies/cartpole").join(file),
            dir.join(file),
        )
        .unwrap();
    }
}

#[test]
fn a_json_file_over_the_limit_is_refused_before_it_is_read() {
    let dir = fresh_dir("large-json");
    let dir = dir.path();
    cartpole_copy(dir);
    // Sparse: a file of the size costs no disk, and before the limit it was
    // read whole (64 MiB of zeros) to fail in the JSON parser instead.
    let file = std::fs::File::create(dir.join("policy.json")).unwrap();
    file.set_len(MAX_CONFIG_BYTES + 1).unwrap();
    let error = MlpPolicy::from_dir(dir).unwrap_err().to_string();
    assert!(
        error.contains("policy.json is larger than 64 MiB"),
        "{error}"
    );
    let error = qforge_model::open(dir).unwrap_err().to_string();
    assert!(error.contains("larger than 64 MiB"), "{error}");
}

#[test]
fn only_regular_files_are_read() {
    let dir = fresh_dir("not-regular");
    let dir = dir.path();
    cartpole_copy(dir);
    // A directory where the weights should be: named as such, not "Is a
    // directory (os error 21)" from the read.
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    std::fs::create_dir(dir.join("model.safetensors")).unwrap();
    let error = MlpPolicy::from_dir(dir).unwrap_err().to_string();
    assert!(
        error.contains(
            "model.safetensors is a directory; qforge reads models only from regular files"
        ),
        "{error}"
    );
}
