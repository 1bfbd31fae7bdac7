//! Error metrics between a reference signal and its reconstruction.
//!
//! Sums run in `f64` in index order. Pairs where either side is NaN are skipped
//! and counted, so a metric never silently turns into NaN.

/// Error of a reconstruction against its reference.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ErrorMetrics {
    /// Mean squared error.
    pub mse: f64,
    /// Signal-to-quantization-noise ratio in dB: 10·log10(Σx² / Σ(x − x')²).
    /// `+∞` for a perfect reconstruction (including an all-zero signal
    /// reconstructed exactly), `−∞` for noise on an all-zero signal.
    pub sqnr_db: f64,
    /// Largest absolute error.
    pub max_abs: f64,
    /// Number of pairs compared.
    pub compared: usize,
    /// Number of pairs skipped because one side was NaN.
    pub skipped_nan: usize,
}

/// Compares `reconstructed` against `reference`. Panics if the lengths differ
/// (a caller bug, not bad data).
pub fn error_metrics(reference: &[f32], reconstructed: &[f32]) -> ErrorMetrics {
    assert_eq!(
        reference.len(),
        reconstructed.len(),
        "error_metrics: length mismatch"
    );
    let (mut signal, mut noise, mut max_abs) = (0.0f64, 0.0f64, 0.0f64);
    let (mut compared, mut skipped_nan) = (0usize, 0usize);
    for (&x, &y) in reference.iter().zip(reconstructed) {
        if x.is_nan() || y.is_nan() {
            skipped_nan += 1;
            continue;
        }
        let (x, y) = (f64::from(x), f64::from(y));
        let e = x - y;
        // ∞ − ∞ is the one NaN left: equal infinities are a perfect match.
        let e = if e.is_nan() { 0.0 } else { e };
        signal += x * x;
        noise += e * e;
        max_abs = max_abs.max(e.abs());
        compared += 1;
    }
    let mse = if compared == 0 {
        0.0
    } else {
        noise / compared as f64
    };
    let sqnr_db = match (signal > 0.0, noise > 0.0) {
        (_, false) => f64::INFINITY,
        (false, true) => f64::NEG_INFINITY,
        (true, true) => 10.0 * (signal / noise).log10(),
    };
    ErrorMetrics {
        mse,
        sqnr_db,
        max_abs,
        compared,
        skipped_nan,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::QuantParams;

    #[test]
    fn exact_and_simple_cases() {
        let m = error_metrics(&[1.0, -2.0], &[1.0, -2.0]);
        assert_eq!((m.mse, m.max_abs, m.sqnr_db), (0.0, 0.0, f64::INFINITY));
        let m = error_metrics(&[3.0, 4.0], &[3.0, 3.0]);
        assert_eq!(m.mse, 0.5);
        assert_eq!(m.max_abs, 1.0);
        assert!((m.sqnr_db - 10.0 * 25f64.log10()).abs() < 1e-12);
        let m = error_metrics(&[0.0, 0.0], &[0.0, 1.0]);
        assert_eq!(m.sqnr_db, f64::NEG_INFINITY);
        let m = error_metrics(&[f32::NAN, 1.0], &[0.0, 1.0]);
        assert_eq!((m.compared, m.skipped_nan), (1, 1));
        let m = error_metrics(&[], &[]);
        assert_eq!((m.mse, m.sqnr_db), (0.0, f64::INFINITY));
    }

    #[test]
    fn int8_sqnr_of_a_uniform_signal_is_about_six_db_per_bit() {
        // Uniform on [-1, 1] at full scale: SQNR ≈ 6.02·8 − 4.77 + 4.77 ≈ 48 dB
        // (signal power 1/3, noise step²/12 with step = 1/127).
        let x: Vec<f32> = (0..20_001).map(|i| i as f32 / 10_000.0 - 1.0).collect();
        let p = QuantParams::symmetric(1.0).params;
        let mut q = vec![0i8; x.len()];
        p.quantize_slice(&x, &mut q);
        let mut y = vec![0f32; x.len()];
        p.dequantize_slice(&q, &mut y);
        let m = error_metrics(&x, &y);
        let expected = 10.0 * ((1.0 / 3.0) / ((1.0 / 127.0f64).powi(2) / 12.0)).log10();
        assert!(
            (m.sqnr_db - expected).abs() < 0.2,
            "{} vs {expected}",
            m.sqnr_db
        );
        assert!(m.max_abs <= 0.5 / 127.0 + 1e-6);
    }
}
