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

use std::process::ExitCode;
use std::time::Duration;

use qforge_calib::{Batch, HiddenStates, Job};
use qforge_core::Stats;
use qforge_core::codec::decode;
use qforge_dist::Failure;
use qforge_dist::cluster::{Compute, RedisAddress, WorkerOptions, serve_with};
use qforge_model::Model;

/// Answers every batch with the template's tensors after `delay`. The
/// template is held as decoded (its histograms sparse, about 1 MB for
/// SmolLM2), so a batch costs the worker a copy of it, and a task of several
/// batches their merge and one encoding, as it costs a real worker.
struct Synthetic {
    template: Stats,
    delay: Duration,
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
        Ok(Stats {
            provenance: job.provenance(batch.id),
            tensors: self.template.tensors.clone(),
        })
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
    };
    let mut synthetic = Synthetic {
        template: stats,
        delay: Duration::from_millis(delay_ms),
    };
    serve_with(&options, &mut synthetic, &mut |_| {}).map_err(|e| e.to_string())?;
    Ok(())
}
