//! The f32 KV cache that [`Llama::forward`] and [`Llama::step`] extend and the
//! INT8 decoder (`qforge-decode`) writes into in place: its buffers, how they
//! grow, and how attention reads them. It lives apart from both passes because
//! both fill the same layout.

use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::Tensor;

use super::{Llama, attention};
use crate::error::Result;

/// Keys and values of one sequence's positions seen so far, per layer,
/// head-major (`[kv_heads, capacity, head_dim]`, the layout the INT8
/// decoder keeps too): a decode step's attention reads each key/value
/// head's keys, then its values, as one contiguous run. A position's keys are
/// written in place: [`KvCache::reserve`] sizes the buffers once for a
/// sequence's whole reservation, so decoding a long sequence never copies
/// what is cached (without a reservation the capacity doubles as it runs
/// out, copying once per doubling).
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    pub(super) layers: Vec<CachedLayer>,
    pub(super) len: usize,
    /// Positions each head's run holds room for.
    pub(super) capacity: usize,
    pub(super) kv_heads: usize,
    pub(super) head_dim: usize,
    /// The positions this cache holds bit for bit in common with the
    /// caches [`KvCache::fork`]ed with it (see [`SharedPrefix`]).
    shared: Option<SharedPrefix>,
}

/// The first `len` positions of every cache that carries the same `id`:
/// the same bits in each, because they were one cache when it was
/// [`KvCache::fork`]ed and committed positions are never written again.
/// The INT8 decoder reads such a prefix once for all the siblings that
/// step together (GRPO's `n` samples of one prompt) instead of once each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedPrefix {
    /// Which fork the caches come from (unique in the process).
    pub id: u64,
    /// Positions held in common.
    pub len: usize,
}

/// The next fork's [`SharedPrefix::id`].
static NEXT_FORK: AtomicU64 = AtomicU64::new(0);

/// One layer's cached keys and values, `[kv_heads, capacity, head_dim]`
/// each; positions from the cache's `len` on hold nothing committed.
#[derive(Debug, Clone, Default)]
pub(super) struct CachedLayer {
    pub(super) keys: Vec<f32>,
    pub(super) values: Vec<f32>,
}

impl KvCache {
    /// Number of cached positions.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// A copy of this cache for a sibling sequence (another sample of the
    /// same prompt), both marked as holding their committed positions in
    /// common. Forks at one length are one family (the `n` samples of a
    /// prompt); a fork after the cache grew starts a new family, which the
    /// caches of the old one, shorter in common, are not part of.
    pub fn fork(&mut self) -> KvCache {
        if self.shared.is_none_or(|shared| shared.len != self.len) {
            self.shared = Some(SharedPrefix {
                id: NEXT_FORK.fetch_add(1, Ordering::Relaxed),
                len: self.len,
            });
        }
        self.clone()
    }

    /// The positions this cache shares with the caches forked with it, if
    /// any were.
    #[inline]
    pub fn shared_prefix(&self) -> Option<SharedPrefix> {
        self.shared
    }

    /// Makes room for `positions` positions in all (cached ones included),
    /// so that growing to them allocates nothing more.
    pub fn reserve(&mut self, positions: usize) {
        if positions > self.capacity {
            self.grow_to(positions);
        }
    }

    /// Positions the cache holds room for without reallocating.
    #[inline]
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Values per key (or value) head of a position.
    #[inline]
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Makes room for `positions` positions in all, doubling the capacity
    /// when it runs out (so appending one position at a time copies the
    /// cache once per doubling).
    pub fn make_room_for(&mut self, positions: usize) {
        if positions > self.capacity {
            self.grow_to(positions.max(2 * self.capacity));
        }
    }

    /// Layer `layer`'s keys and values, `[kv_heads, capacity, head_dim]`
    /// each; positions from [`KvCache::len`] on hold nothing committed.
    #[inline]
    pub fn layer(&self, layer: usize) -> (&[f32], &[f32]) {
        let cached = &self.layers[layer];
        (&cached.keys, &cached.values)
    }

    /// Layer `layer`'s keys and values to write the next positions into in
    /// place (the INT8 decoder's store), before [`KvCache::commit`].
    #[inline]
    pub fn layer_mut(&mut self, layer: usize) -> (&mut [f32], &mut [f32]) {
        let cached = &mut self.layers[layer];
        (&mut cached.keys, &mut cached.values)
    }

    /// Commits the next `positions` positions, whose keys and values the
    /// caller has written in every layer. Beyond the capacity is a bug of
    /// the caller's, refused with a panic.
    #[inline]
    pub fn commit(&mut self, positions: usize) {
        assert!(
            self.len + positions <= self.capacity,
            "committing {positions} positions after {} in a cache of {}",
            self.len,
            self.capacity
        );
        self.len += positions;
    }

    /// Moves every layer into buffers of `capacity` positions per head,
    /// each head's run copied whole (a forward under way may have written
    /// past `len` in some layers).
    pub(super) fn grow_to(&mut self, capacity: usize) {
        let (old, hd) = (self.capacity, self.head_dim);
        for layer in &mut self.layers {
            for buffer in [&mut layer.keys, &mut layer.values] {
                let mut grown = vec![0f32; self.kv_heads * capacity * hd];
                if old > 0 {
                    for (from, to) in buffer
                        .chunks_exact(old * hd)
                        .zip(grown.chunks_exact_mut(capacity * hd))
                    {
                        to[..old * hd].copy_from_slice(from);
                    }
                }
                *buffer = grown;
            }
        }
        self.capacity = capacity;
    }

    /// Writes into layer `layer`, at the positions after the committed
    /// ones, the keys and values of sequence `sequence` of `k`, `v: [b,
    /// kv_heads, seq, head_dim]`: each head's `seq` rows are one run in both.
    pub(super) fn append(
        &mut self,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
        sequence: usize,
    ) -> Result<()> {
        let (b, kv_heads, seq, hd) = k.dims4()?;
        if (kv_heads, hd) != (self.kv_heads, self.head_dim)
            || v.dims4()? != (b, kv_heads, seq, hd)
            || sequence >= b
        {
            return Err(qforge_formats::Error::Shape(format!(
                "keys {:?} and values {:?} for a cache of {} kv heads of {} values",
                k.dims(),
                v.dims(),
                self.kv_heads,
                self.head_dim
            ))
            .into());
        }
        self.make_room_for(self.len + seq);
        let (at, capacity) = (self.len * hd, self.capacity * hd);
        let cached = &mut self.layers[layer];
        for (tensor, target) in [(k, &mut cached.keys), (v, &mut cached.values)] {
            let tensor = tensor.contiguous()?;
            let (storage, layout) = tensor.storage_and_layout();
            let all = attention::values(&storage, layout, tensor.elem_count())?;
            let of_sequence = &all[sequence * kv_heads * seq * hd..][..kv_heads * seq * hd];
            for (head, rows) in of_sequence.chunks_exact(seq * hd).enumerate() {
                target[head * capacity + at..][..seq * hd].copy_from_slice(rows);
            }
        }
        Ok(())
    }

    /// The cached keys and values of `layer` as attention reads them, the
    /// queries from position `start`.
    pub(super) fn view(&self, layer: usize, start: usize) -> attention::SequenceKv<'_> {
        let cached = &self.layers[layer];
        attention::SequenceKv {
            keys: &cached.keys,
            values: &cached.values,
            head_step: self.capacity * self.head_dim,
            stride: self.head_dim,
            start,
        }
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Llama {
    /// Bytes one position of one sequence takes in a [`KvCache`]: an f32
    /// key and value per layer and key/value head.
    pub fn kv_bytes_per_position(&self) -> usize {
        let c = &self.config;
        2 * self.layers.len() * c.num_kv_heads * c.head_dim * std::mem::size_of::<f32>()
    }

    /// An empty KV cache for this model.
    pub fn new_cache(&self) -> KvCache {
        KvCache {
            layers: vec![CachedLayer::default(); self.layers.len()],
            len: 0,
            capacity: 0,
            kv_heads: self.config.num_kv_heads,
            head_dim: self.config.head_dim,
            shared: None,
        }
    }

    /// Refuses a KV cache made for another model.
    pub fn check_cache(&self, cache: &KvCache) -> Result<()> {
        let c = &self.config;
        if cache.layers.len() != self.layers.len()
            || (cache.kv_heads, cache.head_dim) != (c.num_kv_heads, c.head_dim)
        {
            return Err(qforge_formats::Error::Shape(format!(
                "a KV cache of {} layers of {} kv heads of {} values for a model of {} layers of {} of {}",
                cache.layers.len(),
                cache.kv_heads,
                cache.head_dim,
                self.layers.len(),
                c.num_kv_heads,
                c.head_dim
            )).into());
        }
        Ok(())
    }
}
