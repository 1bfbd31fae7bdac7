//! HTTP pieces every handler uses: the headers this server reads and
//! writes, the bearer-token check, and the plain error answers.

use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::rollout::Arm;
use crate::state::AppState;

/// The request header a client names its session (episode) with: A/B
/// splits are sticky by it, and `/v1/feedback` finds the session's arm by it.
pub const SESSION_HEADER: &str = "x-session-id";
/// The response header naming the arm that answered.
pub const ARM_HEADER: &str = "x-qforge-arm";

/// The session a request names, if any.
pub(crate) fn session(headers: &HeaderMap) -> Option<&str> {
    headers.get(SESSION_HEADER).and_then(|v| v.to_str().ok())
}

/// Names the arm that answered in a header.
pub(crate) fn with_arm(mut response: Response, arm: Arm) -> Response {
    response
        .headers_mut()
        .insert(ARM_HEADER, HeaderValue::from_static(arm.name()));
    response
}

/// `{"error": message}` with `status`.
pub(crate) fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, axum::Json(json!({ "error": message.into() }))).into_response()
}

/// An error the client may retry after a second (`Retry-After: 1`).
pub(crate) fn retry_later(status: StatusCode, message: &str) -> Response {
    let mut response = error(status, message);
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response
}

/// 429: the concurrency limit is reached.
pub(crate) fn too_many_requests() -> Response {
    retry_later(
        StatusCode::TOO_MANY_REQUESTS,
        "too many requests in flight; retry shortly",
    )
}

/// 503: the model's worker is gone.
pub(crate) fn worker_stopped() -> Response {
    retry_later(StatusCode::SERVICE_UNAVAILABLE, "the model worker stopped")
}

/// 503: the model did not answer within the request timeout.
pub(crate) fn timed_out() -> Response {
    retry_later(
        StatusCode::SERVICE_UNAVAILABLE,
        "the request timed out waiting for the model",
    )
}

/// Whether the request carries the bearer token the server requires (any
/// request does when it requires none).
pub(crate) fn authorized(state: &AppState, headers: &HeaderMap) -> bool {
    let Some(token) = &state.options.token else {
        return true;
    };
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|given| {
            // Length-independent comparison: no early exit on the first
            // differing byte.
            given.len() == token.len()
                && given
                    .bytes()
                    .zip(token.bytes())
                    .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                    == 0
        })
}
