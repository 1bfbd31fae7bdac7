//! A real `redis-server` for tests: started on a free loopback port with AOF
//! persistence (`appendfsync everysec`, as the deploy docs recommend), in its
//! own directory, killed when dropped. Shared by the dist and CLI tests.

#![allow(dead_code)] // each test crate uses a different subset

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct RedisServer {
    child: Option<Child>,
    pub port: u16,
    dir: PathBuf,
    password: Option<String>,
}

impl RedisServer {
    /// Starts a server, or returns `None` (printing SKIPPED) when
    /// `redis-server` is not installed, except under CI, where that fails.
    pub fn start(name: &str, password: Option<&str>) -> Option<Self> {
        if Command::new("redis-server")
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .is_err()
        {
            assert!(
                std::env::var_os("CI").is_none(),
                "redis-server is not installed; scripts/test.sh installs it"
            );
            eprintln!(
                "SKIPPED {name}: redis-server is not installed (scripts/test.sh installs it)"
            );
            return None;
        }
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free loopback port");
        let dir =
            std::env::temp_dir().join(format!("qforge-redis-{name}-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("redis dir");
        let mut server = Self {
            child: None,
            port,
            dir,
            password: password.map(str::to_owned),
        };
        server.restart();
        Some(server)
    }

    /// `redis://[:PASSWORD@]127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        match &self.password {
            Some(p) => format!("redis://:{p}@127.0.0.1:{}", self.port),
            None => format!("redis://127.0.0.1:{}", self.port),
        }
    }

    /// The URL without the password.
    pub fn url_without_password(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// (Re)starts the server on the same port and data directory, and waits
    /// until it has loaded its AOF and answers.
    pub fn restart(&mut self) {
        let mut command = Command::new("redis-server");
        command
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--dir", self.dir.to_str().expect("utf-8 path")])
            .args([
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--save",
                "",
            ])
            .args(["--logfile", "redis.log"])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(p) = &self.password {
            command.args(["--requirepass", p]);
        }
        self.child = Some(command.spawn().expect("redis-server starts"));
        let client = redis::Client::open(self.url()).expect("url");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let ready = client
                .get_connection_with_timeout(Duration::from_millis(500))
                .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c));
            if ready.is_ok() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "redis-server did not start: {ready:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Sends `signal` (e.g. "TERM", "KILL") and waits for the process to end.
    pub fn stop(&mut self, signal: &str) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args([&format!("-{signal}"), &child.id().to_string()])
                .status();
            let _ = child.wait();
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop("KILL");
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
