//! Fuzz target `qstats_decode`: see `qforge_fuzz::qstats::qstats_decode` for what it checks.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| qforge_fuzz::qstats::qstats_decode(data));
