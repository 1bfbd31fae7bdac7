//! The checks behind qforge's fuzz targets, one function per target.
//!
//! The fuzz targets (`fuzz_targets/*.rs`) call these on libFuzzer's inputs;
//! the corpus-replay tests of `qforge-core` and `qforge-model`
//! (`crates/*/tests/fuzz_corpus_replay.rs`) include the same files with
//! `#[path]` and call them on every file of `fuzz/corpus/<target>/`, so CI
//! replays the corpora on stable with exactly the fuzzers' assertions
//! (the loop over a corpus is `fuzz/replay.rs`, which they include too:
//! it is not part of this crate, whose targets never read the corpus).
//! Each module uses only its crate and the crates below it, so each test
//! can include just its own.

pub mod model;
pub mod qstats;
