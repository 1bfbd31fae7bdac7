//! What the decoder's tests and benches share: SmolLM2 loaded, a model on
//! the INT8 engine, a cache prefilled by the tensor forward.

#![allow(dead_code)] // each test file and bench uses its own subset

use std::path::PathBuf;

use qforge_model::{Activations, KvCache, Llama, Logits};

/// SmolLM2-135M-Instruct, its weights dequantized to f32 at load.
pub fn smollm2() -> Llama {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/smollm2-135m-instruct-q4_1.gguf");
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-models.sh (scripts/test.sh does)",
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

/// A cache holding `prompt`, filled by `model`'s tensor forward (the
/// decoder's reference).
pub fn prefilled_cache(model: &Llama, prompt: &[u32]) -> KvCache {
    let mut cache = model.new_cache();
    model
        .forward(&[prompt.to_vec()], Some(&mut cache), None, Logits::Last)
        .expect("the tensor forward's prefill");
    cache
}
