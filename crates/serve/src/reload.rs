//! `POST /admin/reload {"model": DIR}`: a server swaps in a new artifact
//! (the output of `qforge quantize` or `qforge requantize` at a weight
//! sync) without a restart. The artifact is checked against its manifest
//! and must answer like the one served (a policy: the same observation
//! width and head; a language model: the same tokenizer, chat template and
//! context); its FP source replaces the reference when a rollout needs one.
//! A policy swaps between batches: requests queued before it are answered
//! by the old weights. A language model swaps once its admitted completions
//! are done (each is computed by one version from first token to last);
//! queued ones run on the new weights. Every `/v1/act` and completion
//! answer names the model version that computed it
//! (`X-Qforge-Model-Version`). Reloading needs the bearer token: a server
//! started without one refuses.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use qforge_model::artifact::is_artifact;
use qforge_model::{LanguageModel, MlpPolicy, Model};
use serde::Deserialize;
use serde_json::json;
use tokio::sync::oneshot;

use crate::error::{Error, Result};
use crate::http::{error, worker_stopped};
use crate::rollout::{Arm, served_label};
use crate::served::{Served, reference_for};
use crate::state::{AppState, Backend, LanguageBackend, PolicyBackend};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReloadRequest {
    /// The artifact directory, on the server's file system.
    model: PathBuf,
}

/// Why a reload was refused.
type Refusal = (StatusCode, String);

pub(crate) async fn reload(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let refuse = |(status, message): Refusal| {
        count(&state, "refused");
        error(status, message)
    };
    if state.token.is_none() {
        return refuse((
            StatusCode::FORBIDDEN,
            "POST /admin/reload needs a bearer token: start the server with QFORGE_SERVE_TOKEN set"
                .into(),
        ));
    }
    let request: ReloadRequest = match serde_json::from_slice(&body) {
        Ok(request) => request,
        Err(e) => {
            return refuse((
                StatusCode::BAD_REQUEST,
                format!("the body must be {{\"model\": \"ARTIFACT_DIR\"}}: {e}"),
            ));
        }
    };
    let _one_at_a_time = state.reloading.lock().await;
    let started = Instant::now();
    let path = request.model.clone();
    let needs_reference = match &state.backend {
        Backend::Policy(policy) => policy.fp.is_some(),
        Backend::Language(lm) => lm.fp.is_some(),
    };
    let loaded = tokio::task::spawn_blocking(move || load(&path, needs_reference)).await;
    let loaded = match loaded {
        Ok(Ok(loaded)) => loaded,
        Ok(Err(e)) => return refuse((StatusCode::BAD_REQUEST, e.to_string())),
        Err(e) => {
            return refuse((
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("loading the artifact failed: {e}"),
            ));
        }
    };
    let monitor = loaded
        .calibration
        .map(|c| c.into_monitor(state.options.drift, &state.metrics));
    let version = state.version.load(Ordering::SeqCst) + 1;
    // Labelled before the swap, since the new version answers from then on.
    let rollout = match &state.backend {
        Backend::Policy(served) => &served.rollout,
        Backend::Language(served) => &served.rollout,
    };
    rollout.label_version(version, served_label(&loaded.model.linears()));
    // The reference was not calibrated: nothing to watch.
    let swaps = match &state.backend {
        Backend::Policy(served) => {
            policy_swaps(served, loaded.model, loaded.reference).map(|(policy, reference)| {
                let mut swaps = vec![served.int8.swap(policy, monitor, version)];
                if let (Some(fp), Some(reference)) = (&served.fp, reference) {
                    swaps.push(fp.swap(reference, None, version));
                }
                swaps
            })
        }
        Backend::Language(served) => {
            language_swaps(served, loaded.model, loaded.reference).map(|(lm, reference)| {
                let mut swaps = vec![served.engine(Arm::Int8).swap(lm, monitor, version)];
                if let (Some(fp), Some(reference)) = (&served.fp, reference) {
                    swaps.push(fp.swap(reference, None, version));
                }
                swaps
            })
        }
    };
    let swaps: Vec<Option<oneshot::Receiver<()>>> = match swaps {
        Ok(swaps) => swaps,
        Err(refusal) => return refuse(refusal),
    };
    for swap in swaps {
        let Some(swapped) = swap else {
            return worker_stopped();
        };
        if swapped.await.is_err() {
            return worker_stopped();
        }
    }
    state.version.store(version, Ordering::SeqCst);
    state.metrics.model_version.set(version as i64);
    count(&state, "swapped");
    tracing::info!(
        "qforge serve: reloaded {} as model version {version}",
        request.model.display()
    );
    axum::Json(json!({
        "version": version,
        "model": request.model.display().to_string(),
        "seconds": started.elapsed().as_secs_f64(),
    }))
    .into_response()
}

fn count(state: &AppState, outcome: &str) {
    state
        .metrics
        .reloads
        .get_or_create(&vec![("outcome".to_owned(), outcome.to_owned())])
        .inc();
}

/// Opens the artifact at `path` (checked against its manifest) and, when
/// `needs_reference`, the FP source its manifest records: the artifact
/// first, so a damaged one is named as such before its source is sought.
fn load(path: &Path, needs_reference: bool) -> Result<Served> {
    if !is_artifact(path) {
        return Err(Error::Options(format!(
            "{} is not a qforge artifact (no qforge.json); reload an output of `qforge quantize` or `qforge requantize`",
            path.display()
        )));
    }
    let served = Served::open(path)?;
    match reference_for(path, None, needs_reference)? {
        Some(reference) => served.with_reference(path, &reference),
        None => Ok(served),
    }
}

fn conflict(message: String) -> Refusal {
    (StatusCode::CONFLICT, message)
}

/// The new policy (and reference) for a policy server. Both must take what
/// the served one takes and answer alike (a `log_std` may have been trained
/// on; whether there is one may not change).
fn policy_swaps(
    served: &PolicyBackend,
    model: Model,
    reference: Option<Model>,
) -> std::result::Result<(MlpPolicy, Option<MlpPolicy>), Refusal> {
    let policy = |model: Model| match model {
        Model::Policy(policy) => {
            let config = policy.config();
            if config.observation_dim == served.observation_dim
                && config.head.answers_like(&served.head)
            {
                Ok(*policy)
            } else {
                Err(conflict(format!(
                    "the new artifact takes {} observation values and has head {:?}; the served model takes {} and has {:?}: clients would break, so it is not swapped in",
                    config.observation_dim, config.head, served.observation_dim, served.head
                )))
            }
        }
        Model::Language(_) => Err(conflict(
            "the new artifact is a language model; this server runs a policy".into(),
        )),
    };
    Ok((policy(model)?, reference.map(policy).transpose()?))
}

/// The new model (and reference) for a language-model server. Both must
/// read and write text as the served one does (tokenizer, chat template)
/// and take as long a context: requests are tokenized and checked before
/// they reach the engine.
fn language_swaps(
    served: &LanguageBackend,
    model: Model,
    reference: Option<Model>,
) -> std::result::Result<(LanguageModel, Option<LanguageModel>), Refusal> {
    let language = |model: Model| match model {
        Model::Language(lm) => {
            let context = lm.model.config().max_position_embeddings;
            if !lm.text.same_as(&served.text) {
                Err(conflict(
                    "the new artifact's tokenizer or chat template differs from the served model's: clients would get other tokens, so it is not swapped in".into(),
                ))
            } else if context != served.context {
                Err(conflict(format!(
                    "the new artifact has a context of {context} positions, the served model {}: it is not swapped in",
                    served.context
                )))
            } else {
                Ok(*lm)
            }
        }
        Model::Policy(_) => Err(conflict(
            "the new artifact is a control policy; this server runs a language model".into(),
        )),
    };
    Ok((language(model)?, reference.map(language).transpose()?))
}
