//! Hyper-parameters of Llama-family decoders, from a Hugging Face `config.json`
//! or from GGUF metadata.

use serde_json::Value;

use crate::error::{Error, Result};
use crate::gguf::GgufHeader;

/// The decoder families qforge runs. They share one forward; they differ in
/// biases and in how their files lay out the attention weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Llama 1/2/3, SmolLM, TinyLlama and other `LlamaForCausalLM` models.
    Llama,
    /// Mistral (its sliding window does not apply below its window length,
    /// 4096 tokens for Mistral 7B, and qforge's contexts stay below it).
    Mistral,
    /// Qwen2 and Qwen2.5: biases on q, k and v.
    Qwen2,
}

/// Frequency scaling of rotary embeddings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Llama 3.1's scaling of low frequencies.
    Llama3 {
        /// Overall factor.
        factor: f64,
        /// Wavelengths above original_max / low_freq_factor are divided by `factor`.
        low_freq_factor: f64,
        /// Wavelengths below original_max / high_freq_factor are kept.
        high_freq_factor: f64,
        /// Context length the model was pre-trained with.
        original_max_position_embeddings: f64,
    },
}

/// Hyper-parameters of a decoder.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// Which family.
    pub family: Family,
    /// Model width.
    pub hidden_size: usize,
    /// Width of the MLP.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (fewer than query heads under GQA).
    pub num_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE scaling.
    pub rope_scaling: RopeScaling,
    /// Longest context.
    pub max_position_embeddings: usize,
    /// q, k and v projections carry biases (Qwen2).
    pub attention_bias: bool,
    /// End-of-sequence token ids.
    pub eos_token_ids: Vec<u32>,
    /// Beginning-of-sequence token id, if the model uses one.
    pub bos_token_id: Option<u32>,
}

fn family_from_architecture(name: &str) -> Result<Family> {
    Ok(match name {
        "LlamaForCausalLM" | "llama" => Family::Llama,
        "MistralForCausalLM" | "mistral" => Family::Mistral,
        "Qwen2ForCausalLM" | "qwen2" => Family::Qwen2,
        other => {
            return Err(Error::Unsupported(format!(
                "architecture {other:?}; qforge runs Llama (incl. SmolLM2, Llama 3), Mistral and Qwen2 decoders"
            )));
        }
    })
}

impl LlamaConfig {
    /// Validates the sizes and their relations. Upper bounds (far above any
    /// published model) keep a hostile config from sizing allocations.
    fn validate(self) -> Result<Self> {
        let bounded = self.num_layers <= 1024
            && self.num_heads <= 1024
            && self.num_kv_heads <= 1024
            && self.head_dim <= 1024
            && self.hidden_size <= 1 << 17
            && self.intermediate_size <= 1 << 20
            && self.vocab_size <= 1 << 23;
        if !bounded {
            return Err(Error::Format(format!(
                "implausible model sizes: {} layers, {} heads, head_dim {}, hidden {}, intermediate {}, vocab {}",
                self.num_layers,
                self.num_heads,
                self.head_dim,
                self.hidden_size,
                self.intermediate_size,
                self.vocab_size
            )));
        }
        let ok = self.num_heads > 0
            && self.num_kv_heads > 0
            && self.num_heads.is_multiple_of(self.num_kv_heads)
            && self.head_dim > 0
            && self.head_dim.is_multiple_of(2)
            && self.hidden_size > 0
            && self.intermediate_size > 0
            && self.vocab_size > 0
            && self.num_layers > 0;
        if !ok {
            return Err(Error::Format(format!(
                "inconsistent model sizes: {} heads, {} kv heads, head_dim {}, hidden {}, vocab {}",
                self.num_heads, self.num_kv_heads, self.head_dim, self.hidden_size, self.vocab_size
            )));
        }
        // Out of range, these loaded and made every logit NaN: perplexity
        // came out null with exit 0.
        let positive = |value: f64| value.is_finite() && value > 0.0;
        let out_of_range = if !positive(self.rms_norm_eps) {
            Some(format!("rms_norm_eps {}", self.rms_norm_eps))
        } else if !positive(self.rope_theta) {
            Some(format!("rope_theta {}", self.rope_theta))
        } else if self.max_position_embeddings == 0 {
            Some("a context length (max_position_embeddings) of 0".to_owned())
        } else if let RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } = self.rope_scaling
            && !([
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            ]
            .into_iter()
            .all(positive)
                && low_freq_factor < high_freq_factor)
        {
            Some(format!(
                "llama3 rope scaling factor {factor}, low_freq_factor {low_freq_factor}, \
                 high_freq_factor {high_freq_factor}, original_max_position_embeddings \
                 {original_max_position_embeddings}"
            ))
        } else {
            None
        };
        if let Some(what) = out_of_range {
            return Err(Error::Format(format!(
                "{what} is out of range: epsilon, RoPE base, context length and scaling factors \
                 must be positive and finite (and low_freq_factor < high_freq_factor)"
            )));
        }
        Ok(self)
    }

    /// From a Hugging Face `config.json`.
    pub fn from_hf(json: &Value) -> Result<Self> {
        let architecture = json["architectures"]
            .get(0)
            .and_then(Value::as_str)
            .or_else(|| json["model_type"].as_str())
            .ok_or_else(|| Error::Format("config.json names no architecture".into()))?;
        let family = family_from_architecture(architecture)?;
        let usize_of = |key: &str| -> Result<usize> {
            json[key].as_u64().map(|v| v as usize).ok_or_else(|| {
                Error::Format(format!("config.json: {key} missing or not an integer"))
            })
        };
        let hidden_size = usize_of("hidden_size")?;
        let num_heads = usize_of("num_attention_heads")?;
        let head_dim = json["head_dim"]
            .as_u64()
            .map_or(hidden_size / num_heads.max(1), |v| v as usize);
        let rope_scaling = match json.get("rope_scaling").filter(|v| !v.is_null()) {
            None => RopeScaling::None,
            Some(s) => {
                let kind = s["rope_type"].as_str().or_else(|| s["type"].as_str());
                match kind {
                    Some("llama3") => {
                        let f = |key: &str| {
                            s[key].as_f64().ok_or_else(|| {
                                Error::Format(format!("config.json: rope_scaling.{key} missing"))
                            })
                        };
                        RopeScaling::Llama3 {
                            factor: f("factor")?,
                            low_freq_factor: f("low_freq_factor")?,
                            high_freq_factor: f("high_freq_factor")?,
                            original_max_position_embeddings: f(
                                "original_max_position_embeddings",
                            )?,
                        }
                    }
                    Some("default") | None => RopeScaling::None,
                    Some(other) => {
                        return Err(Error::Unsupported(format!("rope_scaling type {other:?}")));
                    }
                }
            }
        };
        let eos_token_ids = match &json["eos_token_id"] {
            Value::Number(n) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
            Value::Array(a) => a
                .iter()
                .filter_map(Value::as_u64)
                .map(|v| v as u32)
                .collect(),
            _ => Vec::new(),
        };
        Self {
            family,
            hidden_size,
            intermediate_size: usize_of("intermediate_size")?,
            num_layers: usize_of("num_hidden_layers")?,
            num_heads,
            num_kv_heads: json["num_key_value_heads"]
                .as_u64()
                .map_or(num_heads, |v| v as usize),
            head_dim,
            vocab_size: usize_of("vocab_size")?,
            rms_norm_eps: json["rms_norm_eps"].as_f64().unwrap_or(1e-6),
            rope_theta: json["rope_theta"].as_f64().unwrap_or(10_000.0),
            rope_scaling,
            max_position_embeddings: json["max_position_embeddings"]
                .as_u64()
                .map_or(4096, |v| v as usize),
            attention_bias: family == Family::Qwen2
                || json["attention_bias"].as_bool().unwrap_or(false),
            eos_token_ids,
            bos_token_id: json["bos_token_id"].as_u64().map(|v| v as u32),
        }
        .validate()
    }

    /// As a Hugging Face `config.json` ([`LlamaConfig::from_hf`] reads it
    /// back to an equal config), so a model loaded from GGUF can be written
    /// as a Hugging Face directory.
    pub fn to_hf(&self) -> Value {
        let (architecture, model_type) = match self.family {
            Family::Llama => ("LlamaForCausalLM", "llama"),
            Family::Mistral => ("MistralForCausalLM", "mistral"),
            Family::Qwen2 => ("Qwen2ForCausalLM", "qwen2"),
        };
        let rope_scaling = match self.rope_scaling {
            RopeScaling::None => Value::Null,
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => serde_json::json!({
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original_max_position_embeddings,
            }),
        };
        serde_json::json!({
            "architectures": [architecture],
            "model_type": model_type,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "eos_token_id": self.eos_token_ids,
            "bos_token_id": self.bos_token_id,
            "torch_dtype": "float32",
        })
    }

    /// From GGUF metadata.
    pub fn from_gguf(header: &GgufHeader) -> Result<Self> {
        let arch = header.get_str("general.architecture")?;
        let family = family_from_architecture(arch)?;
        let key = |k: &str| format!("{arch}.{k}");
        let hidden_size = header.get_u64(&key("embedding_length"))? as usize;
        let num_heads = header.get_u64(&key("attention.head_count"))? as usize;
        let num_kv_heads = header
            .get_u64(&key("attention.head_count_kv"))
            .map_or(num_heads, |v| v as usize);
        let head_dim = header
            .get_u64(&key("attention.key_length"))
            .map_or(hidden_size / num_heads.max(1), |v| v as usize);
        let vocab_size = match header.get_u64(&key("vocab_size")) {
            Ok(v) => v as usize,
            Err(_) => header
                .get("tokenizer.ggml.tokens")?
                .as_array()
                .map(<[_]>::len)
                .ok_or_else(|| Error::Format("tokenizer.ggml.tokens is not an array".into()))?,
        };
        let rope_scaling = match header.get_str(&key("rope.scaling.type")) {
            Ok("llama3") => RopeScaling::Llama3 {
                factor: header.get_f64(&key("rope.scaling.factor"))?,
                low_freq_factor: header.get_f64(&key("rope.scaling.low_freq_factor"))?,
                high_freq_factor: header.get_f64(&key("rope.scaling.high_freq_factor"))?,
                original_max_position_embeddings: header
                    .get_f64(&key("rope.scaling.original_context_length"))?,
            },
            _ => RopeScaling::None,
        };
        Self {
            family,
            hidden_size,
            intermediate_size: header.get_u64(&key("feed_forward_length"))? as usize,
            num_layers: header.get_u64(&key("block_count"))? as usize,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            rms_norm_eps: header.get_f64(&key("attention.layer_norm_rms_epsilon"))?,
            rope_theta: header.get_f64(&key("rope.freq_base")).unwrap_or(10_000.0),
            rope_scaling,
            max_position_embeddings: header
                .get_u64(&key("context_length"))
                .map_or(4096, |v| v as usize),
            attention_bias: family == Family::Qwen2,
            eos_token_ids: header
                .get_u64("tokenizer.ggml.eos_token_id")
                .map(|v| vec![v as u32])
                .unwrap_or_default(),
            bos_token_id: header
                .get_u64("tokenizer.ggml.bos_token_id")
                .ok()
                .map(|v| v as u32),
        }
        .validate()
    }

    /// Inverse frequencies of the rotary embedding, `head_dim / 2` of them,
    /// with Llama 3 scaling applied (as in Meta's reference implementation).
    pub fn inverse_frequencies(&self) -> Vec<f32> {
        let half = self.head_dim / 2;
        (0..half)
            .map(|i| {
                let base = 1.0 / self.rope_theta.powf(2.0 * i as f64 / self.head_dim as f64);
                let scaled = match self.rope_scaling {
                    RopeScaling::None => base,
                    RopeScaling::Llama3 {
                        factor,
                        low_freq_factor,
                        high_freq_factor,
                        original_max_position_embeddings: original,
                    } => {
                        let wavelength = 2.0 * std::f64::consts::PI / base;
                        let low_freq_wavelength = original / low_freq_factor;
                        let high_freq_wavelength = original / high_freq_factor;
                        if wavelength < high_freq_wavelength {
                            base
                        } else if wavelength > low_freq_wavelength {
                            base / factor
                        } else {
                            let smooth = (original / wavelength - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * base / factor + smooth * base
                        }
                    }
                };
                scaled as f32
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_hf_config_and_refuses_unknown_architectures() {
        let json = serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 100, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            "eos_token_id": [1, 2]
        });
        let c = LlamaConfig::from_hf(&json).unwrap();
        assert_eq!(
            (c.head_dim, c.num_kv_heads, c.eos_token_ids.clone()),
            (16, 2, vec![1, 2])
        );
        assert!(matches!(c.rope_scaling, RopeScaling::Llama3 { .. }));
        let mut bad = json.clone();
        bad["architectures"] = serde_json::json!(["GPTNeoXForCausalLM"]);
        let err = LlamaConfig::from_hf(&bad).unwrap_err().to_string();
        assert!(err.contains("GPTNeoXForCausalLM"), "{err}");
    }

    #[test]
    fn epsilon_rope_base_context_and_scaling_must_be_in_range() {
        let base = serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100
        });
        LlamaConfig::from_hf(&base).unwrap();
        let scaling = serde_json::json!({"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 4.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192});
        // Each loaded before and made every logit NaN (perplexity `null`).
        for (key, value, expected) in [
            ("rms_norm_eps", serde_json::json!(0.0), "rms_norm_eps 0"),
            (
                "rms_norm_eps",
                serde_json::json!(-1e-5),
                "rms_norm_eps -0.00001",
            ),
            ("rope_theta", serde_json::json!(0.0), "rope_theta 0"),
            (
                "rope_theta",
                serde_json::json!(-10000.0),
                "rope_theta -10000",
            ),
            (
                "max_position_embeddings",
                serde_json::json!(0),
                "context length",
            ),
            ("rope_scaling", scaling, "llama3 rope scaling"),
        ] {
            let mut json = base.clone();
            json[key] = value;
            let error = LlamaConfig::from_hf(&json).unwrap_err().to_string();
            assert!(
                error.contains(expected) && error.contains("out of range"),
                "{key}: {error}"
            );
        }
    }

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let mut c = LlamaConfig::from_hf(&serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 1,
            "num_hidden_layers": 1, "num_attention_heads": 32, "vocab_size": 1,
            "rope_theta": 500000.0
        }))
        .unwrap();
        let plain = c.inverse_frequencies();
        c.rope_scaling = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        };
        let scaled = c.inverse_frequencies();
        assert_eq!(scaled[0], plain[0], "highest frequency unchanged");
        let last = plain.len() - 1;
        assert!((scaled[last] * 8.0 - plain[last]).abs() < plain[last] * 1e-6);
    }
}
