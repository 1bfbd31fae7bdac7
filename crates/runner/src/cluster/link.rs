//! A Redis connection that survives a Redis restart and follows a Redis
//! Cluster's redirections.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use redis::{
    Client, Connection, ConnectionAddr, ConnectionInfo, IntoConnectionInfo, RedisError,
    RedisResult, ServerErrorKind,
};

use crate::error::{Error, Result};

/// The environment variable that may hold the Redis password.
pub const PASSWORD_VARIABLE: &str = "QFORGE_REDIS_PASSWORD";

/// A password file is a line, not a document.
const PASSWORD_FILE_LIMIT: u64 = 4096;

/// Longer than any `BLOCK` we issue, so a stopped (SIGSTOP) Redis is noticed.
const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// The shortest read timeout, under an outage limit shorter than
/// [`IO_TIMEOUT`]: still longer than any `BLOCK` we issue (250 ms).
const MIN_IO_TIMEOUT: Duration = Duration::from_secs(1);

/// The shortest wait for a connection, however little of the outage limit
/// is left.
const MIN_CONNECT_TIMEOUT: Duration = Duration::from_millis(100);

/// Redirections one command may follow in a row. A run's keys share a slot,
/// so a command is redirected once when the cluster's slots move and twice
/// while a slot migrates; more means its keys lie on several nodes.
const REDIRECT_LIMIT: usize = 5;

/// A Redis node: the one the URL names, or a Redis Cluster node that a
/// `MOVED` or `ASK` redirection named.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Node {
    Url,
    Redirected { host: String, port: u16 },
}

/// Connections, re-opened on I/O errors, retried until the outage lasts
/// longer than `outage_limit`. Against a Redis Cluster, commands go to the
/// node that serves their slot: the URL's node until a `MOVED` names
/// another, which is then kept (a run's keys share one slot); `qforge:active`
/// may live elsewhere, so a connection is kept per node.
pub(crate) struct Link {
    info: ConnectionInfo,
    connections: HashMap<Node, Connection>,
    node: Node,
    outage_limit: Duration,
    url: String,
    /// Times the connection was re-established after an outage.
    pub reconnects: usize,
}

/// Where Redis is: its URL and, kept out of the URL (and so out of `ps`
/// and of every message), an optional password. Prints redacted.
#[derive(Clone)]
pub struct RedisAddress {
    url: String,
    password: Option<String>,
}

impl RedisAddress {
    /// `url` is `redis://[[USER]:PASSWORD@]HOST:PORT[/DB]` or
    /// `redis+unix:///PATH[?db=N&user=U&pass=P]`; `password`, when given,
    /// must not also be in the URL.
    pub fn new(url: &str, password: Option<String>) -> Result<Self> {
        let info = url.into_connection_info().map_err(|e| {
            Error::Cluster(format!(
                "invalid cluster URL {}: {e}; expected redis://[:PASSWORD@]HOST:PORT or \
                 redis+unix:///PATH",
                redact(url)
            ))
        })?;
        if password.is_some() && info.redis_settings().password().is_some() {
            return Err(Error::Cluster(format!(
                "the Redis password is given twice, in the URL {} and in --redis-password-file or \
                 QFORGE_REDIS_PASSWORD; keep one (the file or the variable keeps it out of `ps`)",
                redact(url)
            )));
        }
        if password.as_deref() == Some("") {
            return Err(Error::Cluster("the Redis password is empty".into()));
        }
        Ok(Self {
            url: url.to_owned(),
            password,
        })
    }

    /// The Redis at `url` with the password from `password_file` (its first
    /// line) if given, else from the environment variable
    /// [`PASSWORD_VARIABLE`] if set: either keeps the password out of the URL
    /// and of `ps`.
    pub fn with_password_from(url: &str, password_file: Option<&Path>) -> Result<Self> {
        let password = match password_file {
            Some(path) => Some(read_password_file(path)?),
            None => match std::env::var(PASSWORD_VARIABLE) {
                Ok(p) if !p.is_empty() => Some(p),
                Ok(_) | Err(std::env::VarError::NotPresent) => None,
                Err(std::env::VarError::NotUnicode(_)) => {
                    return Err(Error::Cluster(format!(
                        "{PASSWORD_VARIABLE} is not valid UTF-8"
                    )));
                }
            },
        };
        Self::new(url, password)
    }

    fn connection_info(&self) -> Result<ConnectionInfo> {
        let mut info = self
            .url
            .as_str()
            .into_connection_info()
            .map_err(|e| Error::Cluster(format!("invalid cluster URL {self}: {e}")))?;
        if let Some(password) = &self.password {
            let settings = info.redis_settings().clone().set_password(password);
            info = info.set_redis_settings(settings);
        }
        Ok(info)
    }
}

/// The first line of a password file (a trailing newline is not part of
/// the password).
fn read_password_file(path: &Path) -> Result<String> {
    let refuse =
        |why: String| Error::Cluster(format!("--redis-password-file {}: {why}", path.display()));
    let file = std::fs::File::open(path).map_err(|e| refuse(e.to_string()))?;
    let metadata = file.metadata().map_err(|e| refuse(e.to_string()))?;
    if !metadata.is_file() {
        return Err(refuse("not a regular file".into()));
    }
    if metadata.len() > PASSWORD_FILE_LIMIT {
        return Err(refuse(format!(
            "{} bytes; a password file holds one line (at most {PASSWORD_FILE_LIMIT} bytes)",
            metadata.len()
        )));
    }
    let text = std::io::read_to_string(file).map_err(|e| refuse(e.to_string()))?;
    let password = text.lines().next().unwrap_or("");
    if password.is_empty() {
        return Err(refuse("its first line is empty".into()));
    }
    Ok(password.to_owned())
}

impl std::fmt::Display for RedisAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&redact(&self.url))
    }
}

impl std::fmt::Debug for RedisAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RedisAddress({self})")
    }
}

/// The URL with every password blanked, for messages: the user-info's
/// (`redis://:P@host`) and the `pass`/`password` query parameters
/// (`redis+unix:///path?pass=P`).
fn redact(url: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let mut out = match (base.find("://"), base.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}***{}", &base[..scheme + 3], &base[at..])
        }
        _ => base.to_owned(),
    };
    if let Some(query) = query {
        let parameters: Vec<String> = query
            .split('&')
            .map(|p| match p.split_once('=') {
                Some((key, _))
                    if key.eq_ignore_ascii_case("pass") || key.eq_ignore_ascii_case("password") =>
                {
                    format!("{key}=***")
                }
                _ => p.to_owned(),
            })
            .collect();
        out = format!("{out}?{}", parameters.join("&"));
    }
    out
}

/// Errors that pass: the server is unreachable or loading, or a Redis
/// Cluster is electing a new master or moving a slot.
fn transient(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || matches!(e.code(), Some("LOADING" | "TRYAGAIN" | "CLUSTERDOWN"))
}

/// Where a Redis Cluster sends a command that reached the wrong node:
/// the node, and whether only this command goes there (`ASK`: its slot is
/// migrating) rather than every later one (`MOVED`). A transaction or
/// pipeline carries its commands' errors inside its own.
fn redirection(e: &RedisError) -> Option<(String, u16, bool)> {
    e.clone()
        .into_server_errors()?
        .iter()
        .find_map(|(_, error)| {
            let ask = match error.kind()? {
                ServerErrorKind::Moved => false,
                ServerErrorKind::Ask => true,
                _ => return None,
            };
            // `SLOT HOST:PORT`
            let (host, port) = error
                .details()?
                .split_ascii_whitespace()
                .nth(1)?
                .rsplit_once(':')?;
            Some((host.to_owned(), port.parse().ok()?, ask))
        })
}

impl Link {
    /// Connects and checks that Redis answers (and accepts the password).
    pub(crate) fn open(address: &RedisAddress, outage_limit: Duration) -> Result<Self> {
        let mut link = Self {
            info: address.connection_info()?,
            connections: HashMap::new(),
            node: Node::Url,
            outage_limit,
            url: address.to_string(),
            reconnects: 0,
        };
        link.call(|c| redis::cmd("PING").query::<String>(c))?;
        Ok(link)
    }

    fn explain(&self, e: &RedisError) -> Error {
        let text = e.to_string();
        if text.contains("WRONGPASS") || text.contains("NOAUTH") || text.contains("uthentication") {
            Error::Cluster(format!(
                "Redis at {} refused the credentials ({e}); give the password in QFORGE_REDIS_PASSWORD, in a file named by --redis-password-file, or in the URL (redis://[USER]:PASSWORD@HOST:PORT)",
                self.url
            ))
        } else if transient(e) {
            Error::Cluster(format!(
                "Redis at {} unreachable for more than {:.0} s ({e}); check that it runs, or raise the outage limit",
                self.url,
                self.outage_limit.as_secs_f64()
            ))
        } else {
            Error::Cluster(format!("Redis at {}: {e}", self.url))
        }
    }

    /// Runs `command`, reconnecting and retrying while Redis is unreachable
    /// (up to the outage limit), and following a Redis Cluster's
    /// redirections. A retried command may have run already; every caller
    /// is idempotent or deduplicated downstream.
    ///
    /// The outage is counted from the start of the call, the last moment
    /// Redis was known to answer, and no attempt waits past the limit: a
    /// frozen server otherwise cost a read timeout before the count began
    /// and another after it ended (`--outage-limit 5` gave up after 10.5 s).
    pub(crate) fn call<T>(
        &mut self,
        mut command: impl FnMut(&mut Connection) -> RedisResult<T>,
    ) -> Result<T> {
        let started = Instant::now();
        let mut down = false;
        let mut pause = Duration::from_millis(50);
        let mut redirects = 0;
        let mut asked: Option<Node> = None;
        loop {
            let (node, asking) = match asked.take() {
                Some(node) => (node, true),
                None => (self.node.clone(), false),
            };
            let budget = self.outage_limit.saturating_sub(started.elapsed());
            let attempt = self.connection(&node, down, budget).and_then(|c| {
                if asking {
                    redis::cmd("ASKING").query::<()>(c)?;
                }
                command(c)
            });
            let e = match attempt {
                Ok(value) => {
                    let timeout = Some(self.io_timeout());
                    if down && let Some(connection) = self.connections.get_mut(&node) {
                        // Best effort: a socket that refuses keeps the shorter
                        // timeout, which errs toward noticing an outage.
                        let _ = connection
                            .set_read_timeout(timeout)
                            .and_then(|()| connection.set_write_timeout(timeout));
                    }
                    return Ok(value);
                }
                Err(e) => e,
            };
            if let Some((host, port, ask)) = redirection(&e) {
                redirects += 1;
                if redirects > REDIRECT_LIMIT {
                    return Err(Error::Cluster(format!(
                        "Redis at {} redirected a command {REDIRECT_LIMIT} times ({e}): its keys \
                         are on several Redis Cluster nodes, or the cluster's slots keep moving",
                        self.url
                    )));
                }
                // An empty host is the answering node's.
                let host = match (host.is_empty(), &node, self.info.addr()) {
                    (false, _, _) => host,
                    (true, Node::Redirected { host, .. }, _) => host.clone(),
                    (true, Node::Url, ConnectionAddr::Tcp(url_host, _)) => url_host.clone(),
                    (true, Node::Url, _) => {
                        return Err(Error::Cluster(format!(
                            "Redis at {} redirected a command to port {port} without naming \
                             the host; give the cluster's URL as redis://HOST:PORT",
                            self.url
                        )));
                    }
                };
                let target = Node::Redirected { host, port };
                if ask {
                    asked = Some(target);
                } else {
                    self.node = target;
                }
            } else if transient(&e) {
                // The URL's node answers again, or names a promoted master.
                // Until the cluster sees the failure, it may name the dead
                // one: that is part of the outage, not a redirection loop.
                self.connections.remove(&node);
                self.node = Node::Url;
                redirects = 0;
                down = true;
                let left = self.outage_limit.saturating_sub(started.elapsed());
                if left.is_zero() {
                    return Err(self.explain(&e));
                }
                std::thread::sleep(pause.min(left));
                pause = (pause * 2).min(Duration::from_millis(500));
            } else {
                return Err(self.explain(&e));
            }
        }
    }

    /// How long a read or write waits: [`IO_TIMEOUT`], or the outage limit
    /// if shorter, but never less than [`MIN_IO_TIMEOUT`].
    fn io_timeout(&self) -> Duration {
        IO_TIMEOUT.min(self.outage_limit).max(MIN_IO_TIMEOUT)
    }

    /// The open connection to `node`, opened if need be, within `budget`
    /// (`after_outage`: count it as a reconnection). Reads and writes time
    /// out after [`Link::io_timeout`], or within `budget` after an outage.
    fn connection(
        &mut self,
        node: &Node,
        after_outage: bool,
        budget: Duration,
    ) -> RedisResult<&mut Connection> {
        if !self.connections.contains_key(node) {
            let info = match node {
                Node::Url => self.info.clone(),
                Node::Redirected { host, port } => self
                    .info
                    .clone()
                    .set_addr(ConnectionAddr::Tcp(host.clone(), *port)),
            };
            let io_timeout = self.io_timeout();
            let connect_timeout = budget.clamp(MIN_CONNECT_TIMEOUT, io_timeout);
            let connection = Client::open(info)?.get_connection_with_timeout(connect_timeout)?;
            // Mid-outage, a server that accepts and never answers (stopped,
            // or a hung host whose kernel still completes handshakes) must
            // not hold the command past the limit either; the timeouts go
            // back to normal once it answers (`Link::call`).
            let timeout = if after_outage {
                budget.clamp(MIN_IO_TIMEOUT, io_timeout)
            } else {
                io_timeout
            };
            connection.set_read_timeout(Some(timeout))?;
            connection.set_write_timeout(Some(timeout))?;
            if after_outage {
                self.reconnects += 1;
            }
            self.connections.insert(node.clone(), connection);
        }
        Ok(self.connections.get_mut(node).expect("just opened"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact("redis://:s3cret@10.0.0.1:6379"),
            "redis://***@10.0.0.1:6379"
        );
        assert_eq!(redact("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
        assert_eq!(
            redact("redis+unix:///run/redis.sock?db=2&pass=s3cret&user=q"),
            "redis+unix:///run/redis.sock?db=2&pass=***&user=q"
        );
        assert_eq!(
            redact("unix:///run/r.sock?PASSWORD=a@b"),
            "unix:///run/r.sock?PASSWORD=***"
        );
        let address = RedisAddress::new("redis://:s3cret@10.0.0.1:6379", None).unwrap();
        assert_eq!(
            format!("{address} {address:?}").matches("s3cret").count(),
            0
        );
    }

    #[test]
    fn a_password_comes_from_the_url_or_beside_it_never_both() {
        let beside = RedisAddress::new("redis://10.0.0.1:6379", Some("s3cret".into())).unwrap();
        assert_eq!(
            beside
                .connection_info()
                .unwrap()
                .redis_settings()
                .password(),
            Some("s3cret")
        );
        assert!(!format!("{beside:?}").contains("s3cret"));
        let err = RedisAddress::new("redis://:a@10.0.0.1:6379", Some("b".into()))
            .unwrap_err()
            .to_string();
        assert!(err.contains("given twice") && !err.contains(":a@"), "{err}");
        let err = RedisAddress::new("nonsense://x?pass=hidden", None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("invalid cluster URL") && !err.contains("hidden"),
            "{err}"
        );
    }
}
