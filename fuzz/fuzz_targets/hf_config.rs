//! Fuzz target `hf_config`: see `qforge_fuzz::model::hf_config` for what it checks.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| qforge_fuzz::model::hf_config(data));
