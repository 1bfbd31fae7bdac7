//! Replays the `qstats_decode` fuzz corpus (`fuzz/corpus/qstats_decode/`)
//! through the fuzz target's own checks, on stable and without a fuzzing
//! engine, so every input the fuzzer ever kept stays a regression test.

use std::path::PathBuf;

#[path = "../../../fuzz/src/qstats.rs"]
mod checks;

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

#[test]
fn qstats_decode_corpus_replays_cleanly() {
    let inputs = corpus("qstats_decode");
    // Each panic's own message is printed above the list of failed inputs.
    let failed: Vec<&PathBuf> = inputs
        .iter()
        .filter(|(_, bytes)| std::panic::catch_unwind(|| checks::qstats_decode(bytes)).is_err())
        .map(|(path, _)| path)
        .collect();
    assert!(
        failed.is_empty(),
        "{} of {} qstats_decode corpus inputs fail the fuzz target's checks: {failed:#?}\n\
         reproduce one with `cargo fuzz run qstats_decode <file>` in fuzz/",
        failed.len(),
        inputs.len()
    );
    println!("qstats_decode: replayed {} inputs", inputs.len());
}
