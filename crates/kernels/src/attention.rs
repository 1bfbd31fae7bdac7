//! Scaled dot-product attention of one GQA group of query heads over one
//! key/value head, at one query position (a decode step) or a tile of
//! consecutive positions (a prefill).
//!
//! For each query of the group: the scores `q·k · scale` in key order, their
//! softmax, and the values weighted by it. The arithmetic is fixed down to
//! the order of every addition, and nothing depends on the other queries of
//! the group, so a prefill, a chunked prefill, a decode step and teacher
//! forcing over the same tokens give a query the same bits (the decoder's
//! batch invariance rests on it).
//!
//! The order is that of eight f32 lanes, so the AVX2 tier and its scalar twin
//! compute the same bits (tested): a dot product accumulates dimension `d` in
//! lane `d mod 8` with fused multiply-adds and sums the lanes as
//! `((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))`; the softmax's denominator sums key
//! `t` in lane `t mod 8` with the same tree; each output value accumulates
//! the keys in order with fused multiply-adds and is divided by the
//! denominator once at the end. `exp` is [`crate::exp`]'s, the same bits
//! on both tiers. A wider tier (AVX-512)
//! would have to keep eight lanes to keep the bits, so there is none: a
//! machine with AVX-512 and one without compute the same activations.
//!
//! The two passes over one query's scores (max, then exponentials) read a
//! row of `visible` floats (32 KiB at 8 192 keys) that stays in the cache;
//! no matrix of scores over a whole prompt's queries exists, only a tile's
//! rows. Keys are read from memory once per tile in blocks of eight, values
//! once per tile in blocks that stay in L1: a tile of 4 positions of
//! SmolLM2's 3-head groups reads the cache a quarter as often as a position
//! at a time, which is what a long prefill spends its time on.

use std::cell::RefCell;

use qforge_core::CpuTier;

use crate::error::{Error, Result};
use crate::exp::exp;

mod portable;
#[cfg(target_arch = "x86_64")]
mod x86;

thread_local! {
    /// One group's padded rows of scores and their softmax denominators,
    /// grown per thread to the longest rows seen (or [`reserve`]d).
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Lanes of the fixed summation order.
const LANES: usize = 8;

/// A CPU tier of the attention kernel.
pub type AttentionTier = crate::fma_tier::FmaTier;

/// The query heads of one GQA group at one or more consecutive query
/// positions: head `g` of position `p` at `p · position_stride + g ·
/// head_stride` in `rows`, and position `p` attends the first `visible[p]`
/// positions of the keys (at least 1). A decode step is one position; a
/// prefill attends a tile of positions at once, so each block of keys and
/// values read from memory serves every query of the tile.
#[derive(Debug, Clone, Copy)]
pub struct Queries<'a> {
    /// The queries, each `head_dim` values.
    pub rows: &'a [f32],
    /// Distance between the first values of consecutive heads.
    pub head_stride: usize,
    /// Distance between the first values of consecutive positions.
    pub position_stride: usize,
    /// Positions attended by each query position.
    pub visible: &'a [usize],
}

impl Queries<'_> {
    fn positions(&self) -> usize {
        self.visible.len()
    }

    /// The most positions any query attends.
    fn longest(&self) -> usize {
        self.visible.iter().copied().max().unwrap_or(0)
    }
}

/// One key/value head: the key of position `t` at `offset + t · stride` in
/// `keys`, its value at the same index in `values`.
#[derive(Debug, Clone, Copy)]
pub struct KeyValues<'a> {
    /// Keys, `head_dim` values each.
    pub keys: &'a [f32],
    /// Values, laid out as the keys.
    pub values: &'a [f32],
    /// Index of position 0's key.
    pub offset: usize,
    /// Distance between consecutive positions' keys.
    pub stride: usize,
}

/// Keys and values split at position `len`: positions before it from
/// `prefix`, one cache for every query position of the call, the rest
/// from each query position's own (`own(p)`). Sibling sequences (the `n`
/// samples of one prompt, which store the prompt's positions once and
/// each its own after them) attend together so, and the prefix's keys and
/// values are read once for all of them. Which cache a position's key comes from
/// changes nothing else: each query's scores, softmax and weighted values
/// are computed in the same order as over one cache, so the result has
/// the same bits. One cache for every position is a split with no own
/// part (`From<KeyValues>`).
#[derive(Clone, Copy)]
pub struct Split<'a> {
    /// The keys and values of positions before `len`, shared.
    pub prefix: KeyValues<'a>,
    /// Positions read from `prefix`.
    pub len: usize,
    /// The keys and values from position `len` on.
    pub own: Own<'a>,
}

/// Where a [`Split`]'s positions from its `len` on lie: position `len`'s
/// key at the `offset` of the [`KeyValues`], each next one `stride` on.
#[derive(Clone, Copy)]
pub enum Own<'a> {
    /// Nowhere: the prefix holds every position.
    None,
    /// In one cache for every query position (one sequence's).
    One(KeyValues<'a>),
    /// In query position `p`'s own cache (sibling sequences').
    Each(&'a (dyn Fn(usize) -> KeyValues<'a> + Sync)),
}

impl<'a> From<KeyValues<'a>> for Split<'a> {
    /// One cache for every query position.
    fn from(kv: KeyValues<'a>) -> Self {
        Split {
            prefix: kv,
            len: usize::MAX,
            own: Own::None,
        }
    }
}

impl<'a> Split<'a> {
    /// Query position `p`'s own keys and values. Always inlined: the AVX2
    /// tier calls it in the closure that walks its spans, which otherwise
    /// stops being inlined and costs a 128-position call 2–5 %.
    #[inline(always)]
    fn own_of(&self, p: usize) -> KeyValues<'a> {
        match self.own {
            Own::None => self.prefix,
            Own::One(own) => own,
            Own::Each(own) => own(p),
        }
    }
}

impl std::fmt::Debug for Split<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Split")
            .field("prefix", &self.prefix)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

/// Attention of every query in `queries` over `kv` (one cache's
/// [`KeyValues`], or a [`Split`] between a shared prefix and each query
/// position's own cache), on the fastest tier: `out` holds the outputs
/// position by position, each position's heads in turn, `head_dim` values
/// per head (so the group has `out.len() / (head_dim · positions)` heads);
/// `scale` multiplies each score. A query's result does not depend on the
/// other queries attended beside it.
pub fn attend<'a>(
    queries: Queries<'_>,
    kv: impl Into<Split<'a>>,
    head_dim: usize,
    scale: f32,
    out: &mut [f32],
) -> Result<()> {
    attend_with(AttentionTier::detect(), queries, kv, head_dim, scale, out)
}

/// [`attend`] on a chosen tier; errors if the CPU lacks it or the slices do
/// not hold what the shapes say.
pub fn attend_with<'a>(
    tier: AttentionTier,
    queries: Queries<'_>,
    kv: impl Into<Split<'a>>,
    head_dim: usize,
    scale: f32,
    out: &mut [f32],
) -> Result<()> {
    let kv = kv.into();
    check(queries, kv, head_dim, out)?;
    if !tier.is_supported() {
        return Err(Error::UnsupportedTier(format!("{tier:?}")));
    }
    let rows = out.len() / head_dim;
    let longest = queries.longest();
    let padded = longest.next_multiple_of(LANES);
    reserve(rows, longest);
    SCRATCH.with_borrow_mut(|scratch| {
        let (scores, rest) = scratch.split_at_mut(rows * padded);
        let scratch = Scratch {
            scores,
            totals: &mut rest[..rows],
        };
        match tier {
            #[cfg(target_arch = "x86_64")]
            AttentionTier::Avx2 if head_dim.is_multiple_of(LANES) => {
                // SAFETY: the CPU has AVX2 and FMA (checked above), and
                // `check` accepted the shapes.
                unsafe { x86::attend(queries, kv, head_dim, scratch, scale, out) }
            }
            // Head sizes that are not whole vectors take the scalar order,
            // which is the vector order too.
            _ => portable::attend(queries, kv, head_dim, scratch, scale, out),
        }
    });
    Ok(())
}

/// Grows the calling thread's scratch so that attending `rows` queries
/// (query heads times positions) over up to `visible` positions does not
/// allocate: a decoder of fixed capacity reserves it once per thread, and
/// its steps then allocate nothing.
pub fn reserve(rows: usize, visible: usize) {
    let needed = rows * (visible.next_multiple_of(LANES) + 1);
    SCRATCH.with_borrow_mut(|scratch| {
        if scratch.len() < needed {
            scratch.resize(needed, 0.0);
        }
    });
}

/// The queries' padded rows of scores (row `p · group + g` for head `g` of
/// position `p`, each as long as the longest row rounded up to whole lanes)
/// and their softmax denominators.
struct Scratch<'a> {
    scores: &'a mut [f32],
    totals: &'a mut [f32],
}

impl Scratch<'_> {
    fn padded(&self) -> usize {
        self.scores.len() / self.totals.len()
    }
}

impl KeyValues<'_> {
    /// Whether the keys and values of the first `positions` positions lie
    /// within the slices.
    fn holds(&self, positions: usize, head_dim: usize) -> bool {
        let needed = match positions {
            0 => 0,
            _ => self.offset + (positions - 1) * self.stride + head_dim,
        };
        self.keys.len() >= needed && self.values.len() >= needed
    }
}

fn check(queries: Queries<'_>, kv: Split<'_>, head_dim: usize, out: &[f32]) -> Result<()> {
    let positions = queries.positions();
    let group = out
        .len()
        .checked_div(head_dim * positions)
        .unwrap_or_default();
    let longest = queries.longest();
    let last_query = |group: usize| {
        (positions - 1) * queries.position_stride + (group - 1) * queries.head_stride + head_dim
    };
    let own_fits = |p: usize| {
        let visible = queries.visible[p];
        visible <= kv.len || kv.own_of(p).holds(visible - kv.len, head_dim)
    };
    if group == 0
        || !out.len().is_multiple_of(head_dim * positions)
        || queries.visible.contains(&0)
        || queries.rows.len() < last_query(group)
        || !kv.prefix.holds(kv.len.min(longest), head_dim)
        || !(0..positions).all(own_fits)
    {
        return Err(Error::Shape(format!(
            "attention of {} output values in heads of {head_dim} at {positions} positions \
             (queries: {} values, head stride {}, position stride {}) over up to {longest} \
             positions, the first {} at offset {} stride {} ({} keys, {} values), the rest \
             in each position's own cache",
            out.len(),
            queries.rows.len(),
            queries.head_stride,
            queries.position_stride,
            kv.len.min(longest),
            kv.prefix.offset,
            kv.prefix.stride,
            kv.prefix.keys.len(),
            kv.prefix.values.len()
        )));
    }
    Ok(())
}

/// `max` as x86's `maxps` computes it (the second operand when unordered),
/// so both tiers agree even on NaN.
fn max_ps(a: f32, b: f32) -> f32 {
    if a > b { a } else { b }
}

/// The lanes' sum in the fixed tree.
fn tree_sum(l: [f32; LANES]) -> f32 {
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seeded(len: usize, seed: u32, spread: f32) -> Vec<f32> {
        (0..len)
            .map(|i| ((i as f32 + seed as f32 * 0.173) * 0.618).sin() * spread)
            .collect()
    }

    /// Attention in f64 with the exact softmax.
    fn reference(q: &[f32], keys: &[f32], values: &[f32], hd: usize, scale: f32) -> Vec<f64> {
        let visible = keys.len() / hd;
        let scores: Vec<f64> = keys
            .chunks_exact(hd)
            .map(|k| {
                q.iter()
                    .zip(k)
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum::<f64>()
                    * scale as f64
            })
            .collect();
        let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f64 = e.iter().sum();
        (0..hd)
            .map(|d| {
                (0..visible)
                    .map(|t| e[t] * values[t * hd + d] as f64)
                    .sum::<f64>()
                    / total
            })
            .collect()
    }

    struct Case {
        hd: usize,
        group: usize,
        visible: usize,
    }

    fn run(
        tier: AttentionTier,
        case: &Case,
        spread: f32,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let Case { hd, group, visible } = *case;
        // Two kv heads interleaved per position, as a KV cache lays them out;
        // the group attends the second.
        let stride = 2 * hd;
        let q = seeded(group * hd, 1, spread);
        let keys = seeded(visible * stride, 2, spread);
        let values = seeded(visible * stride, 3, 1.0);
        let mut out = vec![0f32; group * hd];
        attend_with(
            tier,
            Queries {
                rows: &q,
                head_stride: hd,
                position_stride: 0,
                visible: &[visible],
            },
            KeyValues {
                keys: &keys,
                values: &values,
                offset: hd,
                stride,
            },
            hd,
            1.0 / (hd as f32).sqrt(),
            &mut out,
        )
        .unwrap();
        (q, keys, values, out)
    }

    const CASES: [Case; 5] = [
        Case {
            hd: 64,
            group: 3,
            visible: 1,
        },
        Case {
            hd: 64,
            group: 3,
            visible: 200,
        },
        Case {
            hd: 128,
            group: 4,
            visible: 77,
        },
        Case {
            hd: 20,
            group: 2,
            visible: 13,
        },
        Case {
            hd: 64,
            group: 1,
            visible: 8,
        },
    ];

    /// Runs `attend` on every tier this CPU has and asserts that each
    /// writes `expected`'s bits (`what` names the case).
    fn assert_every_tier_gives(
        expected: &[f32],
        what: &str,
        attend: impl Fn(AttentionTier, &mut [f32]),
    ) {
        for &tier in AttentionTier::ALL.iter().filter(|t| t.is_supported()) {
            let mut out = vec![0f32; expected.len()];
            attend(tier, &mut out);
            let same = out
                .iter()
                .zip(expected)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{tier:?}: {what}");
        }
    }

    /// The queries of `visible.len()` positions in `q`, heads
    /// `strides.0` apart and positions `strides.1` apart.
    fn queries<'a>(q: &'a [f32], visible: &'a [usize], strides: (usize, usize)) -> Queries<'a> {
        Queries {
            rows: q,
            head_stride: strides.0,
            position_stride: strides.1,
            visible,
        }
    }

    /// Asserts that the positions of `visible` attended in one call over
    /// `together` get, on every tier, the bits each gets alone on the
    /// portable tier over its whole cache `whole(p)`: position `p`'s
    /// `group` queries start at `p · strides.1` in `q`, their heads
    /// `strides.0` apart (`what` names the case).
    fn assert_together_gives_each_alone<'a>(
        (q, visible): (&[f32], &[usize]),
        (group, hd): (usize, usize),
        strides: (usize, usize),
        whole: impl Fn(usize) -> KeyValues<'a>,
        together: Split<'_>,
        what: &str,
    ) {
        let scale = 1.0 / (hd as f32).sqrt();
        let mut alone = vec![0f32; visible.len() * group * hd];
        for (p, out) in alone.chunks_exact_mut(group * hd).enumerate() {
            let one = queries(&q[p * strides.1..], &visible[p..=p], (strides.0, 0));
            attend_with(AttentionTier::Portable, one, whole(p), hd, scale, out).unwrap();
        }
        let tile = queries(q, visible, strides);
        assert_every_tier_gives(&alone, what, |tier, out| {
            attend_with(tier, tile, together, hd, scale, out).unwrap()
        });
    }

    #[test]
    fn every_tier_gives_the_same_bits() {
        for case in &CASES {
            let (.., reference) = run(AttentionTier::Portable, case, 3.0);
            let what = format!("differs from the portable tier at hd {}", case.hd);
            assert_every_tier_gives(&reference, &what, |tier, out| {
                out.copy_from_slice(&run(tier, case, 3.0).3)
            });
        }
    }

    #[test]
    fn attention_matches_the_exact_softmax() {
        for case in &CASES {
            for &tier in AttentionTier::ALL.iter().filter(|t| t.is_supported()) {
                // A spread of 6 gives scores tens of nats apart.
                let (q, keys, values, out) = run(tier, case, 6.0);
                let hd = case.hd;
                let head = |rows: &[f32]| -> Vec<f32> {
                    rows.chunks_exact(2 * hd)
                        .flat_map(|r| r[hd..].to_vec())
                        .collect()
                };
                let (keys, values) = (head(&keys), head(&values));
                for (g, out) in out.chunks_exact(hd).enumerate() {
                    let expected = reference(
                        &q[g * hd..(g + 1) * hd],
                        &keys,
                        &values,
                        hd,
                        1.0 / (hd as f32).sqrt(),
                    );
                    for (&o, &e) in out.iter().zip(&expected) {
                        assert!(
                            (o as f64 - e).abs() <= 1e-5 * (1.0 + e.abs()),
                            "{o} vs {e} ({tier:?})"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_nan_key_makes_the_output_nan_on_every_tier() {
        let hd = 16;
        let q = vec![0.5f32; hd];
        let mut keys = seeded(10 * hd, 4, 1.0);
        keys[3 * hd + 5] = f32::NAN;
        let values = seeded(10 * hd, 5, 1.0);
        for &tier in AttentionTier::ALL.iter().filter(|t| t.is_supported()) {
            let mut out = vec![0f32; hd];
            attend_with(
                tier,
                Queries {
                    rows: &q,
                    head_stride: hd,
                    position_stride: 0,
                    visible: &[10],
                },
                KeyValues {
                    keys: &keys,
                    values: &values,
                    offset: 0,
                    stride: hd,
                },
                hd,
                0.25,
                &mut out,
            )
            .unwrap();
            assert!(out.iter().all(|o| o.is_nan()), "{tier:?}: {out:?}");
        }
    }

    #[test]
    fn slices_shorter_than_the_shapes_are_refused() {
        let (q, keys, values) = (vec![0f32; 64], vec![0f32; 64 * 4], vec![0f32; 64 * 4]);
        let mut out = vec![0f32; 64];
        let attempt = |visible: usize, offset: usize, out: &mut [f32]| {
            attend(
                Queries {
                    rows: &q,
                    head_stride: 64,
                    position_stride: 64,
                    visible: &[visible],
                },
                KeyValues {
                    keys: &keys,
                    values: &values,
                    offset,
                    stride: 64,
                },
                64,
                1.0,
                out,
            )
        };
        assert!(attempt(4, 0, &mut out).is_ok());
        assert!(attempt(5, 0, &mut out).is_err());
        assert!(attempt(4, 1, &mut out).is_err());
        assert!(attempt(0, 0, &mut out).is_err());
        assert!(attempt(1, 0, &mut vec![0f32; 128]).is_err());
        assert!(attempt(1, 0, &mut vec![0f32; 60]).is_err());
        // Two positions need two queries' values and two outputs.
        let two = |q: &[f32], out: &mut [f32]| {
            attend(
                Queries {
                    rows: q,
                    head_stride: 64,
                    position_stride: 64,
                    visible: &[1, 2],
                },
                KeyValues {
                    keys: &keys,
                    values: &values,
                    offset: 0,
                    stride: 64,
                },
                64,
                1.0,
                out,
            )
        };
        assert!(two(&[0f32; 128], &mut vec![0f32; 128]).is_ok());
        assert!(two(&q, &mut vec![0f32; 128]).is_err());
        assert!(two(&[0f32; 128], &mut vec![0f32; 64]).is_err());
        assert!(two(&[0f32; 128], &mut vec![0f32; 192]).is_err());
    }

    /// A tile of positions gives each query the bits it gets alone, on
    /// every tier: causal rows of every length around the lanes and the
    /// value blocks, and trailing rows that stop growing (a padded
    /// sequence's queries past its end).
    #[test]
    fn a_tile_of_positions_gives_each_query_its_bits_alone() {
        for (hd, group) in [(64, 3), (128, 4), (20, 2)] {
            let positions = 13;
            let visible: Vec<usize> = (0..positions).map(|p| (60 + p).min(70)).collect();
            let longest = visible[positions - 1];
            // Queries laid out [heads, positions, hd], as the tensor forward
            // holds them; two kv heads interleaved per cached position.
            let q = seeded(group * positions * hd, 6, 3.0);
            let keys = seeded(longest * 2 * hd, 7, 3.0);
            let values = seeded(longest * 2 * hd, 8, 1.0);
            let kv = KeyValues {
                keys: &keys,
                values: &values,
                offset: hd,
                stride: 2 * hd,
            };
            assert_together_gives_each_alone(
                (&q, &visible),
                (group, hd),
                (positions * hd, hd),
                |_| kv,
                kv.into(),
                &format!("a tile differs from its positions alone (hd {hd})"),
            );
        }
    }

    /// Siblings attending together over a shared prefix get the bits each
    /// gets alone over its whole cache, on every tier: the prefix is read
    /// from the shared cache and the rest from each sibling's own, which
    /// holds its positions from the prefix's end on (behind a NaN position
    /// that a read off by one would take), for prefixes around the lanes
    /// and the value blocks and siblings that see less than the prefix.
    #[test]
    fn siblings_over_a_shared_prefix_get_their_bits_alone() {
        for (hd, group) in [(64, 3), (128, 4), (20, 2)] {
            for prefix in [1, 7, 8, 48, 64, 65] {
                let visible: Vec<usize> = [prefix + 1, prefix + 90, prefix, prefix + 9, 1]
                    .into_iter()
                    .map(|v| v.max(1))
                    .collect();
                let siblings = visible.len();
                let longest = prefix + 90;
                // Two kv heads interleaved per cached position; the group
                // attends the second.
                let width = longest * 2 * hd;
                let shared = seeded(width, 9, 3.0);
                let shared_values = seeded(width, 10, 1.0);
                let whole: Vec<(Vec<f32>, Vec<f32>)> = (0..siblings as u32)
                    .map(|s| {
                        let mut keys = seeded(width, 11 + s, 3.0);
                        let mut values = seeded(width, 31 + s, 1.0);
                        keys[..prefix * 2 * hd].copy_from_slice(&shared[..prefix * 2 * hd]);
                        values[..prefix * 2 * hd]
                            .copy_from_slice(&shared_values[..prefix * 2 * hd]);
                        (keys, values)
                    })
                    .collect();
                let tail = |buffer: &Vec<f32>| {
                    let mut tail = vec![f32::NAN; 2 * hd];
                    tail.extend_from_slice(&buffer[prefix * 2 * hd..]);
                    tail
                };
                let own: Vec<(Vec<f32>, Vec<f32>)> = whole
                    .iter()
                    .map(|(keys, values)| (tail(keys), tail(values)))
                    .collect();
                // The second of two kv heads interleaved per position, from
                // `at`'s position on.
                fn second<'a>(
                    (keys, values): &'a (Vec<f32>, Vec<f32>),
                    hd: usize,
                    at: usize,
                ) -> KeyValues<'a> {
                    KeyValues {
                        keys,
                        values,
                        offset: at * 2 * hd + hd,
                        stride: 2 * hd,
                    }
                }
                let of = |cache| second(cache, hd, 0);
                let q = seeded(siblings * group * hd, 12, 3.0);
                let own_of = |p: usize| second(&own[p], hd, 1);
                let prefix_cache = (shared, shared_values);
                let split = Split {
                    prefix: of(&prefix_cache),
                    len: prefix,
                    own: Own::Each(&own_of),
                };
                assert_together_gives_each_alone(
                    (&q, &visible),
                    (group, hd),
                    (hd, group * hd),
                    |p| of(&whole[p]),
                    split,
                    &format!("siblings differ from alone (hd {hd}, prefix {prefix})"),
                );
            }
        }
    }

    #[test]
    fn a_sibling_cache_shorter_than_its_positions_is_refused() {
        let hd = 16;
        // The own cache holds one position, the prefix's end.
        let (prefix, short) = (vec![0f32; 8 * hd], vec![0f32; hd]);
        fn kv(buffer: &[f32]) -> KeyValues<'_> {
            KeyValues {
                keys: buffer,
                values: buffer,
                offset: 0,
                stride: 16,
            }
        }
        let split = Split {
            prefix: kv(&prefix),
            len: 8,
            own: Own::One(kv(&short)),
        };
        let attempt = |visible: usize| {
            let queries = Queries {
                rows: &[0f32; 16],
                head_stride: hd,
                position_stride: hd,
                visible: &[visible],
            };
            attend(queries, split, hd, 1.0, &mut [0f32; 16])
        };
        assert!(attempt(9).is_ok());
        let refused = attempt(10).unwrap_err().to_string();
        assert!(refused.contains("own cache"), "{refused}");
        // The prefix must hold what it is read for, too.
        let long_prefix = Split { len: 9, ..split };
        let queries = Queries {
            rows: &[0f32; 16],
            head_stride: hd,
            position_stride: hd,
            visible: &[9],
        };
        assert!(attend(queries, long_prefix, hd, 1.0, &mut [0f32; 16]).is_err());
    }
}
