//! How a worker takes its next task: reading the task streams in the
//! order [`policy::task_sources`] gives, stealing from other workers'
//! routed streams, reclaiming dead workers' tasks of the shared stream and
//! picking stragglers' tasks to re-execute speculatively. This file reads
//! what those choices depend on and carries them out; the choices are
//! `cluster/policy.rs`'s.

use std::time::Duration;

use redis::streams::{
    StreamClaimReply, StreamInfoGroupsReply, StreamPendingReply, StreamRangeReply, StreamReadReply,
};

use super::{JoinedRun, Queue, Task, WorkerReport, queue};
use crate::backend::Failure;
use crate::cluster::keys::{GROUP, idle_pending, named_batches};
use crate::cluster::link::Link;
use crate::cluster::policy::{self, Claimed, Source, Steal};
use crate::error::Result;

impl JoinedRun {
    /// The next undelivered task, waiting briefly for one, from the
    /// sources [`policy::task_sources`] lists in turn (in a routed run:
    /// this worker's own stream, the shared one, a steal, then a wait).
    pub(super) fn next_task(&self, link: &mut Link) -> Result<Queue> {
        let routes = self.routes.borrow();
        for source in policy::task_sources(&routes, &self.name) {
            let read = match source {
                Source::Read(owner) => self.read(link, owner, None)?,
                Source::Steal => match self.steal(link, &routes)? {
                    Some(task) => Queue::Task(task),
                    None => Queue::Empty,
                },
                Source::Wait(owner) => return self.read(link, owner, Some(200)),
            };
            if !matches!(read, Queue::Empty) {
                return Ok(read);
            }
        }
        Ok(Queue::Empty)
    }

    /// The next undelivered task of the routed stream of `owner` (`None`:
    /// the shared one), waiting up to `block` milliseconds for one (`None`:
    /// not at all).
    fn read(&self, link: &mut Link, owner: Option<&str>, block: Option<u64>) -> Result<Queue> {
        let stream = queue(&self.keys, owner);
        let reply: Option<Option<StreamReadReply>> = link.call(|c| {
            let mut read = redis::cmd("XREADGROUP");
            read.arg("GROUP")
                .arg(GROUP)
                .arg(&self.name)
                .arg("COUNT")
                .arg(1);
            if let Some(block) = block {
                read.arg("BLOCK").arg(block);
            }
            match read.arg("STREAMS").arg(&stream).arg(">").query(c) {
                Err(e) if matches!(e.code(), Some("NOGROUP" | "UNBLOCKED")) => Ok(None),
                other => other.map(Some),
            }
        })?;
        let Some(reply) = reply else {
            return Ok(Queue::Gone);
        };
        Ok(reply
            .into_iter()
            .flat_map(|r| r.keys)
            .flat_map(|k| k.ids)
            .next()
            .map_or(Queue::Empty, |entry| {
                Queue::Task(Task {
                    owner: owner.map(str::to_owned),
                    entry,
                })
            }))
    }

    /// A task of another worker's routed stream that its owner has not
    /// read yet, when this worker would idle: from the owners
    /// [`policy::steal`] picks by their backlogs and heartbeats, else from
    /// those [`policy::overdue`] finds stuck.
    fn steal(&self, link: &mut Link, routes: &[String]) -> Result<Option<Task>> {
        let others: Vec<&String> = routes.iter().filter(|r| **r != self.name).collect();
        if others.is_empty() {
            return Ok(None);
        }
        let replies: Vec<redis::Value> = link.call(|c| {
            let mut pipe = redis::pipe();
            for owner in &others {
                pipe.cmd("XINFO")
                    .arg("GROUPS")
                    .arg(self.keys.routed_tasks(owner));
            }
            for owner in &others {
                pipe.cmd("EXISTS").arg(self.keys.heartbeat(owner));
            }
            match pipe.query(c) {
                // A stream gone: the run ended (its coordinator deleted
                // the streams) or Redis lost it (the coordinator recreates
                // it). Nothing to steal now.
                Err(e) if e.to_string().contains("no such key") => Ok(Vec::new()),
                other => other,
            }
        })?;
        if replies.len() != 2 * others.len() {
            return Ok(None);
        }
        let (groups, beats) = replies.split_at(others.len());
        let groups = groups
            .iter()
            .map(|reply| redis::from_redis_value_ref::<StreamInfoGroupsReply>(reply).ok());
        let beats = beats
            .iter()
            .map(|reply| redis::from_redis_value_ref::<bool>(reply).unwrap_or(false));
        let streams = others
            .iter()
            .zip(groups.zip(beats))
            .filter_map(|(owner, (reply, beating))| {
                let group = reply?.groups.into_iter().find(|g| g.name == GROUP)?;
                Some(policy::RoutedBacklog {
                    owner: owner.as_str(),
                    lag: group.lag,
                    last_delivered: group.last_delivered_id,
                    beating,
                })
            })
            .collect();
        let snapshot = policy::StealSnapshot {
            streams,
            since_joined: self.joined.elapsed(),
            heartbeat_timeout: Duration::from_millis(self.spec.heartbeat_timeout_ms),
        };
        let candidates = match policy::steal(snapshot) {
            Steal::From(owners) => owners,
            Steal::IfOverdue(waiting) => self.overdue(link, &waiting)?,
        };
        for owner in candidates {
            if let Queue::Task(task) = self.read(link, Some(owner), None)? {
                return Ok(Some(task));
            }
        }
        Ok(None)
    }

    /// Of the owners in `waiting`, each with unread tasks after the entry
    /// it last read, those [`policy::overdue`] finds stuck, from their
    /// oldest unread task and the time on Redis's clock, which stamped the
    /// task's id.
    fn overdue<'a>(&self, link: &mut Link, waiting: &[(&'a str, String)]) -> Result<Vec<&'a str>> {
        if waiting.is_empty() {
            return Ok(Vec::new());
        }
        let (time, unread): ((u64, u64), Vec<StreamRangeReply>) = link.call(|c| {
            let mut unread = redis::pipe();
            for (owner, last_read) in waiting {
                unread
                    .cmd("XRANGE")
                    .arg(self.keys.routed_tasks(owner))
                    .arg(format!("({last_read}"))
                    .arg("+")
                    .arg("COUNT")
                    .arg(1);
            }
            Ok((redis::cmd("TIME").query(c)?, unread.query(c)?))
        })?;
        let now_ms = time.0 * 1000 + time.1 / 1000;
        let unread: Vec<policy::Unread> = waiting
            .iter()
            .zip(&unread)
            .map(|((owner, _), range)| policy::Unread {
                owner,
                oldest: range
                    .ids
                    .first()
                    .map(|entry| (entry.id.as_str(), named_batches(entry).map(|b| b.len()))),
            })
            .collect();
        Ok(policy::overdue(&unread, now_ms, self.straggler_floor()))
    }

    /// This worker's [`policy::straggler_floor`]: from the batches it has
    /// observed in this run.
    fn straggler_floor(&self) -> Duration {
        policy::straggler_floor(
            self.observed.get(),
            Duration::from_millis(self.spec.heartbeat_timeout_ms),
        )
    }

    /// Takes over a task whose worker is dead: its heartbeat expired, or
    /// does not name the task while it has been pending past the timeout (a
    /// worker restarted under the same name). Only the tasks of the workers
    /// [`policy::suspects`] names are listed.
    ///
    /// Only the shared stream: the coordinator takes back dead workers'
    /// tasks on routed streams (see `RedisBackend`'s `reassign_dead`).
    pub(super) fn reclaim(
        &self,
        link: &mut Link,
        report: &mut WorkerReport,
    ) -> Result<Option<Task>> {
        let tasks = self.keys.tasks();
        let holders: StreamPendingReply =
            link.call(
                |c| match redis::cmd("XPENDING").arg(&tasks).arg(GROUP).query(c) {
                    Err(e) if e.code() == Some("NOGROUP") => Ok(StreamPendingReply::default()),
                    other => other,
                },
            )?;
        let StreamPendingReply::Data(holders) = holders else {
            return Ok(None);
        };
        let beats: Vec<String> = holders
            .consumers
            .iter()
            .map(|c| self.keys.heartbeat(&c.name))
            .collect();
        let beats: Vec<Option<String>> =
            link.call(|c| redis::cmd("MGET").arg(&beats[..]).query(c))?;
        let holders: Vec<policy::Holder> = holders
            .consumers
            .iter()
            .zip(&beats)
            .map(|(holder, beat)| policy::Holder {
                name: &holder.name,
                pending: holder.pending,
                heartbeat: beat.as_deref(),
            })
            .collect();
        for suspect in policy::suspects(&holders) {
            if let Some(entry) = self.claim_from(link, suspect.name, &suspect.named, report)? {
                return Ok(Some(entry));
            }
        }
        Ok(None)
    }

    /// Claims a task of `holder` pending past the timeout that its heartbeat
    /// does not name (`named`); one that dead workers were handed too often
    /// is published as failed instead.
    fn claim_from(
        &self,
        link: &mut Link,
        holder: &str,
        named: &[&str],
        report: &mut WorkerReport,
    ) -> Result<Option<Task>> {
        let timeout = self.spec.heartbeat_timeout_ms;
        let tasks = self.keys.tasks();
        for pending in idle_pending(link, &tasks, timeout, 32, Some(holder))? {
            if named.contains(&pending.id.as_str()) {
                continue; // alive and still on it
            }
            // XCLAIM with the idle floor: of several idle workers, one wins.
            let claimed: StreamClaimReply = link.call(|c| {
                match redis::cmd("XCLAIM")
                    .arg(&tasks)
                    .arg(GROUP)
                    .arg(&self.name)
                    .arg(timeout)
                    .arg(&pending.id)
                    .query(c)
                {
                    Err(e) if e.code() == Some("NOGROUP") => Ok(StreamClaimReply::default()),
                    other => other,
                }
            })?;
            let Some(entry) = claimed.ids.into_iter().next() else {
                continue;
            };
            let task = Task { owner: None, entry };
            if policy::claimed(pending.times_delivered) == Claimed::Fail {
                let failure = Failure::Worker(format!(
                    "{} workers died while observing it (out of memory? a crash in the forward?)",
                    pending.times_delivered
                ));
                let answers = match self.planned(&task.entry) {
                    Ok(batches) => batches
                        .into_iter()
                        .map(|b| self.failed(b, failure.clone()))
                        .collect(),
                    Err(unplanned) => vec![unplanned],
                };
                report.failed += answers.len();
                self.publish(link, std::slice::from_ref(&task), &answers, false)?;
                continue;
            }
            return Ok(Some(task));
        }
        Ok(None)
    }

    /// Picks the oldest task another (live) worker still holds, if it is a
    /// straggler's ([`policy::is_straggler`]), the run's speculation budget
    /// allows one more execution ([`policy::within_speculation_budget`])
    /// and nobody else speculates on it.
    pub(super) fn speculate(&self, link: &mut Link) -> Result<Option<Task>> {
        // Per batch; a task of several must have been held that many times
        // as long.
        let floor = self.straggler_floor();
        let routes = self.routes.borrow();
        let owners = std::iter::once(None).chain(routes.iter().map(|r| Some(r.as_str())));
        for owner in owners {
            if let Some(task) = self.speculate_on(link, owner, floor)? {
                return Ok(Some(task));
            }
        }
        Ok(None)
    }

    /// [`JoinedRun::speculate`] over the tasks of the routed stream of
    /// `owner` (`None`: the shared one), for a worker whose floor per batch
    /// is `floor`.
    fn speculate_on(
        &self,
        link: &mut Link,
        owner: Option<&str>,
        floor: Duration,
    ) -> Result<Option<Task>> {
        let tasks = queue(&self.keys, owner);
        for pending in idle_pending(link, &tasks, floor.as_millis() as u64, 8, None)? {
            if pending.consumer == self.name {
                continue;
            }
            let range: StreamRangeReply = link.call(|c| {
                redis::cmd("XRANGE")
                    .arg(&tasks)
                    .arg(&pending.id)
                    .arg(&pending.id)
                    .query(c)
            })?;
            let Some(entry) = range.ids.into_iter().next() else {
                continue;
            };
            let batches = named_batches(&entry).map(|b| b.len());
            let idle = Duration::from_millis(pending.last_delivered_ms as u64);
            if !policy::is_straggler(idle, batches, floor) {
                continue;
            }
            let task = Task {
                owner: owner.map(str::to_owned),
                entry,
            };
            let mine: Option<String> = link.call(|c| {
                redis::cmd("SET")
                    .arg(self.keys.speculation_claim(&task.label()))
                    .arg(&self.name)
                    .arg("NX")
                    .arg("PX")
                    .arg(3_600_000)
                    .query(c)
            })?;
            if mine.is_none() {
                continue;
            }
            // The budget counts batches, as the planned work does.
            let started: u64 = link.call(|c| {
                redis::cmd("INCRBY")
                    .arg(self.keys.speculative())
                    .arg(policy::task_size(batches))
                    .query(c)
            })?;
            if !policy::within_speculation_budget(started, self.spec.speculation_cap()) {
                return Ok(None);
            }
            return Ok(Some(task));
        }
        Ok(None)
    }
}
