//! The unit tests' server: [`serve`] on a loopback port in its own runtime,
//! spoken to over raw HTTP/1.1, stopped when dropped.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use qforge_model::{LanguageModel, Model};
use tokio::sync::oneshot;

use crate::conn::ConnectionLimits;
use crate::drift::DriftOptions;
use crate::engine::EngineLimits;
use crate::rollout::{RolloutMode, RolloutOptions};
use crate::served::Served;
use crate::server::{ServeOptions, serve};

/// Generous, for a machine whose cores are all busy.
const DEADLINE: Duration = Duration::from_secs(180);

fn repository(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(relative)
}

/// The CLI's defaults, on a free port.
pub(crate) fn options() -> ServeOptions {
    ServeOptions {
        addr: "127.0.0.1:0".parse().expect("an address"),
        max_batch: 32,
        max_wait: Duration::from_millis(2),
        max_body_bytes: 1 << 20,
        max_rows: 4096,
        max_tokens: 1024,
        max_prompt_tokens: 4096,
        model_name: "smollm2".into(),
        engine: EngineLimits {
            max_sequences: 4,
            kv_budget_tokens: 512,
            threads: 1,
            prefill_threads: 1,
            prefill_chunk: 256,
        },
        max_concurrency: 256,
        connections: ConnectionLimits {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(10),
            keep_alive_timeout: Duration::from_secs(5),
            max_connections: 256,
            drain_timeout: Duration::from_secs(20),
        },
        timeout: Duration::from_secs(300),
        feedback_interval: Duration::from_secs(1),
        token: None,
        rollout: RolloutOptions {
            mode: RolloutMode::Int8Only,
            threshold: 0.95,
            agreement_window: 1000,
            reward_window: 20,
            min_sessions: 10,
            min_span: Duration::from_secs(60),
            random_return: 0.0,
            logprob_mismatch_alert: 0.1,
        },
        drift: DriftOptions {
            sample: 0.125,
            window_rows: 4096,
            threshold: 1e-3,
        },
    }
}

/// SmolLM2 (`scripts/fetch-models.sh` fetches it).
pub(crate) fn smollm2() -> LanguageModel {
    let path = repository("models/smollm2-135m-instruct-q4_1.gguf");
    match qforge_model::open(&path) {
        Ok(Model::Language(model)) => *model,
        _ => panic!(
            "{} is missing or not a language model: run scripts/fetch-models.sh",
            path.display()
        ),
    }
}

/// SmolLM2 with every linear layer on the INT8 engine: its steps run on
/// the batched decoder, where a sequence's draws do not depend on the
/// batch.
pub(crate) fn smollm2_int8() -> LanguageModel {
    let mut lm = smollm2();
    lm.model = lm
        .model
        .with_linears(|_, layer| layer.to_int8(qforge_model::Activations::Dynamic))
        .expect("SmolLM2's linear layers quantize");
    lm
}

/// A running server; dropping it shuts it down.
pub(crate) struct TestServer {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TestServer {
    fn start(served: Served) -> Self {
        Self::start_with(served, options())
    }

    fn start_with(served: Served, options: ServeOptions) -> Self {
        let (bound, address) = std::sync::mpsc::channel();
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("a runtime");
            runtime
                .block_on(serve(
                    served,
                    options,
                    move |addr| bound.send(addr).expect("the test waits"),
                    async {
                        let _ = stopped.await;
                    },
                ))
                .expect("the server runs");
        });
        let addr = address.recv_timeout(DEADLINE).expect("the server listens");
        Self {
            addr,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// The CartPole policy directory.
    pub(crate) fn policy() -> Self {
        match qforge_model::open(&repository("fixtures/policies/cartpole")) {
            Ok(model @ Model::Policy(_)) => Self::start(Served {
                model,
                reference: None,
                calibration: None,
            }),
            _ => panic!("fixtures/policies/cartpole is a policy"),
        }
    }

    /// SmolLM2 behind the server.
    pub(crate) fn language_model() -> Self {
        Self::language_model_with(options())
    }

    /// SmolLM2 behind a server with `options`.
    pub(crate) fn language_model_with(options: ServeOptions) -> Self {
        Self::serving(smollm2(), options)
    }

    /// `model` behind a server with `options`.
    pub(crate) fn serving(model: LanguageModel, options: ServeOptions) -> Self {
        Self::serving_with_reference(model, None, options)
    }

    /// `model` behind a server with `options`, beside `reference` when a
    /// rollout needs one.
    pub(crate) fn serving_with_reference(
        model: LanguageModel,
        reference: Option<LanguageModel>,
        options: ServeOptions,
    ) -> Self {
        Self::start_with(
            Served {
                model: Model::Language(Box::new(model)),
                reference: reference.map(|r| Model::Language(Box::new(r))),
                calibration: None,
            },
            options,
        )
    }

    /// A connection with `body` sent to `target` as JSON, to read the
    /// answer from.
    fn send(&self, method: &str, target: &str, body: &str) -> TcpStream {
        self.send_with(method, target, &["Content-Type: application/json"], body)
    }

    /// A connection with `body` sent to `target` under `headers` (and
    /// nothing else but Host, Connection and Content-Length).
    fn send_with(&self, method: &str, target: &str, headers: &[&str], body: &str) -> TcpStream {
        let mut stream = TcpStream::connect(self.addr).expect("connect");
        stream
            .set_read_timeout(Some(DEADLINE))
            .expect("a read timeout");
        let headers: String = headers.iter().map(|h| format!("{h}\r\n")).collect();
        write!(
            stream,
            "{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .expect("send");
        stream
    }

    /// One request; the status and the body.
    pub(crate) fn request(&self, method: &str, target: &str, body: &str) -> (u16, String) {
        self.answer(self.send(method, target, body))
    }

    /// One request under `headers` only (no Content-Type unless given);
    /// the status and the body.
    pub(crate) fn request_with(
        &self,
        method: &str,
        target: &str,
        headers: &[&str],
        body: &str,
    ) -> (u16, String) {
        self.answer(self.send_with(method, target, headers, body))
    }

    /// `POST /v1/completions` with `body`; the status and the answer as
    /// JSON (null when it is none).
    pub(crate) fn post_completion(&self, body: &serde_json::Value) -> (u16, serde_json::Value) {
        let (status, text) = self.request("POST", "/v1/completions", &body.to_string());
        (
            status,
            serde_json::from_str(&text).unwrap_or(serde_json::Value::Null),
        )
    }

    /// The status and the body of the answer on `stream`.
    fn answer(&self, mut stream: TcpStream) -> (u16, String) {
        let mut response = String::new();
        stream.read_to_string(&mut response).expect("an answer");
        let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no status in {head:?}"));
        (status, body.to_owned())
    }

    /// The value of a Prometheus sample (`name` with its labels, if any)
    /// in `/metrics`.
    pub(crate) fn metric(&self, name: &str) -> Option<f64> {
        let (_, text) = self.request("GET", "/metrics", "");
        text.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
    }

    /// Waits until `/metrics` shows `name` at `value` or more.
    pub(crate) fn wait_for_metric(&self, name: &str, value: f64) {
        let deadline = Instant::now() + DEADLINE;
        while self.metric(name).is_none_or(|v| v < value) {
            assert!(Instant::now() < deadline, "{name} never reached {value}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until `/metrics` shows `name` at `value` or less.
    pub(crate) fn wait_for_metric_to_fall(&self, name: &str, value: f64) {
        let deadline = Instant::now() + DEADLINE;
        while self.metric(name).is_none_or(|v| v > value) {
            assert!(Instant::now() < deadline, "{name} never fell to {value}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends `body` to `target` as a streamed request and returns the
    /// connection once the first chunk of events has arrived, to be read on
    /// or dropped (a client hanging up).
    pub(crate) fn stream_opened(&self, target: &str, body: &str) -> TcpStream {
        let mut stream = self.send("POST", target, body);
        let mut seen = Vec::new();
        let mut buffer = [0u8; 4096];
        while !String::from_utf8_lossy(&seen).contains("data: ") {
            let read = stream.read(&mut buffer).expect("the stream's first events");
            assert!(
                read > 0,
                "the server closed the stream: {}",
                String::from_utf8_lossy(&seen)
            );
            seen.extend_from_slice(&buffer[..read]);
        }
        stream
    }

    /// Waits until `target` answers `status`.
    pub(crate) fn wait_for_status(&self, target: &str, status: u16) {
        let deadline = Instant::now() + DEADLINE;
        while self.request("GET", target, "").0 != status {
            assert!(
                Instant::now() < deadline,
                "{target} never answered {status}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
