//! The Llama forward on a small random model in a Hugging Face directory
//! against candle-transformers' Llama and Qwen2 (peers with their own code),
//! and bf16 weights kept as stored: the peer's logits, their f32 widening's,
//! and an artifact's.

#[path = "support/tiny_llama.rs"]
mod tiny_llama;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_transformers::models::llama as peer;
use qforge_formats::manifest::write_manifest;
use qforge_model::artifact::{LayerPrecision, load_language_model, write_language_model};
use qforge_model::{Llama, Logits};
use tiny_llama::{
    FFN, HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB, last_logits, max_diff, tiny_family, tiny_model,
};

fn peer_last_logits(dir: &Path, tokens: &[u32]) -> Vec<f32> {
    let config: peer::LlamaConfig =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let config = config.into_config(false);
    let vb = unsafe {
        candle_nn::VarBuilder::from_mmaped_safetensors(
            &[dir.join("model.safetensors")],
            DType::F32,
            &Device::Cpu,
        )
    }
    .unwrap();
    let model = peer::Llama::load(vb, &config).unwrap();
    let mut cache = peer::Cache::new(false, DType::F32, &config, &Device::Cpu).unwrap();
    let x = Tensor::new(tokens, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    model
        .forward(&x, 0, &mut cache)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn qwen2_peer_last_logits(dir: &Path, tokens: &[u32]) -> Vec<f32> {
    let config: candle_transformers::models::qwen2::Config =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let vb = unsafe {
        candle_nn::VarBuilder::from_mmaped_safetensors(
            &[dir.join("model.safetensors")],
            DType::F32,
            &Device::Cpu,
        )
    }
    .unwrap();
    let mut model = candle_transformers::models::qwen2::ModelForCausalLM::new(&config, vb).unwrap();
    let x = Tensor::new(tokens, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    model
        .forward(&x, 0)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// Every position's logits of `batch`, flat.
fn all_logits(model: &Llama, batch: &[Vec<u32>]) -> Vec<f32> {
    model
        .forward(batch, None, None, Logits::All)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

#[test]
fn matches_candle_transformers_llama_on_a_hf_directory() {
    let dir = tiny_model("peer");
    let ours = Llama::from_hf_dir(&dir).unwrap();
    for tokens in [
        vec![1u32, 5, 9, 33, 70, 2, 11],
        vec![4u32; 3],
        (0..40).map(|i| (i * 7 % 96) as u32).collect(),
    ] {
        let expected = peer_last_logits(&dir, &tokens);
        let got = &last_logits(&ours, std::slice::from_ref(&tokens))[0];
        let diff = max_diff(got, &expected);
        assert!(diff < 1e-4, "{} tokens: max |Δ| {diff}", tokens.len());
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// The tensors of the model in `dir`, rewritten in bf16.
fn narrow_to_bf16(dir: &Path) -> HashMap<String, Tensor> {
    let path = dir.join("model.safetensors");
    let tensors = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let bf16: HashMap<String, Tensor> = tensors
        .into_iter()
        .map(|(name, t)| (name, t.to_dtype(DType::BF16).unwrap()))
        .collect();
    candle_core::safetensors::save(&bf16, &path).unwrap();
    bf16
}

#[test]
fn bf16_weights_stay_mapped_and_match_the_peer_and_their_f32_widening() {
    let dir = tiny_model("bf16");
    let bf16 = narrow_to_bf16(&dir);
    let ours = Llama::from_hf_dir(&dir).unwrap();
    // The same values widened to f32 and held in memory: widening at each
    // use from the file's mapping computes exactly what they do.
    let widened_dir = tiny_model("bf16-widened");
    let widened: HashMap<String, Tensor> = bf16
        .iter()
        .map(|(name, t)| (name.clone(), t.to_dtype(DType::F32).unwrap()))
        .collect();
    candle_core::safetensors::save(&widened, widened_dir.join("model.safetensors")).unwrap();
    let resident = Llama::from_hf_dir(&widened_dir).unwrap();
    let batch = [(0..17).map(|i| (i * 7 % 96) as u32).collect::<Vec<u32>>()];
    assert_eq!(all_logits(&ours, &batch), all_logits(&resident, &batch));
    std::fs::remove_dir_all(widened_dir).unwrap();
    // Decoder linears stay 2 bytes a weight, and so does the tied lm_head:
    // the embedding stays bf16 too.
    let hd = HIDDEN / HEADS;
    let per_layer = HIDDEN * (HEADS + 2 * KV_HEADS) * hd + HEADS * hd * HIDDEN + 3 * HIDDEN * FFN;
    assert_eq!(
        ours.linear_weight_bytes(),
        2 * LAYERS * per_layer + 2 * VOCAB * HIDDEN
    );
    let tokens: Vec<u32> = (0..24).map(|i| (i * 13 % 96) as u32).collect();
    let expected = peer_last_logits(&dir, &tokens);
    let got = &last_logits(&ours, std::slice::from_ref(&tokens))[0];
    assert!(max_diff(got, &expected) < 1e-4);
    std::fs::remove_dir_all(dir).unwrap();
}

/// A bf16 model's artifact keeps what is bf16 in bf16 (the embedding, a
/// full-precision layer, the tied lm_head left in full precision) and loads
/// back as the model that was written, logit for logit; a layer a transform
/// rescales is f32 again.
#[test]
fn a_bf16_models_artifact_keeps_bf16_and_loads_back_as_written() {
    let dir = tiny_model("bf16-artifact");
    narrow_to_bf16(&dir);
    let mut lm = qforge_model::LanguageModel::load(&dir).unwrap();
    let smoothed = "model.layers.1.mlp.down_proj";
    lm.model = lm
        .model
        .with_linears(|point, layer| {
            if point == smoothed {
                layer.scale_inputs(&vec![0.5; FFN])
            } else {
                Ok(layer.clone())
            }
        })
        .unwrap();
    let fp = ["model.layers.0.mlp.down_proj", smoothed, "lm_head"];
    let points: BTreeMap<String, LayerPrecision> = lm
        .model
        .linears()
        .iter()
        .map(|(_, point, _)| {
            let precision = if fp.contains(&point.as_str()) {
                LayerPrecision::Fp
            } else {
                LayerPrecision::Int8Dynamic
            };
            (point.clone(), precision)
        })
        .collect();
    let quantized = lm
        .model
        .with_linears(|point, layer| points[point].apply(layer))
        .unwrap();
    let artifact = tempfile::tempdir().unwrap();
    write_language_model(artifact.path(), &lm, &points).unwrap();
    write_manifest(artifact.path(), serde_json::json!({"test": true})).unwrap();

    let bytes = std::fs::read(artifact.path().join("model.safetensors")).unwrap();
    let stored = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let dtype = |name: &str| stored.tensor(name).unwrap().dtype();
    use safetensors::Dtype;
    assert_eq!(dtype("model.embed_tokens.weight"), Dtype::BF16);
    assert_eq!(dtype("lm_head.weight"), Dtype::BF16);
    assert_eq!(dtype("model.layers.0.mlp.down_proj.weight"), Dtype::BF16);
    assert_eq!(dtype(&format!("{smoothed}.weight")), Dtype::F32);
    assert_eq!(dtype("model.norm.weight"), Dtype::F32);
    assert_eq!(dtype("model.layers.0.mlp.up_proj.weight"), Dtype::I8);

    let loaded = load_language_model(artifact.path()).unwrap();
    let batch = [(0..19).map(|i| (i * 5 % 96) as u32).collect::<Vec<u32>>()];
    assert_eq!(
        all_logits(&loaded.model, &batch),
        all_logits(&quantized, &batch)
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn qwen2_with_biases_matches_candle_transformers_qwen2() {
    let dir = tiny_family("qwen2", true);
    let ours = Llama::from_hf_dir(&dir).unwrap();
    assert!(ours.config().attention_bias);
    for tokens in [
        vec![3u32, 1, 4, 1, 5, 9, 2, 6],
        (0..30).map(|i| (i * 11 % 96) as u32).collect(),
    ] {
        let expected = qwen2_peer_last_logits(&dir, &tokens);
        let got = &last_logits(&ours, std::slice::from_ref(&tokens))[0];
        let diff = max_diff(got, &expected);
        assert!(diff < 1e-4, "{} tokens: max |Δ| {diff}", tokens.len());
    }
    std::fs::remove_dir_all(dir).unwrap();
}
