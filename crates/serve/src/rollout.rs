//! A/B rollout of the INT8 model against its full-precision reference, with
//! automatic rollback.
//!
//! Three modes: everything on INT8; a split where each session (the
//! `X-Session-Id` header) sticks to one arm; and shadow, where INT8 answers
//! and the reference runs the same observations on a sample of requests so
//! their action agreement is measured. Two signals are watched over sliding
//! windows: shadow agreement (observations) and reward consistency from
//! `/v1/feedback` (episodes per arm). When either falls below the threshold
//! every later request goes to the reference: the rollback is logged,
//! counted in the metrics, and lasts until the server restarts (an operator
//! decides when INT8 gets another chance). Rewards are the clients' word,
//! so a reward verdict also needs episodes of enough distinct sessions over
//! enough time: a burst of posts, whatever sessions it names, is no A/B test.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use qforge_core::splitmix::mix;
use qforge_model::Linear;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::metrics::Metrics;

/// Which model answers: the roles `--ab`, `/v1/feedback` and the metrics
/// name. Answers name the precision of the model that computed them
/// instead ([`Rollout::label`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arm {
    /// The served (normally quantized) model; `fp32` is taken for it too,
    /// as answers of an unquantized served model name it.
    #[serde(alias = "fp32")]
    Int8,
    /// Its full-precision reference.
    Fp,
}

impl Arm {
    /// `int8` or `fp`.
    pub fn name(self) -> &'static str {
        match self {
            Arm::Int8 => "int8",
            Arm::Fp => "fp",
        }
    }

    fn index(self) -> usize {
        match self {
            Arm::Int8 => 0,
            Arm::Fp => 1,
        }
    }
}

/// How requests are shared between the arms.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RolloutMode {
    /// Every request goes to the INT8 model (no reference needed).
    Int8Only,
    /// This share of sessions goes to INT8, the rest to the reference.
    Split {
        /// In [0, 1].
        int8_share: f64,
    },
    /// INT8 answers every request; the reference also runs this share of
    /// them and the actions are compared.
    Shadow {
        /// In (0, 1].
        sample: f64,
    },
}

impl RolloutMode {
    /// A split from its shares, `int8=A,fp=B`: the INT8 share A / (A + B)
    /// (an arm left out has share 0).
    pub fn parse_split(text: &str) -> std::result::Result<RolloutMode, String> {
        let (mut int8, mut fp) = (0.0, 0.0);
        for part in text.split(',') {
            let (arm, share) = part
                .split_once('=')
                .ok_or_else(|| format!("{part:?} is not ARM=SHARE (e.g. int8=0.9,fp=0.1)"))?;
            let share: f64 = share
                .trim()
                .parse()
                .ok()
                .filter(|s: &f64| s.is_finite() && *s >= 0.0)
                .ok_or_else(|| format!("the share of {arm} must be a number ≥ 0"))?;
            match arm.trim() {
                "int8" => int8 = share,
                "fp" => fp = share,
                other => return Err(format!("unknown arm {other:?}: the arms are int8 and fp")),
            }
        }
        if int8 + fp <= 0.0 {
            return Err("the shares must not all be 0".into());
        }
        Ok(RolloutMode::Split {
            int8_share: int8 / (int8 + fp),
        })
    }

    /// Whether the mode needs the reference model.
    pub fn needs_reference(self) -> bool {
        !matches!(self, RolloutMode::Int8Only)
    }
}

/// When to roll back.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RolloutOptions {
    /// How requests are shared.
    pub mode: RolloutMode,
    /// Agreement or reward consistency below this rolls back (0.95).
    pub threshold: f64,
    /// Shadow-compared observations the agreement is judged over.
    pub agreement_window: usize,
    /// Episodes per arm the reward consistency is judged over.
    pub reward_window: usize,
    /// Distinct sessions each arm's reward window must hold episodes of
    /// before reward consistency may roll back.
    pub min_sessions: usize,
    /// Least time from the oldest episode in the reward windows to the
    /// newest before reward consistency may roll back.
    pub min_span: Duration,
    /// The return of a random policy: consistency is
    /// `1 − |int8 − fp| / |fp − random|`, the definition `scripts/eval-return`
    /// uses (0 makes it the relative difference to FP).
    pub random_return: f64,
    /// Raise the log-prob mismatch alert while the mean |log π_int8 − log π_fp|
    /// over the last `agreement_window` shadowed actions or tokens exceeds
    /// this (nats). An alert, not a rollback: the answers may still agree,
    /// but an RL learner's importance weights (π_train / π_rollout) then
    /// stray from 1 and truncation starts to bite.
    pub logprob_mismatch_alert: f64,
}

/// The sliding windows both signals are judged over.
#[derive(Debug, Default)]
struct Windows {
    agreement: VecDeque<bool>,
    agreeing: usize,
    logprob_mismatches: VecDeque<f64>,
    gap_alerting: bool,
    rewards: [VecDeque<Episode>; 2],
}

/// One reported episode.
#[derive(Debug)]
struct Episode {
    reward: f64,
    /// The session's [`stable_hash`]; `None`: reported without one (all
    /// such reports count as one session, as [`FeedbackLimit`] counts them).
    session: Option<u64>,
    at: Instant,
}

/// What `/v1/feedback` answers.
#[derive(Debug, Clone, Serialize)]
pub struct FeedbackSummary {
    /// The arm the reward was counted for.
    pub arm: Arm,
    /// Episodes in each arm's window.
    pub window_episodes: WindowEpisodes,
    /// Reward consistency over full windows, once both are full.
    pub reward_consistency: Option<f64>,
    /// Whether traffic has been rolled back to the reference.
    pub rolled_back: bool,
    /// Why a consistency below the threshold has not rolled back (yet):
    /// too few sessions, or too short a time, behind the windows.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rollback_withheld: Option<String>,
}

/// Episodes in each arm's window.
#[derive(Debug, Clone, Serialize)]
pub struct WindowEpisodes {
    /// INT8 arm.
    pub int8: usize,
    /// Reference arm.
    pub fp: usize,
}

/// The label of answers the served arm computes with `linears`: `int8`
/// when any layer runs INT8 (a mixed-precision artifact's FP fallbacks are
/// part of its INT8 deployment), `fp32` when none does (a model served
/// unquantized, computing in f32 whatever its file stores). Labelled
/// `int8`, an FP model's answers claimed a quantization they never had.
pub fn served_label(linears: &[(String, String, &Linear)]) -> &'static str {
    if linears.iter().any(|(_, _, l)| matches!(l, Linear::Int8(_))) {
        Arm::Int8.name()
    } else {
        "fp32"
    }
}

/// The rollout state shared by every request.
pub struct Rollout {
    options: RolloutOptions,
    /// (first model version, [`served_label`]) of the served arm, in
    /// version order: a reload may change the label.
    served_labels: Mutex<Vec<(u64, &'static str)>>,
    rolled_back: AtomicBool,
    windows: Mutex<Windows>,
    /// Draws for requests without a session and for shadow sampling.
    draws: AtomicU64,
    metrics: Arc<Metrics>,
}

/// A well-mixed 64-bit hash (FNV-1a, then SplitMix64's finalizer), stable
/// across builds and restarts so a session keeps its arm.
fn stable_hash(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    mix(h)
}

/// A hash as a fraction in [0, 1).
fn unit(h: u64) -> f64 {
    (h >> 11) as f64 / (1u64 << 53) as f64
}

impl Rollout {
    /// The rollout for `options`, reporting into `metrics`, whose served
    /// arm's model version 1 answers as `served` ([`served_label`]).
    pub fn new(options: RolloutOptions, metrics: Arc<Metrics>, served: &'static str) -> Self {
        Self {
            options,
            served_labels: Mutex::new(vec![(1, served)]),
            rolled_back: AtomicBool::new(false),
            windows: Mutex::new(Windows::default()),
            draws: AtomicU64::new(0),
            metrics,
        }
    }

    /// The options it runs with.
    pub fn options(&self) -> &RolloutOptions {
        &self.options
    }

    /// Whether traffic has been rolled back to the reference.
    pub fn rolled_back(&self) -> bool {
        self.rolled_back.load(Ordering::SeqCst)
    }

    fn draw(&self) -> f64 {
        unit(mix(self.draws.fetch_add(1, Ordering::Relaxed)))
    }

    /// The arm of a request from `session` (none: drawn per request).
    pub fn arm_for(&self, session: Option<&str>) -> Arm {
        if self.rolled_back() {
            return Arm::Fp;
        }
        self.assigned_arm(session)
    }

    /// The arm `session` was assigned before any rollback: where its
    /// episode's reward belongs.
    pub fn assigned_arm(&self, session: Option<&str>) -> Arm {
        match self.options.mode {
            RolloutMode::Int8Only | RolloutMode::Shadow { .. } => Arm::Int8,
            RolloutMode::Split { int8_share } => {
                let fraction =
                    session.map_or_else(|| self.draw(), |s| unit(stable_hash(s.as_bytes())));
                if fraction < int8_share {
                    Arm::Int8
                } else {
                    Arm::Fp
                }
            }
        }
    }

    /// Records that model `version` of the served arm answers as `label`.
    pub fn label_version(&self, version: u64, label: &'static str) {
        let mut labels = self.served_labels.lock().expect("labels lock");
        // A reload refused after it was labelled left its version unused.
        labels.retain(|&(from, _)| from < version);
        labels.push((version, label));
    }

    /// What an answer of `arm` computed by model `version` is labelled:
    /// the reference's `fp`, the served model's [`served_label`].
    pub fn label(&self, arm: Arm, version: u64) -> &'static str {
        match arm {
            Arm::Fp => Arm::Fp.name(),
            Arm::Int8 => {
                let labels = self.served_labels.lock().expect("labels lock");
                labels
                    .iter()
                    .rev()
                    .find(|&&(from, _)| from <= version)
                    .map_or(Arm::Int8.name(), |&(_, label)| label)
            }
        }
    }

    /// Counts a request `arm` answered.
    pub fn count_answer(&self, arm: Arm) {
        self.metrics
            .arm_requests
            .get_or_create(&vec![("arm".to_owned(), arm.name().to_owned())])
            .inc();
    }

    /// Whether the reference should shadow this (INT8-answered) request.
    pub fn shadow_this(&self) -> bool {
        match self.options.mode {
            RolloutMode::Shadow { sample } => !self.rolled_back() && self.draw() < sample,
            _ => false,
        }
    }

    /// Counts shadow comparisons, one per observation; rolls back when the
    /// agreement over a full window is below the threshold.
    pub fn record_agreement(&self, agreements: &[bool]) {
        let mut w = self.windows.lock().expect("rollout lock");
        for &agree in agreements {
            w.agreement.push_back(agree);
            w.agreeing += usize::from(agree);
            if w.agreement.len() > self.options.agreement_window
                && w.agreement.pop_front() == Some(true)
            {
                w.agreeing -= 1;
            }
        }
        let agreement = w.agreeing as f64 / w.agreement.len().max(1) as f64;
        let full = w.agreement.len() >= self.options.agreement_window;
        drop(w);
        self.metrics
            .shadow_observations
            .inc_by(agreements.len() as u64);
        self.metrics.shadow_agreement.set(agreement);
        if full && agreement < self.options.threshold {
            self.roll_back(&format!(
                "shadow agreement {:.2} % < {:.2} % over the last {} observations",
                agreement * 100.0,
                self.options.threshold * 100.0,
                self.options.agreement_window
            ));
        }
    }

    /// Records |log π_int8 − log π_fp| of shadowed actions or tokens: into
    /// the histogram, and into the window whose mean raises or clears the
    /// alert.
    pub fn record_logprob_mismatches(&self, gaps: &[f64]) {
        for &gap in gaps {
            self.metrics.logprob_mismatch.observe(gap);
        }
        let window = self.options.agreement_window;
        let mut w = self.windows.lock().expect("rollout lock");
        w.logprob_mismatches.extend(gaps);
        let excess = w.logprob_mismatches.len().saturating_sub(window);
        w.logprob_mismatches.drain(..excess);
        // Summed afresh (window additions per call, cheap beside a forward)
        // so no running sum drifts away from the window's true mean.
        let mean =
            w.logprob_mismatches.iter().sum::<f64>() / w.logprob_mismatches.len().max(1) as f64;
        let full = w.logprob_mismatches.len() >= window;
        let alert = full && mean > self.options.logprob_mismatch_alert;
        let changed = alert != w.gap_alerting;
        w.gap_alerting = alert;
        drop(w);
        self.metrics.logprob_mismatch_mean.set(mean);
        if changed {
            self.metrics.logprob_mismatch_alert.set(i64::from(alert));
            if alert {
                tracing::warn!(
                    "qforge serve: log-prob mismatch alert: INT8 and FP log-probabilities differ by {mean:.4} nats on average over the last {window} shadowed answers (threshold {:.4}); importance weights of an RL learner stray from 1: quantize with a more accurate recipe or recalibrate",
                    self.options.logprob_mismatch_alert
                );
            } else {
                tracing::info!("qforge serve: log-prob mismatch alert cleared");
            }
        }
    }

    /// Counts one episode's reward for `arm`, reported by `session` at
    /// `now`; rolls back when the reward consistency over full windows of
    /// both arms is below the threshold, and the windows hold episodes of
    /// enough sessions over enough time.
    pub fn record_reward(
        &self,
        arm: Arm,
        reward: f64,
        session: Option<&str>,
        now: Instant,
    ) -> FeedbackSummary {
        let window = self.options.reward_window;
        let mut w = self.windows.lock().expect("rollout lock");
        let rewards = &mut w.rewards[arm.index()];
        rewards.push_back(Episode {
            reward,
            session: session.map(|s| stable_hash(s.as_bytes())),
            at: now,
        });
        if rewards.len() > window {
            rewards.pop_front();
        }
        let mean =
            |r: &VecDeque<Episode>| r.iter().map(|e| e.reward).sum::<f64>() / r.len().max(1) as f64;
        let (int8, fp) = (&w.rewards[0], &w.rewards[1]);
        let means = (mean(int8), mean(fp));
        let counts = WindowEpisodes {
            int8: int8.len(),
            fp: fp.len(),
        };
        let consistency = (int8.len() >= window && fp.len() >= window).then(|| {
            let spread = (means.1 - self.options.random_return).abs().max(1e-12);
            1.0 - (means.0 - means.1).abs() / spread
        });
        let shortfall = self.evidence_shortfall(&w.rewards, now);
        drop(w);
        let arm_label = vec![("arm".to_owned(), arm.name().to_owned())];
        self.metrics
            .feedback_episodes
            .get_or_create(&arm_label)
            .inc();
        self.metrics
            .mean_episode_reward
            .get_or_create(&arm_label)
            .set(if arm == Arm::Int8 { means.0 } else { means.1 });
        let mut rollback_withheld = None;
        if let Some(c) = consistency {
            self.metrics.reward_consistency.set(c);
            if c < self.options.threshold && shortfall.is_some() {
                rollback_withheld = shortfall;
            } else if c < self.options.threshold {
                self.roll_back(&format!(
                    "reward consistency {:.2} % < {:.2} % over the last {window} episodes per arm (mean reward int8 {:.4}, fp {:.4})",
                    c * 100.0,
                    self.options.threshold * 100.0,
                    means.0,
                    means.1
                ));
            }
        }
        FeedbackSummary {
            arm,
            window_episodes: counts,
            reward_consistency: consistency,
            rolled_back: self.rolled_back(),
            rollback_withheld,
        }
    }

    /// What the reward windows lack for a verdict (`None`: nothing): each
    /// arm's episodes from `min_sessions` distinct sessions, all of them
    /// spread over `min_span` up to `now`.
    fn evidence_shortfall(&self, windows: &[VecDeque<Episode>; 2], now: Instant) -> Option<String> {
        let needed = self.options.min_sessions;
        for (arm, episodes) in [Arm::Int8, Arm::Fp].into_iter().zip(windows) {
            let sessions: HashSet<Option<u64>> = episodes.iter().map(|e| e.session).collect();
            if sessions.len() < needed {
                return Some(format!(
                    "the {} window holds episodes of {} distinct sessions; a rollback needs {needed} (--rollback-min-sessions)",
                    arm.name(),
                    sessions.len()
                ));
            }
        }
        let oldest = windows
            .iter()
            .filter_map(|w| w.front())
            .map(|e| e.at)
            .min()?;
        let span = now.saturating_duration_since(oldest);
        (span < self.options.min_span).then(|| {
            format!(
                "the windows' episodes span {} ms; a rollback needs {} ms (--rollback-min-span-ms; under heavy traffic raise --reward-window so a window spans that long)",
                span.as_millis(),
                self.options.min_span.as_millis()
            )
        })
    }

    fn roll_back(&self, reason: &str) {
        if !self.rolled_back.swap(true, Ordering::SeqCst) {
            self.metrics.rolled_back.set(1);
            tracing::warn!("qforge serve: rolled back to the FP reference: {reason}");
        }
    }
}

/// Sessions whose last reward [`FeedbackLimit`] remembers at most (a
/// 16-byte digest and an instant each: about 2 MiB).
const MAX_FEEDBACK_SESSIONS: usize = 65_536;

/// One reward per session per interval on `/v1/feedback`. An episode ends
/// once, so a session that reports faster is not reporting episodes; and
/// without a limit about 40 posts (20 per arm, the default window) forced a
/// rollback that lasts until a restart.
pub struct FeedbackLimit {
    interval: Duration,
    /// When each session (by digest, so a long session id costs no
    /// memory) last reported.
    last: Mutex<HashMap<[u8; 16], Instant>>,
}

impl FeedbackLimit {
    /// A limit of one reward per `interval` (zero: no limit).
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            last: Mutex::new(HashMap::new()),
        }
    }

    /// Takes a reward from `session` (no session: one shared bucket) at
    /// `now`, or says how long until that session may report again.
    pub fn admit(&self, session: Option<&str>, now: Instant) -> Result<(), Duration> {
        if self.interval.is_zero() {
            return Ok(());
        }
        let mut key = [0u8; 16];
        let digest = match session {
            Some(s) => Sha256::new().chain_update(b"s").chain_update(s),
            None => Sha256::new().chain_update(b"-"),
        }
        .finalize();
        key.copy_from_slice(&digest[..16]);
        let mut last = self.last.lock().expect("feedback lock");
        if let Some(&at) = last.get(&key) {
            let next = at + self.interval;
            if now < next {
                return Err(next - now);
            }
        }
        if last.len() >= MAX_FEEDBACK_SESSIONS {
            // Only sessions still inside their interval matter.
            last.retain(|_, at| now.saturating_duration_since(*at) < self.interval);
            if last.len() >= MAX_FEEDBACK_SESSIONS {
                // More sessions reporting within one interval than a real
                // fleet has episodes ending: refuse rather than grow.
                return Err(self.interval);
            }
        }
        last.insert(key, now);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_reports_once_per_interval() {
        let limit = FeedbackLimit::new(Duration::from_secs(1));
        let t0 = Instant::now();
        assert_eq!(limit.admit(Some("a"), t0), Ok(()));
        assert_eq!(
            limit.admit(Some("a"), t0 + Duration::from_millis(400)),
            Err(Duration::from_millis(600))
        );
        // Other sessions, and reports without one, have their own buckets.
        assert_eq!(limit.admit(Some("b"), t0), Ok(()));
        assert_eq!(limit.admit(None, t0), Ok(()));
        assert!(limit.admit(None, t0).is_err());
        assert_eq!(limit.admit(Some("a"), t0 + Duration::from_secs(1)), Ok(()));
        let none = FeedbackLimit::new(Duration::ZERO);
        assert!((0..100).all(|_| none.admit(Some("a"), t0).is_ok()));
    }

    fn rollout(mode: RolloutMode) -> Rollout {
        Rollout::new(
            RolloutOptions {
                mode,
                threshold: 0.95,
                agreement_window: 100,
                reward_window: 4,
                min_sessions: 1,
                min_span: Duration::ZERO,
                random_return: 0.0,
                logprob_mismatch_alert: 0.1,
            },
            Arc::new(Metrics::default()),
            "int8",
        )
    }

    #[test]
    fn sessions_stick_to_an_arm_and_the_split_follows_the_share() {
        let r = rollout(RolloutMode::Split { int8_share: 0.3 });
        let sessions: Vec<String> = (0..10_000).map(|i| format!("episode-{i}")).collect();
        let first: Vec<Arm> = sessions.iter().map(|s| r.arm_for(Some(s))).collect();
        let again: Vec<Arm> = sessions.iter().map(|s| r.arm_for(Some(s))).collect();
        assert_eq!(first, again);
        let int8 = first.iter().filter(|&&a| a == Arm::Int8).count() as f64 / 1e4;
        assert!((int8 - 0.3).abs() < 0.02, "{int8}");
        // Without a session every request is drawn afresh, at the same share.
        let drawn = (0..10_000).filter(|_| r.arm_for(None) == Arm::Int8).count() as f64 / 1e4;
        assert!((drawn - 0.3).abs() < 0.02, "{drawn}");
    }

    #[test]
    fn the_logprob_mismatch_alert_follows_the_mean_over_a_full_window() {
        let r = rollout(RolloutMode::Shadow { sample: 1.0 });
        let gauge = |m: &Metrics| m.logprob_mismatch_alert.get();
        // A mean of 0.5 nats, far above 0.1, but the window is not full.
        r.record_logprob_mismatches(&[0.5; 99]);
        assert_eq!(gauge(&r.metrics), 0);
        r.record_logprob_mismatches(&[0.5]);
        assert_eq!(gauge(&r.metrics), 1);
        assert_eq!(r.metrics.logprob_mismatch_mean.get(), 0.5);
        // 100 exact matches push every gap out of the window: cleared.
        r.record_logprob_mismatches(&[0.0; 100]);
        assert_eq!(gauge(&r.metrics), 0);
        assert_eq!(r.metrics.logprob_mismatch_mean.get(), 0.0);
        // 9 of 100 at 1 nat: mean 0.09 ≤ 0.1, no alert; 11 of 100: alert.
        r.record_logprob_mismatches(&[1.0; 9]);
        assert_eq!(gauge(&r.metrics), 0);
        r.record_logprob_mismatches(&[1.0; 2]);
        assert_eq!(gauge(&r.metrics), 1);
        // An alert never rolls traffic back.
        assert!(!r.rolled_back());
    }

    #[test]
    fn low_agreement_over_a_full_window_rolls_back_and_it_sticks() {
        let r = rollout(RolloutMode::Shadow { sample: 1.0 });
        assert!(r.shadow_this());
        // 90 % agreement, but the window is not full yet: no verdict.
        let mut batch = vec![true; 45];
        batch.extend([false; 5]);
        r.record_agreement(&batch);
        assert!(!r.rolled_back());
        assert_eq!(r.arm_for(None), Arm::Int8);
        r.record_agreement(&batch);
        assert!(r.rolled_back());
        assert_eq!(r.arm_for(Some("x")), Arm::Fp);
        assert!(!r.shadow_this());
        assert!(r.metrics.render().contains("qforge_rolled_back 1"));
    }

    #[test]
    fn good_agreement_keeps_int8_as_the_window_slides() {
        let r = rollout(RolloutMode::Shadow { sample: 1.0 });
        for _ in 0..50 {
            let mut batch = vec![true; 19];
            batch.push(false);
            r.record_agreement(&batch);
        }
        assert!(!r.rolled_back());
        assert!(r.metrics.render().contains("qforge_shadow_agreement 0.95"));
    }

    #[test]
    fn reward_consistency_is_judged_on_full_windows_of_both_arms() {
        let r = rollout(RolloutMode::Split { int8_share: 0.5 });
        let now = Instant::now();
        for _ in 0..4 {
            let s = r.record_reward(Arm::Fp, 500.0, None, now);
            assert_eq!(s.reward_consistency, None);
        }
        for _ in 0..3 {
            let s = r.record_reward(Arm::Int8, 490.0, None, now);
            assert_eq!(s.reward_consistency, None);
        }
        let s = r.record_reward(Arm::Int8, 490.0, None, now);
        assert_eq!(s.reward_consistency, Some(0.98));
        assert!(!s.rolled_back);
        // Worse INT8 episodes slide in: 1 − (500 − 450) / 500 = 0.90.
        for _ in 0..4 {
            r.record_reward(Arm::Int8, 450.0, None, now);
        }
        assert!(r.rolled_back());
        assert_eq!(r.arm_for(Some("any")), Arm::Fp);
    }

    #[test]
    fn a_reward_rollback_waits_for_enough_sessions_over_enough_time() {
        let r = Rollout::new(
            RolloutOptions {
                min_sessions: 3,
                min_span: Duration::from_secs(60),
                ..rollout(RolloutMode::Split { int8_share: 0.5 }).options
            },
            Arc::new(Metrics::default()),
            "int8",
        );
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        // The attack: terrible INT8 and perfect FP episodes from one session
        // each, in a burst. Consistency 0, but no verdict.
        for i in 0..4 {
            r.record_reward(Arm::Fp, 500.0, Some("fp"), at(i));
        }
        let s = (0..4)
            .map(|i| r.record_reward(Arm::Int8, 0.0, Some("int8"), at(i)))
            .last()
            .unwrap();
        assert_eq!(s.reward_consistency, Some(0.0));
        let why = s.rollback_withheld.unwrap();
        assert!(
            why.contains("int8 window holds episodes of 1 distinct sessions"),
            "{why}"
        );
        // Distinct sessions, still within the minute.
        for (i, session) in ["a", "b", "c", "d"].iter().enumerate() {
            r.record_reward(Arm::Fp, 500.0, Some(session), at(10 + i as u64));
        }
        for (i, session) in ["e", "f", "g"].iter().enumerate() {
            r.record_reward(Arm::Int8, 0.0, Some(session), at(10 + i as u64));
        }
        let s = r.record_reward(Arm::Int8, 0.0, Some("h"), at(59));
        let why = s.rollback_withheld.unwrap();
        assert!(
            why.contains("span 49000 ms; a rollback needs 60000 ms"),
            "{why}"
        );
        assert!(!r.rolled_back());
        // A minute after the oldest episode in the windows: the verdict.
        let s = r.record_reward(Arm::Int8, 0.0, Some("i"), at(71));
        assert_eq!((s.rolled_back, s.rollback_withheld), (true, None));
    }

    #[test]
    fn the_served_arm_is_labelled_by_each_versions_model() {
        let r = rollout(RolloutMode::Split { int8_share: 0.5 });
        let fp32 = Rollout::new(r.options, Arc::clone(&r.metrics), "fp32");
        assert_eq!(fp32.label(Arm::Int8, 1), "fp32");
        assert_eq!(fp32.label(Arm::Fp, 1), "fp");
        // A reload to an INT8 artifact: version 2 on; a refused reload's
        // label is replaced by the next one's.
        fp32.label_version(2, "fp32");
        fp32.label_version(2, "int8");
        assert_eq!(
            [1, 2, 3].map(|v| fp32.label(Arm::Int8, v)),
            ["fp32", "int8", "int8"]
        );
        // Answers name it; feedback may name the served arm by it.
        let arm: Arm = serde_json::from_str("\"fp32\"").unwrap();
        assert_eq!(arm, Arm::Int8);
    }
}
