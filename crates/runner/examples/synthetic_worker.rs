//! A `qforge worker` whose forward is synthetic, for measuring the Redis
//! backend at scale (`scripts/bench_cluster_scale.py`): it joins a run like
//! any worker (loads the spec's model and data, plans, sends its
//! fingerprint, heartbeats, claims dead workers' tasks), but observes a batch
//! by sleeping for a fixed delay and answering with the tensors of a template
//! `.qstats` file (for example one SmolLM2 calibration: 121 tensors), stamped
//! with the batch's provenance. Hundreds of them then load the coordinator
//! and Redis as hundreds of real workers would, without loading the cores.
//!
//! Every batch gets the same tensors, so the merged result depends only on
//! the plan: any number of workers, and any of them killed, must write the
//! same bytes.
//!
//! Usage: `synthetic_worker REDIS_URL RUN NAME TEMPLATE.qstats DELAY_MS`

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::Duration;

use qforge_calib::{Batch, HiddenStates, Job};
use qforge_core::codec::decode;
use qforge_core::{MergePolicy, Stats, TensorStats};
use qforge_model::Model;
use qforge_runner::Failure;
use qforge_runner::cluster::{ClusterKey, Compute, RedisAddress, WorkerOptions, run_worker_with};

/// Answers every batch with the template's tensors after `delay`. The
/// template is held as decoded (its histograms sparse, about 1 MB for
/// SmolLM2). A task's first batch costs the worker a copy of it, every
/// other its merge into the task's statistics (in place: the same bins), and
/// the task one encoding, as a real worker merges and encodes its batches;
/// copying the template for every batch, and freeing it, was half of the
/// workers' CPU time at 256 of them.
struct Synthetic {
    template: Stats,
    delay: Duration,
}

impl Synthetic {
    /// `tensors` as batch `batch`'s statistics.
    fn stamped(&self, batch: &Batch, job: &Job, tensors: BTreeMap<String, TensorStats>) -> Stats {
        Stats {
            provenance: job.provenance(batch.id),
            tensors,
        }
    }
}

impl Compute for Synthetic {
    fn observe(
        &self,
        _: &Model,
        batch: &Batch,
        job: &Job,
        _: &HiddenStates,
    ) -> Result<Stats, Failure> {
        std::thread::sleep(self.delay);
        Ok(self.stamped(batch, job, self.template.tensors.clone()))
    }

    fn observe_into(
        &self,
        target: &Model,
        batch: &Batch,
        job: &Job,
        hidden_states: &HiddenStates,
        task: &mut Option<Stats>,
    ) -> Result<(), Failure> {
        let Some(merged) = task else {
            *task = Some(self.observe(target, batch, job, hidden_states)?);
            return Ok(());
        };
        std::thread::sleep(self.delay);
        let fault = |e: qforge_core::Error| Failure::Worker(e.to_string());
        // Checked before anything changes, as `Stats::merge` does: on an
        // error the task's statistics stay as they were.
        for (name, tensor) in &self.template.tensors {
            match merged.tensors.get(name) {
                Some(into) => into.check_merge(tensor).map_err(fault)?,
                None => {
                    return Err(Failure::Worker(format!(
                        "the task's statistics lack tensor {name}"
                    )));
                }
            }
        }
        // The batch's id (no tensors: nothing copied), then the template's
        // tensors.
        merged
            .merge(
                &self.stamped(batch, job, BTreeMap::new()),
                MergePolicy::Strict,
            )
            .map_err(fault)?;
        for (name, tensor) in &self.template.tensors {
            if let Some(into) = merged.tensors.get_mut(name) {
                into.merge(tensor).map_err(fault)?;
            }
        }
        Ok(())
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("synthetic_worker: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, run, name, template, delay_ms] = args.as_slice() else {
        return Err("usage: synthetic_worker REDIS_URL RUN NAME TEMPLATE.qstats DELAY_MS".into());
    };
    let bytes = std::fs::read(template).map_err(|e| format!("cannot read {template}: {e}"))?;
    let stats = decode(&bytes).map_err(|e| format!("{template} is not a .qstats file: {e}"))?;
    let delay_ms: u64 = delay_ms
        .parse()
        .map_err(|_| format!("DELAY_MS must be a whole number of milliseconds, not {delay_ms}"))?;
    let options = WorkerOptions {
        redis: RedisAddress::new(url, None).map_err(|e| e.to_string())?,
        run: Some(run.clone()),
        name: name.clone(),
        forever: false,
        wait: Duration::from_secs(120),
        outage_limit: Duration::from_secs(60),
        key: ClusterKey::load(None).map_err(|e| e.to_string())?.0,
    };
    let mut synthetic = Synthetic {
        template: stats,
        delay: Duration::from_millis(delay_ms),
    };
    run_worker_with(&options, &mut synthetic, &mut |_| {}).map_err(|e| e.to_string())?;
    Ok(())
}
