//! The Llama forward's own contracts on a small random model in a Hugging
//! Face directory: padding, KV cache, errors, observation, passes resumed
//! from a kept hidden state, and a decoder from tensors held in memory.

#[path = "support/tiny_llama.rs"]
mod tiny_llama;

use std::collections::BTreeMap;

use candle_core::{Device, Tensor};
use qforge_model::{Llama, Logits, Observer, Statistics, StatsObserver};
use tiny_llama::{
    FFN, HIDDEN, LAYERS, VOCAB, last_logits, max_diff, one_input_int8, tiny_family, tiny_model,
};

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

/// A model run from its own hidden state kept entering a layer gives its
/// whole forward's logits bit for bit, and so does a model that differs from
/// it only from that layer on (what the guard's per-layer ranking relies on;
/// `qforge-eval`'s tests check the comparisons built on it).
#[test]
fn a_forward_resumed_from_a_kept_hidden_state_gives_the_whole_forwards_logits() {
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
    for point in ["model.layers.1.mlp.down_proj", "lm_head"] {
        let changed = one_input_int8(&model, point);
        let layer = Llama::layer_of(point).unwrap_or(layers);
        let own = changed.forward(&batch, None, None, Logits::All).unwrap();
        let resumed = changed
            .forward_resuming(&batch, &kept[layer], Logits::All)
            .unwrap();
        assert_eq!(bits(&resumed), bits(&own), "{point}");
        assert_ne!(bits(&own), bits(&whole), "{point} changed nothing");
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
