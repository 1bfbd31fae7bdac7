//! A Redis connection that survives a Redis restart.

use std::time::{Duration, Instant};

use redis::{Client, Connection, RedisError, RedisResult};

use crate::error::{Error, Result};

/// Longer than any `BLOCK` we issue, so a stopped (SIGSTOP) Redis is noticed.
const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// One connection, re-opened on I/O errors, retried until the outage lasts
/// longer than `outage_limit`.
pub(crate) struct Link {
    client: Client,
    connection: Option<Connection>,
    outage_limit: Duration,
    url: String,
    /// Times the connection was re-established after an outage.
    pub reconnects: usize,
}

/// The URL with any password blanked, for messages.
pub(crate) fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}***{}", &url[..scheme + 3], &url[at..])
        }
        _ => url.to_owned(),
    }
}

fn transient(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || e.code() == Some("LOADING")
}

impl Link {
    /// Connects and checks that Redis answers (and accepts the password).
    pub(crate) fn open(url: &str, outage_limit: Duration) -> Result<Self> {
        let client = Client::open(url).map_err(|e| {
            Error::Cluster(format!(
                "invalid cluster URL {}: {e}; expected redis://[:PASSWORD@]HOST:PORT",
                redact(url)
            ))
        })?;
        let mut link = Self {
            client,
            connection: None,
            outage_limit,
            url: redact(url),
            reconnects: 0,
        };
        link.call(|c| redis::cmd("PING").query::<String>(c))?;
        Ok(link)
    }

    fn explain(&self, e: &RedisError) -> Error {
        let text = e.to_string();
        if text.contains("WRONGPASS") || text.contains("NOAUTH") || text.contains("uthentication") {
            Error::Cluster(format!(
                "Redis at {} refused the credentials ({e}); put them in the URL: redis://:PASSWORD@HOST:PORT or redis://USER:PASSWORD@HOST:PORT",
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
    /// (up to the outage limit). A retried command may have run already;
    /// every caller is idempotent or deduplicated downstream.
    pub(crate) fn call<T>(
        &mut self,
        mut command: impl FnMut(&mut Connection) -> RedisResult<T>,
    ) -> Result<T> {
        let mut down_since: Option<Instant> = None;
        let mut pause = Duration::from_millis(50);
        loop {
            let attempt = match self.connection.as_mut() {
                Some(connection) => command(connection),
                None => self
                    .client
                    .get_connection_with_timeout(IO_TIMEOUT)
                    .and_then(|c| {
                        c.set_read_timeout(Some(IO_TIMEOUT))?;
                        c.set_write_timeout(Some(IO_TIMEOUT))?;
                        if down_since.is_some() {
                            self.reconnects += 1;
                        }
                        self.connection = Some(c);
                        command(self.connection.as_mut().expect("just set"))
                    }),
            };
            match attempt {
                Ok(value) => return Ok(value),
                Err(e) if transient(&e) => {
                    self.connection = None;
                    let since = *down_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= self.outage_limit {
                        return Err(self.explain(&e));
                    }
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(500));
                }
                Err(e) => return Err(self.explain(&e)),
            }
        }
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
    }
}
