//! Every CPU tier of the observation kernel against its scalar twin, on random
//! lengths (including empty, odd and block-straddling ones) and every value
//! class. A tier this CPU lacks is reported as skipped, not passed.

use proptest::prelude::*;
use qforge_core::histogram::observe_reference;
use qforge_core::{CpuFeatures, CpuTier, Histogram, ObserveTier};

/// Tier tests skip what the CPU lacks, so a probe that stopped seeing a
/// feature would turn them into passes that ran nothing. Where the CPU is
/// chosen for the tests (qemu's CPU models in scripts/test-aarch64.sh), the
/// runner names its features in `QFORGE_EXPECT_CPU_FEATURES` and the probe
/// must find each.
#[test]
fn the_probe_finds_every_feature_the_runner_names() {
    let Ok(expected) = std::env::var("QFORGE_EXPECT_CPU_FEATURES") else {
        eprintln!("SKIPPED: QFORGE_EXPECT_CPU_FEATURES names no features to find");
        return;
    };
    let found = CpuFeatures::get().names();
    for feature in expected.split(',').filter(|f| !f.is_empty()) {
        assert!(
            found.contains(&feature),
            "the runner's CPU has {feature}, the probe found only {found:?}"
        );
    }
}

fn supported_tiers() -> Vec<ObserveTier> {
    ObserveTier::ALL
        .iter()
        .copied()
        .filter(|tier| {
            let ok = tier.is_supported();
            if !ok {
                eprintln!("SKIPPED: observe tier {tier:?} is not supported on this CPU");
            }
            ok
        })
        .collect()
}

/// Finite values only: whole blocks then take the vectorised fast path.
fn finite() -> impl Strategy<Value = f32> {
    prop_oneof![
        6 => -100.0f32..100.0,
        2 => Just(0.0f32),
        1 => Just(-0.0f32),
        1 => proptest::num::f32::NORMAL | proptest::num::f32::SUBNORMAL,
    ]
}

/// Every class, NaN and ±∞ included: blocks take the exact slow path.
fn any_class() -> impl Strategy<Value = f32> {
    prop_oneof![
        4 => finite(),
        1 => Just(f32::INFINITY),
        1 => Just(f32::NEG_INFINITY),
        1 => any::<u32>().prop_map(f32::from_bits),
    ]
}

fn values() -> impl Strategy<Value = Vec<f32>> {
    prop_oneof![
        proptest::collection::vec(finite(), 0..9000),
        proptest::collection::vec(any_class(), 0..9000),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn tiers_match_the_scalar_twin(values in values()) {
        let mut reference = Histogram::new();
        observe_reference(&mut reference, &values);
        for tier in supported_tiers() {
            let mut h = Histogram::new();
            h.observe_with(tier, &values).unwrap();
            prop_assert_eq!(&h, &reference, "tier {:?}", tier);
        }
    }
}

#[test]
fn tiers_match_on_finite_blocks_without_specials() {
    // Exercises the fast path (whole blocks of finite values) on a long input.
    let values: Vec<f32> = (0..3 * 4096)
        .map(|i| ((i as f32) * 0.618).sin() * 1e3 * if i % 3 == 0 { 0.0 } else { 1.0 })
        .collect();
    let mut reference = Histogram::new();
    observe_reference(&mut reference, &values);
    for tier in supported_tiers() {
        let mut h = Histogram::new();
        h.observe_with(tier, &values).unwrap();
        assert_eq!(h, reference, "tier {tier:?}");
    }
}

#[test]
fn unsupported_tier_is_an_error_not_a_silent_fallback() {
    for &tier in ObserveTier::ALL {
        let result = Histogram::new().observe_with(tier, &[1.0]);
        assert_eq!(result.is_ok(), tier.is_supported(), "{tier:?}");
    }
}
