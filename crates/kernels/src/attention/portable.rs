//! The portable tier: the attention arithmetic in scalar Rust, lane for lane
//! the order the AVX2 tier computes in, so both give the same bits.

use super::*;

pub(super) fn attend(
    queries: Queries<'_>,
    kv: Split<'_>,
    hd: usize,
    scratch: Scratch<'_>,
    scale: f32,
    out: &mut [f32],
) {
    let padded = scratch.padded();
    let group = scratch.totals.len() / queries.positions();
    let rows = scratch.scores.chunks_exact_mut(padded);
    for (r, (row, out)) in rows.zip(out.chunks_exact_mut(hd)).enumerate() {
        let (p, g) = (r / group, r % group);
        let visible = queries.visible[p];
        let query = &queries.rows[p * queries.position_stride + g * queries.head_stride..][..hd];
        // The prefix's positions from the shared cache, the rest from the
        // position's own: the same keys in the same order.
        let shared = visible.min(kv.len);
        let own = if visible > shared {
            kv.own_of(p)
        } else {
            kv.prefix
        };
        // Each span with the position its cache's first key holds.
        let spans = [(kv.prefix, 0..shared, 0), (own, shared..visible, shared)];
        let row = &mut row[..visible.next_multiple_of(LANES)];
        for (kv, span, first) in spans.clone() {
            for t in span {
                let key = &kv.keys[kv.offset + (t - first) * kv.stride..][..hd];
                row[t] = dot(query, key) * scale;
            }
        }
        row[visible..].fill(f32::NEG_INFINITY);
        let total = exponentials(row);
        out.fill(0.0);
        for (kv, span, first) in spans {
            for t in span {
                let at = kv.offset + (t - first) * kv.stride;
                let (e, value) = (row[t], &kv.values[at..][..hd]);
                for (o, &v) in out.iter_mut().zip(value) {
                    *o = e.mul_add(v, *o);
                }
            }
        }
        out.iter_mut().for_each(|o| *o /= total);
    }
}

/// `q·k`: dimension `d` in lane `d mod 8`, lanes summed by the tree.
fn dot(q: &[f32], k: &[f32]) -> f32 {
    let mut lanes = [0f32; LANES];
    for (d, (&a, &b)) in q.iter().zip(k).enumerate() {
        lanes[d % LANES] = a.mul_add(b, lanes[d % LANES]);
    }
    tree_sum(lanes)
}

/// Replaces a padded row of scores by `e^(s - max)` and returns their sum.
fn exponentials(row: &mut [f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    for block in row.chunks_exact(LANES) {
        for (m, &s) in lanes.iter_mut().zip(block) {
            *m = max_ps(*m, s);
        }
    }
    // The order of `x86::max_lanes`.
    let max = max_ps(
        max_ps(max_ps(lanes[0], lanes[4]), max_ps(lanes[2], lanes[6])),
        max_ps(max_ps(lanes[1], lanes[5]), max_ps(lanes[3], lanes[7])),
    );
    let mut sums = [0f32; LANES];
    for block in row.chunks_exact_mut(LANES) {
        for (sum, s) in sums.iter_mut().zip(block) {
            *s = exp(*s - max);
            *sum += *s;
        }
    }
    tree_sum(sums)
}
