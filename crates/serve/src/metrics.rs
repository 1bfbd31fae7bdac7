//! The server's Prometheus metrics, exposed at `/metrics` in the text
//! format.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

/// Labels: endpoint and status, or arm.
pub type Labels = Vec<(String, String)>;

/// A gauge holding a ratio or a mean.
type FloatGauge = Gauge<f64, AtomicU64>;

fn latency_histogram() -> Histogram {
    // 50 µs … ~1.6 s in factors of 2.
    Histogram::new(exponential_buckets(5e-5, 2.0, 16))
}

/// Every metric the server keeps.
pub struct Metrics {
    registry: Registry,
    /// Requests by endpoint and HTTP status.
    pub requests: Family<Labels, Counter>,
    /// Request latency by endpoint, seconds.
    pub latency: Family<Labels, Histogram, fn() -> Histogram>,
    /// Rows per batched forward: observations, or sequences per decode step.
    pub batch_rows: Histogram,
    /// Requests waiting for the batcher.
    pub queue_depth: Gauge,
    /// Observations answered.
    pub observations: Counter,
    /// Resident memory of the process, bytes (read at scrape time).
    pub resident_memory: Gauge,
    /// Requests answered, by arm (`int8`, `fp`).
    pub arm_requests: Family<Labels, Counter>,
    /// 1 once traffic has rolled back to the FP reference.
    pub rolled_back: Gauge,
    /// Observations the FP reference shadowed.
    pub shadow_observations: Counter,
    /// Shadow action agreement over the rollout window.
    pub shadow_agreement: FloatGauge,
    /// Episode rewards received, by arm.
    pub feedback_episodes: Family<Labels, Counter>,
    /// Mean episode reward over the rollout window, by arm.
    pub mean_episode_reward: Family<Labels, FloatGauge>,
    /// Reward consistency of INT8 against FP over full windows.
    pub reward_consistency: FloatGauge,
    /// Share of sampled layer-input values beyond the calibrated range, by
    /// point, over the last drift window.
    pub drift_out_of_range: Family<Labels, FloatGauge>,
    /// Share a static INT8 layer clipped, by point, last drift window.
    pub drift_clipping: Family<Labels, FloatGauge>,
    /// Total-variation distance of |x| octaves from calibration's, by point,
    /// last drift window.
    pub drift_distance: Family<Labels, FloatGauge>,
    /// Drift windows judged, by point.
    pub drift_windows: Family<Labels, Counter>,
    /// 1 while some point's out-of-range share exceeds the threshold.
    pub drift_alert: Gauge,
    /// Prompt tokens run through the model.
    pub prompt_tokens: Counter,
    /// Tokens generated.
    pub generated_tokens: Counter,
    /// Sequences in the decode batch.
    pub running_sequences: Gauge,
    /// KV-cache positions reserved by running sequences.
    pub kv_reserved_tokens: Gauge,
    /// Seconds from admission to the first token (the prompt's forward).
    pub time_to_first_token: Histogram,
    /// Seconds from admission to the last token.
    pub completion_duration: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("qforge");
        let requests = Family::<Labels, Counter>::default();
        let latency =
            Family::<Labels, Histogram, fn() -> Histogram>::new_with_constructor(latency_histogram);
        let batch_rows = Histogram::new(exponential_buckets(1.0, 2.0, 10));
        let queue_depth = Gauge::default();
        let observations = Counter::default();
        let resident_memory = Gauge::default();
        registry.register(
            "requests",
            "HTTP requests by endpoint and status",
            requests.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "Request latency by endpoint",
            latency.clone(),
        );
        registry.register(
            "batch_rows",
            "Rows per batched forward: observations, or sequences in a decode step",
            batch_rows.clone(),
        );
        registry.register(
            "queue_depth",
            "Requests waiting for the batcher",
            queue_depth.clone(),
        );
        registry.register(
            "observations",
            "Observations answered",
            observations.clone(),
        );
        registry.register(
            "resident_memory_bytes",
            "Resident memory of the server process",
            resident_memory.clone(),
        );
        let arm_requests = Family::<Labels, Counter>::default();
        let rolled_back = Gauge::default();
        let shadow_observations = Counter::default();
        let shadow_agreement = FloatGauge::default();
        let feedback_episodes = Family::<Labels, Counter>::default();
        let mean_episode_reward = Family::<Labels, FloatGauge>::default();
        let reward_consistency = FloatGauge::default();
        registry.register(
            "arm_requests",
            "Requests answered, by arm",
            arm_requests.clone(),
        );
        registry.register(
            "rolled_back",
            "1 once traffic has rolled back to the FP reference",
            rolled_back.clone(),
        );
        registry.register(
            "shadow_observations",
            "Observations the FP reference shadowed",
            shadow_observations.clone(),
        );
        registry.register(
            "shadow_agreement",
            "Action agreement of INT8 with the FP shadow over the rollout window",
            shadow_agreement.clone(),
        );
        registry.register(
            "feedback_episodes",
            "Episode rewards received on /v1/feedback, by arm",
            feedback_episodes.clone(),
        );
        registry.register(
            "mean_episode_reward",
            "Mean episode reward over the rollout window, by arm",
            mean_episode_reward.clone(),
        );
        registry.register(
            "reward_consistency",
            "1 - |int8 - fp| / |fp - random| of mean episode rewards over full windows",
            reward_consistency.clone(),
        );
        let drift_out_of_range = Family::<Labels, FloatGauge>::default();
        let drift_clipping = Family::<Labels, FloatGauge>::default();
        let drift_distance = Family::<Labels, FloatGauge>::default();
        let drift_windows = Family::<Labels, Counter>::default();
        let drift_alert = Gauge::default();
        registry.register(
            "activation_out_of_range_ratio",
            "Share of sampled layer-input values beyond the calibrated range, last drift window",
            drift_out_of_range.clone(),
        );
        registry.register(
            "activation_clipping_ratio",
            "Share of sampled layer-input values a static INT8 layer clips, last drift window",
            drift_clipping.clone(),
        );
        registry.register(
            "activation_drift",
            "Total-variation distance of the |x| octave histogram from calibration's, last drift window",
            drift_distance.clone(),
        );
        registry.register(
            "drift_windows",
            "Drift windows judged, by point",
            drift_windows.clone(),
        );
        registry.register(
            "drift_alert",
            "1 while some point's out-of-range share exceeds the drift threshold",
            drift_alert.clone(),
        );
        let prompt_tokens = Counter::default();
        let generated_tokens = Counter::default();
        let running_sequences = Gauge::default();
        let kv_reserved_tokens = Gauge::default();
        let time_to_first_token = latency_histogram();
        let completion_duration = latency_histogram();
        registry.register(
            "prompt_tokens",
            "Prompt tokens run through the model",
            prompt_tokens.clone(),
        );
        registry.register(
            "generated_tokens",
            "Tokens generated",
            generated_tokens.clone(),
        );
        registry.register(
            "running_sequences",
            "Sequences in the decode batch",
            running_sequences.clone(),
        );
        registry.register(
            "kv_reserved_tokens",
            "KV-cache positions reserved by running sequences",
            kv_reserved_tokens.clone(),
        );
        registry.register(
            "time_to_first_token_seconds",
            "Seconds from admission to the first token",
            time_to_first_token.clone(),
        );
        registry.register(
            "completion_duration_seconds",
            "Seconds from admission to the last token",
            completion_duration.clone(),
        );
        Self {
            registry,
            requests,
            latency,
            batch_rows,
            queue_depth,
            observations,
            resident_memory,
            arm_requests,
            rolled_back,
            shadow_observations,
            shadow_agreement,
            feedback_episodes,
            mean_episode_reward,
            reward_consistency,
            drift_out_of_range,
            drift_clipping,
            drift_distance,
            drift_windows,
            drift_alert,
            prompt_tokens,
            generated_tokens,
            running_sequences,
            kv_reserved_tokens,
            time_to_first_token,
            completion_duration,
        }
    }
}

impl Metrics {
    /// Counts one finished request.
    pub fn record(&self, endpoint: &str, status: u16, seconds: f64) {
        let endpoint = ("endpoint".to_owned(), endpoint.to_owned());
        self.requests
            .get_or_create(&vec![
                endpoint.clone(),
                ("status".into(), status.to_string()),
            ])
            .inc();
        self.latency.get_or_create(&vec![endpoint]).observe(seconds);
    }

    /// The text exposition.
    pub fn render(&self) -> String {
        self.resident_memory.set(resident_bytes());
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}

/// Resident set size from `/proc/self/statm` (0 where there is none).
fn resident_bytes() -> i64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<i64>().ok())
        .map_or(0, |pages| pages * 4096)
}
