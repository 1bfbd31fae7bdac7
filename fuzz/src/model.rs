//! Checks of `qforge-formats`' and `qforge-model`'s parsers, for the
//! `gguf_header`, `onnx_import`, `policy` and `hf_config` targets. Uses
//! `qforge-formats`, `qforge-model` and `serde_json` only, so
//! `crates/model/tests/fuzz_corpus_replay.rs` can include it.

use qforge_formats::gguf::GgufHeader;
use qforge_formats::llama_config::LlamaConfig;
use qforge_formats::policy::Head;
use qforge_formats::tokenizer::TextTokenizer;
use qforge_model::MlpPolicy;

/// The widest layer [`run_policy`] runs a forward pass through.
///
/// A loaded policy's widths are already bounded by the input (each layer's
/// weight must be a tensor of exactly `out × in` values held in the input),
/// so this is a second bound, not the only one: it keeps the forward pass
/// (an allocation and a matmul per layer) cheap per execution, and keeps
/// memory bounded even if a loader ever accepts weights whose size is not
/// tied to the bytes (broadcast, lazily generated or memory-mapped
/// tensors), where a width of 2^40 would be an out-of-memory abort rather
/// than a finding.
pub const MAX_FORWARD_WIDTH: usize = 4096;

/// `GgufHeader::parse`; on success, every tensor lies inside the file, and
/// the model config and tokenizer built from the metadata load or fail
/// cleanly.
pub fn gguf_header(data: &[u8]) {
    let Ok(header) = GgufHeader::parse(data) else {
        return;
    };
    for (name, t) in &header.tensors {
        let end = t.start.checked_add(t.size);
        assert!(
            end.is_some_and(|end| end <= data.len() as u64),
            "tensor {name} ({} bytes at {}) lies outside the {}-byte file",
            t.size,
            t.start,
            data.len()
        );
    }
    let _ = LlamaConfig::from_gguf(&header);
    let _ = TextTokenizer::from_gguf(&header);
}

/// `import_mlp_bytes` for a discrete head of 2 actions; an imported policy
/// must run.
pub fn onnx_import(data: &[u8]) {
    let head = Head::Discrete { actions: 2 };
    if let Ok(policy) = qforge_model::onnx::import_mlp_bytes(data, head, None) {
        run_policy(&policy);
    }
}

/// Splits `data` at its first 0xFF byte (never part of UTF-8, so never of
/// the JSON) into `policy.json` and `model.safetensors` bytes, and loads
/// them with `MlpPolicy::from_bytes`; a loaded policy must run.
pub fn policy(data: &[u8]) {
    let (config, weights) = split_policy(data);
    if let Ok(policy) = MlpPolicy::from_bytes(config, weights) {
        run_policy(&policy);
    }
}

/// The `policy.json` and `model.safetensors` halves of a `policy` input.
pub fn split_policy(data: &[u8]) -> (&[u8], &[u8]) {
    match data.iter().position(|&b| b == 0xFF) {
        Some(at) => (&data[..at], &data[at + 1..]),
        None => (data, &[]),
    }
}

/// Runs `policy` on one observation of zeros (unless a layer is wider than
/// [`MAX_FORWARD_WIDTH`]); a policy that loaded must produce one output per
/// head output, and one action.
fn run_policy(policy: &MlpPolicy) {
    let config = policy.config();
    let widest = config
        .hidden
        .iter()
        .chain([&config.observation_dim, &config.head.outputs()])
        .max()
        .copied()
        .unwrap_or(0);
    if widest > MAX_FORWARD_WIDTH {
        return;
    }
    let zeros = vec![0.0f32; config.observation_dim];
    let outputs = policy
        .forward(&zeros, None)
        .expect("a policy that loaded runs on an observation of zeros");
    assert_eq!(
        outputs.len(),
        config.head.outputs(),
        "one row of head outputs"
    );
    assert_eq!(policy.actions_from_outputs(&outputs).len(), 1, "one action");
}

/// Parses `data` as JSON and reads it as a Hugging Face `config.json`; a
/// config that is accepted satisfies the relations the decoder relies on.
pub fn hf_config(data: &[u8]) {
    let Ok(json) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    if let Ok(c) = LlamaConfig::from_hf(&json) {
        assert!(c.num_heads > 0 && c.num_kv_heads > 0, "{c:?}");
        assert!(c.num_heads.is_multiple_of(c.num_kv_heads), "{c:?}");
        assert!(c.head_dim > 0 && c.head_dim.is_multiple_of(2), "{c:?}");
        assert!(c.hidden_size > 0 && c.intermediate_size > 0, "{c:?}");
        assert!(c.vocab_size > 0 && c.num_layers > 0, "{c:?}");
    }
}
