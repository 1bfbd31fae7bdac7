//! What keeps a web page from driving a server: a browser lets any page
//! POST a form or `text/plain` to `http://127.0.0.1:8000` without asking
//! (no CORS preflight), and a server without a token would act on it. So
//! a body labelled as anything but JSON is refused, and a server without a
//! token refuses a request whose `Origin` is foreign: a page's, not the
//! machine's own.

use std::net::IpAddr;

use axum::http::{HeaderMap, Method, header};

/// Why a request that names a body type other than JSON is refused, or
/// `None` when it names JSON or no type at all. A browser labels every
/// body a page can send without a preflight (`text/plain`, a form), so an
/// unlabelled body comes from a client that is not a page (or from a
/// script, whose `Origin` [`foreign_origin`] judges). GET and HEAD carry
/// no body, so their label is not read.
pub(crate) fn not_json(method: &Method, headers: &HeaderMap) -> Option<String> {
    if method == Method::GET || method == Method::HEAD {
        return None;
    }
    let value = headers.get(header::CONTENT_TYPE)?;
    let text = value.to_str().unwrap_or("");
    // `application/json; charset=utf-8` is JSON too; the type is case-blind.
    let media = text.split(';').next().unwrap_or("").trim();
    if media.eq_ignore_ascii_case("application/json") {
        return None;
    }
    Some(format!(
        "this server reads JSON bodies, not {:?}: send Content-Type: application/json (curl: -H 'Content-Type: application/json')",
        String::from_utf8_lossy(value.as_bytes())
    ))
}

/// The `Origin` of a request a tokenless server must refuse, or `None`.
///
/// An origin is the machine's own when its host is `localhost`, a loopback
/// address, or the address the server is bound to (`bound`; an unspecified
/// one, 0.0.0.0 or ::, names no host of its own). Any port: a page served
/// on this machine is as trusted as the user who runs it. Everything else,
/// `null` (a sandboxed page, a `file:` URL) and a value that is no origin
/// included, is a page elsewhere, or a DNS name rebound to this machine.
/// A request without `Origin` is no cross-site request from a browser:
/// browsers send one on every POST and every cross-origin request.
pub(crate) fn foreign_origin(headers: &HeaderMap, bound: IpAddr) -> Option<String> {
    let value = headers.get(header::ORIGIN)?;
    let text = String::from_utf8_lossy(value.as_bytes()).into_owned();
    let own = origin_host(&text).is_some_and(|host| {
        if host.eq_ignore_ascii_case("localhost") {
            return true;
        }
        let Ok(ip) = host.parse::<IpAddr>() else {
            return false;
        };
        let ip = ip.to_canonical();
        ip.is_loopback() || (!bound.is_unspecified() && ip == bound.to_canonical())
    });
    (!own).then_some(text)
}

/// The host of an origin, `scheme://host[:port]`: an IPv6 host without its
/// brackets.
fn origin_host(origin: &str) -> Option<&str> {
    let (_, authority) = origin.split_once("://")?;
    if let Some(rest) = authority.strip_prefix('[') {
        let (host, after) = rest.split_once(']')?;
        return (after.is_empty() || after.starts_with(':')).then_some(host);
    }
    let host = authority.split(':').next()?;
    (!host.is_empty()).then_some(host)
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    fn with(name: header::HeaderName, value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(name, HeaderValue::from_str(value).unwrap());
        headers
    }

    #[test]
    fn only_json_or_no_label_is_read() {
        for json in ["application/json", "Application/JSON; charset=utf-8"] {
            assert_eq!(
                not_json(&Method::POST, &with(header::CONTENT_TYPE, json)),
                None
            );
        }
        assert_eq!(not_json(&Method::POST, &HeaderMap::new()), None);
        for other in [
            "text/plain",
            "text/plain;charset=UTF-8",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "application/jsonx",
            "",
        ] {
            let why = not_json(&Method::POST, &with(header::CONTENT_TYPE, other))
                .unwrap_or_else(|| panic!("{other:?} was read"));
            assert!(why.contains("Content-Type: application/json"), "{why}");
        }
        let text = with(header::CONTENT_TYPE, "text/plain");
        assert_eq!(not_json(&Method::GET, &text), None);
    }

    #[test]
    fn the_machines_own_origins_pass_and_every_other_is_foreign() {
        let loopback: IpAddr = "127.0.0.1".parse().unwrap();
        let lan: IpAddr = "192.168.1.5".parse().unwrap();
        let any: IpAddr = "0.0.0.0".parse().unwrap();
        let foreign = |origin: &str, bound: IpAddr| {
            foreign_origin(&with(header::ORIGIN, origin), bound).is_some()
        };
        for own in [
            "http://127.0.0.1:8000",
            "http://localhost:3000",
            "https://LOCALHOST",
            "http://127.8.9.1",
            "http://[::1]:8000",
            "http://[::ffff:127.0.0.1]",
        ] {
            for bound in [loopback, lan, any] {
                assert!(!foreign(own, bound), "{own} on {bound}");
            }
        }
        assert!(!foreign("http://192.168.1.5:8000", lan));
        assert!(foreign("http://192.168.1.5:8000", loopback));
        assert!(foreign("http://0.0.0.0:8000", any));
        for other in [
            "https://evil.example",
            "http://localhost.evil.example",
            "http://127.0.0.1.evil.example",
            "null",
            "http://[::1",
            "http://[::1]x",
            "localhost",
        ] {
            assert!(foreign(other, loopback), "{other}");
        }
        assert_eq!(foreign_origin(&HeaderMap::new(), loopback), None);
    }

    #[test]
    fn a_page_cannot_drive_a_tokenless_server() {
        let server = crate::testing::TestServer::policy();
        let act = r#"{"observations": [[0, 0.1, 0, -0.1]]}"#;
        // What a page's form or `fetch` with a string body sends, unasked.
        for label in [
            "Content-Type: text/plain;charset=UTF-8",
            "Content-Type: application/x-www-form-urlencoded",
        ] {
            let (status, body) = server.request_with("POST", "/v1/act", &[label], act);
            assert_eq!(status, 415, "{label}: {body}");
            assert!(
                body.contains("send Content-Type: application/json"),
                "{body}"
            );
        }
        let page = "Origin: https://evil.example";
        let (status, body) = server.request_with(
            "POST",
            "/v1/act",
            &[page, "Content-Type: application/json"],
            act,
        );
        assert_eq!(status, 403, "{body}");
        assert!(
            body.contains("evil.example") && body.contains("is not this machine"),
            "{body}"
        );
        let (status, _) = server.request_with("GET", "/metrics", &[page], "");
        assert_eq!(status, 403);
        // The machine's own pages, and clients that are no page, are served.
        for headers in [
            &[
                "Origin: http://localhost:3000",
                "Content-Type: application/json",
            ][..],
            &["Content-Type: application/json; charset=utf-8"],
            &[],
        ] {
            let (status, body) = server.request_with("POST", "/v1/act", headers, act);
            assert_eq!(status, 200, "{headers:?}: {body}");
        }
    }
}
