//! Weight sync in a run precision on a model that ties lm_head to its
//! embedding: int8-dynamic's residual rotation unties them in the served
//! model, but a trainer still hands over the embedding alone.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use candle_core::{Device, Tensor};
use qforge_core::Calibrator;
use qforge_quant::precision::RunPrecision;
use qforge_quant::sync::WeightSync;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const VOCAB: usize = 64;
const FFN: usize = 96;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;

/// The shape of the tensor `name` in the tiny model `hidden` wide.
fn shape(name: &str, hidden: usize) -> Vec<usize> {
    let kv = KV_HEADS * hidden / HEADS;
    let suffixes: [(&str, Vec<usize>); 7] = [
        ("embed_tokens.weight", vec![VOCAB, hidden]),
        ("norm.weight", vec![hidden]),
        ("k_proj.weight", vec![kv, hidden]),
        ("v_proj.weight", vec![kv, hidden]),
        ("gate_proj.weight", vec![FFN, hidden]),
        ("up_proj.weight", vec![FFN, hidden]),
        ("down_proj.weight", vec![hidden, FFN]),
    ];
    suffixes
        .into_iter()
        .find(|(suffix, _)| name.ends_with(suffix))
        .map_or(vec![hidden, hidden], |(_, shape)| shape)
}

/// Writes a random two-layer Llama `hidden` wide with tied embeddings (no
/// tokenizer) to `dir`; returns its tensors.
fn tied_llama(dir: &Path, hidden: usize) -> BTreeMap<String, Tensor> {
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden, "intermediate_size": FFN, "num_hidden_layers": 2,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 64, "tie_word_embeddings": true,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu"
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut rng = StdRng::seed_from_u64(7);
    let names = [
        "model.embed_tokens.weight".to_owned(),
        "model.norm.weight".to_owned(),
    ]
    .into_iter()
    .chain((0..2).flat_map(|i| {
        [
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        ]
        .map(|t| format!("model.layers.{i}.{t}"))
    }));
    let tensors: BTreeMap<String, Tensor> = names
        .map(|name| {
            let shape = shape(&name, hidden);
            let n = shape.iter().product();
            // Norm gains near one, weights around zero.
            let offset = if shape.len() == 1 { 1.0 } else { 0.0 };
            let values: Vec<f32> = (0..n)
                .map(|_| offset + rng.random_range(-0.3..0.3))
                .collect();
            let tensor = Tensor::from_vec(values, shape, &Device::Cpu).unwrap();
            (name, tensor)
        })
        .collect();
    let map: HashMap<String, Tensor> = tensors.clone().into_iter().collect();
    candle_core::safetensors::save(&map, dir.join("model.safetensors")).unwrap();
    tensors
}

#[test]
fn a_tied_model_syncs_its_own_weights_in_int8_dynamic_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let tensors = tied_llama(dir.path(), 64);
    let opened = qforge_model::open(dir.path())
        .unwrap()
        .into_language(dir.path())
        .unwrap();
    assert!(opened.model.tied_embeddings());
    for name in ["int8-dynamic", "int8-dynamic-plain"] {
        let precision = RunPrecision::named(name, dir.path(), None, Calibrator::MinMax).unwrap();
        let sync = WeightSync::new(dir.path(), precision, &opened).unwrap();
        let served = sync.to_served(opened.clone()).unwrap();
        // The rotation gives lm_head its own matrix; plain keeps it tied.
        assert_eq!(served.model.tied_embeddings(), name == "int8-dynamic-plain");
        // The trainer's weights: the embedding, no lm_head.
        let synced = sync.apply(&served, tensors.clone()).unwrap();
        assert!(synced.change.total.int8_weights > 0, "{name}");
        assert_eq!(synced.change.total.changed, 0, "{name}");
    }
}

/// A width with no Hadamard construction (88 = 8 · 11) is refused by
/// int8-dynamic, naming the plain precision that runs it.
#[test]
fn int8_dynamic_refuses_a_width_it_cannot_rotate() {
    let dir = tempfile::tempdir().unwrap();
    tied_llama(dir.path(), 88);
    let opened = qforge_model::open(dir.path())
        .unwrap()
        .into_language(dir.path())
        .unwrap();
    let precision = |name| RunPrecision::named(name, dir.path(), None, Calibrator::MinMax).unwrap();
    let refused = precision("int8-dynamic")
        .apply_language(opened.clone())
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("no Hadamard rotation of its 88 channels")
            && refused.contains("int8-dynamic-plain runs without the rotation"),
        "{refused}"
    );
    precision("int8-dynamic-plain")
        .apply_language(opened)
        .unwrap();
}
