//! Our full-precision forward against candle-transformers' quantized Llama on
//! SmolLM2-135M-Instruct, with candle told to dequantize every weight to f32
//! (`CANDLE_DEQUANTIZE_ALL=1`; otherwise it multiplies Q4_1 weights with Q8_1
//! activations). The two share no model code: candle keeps GGUF's permuted
//! q/k layout with interleaved rotary embeddings, we un-permute to Hugging
//! Face layout and rotate halves, so this also checks the un-permutation.

use std::path::PathBuf;

use candle_core::{Device, Tensor};
use qforge_model::{Llama, Logits, Residency};

/// The SmolLM2 fixture; fails (never skips) when it is missing.
pub fn smollm2_path() -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/smollm2-135m-instruct-q4_1.gguf");
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-models.sh (scripts/test.sh does)",
        path.display()
    );
    path
}

#[test]
fn logits_match_candle_transformers_within_1e_3() {
    // SAFETY: this test binary has this single test, and the variable is set
    // before any thread that could read the environment is started.
    unsafe { std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1") };
    let path = smollm2_path();
    let ours = Llama::from_gguf(&path).unwrap();
    // Weights kept quantized and dequantized per forward give the same bits.
    let stored = Llama::from_gguf_with(&path, Residency::Stored).unwrap();
    // Q4_1 decoder weights (5 bits a weight) next to the f32 tied lm_head.
    assert!(stored.linear_weight_bytes() * 2 < ours.linear_weight_bytes());

    let mut file = std::fs::File::open(&path).unwrap();
    let content = candle_core::quantized::gguf_file::Content::read(&mut file).unwrap();
    let mut theirs = candle_transformers::models::quantized_llama::ModelWeights::from_gguf(
        content,
        &mut file,
        &Device::Cpu,
    )
    .unwrap();

    let prompts: [&[u32]; 3] = [
        &[1, 9690, 198, 2683, 359, 253, 5356, 5646],
        &[504, 3458, 282, 4649, 314, 2],
        &[
            28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47,
        ],
    ];
    for prompt in prompts {
        let expected = theirs
            .forward(
                &Tensor::new(prompt, &Device::Cpu)
                    .unwrap()
                    .unsqueeze(0)
                    .unwrap(),
                0,
            )
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        theirs.clear_kv_cache();
        let got = ours
            .forward(&[prompt.to_vec()], None, None, Logits::Last)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(got.len(), expected.len());
        let from_stored = stored
            .forward(&[prompt.to_vec()], None, None, Logits::Last)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(from_stored, got, "stored residency changes no bit");
        let max_diff = got
            .iter()
            .zip(&expected)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        println!(
            "prompt of {} tokens: max |Δlogit| = {max_diff:e}",
            prompt.len()
        );
        assert!(max_diff < 1e-3, "max |Δlogit| {max_diff} for {prompt:?}");
    }
}

/// SmolLM2 on the INT8 engine: linear weights (lm_head included) take at
/// most 27 % of their f32 bytes, and the logits stay close to f32's.
#[test]
fn int8_linear_weights_take_a_quarter_of_f32_and_logits_stay_close() {
    let fp = Llama::from_gguf_with(&smollm2_path(), Residency::Dequantized).unwrap();
    let int8 = fp
        .with_linears(|_, layer| layer.to_int8(qforge_model::Activations::Dynamic))
        .unwrap();
    let ratio = int8.linear_weight_bytes() as f64 / fp.linear_weight_bytes() as f64;
    eprintln!("INT8 linear weights: {:.1} % of f32", 100.0 * ratio);
    assert!(ratio <= 0.27, "{ratio}");
    let tokens: Vec<u32> = (0..48).map(|i| 100 + 37 * i).collect();
    let logits = |model: &Llama| {
        model
            .forward(std::slice::from_ref(&tokens), None, None, Logits::All)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    let (a, b) = (logits(&fp), logits(&int8));
    let signal: f64 = a.iter().map(|v| f64::from(*v).powi(2)).sum();
    let noise: f64 = a
        .iter()
        .zip(&b)
        .map(|(x, y)| f64::from(x - y).powi(2))
        .sum();
    let sqnr = 10.0 * (signal / noise).log10();
    eprintln!("INT8 logits SQNR vs f32: {sqnr:.1} dB");
    assert!(sqnr > 15.0, "{sqnr}");
}
