//! `qforge serve`: a policy (native artifact or policy directory) behind
//! `/v1/act`, optionally A/B-tested or shadowed against its FP reference; or
//! a language model behind OpenAI's completions APIs.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use qforge_serve::{
    ConnectionLimits, DriftOptions, EngineLimits, RolloutMode, RolloutOptions, ServeOptions,
    Served, reference_for, serve,
};

use crate::UsageError;

/// The environment variable holding the bearer token clients must send
/// (kept out of the command line, which other users can read).
const TOKEN_VARIABLE: &str = "QFORGE_SERVE_TOKEN";

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
    /// Most observations per batched forward (policies), or sequences per
    /// decode step (language models).
    #[arg(long, default_value_t = 32)]
    max_batch: usize,
    /// Language models: KV-cache positions reserved at once over all
    /// sequences; a request reserves prompt + max_tokens and waits while
    /// the budget is spent.
    #[arg(long, default_value_t = 8192, value_name = "TOKENS")]
    kv_budget_tokens: usize,
    /// Language models: threads the engine's matrix products run on. One by
    /// default: on 2 cores a second thread gave the INT8 SmolLM2 artifact
    /// nothing (−1 to −2 % tokens/s) for 0.5–0.7 more cores, though the FP32
    /// model gained 34 % at 16 clients (BENCHMARKS.md).
    #[arg(long, default_value_t = 1, value_name = "N")]
    engine_threads: usize,
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
    #[arg(long, value_name = "SHARES", value_parser = parse_ab, conflicts_with = "shadow")]
    ab: Option<f64>,
    /// INT8 answers; the reference runs a sample of requests alongside and
    /// their agreement (actions, or tokens) is measured.
    #[arg(long)]
    shadow: bool,
    /// Share of requests the reference shadows.
    #[arg(long, default_value_t = 0.1, value_name = "SHARE", requires = "shadow")]
    shadow_sample: f64,
    /// Roll traffic back to the reference when shadow agreement or reward
    /// consistency falls below this.
    #[arg(long, default_value_t = 0.95)]
    rollback_below: f64,
    /// Shadowed observations (tokens, for a language model) agreement is
    /// judged over.
    #[arg(long, default_value_t = 1000, value_name = "OBSERVATIONS")]
    agreement_window: usize,
    /// Raise qforge_log_prob_gap_alert while the shadow's mean
    /// |log π_int8 − log π_fp| over the agreement window exceeds this
    /// (nats). At 0.1 nats a truncated importance weight (C = 2, at
    /// ln 2 = 0.69) still rarely clips.
    #[arg(long, default_value_t = 0.1, value_name = "NATS")]
    log_prob_gap_alert: f64,
    /// Episodes per arm (from /v1/feedback) reward consistency is judged over.
    #[arg(long, default_value_t = 20, value_name = "EPISODES")]
    reward_window: usize,
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

/// `int8=A,fp=B` → the INT8 share A / (A + B).
fn parse_ab(text: &str) -> std::result::Result<f64, String> {
    let (mut int8, mut fp) = (None, None);
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
            "int8" => int8 = Some(share),
            "fp" => fp = Some(share),
            other => return Err(format!("unknown arm {other:?}: the arms are int8 and fp")),
        }
    }
    let (int8, fp) = (int8.unwrap_or(0.0), fp.unwrap_or(0.0));
    if int8 + fp <= 0.0 {
        return Err("the shares must not all be 0".into());
    }
    Ok(int8 / (int8 + fp))
}

/// Descriptors `serve` keeps for itself beyond its connections: the
/// model's files, the runtime's, stdio, a refused connection's.
const RESERVED_DESCRIPTORS: u64 = 64;
/// The default connection cap where descriptors do not bound it.
const DEFAULT_MAX_CONNECTIONS: u64 = 65_536;

/// This process's open-file limit (the soft one, which is what `accept`
/// runs into), if it has one.
fn descriptor_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit only writes the struct it is given, which we own.
        let read = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0;
        (read && limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur)
    }
    #[cfg(not(unix))]
    None
}

/// `--max-connections`, or the default the descriptor limit leaves room
/// for; refused when the limit cannot hold it.
fn max_connections(asked: Option<usize>) -> Result<usize> {
    let limit = descriptor_limit();
    let room = limit.map_or(DEFAULT_MAX_CONNECTIONS, |l| {
        l.saturating_sub(RESERVED_DESCRIPTORS)
    });
    let raise = |l: u64| {
        format!(
            "this process may open {l} descriptors and the server keeps {RESERVED_DESCRIPTORS} of them for itself; raise the limit (ulimit -n)"
        )
    };
    match (asked, limit) {
        (Some(0), _) => Err(UsageError("--max-connections must be ≥ 1".into()).into()),
        (Some(n), Some(l)) if n as u64 > room => Err(UsageError(format!(
            "--max-connections {n} does not fit: {}, or lower --max-connections to {room}",
            raise(l)
        ))
        .into()),
        (Some(n), _) => Ok(n),
        (None, Some(l)) if room == 0 => {
            Err(UsageError(format!("no room for connections: {}", raise(l))).into())
        }
        (None, _) => Ok(room.min(DEFAULT_MAX_CONNECTIONS) as usize),
    }
}

async fn shutdown_signal(drain: Duration) {
    let interrupt = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => {},
        () = terminate => {},
    }
    eprintln!(
        "qforge serve: shutting down; finishing requests in flight (for at most {} ms)",
        drain.as_millis()
    );
}

/// `qforge serve`.
pub fn serve_command(args: ServeArgs) -> Result<()> {
    if !(args.max_wait_ms.is_finite() && args.max_wait_ms >= 0.0) {
        return Err(UsageError("--max-wait-ms must be ≥ 0".into()).into());
    }
    if !(args.shadow_sample > 0.0 && args.shadow_sample <= 1.0) {
        return Err(UsageError("--shadow-sample must be in (0, 1]".into()).into());
    }
    if !(args.drift_sample > 0.0 && args.drift_sample <= 1.0) || args.drift_window == 0 {
        return Err(
            UsageError("--drift-sample must be in (0, 1] and --drift-window ≥ 1".into()).into(),
        );
    }
    if !(args.drift_threshold.is_finite() && args.drift_threshold >= 0.0) {
        return Err(UsageError("--drift-threshold must be ≥ 0".into()).into());
    }
    if !(0.0..=1.0).contains(&args.rollback_below) {
        return Err(UsageError("--rollback-below must be in [0, 1]".into()).into());
    }
    if !(args.log_prob_gap_alert.is_finite() && args.log_prob_gap_alert >= 0.0) {
        return Err(UsageError("--log-prob-gap-alert must be a number of nats ≥ 0".into()).into());
    }
    if args.agreement_window == 0 || args.reward_window == 0 {
        return Err(UsageError("--agreement-window and --reward-window must be ≥ 1".into()).into());
    }
    let mode = match (args.ab, args.shadow) {
        (Some(int8_share), _) => RolloutMode::Split { int8_share },
        (None, true) => RolloutMode::Shadow {
            sample: args.shadow_sample,
        },
        (None, false) => RolloutMode::Int8Only,
    };
    // A rollout without a reference to roll out against is a usage error.
    let reference = reference_for(
        &args.model,
        args.reference.as_deref(),
        mode.needs_reference(),
    )
    .map_err(|e| match e {
        qforge_serve::Error::Options(why) => anyhow::Error::from(UsageError(why)),
        other => other.into(),
    })?;
    if let Some(path) = &reference {
        eprintln!("qforge serve: FP reference {}", path.display());
    }
    let limits = EngineLimits {
        max_sequences: args.max_batch,
        kv_budget_tokens: args.kv_budget_tokens,
        threads: args.engine_threads,
        prefill_chunk: args.prefill_chunk,
    };
    let served = Served::open(
        &args.model,
        reference.as_deref(),
        args.served_model_name.clone(),
        limits,
    )?;
    if let Served::Language { model, name, .. } = &served {
        let c = model.model.config();
        // K and V, f32, per layer and KV head.
        let bytes_per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4;
        eprintln!(
            "qforge serve: {name}: up to {} sequences per step, KV budget {} tokens ({:.0} MiB)",
            args.max_batch,
            args.kv_budget_tokens,
            (args.kv_budget_tokens * bytes_per_token) as f64 / (1 << 20) as f64
        );
    }
    let token = std::env::var(TOKEN_VARIABLE).ok().filter(|t| !t.is_empty());
    let connections = ConnectionLimits {
        header_timeout: positive_ms(args.header_timeout_ms, "--header-timeout-ms")?,
        body_timeout: positive_ms(args.body_timeout_ms, "--body-timeout-ms")?,
        keep_alive_timeout: positive_ms(args.keep_alive_timeout_ms, "--keep-alive-timeout-ms")?,
        max_connections: max_connections(args.max_connections)?,
        drain_timeout: Duration::from_millis(args.shutdown_timeout_ms),
    };
    let options = ServeOptions {
        addr: args.addr,
        max_batch: args.max_batch,
        max_wait: Duration::from_secs_f64(args.max_wait_ms / 1000.0),
        max_body_bytes: args.max_body_bytes,
        max_rows: args.max_rows,
        max_tokens: args.max_tokens,
        max_prompt_tokens: args.max_prompt_tokens,
        max_concurrency: args.max_concurrency,
        connections,
        timeout: Duration::from_millis(args.timeout_ms),
        feedback_interval: Duration::from_millis(args.feedback_interval_ms),
        token,
        rollout: RolloutOptions {
            mode,
            threshold: args.rollback_below,
            agreement_window: args.agreement_window,
            reward_window: args.reward_window,
            random_return: args.random_return,
            log_prob_gap_alert: args.log_prob_gap_alert,
        },
        drift: DriftOptions {
            sample: args.drift_sample,
            window_rows: args.drift_window,
            threshold: args.drift_threshold,
        },
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let model = args.model.display().to_string();
    runtime.block_on(serve(
        served,
        options,
        |addr| eprintln!("qforge serve: {model} listening on http://{addr}"),
        shutdown_signal(connections.drain_timeout),
    ))?;
    eprintln!("qforge serve: stopped");
    Ok(())
}

/// `ms` milliseconds, refused when 0 (a timeout of 0 would close every
/// connection at once).
fn positive_ms(ms: u64, flag: &str) -> Result<Duration> {
    if ms == 0 {
        return Err(UsageError(format!("{flag} must be ≥ 1")).into());
    }
    Ok(Duration::from_millis(ms))
}
