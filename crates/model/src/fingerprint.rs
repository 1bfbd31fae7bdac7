//! The determinism fingerprint: a hash of every activation a fixed probe batch
//! produces. Two workers whose fingerprints agree compute the same activations
//! (bit for bit) and so the same calibration statistics; matching instruction
//! sets are not enough, since matmul blocking can follow cache sizes.

use qforge_core::{Digest, DigestBuilder, SplitMix64};

use crate::error::Result;
use crate::llama::{Llama, Logits};
use crate::mlp::MlpPolicy;
use crate::observe::Observer;

/// Hashes everything it observes, in order.
#[derive(Default)]
struct HashingObserver(DigestBuilder);

impl Observer for HashingObserver {
    fn observe(&mut self, point: &str, rows: &[f32], width: usize) -> Result<()> {
        self.0.update(point.as_bytes());
        self.0.update(&(width as u64).to_le_bytes());
        for v in rows {
            self.0.update(&v.to_bits().to_le_bytes());
        }
        Ok(())
    }
}

/// The seed of both probes' draws ("QFORGE"): a fingerprint compares
/// machines only while every build draws the same probe.
const PROBE_SEED: u64 = 0x5146_4f52_4745;

/// Fingerprint of a decoder: a batch of two sequences (16 and 11 tokens, so
/// padding is exercised) of pseudo-random token ids.
pub fn llm_fingerprint(model: &Llama) -> Result<Digest> {
    let mut observer = HashingObserver::default();
    let logits = llm_probe(model, &mut observer)?;
    for v in logits.flatten_all()?.to_vec1::<f32>()? {
        observer.0.update(&v.to_bits().to_le_bytes());
    }
    Ok(observer.0.finish())
}

/// Runs the decoder's fixed probe batch (the fingerprint's) past `observer`;
/// returns the last position's logits.
pub fn llm_probe(model: &Llama, observer: &mut dyn Observer) -> Result<candle_core::Tensor> {
    let vocab = model.config().vocab_size as u64;
    let mut draws = SplitMix64::new(PROBE_SEED);
    let batch: Vec<Vec<u32>> = [16usize, 11]
        .iter()
        .map(|&n| (0..n).map(|_| (draws.next_u64() % vocab) as u32).collect())
        .collect();
    model.forward(&batch, None, Some(observer), Logits::Last)
}

/// Fingerprint of a policy: 64 pseudo-random observations in [−2, 2).
pub fn policy_fingerprint(policy: &MlpPolicy) -> Result<Digest> {
    let mut observer = HashingObserver::default();
    let outputs = policy_probe(policy, &mut observer)?;
    for v in outputs {
        observer.0.update(&v.to_bits().to_le_bytes());
    }
    Ok(observer.0.finish())
}

/// Runs the policy's fixed probe batch (the fingerprint's) past `observer`;
/// returns the head's outputs.
pub fn policy_probe(policy: &MlpPolicy, observer: &mut dyn Observer) -> Result<Vec<f32>> {
    let dim = policy.config().observation_dim;
    let mut draws = SplitMix64::new(PROBE_SEED);
    let observations: Vec<f32> = (0..64 * dim)
        .map(|_| (draws.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0)
        .collect();
    policy.forward(&observations, Some(observer))
}
