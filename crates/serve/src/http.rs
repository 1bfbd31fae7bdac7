//! HTTP pieces every handler uses: the headers this server reads and
//! writes, the bearer-token check, reading a body under its limits, and
//! the error answers (plain, or in OpenAI's shape).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde_json::json;

use crate::origin::{foreign_origin, not_json};
use crate::state::AppState;
use crate::token::authorized;

/// The request header a client names its session (episode) with: A/B
/// splits are sticky by it, and `/v1/feedback` finds the session's arm by it.
pub const SESSION_HEADER: &str = "x-session-id";
/// The response header naming the arm that answered.
pub const ARM_HEADER: &str = "x-qforge-arm";
/// The response header naming the model version that answered.
pub const VERSION_HEADER: &str = "x-qforge-model-version";

/// The session a request names, if any.
pub(crate) fn session(headers: &HeaderMap) -> Option<&str> {
    headers.get(SESSION_HEADER).and_then(|v| v.to_str().ok())
}

/// Names the arm that answered in a header, by its label
/// ([`crate::rollout::Rollout::label`]).
pub(crate) fn with_arm(mut response: Response, label: &'static str) -> Response {
    response
        .headers_mut()
        .insert(ARM_HEADER, HeaderValue::from_static(label));
    response
}

/// Names the model version that answered in a header.
pub(crate) fn with_version(mut response: Response, version: u64) -> Response {
    response
        .headers_mut()
        .insert(VERSION_HEADER, HeaderValue::from(version));
    response
}

/// `{"error": message}` with `status`.
pub(crate) fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, axum::Json(json!({ "error": message.into() }))).into_response()
}

/// Which shape an endpoint's errors take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shape {
    /// `{"error": message}` (the policy endpoints, metrics, the document).
    Plain,
    /// OpenAI's `{"error": {"message", "type", "param", "code"}}`, so its
    /// clients show the message.
    OpenAi,
}

/// An OpenAI-shaped error.
pub(crate) fn api_error(
    status: StatusCode,
    kind: &str,
    param: Option<&str>,
    message: String,
) -> Response {
    (
        status,
        axum::Json(json!({
            "error": {"message": message, "type": kind, "param": param, "code": null}
        })),
    )
        .into_response()
}

/// An error in `shape`.
fn refusal(shape: Shape, status: StatusCode, message: String) -> Response {
    match shape {
        Shape::Plain => error(status, message),
        Shape::OpenAi => api_error(status, "invalid_request_error", None, message),
    }
}

/// An answer after which the connection closes: the request's body was
/// not (fully) read, so nothing after it on the connection can be trusted
/// to be a request.
fn closing(mut response: Response) -> Response {
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// Reads the request body before the handler runs, under the body limit
/// (a declared length over it is refused before a byte is read) and the
/// body timeout (a client trickling its body is cut off with 408).
pub(crate) async fn read_body(
    State((state, shape)): State<(Arc<AppState>, Shape)>,
    request: Request,
    next: Next,
) -> Response {
    let limit = state.options.max_body_bytes;
    let (parts, body) = request.into_parts();
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(length) = declared.filter(|&l| l > limit as u64) {
        return closing(refusal(
            shape,
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the body is {length} bytes; this server takes at most {limit}"),
        ));
    }
    let timeout = state.options.connections.body_timeout;
    let read = tokio::time::timeout(timeout, Limited::new(body, limit).collect()).await;
    let bytes = match read {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => {
            return closing(refusal(
                shape,
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the body is over the limit of {limit} bytes"),
            ));
        }
        Ok(Err(e)) => {
            return closing(refusal(
                shape,
                StatusCode::BAD_REQUEST,
                format!("the body could not be read: {e}"),
            ));
        }
        Err(_) => {
            return closing(refusal(
                shape,
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "the body did not arrive within {} ms of the request head",
                    timeout.as_millis()
                ),
            ));
        }
    };
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
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

/// Refuses a request without the server's bearer token with 401, before
/// anything reads its body: a client without the token cannot make the
/// server read (or wait for) a megabyte.
pub(crate) async fn require_token(
    State((state, shape)): State<(Arc<AppState>, Shape)>,
    request: Request,
    next: Next,
) -> Response {
    if authorized(state.token.as_ref(), request.headers()) {
        return next.run(request).await;
    }
    let message = "missing or wrong bearer token (Authorization: Bearer …)".to_owned();
    let response = match shape {
        Shape::Plain => error(StatusCode::UNAUTHORIZED, message),
        Shape::OpenAi => api_error(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            None,
            message,
        ),
    };
    let mut response = closing(response);
    response
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

/// Refuses, before the body is read, what a web page could have sent: a
/// body labelled as anything but JSON (415), and on a server without a
/// token a request from a foreign `Origin` (403). A server with a token
/// needs no Origin check: a page cannot learn the token, and a browser
/// never adds an `Authorization: Bearer` header of its own accord.
pub(crate) async fn refuse_pages(
    State((state, shape)): State<(Arc<AppState>, Shape)>,
    request: Request,
    next: Next,
) -> Response {
    if let Some(why) = not_json(request.method(), request.headers()) {
        return closing(refusal(shape, StatusCode::UNSUPPORTED_MEDIA_TYPE, why));
    }
    if state.token.is_none()
        && let Some(origin) = foreign_origin(request.headers(), state.bound)
    {
        let message = format!(
            "requests from web pages are refused: Origin {origin:?} is not this machine (localhost, loopback, or {}), and this server has no token; serve with a token (QFORGE_SERVE_TOKEN) to take requests from anywhere that has it",
            state.bound
        );
        let response = match shape {
            Shape::Plain => error(StatusCode::FORBIDDEN, message),
            Shape::OpenAi => api_error(StatusCode::FORBIDDEN, "permission_error", None, message),
        };
        return closing(response);
    }
    next.run(request).await
}
