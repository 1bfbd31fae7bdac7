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
    /// Connections open now.
    pub open_connections: Gauge,
    /// Connections closed, by reason (`done`, `header_timeout`,
    /// `idle_timeout`, `evicted`, `refused`, `shutdown`, `drain_deadline`,
    /// `error`).
    pub connections_closed: Family<Labels, Counter>,
    /// Panics caught on the model's threads (the request or batch failed;
    /// the thread went on).
    pub model_panics: Counter,
    /// The version of the model answering (1 at start, one more per
    /// reload).
    pub model_version: Gauge,
    /// `/admin/reload` requests, by outcome (`swapped`, `refused`).
    pub reloads: Family<Labels, Counter>,
    /// Requests answered, by arm (`int8`, `fp`).
    pub arm_requests: Family<Labels, Counter>,
    /// 1 once traffic has rolled back to the FP reference.
    pub rolled_back: Gauge,
    /// Observations the FP reference shadowed.
    pub shadow_observations: Counter,
    /// Shadow action agreement over the rollout window.
    pub shadow_agreement: FloatGauge,
    /// Per shadowed action or generated token, |log π_int8(a) −
    /// log π_fp(a)| of what INT8 answered: the train/rollout mismatch an
    /// importance weight corrects.
    pub logprob_mismatch: Histogram,
    /// The mean of that gap over the rollout window.
    pub logprob_mismatch_mean: FloatGauge,
    /// 1 while that mean exceeds the alert threshold.
    pub logprob_mismatch_alert: Gauge,
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
    /// Admitted sequences whose prompt is still being prefilled.
    pub prefilling_sequences: Gauge,
    /// Prefills dropped at a chunk boundary because their client had gone.
    pub cancelled_prefills: Counter,
    /// KV-cache positions reserved by admitted sequences.
    pub kv_reserved_tokens: Gauge,
    /// Seconds from admission to the first token (the prompt's forward).
    pub time_to_first_token: Histogram,
    /// Seconds from admission to the last token.
    pub completion_duration: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut metrics = Self::unregistered();
        // Registration order is the order of the text exposition.
        metrics.register_serving();
        metrics.register_rollout();
        metrics.register_drift();
        metrics.register_generation();
        metrics
    }
}

impl Metrics {
    /// Every metric at zero, none registered yet.
    fn unregistered() -> Self {
        Self {
            registry: Registry::with_prefix("qforge"),
            requests: Family::default(),
            latency: Family::new_with_constructor(latency_histogram),
            batch_rows: Histogram::new(exponential_buckets(1.0, 2.0, 10)),
            queue_depth: Gauge::default(),
            observations: Counter::default(),
            resident_memory: Gauge::default(),
            open_connections: Gauge::default(),
            connections_closed: Family::default(),
            model_panics: Counter::default(),
            model_version: Gauge::default(),
            reloads: Family::default(),
            arm_requests: Family::default(),
            rolled_back: Gauge::default(),
            shadow_observations: Counter::default(),
            shadow_agreement: FloatGauge::default(),
            logprob_mismatch: Histogram::new(exponential_buckets(1e-4, 4.0, 10)),
            logprob_mismatch_mean: FloatGauge::default(),
            logprob_mismatch_alert: Gauge::default(),
            feedback_episodes: Family::default(),
            mean_episode_reward: Family::default(),
            reward_consistency: FloatGauge::default(),
            drift_out_of_range: Family::default(),
            drift_clipping: Family::default(),
            drift_distance: Family::default(),
            drift_windows: Family::default(),
            drift_alert: Gauge::default(),
            prompt_tokens: Counter::default(),
            generated_tokens: Counter::default(),
            running_sequences: Gauge::default(),
            prefilling_sequences: Gauge::default(),
            cancelled_prefills: Counter::default(),
            kv_reserved_tokens: Gauge::default(),
            time_to_first_token: latency_histogram(),
            completion_duration: latency_histogram(),
        }
    }

    /// Requests, latency, batching, memory.
    fn register_serving(&mut self) {
        let registry = &mut self.registry;
        registry.register(
            "requests",
            "HTTP requests by endpoint and status",
            self.requests.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "Request latency by endpoint",
            self.latency.clone(),
        );
        registry.register(
            "batch_rows",
            "Rows per batched forward: observations, or sequences in a decode step",
            self.batch_rows.clone(),
        );
        registry.register(
            "queue_depth",
            "Requests waiting for the batcher",
            self.queue_depth.clone(),
        );
        registry.register(
            "observations",
            "Observations answered",
            self.observations.clone(),
        );
        registry.register(
            "resident_memory_bytes",
            "Resident memory of the server process",
            self.resident_memory.clone(),
        );
        registry.register(
            "open_connections",
            "Connections open now",
            self.open_connections.clone(),
        );
        registry.register(
            "connections_closed",
            "Connections closed, by reason",
            self.connections_closed.clone(),
        );
        registry.register(
            "model_panics",
            "Panics caught on the model's threads",
            self.model_panics.clone(),
        );
        self.model_version.set(1);
        registry.register(
            "model_version",
            "Version of the model answering: 1 at start, one more per reload",
            self.model_version.clone(),
        );
        registry.register(
            "reloads",
            "POST /admin/reload requests, by outcome",
            self.reloads.clone(),
        );
    }

    /// The A/B or shadow rollout against the FP reference.
    fn register_rollout(&mut self) {
        let registry = &mut self.registry;
        registry.register(
            "arm_requests",
            "Requests answered, by arm",
            self.arm_requests.clone(),
        );
        registry.register(
            "rolled_back",
            "1 once traffic has rolled back to the FP reference",
            self.rolled_back.clone(),
        );
        registry.register(
            "shadow_observations",
            "Observations the FP reference shadowed",
            self.shadow_observations.clone(),
        );
        registry.register(
            "shadow_agreement",
            "Action agreement of INT8 with the FP shadow over the rollout window",
            self.shadow_agreement.clone(),
        );
        registry.register(
            "logprob_mismatch",
            "Per shadowed action or generated token, |log pi_int8(a) - log pi_fp(a)| of what INT8 answered",
            self.logprob_mismatch.clone(),
        );
        registry.register(
            "logprob_mismatch_mean",
            "Mean |log pi_int8(a) - log pi_fp(a)| over the rollout window",
            self.logprob_mismatch_mean.clone(),
        );
        registry.register(
            "logprob_mismatch_alert",
            "1 while the mean shadow log-prob mismatch over the rollout window exceeds the alert threshold",
            self.logprob_mismatch_alert.clone(),
        );
        registry.register(
            "feedback_episodes",
            "Episode rewards received on /v1/feedback, by arm",
            self.feedback_episodes.clone(),
        );
        registry.register(
            "mean_episode_reward",
            "Mean episode reward over the rollout window, by arm",
            self.mean_episode_reward.clone(),
        );
        registry.register(
            "reward_consistency",
            "1 - |int8 - fp| / |fp - random| of mean episode rewards over full windows",
            self.reward_consistency.clone(),
        );
    }

    /// The drift monitor's comparison of layer inputs with calibration.
    fn register_drift(&mut self) {
        let registry = &mut self.registry;
        registry.register(
            "activation_out_of_range_ratio",
            "Share of sampled layer-input values beyond the calibrated range, last drift window",
            self.drift_out_of_range.clone(),
        );
        registry.register(
            "activation_clipping_ratio",
            "Share of sampled layer-input values a static INT8 layer clips, last drift window",
            self.drift_clipping.clone(),
        );
        registry.register(
            "activation_drift",
            "Total-variation distance of the |x| octave histogram from calibration's, last drift window",
            self.drift_distance.clone(),
        );
        registry.register(
            "drift_windows",
            "Drift windows judged, by point",
            self.drift_windows.clone(),
        );
        registry.register(
            "drift_alert",
            "1 while some point's out-of-range share exceeds the drift threshold",
            self.drift_alert.clone(),
        );
    }

    /// The language-model engine: tokens, sequences, KV cache, timings.
    fn register_generation(&mut self) {
        let registry = &mut self.registry;
        registry.register(
            "prompt_tokens",
            "Prompt tokens run through the model",
            self.prompt_tokens.clone(),
        );
        registry.register(
            "generated_tokens",
            "Tokens generated",
            self.generated_tokens.clone(),
        );
        registry.register(
            "running_sequences",
            "Sequences in the decode batch",
            self.running_sequences.clone(),
        );
        registry.register(
            "prefilling_sequences",
            "Admitted sequences whose prompt is still being prefilled",
            self.prefilling_sequences.clone(),
        );
        registry.register(
            "cancelled_prefills",
            "Prefills dropped at a chunk boundary because their client had gone",
            self.cancelled_prefills.clone(),
        );
        registry.register(
            "kv_reserved_tokens",
            "KV-cache positions reserved by admitted sequences",
            self.kv_reserved_tokens.clone(),
        );
        registry.register(
            "time_to_first_token_seconds",
            "Seconds from admission to the first token",
            self.time_to_first_token.clone(),
        );
        registry.register(
            "completion_duration_seconds",
            "Seconds from admission to the last token",
            self.completion_duration.clone(),
        );
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

    /// Counts one closed connection.
    pub fn connection_closed(&self, reason: &str) {
        self.connections_closed
            .get_or_create(&vec![("reason".to_owned(), reason.to_owned())])
            .inc();
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
