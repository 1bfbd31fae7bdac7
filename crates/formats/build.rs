//! Generates the Rust types of qforge's ONNX subset (`proto/onnx.proto`).
//!
//! protox compiles the proto in pure Rust, so building needs no `protoc`;
//! prost-build turns the descriptors into `$OUT_DIR/onnx.rs`, which
//! `src/onnx/mod.rs` includes.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/onnx.proto");
    let descriptors = protox::compile(["proto/onnx.proto"], ["proto"])?;
    prost_build::Config::new().compile_fds(descriptors)?;
    Ok(())
}
