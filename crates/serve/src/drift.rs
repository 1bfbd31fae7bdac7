//! The drift monitor: on a sample of forwards, every layer input is compared
//! with what calibration saw (the artifact's `calibration.json`).
//!
//! Per observation point and per window of `window_rows` sampled rows it
//! measures three things: the share of values outside the calibrated range
//! (|x| above calibration's abs-max), the share a static INT8 layer clips
//! (|x| beyond 127.5 steps of its scale, where rounding stops absorbing the
//! excess), and the total-variation distance between the window's |x|
//! distribution over binary octaves and calibration's. `qforge_drift_alert`
//! is raised while any point's last window has more mass out of range than
//! the threshold (1e-3 by default) on top of what an unchanged distribution
//! puts there: a fresh row from the calibration distribution exceeds the
//! largest of n calibration rows with probability 1 / (n + 1) (order
//! statistics), which for a policy calibrated on 512 observations is 2e-3 —
//! measured 2.2e-3 on held-out CartPole rollouts — and would otherwise raise
//! the alarm on data that never drifted.
//!
//! Cost: one pass over the sampled inputs with a compare and an increment
//! per value, on the batching thread, for the sampled share of forwards.

use std::collections::BTreeMap;
use std::sync::Arc;

use qforge_formats::profile::{CalibrationProfile, OCTAVES, PointProfile, octave};
use qforge_model::Observer;

use crate::metrics::Metrics;

/// How the monitor samples and judges.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DriftOptions {
    /// Share of forwards observed, in (0, 1].
    pub sample: f64,
    /// Sampled rows (observations or tokens) per judged window.
    pub window_rows: usize,
    /// Out-of-range share above which the alert is raised.
    pub threshold: f64,
}

/// Counts of the current window at one point.
struct Window {
    rows: usize,
    values: u64,
    zeros: u64,
    out_of_range: u64,
    clipped: u64,
    octaves: Box<[u64; OCTAVES]>,
}

impl Window {
    fn new() -> Self {
        Self {
            rows: 0,
            values: 0,
            zeros: 0,
            out_of_range: 0,
            clipped: 0,
            octaves: Box::new([0; OCTAVES]),
        }
    }
}

/// One watched point.
struct Watch {
    profile: PointProfile,
    /// Calibration's octave shares, dense.
    expected: Box<[f64; OCTAVES]>,
    /// |x| beyond which a static INT8 layer clips.
    clips_above: Option<f32>,
    window: Window,
    /// Out-of-range share of the last full window beyond the share expected
    /// without drift.
    last_excess: f64,
    /// Rows of this point calibration saw (known once its width is).
    calibration_rows: f64,
    labels: Vec<(String, String)>,
}

/// The monitor; it lives on the batching thread of the served model.
pub struct DriftMonitor {
    watches: BTreeMap<String, Watch>,
    options: DriftOptions,
    metrics: Arc<Metrics>,
    /// Fractional forwards owed to the sample (deterministic sampling).
    credit: f64,
    alerting: bool,
}

impl DriftMonitor {
    /// A monitor for the points of `profile`; `input_scales` holds the
    /// activation scale of every static INT8 point.
    pub fn new(
        profile: CalibrationProfile,
        input_scales: &BTreeMap<String, f32>,
        options: DriftOptions,
        metrics: Arc<Metrics>,
    ) -> Self {
        let watches = profile
            .points
            .into_iter()
            .map(|(point, profile)| {
                let mut expected = Box::new([0.0; OCTAVES]);
                for (&k, &share) in &profile.octave_shares {
                    if let Some(slot) = expected.get_mut(k) {
                        *slot = share;
                    }
                }
                let watch = Watch {
                    expected,
                    clips_above: input_scales.get(&point).map(|s| 127.5 * s),
                    window: Window::new(),
                    last_excess: 0.0,
                    calibration_rows: 0.0,
                    labels: vec![("point".to_owned(), point.clone())],
                    profile,
                };
                (point, watch)
            })
            .collect();
        Self {
            watches,
            options,
            metrics,
            credit: 0.0,
            alerting: false,
        }
    }

    /// `monitor` as the observer of the next forward when that forward is
    /// in the sample.
    pub fn observer_for_next(monitor: Option<&mut DriftMonitor>) -> Option<&mut dyn Observer> {
        let monitor = monitor?;
        if monitor.sample_next() {
            Some(monitor)
        } else {
            None
        }
    }

    /// Whether to observe the next forward.
    fn sample_next(&mut self) -> bool {
        self.credit += self.options.sample;
        if self.credit >= 1.0 {
            self.credit -= 1.0;
            true
        } else {
            false
        }
    }

    /// Publishes a full window of `point` and re-judges the alert.
    fn close_window(&mut self, point: &str) {
        let Some(watch) = self.watches.get_mut(point) else {
            return;
        };
        let w = std::mem::replace(&mut watch.window, Window::new());
        let n = w.values.max(1) as f64;
        let zero_gap = (w.zeros as f64 / n - watch.profile.zero_share).abs();
        let octave_gap: f64 = w
            .octaves
            .iter()
            .zip(watch.expected.iter())
            .map(|(&count, &share)| (count as f64 / n - share).abs())
            .sum();
        let out_of_range = w.out_of_range as f64 / n;
        watch.last_excess = out_of_range - 1.0 / (watch.calibration_rows + 1.0);
        let m = &self.metrics;
        m.drift_out_of_range
            .get_or_create(&watch.labels)
            .set(out_of_range);
        m.drift_clipping
            .get_or_create(&watch.labels)
            .set(w.clipped as f64 / n);
        m.drift_distance
            .get_or_create(&watch.labels)
            .set(0.5 * (zero_gap + octave_gap));
        m.drift_windows.get_or_create(&watch.labels).inc();

        let worst = self
            .watches
            .iter()
            .max_by(|a, b| a.1.last_excess.total_cmp(&b.1.last_excess))
            .map(|(p, w)| (p.clone(), w.last_excess));
        let alert = worst
            .as_ref()
            .is_some_and(|(_, share)| *share > self.options.threshold);
        if alert != self.alerting {
            self.alerting = alert;
            self.metrics.drift_alert.set(i64::from(alert));
            match worst {
                Some((p, share)) if alert => tracing::warn!(
                    "qforge serve: drift alert: {:.3} % more of the values reaching {p} lie outside the calibrated range than calibration's sample size explains (threshold {:.3} %); recalibrate on recent data",
                    share * 100.0,
                    self.options.threshold * 100.0
                ),
                _ => tracing::info!("qforge serve: drift alert cleared"),
            }
        }
    }
}

impl Observer for DriftMonitor {
    fn observe(&mut self, point: &str, rows: &[f32], width: usize) -> qforge_model::Result<()> {
        let Some(watch) = self.watches.get_mut(point) else {
            return Ok(());
        };
        if watch.calibration_rows == 0.0 {
            watch.calibration_rows = (watch.profile.values / width.max(1) as u64) as f64;
        }
        let range = watch.profile.abs_max;
        let clips_above = watch.clips_above.unwrap_or(f32::INFINITY);
        let w = &mut watch.window;
        for &x in rows {
            let a = x.abs();
            if a == 0.0 {
                w.zeros += 1;
            } else {
                w.octaves[octave(a)] += 1;
            }
            // NaN compares false everywhere; the model refuses those inputs.
            w.out_of_range += u64::from(a > range);
            w.clipped += u64::from(a > clips_above);
        }
        w.values += rows.len() as u64;
        w.rows += rows.len() / width.max(1);
        if w.rows >= self.options.window_rows {
            self.close_window(point);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn monitor() -> DriftMonitor {
        let profile = CalibrationProfile {
            points: BTreeMap::from([(
                "layers.0".to_owned(),
                PointProfile {
                    abs_max: 2.0,
                    // 10 000 rows of width 2: 1e-4 expected beyond the range.
                    values: 20_000,
                    zero_share: 0.0,
                    // Everything in [1, 2).
                    octave_shares: BTreeMap::from([(octave(1.0), 1.0)]),
                },
            )]),
        };
        DriftMonitor::new(
            profile,
            // Static scale: clips beyond 127.5 · 2/127 ≈ 2.008.
            &BTreeMap::from([("layers.0".to_owned(), 2.0 / 127.0)]),
            DriftOptions {
                sample: 0.25,
                window_rows: 100,
                threshold: 1e-3,
            },
            Arc::new(Metrics::default()),
        )
    }

    #[test]
    fn sampling_takes_the_exact_share() {
        let mut m = monitor();
        let taken = (0..1000).filter(|_| m.sample_next()).count();
        assert_eq!(taken, 250);
    }

    fn metric(m: &DriftMonitor, name: &str) -> f64 {
        let text = m.metrics.render();
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no {name} in {text}"))
            .parse()
            .unwrap()
    }

    #[test]
    fn in_range_data_stays_quiet_and_out_of_range_data_alerts() {
        let mut m = monitor();
        let point = "{point=\"layers.0\"}";
        // 100 rows of width 2 like calibration's: no drift, no alert.
        let calm: Vec<f32> = (0..200).map(|i| 1.0 + (i % 10) as f32 * 0.05).collect();
        m.observe("layers.0", &calm, 2).unwrap();
        assert_eq!(metric(&m, "qforge_drift_alert"), 0.0);
        assert_eq!(metric(&m, &format!("qforge_activation_drift{point}")), 0.0);
        assert_eq!(
            metric(&m, &format!("qforge_activation_clipping_ratio{point}")),
            0.0
        );
        // A window where 1 value in 200 is beyond the range (and the clip).
        let mut hot = calm.clone();
        hot[7] = 4.0;
        m.observe("layers.0", &hot, 2).unwrap();
        assert_eq!(metric(&m, "qforge_drift_alert"), 1.0);
        for name in [
            "qforge_activation_out_of_range_ratio",
            "qforge_activation_clipping_ratio",
            "qforge_activation_drift",
        ] {
            let v = metric(&m, &format!("{name}{point}"));
            assert!((v - 0.005).abs() < 1e-12, "{name} {v}");
        }
        // Back in range: the alert clears on the next full window.
        m.observe("layers.0", &calm, 2).unwrap();
        assert_eq!(metric(&m, "qforge_drift_alert"), 0.0);
        // Points the profile does not know are ignored.
        m.observe("layers.9", &hot, 2).unwrap();
    }
}
