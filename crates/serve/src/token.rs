//! The bearer token a server requires: kept as its SHA-256 and compared in
//! constant time.

use axum::http::{HeaderMap, header};
use sha2::{Digest, Sha256};

/// The SHA-256 of the bearer token a server requires.
pub(crate) type TokenDigest = [u8; 32];

/// The digest [`authorized`] compares against.
pub(crate) fn token_digest(token: &str) -> TokenDigest {
    Sha256::digest(token.as_bytes()).into()
}

/// Whether `headers` carry the bearer token whose digest is `required`
/// (any request does when none is required). The scheme is matched without
/// regard to case (RFC 7235 §2.1). The token is compared by its SHA-256,
/// all 32 bytes without an early exit: how long the comparison takes says
/// nothing about the token, its length included (comparing the tokens
/// themselves returned at once on a length mismatch), and even a digest
/// prefix that matched would reveal no prefix of the token.
pub(crate) fn authorized(required: Option<&TokenDigest>, headers: &HeaderMap) -> bool {
    let Some(required) = required else {
        return true;
    };
    let Some(given) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token)
    else {
        return false;
    };
    let given = token_digest(given);
    std::hint::black_box(
        given
            .iter()
            .zip(required)
            .fold(0u8, |differ, (a, b)| differ | (a ^ b)),
    ) == 0
}

/// The token of an `Authorization` value in the `Bearer` scheme.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim_start_matches(' ');
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

#[cfg(test)]
mod tests {
    use axum::http::{HeaderMap, HeaderValue, header};

    use super::*;

    fn headers(authorization: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_str(authorization).unwrap(),
        );
        h
    }

    #[test]
    fn the_bearer_scheme_is_case_insensitive_and_the_token_exact() {
        let required = token_digest("s3cret");
        let ok = |value: &str| authorized(Some(&required), &headers(value));
        for value in [
            "Bearer s3cret",
            "bearer s3cret",
            "BEARER s3cret",
            "Bearer   s3cret",
        ] {
            assert!(ok(value), "{value}");
        }
        for value in [
            "Bearer s3cre",
            "Bearer s3cret2",
            "Bearer S3CRET",
            "Bearer ",
            "Basic s3cret",
            "Bearers3cret",
            "s3cret",
        ] {
            assert!(!ok(value), "{value}");
        }
        assert!(!authorized(Some(&required), &HeaderMap::new()));
        assert!(authorized(None, &HeaderMap::new()));
    }
}
