//! Attention whose result for a query depends on nothing but that query,
//! its keys and its values: not on how many other queries run beside it,
//! whether the keys came from a cache, or how a prompt was chunked.
//!
//! Every path of the decoder attends through the kernel
//! [`qforge_kernels::attention::attend`] (the batched forward and
//! `step` here, the INT8 decoder in `decode`), whose arithmetic is fixed to
//! the order of every addition and the same on every CPU tier, so a
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
use qforge_kernels::attention::{KeyValues, Queries, Split, attend};
use rayon::prelude::*;

use crate::error::Result;

/// Where one sequence's keys and values lie, per key/value head: a KV
/// cache's heads (its positions after a shared prefix in its own buffers),
/// or the keys of a forward without a cache. Which buffer a position's key
/// comes from changes no bit of the result.
#[derive(Debug, Clone)]
pub(super) struct SequenceKv<'a> {
    pub heads: Vec<Split<'a>>,
    /// Position of the sequence's first query.
    pub start: usize,
}

/// Query positions of one sequence attended together: each block of keys
/// and values read then serves this many positions' queries. Measured on
/// SmolLM2's 8 192-token INT8 prefill (see BENCHMARKS.md).
const TILE: usize = 4;

/// Causal attention of `q: [b, heads, seq, hd]` over the keys and values of
/// each sequence (`kv[s]`, whose queries sit at positions `kv[s].start..`):
/// query `i` of sequence `s` sees keys up to its own position and before the
/// sequence's padding (`lengths[s]` real tokens from its start). Each tile
/// of [`TILE`] query positions of one key/value head of one sequence is one
/// task of one parallel loop, so a batched decode step attends all its
/// sequences in one call and a prefill spreads over the threads by tiles.
/// Returns `[b, seq, heads · hd]`.
pub(super) fn causal(
    q: &Tensor,
    kv: &[SequenceKv<'_>],
    kv_heads: usize,
    lengths: &[usize],
) -> Result<Tensor> {
    let (b, heads, seq, hd) = q.dims4()?;
    if kv.len() != b
        || lengths.len() != b
        || kv_heads == 0
        || heads % kv_heads != 0
        || lengths.iter().any(|&len| len == 0 || len > seq)
        || kv.iter().any(|s| s.heads.len() != kv_heads)
    {
        return Err(qforge_formats::Error::Shape(format!(
            "attention of queries {:?} over {} sequences of keys ({kv_heads} kv heads, lengths {lengths:?})",
            q.dims(),
            kv.len(),
        )).into());
    }
    let group = heads / kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let q = q.contiguous()?;
    let (q_storage, q_layout) = q.storage_and_layout();
    let q = values(&q_storage, q_layout, q.elem_count())?;
    let tiles = seq.div_ceil(TILE);
    let tile_len = TILE * group * hd;
    // The tiles' outputs, `[b, kv_heads, tiles · TILE, group, hd]`: a tile
    // holds its positions' heads of one key/value group, which the output
    // row interleaves with the other groups', so they are put in place
    // after.
    let mut tiled = vec![0f32; b * kv_heads * tiles * tile_len];
    tiled
        .par_chunks_mut(tile_len)
        .enumerate()
        .try_for_each(|(at, out)| {
            let (s, g, tile) = (at / (kv_heads * tiles), at / tiles % kv_heads, at % tiles);
            let sequence = &kv[s];
            let first = tile * TILE;
            let positions = TILE.min(seq - first);
            // A padding query (never observed) sees the real keys only.
            let mut visible = [0; TILE];
            for (j, visible) in visible[..positions].iter_mut().enumerate() {
                *visible = sequence.start + (first + j + 1).min(lengths[s]);
            }
            let query = ((s * heads + g * group) * seq + first) * hd;
            attend(
                Queries {
                    rows: &q[query..],
                    head_stride: seq * hd,
                    position_stride: hd,
                    visible: &visible[..positions],
                },
                sequence.heads[g],
                hd,
                scale,
                &mut out[..positions * group * hd],
            )
        })?;
    let row = heads * hd;
    let mut out = vec![0f32; b * seq * row];
    for (at, attended) in out.chunks_exact_mut(group * hd).enumerate() {
        let (s, i, g) = (at / (seq * kv_heads), at / kv_heads % seq, at % kv_heads);
        let from = ((s * kv_heads + g) * tiles * TILE + i) * group * hd;
        attended.copy_from_slice(&tiled[from..from + group * hd]);
    }
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
        return Err(qforge_formats::Error::Shape(format!(
            "attention of queries {:?} over keys {:?} and values {:?}",
            q.dims(),
            k.dims(),
            v.dims()
        ))
        .into());
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
            heads: (0..kv_heads)
                .map(|g| {
                    KeyValues {
                        keys: keys_of,
                        values: values_of,
                        offset: g * keys * hd,
                        stride: hd,
                    }
                    .into()
                })
                .collect(),
            start: 0,
        })
        .collect();
    causal(q, &kv, kv_heads, lengths)
}

/// The `len` f32 values of a contiguous CPU tensor's storage, in place.
pub(super) fn values<'a>(storage: &'a Storage, layout: &Layout, len: usize) -> Result<&'a [f32]> {
    let Storage::Cpu(cpu) = storage else {
        return Err(qforge_formats::Error::Unsupported("attention off the CPU".into()).into());
    };
    let start = layout.start_offset();
    Ok(&cpu.as_slice::<f32>()?[start..start + len])
}
