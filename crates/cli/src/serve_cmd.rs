//! `qforge serve`: a policy (native artifact or policy directory) behind
//! `/v1/act`, optionally A/B-tested or shadowed against its FP reference; or
//! a language model behind OpenAI's completions APIs.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use qforge_model::Model;
use qforge_serve::{
    ConnectionLimits, DriftOptions, EngineLimits, RolloutMode, RolloutOptions, ServeOptions,
    Served, reference_for, serve, termination_signal,
};

use crate::UsageError;

/// The environment variable holding the bearer token clients must send
/// (kept out of the command line, which other users can read).
const TOKEN_VARIABLE: &str = "QFORGE_SERVE_TOKEN";
/// A language model's KV budget without `--kv-budget-tokens`: what fits in
/// 4 GiB (256 rollouts of 256 positions of SmolLM2-135M take 2.8 GiB).
const DEFAULT_KV_BYTES: usize = 4 << 30;

/// Arguments of `qforge serve`.
#[derive(Args)]
pub struct ServeArgs {
    /// The model: a native artifact (`qforge quantize`), a policy directory,
    /// an ONNX policy (NAME.onnx, its head in NAME.policy.json), or a
    /// language model (GGUF file or Hugging Face directory).
    #[arg(long, value_name = "PATH")]
    model: PathBuf,
    /// Address to listen on (loopback by default; port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:8000")]
    addr: SocketAddr,
    /// Most observations per batched forward (policies; default 32), or
    /// sequences per decode step (language models; default 256, an RL
    /// trainer's rollout batch).
    #[arg(long)]
    max_batch: Option<usize>,
    /// Language models: KV-cache positions reserved at once over all
    /// sequences; a request reserves prompt + max_tokens and waits while
    /// the budget is spent (default: as many positions as 4 GiB holds,
    /// 93 206 for SmolLM2-135M, 16 384 for Llama-3-8B).
    #[arg(long, value_name = "TOKENS")]
    kv_budget_tokens: Option<usize>,
    /// Language models: threads the engine's decode steps run on (default:
    /// every core). The batched INT8 step splits every layer over them: on
    /// 2 cores, two threads served 1.4–1.8× one thread's tokens/s at 16 to
    /// 256 concurrent rollouts (BENCHMARKS.md).
    #[arg(long, value_name = "N")]
    engine_threads: Option<usize>,
    /// Language models: threads a prompt's prefill runs on (default: every
    /// core). Prefill is compute-bound: a 4 056-token prompt of the INT8
    /// SmolLM2 prefilled at 293 tokens/s on one thread and 451–498 on two.
    #[arg(long, value_name = "N")]
    prefill_threads: Option<usize>,
    /// Language models: the name clients give as `model` (default: the
    /// model's file or directory name).
    #[arg(long, value_name = "NAME")]
    served_model_name: Option<String>,
    /// Longest a request waits for others to batch with (milliseconds).
    #[arg(long, default_value_t = 2.0, value_name = "MS")]
    max_wait_ms: f64,
    /// Largest request body (bytes); larger ones get 413.
    #[arg(long, default_value_t = 1 << 20)]
    max_body_bytes: usize,
    /// Language models: most tokens one completion may ask for; more get
    /// 400 (without max_tokens, a chat completion gets up to this many).
    #[arg(long, default_value_t = 1024)]
    max_tokens: usize,
    /// Language models: most tokens a prompt may have; longer ones get 400
    /// before they are admitted.
    #[arg(long, default_value_t = 4096, value_name = "TOKENS")]
    max_prompt_tokens: usize,
    /// Language models: most prompt tokens prefilled per engine iteration,
    /// over all sequences in prefill, between two decode steps: a long
    /// prompt delays the running sequences by one chunk per token at most.
    #[arg(long, default_value_t = 256, value_name = "TOKENS")]
    prefill_chunk: usize,
    /// Most observations in one request; more get 413.
    #[arg(long, default_value_t = 4096)]
    max_rows: usize,
    /// Requests in flight beyond which new ones get 429 with Retry-After.
    #[arg(long, default_value_t = 256)]
    max_concurrency: usize,
    /// Requests the model has not started on after this get 503 with
    /// Retry-After: a policy's answer, a completion's admission into the
    /// engine (queued for a sequence slot and KV budget). An admitted
    /// completion runs to its end, which max_tokens bounds (milliseconds).
    #[arg(long, default_value_t = 10_000, value_name = "MS")]
    timeout_ms: u64,
    /// A request head must be complete this long after its connection
    /// opened or its previous answer was sent; a client trickling its head
    /// (slowloris) is cut off (milliseconds).
    #[arg(long, default_value_t = 10_000, value_name = "MS")]
    header_timeout_ms: u64,
    /// A request body must arrive this long after its head; a slower one
    /// gets 408 and the connection closes (milliseconds).
    #[arg(long, default_value_t = 10_000, value_name = "MS")]
    body_timeout_ms: u64,
    /// A connection with no request in flight is closed after this long
    /// without a byte of a next request (milliseconds).
    #[arg(long, default_value_t = 5_000, value_name = "MS")]
    keep_alive_timeout_ms: u64,
    /// Most connections open at once (default: the descriptor limit, `ulimit
    /// -n`, less 64 for the server's own files). At the cap a new connection
    /// closes the oldest one without a request in flight; when every one has
    /// a request in flight, the newcomer gets 503.
    #[arg(long, value_name = "N")]
    max_connections: Option<usize>,
    /// On SIGTERM or Ctrl-C: how long requests in flight get to finish
    /// before their connections are closed and the server exits
    /// (milliseconds).
    #[arg(long, default_value_t = 20_000, value_name = "MS")]
    shutdown_timeout_ms: u64,
    /// The full-precision reference for --ab and --shadow (default: the
    /// source recorded in the artifact's manifest).
    #[arg(long, value_name = "DIR")]
    reference: Option<PathBuf>,
    /// Split sessions (the X-Session-Id header) between INT8 and the
    /// reference, e.g. `int8=0.9,fp=0.1`.
    #[arg(long, value_name = "SHARES", value_parser = RolloutMode::parse_split, conflicts_with = "shadow")]
    ab: Option<RolloutMode>,
    /// INT8 answers; the reference runs a sample of requests alongside and
    /// their agreement (actions, or tokens) is measured.
    #[arg(long)]
    shadow: bool,
    /// Share of requests the reference shadows.
    #[arg(long, default_value_t = 0.1, value_name = "SHARE", requires = "shadow")]
    shadow_sample: f64,
    /// Roll traffic back to the reference when shadow agreement or reward
    /// consistency falls below this (reward consistency only with the
    /// evidence --rollback-min-sessions and --rollback-min-span-ms ask for).
    #[arg(long, default_value_t = 0.95)]
    rollback_below: f64,
    /// Shadowed observations (tokens, for a language model) agreement is
    /// judged over.
    #[arg(long, default_value_t = 1000, value_name = "OBSERVATIONS")]
    agreement_window: usize,
    /// Raise qforge_logprob_mismatch_alert while the shadow's mean
    /// |log π_int8 − log π_fp| over the agreement window exceeds this
    /// (nats). At 0.1 nats a truncated importance weight (C = 2, at
    /// ln 2 = 0.69) still rarely clips.
    #[arg(long, default_value_t = 0.1, value_name = "NATS")]
    logprob_mismatch_alert: f64,
    /// Episodes per arm (from /v1/feedback) reward consistency is judged over.
    #[arg(long, default_value_t = 20, value_name = "EPISODES")]
    reward_window: usize,
    /// A reward rollback needs each arm's window to hold episodes of at
    /// least this many distinct sessions (X-Session-Id). Rewards are the
    /// clients' word: half the default window from distinct episodes, so a
    /// few clients reporting many times cannot decide alone. At most
    /// --reward-window.
    #[arg(long, default_value_t = 10, value_name = "SESSIONS")]
    rollback_min_sessions: usize,
    /// A reward rollback needs the episodes in both windows to span at
    /// least this long, oldest to newest: a burst of posts (40 in 0.4 s,
    /// whatever sessions they name) is no A/B test, and an A/B test judges
    /// over time as well as count. A minute lets a fleet that ends 40
    /// episodes a minute still get a verdict from the default windows; under
    /// heavier traffic raise --reward-window so a window spans the minute
    /// (milliseconds). Neither setting authenticates: set a token
    /// (QFORGE_SERVE_TOKEN) where clients may not be trusted.
    #[arg(long, default_value_t = 60_000, value_name = "MS")]
    rollback_min_span_ms: u64,
    /// Least time between two rewards one session (X-Session-Id) reports on
    /// /v1/feedback; sooner ones get 429. An episode reports its return
    /// once; 0 lifts the limit (milliseconds).
    #[arg(long, default_value_t = 1000, value_name = "MS")]
    feedback_interval_ms: u64,
    /// A random policy's episode return: reward consistency is
    /// 1 − |int8 − fp| / |fp − random| (0: relative to FP).
    #[arg(
        long,
        default_value_t = 0.0,
        value_name = "RETURN",
        allow_negative_numbers = true
    )]
    random_return: f64,
    /// Share of forwards whose layer inputs the drift monitor checks against
    /// the artifact's calibration profile.
    #[arg(long, default_value_t = 0.125, value_name = "SHARE")]
    drift_sample: f64,
    /// Sampled rows (observations) per drift window. Rows of one episode
    /// are correlated, so a window should span several episodes: windows of
    /// 500 CartPole observations (one episode) saw up to 0.45 % out of
    /// range on data calibration never saw but that did not drift.
    #[arg(long, default_value_t = 4096, value_name = "ROWS")]
    drift_window: usize,
    /// Raise qforge_drift_alert when a point's share of values outside the
    /// calibrated range exceeds this.
    #[arg(long, default_value_t = 1e-3, value_name = "SHARE")]
    drift_threshold: f64,
}

/// `qforge serve`.
pub fn serve_command(args: ServeArgs) -> Result<()> {
    if !(args.max_wait_ms.is_finite() && args.max_wait_ms >= 0.0) {
        return Err(UsageError("--max-wait-ms must be ≥ 0".into()).into());
    }
    let rollout = rollout_options(&args);
    let mode = rollout.mode;
    let mut options = ServeOptions {
        addr: args.addr,
        max_batch: args.max_batch.unwrap_or(32),
        max_wait: Duration::from_secs_f64(args.max_wait_ms / 1000.0),
        max_body_bytes: args.max_body_bytes,
        max_rows: args.max_rows,
        max_tokens: args.max_tokens,
        max_prompt_tokens: args.max_prompt_tokens,
        model_name: model_name(&args),
        engine: engine_limits(&args),
        max_concurrency: args.max_concurrency,
        connections: ConnectionLimits {
            header_timeout: Duration::from_millis(args.header_timeout_ms),
            body_timeout: Duration::from_millis(args.body_timeout_ms),
            keep_alive_timeout: Duration::from_millis(args.keep_alive_timeout_ms),
            max_connections: ConnectionLimits::connection_cap(args.max_connections)
                .map_err(usage)?,
            drain_timeout: Duration::from_millis(args.shutdown_timeout_ms),
        },
        timeout: Duration::from_millis(args.timeout_ms),
        feedback_interval: Duration::from_millis(args.feedback_interval_ms),
        token: std::env::var(TOKEN_VARIABLE).ok().filter(|t| !t.is_empty()),
        rollout,
        drift: DriftOptions {
            sample: args.drift_sample,
            window_rows: args.drift_window,
            threshold: args.drift_threshold,
        },
    };
    options.validate().map_err(usage)?;
    // A rollout without a reference to roll out against is a usage error.
    let reference = reference_for(
        &args.model,
        args.reference.as_deref(),
        mode.needs_reference(),
    )
    .map_err(usage)?;
    if let Some(path) = &reference {
        eprintln!("qforge serve: FP reference {}", path.display());
    }
    let mut served = Served::open(&args.model)?;
    if let Some(path) = &reference {
        served = served.with_reference(&args.model, path)?;
    }
    if let Model::Language(lm) = &served.model {
        let bytes_per_position = lm.model.kv_bytes_per_position();
        let engine = &mut options.engine;
        if args.kv_budget_tokens.is_none() {
            engine.kv_budget_tokens = DEFAULT_KV_BYTES / bytes_per_position;
        }
        eprintln!(
            "qforge serve: {}: up to {} sequences per step, KV budget {} tokens ({:.0} MiB)",
            options.model_name,
            engine.max_sequences,
            engine.kv_budget_tokens,
            (engine.kv_budget_tokens * bytes_per_position) as f64 / (1 << 20) as f64
        );
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let model = args.model.display().to_string();
    let drain = options.connections.drain_timeout;
    runtime.block_on(serve(
        served,
        options,
        |addr| eprintln!("qforge serve: {model} listening on http://{addr}"),
        termination_signal(drain),
    ))?;
    eprintln!("qforge serve: stopped");
    Ok(())
}

/// The name a language model answers to: `--served-model-name`, else the
/// model file's stem.
fn model_name(args: &ServeArgs) -> String {
    args.served_model_name.clone().unwrap_or_else(|| {
        args.model
            .file_stem()
            .map_or("model".into(), |s| s.to_string_lossy().into_owned())
    })
}

/// The language model's engine limits from the flags; without
/// `--kv-budget-tokens` the budget is set from the model's size once it is
/// open (until then it is unbounded, which the options' check accepts).
fn engine_limits(args: &ServeArgs) -> EngineLimits {
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    EngineLimits {
        max_sequences: args.max_batch.unwrap_or(256),
        kv_budget_tokens: args.kv_budget_tokens.unwrap_or(usize::MAX),
        threads: args.engine_threads.unwrap_or(cores),
        prefill_threads: args.prefill_threads.unwrap_or(cores),
        prefill_chunk: args.prefill_chunk,
    }
}

/// How traffic is shared with the reference and when it rolls back, from
/// the flags.
fn rollout_options(args: &ServeArgs) -> RolloutOptions {
    let mode = match (args.ab, args.shadow) {
        (Some(split), _) => split,
        (None, true) => RolloutMode::Shadow {
            sample: args.shadow_sample,
        },
        (None, false) => RolloutMode::Int8Only,
    };
    RolloutOptions {
        mode,
        threshold: args.rollback_below,
        agreement_window: args.agreement_window,
        reward_window: args.reward_window,
        min_sessions: args.rollback_min_sessions,
        min_span: Duration::from_millis(args.rollback_min_span_ms),
        random_return: args.random_return,
        logprob_mismatch_alert: args.logprob_mismatch_alert,
    }
}

/// The server's refusal of its options (inconsistent flags) as a usage
/// error; any other failure as it is.
fn usage(error: qforge_serve::Error) -> anyhow::Error {
    match error {
        qforge_serve::Error::Options(why) => UsageError(why).into(),
        other => other.into(),
    }
}
