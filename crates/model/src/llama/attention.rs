//! Attention whose result for a query depends on nothing but that query,
//! its keys and its values: not on how many other queries run beside it,
//! whether the keys came from a cache, or how a prompt was chunked.
//!
//! Every path of the decoder attends through [`attend_head`] (the
//! batched forward and `step` here, the INT8 decoder in `decode`), so a
//! prefill, a chunked prefill, a decode step and teacher forcing over the
//! same tokens compute the same attention bits. That matters more than it
//! seems: with dynamic INT8 activations a one-ulp difference can move a
//! value across a rounding boundary of a layer whose step is large (an
//! outlier channel sets the scale), and SmolLM2's log-probabilities then
//! moved by up to 1.4 nats between a decode and a teacher-forced pass when
//! the tensor paths attended through matrix products whose blocking
//! depends on the number of queries. The INT8 linear layers are exact
//! integer sums with per-row scales, so with attention fixed an
//! all-INT8 model scores the same tokens the same way however they are
//! batched: the rollout engine's log-probabilities are the trainer's.

use candle_core::{Device, Layout, Storage, Tensor};
use rayon::prelude::*;

use crate::error::{Error, Result};

thread_local! {
    /// Attention scores of one head, per thread (the decoder's team, rayon's
    /// pool).
    pub(super) static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Attention of one query head over the first `scores.len()` positions of
/// its key/value head, which starts at `offset` in cache rows of `stride`
/// values: the scores in key order, their softmax, the values summed in key
/// order. Nothing in it depends on other queries, so every path that calls
/// it gives a query the same bits.
pub(super) fn attend_head(
    q: &[f32],
    (keys, values): (&[f32], &[f32]),
    (offset, stride): (usize, usize),
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let hd = q.len();
    for (t, s) in scores.iter_mut().enumerate() {
        let at = t * stride + offset;
        *s = dot(q, &keys[at..at + hd]) * scale;
    }
    softmax(scores);
    out.fill(0.0);
    for (t, &p) in scores.iter().enumerate() {
        let at = t * stride + offset;
        for (o, &v) in out.iter_mut().zip(&values[at..at + hd]) {
            *o += p * v;
        }
    }
}

/// Sixteen independent partial sums, so that the loop vectorizes (a single
/// f32 running sum must add in order).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    let (a, b) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = a
        .remainder()
        .iter()
        .zip(b.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in a.zip(b) {
        for i in 0..16 {
            lanes[i] += x[i] * y[i];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

fn softmax(scores: &mut [f32]) {
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
    let mut total = 0.0;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        total += *s;
    }
    for s in scores.iter_mut() {
        *s /= total;
    }
}

/// Causal attention of `q: [b, heads, seq, hd]` (queries at positions
/// `start..start + seq`) over `k`, `v: [b, kv_heads, keys, hd]` (keys at
/// positions `0..keys`, `keys = start + seq`): query `i` of sequence `s`
/// sees keys up to its own position and before the sequence's padding
/// (`lengths[s]` real tokens from `start`). Returns `[b, seq, heads · hd]`.
pub(super) fn causal(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    start: usize,
    lengths: &[usize],
) -> Result<Tensor> {
    let (b, heads, seq, hd) = q.dims4()?;
    let (kb, kv_heads, keys, khd) = k.dims4()?;
    if kb != b
        || khd != hd
        || v.dims4()? != (b, kv_heads, keys, hd)
        || keys != start + seq
        || lengths.len() != b
        || kv_heads == 0
        || heads % kv_heads != 0
    {
        return Err(Error::Shape(format!(
            "attention of queries {:?} over keys {:?} and values {:?} from position {start}",
            q.dims(),
            k.dims(),
            v.dims()
        )));
    }
    let group = heads / kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    // Read in place: a copy of the whole cache per layer and step would
    // double what the cache's growth already copies.
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let (q_storage, q_layout) = q.storage_and_layout();
    let (k_storage, k_layout) = k.storage_and_layout();
    let (v_storage, v_layout) = v.storage_and_layout();
    let q = values(&q_storage, q_layout, q.elem_count())?;
    let k = values(&k_storage, k_layout, k.elem_count())?;
    let v = values(&v_storage, v_layout, v.elem_count())?;
    let row = heads * hd;
    let mut out = vec![0f32; b * seq * row];
    // One output row (a sequence's query position, every head) per task.
    out.par_chunks_mut(row).enumerate().for_each(|(at, out)| {
        let (s, i) = (at / seq, at % seq);
        let visible = (start + i + 1).min(start + lengths[s]);
        SCORES.with_borrow_mut(|scores| {
            if scores.len() < visible {
                scores.resize(visible, 0.0);
            }
            for (h, out) in out.chunks_exact_mut(hd).enumerate() {
                let query = ((s * heads + h) * seq + i) * hd;
                let kv = (s * kv_heads + h / group) * keys * hd;
                attend_head(
                    &q[query..query + hd],
                    (&k[kv..kv + keys * hd], &v[kv..kv + keys * hd]),
                    (0, hd),
                    scale,
                    &mut scores[..visible],
                    out,
                );
            }
        });
    });
    Ok(Tensor::from_vec(out, (b, seq, row), &Device::Cpu)?)
}

/// The `len` f32 values of a contiguous CPU tensor's storage, in place.
fn values<'a>(storage: &'a Storage, layout: &Layout, len: usize) -> Result<&'a [f32]> {
    let Storage::Cpu(cpu) = storage else {
        return Err(Error::Unsupported("attention off the CPU".into()));
    };
    let start = layout.start_offset();
    Ok(&cpu.as_slice::<f32>()?[start..start + len])
}
