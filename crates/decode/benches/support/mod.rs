//! What the decoder's benches share.

use std::path::PathBuf;

use qforge_model::{Activations, Llama};

/// SmolLM2-135M-Instruct as the GGUF holds it.
pub fn smollm2() -> Llama {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/smollm2-135m-instruct-q4_1.gguf");
    assert!(
        path.exists(),
        "{} missing: run scripts/fetch-models.sh",
        path.display()
    );
    Llama::from_gguf(&path).expect("load SmolLM2")
}

/// `model` with every linear layer on the INT8 engine, activations
/// quantized per token.
pub fn int8(model: &Llama) -> Llama {
    model
        .with_linears(|_, layer| layer.to_int8(Activations::Dynamic))
        .expect("INT8 conversion")
}
