//! What the kernel benches share.

use criterion::Criterion;

/// One measurement setting for every kernel bench, so that the figures
/// `scripts/bench.sh` puts side by side in BENCHMARKS.md are taken alike.
pub fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(std::time::Duration::from_millis(500))
        .measurement_time(std::time::Duration::from_secs(2))
        .sample_size(20)
}
