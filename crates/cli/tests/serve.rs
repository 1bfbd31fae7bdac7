//! `qforge serve` as a real process on a loopback port, spoken to over raw
//! HTTP/1.1: bad requests get clear 4xx errors; the bearer token is
//! enforced; random bodies, slow, idle and flooding clients and pages of
//! other origins break nothing; SIGTERM stops it cleanly. A policy's
//! answers and rollouts are tested in `serve_policy.rs`, a language
//! model's in `serve_language.rs`.

#[path = "support/server.rs"]
mod server;
mod support;

use std::io::Write;
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use server::{Server, cartpole, read_until, read_until_closed};

#[test]
fn bad_requests_get_clear_errors_and_the_token_is_enforced() {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/policies/cartpole");
    let server = Server::start(
        &model,
        &["--max-rows", "8", "--max-body-bytes", "2000"],
        Some("s3cret"),
    );
    let auth = "Authorization: Bearer s3cret";
    let ok = r#"{"observations": [[0.0, 0.1, 0.0, -0.1]]}"#;
    assert_eq!(server.request("POST", "/v1/act", &[], ok).0, 401);
    assert_eq!(
        server
            .request("POST", "/v1/act", &["Authorization: Bearer wrong"], ok)
            .0,
        401
    );
    let (status, _, body) = server.request("POST", "/v1/act", &[auth], ok);
    assert_eq!(status, 200, "{body}");

    for (body, status, needle) in [
        ("not json", 400, "expected {"),
        (r#"{"observations": []}"#, 400, "empty"),
        (r#"{"observations": [[1, 2, 3]]}"#, 400, "takes 4"),
        (
            r#"{"observations": [[1, 2, 3, 1e39]]}"#,
            400,
            "not a finite number",
        ),
        (
            r#"{"observations": [[1, 2, 3, 4]], "extra": 1}"#,
            400,
            "unknown field",
        ),
        (
            r#"{"observations": [[0,0,0,0],[0,0,0,0],[0,0,0,0],[0,0,0,0],[0,0,0,0],[0,0,0,0],[0,0,0,0],[0,0,0,0],[0,0,0,0]]}"#,
            413,
            "limit is 8",
        ),
        // The limit is checked while parsing: nothing after the ninth row
        // is read (here it is not even JSON).
        (
            r#"{"observations": [[0,0,0,0],[0,0,0,0],[0,0,0,0],[0,0,0,0],[0,0,0,0],[0,0,0,0],[0,0,0,0],[0,0,0,0],[0,0,0,0], !!!"#,
            413,
            "limit is 8",
        ),
    ] {
        let (got, _, text) = server.request("POST", "/v1/act", &[auth], body);
        assert_eq!(got, status, "{body}: {text}");
        assert!(text.contains(needle), "{body}: {text}");
    }
    // A body over --max-body-bytes is refused before it is parsed.
    let big = format!(r#"{{"observations": [[{}]]}}"#, vec!["0.5"; 1000].join(","));
    assert_eq!(server.request("POST", "/v1/act", &[auth], &big).0, 413);
    // Refusals before the handler runs are counted too.
    let (_, _, metrics) = server.request("GET", "/metrics", &[auth], "");
    assert!(
        metrics.contains("qforge_requests_total{endpoint=\"/v1/act\",status=\"413\"} 3"),
        "{metrics}"
    );
}

#[test]
fn the_token_guards_all_but_the_probes_and_is_checked_before_the_body() {
    let server = Server::start(&cartpole(), &[], Some("s3cret"));
    // The probes stay open; everything else needs the token.
    for target in ["/health", "/ready"] {
        assert_eq!(server.request("GET", target, &[], "").0, 200, "{target}");
    }
    for target in ["/metrics", "/openapi.json"] {
        let (status, head, _) = server.request("GET", target, &[], "");
        assert_eq!(status, 401, "{target}");
        assert!(
            head.to_lowercase().contains("www-authenticate: bearer"),
            "{head}"
        );
        assert_eq!(
            server
                .request("GET", target, &["Authorization: Bearer s3cre"], "")
                .0,
            401,
            "{target}"
        );
        // RFC 7235: the scheme's name is case-insensitive.
        for auth in [
            "Authorization: bearer s3cret",
            "Authorization: BEARER s3cret",
        ] {
            assert_eq!(server.request("GET", target, &[auth], "").0, 200, "{auth}");
        }
    }
    let ok = r#"{"reward": 1}"#;
    assert_eq!(server.post("/v1/feedback", &[], ok).0, 401);
    // A request without the token is refused on its head: the server
    // neither reads nor waits for the 1 000 bytes it announces.
    let mut stream = server.connect();
    stream
        .write_all(
            b"POST /v1/act HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n",
        )
        .unwrap();
    let answer = read_until_closed(&mut stream, "a request with the wrong token");
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
}

#[test]
fn random_bodies_never_break_the_server() {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/policies/cartpole");
    let server = Server::start(&model, &["--max-body-bytes", "65536"], None);
    let mut rng = StdRng::seed_from_u64(7);
    let number = |rng: &mut StdRng| -> String {
        match rng.random_range(0..6) {
            0 => "1e999".into(),
            1 => "-0".into(),
            2 => "null".into(),
            3 => "\"x\"".into(),
            _ => format!("{}", rng.random_range(-1e6..1e6f64)),
        }
    };
    for case in 0..300 {
        let body = match case % 4 {
            // Raw bytes, valid UTF-8 only so the request line stays intact.
            0 => (0..rng.random_range(0..200))
                .map(|_| char::from(rng.random_range(32u8..127)))
                .collect::<String>(),
            // Observations of random widths and contents.
            1 | 2 => {
                let rows: Vec<String> = (0..rng.random_range(0..6))
                    .map(|_| {
                        let width = rng.random_range(0..7);
                        let values: Vec<String> = (0..width).map(|_| number(&mut rng)).collect();
                        format!("[{}]", values.join(","))
                    })
                    .collect();
                format!(r#"{{"observations": [{}]}}"#, rows.join(","))
            }
            // Other shapes of JSON.
            _ => [
                "[]",
                "{}",
                "null",
                r#"{"observations": 3}"#,
                r#"{"observations": [3]}"#,
                "\"\"",
            ][rng.random_range(0..6)]
            .to_owned(),
        };
        let (status, _, text) = server.request("POST", "/v1/act", &[], &body);
        assert!(
            [200, 400, 413].contains(&status),
            "{body:?} → {status} {text}"
        );
    }
    assert_eq!(server.request("GET", "/health", &[], "").0, 200);
}

/// A slowloris client: sends a request line, then one byte of a header
/// that never ends every 100 ms, until the server closes the connection.
/// (The pace is the attack's, not a wait the test decides on.)
fn trickle(mut stream: TcpStream) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        if stream
            .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Trickle: ")
            .is_err()
        {
            return;
        }
        while stream.write_all(b"a").is_ok() {
            std::thread::sleep(Duration::from_millis(100));
        }
    })
}

/// Sends the head of a POST to /v1/act with `Expect: 100-continue` and the
/// first bytes of a 100-byte body, and waits for the server's `100
/// Continue`: from then on the request is in flight on the server.
fn start_slow_act(server: &Server) -> TcpStream {
    let mut stream = server.connect();
    stream
        .write_all(
            b"POST /v1/act HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\nExpect: 100-continue\r\n\r\n",
        )
        .unwrap();
    read_until(&mut stream, "100 Continue\r\n\r\n", "a request in flight");
    stream.write_all(b"{\"observations\": ").unwrap();
    stream
}

#[test]
fn a_client_trickling_its_head_is_cut_off_at_the_header_timeout() {
    let server = Server::start(
        &cartpole(),
        &[
            "--header-timeout-ms",
            "1000",
            "--keep-alive-timeout-ms",
            "600000",
        ],
        None,
    );
    let mut stream = server.connect();
    let client = trickle(stream.try_clone().unwrap());
    read_until_closed(&mut stream, "a client trickling its head");
    client.join().unwrap();
    assert_eq!(
        server.metric("qforge_connections_closed_total{reason=\"header_timeout\"}"),
        Some(1.0)
    );
    assert_eq!(server.request("GET", "/health", &[], "").0, 200);
}

#[test]
fn idle_connections_are_closed_after_the_keep_alive_timeout() {
    let server = Server::start(
        &cartpole(),
        &[
            "--keep-alive-timeout-ms",
            "500",
            "--header-timeout-ms",
            "600000",
        ],
        None,
    );
    // A connection that never sends anything.
    let mut silent = server.connect();
    read_until_closed(&mut silent, "a connection that never sent a byte");
    // A keep-alive connection after its answer.
    let mut kept = server.connect();
    kept.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    read_until(&mut kept, "{\"status\":\"ok\"}", "the answer");
    read_until_closed(&mut kept, "a keep-alive connection after its answer");
    assert_eq!(
        server.metric("qforge_connections_closed_total{reason=\"idle_timeout\"}"),
        Some(2.0)
    );
}

#[test]
fn a_body_that_does_not_arrive_in_time_gets_408() {
    let server = Server::start(&cartpole(), &["--body-timeout-ms", "1000"], None);
    let mut stream = server.connect();
    stream
        .write_all(
            b"POST /v1/act HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"observations\": ",
        )
        .unwrap();
    let answer = read_until_closed(&mut stream, "a body that stopped half-way");
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("did not arrive within 1000 ms"), "{answer}");
}

#[test]
fn at_the_connection_cap_idle_connections_make_room_and_busy_ones_refuse() {
    let server = Server::start(
        &cartpole(),
        &[
            "--max-connections",
            "4",
            "--body-timeout-ms",
            "600000",
            "--keep-alive-timeout-ms",
            "600000",
            "--header-timeout-ms",
            "600000",
        ],
        None,
    );
    // Four idle connections fill the cap; a fifth closes the oldest and is
    // answered (the kernel hands connections over in the order they came).
    let mut idle: Vec<TcpStream> = (0..4).map(|_| server.connect()).collect();
    assert_eq!(server.request("GET", "/health", &[], "").0, 200);
    read_until_closed(&mut idle[0], "the oldest idle connection");
    drop(idle);

    // Four requests in flight: nothing to close, so a fifth gets 503.
    let server = Server::start(
        &cartpole(),
        &["--max-connections", "4", "--body-timeout-ms", "600000"],
        None,
    );
    let busy: Vec<TcpStream> = (0..4).map(|_| start_slow_act(&server)).collect();
    let mut refused = server.connect();
    refused
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let answer = read_until_closed(&mut refused, "a connection beyond the cap");
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 503"),
        "{answer}"
    );
    // Every request in flight still finishes.
    let observation = b"[[0.0, 0.1, 0.0, -0.1]]}";
    for mut stream in busy {
        let pad = 100 - b"{\"observations\": ".len() - observation.len();
        stream.write_all(observation).unwrap();
        stream.write_all(&vec![b' '; pad]).unwrap();
        let answer = read_until(&mut stream, "\"actions\"", "a request in flight");
        assert!(answer.contains("200 OK"), "{answer}");
    }
    assert_eq!(
        server.metric("qforge_connections_closed_total{reason=\"refused\"}"),
        Some(1.0)
    );
}

#[test]
fn a_flood_of_idle_connections_at_a_low_descriptor_limit_locks_nobody_out() {
    use std::os::unix::process::CommandExt;
    let mut command = Server::command(&cartpole(), &[], None);
    // SAFETY: setrlimit is async-signal-safe and touches only the child.
    unsafe {
        command.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: 256,
                rlim_max: 256,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    let server = Server::launch(command);
    // More idle connections than the server may hold descriptors.
    let flood: Vec<TcpStream> = (0..320).map(|_| server.connect()).collect();
    let (status, _, body) = server.request("GET", "/health", &[], "");
    assert_eq!(status, 200, "{body}");
    let (status, v) = server.act(r#"{"observations": [[0.0, 0.1, 0.0, -0.1]]}"#);
    assert_eq!(status, 200, "{v}");
    drop(flood);
}

#[test]
fn sigterm_stops_the_server_within_the_drain_bound_while_clients_trickle() {
    let mut server = Server::start(
        &cartpole(),
        &[
            "--shutdown-timeout-ms",
            "3000",
            "--header-timeout-ms",
            "600000",
            "--body-timeout-ms",
            "600000",
            "--keep-alive-timeout-ms",
            "600000",
        ],
        None,
    );
    let tricklers: Vec<_> = (0..3).map(|_| trickle(server.connect())).collect();
    // One request in flight that will finish, one that never will.
    let mut finishing = start_slow_act(&server);
    let mut stuck = start_slow_act(&server);
    Command::new("kill")
        .args(["-TERM", &server.child.id().to_string()])
        .status()
        .unwrap();
    // The request in flight still gets its answer.
    let observation = b"[[0.0, 0.1, 0.0, -0.1]]}";
    let pad = 100 - b"{\"observations\": ".len() - observation.len();
    finishing.write_all(observation).unwrap();
    finishing.write_all(&vec![b' '; pad]).unwrap();
    let answer = read_until_closed(&mut finishing, "a request in flight at SIGTERM");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    // The one that never finishes is cut at the drain bound, the trickling
    // clients at once, and the server exits.
    let status = server.wait_exit("the server to exit after SIGTERM");
    assert!(status.success(), "{status}");
    read_until_closed(&mut stuck, "a request still in flight at the drain bound");
    for t in tricklers {
        t.join().unwrap();
    }
}

#[test]
fn unknown_paths_get_404_and_are_counted() {
    let server = Server::start(&cartpole(), &[], None);
    for target in ["/nope", "/v1/act/../../etc/passwd", "/v1/%00", "/v2/act"] {
        let (status, _, body) = server.request("GET", target, &[], "");
        assert_eq!(status, 404, "{target}: {body}");
        assert!(body.contains("no such endpoint"), "{body}");
    }
    // One fixed label, whatever the path: a scanner cannot grow the metrics.
    assert_eq!(
        server.metric("qforge_requests_total{endpoint=\"unmatched\",status=\"404\"}"),
        Some(4.0)
    );
}

/// Sends `request` (head and body, as written) and reads the answer.
fn raw(server: &Server, request: &str) -> String {
    let mut stream = server.connect();
    stream.write_all(request.as_bytes()).unwrap();
    read_until_closed(&mut stream, request)
}

#[test]
fn a_web_page_cannot_drive_a_server_without_a_token() {
    let act = r#"{"observations": [[0, 0.1, 0, -0.1]]}"#;
    let post = |target: &str, headers: &str, body: &str| {
        format!(
            "POST {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    let open = Server::start(&cartpole(), &[], None);
    // What a page's form or `fetch` of a string posts without a preflight.
    for kind in [
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
    ] {
        let answer = raw(
            &open,
            &post("/v1/act", &format!("Content-Type: {kind}\r\n"), act),
        );
        assert!(answer.starts_with("HTTP/1.1 415"), "{kind}: {answer}");
        assert!(
            answer.contains("send Content-Type: application/json"),
            "{answer}"
        );
    }
    // A page's script sending JSON carries its Origin.
    let page = "Origin: https://attacker.example\r\nContent-Type: application/json\r\n";
    for (target, body) in [("/v1/act", act), ("/v1/feedback", r#"{"reward": 0}"#)] {
        let answer = raw(&open, &post(target, page, body));
        assert!(answer.starts_with("HTTP/1.1 403"), "{target}: {answer}");
        assert!(answer.contains("QFORGE_SERVE_TOKEN"), "{answer}");
    }
    let local = "Origin: http://127.0.0.1:5173\r\nContent-Type: application/json\r\n";
    assert!(raw(&open, &post("/v1/act", local, act)).starts_with("HTTP/1.1 200"));
    // With a token a page has nothing to send: any Origin that has the
    // token is served, and the content type is still checked.
    let guarded = Server::start(&cartpole(), &[], Some("s3cret"));
    let bearer = "Authorization: Bearer s3cret\r\n";
    let answer = raw(&guarded, &post("/v1/act", &format!("{bearer}{page}"), act));
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let plain = format!("{bearer}Content-Type: text/plain\r\n");
    assert!(raw(&guarded, &post("/v1/act", &plain, act)).starts_with("HTTP/1.1 415"));
}
