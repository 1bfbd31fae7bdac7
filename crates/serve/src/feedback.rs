//! `POST /v1/feedback`: a client reports an episode's return, which the
//! A/B rollout ([`crate::rollout`]) counts for the episode's arm.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use crate::http::{error, session};
use crate::rollout::{Arm, RolloutMode};
use crate::state::{AppState, Backend};

/// The largest |reward| taken. The arms' means are sums over the windows,
/// so without a bound two rewards of 1e308 made a mean infinite and the
/// consistency NaN; and 1e9 is far above any benchmark's return (Atari
/// records are under 1e7, CartPole's is 500), so only a forged or broken
/// report meets the bound.
const MAX_REWARD: f64 = 1e9;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FeedbackRequest {
    /// The episode's return.
    reward: f64,
    /// The arm that played it; by default the session's.
    #[serde(default)]
    arm: Option<Arm>,
}

/// `POST /v1/feedback`: one episode's return, counted for its arm.
pub(crate) async fn feedback(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let (state, headers, body) = (&*state, &headers, &body[..]);
    let session = session(headers);
    let rollout = match &state.backend {
        Backend::Policy(policy) => &policy.rollout,
        Backend::Language(lm) => &lm.rollout,
    };
    let request: FeedbackRequest = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("expected {{\"reward\": number, \"arm\"?: \"int8\"|\"fp32\"|\"fp\"}}: {e}"),
            );
        }
    };
    if !request.reward.is_finite() || request.reward.abs() > MAX_REWARD {
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "reward must be a number within ±{MAX_REWARD:e} (an episode's return); got {}",
                request.reward
            ),
        );
    }
    let arm = match (request.arm, session, rollout.options().mode) {
        (Some(arm), _, _) => arm,
        (None, None, RolloutMode::Split { .. }) => {
            return error(
                StatusCode::BAD_REQUEST,
                "sessions are split between the arms: name the episode's arm (\"arm\") or its session (X-Session-Id header)",
            );
        }
        // Outside a split every session plays INT8 (until a rollback).
        (None, session, _) => rollout.assigned_arm(session),
    };
    // Checked last, so a malformed report does not spend the session's turn.
    let now = Instant::now();
    if let Err(wait) = state.feedback.admit(session, now) {
        let mut response = error(
            StatusCode::TOO_MANY_REQUESTS,
            format!(
                "this session reported a reward less than {} ms ago: an episode reports its return once (retry in {} ms)",
                state.options.feedback_interval.as_millis(),
                wait.as_millis().max(1)
            ),
        );
        let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, seconds.max(1).into());
        return response;
    }
    axum::Json(rollout.record_reward(arm, request.reward, session, now)).into_response()
}

#[cfg(test)]
mod tests {
    use crate::testing::TestServer;

    #[test]
    fn a_reward_beyond_the_bound_is_refused_and_one_at_it_counted() {
        let server = TestServer::policy();
        for reward in ["1e308", "-1e308", "1000000000.001"] {
            let body = format!(r#"{{"reward": {reward}}}"#);
            let (status, text) = server.request("POST", "/v1/feedback", &body);
            assert_eq!(status, 400, "{reward}: {text}");
            assert!(text.contains("within ±1e9"), "{text}");
        }
        let (status, text) = server.request("POST", "/v1/feedback", r#"{"reward": -1e9}"#);
        assert_eq!(status, 200, "{text}");
        assert_eq!(
            server.metric("qforge_feedback_episodes_total{arm=\"int8\"}"),
            Some(1.0)
        );
    }
}
