//! Attention whose result for a query depends on nothing but that query,
//! its keys and its values: not on how many other queries run beside it,
//! whether the keys came from a cache, or how a prompt was chunked.
//!
//! Every path of the decoder attends through [`attend_group`] (the
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

/// Attention of the query heads that share one key/value head (GQA's
/// group: `out.len() / head_dim` heads, head `g`'s query at `g ·
/// query_stride` in `queries`) over the
/// first `visible` positions of that head, which starts at `offset` in cache
/// rows of `stride` values. Each key and value is read once for the whole
/// group (a decode step at a long context is bound by reading the cache).
/// For each query: the scores in key order, their softmax, the values
/// summed in key order; nothing depends on the other queries of the group,
/// so every path that calls it gives a query the same bits.
/// `scores` holds `group · visible` values, `out` `group · head_dim`.
pub(super) fn attend_group(
    (queries, query_stride): (&[f32], usize),
    (keys, values): (&[f32], &[f32]),
    (offset, stride): (usize, usize),
    (head_dim, scale): (usize, f32),
    scores: &mut [f32],
    out: &mut [f32],
) {
    let group = out.len() / head_dim;
    let visible = scores.len() / group;
    for t in 0..visible {
        let at = t * stride + offset;
        let key = &keys[at..at + head_dim];
        for g in 0..group {
            let query = &queries[g * query_stride..g * query_stride + head_dim];
            scores[g * visible + t] = dot(query, key) * scale;
        }
    }
    for scores in scores.chunks_exact_mut(visible) {
        softmax(scores);
    }
    out.fill(0.0);
    for t in 0..visible {
        let at = t * stride + offset;
        let value = &values[at..at + head_dim];
        for (g, out) in out.chunks_exact_mut(head_dim).enumerate() {
            let p = scores[g * visible + t];
            for (o, &v) in out.iter_mut().zip(value) {
                *o += p * v;
            }
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

/// Where one sequence's keys and values lie: the key of kv head `g` at
/// position `t` starts at `g * head_step + t * stride` in `keys` (and its value
/// at the same index in `values`). A KV cache is position-major
/// (`head_step = head_dim`, `stride = kv_heads · head_dim`); the keys of a
/// forward without a cache are head-major tensors (`head_step = keys ·
/// head_dim`, `stride = head_dim`). The key and value of a position sit at the
/// same index whatever the layout, so every layout gives the same bits.
#[derive(Debug, Clone, Copy)]
pub(super) struct SequenceKv<'a> {
    pub keys: &'a [f32],
    pub values: &'a [f32],
    pub head_step: usize,
    pub stride: usize,
    /// Position of the sequence's first query.
    pub start: usize,
}

/// Causal attention of `q: [b, heads, seq, hd]` over the keys and values of
/// each sequence (`kv[s]`, whose queries sit at positions `kv[s].start..`):
/// query `i` of sequence `s` sees keys up to its own position and before the
/// sequence's padding (`lengths[s]` real tokens from its start). Every query
/// of every sequence is one task of one parallel loop, so a batched decode
/// step attends all its sequences in one call. Returns
/// `[b, seq, heads · hd]`.
pub(super) fn causal(
    q: &Tensor,
    kv: &[SequenceKv<'_>],
    kv_heads: usize,
    lengths: &[usize],
) -> Result<Tensor> {
    let (b, heads, seq, hd) = q.dims4()?;
    let fits = |s: &SequenceKv<'_>, len: usize| {
        let last = (kv_heads - 1) * s.head_step + (s.start + len - 1) * s.stride + hd;
        s.keys.len() >= last && s.values.len() >= last
    };
    if kv.len() != b
        || lengths.len() != b
        || kv_heads == 0
        || heads % kv_heads != 0
        || lengths.iter().any(|&len| len == 0 || len > seq)
        || kv.iter().zip(lengths).any(|(s, &len)| !fits(s, len))
    {
        return Err(Error::Shape(format!(
            "attention of queries {:?} over {} sequences of keys ({kv_heads} kv heads, lengths {lengths:?})",
            q.dims(),
            kv.len(),
        )));
    }
    let group = heads / kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let q = q.contiguous()?;
    let (q_storage, q_layout) = q.storage_and_layout();
    let q = values(&q_storage, q_layout, q.elem_count())?;
    let row = heads * hd;
    let mut out = vec![0f32; b * seq * row];
    // One task per (sequence, query position, key/value head): the group of
    // query heads sharing that key/value head is contiguous in the output
    // row, and a single decode step still spreads over the threads.
    out.par_chunks_mut(group * hd)
        .enumerate()
        .for_each(|(at, out)| {
            let (s, i, g) = (at / (seq * kv_heads), at / kv_heads % seq, at % kv_heads);
            let sequence = &kv[s];
            // A padding query (never observed) sees the real keys only.
            let visible = sequence.start + (i + 1).min(lengths[s]);
            let query = ((s * heads + g * group) * seq + i) * hd;
            SCORES.with_borrow_mut(|scores| {
                if scores.len() < group * visible {
                    scores.resize(group * visible, 0.0);
                }
                attend_group(
                    (&q[query..], seq * hd),
                    (sequence.keys, sequence.values),
                    (g * sequence.head_step, sequence.stride),
                    (hd, scale),
                    &mut scores[..group * visible],
                    out,
                );
            });
        });
    Ok(Tensor::from_vec(out, (b, seq, row), &Device::Cpu)?)
}

/// [`causal`] over the keys and values of a forward without a cache,
/// `k`, `v: [b, kv_heads, keys, hd]`, every query from position 0.
pub(super) fn causal_over_tensors(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    lengths: &[usize],
) -> Result<Tensor> {
    let (b, kv_heads, keys, hd) = k.dims4()?;
    if v.dims4()? != (b, kv_heads, keys, hd) || q.dim(0)? != b || q.dim(3)? != hd {
        return Err(Error::Shape(format!(
            "attention of queries {:?} over keys {:?} and values {:?}",
            q.dims(),
            k.dims(),
            v.dims()
        )));
    }
    let (k, v) = (k.contiguous()?, v.contiguous()?);
    let (k_storage, k_layout) = k.storage_and_layout();
    let (v_storage, v_layout) = v.storage_and_layout();
    let k = values(&k_storage, k_layout, k.elem_count())?;
    let v = values(&v_storage, v_layout, v.elem_count())?;
    let per_sequence = kv_heads * keys * hd;
    let kv: Vec<SequenceKv<'_>> = k
        .chunks_exact(per_sequence.max(1))
        .zip(v.chunks_exact(per_sequence.max(1)))
        .map(|(keys_of, values_of)| SequenceKv {
            keys: keys_of,
            values: values_of,
            head_step: keys * hd,
            stride: hd,
            start: 0,
        })
        .collect();
    causal(q, &kv, kv_heads, lengths)
}

/// The `len` f32 values of a contiguous CPU tensor's storage, in place.
pub(super) fn values<'a>(storage: &'a Storage, layout: &Layout, len: usize) -> Result<&'a [f32]> {
    let Storage::Cpu(cpu) = storage else {
        return Err(Error::Unsupported("attention off the CPU".into()));
    };
    let start = layout.start_offset();
    Ok(&cpu.as_slice::<f32>()?[start..start + len])
}
