//! `qforge serve`: a policy (native artifact or policy directory) behind
//! HTTP.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use qforge_serve::{ServeOptions, serve};

use crate::UsageError;
use crate::model_cmd::{AnyModel, load_model};

/// The environment variable holding the bearer token clients must send
/// (kept out of the command line, which other users can read).
const TOKEN_VARIABLE: &str = "QFORGE_SERVE_TOKEN";

/// Arguments of `qforge serve`.
#[derive(Args)]
pub struct ServeArgs {
    /// The policy: a native artifact (`qforge quantize`) or a policy directory.
    #[arg(long, value_name = "DIR")]
    model: PathBuf,
    /// Address to listen on (loopback by default; port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:8000")]
    addr: SocketAddr,
    /// Most observations per batched forward.
    #[arg(long, default_value_t = 32)]
    max_batch: usize,
    /// Longest a request waits for others to batch with (milliseconds).
    #[arg(long, default_value_t = 2.0, value_name = "MS")]
    max_wait_ms: f64,
    /// Largest request body (bytes); larger ones get 413.
    #[arg(long, default_value_t = 1 << 20)]
    max_body_bytes: usize,
    /// Most observations in one request; more get 413.
    #[arg(long, default_value_t = 4096)]
    max_rows: usize,
    /// Requests in flight beyond which new ones get 429 with Retry-After.
    #[arg(long, default_value_t = 256)]
    max_concurrency: usize,
    /// Requests unanswered after this get 503 with Retry-After (milliseconds).
    #[arg(long, default_value_t = 10_000, value_name = "MS")]
    timeout_ms: u64,
}

async fn shutdown_signal() {
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
    eprintln!("qforge serve: shutting down; finishing requests in flight");
}

/// `qforge serve`.
pub fn serve_command(args: ServeArgs) -> Result<()> {
    if !(args.max_wait_ms.is_finite() && args.max_wait_ms >= 0.0) {
        return Err(UsageError("--max-wait-ms must be ≥ 0".into()).into());
    }
    let policy = match load_model(&args.model)? {
        AnyModel::Policy(policy) => policy,
        AnyModel::Language(_) => {
            return Err(UsageError(format!(
                "{} is a language model; serving completions is not built yet, `qforge serve` runs policies",
                args.model.display()
            ))
            .into());
        }
    };
    let token = std::env::var(TOKEN_VARIABLE).ok().filter(|t| !t.is_empty());
    let options = ServeOptions {
        addr: args.addr,
        max_batch: args.max_batch,
        max_wait: Duration::from_secs_f64(args.max_wait_ms / 1000.0),
        max_body_bytes: args.max_body_bytes,
        max_rows: args.max_rows,
        max_concurrency: args.max_concurrency,
        timeout: Duration::from_millis(args.timeout_ms),
        token,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let model = args.model.display().to_string();
    runtime.block_on(serve(
        policy,
        options,
        |addr| eprintln!("qforge serve: {model} listening on http://{addr}"),
        shutdown_signal(),
    ))?;
    eprintln!("qforge serve: stopped");
    Ok(())
}
