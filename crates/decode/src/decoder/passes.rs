//! The decode step's row-parallel passes: norms, rotations, SwiGLU, the KV
//! writes and attention, each over a batch's rows on a [`Team`].

use std::cell::RefCell;

use qforge_kernels::Team;
use qforge_kernels::attention::{Own, Queries, Split, attend, reserve};

use qforge_model::llama::Rotations;
use qforge_model::{KvCache, Observer, Result, RotatedInput};

thread_local! {
    /// What a thread of [`attend_all`] stages its queries and outputs in.
    static STAGED: RefCell<Staged> = const { RefCell::new(Staged::new()) };
}

/// One query group's heads (of one row, or of rows that attend together),
/// rotated for their positions, those rows' visible positions, and their
/// outputs before they go to their rows.
struct Staged {
    queries: Vec<f32>,
    visible: Vec<usize>,
    attended: Vec<f32>,
}

impl Staged {
    const fn new() -> Self {
        Self {
            queries: Vec::new(),
            visible: Vec::new(),
            attended: Vec::new(),
        }
    }
}

/// The first error a parallel pass's threads met, for the caller.
pub(super) struct FirstFailure(std::sync::OnceLock<qforge_kernels::Error>);

impl FirstFailure {
    pub(super) fn new() -> Self {
        Self(std::sync::OnceLock::new())
    }

    /// Keeps `result`'s error if it is the first.
    pub(super) fn note<T>(&self, result: qforge_kernels::Result<T>) {
        if let Err(error) = result {
            let _ = self.0.set(error);
        }
    }

    pub(super) fn into_result(self) -> Result<()> {
        match self.0.into_inner() {
            Some(error) => Err(error.into()),
            None => Ok(()),
        }
    }
}

/// Hands layer `i`'s input `point` (`rows` of `width` values) to `observer`.
pub(super) fn observe(
    observer: &mut Option<&mut dyn Observer>,
    i: usize,
    point: &str,
    rows: &[f32],
    width: usize,
) -> Result<()> {
    match observer.as_deref_mut() {
        Some(observer) => observer.observe(&format!("model.layers.{i}.{point}"), rows, width),
        None => Ok(()),
    }
}

/// The rotary tables, `[positions, half]` each.
#[derive(Clone, Copy)]
pub(super) struct Rope<'a> {
    pub(super) cos: &'a [f32],
    pub(super) sin: &'a [f32],
    pub(super) half: usize,
}

impl Rope<'_> {
    /// Half-split rotary embedding of one head at `position`.
    fn apply(self, head: &mut [f32], position: usize) {
        let at = position * self.half..(position + 1) * self.half;
        let (cos, sin) = (&self.cos[at.clone()], &self.sin[at]);
        let (first, second) = head.split_at_mut(self.half);
        for i in 0..self.half {
            let (a, b) = (first[i], second[i]);
            first[i] = a * cos[i] - b * sin[i];
            second[i] = b * cos[i] + a * sin[i];
        }
    }
}

/// One RMSNorm pass over a batch's residual rows.
pub(super) struct NormPass<'a> {
    pub(super) rows: usize,
    pub(super) eps: f32,
    pub(super) weight: &'a [f32],
    pub(super) rotations: &'a Rotations,
    /// The rotation the normed rows then take (where the model has it).
    pub(super) input: RotatedInput,
    /// A block's output to add into the residual first.
    pub(super) add: &'a [f32],
}

/// `x += add`, then `h = rms_norm(x) · weight`, rotated as
/// `pass.input` asks; in parallel over rows.
pub(super) fn normalize(
    team: &mut Team,
    pass: NormPass<'_>,
    x: &mut [f32],
    h: &mut [f32],
) -> Result<()> {
    let d = pass.weight.len();
    let failure = FirstFailure::new();
    let rotation = pass.rotations.get(pass.input);
    team.run_rows(
        pass.rows,
        [&mut x[..pass.rows * d], &mut h[..pass.rows * d]],
        |rows, [x, h]| {
            for (a, &b) in x.iter_mut().zip(&pass.add[rows.start * d..rows.end * d]) {
                *a += b;
            }
            for (x, h) in x.chunks_exact(d).zip(h.chunks_exact_mut(d)) {
                rms_norm(x, pass.weight, pass.eps, h);
            }
            if let Some(rotation) = rotation {
                failure.note(rotation.rotate(h));
            }
        },
    );
    failure.into_result()
}

/// Rotates every row of `rows` (`n` rows) where the model rotates `input`.
pub(super) fn rotate_rows(
    team: &mut Team,
    rotations: &Rotations,
    input: RotatedInput,
    n: usize,
    rows: &mut [f32],
) -> Result<()> {
    let Some(rotation) = rotations.get(input) else {
        return Ok(());
    };
    let failure = FirstFailure::new();
    let width = rows.len() / n;
    team.run_rows(n, [&mut rows[..n * width]], |_, [rows]| {
        failure.note(rotation.rotate(rows));
    });
    failure.into_result()
}

/// `gate = silu(gate) · up`, rotated where the model rotates the MLP's
/// product; in parallel over rows.
pub(super) fn swiglu(
    team: &mut Team,
    rotations: &Rotations,
    n: usize,
    gate: &mut [f32],
    up: &[f32],
) -> Result<()> {
    let width = gate.len() / n;
    team.run_rows(n, [&mut gate[..n * width]], |rows, [gate]| {
        for (g, &u) in gate
            .iter_mut()
            .zip(&up[rows.start * width..rows.end * width])
        {
            // candle's `silu`, which the tensor forward runs: the same bits.
            // (A vectorized exp here moved INT8 perplexity on an 811-token
            // text by 0.3–0.7 %, a rounding cascade, for 1 % of a step.)
            *g = *g / (1.0 + (-*g).exp()) * u;
        }
    });
    rotate_rows(team, rotations, RotatedInput::MlpProduct, n, gate)
}

/// Writes every row's keys (rotated for its position) and values into its
/// sequence's cache at layer `layer`, position `positions[row]`; sequence
/// `s`'s rows start at `first_rows[s]` and run to the next sequence's. In
/// parallel over sequences.
#[allow(clippy::too_many_arguments)]
pub(super) fn store(
    team: &mut Team,
    layer: usize,
    rope: Rope<'_>,
    positions: &[usize],
    first_rows: &[usize],
    keys: &[f32],
    values: &[f32],
    caches: &mut [&mut KvCache],
) {
    let n = caches.len();
    let width = keys.len() / positions.len();
    team.run_rows(n, [caches], |sequences, [caches]| {
        for (s, cache) in sequences.zip(caches.iter_mut()) {
            let end = first_rows.get(s + 1).copied().unwrap_or(positions.len());
            let (room, base, hd) = (cache.own_capacity(), cache.base(), cache.head_dim());
            let (cached_keys, cached_values) = cache.layer_mut(layer);
            let rows = first_rows[s]..end;
            for (row, &position) in rows.clone().zip(&positions[rows]) {
                let at = row * width..(row + 1) * width;
                let heads = keys[at.clone()]
                    .chunks_exact(hd)
                    .zip(values[at].chunks_exact(hd));
                for (head, (key, value)) in heads.enumerate() {
                    let at = head * room + position - base;
                    let slot = at * hd..(at + 1) * hd;
                    let cached_key = &mut cached_keys[slot.clone()];
                    cached_key.copy_from_slice(key);
                    rope.apply(cached_key, position);
                    cached_values[slot].copy_from_slice(value);
                }
            }
        }
    });
}

/// The query heads of a step and how they share key/value heads.
#[derive(Clone, Copy)]
pub(super) struct AttentionShape {
    pub(super) heads: usize,
    /// Query heads per key/value head.
    pub(super) group: usize,
    /// Values per head.
    pub(super) dim: usize,
    /// What multiplies each score.
    pub(super) scale: f32,
}

/// What a unit of [`attend_all`] costs beside its positions, in positions.
const UNIT_OVERHEAD_POSITIONS: usize = 8;

/// The rows of a pass as attention sees them.
#[derive(Clone, Copy)]
pub(super) struct AttendedRows<'a> {
    /// Each row's sequence.
    pub(super) sequences: &'a [usize],
    /// Each row's position in its sequence.
    pub(super) positions: &'a [usize],
    /// Each row's company (see [`Together`]).
    pub(super) together: &'a [Together],
}

/// Which rows from a row on attend together with it: rows of sibling
/// sequences (caches forked from one prompt) read the positions they
/// share once for all of them.
#[derive(Clone, Copy, Debug)]
pub(super) struct Together {
    /// The end of the rows, from this one on, that attend with it (`row +
    /// 1` for a row that attends alone).
    pub(super) end: usize,
    /// Positions this row's attention reads for itself: its own, and its
    /// part of the shared ones. What it costs a thread.
    pub(super) reads: usize,
}

/// Attention of every row's query heads (`q`, rotated here for the row's
/// position) over its sequence's cache up to and including that position,
/// into `out`.
///
/// Every (row, head) pair is one unit and each thread takes a contiguous
/// share of them of near-equal cost (a unit costs the positions it reads:
/// in a server's batch the rows' caches differ in length several times
/// over), a key/value head's query heads of one row attended together so
/// that its cache is read once per thread: one row's heads split over the
/// threads, many rows split by row. Whole rows of sibling sequences in a
/// thread's share attend together, each key/value head's prefix read once
/// for all of them. A head's result depends on nothing but its query and
/// its sequence's cache (the shared prefix is the same bits in each).
#[allow(clippy::too_many_arguments)]
pub(super) fn attend_all(
    team: &mut Team,
    layer: usize,
    shape: AttentionShape,
    rope: Rope<'_>,
    rows: AttendedRows<'_>,
    q: &[f32],
    caches: &[&mut KvCache],
    out: &mut [f32],
) -> Result<()> {
    let AttentionShape {
        heads, group, dim, ..
    } = shape;
    let count = rows.positions.len();
    // The scratch is sized by capacity, which a reserved cache keeps,
    // rather than by the growing length.
    let longest = caches.iter().map(|c| c.capacity()).max().unwrap_or(1);
    let failure = FirstFailure::new();
    // A unit's work is its keys and values read, plus the query's own
    // (rotated, its scores set up): about as much as a few positions.
    let cost = |unit: usize| rows.together[unit / heads].reads + 1 + UNIT_OVERHEAD_POSITIONS;
    team.run_rows_by_cost(
        count * heads,
        cost,
        [&mut out[..count * heads * dim]],
        |units, [mut out]| {
            // Sized once per thread for the largest cache, so that steps do not
            // allocate.
            reserve(group, longest);
            STAGED.with_borrow_mut(|staged| {
                let mut unit = units.start;
                while !out.is_empty() {
                    let (row, head) = (unit / heads, unit % heads);
                    // Whole rows of this share that attend together.
                    let end = rows.together[row].end.min(units.end / heads);
                    let (done, result) = if head == 0 && end > row + 1 {
                        let (these, rest) = out.split_at_mut((end - row) * heads * dim);
                        let siblings = row..end;
                        let result = attend_together(
                            (layer, shape, rope),
                            rows,
                            siblings,
                            q,
                            caches,
                            staged,
                            these,
                        );
                        out = rest;
                        ((end - row) * heads, result)
                    } else {
                        let kv_head = head / group;
                        let done = ((kv_head + 1) * group - head).min(out.len() / dim);
                        let (these, rest) = out.split_at_mut(done * dim);
                        let result = attend_row(
                            (layer, shape, rope),
                            (rows.sequences[row], rows.positions[row]),
                            &q[(row * heads + head) * dim..][..done * dim],
                            kv_head,
                            caches,
                            staged,
                            these,
                        );
                        out = rest;
                        (done, result)
                    };
                    failure.note(result);
                    unit += done;
                }
            });
        },
    );
    failure.into_result()
}

/// One row's heads of key/value head `kv_head` (`queries`, not yet
/// rotated) over its sequence's cache.
fn attend_row(
    (layer, shape, rope): (usize, AttentionShape, Rope<'_>),
    (sequence, position): (usize, usize),
    queries: &[f32],
    kv_head: usize,
    caches: &[&mut KvCache],
    staged: &mut Staged,
    out: &mut [f32],
) -> qforge_kernels::Result<()> {
    let dim = shape.dim;
    staged.queries.clear();
    staged.queries.extend_from_slice(queries);
    for query in staged.queries.chunks_exact_mut(dim) {
        rope.apply(query, position);
    }
    attend(
        Queries {
            rows: &staged.queries,
            head_stride: dim,
            position_stride: 0,
            visible: &[position + 1],
        },
        caches[sequence].head(layer, kv_head),
        dim,
        shape.scale,
        out,
    )
}

/// Rows `siblings` of sibling sequences, every head (`out`: their rows of
/// all heads), each key/value head's shared prefix read once for all of
/// them.
fn attend_together(
    (layer, shape, rope): (usize, AttentionShape, Rope<'_>),
    rows: AttendedRows<'_>,
    siblings: std::ops::Range<usize>,
    q: &[f32],
    caches: &[&mut KvCache],
    staged: &mut Staged,
    out: &mut [f32],
) -> qforge_kernels::Result<()> {
    let AttentionShape {
        heads,
        group,
        dim,
        scale,
    } = shape;
    let width = group * dim;
    let Staged {
        queries,
        visible,
        attended,
    } = staged;
    visible.clear();
    visible.extend(siblings.clone().map(|row| rows.positions[row] + 1));
    attended.resize(siblings.len() * width, 0.0);
    let eldest = &caches[rows.sequences[siblings.start]];
    for kv_head in 0..heads / group {
        queries.clear();
        for row in siblings.clone() {
            let at = (row * heads + kv_head * group) * dim;
            let from = queries.len();
            queries.extend_from_slice(&q[at..at + width]);
            for query in queries[from..].chunks_exact_mut(dim) {
                rope.apply(query, rows.positions[row]);
            }
        }
        let own = |p: usize| {
            caches[rows.sequences[siblings.start + p]]
                .head(layer, kv_head)
                .own
        };
        let shared = eldest.head(layer, kv_head);
        attend(
            Queries {
                rows: queries,
                head_stride: dim,
                position_stride: width,
                visible,
            },
            Split {
                // Siblings have a prefix (without one `base` is 0, and
                // the own keys are all there is).
                prefix: shared.prefix.unwrap_or(shared.own),
                len: shared.base,
                own: Own::Each(&own),
            },
            dim,
            scale,
            attended,
        )?;
        for (p, from) in attended.chunks_exact(width).enumerate() {
            out[(p * heads + kv_head * group) * dim..][..width].copy_from_slice(from);
        }
    }
    Ok(())
}

/// RMSNorm in the arithmetic of candle's `rms_norm`, which the tensor
/// forward runs (the squares summed in order, each value divided by the root
/// mean square, then scaled), so a decode step computes the tensor path's
/// bits.
fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let root_mean_square = (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32 + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = v / root_mean_square * w;
    }
}
