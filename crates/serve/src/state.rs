//! What every HTTP handler shares: the server's options, the model side
//! ([`Backend`]: a policy behind its batchers, or a language model behind
//! its engines, each with its rollout) and the shared state around it.
//!
//! Both the policy handlers of `server` and the OpenAI-compatible ones of
//! `openai` read this module; it reads neither.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use qforge_formats::policy::Head;
use qforge_formats::text::TextSide;
use qforge_model::{LanguageModel, MlpPolicy};
use tokio::sync::Semaphore;

use crate::batcher::Batcher;
use crate::conn::ConnectionLimits;
use crate::drift::{DriftMonitor, DriftOptions};
use crate::engine::{Engine, EngineLimits};
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::rollout::{Arm, FeedbackLimit, Rollout, RolloutOptions, served_label};
use crate::token::TokenDigest;

/// How the server runs.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Address to bind (127.0.0.1 unless told otherwise; port 0 picks one).
    pub addr: SocketAddr,
    /// Most observations per batched forward.
    pub max_batch: usize,
    /// Longest a request waits for others to share its forward.
    pub max_wait: Duration,
    /// Largest request body, bytes.
    pub max_body_bytes: usize,
    /// Most observations in one request.
    pub max_rows: usize,
    /// Most tokens one completion may ask for.
    pub max_tokens: usize,
    /// Most tokens a prompt may have; a longer one gets 400 before it is
    /// admitted.
    pub max_prompt_tokens: usize,
    /// The name clients may give a language model as `model` (and
    /// `/v1/models` lists).
    pub model_name: String,
    /// The continuous-batching engine's limits, for a language model.
    pub engine: EngineLimits,
    /// Requests in flight beyond which new ones get 429.
    pub max_concurrency: usize,
    /// Read deadlines and the connection cap (see [`crate::conn`]).
    pub connections: ConnectionLimits,
    /// A request the model has not started on within this gets 503: a
    /// policy's answer, a completion's admission into the engine (an
    /// admitted completion runs to its end, which `max_tokens` bounds).
    pub timeout: Duration,
    /// Least time between two rewards one session reports on
    /// `/v1/feedback` (0: no limit).
    pub feedback_interval: Duration,
    /// Required `Authorization: Bearer …` token, if any.
    pub token: Option<String>,
    /// How traffic is shared with the FP reference, and when it rolls back.
    pub rollout: RolloutOptions,
    /// How the served model's layer inputs are watched for drift.
    pub drift: DriftOptions,
}

pub(crate) struct AppState {
    pub(crate) backend: Backend,
    /// The address the server listens on: an `Origin` with this host is
    /// the machine's own (see [`crate::origin`]).
    pub(crate) bound: std::net::IpAddr,
    /// The digest of the required bearer token (`options.token`).
    pub(crate) token: Option<TokenDigest>,
    /// `/openapi.json`.
    pub(crate) openapi: String,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) in_flight: Arc<Semaphore>,
    pub(crate) feedback: FeedbackLimit,
    pub(crate) options: ServeOptions,
    /// The version of the model answering: 1 at start, one more per reload.
    pub(crate) version: AtomicU64,
    /// Held while a reload loads and swaps, so reloads happen one at a time.
    pub(crate) reloading: tokio::sync::Mutex<()>,
}

/// The model side of a server.
// One value per process, behind the shared state's `Arc`.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Backend {
    Policy(PolicyBackend),
    Language(LanguageBackend),
}

impl Backend {
    /// Whether every model thread the server needs still runs.
    pub(crate) fn alive(&self) -> bool {
        match self {
            Backend::Policy(p) => p.int8.alive() && p.fp.as_ref().is_none_or(Batcher::alive),
            Backend::Language(l) => l.int8.alive() && l.fp.as_ref().is_none_or(Engine::alive),
        }
    }
}

/// A policy, its optional reference, and the rollout between them.
pub(crate) struct PolicyBackend {
    pub(crate) int8: Batcher,
    /// The FP reference, when the rollout needs one.
    pub(crate) fp: Option<Batcher>,
    pub(crate) head: Head,
    pub(crate) rollout: Rollout,
    pub(crate) observation_dim: usize,
}

impl PolicyBackend {
    /// Checks the rollout against the models and starts their batchers.
    pub(crate) fn start(
        policy: MlpPolicy,
        reference: Option<MlpPolicy>,
        monitor: Option<DriftMonitor>,
        options: &ServeOptions,
        metrics: &Arc<Metrics>,
    ) -> Result<Self> {
        let rollout = options.rollout;
        match (&reference, rollout.mode.needs_reference()) {
            (None, true) => {
                return Err(Error::Options(
                    "A/B and shadow rollouts need the FP reference model".into(),
                ));
            }
            (Some(fp), _)
                if fp.config().observation_dim != policy.config().observation_dim
                    || fp.config().head != policy.config().head =>
            {
                return Err(Error::Options(format!(
                    "the reference does not act like the model: it takes {} observation values and has head {:?}; the model takes {} and has {:?}",
                    fp.config().observation_dim,
                    fp.config().head,
                    policy.config().observation_dim,
                    policy.config().head
                )));
            }
            _ => {}
        }
        let observation_dim = policy.config().observation_dim;
        let head = policy.config().head.clone();
        let label = served_label(&policy.linears());
        let start = |policy, monitor| {
            Batcher::start(
                policy,
                monitor,
                options.max_batch,
                options.max_wait,
                Arc::clone(metrics),
            )
        };
        let int8 = start(policy, monitor);
        // The reference was not calibrated: nothing to watch.
        let fp = reference.map(|r| start(r, None));
        Ok(Self {
            int8,
            fp,
            head,
            rollout: Rollout::new(rollout, Arc::clone(metrics), label),
            observation_dim,
        })
    }

    pub(crate) fn batcher(&self, arm: Arm) -> &Batcher {
        match arm {
            Arm::Int8 => &self.int8,
            // `serve` refuses a mode that can pick FP without a reference.
            Arm::Fp => self.fp.as_ref().unwrap_or(&self.int8),
        }
    }
}

/// A language model being served.
pub(crate) struct LanguageBackend {
    int8: Engine,
    /// The FP reference's engine, when the rollout needs one.
    pub(crate) fp: Option<Engine>,
    pub(crate) rollout: Rollout,
    pub(crate) name: String,
    /// Shared with the responses that spell tokens (log-probs).
    pub(crate) text: Arc<TextSide>,
    /// Positions the model attends over.
    pub(crate) context: usize,
    /// Token ids the model takes.
    pub(crate) vocab_size: usize,
    /// The most prompt bytes one token can stand for, where the tokenizer
    /// makes that provable: a longer prompt is refused untokenized.
    pub(crate) bytes_per_token: Option<usize>,
    pub(crate) limits: EngineLimits,
    /// Most tokens one request may generate.
    pub(crate) max_tokens: usize,
    /// Most tokens a prompt may have.
    pub(crate) max_prompt_tokens: usize,
    /// Numbers request ids and default seeds.
    pub(crate) requests: AtomicU64,
}

impl LanguageBackend {
    /// Starts an engine for `lm` and one for its `reference` (each with
    /// the options' engine limits: the reference's KV cache is its own).
    pub(crate) fn start(
        lm: LanguageModel,
        reference: Option<LanguageModel>,
        monitor: Option<DriftMonitor>,
        options: &ServeOptions,
        metrics: &Arc<Metrics>,
    ) -> Result<Self> {
        let limits = options.engine;
        match (&reference, options.rollout.mode.needs_reference()) {
            (None, true) => {
                return Err(Error::Options(
                    "A/B and shadow rollouts need the FP reference model".into(),
                ));
            }
            (Some(fp), _) if fp.model.config().vocab_size != lm.model.config().vocab_size => {
                return Err(Error::Options(format!(
                    "the reference has a vocabulary of {} tokens, the model {}: they do not share a tokenizer",
                    fp.model.config().vocab_size,
                    lm.model.config().vocab_size
                )));
            }
            _ => {}
        }
        let text = Arc::new(lm.text.clone());
        let context = lm.model.config().max_position_embeddings;
        let vocab_size = lm.model.config().vocab_size;
        let bytes_per_token = text.tokenizer.max_bytes_per_token();
        let label = served_label(&lm.model.linears());
        Ok(Self {
            int8: Engine::start(lm, monitor, limits, Arc::clone(metrics))?,
            // The reference was not calibrated: nothing to watch.
            fp: reference
                .map(|r| Engine::start(r, None, limits, Arc::clone(metrics)))
                .transpose()?,
            rollout: Rollout::new(options.rollout, Arc::clone(metrics), label),
            name: options.model_name.clone(),
            text,
            context,
            vocab_size,
            bytes_per_token,
            limits,
            max_tokens: options.max_tokens,
            max_prompt_tokens: options.max_prompt_tokens,
            requests: AtomicU64::new(0),
        })
    }

    pub(crate) fn engine(&self, arm: Arm) -> &Engine {
        match arm {
            Arm::Int8 => &self.int8,
            // `start` refuses a mode that can pick FP without a reference.
            Arm::Fp => self.fp.as_ref().unwrap_or(&self.int8),
        }
    }
}
