//! `qforge`: quantize trained RL policies to INT8 and deploy them.
//!
//! Raw arguments are parsed by clap (usage errors exit with 2), validated into
//! a command, and run; `main` maps the outcome to the documented exit codes.

mod calibrate_cmd;
mod demo;
mod export_cmd;
mod info_cmd;
mod model_cmd;
mod output;
mod quantize_cmd;
mod requantize_cmd;
mod rollouts_cmd;
mod serve_cmd;
mod stats_cmd;
mod terminal;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

/// Exit code of a successful run.
const EXIT_OK: u8 = 0;
/// Exit code of a failed run (bad data, I/O error, refused merge, …).
const EXIT_FAILURE: u8 = 1;
/// Exit code of a usage error (bad flags or arguments).
const EXIT_USAGE: u8 = 2;
/// Exit code of a quantization the accuracy guard refused.
const EXIT_GUARD: u8 = 3;

/// An error in how qforge was invoked, as opposed to a failure while running.
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

#[derive(Parser)]
#[command(
    name = "qforge",
    version,
    about = "Quantize trained RL policies to INT8 and deploy them",
    long_about = "qforge quantizes trained reinforcement-learning policies (LLM policies and MLP \
                  control policies) to INT8 after training, with calibration statistics that merge \
                  exactly across any number of workers.\n\n\
                  Exit codes: 0 success; 1 failure (bad input data, I/O error, refused merge); \
                  2 usage error (bad flags or arguments); 3 the accuracy guard refused the \
                  quantized model (no artifact written)."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Inspect, create and merge calibration statistics (.qstats files).
    #[command(subcommand)]
    Stats(StatsCommand),
    /// Run the calibration-statistics demo: synthetic activations observed by one
    /// worker and by several worker threads give byte-identical statistics.
    Demo(demo::DemoArgs),
    /// Run a calibration pass: sample the data, observe every batch on worker
    /// threads, merge the statistics exactly into OUT.qstats.
    Calibrate(calibrate_cmd::CalibrateArgs),
    /// Serve a cluster calibration: join a run in Redis (the active one, or
    /// --run NAME), observe its batches, and exit when it is done.
    Worker(calibrate_cmd::WorkerArgs),
    /// Quantize a model to INT8: calibrate, apply the recipe, check accuracy on
    /// held-out data (falling back to higher precision where needed), and write
    /// the native artifact with report.json, report.html and manifest.json.
    /// With no --model/--data it quantizes the bundled CartPole policy.
    Quantize(Box<quantize_cmd::QuantizeArgs>),
    /// Quantize new weights of an artifact's model (a weight sync in RL
    /// training) with the artifact's frozen activation scales, smoothing,
    /// rotations and precisions, without calibration: reports how many int8
    /// weights changed and warns when activations drift past the scales.
    Requantize(requantize_cmd::RequantizeArgs),
    /// Convert a native artifact to a serving format: compressed-tensors
    /// (vLLM, language models) or ONNX QDQ (policies).
    Export(export_cmd::ExportArgs),
    /// Serve a model over HTTP: a policy on POST /v1/act (dynamic batching),
    /// a language model on OpenAI's /v1/completions and /v1/chat/completions
    /// (continuous batching, SSE); A/B or shadow rollout against the FP
    /// reference with automatic rollback; drift monitor; POST /admin/reload
    /// (token required) swaps in a new artifact; /health, /ready,
    /// /metrics (Prometheus), /openapi.json. Set QFORGE_SERVE_TOKEN to
    /// require a bearer token on all but /health and /ready.
    Serve(serve_cmd::ServeArgs),
    /// Check a directory qforge wrote against its manifest.json: every file's
    /// SHA-256; names the file that changed, went missing or appeared.
    Verify(quantize_cmd::VerifyArgs),
    /// Generate text with a language model (greedy unless --temperature).
    Generate(model_cmd::GenerateArgs),
    /// Generate LLM episodes with a verifiable reward (arithmetic answers
    /// checked exactly) on the full-precision runtime, as calibration data:
    /// JSONL {"prompt", "completion", "reward", "episode_id", "finish"}.
    Rollouts(rollouts_cmd::RolloutsArgs),
    /// Run a policy on the observations of a JSONL file: its raw head outputs
    /// and actions.
    Act(model_cmd::ActArgs),
    /// Evaluate models: perplexity, comparison with a reference, action agreement.
    #[command(subcommand)]
    Eval(model_cmd::EvalCommand),
    /// Print the determinism fingerprint of a model: a hash of the activations
    /// of a fixed probe batch. Workers with equal fingerprints compute equal
    /// calibration statistics.
    Fingerprint(model_cmd::FingerprintArgs),
    /// Print this build and what this CPU runs: the features the CPU probe
    /// found and the tier of each hot kernel.
    Info(info_cmd::InfoArgs),
}

#[derive(Subcommand)]
enum StatsCommand {
    /// Make statistics from a file of values (raw little-endian f32, or .npy).
    ///
    /// The batch id and data hash are the SHA-256 of the values, so statistics of
    /// different files never collide and merging them needs --force.
    Observe(stats_cmd::ObserveArgs),
    /// Merge statistics files exactly (integer addition of histograms).
    ///
    /// Refuses files of different provenance (model, data, recipe, pass) or with
    /// overlapping batch ids, unless --force.
    Merge(stats_cmd::MergeArgs),
    /// Show the statistics of a file and the threshold each calibrator chooses.
    Show(stats_cmd::ShowArgs),
}

/// Flags shared by commands that print results.
#[derive(Args, Clone, Copy)]
pub struct OutputFlags {
    /// Print machine-readable JSON on stdout instead of a human summary.
    #[arg(long)]
    pub json: bool,
}

/// A required output path.
#[derive(Args)]
pub struct OutputPath {
    /// Where to write the result (written atomically: temp file + rename).
    #[arg(short = 'o', long = "output", value_name = "OUT")]
    pub output: PathBuf,
}

/// The error and its causes, each said once. The libraries' errors put
/// their cause's text in their own message (`{path}: {source}`, so that
/// callers formatting them with `{e}` lose nothing) and also return the cause
/// as `source()`, so `{:#}` printed it twice ("No such file or directory (os
/// error 2): No such file or directory (os error 2)"). A cause whose text is
/// already in what has been printed is left out.
fn message(error: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in error.chain() {
        let part = cause.to_string();
        if text.contains(&part) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&part);
    }
    text
}

/// Whether `error` is the caller's mistake (exit 2): bad flags, or a
/// request the libraries refused as not fitting (a setting out of range, a
/// policy where a language model is needed).
/// Each library's error answers through the errors it wraps (an error that
/// `#[error(transparent)]` forwards hides the wrapped one from `anyhow`'s
/// chain).
fn is_misuse(error: &anyhow::Error) -> bool {
    error.downcast_ref::<UsageError>().is_some()
        || error
            .downcast_ref()
            .is_some_and(qforge_model::Error::is_request)
        || error
            .downcast_ref()
            .is_some_and(qforge_formats::Error::is_request)
        || error
            .downcast_ref()
            .is_some_and(qforge_calib::Error::is_request)
        || error
            .downcast_ref()
            .is_some_and(qforge_runner::Error::is_request)
        || error
            .downcast_ref()
            .is_some_and(qforge_quant::Error::is_request)
}

/// candle's thread pool (its element-wise operations) spins 25 000 times
/// before a worker sleeps, while the matrix product that comes next runs on
/// rayon's threads: the spinning worker takes a core from them. With 1 000
/// spins the full-precision forward runs faster on 2 cores:
/// a 163-token prefill 445 → 592 tokens/s, 30 perplexity windows of 128
/// tokens 22.2 → 18.4 s with the same bits (BENCHMARKS.md). It changes when
/// threads sleep, not what they compute. A value the user set is kept.
fn limit_candle_spinning() {
    const SPIN_LIMIT: &str = "CANDLE_BARRIER_POOL_SPIN_LIMIT";
    if std::env::var_os(SPIN_LIMIT).is_none() {
        // SAFETY: called at the start of main, before any thread exists
        // (candle reads the variable when its pool starts, at first use).
        unsafe { std::env::set_var(SPIN_LIMIT, "1000") };
    }
}

fn main() -> ExitCode {
    // Die quietly on a closed pipe (`qforge stats show X | head`), as other
    // Unix tools do, instead of panicking in println!.
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of SIGPIPE before any thread
    // starts; no handler is installed.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    limit_candle_spinning();
    // The libraries log through `tracing` (the server's drift alerts and
    // rollbacks): to stderr, without timestamps, INFO and up unless
    // RUST_LOG says otherwise.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::builder()
                .with_default_directive(tracing_subscriber::filter::LevelFilter::INFO.into())
                .from_env_lossy(),
        )
        .with_writer(std::io::stderr)
        .without_time()
        .with_target(false)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Stats(StatsCommand::Observe(args)) => stats_cmd::observe(args),
        Command::Stats(StatsCommand::Merge(args)) => stats_cmd::merge(args),
        Command::Stats(StatsCommand::Show(args)) => stats_cmd::show(args),
        Command::Demo(args) => demo::run(args),
        Command::Calibrate(args) => calibrate_cmd::calibrate(args),
        Command::Worker(args) => calibrate_cmd::worker(args),
        Command::Quantize(args) => quantize_cmd::quantize_command(*args),
        Command::Verify(args) => quantize_cmd::verify_command(args),
        Command::Requantize(args) => requantize_cmd::requantize_command(args),
        Command::Export(args) => export_cmd::export_command(args),
        Command::Serve(args) => serve_cmd::serve_command(args),
        Command::Generate(args) => model_cmd::generate(args),
        Command::Rollouts(args) => rollouts_cmd::rollouts(args),
        Command::Eval(command) => model_cmd::eval(command),
        Command::Act(args) => model_cmd::act(args),
        Command::Fingerprint(args) => model_cmd::fingerprint(args),
        Command::Info(args) => info_cmd::info(args),
    };
    match result {
        Ok(()) => ExitCode::from(EXIT_OK),
        Err(error) => {
            eprintln!("error: {}", message(&error));
            if is_misuse(&error) {
                ExitCode::from(EXIT_USAGE)
            } else if let Some(qforge_quant::Error::Refused(_)) = error.downcast_ref() {
                ExitCode::from(EXIT_GUARD)
            } else {
                ExitCode::from(EXIT_FAILURE)
            }
        }
    }
}
