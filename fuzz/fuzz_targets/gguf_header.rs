//! Fuzz target `gguf_header`: see `qforge_fuzz::model::gguf_header` for what it checks.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| qforge_fuzz::model::gguf_header(data));
