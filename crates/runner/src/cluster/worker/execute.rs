//! Executing a task: observing its batches (taking in a dead worker's task
//! found on the way), merging those that succeed into one result, and
//! publishing the results before acknowledging the tasks.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use qforge_core::Stats;
use qforge_core::codec::encode;
use redis::streams::StreamId;

use super::{Compute, Current, JoinedRun, Task, WorkerReport};
use crate::backend::Failure;
use crate::cluster::auth::MAC_FIELD;
use crate::cluster::keys::{GROUP, joined, named_batches};
use crate::cluster::link::Link;
use crate::cluster::policy;
use crate::error::Result;

/// One results entry a task gives: the batches it covers, as the `batches`
/// and `ids` fields name them, their statistics (`.qstats` bytes) or why
/// they failed, and the time spent observing them.
pub(super) struct Answer {
    batches: String,
    ids: String,
    observed: std::result::Result<Vec<u8>, Failure>,
    elapsed: Duration,
}

/// A task a worker holds while observing: its entry, the batches it names
/// (planned), and the merged statistics of those observed so far.
struct Held {
    task: Task,
    batches: Vec<usize>,
    merged: Option<Stats>,
    done: Vec<usize>,
    took: Duration,
}

impl Held {
    fn new(task: Task, batches: Vec<usize>) -> Self {
        Self {
            task,
            batches,
            merged: None,
            done: Vec::new(),
            took: Duration::ZERO,
        }
    }
}

impl JoinedRun {
    /// Observes the batches of a task, merges those that succeed into one
    /// result, and publishes it with one entry per batch that failed.
    pub(super) fn execute(
        &self,
        link: &mut Link,
        compute: &dyn Compute,
        current: &Current,
        task: &Task,
        speculative: bool,
        report: &mut WorkerReport,
    ) -> Result<()> {
        // A speculative copy is not this worker's pending task: the
        // heartbeat marks it, so that the count of tasks it names matches
        // those it holds (see `reclaim`).
        let named = if speculative {
            format!("~{}", task.label())
        } else {
            task.label()
        };
        self.announce(link, current, &named)?;
        let started = Instant::now();
        let (held, answers, observed) = match self.planned(&task.entry) {
            Ok(batches) => {
                let held = Held::new(task.clone(), batches);
                self.observe_tasks(link, compute, current, held, speculative, report)?
            }
            Err(unplanned) => (vec![task.clone()], vec![unplanned], 1),
        };
        let (batches, took) = self.observed.get();
        self.observed.set((
            batches.saturating_add(observed as u32),
            took + started.elapsed(),
        ));
        report.batches += observed;
        report.failed += answers.iter().filter(|a| a.observed.is_err()).count();
        self.publish(link, &held, &answers, speculative)?;
        self.announce(link, current, "-")
    }

    /// The plan batches a task names, if they are this worker's (else the
    /// failure to publish for it, under the task's own fields).
    pub(super) fn planned(&self, entry: &StreamId) -> std::result::Result<Vec<usize>, Answer> {
        let plan = &self.calibration.plan.batches;
        let ids = entry.get::<String>("ids").unwrap_or_default();
        match named_batches(entry) {
            Some(batches)
                if !batches.is_empty()
                    && batches.iter().all(|&b| b < plan.len())
                    && joined(batches.iter().map(|&b| plan[b].id)) == ids =>
            {
                Ok(batches)
            }
            _ => {
                let named = entry.get::<String>("batches").unwrap_or_default();
                Err(Answer {
                    observed: Err(Failure::Worker(format!(
                        "task names batches {named} ({ids}), which are not in this worker's plan"
                    ))),
                    batches: named,
                    ids,
                    elapsed: Duration::ZERO,
                })
            }
        }
    }

    /// The answer that batch `batch` failed.
    pub(super) fn failed(&self, batch: usize, failure: Failure) -> Answer {
        Answer {
            batches: batch.to_string(),
            ids: self.calibration.plan.batches[batch].id.to_string(),
            observed: Err(failure),
            elapsed: Duration::ZERO,
        }
    }

    /// Observes the batches of `task` (planned), merging their statistics
    /// in order. Merging is exact, so the coordinator's merge of the result
    /// equals its merges of the batches one by one.
    ///
    /// A dead worker's task found on the way (looked for every
    /// [`JoinedRun::reclaim_every`], unless this is a speculative copy) is
    /// taken into the run: its batches are observed after this task's, the
    /// heartbeat names both, and each task gets its own result, so a result
    /// never covers more than its task (were the dead worker only slow, its
    /// result and this one are duplicates, not an overlap the coordinator
    /// must refuse). Returns the entries held, their answers (a merged
    /// result per task, then a failure per batch that failed) and the number
    /// of batches observed.
    fn observe_tasks(
        &self,
        link: &mut Link,
        compute: &dyn Compute,
        current: &Current,
        task: Held,
        speculative: bool,
        report: &mut WorkerReport,
    ) -> Result<(Vec<Task>, Vec<Answer>, usize)> {
        let plan = &self.calibration.plan.batches;
        let mut queued: BTreeSet<usize> = task.batches.iter().copied().collect();
        let mut queue: VecDeque<(usize, usize)> = task.batches.iter().map(|&b| (0, b)).collect();
        let mut tasks = vec![task];
        let mut failures = Vec::new();
        let mut observed = 0;
        let mut last_reclaim = Instant::now();
        while let Some((t, b)) = queue.pop_front() {
            observed += 1;
            let started = Instant::now();
            let task = &mut tasks[t];
            match compute.observe_into(
                &self.prepared.target,
                &plan[b],
                &self.prepared.job,
                &self.calibration.hidden_states,
                &mut task.merged,
            ) {
                Ok(()) => task.done.push(b),
                Err(failure) => failures.push(self.failed(b, failure)),
            }
            task.took += started.elapsed();
            let look = policy::reclaim_between_batches(
                speculative,
                !queue.is_empty(),
                last_reclaim.elapsed(),
                self.reclaim_every(),
            );
            if !look {
                continue;
            }
            last_reclaim = Instant::now();
            let Some(reclaimed) = self.reclaim(link, report)? else {
                continue;
            };
            report.reclaimed += 1;
            let more = match self.planned(&reclaimed.entry) {
                Ok(more) => more,
                Err(unplanned) => {
                    failures.push(unplanned);
                    Vec::new()
                }
            };
            // A batch already queued here (a retry enqueued beside its first
            // task) is observed once, for its first task.
            let t = tasks.len();
            queue.extend(more.iter().filter(|&&b| queued.insert(b)).map(|&b| (t, b)));
            tasks.push(Held::new(reclaimed, more));
            self.announce(link, current, &joined(tasks.iter().map(|h| h.task.label())))?;
        }
        let mut answers = Vec::with_capacity(tasks.len() + failures.len());
        let mut held = Vec::with_capacity(tasks.len());
        for task in tasks {
            if let Some(stats) = task.merged {
                answers.push(Answer {
                    batches: joined(&task.done),
                    ids: joined(task.done.iter().map(|&b| plan[b].id)),
                    observed: Ok(encode(&stats)),
                    elapsed: task.took,
                });
            }
            held.push(task.task);
        }
        answers.extend(failures);
        Ok((held, answers, observed))
    }

    /// Appends the results of the tasks `held`, then acknowledges them: in
    /// this order, a crash in between leaves pending tasks whose rerun is a
    /// duplicate the merge drops, never a lost result.
    pub(super) fn publish(
        &self,
        link: &mut Link,
        held: &[Task],
        answers: &[Answer],
        speculative: bool,
    ) -> Result<()> {
        let results = self.keys.results();
        link.call(|c| {
            let mut pipe = redis::pipe();
            for answer in answers {
                let elapsed = (answer.elapsed.as_micros() as u64).to_string();
                let mut fields: Vec<(&str, &[u8])> = vec![
                    ("batches", answer.batches.as_bytes()),
                    ("ids", answer.ids.as_bytes()),
                    ("worker", self.name.as_bytes()),
                    ("fingerprint", self.fingerprint.as_bytes()),
                    ("elapsed_us", elapsed.as_bytes()),
                    ("speculative", if speculative { b"1" } else { b"0" }),
                ];
                match &answer.observed {
                    Ok(bytes) => fields.push(("stats", bytes)),
                    Err(failure) => {
                        fields.push(("error", failure.message().as_bytes()));
                        fields.push(("failure", failure.kind().as_bytes()));
                    }
                }
                let mac = self.run_key.seal(&fields);
                let add = pipe.cmd("XADD").arg(&results).arg("*");
                for (name, value) in &fields {
                    add.arg(*name).arg(*value);
                }
                add.arg(MAC_FIELD).arg(&mac).ignore();
            }
            pipe.query::<()>(c)
        })?;
        let mut by_stream: BTreeMap<String, Vec<&str>> = BTreeMap::new();
        for task in held {
            by_stream
                .entry(task.stream(&self.keys))
                .or_default()
                .push(&task.entry.id);
        }
        link.call(|c| {
            let mut pipe = redis::pipe();
            for (stream, ids) in &by_stream {
                pipe.cmd("XACK").arg(stream).arg(GROUP).arg(ids).ignore();
            }
            pipe.query::<()>(c)
        })?;
        Ok(())
    }
}
