//! The coordinator's decisions: how many batches a task holds and how
//! many are in flight, where a routed run sends each batch, and which
//! batches it takes back from dead workers or re-enqueues after Redis lost
//! their task.

use std::collections::{BTreeMap, BTreeSet};
use std::num::NonZeroUsize;
use std::time::Instant;

use crate::cluster::keys::{entry_id, routed_label};

/// Tasks in flight (enqueued, not yet resolved) per live worker: one being
/// observed and one queued, so no worker waits for the next task.
const IN_FLIGHT_PER_WORKER: usize = 2;

/// Batches in flight however few workers are alive (before the first count
/// of heartbeats, too).
const MIN_IN_FLIGHT: usize = 64;

/// The most batches one task holds when sized automatically: a worker that
/// dies loses at most this many batches' work.
const MAX_BATCHES_PER_TASK: usize = 64;

/// Weight of the newest measurement in the running means that size tasks.
const SMOOTHING: f64 = 0.2;

/// Where a routed run's tasks go: each batch to the worker that holds its
/// hidden states, while that worker lives.
#[derive(Debug, Default)]
pub(crate) struct Routing {
    /// The workers with a task stream of their own, sorted; empty: every
    /// task goes to the shared stream.
    pub routes: Vec<String>,
    /// The workers whose heartbeat was alive at the last count.
    pub alive: BTreeSet<String>,
    /// Until then a route counts as alive: a pass's workers join after it
    /// opens, so none has a heartbeat at its start.
    pub presumed_alive_until: Option<Instant>,
    /// Next route for a batch whose holder is gone (round robin).
    next: usize,
}

impl Routing {
    /// The workers that get a routed stream when a pass opens: every
    /// worker that holds some batch's hidden states (`holders`), sorted.
    pub(crate) fn routes_for(holders: &BTreeMap<usize, String>) -> Vec<String> {
        let named: BTreeSet<&String> = holders.values().collect();
        named.into_iter().cloned().collect()
    }

    /// The worker whose stream a task of `batch` goes to at `now`, if the
    /// run is routed: its holder (`holders`) while that one lives, else
    /// the next live route in turn (any route in turn when none lives).
    pub(crate) fn target(
        &mut self,
        batch: usize,
        holders: &BTreeMap<usize, String>,
        now: Instant,
    ) -> Option<String> {
        if self.routes.is_empty() {
            return None;
        }
        let presumed = self.presumed_alive_until.is_some_and(|t| now < t);
        let usable = |worker: &String| presumed || self.alive.contains(worker);
        if let Some(holder) = holders.get(&batch)
            && self.routes.binary_search(holder).is_ok()
            && usable(holder)
        {
            return Some(holder.clone());
        }
        let live: Vec<&String> = self.routes.iter().filter(|r| usable(r)).collect();
        let pool = if live.is_empty() {
            self.routes.iter().collect()
        } else {
            live
        };
        self.next = self.next.wrapping_add(1);
        Some(pool[self.next % pool.len()].clone())
    }

    /// The workers of `alive` without a routed stream: they joined the
    /// pass late, and get one so that later tasks, and the batches they
    /// run in the pass after, can be routed to them.
    pub(crate) fn late_joiners<'a>(&self, alive: &'a BTreeSet<String>) -> Vec<&'a String> {
        alive
            .iter()
            .filter(|worker| self.routes.binary_search(worker).is_err())
            .collect()
    }

    /// Adds `worker`'s stream to the routes, keeping them sorted.
    pub(crate) fn add_route(&mut self, worker: &str) {
        if let Err(at) = self.routes.binary_search_by(|r| r.as_str().cmp(worker)) {
            self.routes.insert(at, worker.to_owned());
        }
    }
}

/// What the coordinator knows when it sizes tasks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Pacing {
    /// Batches per task as the options fix them; `None`: sized here.
    pub fixed: Option<NonZeroUsize>,
    /// Running mean of the coordinator's seconds per result.
    pub merge_seconds: Option<f64>,
    /// Running mean of the workers' seconds per batch.
    pub batch_seconds: Option<f64>,
    /// The live workers counted.
    pub alive: usize,
}

/// Batches per task when `remaining` batches of the plan are unresolved:
/// as the options fix it; one until both times are measured; else enough
/// that the results of all live workers keep the coordinator busy at most
/// half the time (`2 × workers × time per result / time per batch`, at
/// most [`MAX_BATCHES_PER_TASK`]), and no more than lets every worker have
/// [`IN_FLIGHT_PER_WORKER`] tasks of what is left.
pub(crate) fn per_task(pacing: &Pacing, remaining: usize) -> usize {
    if let Some(fixed) = pacing.fixed {
        return fixed.get();
    }
    let (Some(merge), Some(batch)) = (pacing.merge_seconds, pacing.batch_seconds) else {
        return 1;
    };
    let alive = pacing.alive.max(1);
    let keeping_up = (2.0 * alive as f64 * merge / batch.max(1e-6)).ceil();
    let spread = (remaining / (IN_FLIGHT_PER_WORKER * alive)).max(1);
    // `as` saturates: an infinite or huge ratio is the cap.
    (keeping_up as usize)
        .clamp(1, MAX_BATCHES_PER_TASK)
        .min(spread)
}

/// Batches to enqueue now, and how many a task holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Issue {
    /// Moved from the backlog to the open batches, in plan order.
    pub batches: Vec<usize>,
    /// Batches per task.
    pub per_task: usize,
}

/// Moves whole tasks' worth of batches from `backlog` (not enqueued) to
/// `open` (enqueued, unresolved) until the run has its limit in flight:
/// [`IN_FLIGHT_PER_WORKER`] tasks per live worker, [`MIN_IN_FLIGHT`]
/// batches at least, one task at least. A result waits in Redis only for a
/// task in flight, so when the coordinator merges slower than the workers
/// observe, Redis holds a bounded number of results instead of the rest of
/// the plan's (a SmolLM2 result is 1 MB).
pub(crate) fn issue(
    pacing: &Pacing,
    backlog: &mut BTreeSet<usize>,
    open: &mut BTreeSet<usize>,
) -> Issue {
    let per_task = per_task(pacing, backlog.len() + open.len());
    let limit = (IN_FLIGHT_PER_WORKER * pacing.alive * per_task).max(MIN_IN_FLIGHT);
    let mut batches = Vec::new();
    while open.len() + per_task <= limit.max(per_task) && !backlog.is_empty() {
        for _ in 0..per_task {
            let Some(batch) = backlog.pop_first() else {
                break;
            };
            open.insert(batch);
            batches.push(batch);
        }
    }
    Issue { batches, per_task }
}

/// Folds `value` into the running mean `mean`.
pub(crate) fn smooth(mean: &mut Option<f64>, value: f64) {
    *mean = Some(mean.map_or(value, |m| m + SMOOTHING * (value - m)));
}

/// The live workers to pace by, when `alive` heartbeats were counted;
/// `None` keeps the count the pass was paced from (`from_pace`) while no
/// worker of the pass has joined: a pass's workers join after it opens.
pub(crate) fn workers_counted(alive: usize, from_pace: bool) -> Option<usize> {
    (alive > 0 || !from_pace).then_some(alive)
}

/// Updates `open` (enqueued, unresolved) and `backlog` (not enqueued) once
/// the coordinator has handled a result covering `covered`: all of them are
/// settled but those to observe again (`again`), which are open again (to
/// be enqueued one per task). A resumed coordinator may settle, from before
/// its crash, a batch it has not enqueued again: it leaves the backlog too.
pub(crate) fn settle(
    covered: &[usize],
    again: &[usize],
    open: &mut BTreeSet<usize>,
    backlog: &mut BTreeSet<usize>,
) {
    for batch in covered.iter().filter(|b| !again.contains(b)) {
        open.remove(batch);
        backlog.remove(batch);
    }
    for &batch in again {
        backlog.remove(&batch);
        open.insert(batch);
    }
}

/// A task stream as the coordinator reads it to reconcile.
#[derive(Debug, Clone)]
pub(crate) struct StreamTasks<'a> {
    /// The entry its group read last.
    pub last_delivered: &'a str,
    /// Its entries: their ids and the batches they name (`None`: not a
    /// list).
    pub entries: Vec<(&'a str, Option<Vec<usize>>)>,
    /// The ids of the entries delivered but not acknowledged.
    pub pending: BTreeSet<&'a str>,
}

/// What a reconciliation decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reconciled {
    /// Batches to re-enqueue, one per task: no task covered them at this
    /// check or the one before.
    pub lost: Vec<usize>,
    /// Batches without a task at this check only, looked at again next.
    pub suspects: BTreeSet<usize>,
}

/// Which unresolved batches (`open`) Redis lost, from the task streams read
/// once the results stream was read to its end, and the `suspects` of the
/// check before. A batch is covered by an entry not yet delivered or
/// delivered but not acknowledged; one without either at two checks in a
/// row is lost. Its results cannot be waiting unread, since workers publish
/// before they acknowledge and the coordinator has read every result up to
/// this check (checking behind a backlog instead re-enqueued 38 845 tasks
/// of a clean 20 000-batch run).
pub(crate) fn reconcile(
    open: &BTreeSet<usize>,
    streams: &[StreamTasks<'_>],
    suspects: &BTreeSet<usize>,
) -> Reconciled {
    let mut covered = BTreeSet::new();
    for stream in streams {
        let delivered_up_to = entry_id(stream.last_delivered);
        covered.extend(
            stream
                .entries
                .iter()
                .filter(|(id, _)| entry_id(id) > delivered_up_to || stream.pending.contains(id))
                .filter_map(|(_, batches)| batches.as_ref())
                .flatten()
                .copied(),
        );
    }
    let uncovered: BTreeSet<usize> = open.difference(&covered).copied().collect();
    Reconciled {
        lost: uncovered.intersection(suspects).copied().collect(),
        suspects: uncovered.difference(suspects).copied().collect(),
    }
}

/// Whether the coordinator takes back task `id` of `owner`'s routed stream,
/// pending past the heartbeat timeout, from the worker it was delivered to,
/// whose heartbeat is `heartbeat` (`None`: expired): unless that heartbeat
/// names it (`owner/id`), that worker died holding it, or restarted under
/// the same name.
pub(crate) fn abandoned(owner: &str, id: &str, heartbeat: Option<&str>) -> bool {
    let label = routed_label(owner, id);
    !heartbeat.is_some_and(|held| held.split(',').any(|task| task == label))
}

/// The batches of a task taken back that are still unresolved (`open`):
/// those to enqueue again. `batches` is what the task names (`None`: it is
/// gone, or its field is no list).
pub(crate) fn unresolved(batches: Option<Vec<usize>>, open: &BTreeSet<usize>) -> Vec<usize> {
    batches
        .unwrap_or_default()
        .into_iter()
        .filter(|batch| open.contains(batch))
        .collect()
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::policy::test_support::{MS, names};

    #[test]
    fn a_batch_goes_to_its_holder_while_it_lives_else_to_the_next_live_route() {
        let now = Instant::now();
        let holders = BTreeMap::from([(0, "a".to_owned()), (1, "b".to_owned()), (2, "x".into())]);
        let alive = |names: &[&str]| -> BTreeSet<String> {
            names.iter().map(|n| (*n).to_owned()).collect()
        };
        let abc = || names(&["a", "b", "c"]);
        // (case, routes, alive, presumed alive, batches in turn → targets)
        let table = [
            (
                "not routed",
                names(&[]),
                alive(&["a"]),
                false,
                vec![(0, None)],
            ),
            (
                "its holder lives",
                abc(),
                alive(&["a", "c"]),
                false,
                vec![(0, Some("a")), (0, Some("a"))],
            ),
            (
                "its holder is dead: the live routes in turn",
                abc(),
                alive(&["a", "c"]),
                false,
                vec![(1, Some("c")), (1, Some("a")), (1, Some("c"))],
            ),
            (
                "a holder without a route, or no holder",
                abc(),
                alive(&["a", "b", "c"]),
                false,
                vec![(2, Some("b")), (7, Some("c")), (7, Some("a"))],
            ),
            (
                "presumed alive while the pass opens",
                abc(),
                alive(&[]),
                true,
                vec![(1, Some("b")), (0, Some("a")), (7, Some("b"))],
            ),
            (
                "none alive: every route in turn",
                names(&["a", "b"]),
                alive(&[]),
                false,
                vec![(0, Some("b")), (1, Some("a"))],
            ),
        ];
        for (case, routes, alive, presumed, turns) in table {
            let mut routing = Routing {
                routes,
                alive,
                presumed_alive_until: Some(if presumed { now + MS } else { now }),
                ..Routing::default()
            };
            for (turn, (batch, target)) in turns.into_iter().enumerate() {
                let got = routing.target(batch, &holders, now);
                assert_eq!(got.as_deref(), target, "{case}, turn {turn}");
            }
        }
    }

    #[test]
    fn every_holder_and_late_joiner_gets_a_route_kept_sorted() {
        let holders = BTreeMap::from([(0, "b".to_owned()), (1, "a".into()), (2, "b".into())]);
        let mut routing = Routing {
            routes: Routing::routes_for(&holders),
            ..Routing::default()
        };
        assert_eq!(routing.routes, ["a", "b"]);
        let alive: BTreeSet<String> = names(&["a", "c", "0"]).into_iter().collect();
        assert_eq!(routing.late_joiners(&alive), ["0", "c"]);
        for worker in ["c", "0", "c"] {
            routing.add_route(worker);
        }
        assert_eq!(routing.routes, ["0", "a", "b", "c"]);
        assert!(routing.late_joiners(&alive).is_empty());
    }

    fn pacing(fixed: usize, merge: Option<f64>, batch: Option<f64>, alive: usize) -> Pacing {
        Pacing {
            fixed: NonZeroUsize::new(fixed),
            merge_seconds: merge,
            batch_seconds: batch,
            alive,
        }
    }

    #[test]
    fn tasks_are_sized_to_keep_the_coordinator_at_most_half_busy() {
        let table = [
            (
                "fixed by the options",
                pacing(5, Some(1.0), Some(1.0), 3),
                9,
                5,
            ),
            ("nothing measured", pacing(0, None, Some(0.1), 4), 1000, 1),
            (
                "only the merge measured",
                pacing(0, Some(0.007), None, 4),
                1000,
                1,
            ),
            // 2 × 4 × 7 ms / 100 ms = 0.56.
            (
                "workers slower than merging",
                pacing(0, Some(0.007), Some(0.1), 4),
                1000,
                1,
            ),
            // 2 × 10 × 125 ms / 250 ms = 10.
            (
                "merging slower than workers",
                pacing(0, Some(0.125), Some(0.25), 10),
                1000,
                10,
            ),
            // Two tasks each for 10 workers out of 100 batches: 5.
            (
                "the rest of the plan spread",
                pacing(0, Some(0.125), Some(0.25), 10),
                100,
                5,
            ),
            (
                "instant batches: the cap",
                pacing(0, Some(0.007), Some(0.0), 1),
                10_000,
                64,
            ),
            (
                "an infinite ratio: the cap",
                pacing(0, Some(f64::INFINITY), Some(1.0), 1),
                500,
                64,
            ),
            // Counted as one worker: 2 × 1 × 1 s / 125 ms = 16.
            (
                "no live worker counted",
                pacing(0, Some(1.0), Some(0.125), 0),
                1000,
                16,
            ),
            ("nothing left", pacing(0, Some(1.0), Some(0.1), 2), 0, 1),
        ];
        for (case, pacing, remaining, expected) in table {
            assert_eq!(per_task(&pacing, remaining), expected, "{case}");
        }
    }

    #[test]
    fn issuing_keeps_two_tasks_per_live_worker_in_flight() {
        // (case, pacing, backlog, open) → batches issued, per task.
        let table = [
            (
                "two tasks of four for 10 workers",
                pacing(4, None, None, 10),
                0..100,
                0..0,
                80,
                4,
            ),
            (
                "at least 64 batches",
                pacing(1, None, None, 0),
                0..100,
                0..0,
                64,
                1,
            ),
            (
                "a task that would pass the limit waits",
                pacing(4, None, None, 10),
                100..120,
                0..78,
                0,
                4,
            ),
            (
                "one task at least",
                pacing(100, None, None, 0),
                0..150,
                0..0,
                100,
                100,
            ),
            (
                "a short backlog",
                pacing(4, None, None, 10),
                0..3,
                0..0,
                3,
                4,
            ),
        ];
        for (case, pacing, backlog, open, issued, per_task) in table {
            let mut backlog: BTreeSet<usize> = backlog.collect();
            let mut open: BTreeSet<usize> = open.collect();
            let before = backlog.clone();
            let issue = issue(&pacing, &mut backlog, &mut open);
            assert_eq!(issue.per_task, per_task, "{case}");
            assert_eq!(issue.batches.len(), issued, "{case}");
            let first: Vec<usize> = before.iter().copied().take(issued).collect();
            assert_eq!(issue.batches, first, "{case}: in plan order");
            assert!(
                issue
                    .batches
                    .iter()
                    .all(|b| open.contains(b) && !backlog.contains(b)),
                "{case}"
            );
        }
    }

    #[test]
    fn the_coordinator_counts_its_workers_and_smooths_its_times() {
        let table = [
            ("paced, none joined yet", 0, true, None),
            ("paced, one joined", 3, true, Some(3)),
            ("counted before, none alive now", 0, false, Some(0)),
        ];
        for (case, alive, from_pace, counted) in table {
            assert_eq!(workers_counted(alive, from_pace), counted, "{case}");
        }
        let mut mean = None;
        smooth(&mut mean, 1.0);
        assert_eq!(mean, Some(1.0));
        smooth(&mut mean, 2.0);
        assert_eq!(mean, Some(1.0 + SMOOTHING));
    }

    #[test]
    fn a_handled_result_settles_its_batches_but_those_to_observe_again() {
        let set = |b: &[usize]| b.iter().copied().collect::<BTreeSet<usize>>();
        // (case, covered, again) with {1, 2, 3} open and {4, 5} in the
        // backlog → (open, backlog)
        let table = [
            ("merged", vec![1, 2], vec![], vec![3], vec![4, 5]),
            ("one to retry", vec![1, 2], vec![2], vec![2, 3], vec![4, 5]),
            (
                "a retry not enqueued yet",
                vec![4],
                vec![4],
                vec![1, 2, 3, 4],
                vec![5],
            ),
            (
                "merged from before a resume",
                vec![4],
                vec![],
                vec![1, 2, 3],
                vec![5],
            ),
        ];
        for (case, covered, again, open_after, backlog_after) in table {
            let (mut open, mut backlog) = (set(&[1, 2, 3]), set(&[4, 5]));
            settle(&covered, &again, &mut open, &mut backlog);
            assert_eq!(open, set(&open_after), "{case}");
            assert_eq!(backlog, set(&backlog_after), "{case}");
        }
    }

    #[test]
    fn a_batch_is_re_enqueued_after_two_checks_without_a_task() {
        let set = |b: &[usize]| b.iter().copied().collect::<BTreeSet<usize>>();
        // Read up to 5-0: 4-0 is pending, 5-0 acknowledged, 6-0 unread.
        let shared = StreamTasks {
            last_delivered: "5-0",
            entries: vec![
                ("4-0", Some(vec![0])),
                ("5-0", Some(vec![1])),
                ("6-0", Some(vec![2])),
                ("7-0", None),
                ("junk", Some(vec![3])),
            ],
            pending: BTreeSet::from(["4-0"]),
        };
        let routed = StreamTasks {
            last_delivered: "0-0",
            entries: vec![("1-0", Some(vec![5, 6]))],
            pending: BTreeSet::new(),
        };
        let unread_group = StreamTasks {
            last_delivered: "not an id",
            entries: vec![("1-0", Some(vec![7]))],
            pending: BTreeSet::new(),
        };
        let streams = [shared, routed, unread_group];
        let open = set(&[0, 1, 2, 3, 4, 5, 6, 7]);
        // (case, suspects before) → (lost, suspects after)
        let table = [
            ("first check: suspects only", vec![], vec![], vec![1, 3, 4]),
            ("second check: lost", vec![1, 3, 4], vec![1, 3, 4], vec![]),
            (
                "a suspect covered again is cleared",
                vec![0, 1],
                vec![1],
                vec![3, 4],
            ),
            (
                "resolved suspects are forgotten",
                vec![9],
                vec![],
                vec![1, 3, 4],
            ),
        ];
        for (case, suspects, lost, after) in table {
            let reconciled = reconcile(&open, &streams, &set(&suspects));
            assert_eq!(reconciled.lost, lost, "{case}");
            assert_eq!(reconciled.suspects, set(&after), "{case}");
        }
    }

    #[test]
    fn a_routed_task_is_taken_back_unless_its_holders_heartbeat_names_it() {
        let table = [
            ("heartbeat expired", None, true),
            ("idle", Some("-"), true),
            ("on it", Some("w/5-0"), false),
            ("on it among others", Some("1-0,w/5-0"), false),
            ("on a shared task of that id", Some("5-0"), true),
            ("on another owner's task of that id", Some("v/5-0"), true),
            ("a speculative copy of it", Some("~w/5-0"), true),
        ];
        for (case, heartbeat, taken_back) in table {
            assert_eq!(abandoned("w", "5-0", heartbeat), taken_back, "{case}");
        }
        let open = BTreeSet::from([2, 3, 9]);
        assert_eq!(unresolved(Some(vec![1, 2, 3]), &open), [2, 3]);
        assert_eq!(unresolved(Some(vec![1]), &open), Vec::<usize>::new());
        assert_eq!(unresolved(None, &open), Vec::<usize>::new());
    }
}
