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
    for (path, bytes) in &inputs {
        // A failing input is named before the assertion's own message.
        eprintln!("replaying {}", path.display());
        checks::qstats_decode(bytes);
    }
    println!("qstats_decode: replayed {} inputs", inputs.len());
}
