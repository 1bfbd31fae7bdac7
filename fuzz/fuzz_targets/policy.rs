//! Fuzz target `policy`: see `qforge_fuzz::model::policy` for what it checks.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| qforge_fuzz::model::policy(data));
