//! The reduce step of a run, apart from any backend: merges each batch id
//! exactly once, drops duplicates, retries and quarantines failures, keeps the
//! per-worker accounting and the timeline, and says when a checkpoint is due.
//! The coordinator drives it; keeping it free of I/O (but for writing the
//! checkpoint it is handed) lets it be tested outcome by outcome.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use qforge_calib::{Job, Plan};
use qforge_core::{BatchId, Digest, MergePolicy, Provenance, Stats};

use crate::backend::{Failure, Next, Outcome};
use crate::checkpoint::CheckpointStore;
use crate::record::{Delivery, MAX_ATTEMPTS, Progress, RunSummary, WorkerAccount};

/// Rejected results named one by one in the warnings; beyond, only counted.
const REJECTIONS_LOGGED: usize = 8;
use crate::error::{Error, Result};

/// Who sent a result of statistics, and how.
struct ResultCopy {
    worker: String,
    elapsed: Duration,
    speculative: bool,
    digest: Option<Digest>,
}

/// The state of a run's reduce step.
pub(crate) struct Merger<'p> {
    plan: &'p Plan,
    /// Batch id to its index in the plan: what a checkpoint is checked against.
    ids: BTreeMap<BatchId, usize>,
    started: Instant,
    stats: Stats,
    /// Ids merged, restored ones included.
    done: BTreeSet<BatchId>,
    /// Failures so far per batch index.
    attempts: BTreeMap<usize, u32>,
    quarantined: BTreeMap<BatchId, Failure>,
    workers: BTreeMap<String, WorkerAccount>,
    timeline: Vec<Delivery>,
    duplicates: usize,
    /// The digest of each merged result that carried one, with its worker,
    /// by the batches it covered: a later copy of the same batches must
    /// have the same bytes.
    digests: BTreeMap<Vec<usize>, (Digest, String)>,
    /// Results refused before the merge (see [`Merger::reject`]).
    rejected: usize,
    /// Results that covered merged and unmerged batches at once.
    overlapping: usize,
    retries: usize,
    speculative: usize,
    resumed: usize,
    resumed_from: Option<PathBuf>,
    warnings: Vec<String>,
    /// Batches neither merged nor quarantined: at zero the run stops.
    unresolved: usize,
    checkpoint_every: usize,
    since_checkpoint: usize,
    checkpoints_written: usize,
}

impl<'p> Merger<'p> {
    /// An empty merger for `plan` that wants a checkpoint after every
    /// `checkpoint_every` newly merged batches.
    pub(crate) fn new(plan: &'p Plan, checkpoint_every: usize) -> Self {
        let ids = plan
            .batches
            .iter()
            .enumerate()
            .map(|(i, b)| (b.id, i))
            .collect();
        Self {
            plan,
            ids,
            started: Instant::now(),
            stats: Stats::default(),
            done: BTreeSet::new(),
            attempts: BTreeMap::new(),
            quarantined: BTreeMap::new(),
            workers: BTreeMap::new(),
            timeline: Vec::new(),
            duplicates: 0,
            digests: BTreeMap::new(),
            rejected: 0,
            overlapping: 0,
            retries: 0,
            speculative: 0,
            resumed: 0,
            resumed_from: None,
            warnings: Vec::new(),
            unresolved: plan.batches.len(),
            checkpoint_every,
            since_checkpoint: 0,
            checkpoints_written: 0,
        }
    }

    /// Continues from the checkpoint at `path` holding `stats`, once it is
    /// known to belong to this job and plan (merging a stranger's statistics
    /// would silently corrupt the result).
    pub(crate) fn restore(&mut self, job: &Job, path: PathBuf, stats: Stats) -> Result<()> {
        check_checkpoint(&stats.provenance, job, &self.ids, &path)?;
        self.resumed = stats.provenance.batches.len();
        self.done = stats.provenance.batches.clone();
        self.stats = stats;
        self.resumed_from = Some(path);
        self.unresolved = self.pending().len();
        Ok(())
    }

    /// Adds warnings for the summary.
    pub(crate) fn warn(&mut self, warnings: impl IntoIterator<Item = String>) {
        self.warnings.extend(warnings);
    }

    /// Indices of the planned batches not merged yet.
    pub(crate) fn pending(&self) -> Vec<usize> {
        (0..self.plan.batches.len())
            .filter(|&i| !self.done.contains(&self.plan.batches[i].id))
            .collect()
    }

    /// Where the run stands, for `workers` workers.
    pub(crate) fn progress(&self, workers: usize) -> Progress {
        Progress {
            merged: self.done.len(),
            planned: self.plan.batches.len(),
            retries: self.retries,
            workers,
        }
    }

    /// Takes one outcome and says what the backend should do next. A result
    /// for a batch not in the plan (or not the one it was handed out as) is
    /// an error: merging it would make the statistics wrong, not partial.
    pub(crate) fn accept(&mut self, outcome: Outcome) -> Result<Next> {
        match outcome {
            Outcome::Done {
                batches,
                stats,
                worker,
                elapsed,
                speculative,
                digest,
            } => {
                if let Some(digest) = digest {
                    self.compare_copies(&batches, digest, &worker)?;
                }
                let copy = ResultCopy {
                    worker,
                    elapsed,
                    speculative,
                    digest,
                };
                self.accept_done(&batches, &stats, copy)
            }
            Outcome::Failed {
                batches,
                worker,
                error,
            } => Ok(self.accept_failure(&batches, worker, error)),
        }
    }

    /// Fails the run when the merged copy of `batches` has another digest
    /// than `digest`: under one determinism fingerprint a
    /// batch's statistics are the same bytes on every worker, so two copies
    /// that differ mean one machine computed wrongly (a faulty core or
    /// memory, another build) or a holder of the cluster key lied, and the
    /// merged copy cannot be trusted either.
    fn compare_copies(&mut self, batches: &[usize], digest: Digest, worker: &str) -> Result<()> {
        match self.digests.get(batches) {
            None => Ok(()),
            Some((first, _)) if *first == digest => Ok(()),
            Some((first, first_worker)) => Err(Error::Cluster(format!(
                "{} computed twice with different statistics: worker {first_worker} sent {} and \
                 worker {worker} sent {}, under the same determinism fingerprint. One of the \
                 two machines computed wrongly (check its memory and CPU, and that both run \
                 the same build) or something holding the cluster key forged a result; the \
                 statistics cannot be trusted, so the run stops",
                listed(batches),
                &first.to_hex()[..16],
                &digest.to_hex()[..16],
            ))),
        }
    }

    fn accept_done(&mut self, batches: &[usize], stats: &Stats, copy: ResultCopy) -> Result<Next> {
        let ResultCopy {
            worker,
            elapsed,
            speculative,
            digest,
        } = copy;
        self.speculative += usize::from(speculative);
        let busy_seconds = elapsed.as_secs_f64();
        self.workers.entry(worker.clone()).or_default().busy_seconds += busy_seconds;
        let ids = match claimed_ids(self.plan, batches, stats) {
            Ok(ids) => ids,
            Err(reason) => return Ok(self.reject(batches, worker, reason)),
        };
        // A retry or speculative copy that lost the race is a duplicate.
        let merged_before = ids.iter().filter(|id| self.done.contains(id)).count();
        let merged = merged_before == 0;
        if merged {
            // A failed merge leaves the statistics as they were.
            if let Err(e) = self.stats.merge(stats, MergePolicy::Strict) {
                return Ok(self.reject(
                    batches,
                    worker,
                    format!("its statistics do not merge: {e}"),
                ));
            }
            // A batch quarantined after failures that a late result covers is
            // merged now, and was already counted as resolved.
            let fresh = ids
                .iter()
                .filter(|id| self.quarantined.remove(id).is_none())
                .count();
            self.unresolved -= fresh;
            self.done.extend(ids);
            if let Some(digest) = digest {
                self.digests
                    .insert(batches.to_vec(), (digest, worker.clone()));
            }
        }
        let at_seconds = self.started.elapsed().as_secs_f64();
        for &batch in batches {
            self.timeline.push(Delivery {
                worker: worker.clone(),
                batch,
                at_seconds,
                busy_seconds: busy_seconds / batches.len() as f64,
                merged,
            });
        }
        let account = self.workers.entry(worker).or_default();
        if !merged {
            account.duplicates += merged_before;
            self.duplicates += merged_before;
            if merged_before == batches.len() {
                return Ok(Next::Continue);
            }
            // Statistics cannot be taken apart: the batches it covers that
            // are neither merged nor quarantined are observed again. Results
            // grouped before a coordinator resumed and regrouped the plan
            // overlap so.
            self.overlapping += 1;
            let unresolved = batches
                .iter()
                .copied()
                .filter(|&b| {
                    let id = &self.plan.batches[b].id;
                    !self.done.contains(id) && !self.quarantined.contains_key(id)
                })
                .collect::<Vec<_>>();
            return Ok(if unresolved.is_empty() {
                Next::Continue
            } else {
                Next::Retry(unresolved)
            });
        }
        account.merged += batches.len();
        self.since_checkpoint += batches.len();
        Ok(self.next())
    }

    /// A result that must not be merged (forged, corrupt, or of another
    /// run): counted and logged, and its batches handled as failed attempts,
    /// so they are observed again and the run goes on.
    fn reject(&mut self, batches: &[usize], worker: String, reason: String) -> Next {
        self.rejected += 1;
        if self.rejected <= REJECTIONS_LOGGED {
            self.warnings.push(format!(
                "rejected a result for {} from worker {worker}: {reason}",
                listed(batches)
            ));
        }
        self.accept_failure(
            batches,
            worker,
            Failure::Worker(format!("rejected result: {reason}")),
        )
    }

    /// One failed attempt at each of `batches`: those below the limit are
    /// retried, the others quarantined.
    fn accept_failure(&mut self, batches: &[usize], worker: String, error: Failure) -> Next {
        self.workers.entry(worker).or_default().failures += 1;
        let mut retry = Vec::new();
        for &batch in batches {
            let id = self.plan.batches[batch].id;
            // A late failure of a batch already settled changes nothing.
            if self.done.contains(&id) || self.quarantined.contains_key(&id) {
                continue;
            }
            let tries = self.attempts.entry(batch).or_insert(0);
            *tries += 1;
            if *tries < MAX_ATTEMPTS {
                self.retries += 1;
                retry.push(batch);
            } else {
                self.quarantined.insert(id, error.clone());
                self.unresolved -= 1;
            }
        }
        if retry.is_empty() {
            self.next()
        } else {
            Next::Retry(retry)
        }
    }

    fn next(&self) -> Next {
        if self.unresolved == 0 {
            Next::Stop
        } else {
            Next::Continue
        }
    }

    /// Batches were merged since the last checkpoint.
    pub(crate) fn has_unsaved(&self) -> bool {
        self.since_checkpoint > 0
    }

    /// Enough batches were merged since the last checkpoint to write one.
    /// Only a merge makes one due, so duplicates and failures never write
    /// (even with `checkpoint_every` 0).
    pub(crate) fn checkpoint_due(&self) -> bool {
        self.has_unsaved() && self.since_checkpoint >= self.checkpoint_every
    }

    /// Writes the merged statistics to `store`, if there is one, and starts
    /// counting towards the next checkpoint.
    pub(crate) fn checkpoint(&mut self, store: Option<&CheckpointStore>) -> Result<()> {
        if let Some(store) = store {
            store.write(self.done.len() as u64, &self.stats)?;
            self.checkpoints_written += 1;
        }
        self.since_checkpoint = 0;
        Ok(())
    }

    /// The summary, or an error naming the first missing batches if fewer
    /// than `min_coverage` of the plan were merged.
    pub(crate) fn finish(mut self, min_coverage: f64) -> Result<RunSummary> {
        if self.overlapping > 0 {
            self.warnings.push(format!(
                "{} result(s) covered batches merged already together with unmerged ones (grouped before the coordinator resumed); their unmerged batches were observed again",
                self.overlapping
            ));
        }
        let planned = self.plan.batches.len();
        let merged = self.done.len();
        let coverage = if planned == 0 {
            1.0
        } else {
            merged as f64 / planned as f64
        };
        if coverage < min_coverage {
            return Err(Error::Coverage {
                merged,
                planned,
                required: min_coverage,
                missing: self.missing(8).join(", "),
            });
        }
        Ok(RunSummary {
            stats: self.stats,
            planned,
            merged,
            coverage,
            resumed: self.resumed,
            resumed_from: self.resumed_from,
            duplicates: self.duplicates,
            quarantined_results: self.rejected,
            retries: self.retries,
            speculative: self.speculative,
            quarantined: self.quarantined,
            checkpoints_written: self.checkpoints_written,
            warnings: self.warnings,
            workers: self.workers,
            seconds: self.started.elapsed().as_secs_f64(),
            timeline: self.timeline,
        })
    }

    /// The first `limit` batches not merged, with why when quarantined.
    fn missing(&self, limit: usize) -> Vec<String> {
        self.plan
            .batches
            .iter()
            .filter(|b| !self.done.contains(&b.id))
            .take(limit)
            .map(|b| match self.quarantined.get(&b.id) {
                Some(e) => format!("{} (quarantined: {e})", b.id),
                None => b.id.to_string(),
            })
            .collect()
    }
}

/// The batch ids `stats` claims, if they are exactly the ids of plan
/// batches `batches`.
fn claimed_ids(
    plan: &Plan,
    batches: &[usize],
    stats: &Stats,
) -> std::result::Result<BTreeSet<BatchId>, String> {
    let claimed = &stats.provenance.batches;
    let expected: Option<BTreeSet<BatchId>> = batches
        .iter()
        .map(|&b| plan.batches.get(b).map(|batch| batch.id))
        .collect();
    match expected {
        Some(ids) if !ids.is_empty() && ids.len() == batches.len() && &ids == claimed => Ok(ids),
        _ => Err(format!(
            "its statistics claim batch(es) [{}], not this plan's {}",
            claimed
                .iter()
                .take(4)
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", "),
            listed(batches)
        )),
    }
}

/// "batch 3", or "batches 3, 4, 5" (the first eight, then how many more).
fn listed(batches: &[usize]) -> String {
    const SHOWN: usize = 8;
    let mut list = batches
        .iter()
        .take(SHOWN)
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    if batches.len() > SHOWN {
        list.push_str(&format!(" and {} more", batches.len() - SHOWN));
    }
    match batches.len() {
        1 => format!("batch {list}"),
        _ => format!("batches {list}"),
    }
}

/// A checkpoint may only resume the run it was written by.
fn check_checkpoint(
    provenance: &Provenance,
    job: &Job,
    ids: &BTreeMap<BatchId, usize>,
    path: &Path,
) -> Result<()> {
    let expected = job.provenance(BatchId {
        index: 0,
        content: job.data,
    });
    let same_source = provenance.models == expected.models
        && provenance.data == expected.data
        && provenance.recipes == expected.recipes
        && provenance.passes == expected.passes
        && provenance.planned == expected.planned
        && !provenance.forced;
    if !same_source {
        return Err(Error::Checkpoint {
            path: path.display().to_string(),
            reason: "it belongs to a different model, data or recipe; use another --checkpoint-dir or run name".into(),
        });
    }
    if let Some(foreign) = provenance.batches.iter().find(|b| !ids.contains_key(b)) {
        return Err(Error::Checkpoint {
            path: path.display().to_string(),
            reason: format!("it holds batch {foreign}, which is not in this run's plan"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use qforge_calib::{Batch, Recipe};
    use qforge_core::codec::encode;
    use qforge_core::{Digest, TensorStats};

    /// A job and a plan of `n` empty batches: the merger never looks inside
    /// a batch, only at its id.
    fn setup(n: usize) -> (Job, Plan) {
        let job = Job {
            model: Digest::of(b"model"),
            data: Digest::of(b"data"),
            recipe: Recipe::default(),
            planned: n as u64,
            transforms: Vec::new(),
        };
        let batches = (0..n)
            .map(|i| Batch {
                id: BatchId {
                    index: i as u64,
                    content: Digest::of(format!("batch {i}").as_bytes()),
                },
                samples: Vec::new(),
            })
            .collect();
        let plan = Plan {
            batches,
            samples: 0,
            rows: 0,
            strata: Vec::new(),
        };
        (job, plan)
    }

    /// Statistics of one batch `id` of `job`: one tensor that saw `values`.
    fn stats(job: &Job, id: BatchId, values: &[f32]) -> Stats {
        let mut tensor = TensorStats::new();
        tensor.observe(values).unwrap();
        Stats {
            provenance: job.provenance(id),
            tensors: BTreeMap::from([("layer.0".to_owned(), tensor)]),
        }
    }

    fn done(batch: usize, stats: Stats, worker: &str, speculative: bool) -> Outcome {
        group(&[batch], stats, worker, speculative)
    }

    /// The merged statistics of `batches`, as a worker handed them as one
    /// task publishes them.
    fn group(batches: &[usize], stats: Stats, worker: &str, speculative: bool) -> Outcome {
        let digest = Some(Digest::of(&encode(&stats)));
        Outcome::Done {
            batches: batches.to_vec(),
            stats: Box::new(stats),
            worker: worker.to_owned(),
            elapsed: Duration::from_millis(10),
            speculative,
            digest,
        }
    }

    fn failed(batch: usize, worker: &str, error: &str) -> Outcome {
        Outcome::Failed {
            batches: vec![batch],
            worker: worker.to_owned(),
            error: Failure::Worker(error.to_owned()),
        }
    }

    #[test]
    fn a_batch_is_merged_once_and_the_last_one_stops_the_run() {
        let (job, plan) = setup(2);
        let first = stats(&job, plan.batches[0].id, &[1.0, -2.0]);
        let second = stats(&job, plan.batches[1].id, &[0.5]);
        let mut merger = Merger::new(&plan, 50);
        assert_eq!(merger.pending(), vec![0, 1]);
        let next = merger.accept(done(0, first.clone(), "w0", false));
        assert_eq!(next.unwrap(), Next::Continue);
        assert_eq!(merger.pending(), vec![1]);
        assert_eq!(merger.progress(4).merged, 1);
        let next = merger.accept(done(1, second.clone(), "w1", false));
        assert_eq!(next.unwrap(), Next::Stop);

        let summary = merger.finish(1.0).unwrap();
        let mut expected = first;
        expected.merge(&second, MergePolicy::Strict).unwrap();
        assert_eq!(encode(&summary.stats), encode(&expected));
        assert_eq!((summary.merged, summary.coverage), (2, 1.0));
        assert_eq!((summary.duplicates, summary.retries), (0, 0));
        assert_eq!(summary.workers["w0"].merged, 1);
        assert_eq!(summary.workers["w1"].merged, 1);
        assert!(summary.timeline.iter().all(|d| d.merged));
    }

    #[test]
    fn a_duplicate_is_dropped_and_counted() {
        let (job, plan) = setup(2);
        let first = stats(&job, plan.batches[0].id, &[3.0]);
        let mut merger = Merger::new(&plan, 50);
        merger.accept(done(0, first.clone(), "w0", false)).unwrap();
        let next = merger.accept(done(0, first.clone(), "w1", true));
        assert_eq!(next.unwrap(), Next::Continue);

        let summary = merger.finish(0.5).unwrap();
        assert_eq!(encode(&summary.stats), encode(&first));
        assert_eq!((summary.merged, summary.duplicates), (1, 1));
        assert_eq!(summary.speculative, 1);
        assert_eq!(summary.workers["w1"].duplicates, 1);
        assert_eq!(summary.workers["w1"].merged, 0);
        let merged: Vec<bool> = summary.timeline.iter().map(|d| d.merged).collect();
        assert_eq!(merged, [true, false]);
    }

    /// Statistics of `batches` merged, as one worker publishes a task of
    /// several batches.
    fn merged_stats(job: &Job, plan: &Plan, batches: &[usize]) -> Stats {
        let mut all = Stats::default();
        for &b in batches {
            let one = stats(job, plan.batches[b].id, &[b as f32 + 0.5]);
            all.merge(&one, MergePolicy::Strict).unwrap();
        }
        all
    }

    #[test]
    fn a_copy_that_differs_from_the_merged_one_fails_the_run_naming_both_workers() {
        let (job, plan) = setup(2);
        let genuine = stats(&job, plan.batches[0].id, &[3.0]);
        let mut merger = Merger::new(&plan, 50);
        merger
            .accept(done(0, genuine.clone(), "w0", false))
            .unwrap();
        // The same bytes again: a duplicate, dropped.
        let next = merger.accept(done(0, genuine.clone(), "w1", true));
        assert_eq!(next.unwrap(), Next::Continue);
        // A histogram count raised by 40 (a faulty core, or a forger holding
        // the key): the run stops, naming both.
        let mut faulty = genuine;
        faulty
            .tensors
            .get_mut("layer.0")
            .unwrap()
            .observe(&[1.0; 40])
            .unwrap();
        let err = merger
            .accept(done(0, faulty, "w2", true))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("worker w0 sent") && err.contains("worker w2 sent"),
            "{err}"
        );
        assert!(err.contains("computed wrongly"), "{err}");
    }

    #[test]
    fn a_group_result_merges_as_its_batches_one_by_one() {
        let (job, plan) = setup(5);
        let mut merger = Merger::new(&plan, 50);
        let first = merged_stats(&job, &plan, &[0, 2, 3]);
        assert_eq!(
            merger
                .accept(group(&[0, 2, 3], first.clone(), "w0", false))
                .unwrap(),
            Next::Continue
        );
        assert_eq!(merger.pending(), vec![1, 4]);
        // Its speculative copy is a duplicate of three batches.
        merger.accept(group(&[0, 2, 3], first, "w1", true)).unwrap();
        let rest = merged_stats(&job, &plan, &[1, 4]);
        assert_eq!(
            merger.accept(group(&[1, 4], rest, "w1", false)).unwrap(),
            Next::Stop
        );

        let summary = merger.finish(1.0).unwrap();
        let one_by_one = merged_stats(&job, &plan, &[0, 1, 2, 3, 4]);
        assert_eq!(encode(&summary.stats), encode(&one_by_one));
        assert_eq!((summary.merged, summary.duplicates), (5, 3));
        assert_eq!(summary.workers["w0"].merged, 3);
        assert_eq!(summary.workers["w1"].merged, 2);
        assert_eq!(summary.timeline.len(), 8);
    }

    #[test]
    fn a_group_overlapping_merged_batches_is_not_merged_and_its_others_are_retried() {
        let (job, plan) = setup(4);
        let mut merger = Merger::new(&plan, 50);
        let first = merged_stats(&job, &plan, &[0, 1]);
        merger.accept(group(&[0, 1], first, "w0", false)).unwrap();
        // Grouped otherwise (before a coordinator resumed): 1 is merged, 2
        // and 3 are not, and statistics do not come apart.
        let overlapping = merged_stats(&job, &plan, &[1, 2, 3]);
        let next = merger.accept(group(&[1, 2, 3], overlapping, "w1", false));
        assert_eq!(next.unwrap(), Next::Retry(vec![2, 3]));
        assert_eq!(merger.pending(), vec![2, 3]);
        assert_eq!(merger.progress(2).retries, 0, "not a failure of 2 or 3");
        for b in [2, 3] {
            merger
                .accept(done(b, merged_stats(&job, &plan, &[b]), "w1", false))
                .unwrap();
        }

        let summary = merger.finish(1.0).unwrap();
        let one_by_one = merged_stats(&job, &plan, &[0, 1, 2, 3]);
        assert_eq!(encode(&summary.stats), encode(&one_by_one));
        assert_eq!(summary.duplicates, 1);
        assert!(
            summary
                .warnings
                .iter()
                .any(|w| w.contains("1 result(s) covered")),
            "{:?}",
            summary.warnings
        );
    }

    #[test]
    fn a_quarantined_batch_merged_late_is_resolved_once() {
        let (job, plan) = setup(3);
        let mut merger = Merger::new(&plan, 50);
        for _ in 0..MAX_ATTEMPTS {
            merger.accept(failed(1, "w0", "died")).unwrap();
        }
        assert_eq!(merger.progress(1).merged, 0);
        // A late copy of a task of 0 and 1, then the last batch: the run
        // stops there, not a batch early, and 1 counts as merged.
        let late = merged_stats(&job, &plan, &[0, 1]);
        assert_eq!(
            merger.accept(group(&[0, 1], late, "w1", false)).unwrap(),
            Next::Continue
        );
        let last = merged_stats(&job, &plan, &[2]);
        assert_eq!(
            merger.accept(group(&[2], last, "w1", false)).unwrap(),
            Next::Stop
        );
        let summary = merger.finish(1.0).unwrap();
        assert_eq!(summary.merged, 3);
        assert!(summary.quarantined.is_empty());
        // Late when it is the last: no underflow, the run stops.
        let (job, plan) = setup(2);
        let mut merger = Merger::new(&plan, 50);
        merger
            .accept(done(0, merged_stats(&job, &plan, &[0]), "w0", false))
            .unwrap();
        for _ in 0..MAX_ATTEMPTS - 1 {
            merger.accept(failed(1, "w0", "died")).unwrap();
        }
        assert_eq!(merger.accept(failed(1, "w0", "died")).unwrap(), Next::Stop);
        let late = merged_stats(&job, &plan, &[1]);
        assert_eq!(
            merger.accept(done(1, late, "w1", false)).unwrap(),
            Next::Stop
        );
        assert_eq!(merger.finish(1.0).unwrap().merged, 2);
    }

    #[test]
    fn a_group_claiming_other_batches_is_rejected_and_each_of_its_batches_retried() {
        let (job, plan) = setup(3);
        let mut merger = Merger::new(&plan, 50);
        // Statistics of 0 and 1 published as 0, 1 and 2.
        let short = merged_stats(&job, &plan, &[0, 1]);
        let next = merger.accept(group(&[0, 1, 2], short, "w0", false));
        assert_eq!(next.unwrap(), Next::Retry(vec![0, 1, 2]));
        assert_eq!(merger.pending(), vec![0, 1, 2]);
        let summary = merger.finish(0.0).unwrap();
        assert_eq!(summary.quarantined_results, 1);
        assert!(
            summary.warnings[0].contains("batches 0, 1, 2 from worker w0"),
            "{:?}",
            summary.warnings
        );
    }

    #[test]
    fn a_failure_is_retried_then_quarantined_after_max_attempts() {
        let (_, plan) = setup(2);
        let mut merger = Merger::new(&plan, 50);
        for attempt in 1..MAX_ATTEMPTS {
            let next = merger.accept(failed(1, "w0", &format!("boom {attempt}")));
            assert_eq!(next.unwrap(), Next::Retry(vec![1]));
        }
        let next = merger.accept(failed(1, "w0", "boom last"));
        assert_eq!(next.unwrap(), Next::Continue);
        // Quarantined for good: a later failure is not retried again.
        assert_eq!(
            merger.accept(failed(1, "w1", "late")).unwrap(),
            Next::Continue
        );
        assert_eq!(merger.progress(1).retries, (MAX_ATTEMPTS - 1) as usize);

        let err = merger.finish(1.0).unwrap_err().to_string();
        assert!(err.contains("0/2"), "{err}");
        assert!(
            err.contains("(quarantined: worker fault: boom last)"),
            "{err}"
        );
    }

    #[test]
    fn quarantining_the_last_unresolved_batch_stops_the_run() {
        let (job, plan) = setup(2);
        let mut merger = Merger::new(&plan, 50);
        let first = stats(&job, plan.batches[0].id, &[1.0]);
        merger.accept(done(0, first, "w0", false)).unwrap();
        for _ in 1..MAX_ATTEMPTS {
            merger.accept(failed(1, "w0", "boom")).unwrap();
        }
        assert_eq!(merger.accept(failed(1, "w0", "boom")).unwrap(), Next::Stop);

        let summary = merger.finish(0.5).unwrap();
        assert_eq!(summary.quarantined.len(), 1);
        assert_eq!(
            summary.quarantined[&plan.batches[1].id],
            Failure::Worker("boom".into())
        );
        assert_eq!(summary.workers["w0"].failures, MAX_ATTEMPTS as usize);
    }

    #[test]
    fn a_result_for_a_batch_not_in_the_plan_is_rejected_as_a_failed_attempt() {
        let (job, plan) = setup(2);
        let stranger = BatchId {
            index: 0,
            content: Digest::of(b"another data set"),
        };
        let mut merger = Merger::new(&plan, 50);
        let next = merger.accept(done(0, stats(&job, stranger, &[1.0]), "w0", false));
        assert_eq!(next.unwrap(), Next::Retry(vec![0]));
        // Nor may it pass as another planned batch.
        let other = stats(&job, plan.batches[1].id, &[1.0]);
        assert_eq!(
            merger.accept(done(0, other, "w0", false)).unwrap(),
            Next::Retry(vec![0])
        );
        assert_eq!(merger.pending(), vec![0, 1]);
        // Statistics that cannot merge with the ones merged so far (another
        // histogram layout for the same tensor) leave those untouched.
        let first = stats(&job, plan.batches[0].id, &[1.0]);
        merger.accept(done(0, first, "w0", false)).unwrap();
        let before = merger.stats.clone();
        let mut odd = stats(&job, plan.batches[1].id, &[1.0]);
        let mut channels = TensorStats::with_channels(3);
        channels.observe(&[1.0, 2.0, 3.0]).unwrap();
        odd.tensors.insert("layer.0".into(), channels);
        assert_eq!(
            merger.accept(done(1, odd, "w1", false)).unwrap(),
            Next::Retry(vec![1])
        );
        assert_eq!(merger.stats, before);
        assert_eq!(merger.pending(), vec![1]);

        let summary = merger.finish(0.0).unwrap();
        assert_eq!(summary.quarantined_results, 3);
        assert_eq!(summary.warnings.len(), 3, "{:?}", summary.warnings);
        assert!(summary.warnings[0].contains("batch 0 from worker w0"));
        assert!(
            summary.warnings[2].contains("do not merge"),
            "{:?}",
            summary.warnings
        );
        assert_eq!(summary.workers["w1"].failures, 1);
    }

    #[test]
    fn a_checkpoint_is_restored_only_into_its_own_plan() {
        let (job, plan) = setup(3);
        let checkpoint = stats(&job, plan.batches[1].id, &[2.0]);
        let mut merger = Merger::new(&plan, 50);
        merger
            .restore(&job, PathBuf::from("ckpt"), checkpoint.clone())
            .unwrap();
        assert_eq!(merger.pending(), vec![0, 2]);
        // The restored batch counts as merged: its result again is a duplicate.
        merger.accept(done(1, checkpoint, "w0", false)).unwrap();
        let summary = merger.finish(0.0).unwrap();
        assert_eq!((summary.resumed, summary.duplicates), (1, 1));

        let (_, smaller) = setup(1);
        let foreign = stats(&job, plan.batches[2].id, &[2.0]);
        let mut merger = Merger::new(&smaller, 50);
        let err = merger.restore(&job, PathBuf::from("ckpt"), foreign);
        assert!(matches!(err, Err(Error::Checkpoint { .. })), "{err:?}");
    }

    #[test]
    fn only_merges_make_a_checkpoint_due() {
        let (job, plan) = setup(3);
        let mut merger = Merger::new(&plan, 2);
        let first = stats(&job, plan.batches[0].id, &[1.0]);
        merger.accept(done(0, first.clone(), "w0", false)).unwrap();
        assert!(merger.has_unsaved() && !merger.checkpoint_due());
        merger.accept(done(0, first, "w1", true)).unwrap();
        merger.accept(failed(2, "w0", "boom")).unwrap();
        assert!(!merger.checkpoint_due());
        let second = stats(&job, plan.batches[1].id, &[1.0]);
        merger.accept(done(1, second, "w0", false)).unwrap();
        assert!(merger.checkpoint_due());
        merger.checkpoint(None).unwrap();
        assert!(!merger.has_unsaved() && !merger.checkpoint_due());
        assert_eq!(merger.finish(0.0).unwrap().checkpoints_written, 0);
    }
}
