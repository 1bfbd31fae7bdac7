//! The corpus replay the crates' `fuzz_corpus_replay.rs` tests run: every
//! file of `fuzz/corpus/<target>/` through the target's check, on stable
//! and without a fuzzing engine. Uses `std` only, so each test can include
//! it beside its own checks.

use std::path::PathBuf;

/// Every file of `fuzz/corpus/<target>/`, sorted; fails if there are none,
/// so a moved or emptied corpus cannot make the test pass vacuously.
fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target);
    let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| {
        panic!(
            "fuzz corpus {} is missing ({e}); see fuzz/README.md",
            dir.display()
        )
    });
    let mut paths: Vec<PathBuf> = entries
        .map(|e| e.expect("readable corpus directory").path())
        .filter(|p| p.is_file())
        .collect();
    paths.sort();
    assert!(!paths.is_empty(), "fuzz corpus {} is empty", dir.display());
    paths
        .into_iter()
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p, bytes)
        })
        .collect()
}

/// Runs `check` on every input of `target`'s corpus; fails naming every
/// input whose check panicked (each panic's own message is printed above).
pub fn replay(target: &str, check: fn(&[u8])) {
    let inputs = corpus(target);
    let failed: Vec<&PathBuf> = inputs
        .iter()
        .filter(|(_, bytes)| std::panic::catch_unwind(|| check(bytes)).is_err())
        .map(|(path, _)| path)
        .collect();
    assert!(
        failed.is_empty(),
        "{} of {} {target} corpus inputs fail the fuzz target's checks: {failed:#?}\n\
         reproduce one with `cargo fuzz run {target} <file>` in fuzz/",
        failed.len(),
        inputs.len()
    );
    println!("{target}: replayed {} inputs", inputs.len());
}
