//! The HTTP server: `POST /v1/act`, `POST /v1/feedback`, `GET /health`,
//! `GET /ready`, `GET /metrics`, `GET /openapi.json`, with a body limit and
//! deadline, an optional bearer token, a concurrency limit (429 +
//! Retry-After), a request timeout (503 + Retry-After), the connection
//! handling of [`crate::conn`] (read deadlines, a cap, a bounded drain on
//! shutdown), and the A/B rollout of [`crate::rollout`].

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, MatchedPath, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use qforge_model::Model;
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Value, json};
use tokio::sync::{Semaphore, oneshot};

use crate::batcher::{ActRequest, Answer, Choice};
use crate::conn;
use crate::error::{Error, Result};
use crate::feedback;
use crate::http::{
    Shape, error, read_body, refuse_pages, require_token, session, timed_out, too_many_requests,
    with_arm, with_version, worker_stopped,
};
use crate::metrics::Metrics;
use crate::openai;
use crate::reload;
use crate::rollout::{Arm, FeedbackLimit, RolloutMode};
use crate::served::Served;
use crate::state::{AppState, Backend, LanguageBackend, PolicyBackend};
use crate::token::token_digest;

pub use crate::http::{ARM_HEADER, SESSION_HEADER};
pub use crate::state::ServeOptions;

async fn act(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    let (state, headers, body) = (&state, &headers, &body[..]);
    let Ok(_permit) = Arc::clone(&state.in_flight).try_acquire_owned() else {
        return too_many_requests();
    };
    let Backend::Policy(policy) = &state.backend else {
        return error(
            StatusCode::NOT_FOUND,
            "this server runs a language model: use /v1/completions or /v1/chat/completions",
        );
    };
    let arm = policy.rollout.arm_for(session(headers));
    let batcher = policy.batcher(arm);
    // From here until it is queued (or refused), a batch being collected
    // waits for this request.
    let arrival = batcher.announce();
    let request = match read_observations(body, policy.observation_dim, state.options.max_rows) {
        Ok(read) => read,
        Err((status, message)) => return error(status, message),
    };
    let choice = match choose(&policy.head, &request) {
        Ok(choice) => choice,
        Err(message) => return error(StatusCode::BAD_REQUEST, message),
    };
    let (observations, rows) = (request.observations, request.rows);
    // A sampled answer is no greedy action to compare: the shadow then
    // measures only the log-probability gap.
    let shadowed = (arm == Arm::Int8 && policy.rollout.shadow_this())
        .then(|| (observations.clone(), !request.sample));
    let (reply, answer) = oneshot::channel();
    if !batcher.submit(
        arrival,
        ActRequest {
            observations,
            rows,
            choice,
            reply,
        },
    ) {
        return worker_stopped();
    }
    match tokio::time::timeout(state.options.timeout, answer).await {
        Ok(Ok(Ok(Answer {
            actions,
            log_probs,
            version,
        }))) => {
            state.metrics.observations.inc_by(rows as u64);
            policy.rollout.count_answer(arm);
            let label = policy.rollout.label(arm, version);
            let body = json!({ "actions": actions, "log_probs": log_probs, "arm": label });
            if let Some((observations, greedy)) = shadowed {
                let int8 = Int8Answer {
                    actions,
                    log_probs,
                    version,
                    greedy,
                };
                tokio::spawn(shadow(Arc::clone(state), observations, rows, int8));
            }
            with_version(with_arm(axum::Json(body).into_response(), label), version)
        }
        Ok(Ok(Err(message))) => error(StatusCode::INTERNAL_SERVER_ERROR, message),
        Ok(Err(_)) => worker_stopped(),
        Err(_) => timed_out(),
    }
}

/// Why an `/v1/act` body is refused: the status and the message.
type Refusal = (StatusCode, String);

/// The observations of an `/v1/act` body, row after row, and how many
/// rows: at least one, at most `max_rows`, each `dim` finite numbers.
///
/// The limits are checked while the body is parsed, so a refused body
/// costs no more than the rows up to the first that breaks one: a 1 MiB
/// body of 58 000 rows used to be parsed whole before the row limit
/// refused it.
fn read_observations(
    body: &[u8],
    dim: usize,
    max_rows: usize,
) -> std::result::Result<Reading, Refusal> {
    let mut reading = Reading {
        dim,
        max_rows,
        observations: Vec::new(),
        rows: 0,
        sample: false,
        seed: None,
        refusal: None,
    };
    let mut de = serde_json::Deserializer::from_slice(body);
    let parsed = ActBody(&mut reading)
        .deserialize(&mut de)
        .and_then(|()| de.end());
    if let Some(refusal) = reading.refusal.take() {
        return Err(refusal);
    }
    parsed.map_err(|e| {
        (
            StatusCode::BAD_REQUEST,
            format!("expected {{\"observations\": [[numbers], …], \"sample\"?: bool, \"seed\"?: integer}}: {e}"),
        )
    })?;
    if reading.rows == 0 {
        return Err((StatusCode::BAD_REQUEST, "observations is empty".into()));
    }
    if reading.seed.is_some() && !reading.sample {
        return Err((
            StatusCode::BAD_REQUEST,
            "seed seeds sampling: send it with \"sample\": true".into(),
        ));
    }
    Ok(reading)
}

/// What [`read_observations`] has read so far, and the first limit broken.
struct Reading {
    dim: usize,
    max_rows: usize,
    observations: Vec<f32>,
    rows: usize,
    /// Draw the actions from the head's distribution instead of taking the
    /// greedy ones.
    sample: bool,
    /// The draws' seed (reproducible rollouts); by default, fresh entropy.
    seed: Option<u64>,
    /// Set with the error that stops the parse when a limit is broken:
    /// serde's errors are messages, this keeps the status.
    refusal: Option<Refusal>,
}

impl Reading {
    fn refuse<E: de::Error>(&mut self, status: StatusCode, message: String) -> E {
        let error = E::custom(&message);
        self.refusal = Some((status, message));
        error
    }
}

/// The body: an object with `observations` and nothing else.
struct ActBody<'a>(&'a mut Reading);

impl<'de> DeserializeSeed<'de> for ActBody<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> std::result::Result<(), D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for ActBody<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(
            "an object {\"observations\": [[numbers], …], \"sample\"?: bool, \"seed\"?: integer}",
        )
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<(), A::Error> {
        const FIELDS: &[&str] = &["observations", "sample", "seed"];
        let mut seen = [false; 3];
        while let Some(key) = map.next_key::<String>()? {
            let Some(field) = FIELDS.iter().position(|f| *f == key) else {
                return Err(de::Error::unknown_field(&key, FIELDS));
            };
            if std::mem::replace(&mut seen[field], true) {
                return Err(de::Error::duplicate_field(FIELDS[field]));
            }
            match field {
                0 => map.next_value_seed(Seq(Rows(&mut *self.0)))?,
                1 => self.0.sample = map.next_value()?,
                _ => self.0.seed = Some(map.next_value()?),
            }
        }
        if !seen[0] {
            return Err(de::Error::missing_field("observations"));
        }
        Ok(())
    }
}

/// Reads a JSON list through the visitor it wraps, so that `Rows` and `Row`
/// share one `DeserializeSeed` instead of two identical ones.
struct Seq<V>(V);

impl<'de, V: Visitor<'de, Value = ()>> DeserializeSeed<'de> for Seq<V> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> std::result::Result<(), D::Error> {
        deserializer.deserialize_seq(self.0)
    }
}

/// `observations`: rows, at most `max_rows` of them.
struct Rows<'a>(&'a mut Reading);

impl<'de> Visitor<'de> for Rows<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a list of observations")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<(), A::Error> {
        let reading = self.0;
        loop {
            if reading.rows == reading.max_rows {
                // One row more is enough to refuse; the rest is never read.
                if seq.next_element::<de::IgnoredAny>()?.is_some() {
                    let max = reading.max_rows;
                    return Err(reading.refuse(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        format!("more than {max} observations in one request; the limit is {max}"),
                    ));
                }
                return Ok(());
            }
            if seq.next_element_seed(Seq(Row(&mut *reading)))?.is_none() {
                return Ok(());
            }
            reading.rows += 1;
        }
    }
}

/// One observation: exactly `dim` finite numbers.
struct Row<'a>(&'a mut Reading);

impl<'de> Visitor<'de> for Row<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an observation: a list of numbers")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<(), A::Error> {
        let reading = self.0;
        let (i, dim) = (reading.rows, reading.dim);
        for j in 0..dim {
            let Some(v) = seq.next_element::<f32>()? else {
                return Err(reading.refuse(
                    StatusCode::BAD_REQUEST,
                    format!("observation {i} has {j} values; the policy takes {dim}"),
                ));
            };
            if !v.is_finite() {
                return Err(reading.refuse(
                    StatusCode::BAD_REQUEST,
                    format!("observation {i} holds {v}, which is not a finite number"),
                ));
            }
            reading.observations.push(v);
        }
        let mut extra = 0;
        while seq.next_element::<de::IgnoredAny>()?.is_some() {
            extra += 1;
        }
        if extra > 0 {
            return Err(reading.refuse(
                StatusCode::BAD_REQUEST,
                format!(
                    "observation {i} has {} values; the policy takes {dim}",
                    dim + extra
                ),
            ));
        }
        Ok(())
    }
}

/// What INT8 answered, for the shadow to compare.
struct Int8Answer {
    actions: Vec<qforge_formats::policy::Action>,
    log_probs: Vec<Option<f64>>,
    version: u64,
    /// The actions were the greedy ones (not sampled), so their agreement
    /// with FP's greedy actions is meaningful.
    greedy: bool,
}

/// Runs the FP reference on observations INT8 already answered: counts how
/// many greedy actions agree, and records how far the FP log-probability of
/// each INT8 action is from INT8's own. The client has its answer already;
/// a reference that fails or times out, or answers with another version (a
/// reload came between), only costs the comparison.
async fn shadow(state: Arc<AppState>, observations: Vec<f32>, rows: usize, int8: Int8Answer) {
    let Backend::Policy(policy) = &state.backend else {
        return;
    };
    let Some(fp) = &policy.fp else { return };
    let (reply, answer) = oneshot::channel();
    let arrival = fp.announce();
    if !fp.submit(
        arrival,
        ActRequest {
            observations,
            rows,
            choice: Choice::Score(int8.actions.clone()),
            reply,
        },
    ) {
        return;
    }
    if let Ok(Ok(Ok(fp))) = tokio::time::timeout(state.options.timeout, answer).await
        && fp.version == int8.version
    {
        let gaps: Vec<f64> = int8
            .log_probs
            .iter()
            .zip(&fp.log_probs)
            .filter_map(|(ours, theirs)| Some((ours.as_ref()? - theirs.as_ref()?).abs()))
            .collect();
        policy.rollout.record_logprob_mismatches(&gaps);
        if int8.greedy {
            let agreements: Vec<bool> = int8
                .actions
                .iter()
                .zip(&fp.actions)
                .map(|(a, b)| policy.head.actions_agree(a, b))
                .collect();
            policy.rollout.record_agreement(&agreements);
        }
    }
}

/// How a request's actions are chosen: greedy, or sampled (seeded when it
/// gives a seed) from a head that has a distribution.
fn choose(
    head: &qforge_formats::policy::Head,
    request: &Reading,
) -> std::result::Result<Choice, String> {
    if !request.sample {
        return Ok(Choice::Greedy);
    }
    if !head.is_stochastic() {
        return Err(
            "this policy's head has no distribution to sample (a value head, or a Gaussian head without log_std in policy.json); leave sample out for its greedy actions".into(),
        );
    }
    let rng = match request.seed {
        Some(seed) => StdRng::seed_from_u64(seed),
        None => StdRng::from_os_rng(),
    };
    Ok(Choice::Sample(Box::new(rng)))
}

/// The API, published at `/openapi.json`.
const OPENAPI: &str = include_str!("../api/openapi.json");

/// The API document of this server: the published one, with what only the
/// served model and the options decide filled in (observation width, rows
/// per request, the largest token id), so a client or a fuzzer reads the
/// real contract.
fn openapi_document(backend: &Backend, options: &ServeOptions) -> String {
    let mut doc: Value = serde_json::from_str(OPENAPI).expect("the bundled document is JSON");
    // Only a server with a token takes reloads; without one the route
    // refuses every request, so it is no part of the contract.
    if options.token.is_none()
        && let Some(paths) = doc["paths"].as_object_mut()
    {
        paths.remove("/admin/reload");
    }
    if let Backend::Policy(policy) = backend {
        let observations =
            &mut doc["components"]["schemas"]["ActRequest"]["properties"]["observations"];
        // A limit, not a schema rule: more rows are answered 413.
        observations["description"] = format!(
            "At most {} observations per request (more: 413)",
            options.max_rows
        )
        .into();
        let row = &mut observations["items"];
        row["minItems"] = policy.observation_dim.into();
        row["maxItems"] = policy.observation_dim.into();
        // Observations are read as f32: from 2^128 − 2^103 (half an ulp
        // above f32::MAX) on, a number rounds to infinity and is refused.
        let largest = f64::from_bits((2f64.powi(128) - 2f64.powi(103)).to_bits() - 1);
        row["items"]["minimum"] = (-largest).into();
        row["items"]["maximum"] = largest.into();
    }
    if let Backend::Language(lm) = backend {
        let ids = &mut doc["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]["oneOf"]
            [1]["items"];
        ids["maximum"] = lm.vocab_size.saturating_sub(1).into();
        let choices = crate::openai::MAX_CHOICES.min(lm.limits.max_sequences);
        for request in ["CompletionRequest", "ChatRequest"] {
            doc["components"]["schemas"][request]["properties"]["n"]["maximum"] = choices.into();
        }
    }
    doc.to_string()
}

async fn openapi(State(state): State<Arc<AppState>>) -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        state.openapi.clone(),
    )
        .into_response()
}

async fn health() -> Response {
    axum::Json(json!({ "status": "ok" })).into_response()
}

/// 200 while every model thread runs; 503 once one has ended, so an
/// orchestrator stops sending traffic to a server that can only refuse it.
async fn ready(State(state): State<Arc<AppState>>) -> Response {
    if state.backend.alive() {
        health().await
    } else {
        worker_stopped()
    }
}

/// 404 for a path no route serves (counted in the metrics as
/// `endpoint="unmatched"`: a fixed label, whatever the path).
async fn not_found() -> Response {
    error(
        StatusCode::NOT_FOUND,
        "no such endpoint; /openapi.json lists them",
    )
}

/// Counts every request by its route's path pattern and status — the
/// handler's own answers, the ones the layers give before it runs (a body
/// over the limit: 413), and paths no route serves (`unmatched`, 404).
async fn track(
    State(state): State<Arc<AppState>>,
    request: axum::extract::Request,
    next: Next,
) -> Response {
    let started = Instant::now();
    let endpoint = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", MatchedPath::as_str)
        .to_owned();
    let response = next.run(request).await;
    state.metrics.record(
        &endpoint,
        response.status().as_u16(),
        started.elapsed().as_secs_f64(),
    );
    response
}

async fn render_metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
}

/// Completes on SIGTERM or Ctrl-C: the `shutdown` a server run from a
/// terminal or by a process manager stops on.
pub async fn termination_signal(drain: Duration) {
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
    tracing::info!(
        "shutting down; finishing requests in flight (for at most {} ms)",
        drain.as_millis()
    );
}

/// Serves `served` until `shutdown` completes, then lets in-flight requests
/// finish for at most the drain timeout. `on_bound` hears the bound address
/// (port 0 resolved) once the socket listens.
pub async fn serve(
    served: Served,
    options: ServeOptions,
    on_bound: impl FnOnce(SocketAddr),
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    options.validate()?;
    let metrics = Arc::new(Metrics::default());
    let backend = start_backend(served, &options, &metrics)?;
    let listener = tokio::net::TcpListener::bind(options.addr)
        .await
        .map_err(|e| Error::Bind(options.addr, e))?;
    let bound = listener
        .local_addr()
        .map_err(|e| Error::Bind(options.addr, e))?;
    let state = Arc::new(AppState {
        openapi: openapi_document(&backend, &options),
        backend,
        bound: bound.ip(),
        token: options.token.as_deref().map(token_digest),
        metrics: Arc::clone(&metrics),
        in_flight: Arc::new(Semaphore::new(options.max_concurrency)),
        feedback: FeedbackLimit::new(options.feedback_interval),
        options: options.clone(),
        version: AtomicU64::new(1),
        reloading: tokio::sync::Mutex::new(()),
    });
    let app = router(state);
    on_bound(bound);
    conn::run(listener, app, options.connections, metrics, shutdown).await;
    Ok(())
}

impl ServeOptions {
    /// Refuses limits of zero (the engine's among them), a rollout share, rollback threshold,
    /// window or least number of sessions out of range, and drift settings
    /// out of range.
    pub fn validate(&self) -> Result<()> {
        check_options(self)
    }
}

fn check_options(options: &ServeOptions) -> Result<()> {
    if options.max_batch == 0
        || options.max_rows == 0
        || options.max_tokens == 0
        || options.max_prompt_tokens == 0
        || options.max_concurrency == 0
        || options.connections.max_connections == 0
    {
        return Err(Error::Options(
            "max batch, max rows, max tokens, max prompt tokens, max concurrency and max connections must be at least 1"
                .into(),
        ));
    }
    options.engine.check()?;
    let c = options.connections;
    if [c.header_timeout, c.body_timeout, c.keep_alive_timeout]
        .iter()
        .any(Duration::is_zero)
    {
        return Err(Error::Options(
            "the header, body and keep-alive timeouts must be longer than 0".into(),
        ));
    }
    let rollout = options.rollout;
    let share_ok = match rollout.mode {
        RolloutMode::Int8Only => true,
        RolloutMode::Split { int8_share } => (0.0..=1.0).contains(&int8_share),
        RolloutMode::Shadow { sample } => sample > 0.0 && sample <= 1.0,
    };
    if !share_ok {
        return Err(Error::Options(
            "the INT8 share of a split must be in [0, 1] and a shadow's sample in (0, 1]".into(),
        ));
    }
    if !(rollout.threshold.is_finite() && (0.0..=1.0).contains(&rollout.threshold))
        || rollout.agreement_window == 0
        || rollout.reward_window == 0
    {
        return Err(Error::Options(
            "the rollback threshold must be in [0, 1] and its windows at least 1".into(),
        ));
    }
    if !(1..=rollout.reward_window).contains(&rollout.min_sessions) {
        return Err(Error::Options(format!(
            "the rollback's least number of sessions per arm ({}) must be between 1 and the reward window ({} episodes), or no reward could ever roll back: lower --rollback-min-sessions or raise --reward-window",
            rollout.min_sessions, rollout.reward_window
        )));
    }
    if !(rollout.logprob_mismatch_alert.is_finite() && rollout.logprob_mismatch_alert >= 0.0) {
        return Err(Error::Options(
            "the log-prob mismatch alert threshold must be a number of nats ≥ 0".into(),
        ));
    }
    let drift = options.drift;
    if !(drift.sample > 0.0 && drift.sample <= 1.0)
        || drift.window_rows == 0
        || !(drift.threshold.is_finite() && drift.threshold >= 0.0)
    {
        return Err(Error::Options(
            "the drift sample must be in (0, 1], its window at least 1 row and its threshold ≥ 0"
                .into(),
        ));
    }
    Ok(())
}

/// Starts the batchers or engines of the served model (and its
/// reference), each with a drift monitor where there is a calibration.
fn start_backend(
    served: Served,
    options: &ServeOptions,
    metrics: &Arc<Metrics>,
) -> Result<Backend> {
    let monitor = served
        .calibration
        .map(|c| c.into_monitor(options.drift, metrics));
    let policy = |model, reference, monitor| {
        PolicyBackend::start(model, reference, monitor, options, metrics).map(Backend::Policy)
    };
    let language = |model, reference, monitor| {
        LanguageBackend::start(model, reference, monitor, options, metrics).map(Backend::Language)
    };
    match (served.model, served.reference) {
        (Model::Policy(model), None) => policy(*model, None, monitor),
        (Model::Policy(model), Some(Model::Policy(reference))) => {
            policy(*model, Some(*reference), monitor)
        }
        (Model::Language(model), None) => language(*model, None, monitor),
        (Model::Language(model), Some(Model::Language(reference))) => {
            language(*model, Some(*reference), monitor)
        }
        // `Served::with_reference` refuses this, naming the paths; a value built
        // otherwise is refused here.
        (model, Some(reference)) => Err(Error::Options(format!(
            "the model is a {} and its reference a {}: they must be the same kind of model",
            model.kind(),
            reference.kind()
        ))),
    }
}

/// The routes; the bearer token (when the server requires one), the
/// refusal of what a web page could have sent, and then the body reading
/// (limit and deadline) on all but the probes; and the
/// request metrics around them all. `/health` and `/ready` stay open, so
/// an orchestrator's probes need no secret: they tell only whether the
/// process and its model are up.
fn router(state: Arc<AppState>) -> Router {
    let guarded = |routes: Router<Arc<AppState>>, shape: Shape| {
        routes
            .route_layer(middleware::from_fn_with_state(
                (Arc::clone(&state), shape),
                read_body,
            ))
            .route_layer(middleware::from_fn_with_state(
                (Arc::clone(&state), shape),
                refuse_pages,
            ))
            // Added last, so it runs first: before the body is read.
            .route_layer(middleware::from_fn_with_state(
                (Arc::clone(&state), shape),
                require_token,
            ))
    };
    let policy = Router::new()
        .route("/v1/act", post(act))
        .route("/v1/feedback", post(feedback::feedback))
        .route("/admin/reload", post(reload::reload))
        .route("/metrics", get(render_metrics))
        .route("/openapi.json", get(openapi));
    let completions = Router::new()
        .route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/models", get(openai::models));
    Router::new()
        .route("/health", get(health))
        .route("/ready", get(ready))
        .merge(guarded(policy, Shape::Plain))
        .merge(guarded(completions, Shape::OpenAi))
        .fallback(not_found)
        // `read_body` enforces the limit; the extractors take what it read.
        .layer(DefaultBodyLimit::disable())
        // A layer, not a route layer: the fallback's 404s are counted too.
        .layer(middleware::from_fn_with_state(Arc::clone(&state), track))
        .with_state(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(body: &str, max_rows: usize) -> std::result::Result<(Vec<f32>, usize), Refusal> {
        read_observations(body.as_bytes(), 2, max_rows).map(|r| (r.observations, r.rows))
    }

    fn refused(body: &str, max_rows: usize) -> (u16, String) {
        let (status, message) = read(body, max_rows).unwrap_err();
        (status.as_u16(), message)
    }

    #[test]
    fn observations_are_read_row_after_row() {
        let (values, rows) = read(r#" {"observations": [[1, 2.5], [-0, 3e2]]} "#, 2).unwrap();
        assert_eq!(rows, 2);
        assert_eq!(values, [1.0, 2.5, -0.0, 300.0]);
    }

    #[test]
    fn sample_and_seed_are_read_beside_the_observations() {
        let r = read_observations(
            br#"{"sample": true, "observations": [[1, 2]], "seed": 9}"#,
            2,
            4,
        )
        .unwrap();
        assert_eq!((r.rows, r.sample, r.seed), (1, true, Some(9)));
        let r = read_observations(br#"{"observations": [[1, 2]]}"#, 2, 4).unwrap();
        assert_eq!((r.sample, r.seed), (false, None));
    }

    #[test]
    fn the_row_limit_stops_the_parse_at_the_first_row_beyond_it() {
        // What follows the third row is not even JSON: the parse stopped there.
        let (status, message) = refused(r#"{"observations": [[0, 0], [0, 0], [0, 0], !!!"#, 2);
        assert_eq!(status, 413, "{message}");
        assert!(message.contains("the limit is 2"), "{message}");
        // At the limit, still fine.
        assert_eq!(
            read(r#"{"observations": [[0, 0], [0, 0]]}"#, 2).unwrap().1,
            2
        );
    }

    #[test]
    fn each_refusal_names_the_problem() {
        for (body, status, needle) in [
            (
                r#"{"observations": [[1, 2], [3]]}"#,
                400,
                "observation 1 has 1 values; the policy takes 2",
            ),
            (
                r#"{"observations": [[1, 2, 3, 4]]}"#,
                400,
                "observation 0 has 4 values",
            ),
            (
                r#"{"observations": [[1, 1e39]]}"#,
                400,
                "holds inf, which is not a finite number",
            ),
            (r#"{"observations": [[1, 1e999]]}"#, 400, "expected {"),
            (r#"{"observations": [[1, "x"]]}"#, 400, "invalid type"),
            (r#"{"observations": []}"#, 400, "observations is empty"),
            (
                r#"{"observations": [[1, 2]], "extra": 1}"#,
                400,
                "unknown field `extra`",
            ),
            (
                r#"{"observations": [[1, 2]], "observations": [[1, 2]]}"#,
                400,
                "duplicate field",
            ),
            (r#"{}"#, 400, "missing field `observations`"),
            (
                r#"{"observations": [[1, 2]]} x"#,
                400,
                "trailing characters",
            ),
            (r#"[]"#, 400, "expected {"),
            ("", 400, "expected {"),
            (
                r#"{"observations": [[1, 2]], "seed": 3}"#,
                400,
                "send it with \"sample\": true",
            ),
            (
                r#"{"observations": [[1, 2]], "sample": 1}"#,
                400,
                "invalid type",
            ),
            (
                r#"{"observations": [[1, 2]], "sample": true, "seed": -1}"#,
                400,
                "invalid value",
            ),
        ] {
            let (got, message) = refused(body, 8);
            assert_eq!(got, status, "{body}: {message}");
            assert!(message.contains(needle), "{body}: {message}");
        }
    }

    #[test]
    fn an_unquantized_policy_answers_as_fp32() {
        // The CartPole directory, served as it is: no INT8 layer.
        let server = crate::testing::TestServer::policy();
        let (status, body) = server.request(
            "POST",
            "/v1/act",
            r#"{"observations": [[0, 0.1, 0, -0.1]]}"#,
        );
        assert_eq!(status, 200, "{body}");
        let answer: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(answer["arm"], "fp32", "{body}");
    }
}
