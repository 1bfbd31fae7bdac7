//! The worker's decisions: where it looks for its next task, whom it
//! steals from, whose tasks it reclaims, which stragglers it re-executes,
//! and how often it looks.

use std::time::Duration;

use crate::cluster::keys::entry_id;

/// A task delivered this many times to workers that all died is reported as
/// failed instead of being handed out again (the coordinator then retries or
/// quarantines it like any failure).
const MAX_DELIVERIES: usize = 3;

/// Unread tasks a live owner must have before an idle worker steals one.
/// A thief runs a stolen batch from the deepest state it kept of it, which
/// may be many layers back: on SmolLM2 (`--sequential`, 2 workers) stolen
/// one-batch tasks took 30–232 ms where their owners took 28–70 ms over
/// their own. Taking one of `n` unread tasks ends the owner's backlog a
/// task sooner but the thief's only after that rerun; from 2 and from 4
/// unread it ended the passes traced 30–100 ms later. An owner with fewer
/// finishes its own; one that is gone is stolen from at once.
const STEAL_BACKLOG: usize = 8;

/// How often a worker rereads the run's state, coordinator and routes
/// while it works. The end of a run is seen sooner: its coordinator deletes
/// the task streams, which wakes the workers blocked reading them, and a
/// worker that finds its stream gone rereads at once.
const STATE_CHECK_EVERY: Duration = Duration::from_millis(250);

/// Where a worker looks for its next task, one after the other until one
/// gives a task (or the queue is gone).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source<'a> {
    /// Read a task without waiting: from the routed stream of this worker
    /// (`Some`: its own name) or from the shared one (`None`).
    Read(Option<&'a str>),
    /// Steal one from another worker's routed stream (see [`steal`]).
    Steal,
    /// Wait briefly for a task on this stream, as in `Read`.
    Wait(Option<&'a str>),
}

/// Where worker `me` looks for its next task in a run whose routed streams
/// belong to `routes` (sorted; empty: every task is on the shared stream).
/// Its own stream comes first, since it holds the hidden states of those
/// batches; then the shared one; then a steal; and only then does it wait,
/// on its own stream if it has one.
pub(crate) fn task_sources<'a>(routes: &[String], me: &'a str) -> Vec<Source<'a>> {
    if routes.is_empty() {
        return vec![Source::Wait(None)];
    }
    let own = routes
        .binary_search_by(|route| route.as_str().cmp(me))
        .is_ok()
        .then_some(me);
    let mut sources = Vec::with_capacity(4);
    if own.is_some() {
        sources.push(Source::Read(own));
    }
    sources.extend([Source::Read(None), Source::Steal, Source::Wait(own)]);
    sources
}

/// Another worker's routed stream, as a worker about to steal read it.
#[derive(Debug, Clone)]
pub(crate) struct RoutedBacklog<'a> {
    /// The worker the stream is routed to.
    pub owner: &'a str,
    /// Tasks its owner has not read yet (the group's lag; `None` where
    /// Redis cannot tell).
    pub lag: Option<usize>,
    /// The entry its owner read last.
    pub last_delivered: String,
    /// Whether its owner's heartbeat lives.
    pub beating: bool,
}

/// What a worker knows when it would steal.
#[derive(Debug, Clone)]
pub(crate) struct StealSnapshot<'a> {
    /// The other workers' routed streams whose group exists.
    pub streams: Vec<RoutedBacklog<'a>>,
    /// How long ago the thief joined the run.
    pub since_joined: Duration,
    /// The run's heartbeat timeout: for that long after the thief joined,
    /// an owner without a heartbeat may still be joining.
    pub heartbeat_timeout: Duration,
}

/// Whom a worker steals from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Steal<'a> {
    /// From these owners' streams, in this order (the most unread first;
    /// of two with as many, the greater name first).
    From(Vec<&'a str>),
    /// No owner has a backlog worth stealing from, or is gone: these have
    /// unread tasks after the entry they read last, and are stolen from if
    /// [`overdue`].
    IfOverdue(Vec<(&'a str, String)>),
}

/// Whom a worker that would idle steals from. A thief runs the batches
/// from the deepest states it holds of them, which takes longer than their
/// owner would (see [`STEAL_BACKLOG`]). So it takes from an owner with at
/// least [`STEAL_BACKLOG`] unread tasks, or from an owner without a
/// heartbeat (dead, unless the thief joined less than a heartbeat timeout
/// ago); else only from an owner stuck on its current task ([`overdue`]).
pub(crate) fn steal(snapshot: StealSnapshot<'_>) -> Steal<'_> {
    let joining = snapshot.since_joined < snapshot.heartbeat_timeout;
    let mut backlogs = Vec::new();
    let mut waiting = Vec::new();
    for stream in snapshot.streams {
        let gone = !stream.beating && !joining;
        match stream.lag {
            Some(lag) if lag >= STEAL_BACKLOG || (lag > 0 && gone) => {
                backlogs.push((lag, stream.owner));
            }
            Some(lag) if lag > 0 => waiting.push((stream.owner, stream.last_delivered)),
            _ => {}
        }
    }
    if backlogs.is_empty() {
        return Steal::IfOverdue(waiting);
    }
    backlogs.sort_unstable_by(|a, b| b.cmp(a));
    Steal::From(backlogs.into_iter().map(|(_, owner)| owner).collect())
}

/// The oldest task an owner has not read, as a thief sees it.
#[derive(Debug, Clone)]
pub(crate) struct Unread<'o, 'e> {
    /// The worker whose routed stream holds it.
    pub owner: &'o str,
    /// Its entry id (Redis stamped it with its clock when it was queued)
    /// and the number of batches it names (`None`: its field is no list);
    /// `None` when the stream has no entry after the one read last.
    pub oldest: Option<(&'e str, Option<usize>)>,
}

/// Of the owners with unread tasks, those whose oldest unread task has
/// waited, by `now_ms` on Redis's clock, for [`STEAL_BACKLOG`] times the
/// straggler floor (`floor`, see [`straggler_floor`]) per batch it names:
/// in that time an owner working at the thief's pace would have run that
/// many tasks, so it is stuck on the one it holds.
pub(crate) fn overdue<'o>(unread: &[Unread<'o, '_>], now_ms: u64, floor: Duration) -> Vec<&'o str> {
    let patience = floor * STEAL_BACKLOG as u32;
    unread
        .iter()
        .filter(|task| {
            task.oldest.is_some_and(|(id, batches)| {
                let queued_ms = entry_id(id).map_or(now_ms, |(ms, _)| ms);
                Duration::from_millis(now_ms.saturating_sub(queued_ms))
                    >= patience * task_size(batches)
            })
        })
        .map(|task| task.owner)
        .collect()
}

/// A task's size in batches, for the thresholds that scale with it: one
/// at least, also for a task whose `batches` field is no list.
pub(crate) fn task_size(batches: Option<usize>) -> u32 {
    batches.map_or(1, |b| b.max(1)) as u32
}

/// Twice the time this worker takes over a batch, from the `(batches,
/// time)` it has `observed` in the run (the heartbeat timeout before it has
/// observed any): a task held or queued longer than this per batch is a
/// straggler's, worth running here as well.
pub(crate) fn straggler_floor(observed: (u32, Duration), heartbeat_timeout: Duration) -> Duration {
    match observed {
        (0, _) => heartbeat_timeout,
        (batches, took) => 2 * took / batches,
    }
}

/// Whether a task that another worker has held for `idle` since it was
/// delivered, naming `batches` batches, is a straggler's that a worker
/// whose floor per batch is `floor` re-executes speculatively: held for at
/// least the floor per batch. Without that floor, a queue emptied by a
/// coordinator that merges slower than workers observe sent every idle
/// worker after fresh tasks: the cap's 20 % of extra results, all
/// duplicates, at the very coordinator that bounded the run.
pub(crate) fn is_straggler(idle: Duration, batches: Option<usize>, floor: Duration) -> bool {
    idle >= floor * task_size(batches)
}

/// Whether a speculative execution that brings the run's count of
/// speculatively observed batches to `started` stays within the run's
/// speculation budget `cap`.
pub(crate) fn within_speculation_budget(started: u64, cap: u64) -> bool {
    started <= cap
}

/// A worker holding tasks of the shared stream, as a worker looking for
/// dead workers' tasks reads it.
#[derive(Debug, Clone)]
pub(crate) struct Holder<'a> {
    /// Its name (the consumer in the group).
    pub name: &'a str,
    /// The tasks it holds: delivered, not acknowledged.
    pub pending: usize,
    /// Its heartbeat's value; `None`: expired.
    pub heartbeat: Option<&'a str>,
}

/// A holder whose tasks may be dead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Suspect<'a> {
    /// The holder.
    pub name: &'a str,
    /// The shared-stream tasks its heartbeat names: it is still on those;
    /// any other of its tasks pending past the heartbeat timeout is dead.
    pub named: Vec<&'a str>,
}

/// The holders, in order, whose tasks a worker looks at to reclaim: those
/// whose heartbeat expired, or names fewer tasks than they hold (a worker
/// restarted under the same name). Liveness comes from the heartbeat,
/// never from how long a task has been pending, so a live worker on a slow
/// task keeps it. Looking only at suspects matters: listing every task
/// pending past the timeout instead found, once tasks of several batches
/// outlasted the timeout, the tasks of live workers first, and at 256
/// workers a dead one's tasks waited 7 s.
pub(crate) fn suspects<'a>(holders: &[Holder<'a>]) -> Vec<Suspect<'a>> {
    holders
        .iter()
        .filter_map(|holder| {
            let named = holder.heartbeat.map(held_shared).unwrap_or_default();
            let alive = holder.heartbeat.is_some() && holder.pending <= named.len();
            (!alive).then_some(Suspect {
                name: holder.name,
                named,
            })
        })
        .collect()
}

/// The shared-stream tasks a heartbeat names as held. A heartbeat lists
/// the labels of its worker's tasks, comma-separated: `-` for none, `~`
/// before a speculative copy (which the worker does not hold), and a task
/// of a routed stream qualified by its owner (`owner/id`).
fn held_shared(heartbeat: &str) -> Vec<&str> {
    heartbeat
        .split(',')
        .filter(|id| *id != "-" && !id.starts_with('~') && !id.contains('/'))
        .collect()
}

/// What a worker does with a dead worker's task it has just claimed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Claimed {
    /// Observe it.
    Observe,
    /// Publish its batches as failed: every worker it was delivered to
    /// ([`MAX_DELIVERIES`] or more) died on it, so it likely kills workers.
    Fail,
}

/// What to do with a claimed task that was delivered `times_delivered`
/// times (this claim included).
pub(crate) fn claimed(times_delivered: usize) -> Claimed {
    if times_delivered >= MAX_DELIVERIES {
        Claimed::Fail
    } else {
        Claimed::Observe
    }
}

/// How often a worker looks for dead workers' tasks, between its own
/// batches too, given the run's heartbeat timeout: so that a death costs
/// about one timeout, not the queue's length or a long task's.
pub(crate) fn reclaim_every(heartbeat_timeout_ms: u64) -> Duration {
    Duration::from_millis((heartbeat_timeout_ms / 4).clamp(50, 1000))
}

/// Whether a worker rereads the run's state now: at its first look, when
/// its task stream was gone (the run ended or its coordinator is
/// recreating it), or [`STATE_CHECK_EVERY`] after the last.
pub(crate) fn check_state_now(queue_gone: bool, since_last_check: Option<Duration>) -> bool {
    queue_gone || since_last_check.is_none_or(|since| since >= STATE_CHECK_EVERY)
}

/// Whether a worker observing a task looks for a dead worker's task
/// between two of its batches: not for a speculative copy (its result is
/// likely a duplicate; adding a dead worker's task would delay that one
/// too), not after the last batch (the main loop looks next), and at most
/// once every `every` ([`reclaim_every`]), `since_last` being the time
/// since it last looked.
pub(crate) fn reclaim_between_batches(
    speculative: bool,
    batches_left: bool,
    since_last: Duration,
    every: Duration,
) -> bool {
    !speculative && batches_left && since_last >= every
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::policy::test_support::{MS, names};

    #[test]
    fn a_worker_reads_its_own_stream_then_the_shared_one_then_steals_then_waits() {
        use Source::{Read, Steal, Wait};
        let table: [(&str, &[&str], Vec<Source>); 4] = [
            ("not routed", &[], vec![Wait(None)]),
            (
                "routed to it",
                &["a", "b"],
                vec![Read(Some("a")), Read(None), Steal, Wait(Some("a"))],
            ),
            (
                "routed to others",
                &["b", "c"],
                vec![Read(None), Steal, Wait(None)],
            ),
            (
                "its name a prefix of a route",
                &["ab"],
                vec![Read(None), Steal, Wait(None)],
            ),
        ];
        for (case, routes, expected) in table {
            assert_eq!(task_sources(&names(routes), "a"), expected, "{case}");
        }
    }

    /// A routed stream of `owner` with `lag` unread tasks after `1-0`.
    fn backlog(owner: &str, lag: Option<usize>, beating: bool) -> RoutedBacklog<'_> {
        RoutedBacklog {
            owner,
            lag,
            last_delivered: "1-0".into(),
            beating,
        }
    }

    #[test]
    fn a_thief_takes_from_a_backlog_or_a_dead_owner_else_only_from_a_stuck_one() {
        let timeout = 2000 * MS;
        let long_ago = 10 * timeout;
        let waiting = |owners: &[&'static str]| {
            Steal::IfOverdue(owners.iter().map(|o| (*o, "1-0".to_owned())).collect())
        };
        let below = STEAL_BACKLOG - 1;
        let table = [
            (
                "a live owner below the backlog keeps its tasks",
                vec![backlog("b", Some(below), true)],
                long_ago,
                waiting(&["b"]),
            ),
            (
                "a live owner at the backlog is stolen from",
                vec![backlog("b", Some(STEAL_BACKLOG), true)],
                long_ago,
                Steal::From(vec!["b"]),
            ),
            (
                "an owner whose heartbeat expired is stolen from at once",
                vec![backlog("b", Some(1), false)],
                long_ago,
                Steal::From(vec!["b"]),
            ),
            (
                "an owner without a heartbeat may be joining within a timeout",
                vec![backlog("b", Some(1), false)],
                timeout - MS,
                waiting(&["b"]),
            ),
            (
                "a heartbeat timeout after joining, a silent owner is dead",
                vec![backlog("b", Some(1), false)],
                timeout,
                Steal::From(vec!["b"]),
            ),
            (
                "nothing unread, nothing to steal",
                vec![backlog("b", Some(0), false), backlog("c", Some(0), true)],
                long_ago,
                waiting(&[]),
            ),
            (
                "a lag Redis cannot tell is no backlog",
                vec![backlog("b", None, false)],
                long_ago,
                waiting(&[]),
            ),
            (
                "the most unread first; ties to the greater name",
                vec![
                    backlog("b", Some(9), true),
                    backlog("c", Some(9), true),
                    backlog("d", Some(12), true),
                    backlog("e", Some(1), true),
                ],
                long_ago,
                Steal::From(vec!["d", "c", "b"]),
            ),
            (
                "a dead owner's one task ranks by its lag too",
                vec![backlog("b", Some(1), false), backlog("c", Some(8), true)],
                long_ago,
                Steal::From(vec!["c", "b"]),
            ),
        ];
        for (case, streams, since_joined, expected) in table {
            let snapshot = StealSnapshot {
                streams,
                since_joined,
                heartbeat_timeout: timeout,
            };
            assert_eq!(steal(snapshot), expected, "{case}");
        }
    }

    #[test]
    fn an_owner_is_stuck_once_its_oldest_unread_task_waited_its_patience_per_batch() {
        // Floor 100 ms: patience 800 ms per batch.
        let floor = 100 * MS;
        let now = 10_000;
        let table = [
            ("just short of patience", Some(("9201-0", Some(1))), false),
            ("at patience", Some(("9200-0", Some(1))), true),
            ("two batches, short", Some(("8401-3", Some(2))), false),
            ("two batches, at", Some(("8400-0", Some(2))), true),
            (
                "an empty list counts one batch",
                Some(("9200-0", Some(0))),
                true,
            ),
            (
                "a field no list counts one batch",
                Some(("9200-0", None)),
                true,
            ),
            (
                "an id not Redis's waited no time",
                Some(("junk", Some(1))),
                false,
            ),
            (
                "an id from the future waited no time",
                Some(("20000-0", Some(1))),
                false,
            ),
            ("nothing unread after all", None, false),
            ("long overdue", Some(("0-0", Some(4))), true),
        ];
        for (case, oldest, stuck) in table {
            let unread = [Unread { owner: "b", oldest }];
            let expected: Vec<&str> = if stuck { vec!["b"] } else { vec![] };
            assert_eq!(overdue(&unread, now, floor), expected, "{case}");
        }
        let several = [
            Unread {
                owner: "b",
                oldest: Some(("0-0", Some(1))),
            },
            Unread {
                owner: "c",
                oldest: Some(("9999-0", Some(1))),
            },
            Unread {
                owner: "d",
                oldest: Some(("1-0", Some(1))),
            },
        ];
        assert_eq!(overdue(&several, now, floor), ["b", "d"]);
    }

    #[test]
    fn a_straggler_is_held_twice_this_workers_time_per_batch_within_the_budget() {
        let timeout = 2000 * MS;
        let floors = [
            (
                "nothing observed yet: the heartbeat timeout",
                (0, 5000 * MS),
                timeout,
            ),
            ("twice the mean", (4, 400 * MS), 200 * MS),
            ("instant batches", (3, Duration::ZERO), Duration::ZERO),
        ];
        for (case, observed, floor) in floors {
            assert_eq!(straggler_floor(observed, timeout), floor, "{case}");
        }
        let floor = 100 * MS;
        let table = [
            ("held less than the floor", 99 * MS, Some(1), false),
            ("held the floor", 100 * MS, Some(1), true),
            (
                "a task of three, held twice the floor",
                200 * MS,
                Some(3),
                false,
            ),
            ("a task of three, held three times", 300 * MS, Some(3), true),
            ("an empty list counts one batch", 100 * MS, Some(0), true),
            ("a field no list counts one batch", 100 * MS, None, true),
        ];
        for (case, idle, batches, straggler) in table {
            assert_eq!(is_straggler(idle, batches, floor), straggler, "{case}");
        }
        assert_eq!(task_size(Some(5)), 5);
        for (started, within) in [(0, true), (9, true), (10, true), (11, false)] {
            assert_eq!(within_speculation_budget(started, 10), within, "{started}");
        }
    }

    #[test]
    fn a_holder_is_suspect_when_its_heartbeat_expired_or_names_fewer_tasks_than_it_holds() {
        let table = [
            ("heartbeat expired", 1, None, Some(vec![])),
            ("live, on its task", 1, Some("1-0"), None),
            ("live, on both its tasks", 2, Some("1-0,2-0"), None),
            (
                "holds more than it names",
                2,
                Some("1-0"),
                Some(vec!["1-0"]),
            ),
            (
                "restarted under the same name, idle",
                1,
                Some("-"),
                Some(vec![]),
            ),
            (
                "a speculative copy is not held",
                1,
                Some("~1-0"),
                Some(vec![]),
            ),
            (
                "a routed task is not the shared stream's",
                1,
                Some("w/1-0"),
                Some(vec![]),
            ),
            (
                "held, beside a speculative and a routed one",
                1,
                Some("~9-0,w/3-0,1-0"),
                None,
            ),
            (
                "names more than it holds (a stale count)",
                1,
                Some("1-0,2-0"),
                None,
            ),
        ];
        for (case, pending, heartbeat, named) in table {
            let holder = Holder {
                name: "w",
                pending,
                heartbeat,
            };
            let expected: Vec<Suspect> = named
                .into_iter()
                .map(|named| Suspect { name: "w", named })
                .collect();
            assert_eq!(suspects(&[holder]), expected, "{case}");
        }
        // In the order Redis listed them.
        let holders = [
            Holder {
                name: "c",
                pending: 1,
                heartbeat: None,
            },
            Holder {
                name: "b",
                pending: 1,
                heartbeat: Some("1-0"),
            },
            Holder {
                name: "a",
                pending: 1,
                heartbeat: Some("-"),
            },
        ];
        let order: Vec<&str> = suspects(&holders).iter().map(|s| s.name).collect();
        assert_eq!(order, ["c", "a"]);
    }

    #[test]
    fn a_task_that_every_worker_it_reached_died_on_fails() {
        let table = [
            (1, Claimed::Observe),
            (MAX_DELIVERIES - 1, Claimed::Observe),
            (MAX_DELIVERIES, Claimed::Fail),
            (MAX_DELIVERIES + 5, Claimed::Fail),
        ];
        for (delivered, verdict) in table {
            assert_eq!(claimed(delivered), verdict, "{delivered}");
        }
    }

    #[test]
    fn a_worker_paces_its_state_checks_and_reclaims() {
        let every = [(2000, 500), (100, 50), (0, 50), (3999, 999), (60_000, 1000)];
        for (timeout_ms, expected_ms) in every {
            assert_eq!(reclaim_every(timeout_ms), expected_ms * MS, "{timeout_ms}");
        }
        let checks = [
            ("the first look", false, None, true),
            ("soon after", false, Some(249 * MS), false),
            ("a period after", false, Some(STATE_CHECK_EVERY), true),
            ("the queue vanished", true, Some(Duration::ZERO), true),
        ];
        for (case, gone, since, check) in checks {
            assert_eq!(check_state_now(gone, since), check, "{case}");
        }
        let every = 500 * MS;
        let between = [
            ("due, batches left", false, true, every, true),
            ("not due yet", false, true, every - MS, false),
            (
                "a speculative copy never reclaims",
                true,
                true,
                every,
                false,
            ),
            (
                "after its last batch the loop looks",
                false,
                false,
                every,
                false,
            ),
        ];
        for (case, speculative, left, since, look) in between {
            assert_eq!(
                reclaim_between_batches(speculative, left, since, every),
                look,
                "{case}"
            );
        }
    }
}
