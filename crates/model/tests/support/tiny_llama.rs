//! What the Llama forward tests share: a small random GQA decoder (Llama or
//! Qwen2) written to a Hugging Face directory, and comparisons of logits.

// Each test binary uses its own part of this module.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{Device, Tensor};
use qforge_model::{Llama, Logits};

pub const VOCAB: usize = 96;
pub const HIDDEN: usize = 64;
pub const LAYERS: usize = 2;
pub const HEADS: usize = 4;
pub const KV_HEADS: usize = 2;
pub const FFN: usize = 160;

/// Deterministic pseudo-random values (LCG), scaled.
pub fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(2862933555777941757)
        .wrapping_add(3037000493);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Writes a random GQA Llama with tied embeddings to a fresh directory.
pub fn tiny_model(name: &str) -> PathBuf {
    tiny_family(name, false)
}

/// Writes a random GQA decoder: a Llama with tied embeddings, or (`qwen2`) a
/// Qwen2 with q/k/v biases and its own lm_head.
pub fn tiny_family(name: &str, qwen2: bool) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("qforge-tiny-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = serde_json::json!({
        "architectures": [if qwen2 { "Qwen2ForCausalLM" } else { "LlamaForCausalLM" }],
        "hidden_size": HIDDEN, "intermediate_size": FFN,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 128, "tie_word_embeddings": !qwen2,
        "bos_token_id": 1, "eos_token_id": 2,
        "sliding_window": 128, "max_window_layers": LAYERS, "use_sliding_window": false,
        "hidden_act": "silu"
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let hd = HIDDEN / HEADS;
    let mut tensors = HashMap::new();
    let mut seed = 1;
    let mut add = |name: String, shape: &[usize], scale: f32, offset: f32| {
        seed += 1;
        let n: usize = shape.iter().product();
        let v: Vec<f32> = values(n, seed, scale)
            .into_iter()
            .map(|x| x + offset)
            .collect();
        tensors.insert(name, Tensor::from_vec(v, shape, &Device::Cpu).unwrap());
    };
    add(
        "model.embed_tokens.weight".into(),
        &[VOCAB, HIDDEN],
        1.0,
        0.0,
    );
    add("model.norm.weight".into(), &[HIDDEN], 0.2, 1.0);
    if qwen2 {
        add("lm_head.weight".into(), &[VOCAB, HIDDEN], 0.5, 0.0);
    }
    for i in 0..LAYERS {
        let p = format!("model.layers.{i}");
        add(format!("{p}.input_layernorm.weight"), &[HIDDEN], 0.2, 1.0);
        add(
            format!("{p}.post_attention_layernorm.weight"),
            &[HIDDEN],
            0.2,
            1.0,
        );
        add(
            format!("{p}.self_attn.q_proj.weight"),
            &[HEADS * hd, HIDDEN],
            0.3,
            0.0,
        );
        add(
            format!("{p}.self_attn.k_proj.weight"),
            &[KV_HEADS * hd, HIDDEN],
            0.3,
            0.0,
        );
        add(
            format!("{p}.self_attn.v_proj.weight"),
            &[KV_HEADS * hd, HIDDEN],
            0.3,
            0.0,
        );
        add(
            format!("{p}.self_attn.o_proj.weight"),
            &[HIDDEN, HEADS * hd],
            0.3,
            0.0,
        );
        add(
            format!("{p}.mlp.gate_proj.weight"),
            &[FFN, HIDDEN],
            0.3,
            0.0,
        );
        add(format!("{p}.mlp.up_proj.weight"), &[FFN, HIDDEN], 0.3, 0.0);
        add(
            format!("{p}.mlp.down_proj.weight"),
            &[HIDDEN, FFN],
            0.3,
            0.0,
        );
        if qwen2 {
            add(
                format!("{p}.self_attn.q_proj.bias"),
                &[HEADS * hd],
                0.5,
                0.0,
            );
            add(
                format!("{p}.self_attn.k_proj.bias"),
                &[KV_HEADS * hd],
                0.5,
                0.0,
            );
            add(
                format!("{p}.self_attn.v_proj.bias"),
                &[KV_HEADS * hd],
                0.5,
                0.0,
            );
        }
    }
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
    dir
}

pub fn last_logits(model: &Llama, batch: &[Vec<u32>]) -> Vec<Vec<f32>> {
    model
        .forward(batch, None, None, Logits::Last)
        .unwrap()
        .to_vec2()
        .unwrap()
}

pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// `model` with only the layers fed by `point` on the INT8 engine (dynamic
/// activations).
pub fn one_input_int8(model: &Llama, point: &str) -> Llama {
    model
        .with_linears(|p, layer| {
            if p == point {
                layer.to_int8(qforge_model::Activations::Dynamic)
            } else {
                Ok(layer.clone())
            }
        })
        .unwrap()
}
