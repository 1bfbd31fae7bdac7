//! Property tests of the merge laws that make statistics exact and order-free:
//! merging is commutative and associative, any sharding of the same values in
//! any order encodes to the same bytes, and a batch cannot be counted twice.
//! A Gram matrix that some batch's values dropped (NaN, ±∞, beyond its
//! range) obeys the same laws.

use proptest::prelude::*;
use qforge_core::codec::{decode, encode};
use qforge_core::{BatchId, Digest, Gram, MergePolicy, Provenance, SplitMix64, Stats, TensorStats};

const CHANNELS: usize = 4;

/// Values of every class: ordinary, zero of both signs, subnormal, huge, ±∞ and
/// NaN (with arbitrary payloads).
fn value() -> impl Strategy<Value = f32> {
    prop_oneof![
        6 => -10.0f32..10.0,
        1 => Just(0.0f32),
        1 => Just(-0.0f32),
        1 => proptest::num::f32::ANY,
        1 => any::<u32>().prop_map(f32::from_bits),
    ]
}

/// Rows of `CHANNELS` values.
fn rows() -> impl Strategy<Value = Vec<f32>> {
    (0usize..40).prop_flat_map(|rows| proptest::collection::vec(value(), rows * CHANNELS))
}

/// Statistics of one batch: three tensors, one with per-channel tracking and
/// one with a Gram matrix (at the exponent of a run of 100 batches of at
/// most 40 rows, so that the huge values drop it).
fn batch_stats(index: u64, values: &[f32]) -> Stats {
    let mut with_channels = TensorStats::with_channels(CHANNELS);
    with_channels.observe(values).unwrap();
    let mut plain = TensorStats::new();
    plain.observe(values).unwrap();
    let gram = Gram::new(CHANNELS, Gram::run_exponent(100 * 40)).unwrap();
    let mut with_gram = TensorStats::with_gram(gram);
    with_gram.observe(values).unwrap();
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let id = BatchId {
        index,
        content: Digest::of(&bytes),
    };
    Stats {
        provenance: Provenance::single(
            Some(Digest::of(b"model")),
            Digest::of(b"data"),
            Digest::of(b"recipe"),
            "activation",
            id,
            100,
        ),
        tensors: [
            ("layers.0.mlp.down_proj".to_owned(), with_channels),
            ("layers.0.self_attn.q_proj".to_owned(), plain),
            ("layers.0.self_attn.o_proj".to_owned(), with_gram),
        ]
        .into(),
    }
}

fn merged(parts: &[Stats]) -> Stats {
    let mut out = Stats::default();
    for part in parts {
        out.merge(part, MergePolicy::Strict).unwrap();
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn merge_is_commutative(a in rows(), b in rows()) {
        let (a, b) = (batch_stats(0, &a), batch_stats(1, &b));
        prop_assert_eq!(encode(&merged(&[a.clone(), b.clone()])), encode(&merged(&[b, a])));
    }

    #[test]
    fn merge_is_associative(a in rows(), b in rows(), c in rows()) {
        let (a, b, c) = (batch_stats(0, &a), batch_stats(1, &b), batch_stats(2, &c));
        let left = merged(&[merged(&[a.clone(), b.clone()]), c.clone()]);
        let right = merged(&[a, merged(&[b, c])]);
        prop_assert_eq!(encode(&left), encode(&right));
    }

    /// Splitting the same batches across any number of workers, each merging
    /// its share in any order, and merging the workers' results in any order,
    /// gives the bytes of a single worker that merged every batch in order.
    #[test]
    fn any_sharding_gives_identical_bytes(
        batches in proptest::collection::vec(rows(), 1..12),
        assignment in proptest::collection::vec(0usize..5, 12),
        order_seed in any::<u64>(),
    ) {
        let stats: Vec<Stats> = batches.iter().enumerate()
            .map(|(i, v)| batch_stats(i as u64, v)).collect();
        let single = encode(&merged(&stats));

        let mut workers: Vec<Vec<Stats>> = vec![Vec::new(); 5];
        for (i, s) in stats.iter().enumerate() {
            workers[assignment[i]].push(s.clone());
        }
        let mut draws = SplitMix64::new(order_seed);
        let mut partials: Vec<Stats> = workers.into_iter().map(|mut w| {
            shuffle(&mut w, &mut draws);
            merged(&w)
        }).collect();
        shuffle(&mut partials, &mut draws);
        let sharded = merged(&partials);
        prop_assert_eq!(&encode(&sharded), &single);
        prop_assert_eq!(decode(&single).unwrap(), sharded.clone());

        // And both equal the ground truth: every value observed at once.
        // Not the Gram matrix: its f32 sums are rounded per observation's
        // chunk, so one observation of every row rounds otherwise (exactness
        // is that the same observations give the same integers).
        let all: Vec<f32> = batches.concat();
        let mut truth = batch_stats(0, &all).tensors;
        let mut sharded = sharded.tensors;
        for tensors in [&mut truth, &mut sharded] {
            tensors.remove("layers.0.self_attn.o_proj");
        }
        prop_assert_eq!(&sharded, &truth);
    }

    /// A batch merged a second time (a retry or a speculative duplicate) is
    /// refused, and the statistics are left exactly as they were.
    #[test]
    fn duplicates_are_refused(batches in proptest::collection::vec(rows(), 1..6), pick in any::<usize>()) {
        let stats: Vec<Stats> = batches.iter().enumerate()
            .map(|(i, v)| batch_stats(i as u64, v)).collect();
        let mut all = merged(&stats);
        let before = encode(&all);
        let duplicate = &stats[pick % stats.len()];
        prop_assert!(all.merge(duplicate, MergePolicy::Strict).is_err());
        prop_assert_eq!(encode(&all), before);
    }

    /// Observing values in one call or in arbitrary pieces is the same.
    #[test]
    fn observation_is_split_invariant(values in rows(), cuts in proptest::collection::vec(any::<usize>(), 0..6)) {
        let mut whole = TensorStats::new();
        whole.observe(&values).unwrap();
        let mut pieces = TensorStats::new();
        let mut points: Vec<usize> = cuts.iter().map(|c| c % (values.len() + 1)).collect();
        points.push(0);
        points.push(values.len());
        points.sort_unstable();
        for w in points.windows(2) {
            pieces.observe(&values[w[0]..w[1]]).unwrap();
        }
        prop_assert_eq!(whole, pieces);
    }
}

/// Fisher–Yates with a SplitMix64 stream, so the order is part of the case.
fn shuffle<T>(items: &mut [T], draws: &mut SplitMix64) {
    for i in (1..items.len()).rev() {
        items.swap(i, (draws.next_u64() % (i as u64 + 1)) as usize);
    }
}

#[test]
fn forced_merge_is_marked_and_order_free() {
    let a = batch_stats(0, &[1.0; 8]);
    let mut b = batch_stats(0, &[2.0; 8]);
    b.provenance.data = [Digest::of(b"other data")].into();
    let mut ab = a.clone();
    assert!(ab.merge(&b, MergePolicy::Strict).is_err());
    ab.merge(&b, MergePolicy::Force).unwrap();
    let mut ba = b.clone();
    ba.merge(&a, MergePolicy::Force).unwrap();
    assert!(ab.provenance.forced);
    assert_eq!(ab.provenance.data.len(), 2);
    assert_eq!(encode(&ab), encode(&ba));
}

#[test]
fn channel_count_mismatch_is_an_error_and_changes_nothing() {
    let mut a = batch_stats(0, &[1.0; 8]);
    let mut b = batch_stats(1, &[1.0; 8]);
    b.tensors.insert(
        "layers.0.mlp.down_proj".into(),
        TensorStats::with_channels(3),
    );
    let before = encode(&a);
    let err = a.merge(&b, MergePolicy::Strict).unwrap_err();
    assert!(err.to_string().contains("channels"), "{err}");
    assert_eq!(encode(&a), before);
}

#[test]
fn values_a_gram_matrix_cannot_sum_drop_it_in_any_merge_order() {
    let finite = batch_stats(0, &[1.5; 8]);
    let gram = |stats: &Stats| stats.tensors["layers.0.self_attn.o_proj"].gram().cloned();
    assert!(gram(&finite).is_some());
    for bad in [f32::NAN, f32::INFINITY, 1e30] {
        let dropped = batch_stats(1, &[bad, 1.0, 2.0, 3.0]);
        let tensor = &dropped.tensors["layers.0.self_attn.o_proj"];
        assert!(tensor.gram().is_none(), "{bad} kept the Gram matrix");
        // The histogram still counts the values.
        let h = tensor.histogram();
        assert_eq!(h.count() + h.nan() + h.pos_inf() + h.neg_inf(), 4);
        let (ab, ba) = (
            merged(&[finite.clone(), dropped.clone()]),
            merged(&[dropped, finite.clone()]),
        );
        assert!(gram(&ab).is_none());
        assert_eq!(encode(&ab), encode(&ba));
    }
}
