//! Fuzz target `onnx_import`: see `qforge_fuzz::model::onnx_import` for what it checks.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| qforge_fuzz::model::onnx_import(data));
