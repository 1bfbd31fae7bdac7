//! Replays the `qstats_decode` fuzz corpus (`fuzz/corpus/qstats_decode/`)
//! through the fuzz target's own checks, on stable and without a fuzzing
//! engine, so every input the fuzzer ever kept stays a regression test.

#[path = "../../../fuzz/src/qstats.rs"]
mod checks;
#[path = "../../../fuzz/replay.rs"]
mod replay;

#[test]
fn qstats_decode_corpus_replays_cleanly() {
    replay::replay("qstats_decode", checks::qstats_decode);
}
