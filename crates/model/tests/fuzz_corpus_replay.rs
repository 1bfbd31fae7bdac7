//! Replays the fuzz corpora of `qforge-model`'s parsers
//! (`fuzz/corpus/{gguf_header,onnx_import,policy,hf_config}/`) through the
//! fuzz targets' own checks, on stable and without a fuzzing engine, so every
//! input the fuzzers ever kept stays a regression test.

#[path = "../../../fuzz/src/model.rs"]
mod checks;
#[path = "../../../fuzz/replay.rs"]
mod replay;

use replay::replay;

#[test]
fn gguf_header_corpus_replays_cleanly() {
    replay("gguf_header", checks::gguf_header);
}

#[test]
fn onnx_import_corpus_replays_cleanly() {
    replay("onnx_import", checks::onnx_import);
}

#[test]
fn policy_corpus_replays_cleanly() {
    replay("policy", checks::policy);
}

#[test]
fn hf_config_corpus_replays_cleanly() {
    replay("hf_config", checks::hf_config);
}
