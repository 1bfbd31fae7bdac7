//! `POST /admin/reload {"model": DIR}`: a policy server swaps in a new
//! artifact (the output of `qforge quantize` or `qforge requantize` at a
//! weight sync) without a restart. The artifact is checked against its
//! manifest and must act like the one served (same observation width and
//! head); its FP source replaces the reference when a rollout needs one.
//! The swap happens between batches: requests queued before it are answered
//! by the old weights, and every `/v1/act` answer names the model version
//! that computed it (`X-Qforge-Model-Version`). Reloading needs the bearer
//! token: a server started without one refuses.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use qforge_model::artifact::is_artifact;
use qforge_model::{MlpPolicy, Model};
use serde::Deserialize;
use serde_json::json;

use crate::error::{Error, Result};
use crate::http::{error, worker_stopped};
use crate::served::{Calibration, reference_for};
use crate::state::{AppState, Backend, PolicyBackend};

/// The response header naming the model version that answered.
pub const VERSION_HEADER: &str = "x-qforge-model-version";

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReloadRequest {
    /// The artifact directory, on the server's file system.
    model: PathBuf,
}

/// What a reload swaps in.
struct Loaded {
    policy: MlpPolicy,
    reference: Option<MlpPolicy>,
    calibration: Option<Calibration>,
}

pub(crate) async fn reload(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let refuse = |status: StatusCode, message: String| {
        count(&state, "refused");
        error(status, message)
    };
    if state.token.is_none() {
        return refuse(
            StatusCode::FORBIDDEN,
            "POST /admin/reload needs a bearer token: start the server with QFORGE_SERVE_TOKEN set"
                .into(),
        );
    }
    let Backend::Policy(policy) = &state.backend else {
        return refuse(
            StatusCode::NOT_IMPLEMENTED,
            "reloading a language model is not supported yet: start a server on the new artifact"
                .into(),
        );
    };
    let request: ReloadRequest = match serde_json::from_slice(&body) {
        Ok(request) => request,
        Err(e) => {
            return refuse(
                StatusCode::BAD_REQUEST,
                format!("the body must be {{\"model\": \"ARTIFACT_DIR\"}}: {e}"),
            );
        }
    };
    let _one_at_a_time = policy.reloading.lock().await;
    let started = Instant::now();
    let path = request.model.clone();
    let needs_reference = policy.fp.is_some();
    let loaded = tokio::task::spawn_blocking(move || load(&path, needs_reference)).await;
    let loaded = match loaded {
        Ok(Ok(loaded)) => loaded,
        Ok(Err(e)) => return refuse(StatusCode::BAD_REQUEST, e.to_string()),
        Err(e) => {
            return refuse(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("loading the artifact failed: {e}"),
            );
        }
    };
    if let Err(why) = acts_alike(policy, &loaded.policy) {
        return refuse(StatusCode::CONFLICT, why);
    }
    let monitor = loaded
        .calibration
        .map(|c| c.into_monitor(state.options.drift, &state.metrics));
    let version = policy.version.load(Ordering::SeqCst) + 1;
    let mut swaps = vec![policy.int8.swap(loaded.policy, monitor, version)];
    if let (Some(fp), Some(reference)) = (&policy.fp, loaded.reference) {
        // The reference was not calibrated: nothing to watch.
        swaps.push(fp.swap(reference, None, version));
    }
    for swap in swaps {
        let Some(swapped) = swap else {
            return worker_stopped();
        };
        if swapped.await.is_err() {
            return worker_stopped();
        }
    }
    policy.version.store(version, Ordering::SeqCst);
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
/// `needs_reference`, the FP source its manifest records.
fn load(path: &Path, needs_reference: bool) -> Result<Loaded> {
    if !is_artifact(path) {
        return Err(Error::Options(format!(
            "{} is not a qforge artifact (no qforge.json); reload an output of `qforge quantize` or `qforge requantize`",
            path.display()
        )));
    }
    let policy_at = |p: &Path| match qforge_model::open(p)? {
        Model::Policy(policy) => Ok(*policy),
        Model::Language(_) => Err(Error::Options(format!(
            "{} is a language model; this server runs a policy",
            p.display()
        ))),
    };
    let policy = policy_at(path)?;
    let calibration = Calibration::of(path)?;
    let reference = reference_for(path, None, needs_reference)?
        .map(|p| policy_at(&p))
        .transpose()?;
    Ok(Loaded {
        policy,
        reference,
        calibration,
    })
}

/// The new policy must take what the served one takes and answer alike
/// (its `log_std` may have been trained on; whether it has one may not
/// change).
fn acts_alike(served: &PolicyBackend, new: &MlpPolicy) -> std::result::Result<(), String> {
    let config = new.config();
    if config.observation_dim == served.observation_dim && config.head.answers_like(&served.head) {
        return Ok(());
    }
    Err(format!(
        "the new artifact takes {} observation values and has head {:?}; the served model takes {} and has {:?}: clients would break, so it is not swapped in",
        config.observation_dim, config.head, served.observation_dim, served.head
    ))
}
