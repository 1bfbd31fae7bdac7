//! The `qforge serve` process the serve tests speak to over raw HTTP/1.1,
//! and what the test files share: waiting for a condition, the CartPole
//! fixture, the model version an answer names, reading a connection.

// Each test binary uses its own part of this module.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

/// Waits for `condition` (polled every 20 ms), failing after a deadline
/// generous enough for a machine whose cores are all busy.
pub fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(180);
    while !condition() {
        assert!(
            std::time::Instant::now() < deadline,
            "gave up waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub struct Server {
    pub child: Child,
    pub addr: String,
}

impl Server {
    pub fn start(model: &Path, extra: &[&str], token: Option<&str>) -> Server {
        Server::launch(Server::command(model, extra, token))
    }

    /// `qforge serve` of `model` on a free loopback port.
    pub fn command(model: &Path, extra: &[&str], token: Option<&str>) -> Command {
        let mut command = Command::new(env!("CARGO_BIN_EXE_qforge"));
        command
            .args([
                "serve",
                "--model",
                model.to_str().unwrap(),
                "--addr",
                "127.0.0.1:0",
            ])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        // A loaded machine (CI runs the suites side by side on two cores)
        // can take longer than the default 10 s to answer; only the test of
        // the timeout itself sets one.
        if !extra.contains(&"--timeout-ms") {
            command.args(["--timeout-ms", "300000"]);
        }
        if let Some(token) = token {
            command.env("QFORGE_SERVE_TOKEN", token);
        }
        command
    }

    /// Starts `command` and waits until it listens.
    pub fn launch(mut command: Command) -> Server {
        let mut child = command.spawn().unwrap();
        let mut stderr = BufReader::new(child.stderr.take().unwrap());
        let mut seen = String::new();
        let addr = loop {
            let mut line = String::new();
            if stderr.read_line(&mut line).unwrap() == 0 {
                panic!("the server stopped before listening: {seen}");
            }
            if let Some(addr) = line.split("http://").nth(1) {
                break addr.trim().to_owned();
            }
            seen.push_str(&line);
        };
        // Keep draining stderr so the server never blocks on a full pipe.
        std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
        Server { child, addr }
    }

    /// One request; returns the status, the headers and the body.
    pub fn request(
        &self,
        method: &str,
        target: &str,
        headers: &[&str],
        body: &str,
    ) -> (u16, String, String) {
        let mut stream = TcpStream::connect(&self.addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(300)))
            .unwrap();
        let mut request = format!(
            "{method} {target} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
            self.addr,
            body.len()
        );
        for h in headers {
            request.push_str(h);
            request.push_str("\r\n");
        }
        request.push_str("\r\n");
        stream.write_all(request.as_bytes()).unwrap();
        stream.write_all(body.as_bytes()).unwrap();
        let mut response = String::new();
        // The server may close early on an oversized body; read what came.
        let _ = stream.read_to_string(&mut response);
        let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no status in {head:?}"));
        (status, head.to_owned(), body.to_owned())
    }

    pub fn act(&self, body: &str) -> (u16, Value) {
        self.post("/v1/act", &[], body)
    }

    pub fn post(&self, target: &str, headers: &[&str], body: &str) -> (u16, Value) {
        let (status, _, body) = self.request("POST", target, headers, body);
        (status, serde_json::from_str(&body).unwrap_or(Value::Null))
    }

    /// The value of the metric line starting with `name ` (labels included).
    pub fn metric(&self, name: &str) -> Option<f64> {
        let (_, _, text) = self.request("GET", "/metrics", &[], "");
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .map(|v| v.trim().parse().unwrap())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The model version a response's headers name (`X-Qforge-Model-Version`).
pub fn model_version(head: &str) -> u64 {
    head.lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("x-qforge-model-version: ")
                .map(|v| v.trim().parse().unwrap())
        })
        .unwrap_or_else(|| panic!("no version header in {head}"))
}

/// The CartPole policy directory, which serves without quantizing.
pub fn cartpole() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/policies/cartpole")
}

/// How long a test waits for the server to act on a connection before it
/// calls the server stuck: generous, for a machine whose cores are busy.
pub const CONNECTION_DEADLINE: Duration = Duration::from_secs(120);

impl Server {
    pub fn connect(&self) -> TcpStream {
        let stream = TcpStream::connect(&self.addr).unwrap();
        // Short reads, so a waiting test checks its deadline often.
        stream
            .set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        stream
    }

    /// Waits until the process exits; its status.
    pub fn wait_exit(&mut self, what: &str) -> std::process::ExitStatus {
        let mut status = None;
        wait_until(what, || {
            status = self.child.try_wait().unwrap();
            status.is_some()
        });
        status.unwrap()
    }
}

/// Reads `stream` until what arrived contains `needle`; what arrived.
pub fn read_until(stream: &mut TcpStream, needle: &str, what: &str) -> String {
    read_stream(stream, Some(needle), what)
}

/// Reads `stream` until the server closes it (a reset is a close too);
/// what it sent before. Panics when the server keeps it open past the
/// deadline.
pub fn read_until_closed(stream: &mut TcpStream, what: &str) -> String {
    read_stream(stream, None, what)
}

/// Reads `stream` until what arrived contains `needle`, or with no needle
/// until the server closes it.
fn read_stream(stream: &mut TcpStream, needle: Option<&str>, what: &str) -> String {
    let deadline = std::time::Instant::now() + CONNECTION_DEADLINE;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while needle.is_none_or(|needle| !String::from_utf8_lossy(&got).contains(needle)) {
        let sent = |got: &[u8]| String::from_utf8_lossy(got).into_owned();
        match (stream.read(&mut buf), needle) {
            (Err(e), _)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                let waiting = match needle {
                    Some(needle) => format!("no {needle:?} yet"),
                    None => "the server kept the connection open".to_owned(),
                };
                assert!(
                    std::time::Instant::now() < deadline,
                    "{what}: {waiting}; it sent {:?}",
                    sent(&got)
                );
            }
            (Ok(0) | Err(_), None) => break,
            (Ok(0), Some(needle)) => {
                panic!("{what}: closed before {needle:?}; it sent {:?}", sent(&got))
            }
            (Ok(n), _) => got.extend_from_slice(&buf[..n]),
            (Err(e), Some(_)) => panic!("{what}: {e}"),
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}
