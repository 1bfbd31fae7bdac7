//! The coordinator's task streams: enqueuing batches as tasks (sized and
//! paced by [`policy::issue`], routed by [`Routing::target`]), opening the
//! streams of a pass and of late joiners, and the periodic check that
//! renews the coordinator's lease, counts the live workers, takes back what
//! dead workers held on routed streams and re-enqueues the batches whose
//! task Redis lost.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use qforge_calib::Plan;
use redis::streams::{StreamInfoGroupsReply, StreamPendingCountReply, StreamRangeReply};

use super::{RedisBackend, routed_streams};
use crate::cluster::keys::{GROUP, idle_pending, joined, named_batches};
use crate::cluster::link::Link;
use crate::cluster::policy::{self, Pacing, Routing};
use crate::error::{Error, Result};

impl RedisBackend {
    /// Enqueues `batches` as tasks of up to `per_task` batches each: on the
    /// shared stream, or, in a routed run, on the streams of the workers
    /// [`Routing::target`] picks.
    pub(super) fn enqueue(
        &self,
        link: &mut Link,
        plan: &Plan,
        batches: &[usize],
        per_task: usize,
    ) -> Result<()> {
        let mut by_stream: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        {
            let book = self.book.borrow();
            let mut routing = self.routing.borrow_mut();
            for &batch in batches {
                let stream = match routing.target(batch, &book.holders, Instant::now()) {
                    Some(worker) => self.keys.routed_tasks(&worker),
                    None => self.keys.tasks(),
                };
                by_stream.entry(stream).or_default().push(batch);
            }
        }
        for (stream, batches) in by_stream {
            self.add_tasks(link, &stream, plan, &batches, per_task)?;
        }
        Ok(())
    }

    /// Appends `batches` to `stream` as tasks of up to `per_task` batches.
    fn add_tasks(
        &self,
        link: &mut Link,
        stream: &str,
        plan: &Plan,
        batches: &[usize],
        per_task: usize,
    ) -> Result<()> {
        let tasks: Vec<&[usize]> = batches.chunks(per_task.max(1)).collect();
        for chunk in tasks.chunks(512) {
            link.call(|c| {
                let mut pipe = redis::pipe();
                for task in chunk {
                    pipe.cmd("XADD")
                        .arg(stream)
                        .arg("*")
                        .arg("batches")
                        .arg(joined(task.iter()))
                        .arg("ids")
                        .arg(joined(task.iter().map(|&b| plan.batches[b].id)))
                        .ignore();
                }
                pipe.query::<()>(c)
            })?;
        }
        Ok(())
    }

    /// What tasks are sized and paced by now: the options, the times
    /// measured and the live workers counted.
    fn pacing(&self) -> Pacing {
        let book = self.book.borrow();
        Pacing {
            fixed: self.batches_per_task,
            merge_seconds: book.merge_seconds,
            batch_seconds: book.batch_seconds,
            alive: self.alive.get(),
        }
    }

    /// Fresh, empty task streams and groups: the shared one, and in a
    /// routed run one for each worker holding batches' hidden states.
    /// Whatever streams an earlier coordinator of the run left are deleted.
    pub(super) fn reset_tasks(&self, link: &mut Link) -> Result<()> {
        let mut stale = routed_streams(link, &self.keys)?;
        stale.push(self.keys.tasks());
        let routes = Routing::routes_for(&self.book.borrow().holders);
        link.call(|c| {
            let mut pipe = redis::pipe();
            pipe.atomic()
                .cmd("DEL")
                .arg(&stale[..])
                .arg(self.keys.routes())
                .ignore();
            for stream in std::iter::once(self.keys.tasks())
                .chain(routes.iter().map(|r| self.keys.routed_tasks(r)))
            {
                pipe.cmd("XGROUP")
                    .arg("CREATE")
                    .arg(stream)
                    .arg(GROUP)
                    .arg("0")
                    .arg("MKSTREAM")
                    .ignore();
            }
            if !routes.is_empty() {
                pipe.cmd("SADD")
                    .arg(self.keys.routes())
                    .arg(&routes[..])
                    .ignore();
            }
            pipe.query::<()>(c)
        })?;
        let mut routing = self.routing.borrow_mut();
        routing.routes = routes;
        routing.presumed_alive_until =
            Some(Instant::now() + Duration::from_millis(self.spec.heartbeat_timeout_ms));
        Ok(())
    }

    /// Gives `worker`, alive in a routed run without a stream of its own
    /// (it joined late), one: later tasks can be routed to it, and the
    /// batches it runs to the pass after.
    fn add_route(&self, link: &mut Link, worker: &str) -> Result<()> {
        self.create_group(link, &self.keys.routed_tasks(worker))?;
        link.call(|c| {
            redis::cmd("SADD")
                .arg(self.keys.routes())
                .arg(worker)
                .query::<i64>(c)
        })?;
        self.routing.borrow_mut().add_route(worker);
        Ok(())
    }

    /// The run's task streams: the shared one first, then the routed ones.
    fn task_streams(&self) -> Vec<String> {
        std::iter::once(self.keys.tasks())
            .chain(
                self.routing
                    .borrow()
                    .routes
                    .iter()
                    .map(|r| self.keys.routed_tasks(r)),
            )
            .collect()
    }

    /// Enqueues the batches [`policy::issue`] moves from `backlog` to
    /// `open` (enqueued, unresolved).
    pub(super) fn issue(
        &self,
        link: &mut Link,
        plan: &Plan,
        backlog: &mut BTreeSet<usize>,
        open: &mut BTreeSet<usize>,
    ) -> Result<()> {
        let issue = policy::issue(&self.pacing(), backlog, open);
        self.enqueue(link, plan, &issue.batches, issue.per_task)
    }

    fn create_group(&self, link: &mut Link, stream: &str) -> Result<()> {
        link.call(|c| {
            match redis::cmd("XGROUP")
                .arg("CREATE")
                .arg(stream)
                .arg(GROUP)
                .arg("0")
                .arg("MKSTREAM")
                .query::<()>(c)
            {
                Err(e) if e.code() == Some("BUSYGROUP") => Ok(()),
                other => other,
            }
        })
    }

    /// The periodic check ([`super::RECONCILE_EVERY`]): renews the
    /// coordinator's lease (failing if another took the run over), counts
    /// the live workers, gives late joiners of a routed run their stream
    /// and takes back what dead ones held on theirs, and reconciles the
    /// task streams with the open batches (`open`).
    pub(super) fn check(
        &self,
        link: &mut Link,
        plan: &Plan,
        open: &BTreeSet<usize>,
        drained: bool,
    ) -> Result<()> {
        let token = &self.token;
        let held: Option<String> = link.call(|c| {
            redis::cmd("SET")
                .arg(self.keys.coordinator())
                .arg(token)
                .arg("PX")
                .arg(self.spec.heartbeat_timeout_ms)
                .arg("GET")
                .query(c)
        })?;
        if held.as_deref().is_some_and(|h| h != token) {
            return Err(Error::Cluster(format!(
                "another coordinator took over run {}; this one stops",
                self.keys.run()
            )));
        }
        let alive = self.alive_workers(link)?;
        let mut book = self.book.borrow_mut();
        if let Some(counted) = policy::workers_counted(alive.len(), book.workers_from_pace) {
            book.workers_from_pace = false;
            self.alive.set(counted);
        }
        drop(book);
        if !self.routing.borrow().routes.is_empty() {
            let unrouted = self.routing.borrow().late_joiners(&alive);
            for worker in unrouted {
                self.add_route(link, worker)?;
            }
            self.routing.borrow_mut().alive = alive;
            self.reassign_dead(link, plan, open)?;
        }
        self.reconcile(link, plan, open, drained)
    }

    /// Re-enqueues unresolved batches that have neither a queued nor a
    /// pending task two checks in a row (Redis lost the task, or a result
    /// and its acknowledgement): [`policy::reconcile`] decides from the
    /// task streams read once the coordinator has read the results stream
    /// to its end (`drained`), since a batch whose result is published but
    /// not read yet has no task either.
    fn reconcile(
        &self,
        link: &mut Link,
        plan: &Plan,
        open: &BTreeSet<usize>,
        drained: bool,
    ) -> Result<()> {
        let mut delivered = Vec::new();
        for stream in self.task_streams() {
            match last_delivered(link, &stream)? {
                Some(id) => delivered.push((stream, id)),
                None if stream == self.keys.tasks() => {
                    // Redis lost the shared stream or its group: recreate,
                    // re-enqueue all.
                    self.create_group(link, &stream)?;
                    let all: Vec<usize> = open.iter().copied().collect();
                    let per_task = policy::per_task(&self.pacing(), open.len());
                    self.enqueue(link, plan, &all, per_task)?;
                    self.book.borrow_mut().reenqueued += all.len();
                    return Ok(());
                }
                // A routed stream lost: recreated for its owner to read;
                // the batches it held are re-enqueued below, as any lost.
                None => self.create_group(link, &stream)?,
            }
        }
        if !drained {
            return Ok(());
        }
        let mut read = Vec::with_capacity(delivered.len());
        for (stream, last_delivered) in &delivered {
            let entries: StreamRangeReply =
                link.call(|c| redis::cmd("XRANGE").arg(stream).arg("-").arg("+").query(c))?;
            let pending: StreamPendingCountReply = link.call(|c| {
                redis::cmd("XPENDING")
                    .arg(stream)
                    .arg(GROUP)
                    .arg("-")
                    .arg("+")
                    .arg(entries.ids.len().max(1))
                    .query(c)
            })?;
            read.push((last_delivered, entries, pending));
        }
        let streams: Vec<policy::StreamTasks> = read
            .iter()
            .map(|(last_delivered, entries, pending)| policy::StreamTasks {
                last_delivered,
                entries: entries
                    .ids
                    .iter()
                    .map(|entry| (entry.id.as_str(), named_batches(entry)))
                    .collect(),
                pending: pending.ids.iter().map(|p| p.id.as_str()).collect(),
            })
            .collect();
        let mut book = self.book.borrow_mut();
        let reconciled = policy::reconcile(open, &streams, &book.suspects);
        let lost = reconciled.lost;
        book.suspects = reconciled.suspects;
        if !lost.is_empty() {
            book.reenqueued += lost.len();
            drop(book);
            self.enqueue(link, plan, &lost, 1)?;
        }
        Ok(())
    }

    /// Takes back the tasks held on routed streams by dead workers (those
    /// [`policy::abandoned`]: pending past the timeout on a worker whose
    /// heartbeat expired or does not name them), and enqueues their
    /// unresolved batches on the shared stream. There the workers' own
    /// reclaim takes over if the next worker dies too, and counts the
    /// deliveries that fail a batch which kills every worker.
    ///
    /// The coordinator does this for every routed stream once a check;
    /// were the workers to, each would list every stream's pending tasks
    /// at every check: a cost growing with the square of the workers.
    fn reassign_dead(&self, link: &mut Link, plan: &Plan, open: &BTreeSet<usize>) -> Result<()> {
        let routes = self.routing.borrow().routes.clone();
        let timeout = self.spec.heartbeat_timeout_ms;
        let mut stale = Vec::new();
        for owner in &routes {
            let stream = self.keys.routed_tasks(owner);
            let idle = idle_pending(link, &stream, timeout, 64, None)?;
            stale.extend(idle.into_iter().map(|p| (stream.clone(), owner, p)));
        }
        if stale.is_empty() {
            return Ok(());
        }
        let beats: Vec<String> = stale
            .iter()
            .map(|(_, _, pending)| self.keys.heartbeat(&pending.consumer))
            .collect();
        let beats: Vec<Option<String>> =
            link.call(|c| redis::cmd("MGET").arg(&beats[..]).query(c))?;
        for ((stream, owner, pending), beat) in stale.iter().zip(beats) {
            if !policy::abandoned(owner, &pending.id, beat.as_deref()) {
                continue;
            }
            let range: StreamRangeReply = link.call(|c| {
                redis::cmd("XRANGE")
                    .arg(stream)
                    .arg(&pending.id)
                    .arg(&pending.id)
                    .query(c)
            })?;
            link.call(|c| {
                redis::cmd("XACK")
                    .arg(stream)
                    .arg(GROUP)
                    .arg(&pending.id)
                    .query::<i64>(c)
            })?;
            let unresolved = policy::unresolved(range.ids.first().and_then(named_batches), open);
            if !unresolved.is_empty() {
                self.add_tasks(
                    link,
                    &self.keys.tasks(),
                    plan,
                    &unresolved,
                    unresolved.len(),
                )?;
                self.book.borrow_mut().reassigned += 1;
            }
        }
        Ok(())
    }

    /// Workers whose heartbeat key is alive.
    fn alive_workers(&self, link: &mut Link) -> Result<BTreeSet<String>> {
        let names: Vec<String> =
            link.call(|c| redis::cmd("HKEYS").arg(self.keys.workers()).query(c))?;
        if names.is_empty() {
            return Ok(BTreeSet::new());
        }
        let beats: Vec<String> = names.iter().map(|n| self.keys.heartbeat(n)).collect();
        let beats: Vec<Option<String>> =
            link.call(|c| redis::cmd("MGET").arg(&beats[..]).query(c))?;
        Ok(names
            .into_iter()
            .zip(beats)
            .filter_map(|(name, beat)| beat.map(|_| name))
            .collect())
    }
}

/// The last entry of `stream` delivered to its group; `None` when Redis
/// lost the stream or the group.
fn last_delivered(link: &mut Link, stream: &str) -> Result<Option<String>> {
    let groups: Option<StreamInfoGroupsReply> =
        link.call(
            |c| match redis::cmd("XINFO").arg("GROUPS").arg(stream).query(c) {
                Ok(reply) => Ok(Some(reply)),
                Err(e) if e.to_string().contains("no such key") => Ok(None),
                Err(e) => Err(e),
            },
        )?;
    Ok(groups
        .and_then(|g| g.groups.into_iter().find(|g| g.name == GROUP))
        .map(|g| g.last_delivered_id))
}
