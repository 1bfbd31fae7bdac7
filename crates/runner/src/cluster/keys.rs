//! Key names of a run, and what both sides read from its task streams.

use qforge_core::Digest;
use redis::streams::{StreamId, StreamPendingCountReply, StreamPendingId};

use super::link::Link;
use crate::error::{Error, Result};

/// The consumer group of the task stream.
pub(crate) const GROUP: &str = "workers";

/// The run that workers without `--run` join.
pub(crate) const ACTIVE: &str = "qforge:active";

/// The keys of one run, all sharing the hash tag `{run}`.
#[derive(Debug, Clone)]
pub struct RunKeys {
    run: String,
}

impl RunKeys {
    /// Keys of run `run`. Run names are 1–64 characters of `[A-Za-z0-9._-]`
    /// (braces would break the hash tag).
    pub fn new(run: &str) -> Result<Self> {
        check_name("run", run)?;
        Ok(Self {
            run: run.to_owned(),
        })
    }

    /// The run's name.
    pub fn run(&self) -> &str {
        &self.run
    }

    fn key(&self, suffix: &str) -> String {
        format!("qforge:{{{}}}:{suffix}", self.run)
    }

    pub(crate) fn spec(&self) -> String {
        self.key("spec")
    }
    pub(crate) fn state(&self) -> String {
        self.key("state")
    }
    pub(crate) fn coordinator(&self) -> String {
        self.key("coordinator")
    }
    pub(crate) fn tasks(&self) -> String {
        self.key("tasks")
    }
    /// The task stream of the batches whose hidden states `worker` holds.
    pub(crate) fn routed_tasks(&self, worker: &str) -> String {
        self.key(&format!("tasks:{worker}"))
    }
    /// The workers that have a routed task stream (a set).
    pub(crate) fn routes(&self) -> String {
        self.key("routes")
    }
    pub(crate) fn results(&self) -> String {
        self.key("results")
    }
    pub(crate) fn heartbeat(&self, worker: &str) -> String {
        self.key(&format!("hb:{worker}"))
    }
    pub(crate) fn workers(&self) -> String {
        self.key("workers")
    }
    pub(crate) fn reference(&self) -> String {
        self.key("reference")
    }
    pub(crate) fn speculative(&self) -> String {
        self.key("speculative")
    }
    pub(crate) fn speculation_claim(&self, entry: &str) -> String {
        self.key(&format!("spec:{entry}"))
    }
    /// Where a pipeline's run holds the GPTQ rounding whose digest is
    /// `rounding`.
    pub(crate) fn rounding(&self, rounding: &Digest) -> String {
        self.key(&format!("rounding:{}", rounding.to_hex()))
    }

    /// Keys that describe the run as a whole (not per worker or per entry).
    pub(crate) fn run_wide(&self) -> [String; 9] {
        [
            self.spec(),
            self.state(),
            self.coordinator(),
            self.tasks(),
            self.routes(),
            self.results(),
            self.workers(),
            self.reference(),
            self.speculative(),
        ]
    }
}

/// Checks a run's or worker's name (`what`): 1–64 characters of
/// `[A-Za-z0-9._-]`. Both are parts of keys, and a worker's name is also
/// part of the task names its heartbeat lists (see [`routed_label`]).
pub(crate) fn check_name(what: &str, name: &str) -> Result<()> {
    let valid = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if valid {
        Ok(())
    } else {
        Err(Error::Cluster(format!(
            "invalid {what} name {name:?}: use 1-64 characters of letters, digits, '.', '_' and '-'"
        )))
    }
}

/// The plan batches a task or result entry names: its `batches` field, the
/// indices in ascending order joined by commas (as [`joined`] writes them).
/// `None` when the field is missing or not such a list (a forged `0,0`
/// would count one batch twice).
pub(crate) fn named_batches(entry: &StreamId) -> Option<Vec<usize>> {
    let field = entry.get::<String>("batches")?;
    let batches: Vec<usize> = field
        .split(',')
        .map(|b| b.parse().ok())
        .collect::<Option<_>>()?;
    batches
        .windows(2)
        .all(|pair| pair[0] < pair[1])
        .then_some(batches)
}

/// `items` joined by commas: a task's or result's `batches` and `ids`.
pub(crate) fn joined<T: std::fmt::Display>(items: impl IntoIterator<Item = T>) -> String {
    items
        .into_iter()
        .map(|item| item.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// How a worker's heartbeat names a task it holds from the routed stream of
/// `owner`: entry ids of two streams may coincide, so they are qualified
/// (a shared-stream task is named by its id alone).
pub(crate) fn routed_label(owner: &str, id: &str) -> String {
    format!("{owner}/{id}")
}

/// Up to `count` tasks of `stream` pending for at least `idle` ms (those of
/// `consumer` only, if given), oldest first; none when the stream or its
/// group is gone (the run ended, or Redis lost it).
pub(crate) fn idle_pending(
    link: &mut Link,
    stream: &str,
    idle: u64,
    count: usize,
    consumer: Option<&str>,
) -> Result<Vec<StreamPendingId>> {
    let reply: StreamPendingCountReply = link.call(|c| {
        let mut pending = redis::cmd("XPENDING");
        pending
            .arg(stream)
            .arg(GROUP)
            .arg("IDLE")
            .arg(idle)
            .arg("-")
            .arg("+")
            .arg(count);
        if let Some(consumer) = consumer {
            pending.arg(consumer);
        }
        match pending.query(c) {
            Err(e) if e.code() == Some("NOGROUP") => Ok(StreamPendingCountReply::default()),
            other => other,
        }
    })?;
    Ok(reply.ids)
}

/// A stream entry id `ms-seq`, ordered as Redis orders them.
pub(crate) fn entry_id(id: &str) -> Option<(u64, u64)> {
    let (ms, seq) = id.split_once('-')?;
    Some((ms.parse().ok()?, seq.parse().ok()?))
}

/// Milliseconds since the epoch: the clock Redis numbers stream entries by.
pub(crate) fn now_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_share_the_hash_tag_and_names_are_checked() {
        let keys = RunKeys::new("cartpole-7").unwrap();
        for key in keys.run_wide() {
            assert!(key.starts_with("qforge:{cartpole-7}:"), "{key}");
        }
        assert_eq!(keys.heartbeat("w1"), "qforge:{cartpole-7}:hb:w1");
        for bad in ["", "a{b}", "has space", &"x".repeat(65)] {
            assert!(RunKeys::new(bad).is_err(), "{bad:?}");
        }
        assert!(entry_id("12-3") < entry_id("12-10"));
        assert!(entry_id("9-99") < entry_id("10-0"));
        assert_eq!(entry_id("junk"), None);
    }
}
