//! The Llama forward on a small random model in a Hugging Face directory:
//! against candle-transformers' Llama (a peer with its own code), and the
//! forward's own contracts: padding, KV cache, observation.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_transformers::models::llama as peer;
use qforge_model::artifact::{LayerPrecision, load_language_model, write_language_model};
use qforge_model::manifest::write_manifest;
use qforge_model::{Llama, Logits, Observer, RotatedInput, Statistics, StatsObserver};

const VOCAB: usize = 96;
const HIDDEN: usize = 64;
const LAYERS: usize = 2;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const FFN: usize = 160;

/// Deterministic pseudo-random values (LCG), scaled.
fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
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
fn tiny_model(name: &str) -> PathBuf {
    tiny_family(name, false)
}

/// Writes a random GQA decoder: a Llama with tied embeddings, or (`qwen2`) a
/// Qwen2 with q/k/v biases and its own lm_head.
fn tiny_family(name: &str, qwen2: bool) -> PathBuf {
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

fn last_logits(model: &Llama, batch: &[Vec<u32>]) -> Vec<Vec<f32>> {
    model
        .forward(batch, None, None, Logits::Last)
        .unwrap()
        .to_vec2()
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

/// The largest logit difference between one INT8 decoder step on `ours`
/// and the tensor forward's step on `reference` (caches of the same
/// positions), both continuing with `token`.
fn step_difference(
    model: &Llama,
    reference: &mut qforge_model::KvCache,
    decoder: &mut qforge_model::Decoder,
    ours: &mut qforge_model::KvCache,
    token: u32,
) -> f32 {
    let expected = model
        .forward(&[vec![token]], Some(reference), None, Logits::Last)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    max_diff(
        decoder.step(model, &mut [ours], &[token], None).unwrap(),
        &expected,
    )
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
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

#[test]
fn padding_kv_cache_and_observation_keep_their_contracts() {
    let dir = tiny_model("contracts");
    let model = Llama::from_hf_dir(&dir).unwrap();
    let long: Vec<u32> = (0..12).map(|i| (i * 5 + 3) % 96).collect();
    let short: Vec<u32> = vec![7, 8, 9, 10, 11];

    // A right-padded batch gives each sequence the logits it gets alone.
    let batched = last_logits(&model, &[long.clone(), short.clone()]);
    assert!(
        max_diff(
            &batched[0],
            &last_logits(&model, std::slice::from_ref(&long))[0]
        ) < 1e-4
    );
    assert!(
        max_diff(
            &batched[1],
            &last_logits(&model, std::slice::from_ref(&short))[0]
        ) < 1e-4
    );

    // Decoding token by token with the cache gives the full forward's logits,
    // and within its reservation the cache never reallocates.
    let mut cache = model.new_cache();
    cache.reserve(long.len());
    let reserved = cache.capacity();
    assert!(reserved >= long.len(), "{reserved}");
    model
        .forward(&[long[..8].to_vec()], Some(&mut cache), None, Logits::Last)
        .unwrap();
    let mut step = None;
    for &t in &long[8..] {
        step = Some(
            model
                .forward(&[vec![t]], Some(&mut cache), None, Logits::Last)
                .unwrap(),
        );
    }
    assert_eq!(cache.len(), long.len());
    assert_eq!(cache.capacity(), reserved, "the cache reallocated");
    assert_eq!(
        cache.clone().capacity(),
        reserved,
        "a clone lost the reservation"
    );
    let err = model
        .forward(&[vec![1], vec![2]], Some(&mut cache), None, Logits::Last)
        .unwrap_err()
        .to_string();
    assert!(err.contains("one sequence"), "{err}");
    assert_eq!(cache.len(), long.len());
    let step: Vec<f32> = step.unwrap().flatten_all().unwrap().to_vec1().unwrap();
    assert!(max_diff(&step, &last_logits(&model, std::slice::from_ref(&long))[0]) < 1e-4);

    // Without a reservation the cache grows as it fills and keeps what it
    // held; a refused forward leaves it as it was.
    let mut grown = model.new_cache();
    for chunk in [&long[..5], &long[5..8]] {
        model
            .forward(&[chunk.to_vec()], Some(&mut grown), None, Logits::Last)
            .unwrap();
    }
    let refused = vec![VOCAB as u32 + 5];
    assert!(
        model
            .forward(&[refused], Some(&mut grown), None, Logits::Last)
            .is_err()
    );
    assert_eq!(grown.len(), 8);
    let mut grown_step = None;
    for &t in &long[8..] {
        grown_step = Some(
            model
                .forward(&[vec![t]], Some(&mut grown), None, Logits::Last)
                .unwrap(),
        );
    }
    assert!(grown.capacity() >= long.len());
    let grown_step: Vec<f32> = grown_step
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert!(max_diff(&grown_step, &step) < 1e-4);

    // Every distinct linear input is observed, padding never.
    let mut observer = StatsObserver::new(Statistics::Histograms { per_channel: true });
    model
        .forward(
            &[long.clone(), short.clone()],
            None,
            Some(&mut observer as &mut dyn Observer),
            Logits::All,
        )
        .unwrap();
    let points: Vec<&str> = observer.tensors.keys().map(String::as_str).collect();
    assert_eq!(points.len(), 4 * LAYERS + 1, "{points:?}");
    for i in 0..LAYERS {
        for p in [
            "self_attn.q_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.down_proj",
        ] {
            assert!(
                points.contains(&format!("model.layers.{i}.{p}").as_str()),
                "{p}"
            );
        }
    }
    let rows = (long.len() + short.len()) as u64;
    let q = &observer.tensors["model.layers.0.self_attn.q_proj"];
    assert_eq!(q.histogram().count(), rows * HIDDEN as u64);
    let down = &observer.tensors["model.layers.1.mlp.down_proj"];
    assert_eq!(down.histogram().count(), rows * FFN as u64);
    assert_eq!(down.channel_abs_max().unwrap().len(), FFN);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bad_inputs_are_clear_errors() {
    let dir = tiny_model("bad");
    let model = Llama::from_hf_dir(&dir).unwrap();
    let err = model
        .forward(&[vec![500]], None, None, Logits::Last)
        .unwrap_err()
        .to_string();
    assert!(err.contains("outside the vocabulary"), "{err}");
    assert!(model.forward(&[vec![]], None, None, Logits::Last).is_err());
    let err = model
        .forward(&[vec![1; 200]], None, None, Logits::Last)
        .unwrap_err()
        .to_string();
    assert!(err.contains("context"), "{err}");

    // A truncated safetensors file and a missing tensor name the problem.
    let weights = std::fs::read(dir.join("model.safetensors")).unwrap();
    std::fs::write(
        dir.join("model.safetensors"),
        &weights[..weights.len() - 100],
    )
    .unwrap();
    let err = Llama::from_hf_dir(&dir).unwrap_err().to_string();
    assert!(
        err.contains("model.safetensors") || err.contains(dir.to_str().unwrap()),
        "{err}"
    );
    let mut tensors = candle_core::safetensors::load_buffer(&weights, &Device::Cpu).unwrap();
    tensors.remove("model.layers.1.mlp.up_proj.weight");
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
    let err = Llama::from_hf_dir(&dir).unwrap_err().to_string();
    assert!(err.contains("model.layers.1.mlp.up_proj.weight"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// The allocation-free INT8 decoder against the tensor forward of the same
/// INT8 model, step by step, on a random GQA Llama (tied lm_head) and a
/// Qwen2 (q/k/v biases): the same bits. Dynamic INT8 activations turn any
/// difference of one ulp before a linear layer into a whole step of its
/// input when a value crosses a rounding boundary (the decoder's RMSNorm
/// once multiplied by the inverse root where candle divides by the root,
/// and Qwen2's logits then moved by 0.18), so nothing less than equality
/// holds up. On three threads, the 4 query heads split 1:1:2, so a key/value
/// head's two query heads are attended on different threads.
#[test]
fn int8_decoder_steps_match_the_tensor_forward() {
    for (qwen2, threads) in [(false, 2), (true, 2), (false, 3)] {
        let dir = tiny_family(
            &format!("decode-{}-{threads}", if qwen2 { "qwen2" } else { "llama" }),
            qwen2,
        );
        let model = Llama::from_hf_dir(&dir)
            .unwrap()
            .with_linears(|_, layer| layer.to_int8(qforge_model::Activations::Dynamic))
            .unwrap();
        let prompt = vec![1u32, 5, 9, 33, 70, 11];
        let mut cache = model.new_cache();
        model
            .forward(
                std::slice::from_ref(&prompt),
                Some(&mut cache),
                None,
                Logits::Last,
            )
            .unwrap();
        let mut decoder = qforge_model::Decoder::new(threads).unwrap();
        assert!(qforge_model::Decoder::supports(&model), "all INT8");
        let mut ours = cache.clone();
        for step in 0..12u32 {
            let token = (step * 37 + 3) % VOCAB as u32;
            let diff = step_difference(&model, &mut cache, &mut decoder, &mut ours, token);
            assert_eq!(diff, 0.0, "qwen2 {qwen2}, step {step}: max |Δ| {diff}");
        }
        assert!(
            decoder
                .step(&model, &mut [&mut ours], &[VOCAB as u32], None)
                .is_err(),
            "out-of-vocabulary token"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}

#[test]
fn smoothing_keeps_the_function_and_moves_the_activation_range() {
    let dir = tiny_family("smooth", true);
    let model = Llama::from_hf_dir(&dir).unwrap();
    let points = model.smoothable_points();
    assert_eq!(points.len(), 3 * LAYERS);
    let factors: std::collections::BTreeMap<String, Vec<f32>> = points
        .iter()
        .enumerate()
        .map(|(k, p)| {
            let width = if p.ends_with("down_proj") {
                FFN
            } else {
                HIDDEN
            };
            let f = values(width, 100 + k as u64, 0.75)
                .into_iter()
                .map(|v| 1.0 + v) // in [0.25, 1.75]
                .collect();
            (p.clone(), f)
        })
        .collect();
    let smoothed = model.smoothed(&factors).unwrap();
    let tokens = vec![(0..30).map(|i| (i * 5 % 96) as u32).collect::<Vec<_>>()];
    let diff = max_diff(
        &last_logits(&model, &tokens)[0],
        &last_logits(&smoothed, &tokens)[0],
    );
    assert!(diff < 1e-4, "max |Δ| {diff}");

    // The down_proj input channel j is divided by its factor.
    let mut plain = StatsObserver::new(Statistics::Histograms { per_channel: false });
    model
        .forward(&tokens, None, Some(&mut plain), Logits::Last)
        .unwrap();
    let mut moved = StatsObserver::new(Statistics::Histograms { per_channel: false });
    smoothed
        .forward(&tokens, None, Some(&mut moved), Logits::Last)
        .unwrap();
    let point = "model.layers.1.mlp.down_proj";
    let before = plain.tensors[point].histogram().abs_max().unwrap();
    let after = moved.tensors[point].histogram().abs_max().unwrap();
    assert!(
        (before - after).abs() > 1e-3 * before,
        "{before} vs {after}"
    );

    // A point whose scale cannot be folded is refused.
    let mut bad = factors.clone();
    bad.insert("model.layers.0.self_attn.o_proj".into(), vec![1.0; HIDDEN]);
    assert!(model.smoothed(&bad).is_err());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn batched_steps_match_each_sequence_decoded_alone() {
    let dir = tiny_family("step", true);
    let fp = Llama::from_hf_dir(&dir).unwrap();
    let int8 = fp
        .with_linears(|_, layer| layer.to_int8(qforge_model::Activations::Dynamic))
        .unwrap();
    for (name, model) in [("f32", &fp), ("int8-dynamic", &int8)] {
        // Three sequences at different positions: their prompts differ in length.
        let prompts = [vec![1u32, 5, 9], vec![7u32, 2, 40, 41, 90, 3], vec![12u32]];
        let mut alone: Vec<_> = prompts.iter().map(|_| model.new_cache()).collect();
        let mut together: Vec<_> = prompts.iter().map(|_| model.new_cache()).collect();
        for (p, (a, t)) in prompts.iter().zip(alone.iter_mut().zip(&mut together)) {
            model
                .forward(std::slice::from_ref(p), Some(a), None, Logits::Last)
                .unwrap();
            model
                .forward(std::slice::from_ref(p), Some(t), None, Logits::Last)
                .unwrap();
        }
        let mut observer = StatsObserver::new(Statistics::Histograms { per_channel: false });
        for step in 0..8u32 {
            let tokens: Vec<u32> = (0..3)
                .map(|s| (step * 31 + s * 17 + 2) % VOCAB as u32)
                .collect();
            let mut caches: Vec<&mut qforge_model::KvCache> = together.iter_mut().collect();
            let batched = model
                .step(&mut caches, &tokens, Some(&mut observer))
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            for (s, cache) in alone.iter_mut().enumerate() {
                let reference = model
                    .forward(&[vec![tokens[s]]], Some(cache), None, Logits::Last)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                let diff = max_diff(&batched[s], &reference);
                assert!(
                    diff < 1e-4,
                    "{name}, step {step}, sequence {s}: max |Δ| {diff}"
                );
            }
        }
        for (a, t) in alone.iter().zip(&together) {
            assert_eq!(a.len(), t.len());
        }
        // Every linear input of every step was observed, one row per sequence.
        let q = &observer.tensors["model.layers.0.self_attn.q_proj"];
        assert_eq!(q.histogram().count(), 8 * 3 * HIDDEN as u64);
        let mut caches: Vec<&mut qforge_model::KvCache> = together.iter_mut().collect();
        assert!(
            model.step(&mut caches, &[1, 2], None).is_err(),
            "token count"
        );
        assert!(
            model
                .step(&mut caches, &[1, 2, VOCAB as u32], None)
                .is_err(),
            "vocabulary"
        );
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn hadamard_rotations_keep_the_function_on_both_forwards() {
    let dir = tiny_family("rotate", false);
    let model = Llama::from_hf_dir(&dir).unwrap();
    let every = RotatedInput::ALL;
    let rotated = model.rotated(&every).unwrap();
    assert_eq!(rotated.rotated_inputs(), every.to_vec());
    assert!(model.rotated_inputs().is_empty());
    let tokens = vec![(0..30).map(|i| (i * 7 % 96) as u32).collect::<Vec<_>>()];
    let diff = max_diff(
        &last_logits(&model, &tokens)[0],
        &last_logits(&rotated, &tokens)[0],
    );
    assert!(diff < 1e-4, "full precision: max |Δ| {diff}");
    let twice = rotated.rotated(&[RotatedInput::Head]).unwrap_err();
    assert!(twice.to_string().contains("rotated already"), "{twice}");
    assert!(
        rotated.smoothable_points().is_empty(),
        "a rotated input cannot be smoothed into the layer before it"
    );
    let down_only = model.rotated(&[RotatedInput::MlpProduct]).unwrap();
    assert_eq!(down_only.smoothable_points().len(), 2 * LAYERS);

    // The INT8 decoder rotates like the tensor forward it stands in for.
    int8_decoder_follows_the_forward(&rotated);
    std::fs::remove_dir_all(dir).unwrap();
}

/// `model` with every linear int8 (dynamic activations): after a prompt,
/// the INT8 decoder's steps give the tensor forward's logits.
fn int8_decoder_follows_the_forward(model: &Llama) {
    let int8 = model
        .with_linears(|_, layer| layer.to_int8(qforge_model::Activations::Dynamic))
        .unwrap();
    let prompt = vec![1u32, 5, 9, 33, 70, 11];
    let mut cache = int8.new_cache();
    int8.forward(
        std::slice::from_ref(&prompt),
        Some(&mut cache),
        None,
        Logits::Last,
    )
    .unwrap();
    let mut decoder = qforge_model::Decoder::new(2).unwrap();
    let mut ours = cache.clone();
    for token in [3u32, 17, 42] {
        let diff = step_difference(&int8, &mut cache, &mut decoder, &mut ours, token);
        assert!(diff < 1e-4, "int8 decoder: max |Δ| {diff}");
    }
}

#[test]
fn a_rotated_residual_stream_keeps_the_function_as_a_plain_llama() {
    for qwen2 in [false, true] {
        let dir = tiny_family(if qwen2 { "residual-qwen2" } else { "residual" }, qwen2);
        let model = Llama::from_hf_dir(&dir).unwrap();
        let residual = model.residual_rotated(7).unwrap();
        assert!(
            residual.rotated_inputs().is_empty(),
            "nothing rotates online"
        );
        assert!(
            !residual.tied_embeddings(),
            "the folded final norm makes lm_head its own matrix"
        );
        let tokens = vec![(0..30).map(|i| (i * 7 % 96) as u32).collect::<Vec<_>>()];
        // Another seed's signs make other weights for the same function.
        let other = model.residual_rotated(8).unwrap();
        for rotated in [&residual, &other] {
            let diff = max_diff(
                &last_logits(&model, &tokens)[0],
                &last_logits(rotated, &tokens)[0],
            );
            assert!(diff < 1e-4, "qwen2 {qwen2}: full precision: max |Δ| {diff}");
        }
        let weights = |m: &Llama| {
            m.linears()[0]
                .2
                .full_precision()
                .unwrap()
                .0
                .to_vec2::<f32>()
                .unwrap()
        };
        assert_ne!(weights(&residual), weights(&other));

        // QuaRot's arrangement: the inputs the residual does not reach
        // rotate online, and the INT8 decoder follows the tensor forward.
        let online = [RotatedInput::AttentionOutput, RotatedInput::MlpProduct];
        let quarot = residual.rotated(&online).unwrap();
        let diff = max_diff(
            &last_logits(&model, &tokens)[0],
            &last_logits(&quarot, &tokens)[0],
        );
        assert!(
            diff < 1e-4,
            "qwen2 {qwen2}: with online rotations: max |Δ| {diff}"
        );
        int8_decoder_follows_the_forward(&quarot);

        // The residual is rotated before anything rotates online.
        let late = quarot.residual_rotated(7).unwrap_err();
        assert!(
            late.to_string()
                .contains("rotate the residual stream first"),
            "{late}"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}

/// Records the inputs of the points of one decoder layer, and is finished
/// once it has seen them all.
struct LayerCapture {
    layer: usize,
    rows: Vec<(String, Vec<f32>)>,
}

impl Observer for LayerCapture {
    fn observe(&mut self, point: &str, rows: &[f32], _width: usize) -> qforge_model::Result<()> {
        if point.starts_with(&format!("model.layers.{}.", self.layer)) {
            self.rows.push((point.to_owned(), rows.to_vec()));
        }
        Ok(())
    }

    fn finished(&self) -> bool {
        let points: std::collections::BTreeSet<&String> =
            self.rows.iter().map(|(p, _)| p).collect();
        points.len() == 4
    }
}

/// Two sequences of the tiny model's vocabulary, 19 and 11 tokens long (so
/// padding is exercised).
fn two_ragged_sequences() -> Vec<Vec<u32>> {
    vec![
        (0..19).map(|i| (i * 5 % 96) as u32).collect(),
        (0..11).map(|i| (i * 3 % 96) as u32).collect(),
    ]
}

#[test]
fn an_observing_pass_resumed_from_a_kept_hidden_state_sees_what_the_whole_forward_sees() {
    let dir = tiny_model("resume");
    let model = Llama::from_hf_dir(&dir).unwrap();
    let batch = two_ragged_sequences();
    let capture = |layer| LayerCapture {
        layer,
        rows: Vec::new(),
    };
    let mut whole = capture(1);
    model.observe(&batch, &mut whole).unwrap();
    assert!(whole.finished());

    // A pass over layer 0 stops there and keeps the states entering layers 0 and 1.
    let mut first = capture(0);
    let kept = model
        .observe_resuming(&batch, &mut first, None, false)
        .unwrap();
    assert_eq!(kept.iter().map(|s| s.layer).collect::<Vec<_>>(), [0, 1]);
    let mut resumed = capture(1);
    let again = model
        .observe_resuming(&batch, &mut resumed, Some(&kept[1]), false)
        .unwrap();
    assert_eq!(resumed.rows, whole.rows);
    // Run to the end from layer 1, it keeps the states entering layers 1 and 2 (the
    // final norm).
    assert_eq!(again.iter().map(|s| s.layer).collect::<Vec<_>>(), [1, 2]);

    // A state of another batch's shape is refused, not misread.
    let other = vec![vec![1u32, 2, 3]];
    let err = model
        .observe_resuming(&other, &mut capture(1), Some(&kept[1]), false)
        .unwrap_err();
    assert!(err.to_string().contains("hidden state"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// Records the points it is offered, in order, and is finished once it was
/// offered `last`.
struct UpTo {
    last: &'static str,
    offered: Vec<String>,
}

impl Observer for UpTo {
    fn observe(&mut self, point: &str, _rows: &[f32], _width: usize) -> qforge_model::Result<()> {
        if self.offered.last().map(String::as_str) != Some(point) {
            self.offered.push(point.to_owned());
        }
        Ok(())
    }

    fn finished(&self) -> bool {
        self.offered.iter().any(|p| p == self.last)
    }
}

/// A pass finished at an input inside a layer stops there (the rest of the
/// layer would compute what no one observes); one finished at `down_proj`'s
/// input runs its layer to the end, to keep the state entering the next
/// layer for the pass that observes it.
#[test]
fn an_observing_pass_stops_inside_a_layer_and_ends_it_only_for_a_state_still_valid() {
    let dir = tiny_model("stop");
    let model = Llama::from_hf_dir(&dir).unwrap();
    let batch = two_ragged_sequences();
    // The inputs a pass ending at `last` is offered, and the layers whose
    // entering states it keeps.
    let up_to = |last: &'static str, rounds_observed: bool| {
        let mut observer = UpTo {
            last,
            offered: Vec::new(),
        };
        let kept = model
            .observe_resuming(&batch, &mut observer, None, rounds_observed)
            .unwrap();
        let layers: Vec<usize> = kept.iter().map(|s| s.layer).collect();
        (observer.offered, layers, kept)
    };

    let (offered, layers, _) = up_to("model.layers.0.self_attn.o_proj", false);
    assert_eq!(
        offered,
        [
            "model.layers.0.self_attn.q_proj",
            "model.layers.0.self_attn.o_proj"
        ]
    );
    assert_eq!(layers, [0]);

    let (mlp, layers, kept) = up_to("model.layers.0.mlp.down_proj", false);
    assert_eq!(mlp.len(), 4);
    assert_eq!(layers, [0, 1]);
    // A pass whose layers are rounded before the next pass (GPTQ propagating
    // its rounding) stops at down_proj's input too: the state entering
    // layer 1 would be stale.
    let (rounding, layers, _) = up_to("model.layers.0.mlp.down_proj", true);
    assert_eq!(rounding, mlp);
    assert_eq!(layers, [0]);

    // What it kept is the state entering layer 1: a pass resumed from it
    // sees layer 1 as the whole forward does.
    let mut whole = LayerCapture {
        layer: 1,
        rows: Vec::new(),
    };
    model.observe(&batch, &mut whole).unwrap();
    let mut resumed = LayerCapture {
        layer: 1,
        rows: Vec::new(),
    };
    model
        .observe_resuming(&batch, &mut resumed, Some(&kept[1]), false)
        .unwrap();
    assert_eq!(resumed.rows, whole.rows);
    std::fs::remove_dir_all(dir).unwrap();
}

/// The activation pass with the first group's Hessians records, in one
/// forward, what the activation pass and the Hessian pass record apart: the
/// same histograms of every input and the same Gram integers of the listed
/// ones.
#[test]
fn histograms_and_grams_in_one_forward_equal_each_recorded_alone() {
    use std::collections::BTreeMap;

    let dir = tiny_model("fused-pass");
    let model = Llama::from_hf_dir(&dir).unwrap();
    let batch = two_ragged_sequences();
    let exponent = qforge_core::Gram::run_exponent(30);
    let points: BTreeMap<String, i32> = [
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.mlp.down_proj",
    ]
    .map(|p| (p.to_owned(), exponent))
    .into();
    let observed = |statistics| {
        let mut observer = StatsObserver::new(statistics);
        model.observe(&batch, &mut observer).unwrap();
        observer.tensors
    };
    let activation = observed(Statistics::Histograms { per_channel: false });
    let hessian = observed(Statistics::Grams(points.clone()));
    let both = observed(Statistics::HistogramsAndGrams(points.clone()));
    assert_eq!(both.len(), activation.len());
    assert_eq!(hessian.len(), points.len());
    for (point, tensor) in &both {
        assert_eq!(tensor.histogram(), activation[point].histogram(), "{point}");
        match hessian.get(point) {
            Some(alone) => {
                let gram = tensor.gram().expect("a listed point has its Gram matrix");
                assert!(gram.upper().iter().any(|&v| v != 0), "{point}");
                assert_eq!(Some(gram), alone.gram(), "{point}");
            }
            None => assert!(tensor.gram().is_none(), "{point}"),
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// A model that differs from another only from some layer on, run from the
/// other's hidden state entering that layer, gives its own whole forward's
/// logits bit for bit (what the guard's per-layer ranking relies on), and
/// its comparison with the other is the whole comparison's.
#[test]
fn a_forward_resumed_from_a_kept_hidden_state_gives_the_whole_forwards_logits() {
    use qforge_model::Activations;
    use qforge_model::lm::{ReferenceLogProbs, compare_from, compare_to};

    let dir = tiny_model("forward-resume");
    let model = Llama::from_hf_dir(&dir).unwrap();
    let tokens: Vec<u32> = (0..19).map(|i| (i * 5 % 96) as u32).collect();
    let batch = vec![tokens.clone()];
    let whole = model.forward(&batch, None, None, Logits::All).unwrap();
    let (logits, kept) = model.forward_keeping(&batch, Logits::All).unwrap();
    let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(bits(&logits), bits(&whole));
    let layers = model.config().num_layers;
    assert_eq!(
        kept.iter().map(|s| s.layer).collect::<Vec<_>>(),
        (0..=layers).collect::<Vec<_>>()
    );
    for state in &kept {
        let resumed = model.forward_resuming(&batch, state, Logits::Last).unwrap();
        let last = model.forward(&batch, None, None, Logits::Last).unwrap();
        assert_eq!(bits(&resumed), bits(&last), "from layer {}", state.layer);
    }

    let reference = ReferenceLogProbs::keeping_states(&model, &tokens, tokens.len()).unwrap();
    // The reference's perplexity, read from what it kept, is the one a
    // forward of it gives, bit for bit.
    let forward = qforge_model::lm::perplexity(&model, &tokens, tokens.len()).unwrap();
    assert_eq!(reference.perplexity(), forward.perplexity);
    for point in ["model.layers.1.mlp.down_proj", "lm_head"] {
        let changed = model
            .with_linears(|p, layer| {
                if p == point {
                    layer.to_int8(Activations::Dynamic)
                } else {
                    Ok(layer.clone())
                }
            })
            .unwrap();
        let layer = Llama::layer_of(point).unwrap_or(layers);
        let own = changed.forward(&batch, None, None, Logits::All).unwrap();
        let resumed = changed
            .forward_resuming(&batch, &kept[layer], Logits::All)
            .unwrap();
        assert_eq!(bits(&resumed), bits(&own), "{point}");
        assert_ne!(bits(&own), bits(&whole), "{point} changed nothing");
        let whole = compare_to(&changed, &reference, &tokens).unwrap();
        assert_eq!(
            compare_from(&changed, &reference, &tokens, layer).unwrap(),
            whole,
            "{point}"
        );
        assert_eq!(whole.reference_perplexity, forward.perplexity, "{point}");
    }
    assert_eq!(
        Llama::layer_of("model.layers.12.self_attn.q_proj"),
        Some(12)
    );
    assert_eq!(Llama::layer_of("lm_head"), None);
    let other = vec![vec![1u32, 2, 3]];
    let err = model
        .forward_resuming(&other, &kept[1], Logits::All)
        .unwrap_err();
    assert!(err.to_string().contains("hidden state"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// A decoder built from tensors held in memory (a trainer's weight sync)
/// computes what the same tensors read from files compute, for a tied Llama
/// and an untied Qwen2 with q/k/v biases. Its names are exactly the
/// checkpoint's; a missing or unknown tensor is refused by name, and a tied
/// model takes an `lm_head.weight` only when it equals the embedding (as a
/// PyTorch `state_dict` lists it).
#[test]
fn a_decoder_from_named_tensors_computes_what_its_files_do() {
    for qwen2 in [false, true] {
        let dir = tiny_family(&format!("named-{qwen2}"), qwen2);
        let from_files = Llama::from_hf_dir(&dir).unwrap();
        let (config, tied) = (from_files.config().clone(), from_files.tied_embeddings());
        assert_eq!(tied, !qwen2);
        let tensors: BTreeMap<String, Tensor> =
            candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)
                .unwrap()
                .into_iter()
                .collect();
        let names: std::collections::BTreeSet<String> = tensors.keys().cloned().collect();
        assert_eq!(Llama::tensor_names(&config, tied), names);
        let built = |tensors: BTreeMap<String, Tensor>| {
            Llama::from_tensors(config.clone(), tied, tensors).map_err(|e| e.to_string())
        };
        let from_memory = built(tensors.clone()).unwrap();
        let prompt = [vec![1u32, 5, 9, 33, 70]];
        assert_eq!(
            last_logits(&from_files, &prompt),
            last_logits(&from_memory, &prompt)
        );

        let mut missing = tensors.clone();
        missing.remove("model.layers.1.self_attn.k_proj.weight");
        let err = built(missing).unwrap_err();
        assert!(
            err.contains("missing tensor model.layers.1.self_attn.k_proj.weight"),
            "{err}"
        );
        let mut unknown = tensors.clone();
        unknown.insert(
            "model.layers.7.mlp.up_proj.weight".into(),
            tensors["model.layers.0.mlp.up_proj.weight"].clone(),
        );
        let err = built(unknown).unwrap_err();
        assert!(
            err.contains("unknown tensor model.layers.7.mlp.up_proj.weight"),
            "{err}"
        );
        if tied {
            let embedding = tensors["model.embed_tokens.weight"].clone();
            let mut with_head = tensors.clone();
            with_head.insert("lm_head.weight".into(), embedding.clone());
            let head_given = built(with_head.clone()).unwrap();
            assert_eq!(
                last_logits(&head_given, &prompt),
                last_logits(&from_files, &prompt)
            );
            with_head.insert("lm_head.weight".into(), (embedding * 2.0).unwrap());
            let err = built(with_head).unwrap_err();
            assert!(err.contains("lm_head.weight differs"), "{err}");
        }
        std::fs::remove_dir_all(dir).unwrap();
    }
}
