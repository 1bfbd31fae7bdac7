//! The f32 KV cache that [`Llama::forward`] and [`Llama::step`] extend and the
//! INT8 decoder (`qforge-decode`) writes into in place: its buffers, how they
//! grow, and how attention reads them. It lives apart from both passes because
//! both fill the same layout.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::Tensor;
use qforge_kernels::attention::{KeyValues, Own, Split};

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
///
/// Caches [`KvCache::fork`]ed from one (the `n` samples of a prompt) store
/// the positions they were forked at once, in a read-only prefix they
/// share, and each its own positions after it.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    /// This cache's own positions, from [`KvCache::base`] on: `[kv_heads,
    /// capacity − base, head_dim]` per layer.
    pub(super) layers: Vec<CachedLayer>,
    pub(super) len: usize,
    /// Positions the cache holds room for, the shared prefix's included.
    pub(super) capacity: usize,
    pub(super) kv_heads: usize,
    pub(super) head_dim: usize,
    /// The positions before this cache's own, stored once for the caches
    /// forked with it.
    prefix: Option<Arc<Prefix>>,
}

/// The first `len` positions of every cache that carries the same `id`:
/// one read-only copy that they share, made when they were
/// [`KvCache::fork`]ed. The INT8 decoder reads such a prefix once for all
/// the siblings that step together (GRPO's `n` samples of one prompt)
/// instead of once each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedPrefix {
    /// Which fork the caches come from (unique in the process).
    pub id: u64,
    /// Positions held in common.
    pub len: usize,
}

/// A shared prefix's keys and values, `[kv_heads, len, head_dim]` per layer.
#[derive(Debug)]
struct Prefix {
    shared: SharedPrefix,
    layers: Vec<CachedLayer>,
}

/// The next fork's [`SharedPrefix::id`].
static NEXT_FORK: AtomicU64 = AtomicU64::new(0);

/// One layer's cached keys and values, each key/value head's positions one
/// run.
#[derive(Debug, Clone, Default)]
pub(super) struct CachedLayer {
    pub(super) keys: Vec<f32>,
    pub(super) values: Vec<f32>,
}

/// One key/value head of one layer of a [`KvCache`], as attention reads
/// it: positions before `base` from the shared prefix, the rest from the
/// cache's own keys and values.
#[derive(Debug, Clone, Copy)]
pub struct CachedHead<'a> {
    /// The shared prefix's positions (`None`: the cache has none, and
    /// `base` is 0).
    pub prefix: Option<KeyValues<'a>>,
    /// Positions in the prefix.
    pub base: usize,
    /// Position `base` and the ones after it.
    pub own: KeyValues<'a>,
}

impl<'a> From<CachedHead<'a>> for Split<'a> {
    /// The head as the attention kernel reads one sequence's cache.
    fn from(head: CachedHead<'a>) -> Self {
        match head.prefix {
            Some(prefix) => Split {
                prefix,
                len: head.base,
                own: Own::One(head.own),
            },
            None => head.own.into(),
        }
    }
}

impl KvCache {
    /// Number of cached positions.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// A cache for a sibling sequence (another sample of the same
    /// prompt), with room for as many positions as this one. The committed
    /// positions move into a read-only prefix that both share, stored once;
    /// each goes on in its own keys and values. Forks at one length are one
    /// family (the `n` samples of a prompt); a fork after the cache grew
    /// starts a new family (its prefix a copy of the old one and what
    /// came after), which the caches of the old one are not part of.
    pub fn fork(&mut self) -> KvCache {
        if self
            .prefix
            .as_ref()
            .is_none_or(|p| p.shared.len != self.len)
        {
            self.freeze();
        }
        self.sibling()
    }

    /// A cache of this one's shape, length and prefix that holds no
    /// positions of its own yet, with room for as many positions as this
    /// one. Meant for a cache whose committed positions are all in its
    /// prefix.
    fn sibling(&self) -> KvCache {
        let mut sibling = KvCache {
            layers: vec![CachedLayer::default(); self.layers.len()],
            len: self.len,
            capacity: self.len,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            prefix: self.prefix.clone(),
        };
        sibling.reserve(self.capacity);
        sibling
    }

    /// Moves every committed position into a new shared prefix (one copy,
    /// each head's run compact) and gives this cache fresh own buffers for
    /// the room it had after them.
    fn freeze(&mut self) {
        let (base, len, hd) = (self.base(), self.len, self.head_dim);
        let (room, heads) = (self.capacity - base, self.kv_heads);
        let earlier = self.prefix.take();
        let layers = self
            .layers
            .iter()
            .enumerate()
            .map(|(l, own)| {
                // Without an earlier prefix `base` is 0 and it adds nothing.
                let frozen = |old: &[f32], own: &[f32]| {
                    let mut run = Vec::with_capacity(heads * len * hd);
                    for head in 0..heads {
                        run.extend_from_slice(&old[head * base * hd..][..base * hd]);
                        run.extend_from_slice(&own[head * room * hd..][..(len - base) * hd]);
                    }
                    run
                };
                let old = earlier.as_ref().map(|p| &p.layers[l]);
                CachedLayer {
                    keys: frozen(old.map_or(&[], |old| &old.keys), &own.keys),
                    values: frozen(old.map_or(&[], |old| &old.values), &own.values),
                }
            })
            .collect();
        self.prefix = Some(Arc::new(Prefix {
            shared: SharedPrefix {
                id: NEXT_FORK.fetch_add(1, Ordering::Relaxed),
                len,
            },
            layers,
        }));
        *self = self.sibling();
    }

    /// The positions this cache shares with the caches forked with it, if
    /// any were.
    #[inline]
    pub fn shared_prefix(&self) -> Option<SharedPrefix> {
        self.prefix.as_ref().map(|p| p.shared)
    }

    /// Positions held in the shared prefix (0 without one): the cache's
    /// own keys and values start at this position.
    #[inline]
    pub fn base(&self) -> usize {
        self.prefix.as_ref().map_or(0, |p| p.shared.len)
    }

    /// Positions this cache stores itself, committed or room: what it costs
    /// beside the prefix it shares.
    #[inline]
    pub fn own_capacity(&self) -> usize {
        self.capacity - self.base()
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

    /// Key/value head `kv_head` of layer `layer`, as attention reads it.
    #[inline]
    pub fn head(&self, layer: usize, kv_head: usize) -> CachedHead<'_> {
        let hd = self.head_dim;
        let base = self.base();
        let own = &self.layers[layer];
        CachedHead {
            prefix: self.prefix.as_ref().map(|p| KeyValues {
                keys: &p.layers[layer].keys,
                values: &p.layers[layer].values,
                offset: kv_head * base * hd,
                stride: hd,
            }),
            base,
            own: KeyValues {
                keys: &own.keys,
                values: &own.values,
                offset: kv_head * (self.capacity - base) * hd,
                stride: hd,
            },
        }
    }

    /// Layer `layer`'s own keys and values to write the next positions
    /// into in place (the INT8 decoder's store), before
    /// [`KvCache::commit`]: `[kv_heads, own_capacity, head_dim]` each,
    /// position [`KvCache::base`] first.
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

    /// Moves every layer's own positions into buffers of room for
    /// `capacity` positions in all, each head's run copied whole (a forward
    /// under way may have written past `len` in some layers).
    pub(super) fn grow_to(&mut self, capacity: usize) {
        let (base, hd) = (self.base(), self.head_dim);
        let (old, room) = (self.capacity - base, capacity - base);
        for layer in &mut self.layers {
            for buffer in [&mut layer.keys, &mut layer.values] {
                let mut grown = vec![0f32; self.kv_heads * room * hd];
                if old > 0 {
                    for (from, to) in buffer
                        .chunks_exact(old * hd)
                        .zip(grown.chunks_exact_mut(room * hd))
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
        let (at, room) = ((self.len - self.base()) * hd, self.own_capacity() * hd);
        let cached = &mut self.layers[layer];
        for (tensor, target) in [(k, &mut cached.keys), (v, &mut cached.values)] {
            let tensor = tensor.contiguous()?;
            let (storage, layout) = tensor.storage_and_layout();
            let all = attention::values(&storage, layout, tensor.elem_count())?;
            let of_sequence = &all[sequence * kv_heads * seq * hd..][..kv_heads * seq * hd];
            for (head, rows) in of_sequence.chunks_exact(seq * hd).enumerate() {
                target[head * room + at..][..seq * hd].copy_from_slice(rows);
            }
        }
        Ok(())
    }

    /// The cached keys and values of `layer` as attention reads them, the
    /// queries from position `start`.
    pub(super) fn view(&self, layer: usize, start: usize) -> attention::SequenceKv<'_> {
        attention::SequenceKv {
            heads: (0..self.kv_heads)
                .map(|g| self.head(layer, g).into())
                .collect(),
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
            prefix: None,
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

#[cfg(test)]
mod tests {
    use super::*;

    const HEAD_DIM: usize = 4;

    /// What the key of `(layer, head, position)` holds in every value
    /// (its value holds the negation).
    fn code(layer: usize, head: usize, position: usize) -> f32 {
        (position * 100 + head * 10 + layer) as f32
    }

    /// Writes and commits the next `positions` positions, as the INT8
    /// decoder's store does.
    fn write(cache: &mut KvCache, positions: usize) {
        let (len, base, room) = (cache.len(), cache.base(), cache.own_capacity());
        for layer in 0..cache.layers.len() {
            let heads = cache.kv_heads;
            let (keys, values) = cache.layer_mut(layer);
            for head in 0..heads {
                for t in len..len + positions {
                    let at = (head * room + t - base) * HEAD_DIM;
                    keys[at..at + HEAD_DIM].fill(code(layer, head, t));
                    values[at..at + HEAD_DIM].fill(-code(layer, head, t));
                }
            }
        }
        cache.commit(positions);
    }

    /// Asserts that attention would read every committed position's key
    /// and value back (`what` names the cache).
    fn assert_reads_back(cache: &KvCache, what: &str) {
        for layer in 0..cache.layers.len() {
            for head in 0..cache.kv_heads {
                let h = cache.head(layer, head);
                for t in 0..cache.len() {
                    let (kv, index) = match h.prefix {
                        Some(prefix) if t < h.base => (prefix, t),
                        _ => (h.own, t - h.base),
                    };
                    let at = kv.offset + index * kv.stride;
                    let read = (kv.keys[at..at + HEAD_DIM].to_vec(), kv.values[at]);
                    let expected = code(layer, head, t);
                    assert_eq!(
                        read,
                        (vec![expected; HEAD_DIM], -expected),
                        "{what}: layer {layer} head {head} position {t}"
                    );
                }
            }
        }
    }

    /// Forks store the positions they were forked at once and each its
    /// own after them; a fork after a sibling grew starts a family of its
    /// own whose prefix holds the old prefix and what came after; every
    /// cache reads back every position it committed.
    #[test]
    fn forks_store_the_prefix_once_and_read_back_every_position() {
        let mut origin = KvCache {
            layers: vec![CachedLayer::default(); 2],
            len: 0,
            capacity: 0,
            kv_heads: 3,
            head_dim: HEAD_DIM,
            prefix: None,
        };
        origin.reserve(20);
        write(&mut origin, 7);
        let mut sibling = origin.fork();
        assert_eq!(origin.shared_prefix(), sibling.shared_prefix());
        for cache in [&origin, &sibling] {
            assert_eq!((cache.base(), cache.len(), cache.capacity()), (7, 7, 20));
            assert_eq!(cache.own_capacity(), 13);
        }
        write(&mut sibling, 5);
        write(&mut origin, 2);
        assert_reads_back(&origin, "the origin");
        assert_reads_back(&sibling, "its sibling");

        let grandchild = sibling.fork();
        assert_ne!(sibling.shared_prefix(), origin.shared_prefix());
        assert_eq!(sibling.shared_prefix(), grandchild.shared_prefix());
        assert_eq!((grandchild.base(), grandchild.own_capacity()), (12, 8));
        assert_reads_back(&sibling, "the sibling after its fork");
        assert_reads_back(&grandchild, "the sibling's fork");
        assert_reads_back(&origin.clone(), "a clone of the origin");
    }
}
