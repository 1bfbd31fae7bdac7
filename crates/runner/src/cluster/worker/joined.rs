//! One worker in one run: joining it (the spec's files and plan checked,
//! the fingerprint admitted), the heartbeat that says it lives and names
//! the tasks it holds, and the loop that takes tasks (`take.rs`) and
//! executes them (`execute.rs`) until the run ends.

use std::cell::{Cell, RefCell};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use qforge_calib::Session;
use serde_json::json;

use super::{
    Compute, Current, Ending, JoinedRun, Prepared, Queue, WorkerOptions, WorkerReport, abbreviated,
    hostname,
};
use crate::cluster::auth::RunKey;
use crate::cluster::keys::{ACTIVE, RunKeys};
use crate::cluster::link::Link;
use crate::cluster::policy;
use crate::cluster::spec::RunSpec;
use crate::error::{Error, Result};
use qforge_core::{CpuTier, ObserveTier};

impl JoinedRun {
    /// Checks that `calibration` is what `spec` describes, applies the
    /// spec's transforms and computes the fingerprint (unless `fingerprint`
    /// already holds it for this pass's model).
    pub(super) fn join(
        options: &WorkerOptions,
        spec: RunSpec,
        run_key: RunKey,
        calibration: Session,
        fingerprint: Option<String>,
        log: &mut dyn FnMut(&str),
    ) -> Result<Self> {
        let run = spec.run.clone();
        let mismatch = |what: &str, found: String, expected: &str| {
            Error::Cluster(format!(
                "run {run}: this worker's {what} has sha256 {found} but the run expects {expected}; \
                 every worker must reach the same files (a shared filesystem)"
            ))
        };
        let model = calibration.model_digest.to_hex();
        if model != spec.model.sha256 {
            return Err(mismatch("model", model, &spec.model.sha256));
        }
        let data = calibration.data.digest.to_hex();
        if data != spec.data.sha256 {
            return Err(mismatch("data", data, &spec.data.sha256));
        }
        let job = calibration.job(&spec.recipe, &spec.transforms);
        if calibration.plan.digest().to_hex() != spec.plan_sha256 || job.planned != spec.planned {
            return Err(Error::Cluster(format!(
                "run {run}: this worker planned different batches than the coordinator; use the same qforge build"
            )));
        }
        let target = calibration
            .pass_target(&job)
            .map_err(|e| Error::Cluster(format!("run {run}: cannot build its model: {e}")))?;
        let fingerprint = match fingerprint {
            Some(known) => known,
            None => target.fingerprint()?.to_hex(),
        };
        log(&format!(
            "joining run {run} as {} (fingerprint {})",
            options.name,
            abbreviated(&fingerprint)
        ));
        Ok(Self {
            keys: RunKeys::new(&run)?,
            spec,
            run_key,
            calibration,
            prepared: Prepared { target, job },
            name: options.name.clone(),
            fingerprint,
            redis: options.redis.clone(),
            outage_limit: options.outage_limit,
            follows_active: options.run.is_none(),
            observed: Cell::new((0, Duration::ZERO)),
            routes: RefCell::default(),
            joined: Instant::now(),
        })
    }

    /// Registers, checks admission, then observes tasks until the run ends.
    pub(super) fn take_part(
        &mut self,
        link: &mut Link,
        compute: &dyn Compute,
        report: &mut WorkerReport,
        log: &mut dyn FnMut(&str),
    ) -> Result<Ending> {
        let keys = &self.keys;
        let fingerprint = &self.fingerprint;
        let reference: String = link.call(|c| {
            redis::pipe()
                .cmd("SET")
                .arg(keys.reference())
                .arg(fingerprint)
                .arg("NX")
                .ignore()
                .cmd("GET")
                .arg(keys.reference())
                .query::<(String,)>(c)
                .map(|(r,)| r)
        })?;
        let matches = &reference == fingerprint;
        let admitted = matches || self.spec.allow_mixed_hardware;
        let record = json!({
            "build": crate::BUILD,
            "kernel_tier": format!("{:?}", ObserveTier::detect()).to_lowercase(),
            "fingerprint": fingerprint,
            "host": hostname(),
            "pid": std::process::id(),
            "admitted": admitted,
        })
        .to_string();
        link.call(|c| {
            redis::cmd("HSET")
                .arg(keys.workers())
                .arg(&self.name)
                .arg(&record)
                .query::<i64>(c)
        })?;
        if !admitted {
            return Err(Error::Refused(format!(
                "this worker's determinism fingerprint {} differs from the run's {}: its forward pass \
                 computes different activations (another build or CPU), which would break byte-identical \
                 statistics; run workers on matching machines, or start the coordinator with \
                 --allow-mixed-hardware to accept results exact only up to forward-pass rounding",
                abbreviated(fingerprint),
                abbreviated(&reference)
            )));
        }
        if !matches {
            log("fingerprint differs from the run's reference; admitted (--allow-mixed-hardware)");
        }

        let current: Current = Arc::new(Mutex::new("-".into()));
        // Dropping `stop` wakes and ends the heartbeat thread at once.
        let (stop, stopped) = mpsc::channel::<()>();
        let heartbeat = self.start_heartbeat(current.clone(), stopped)?;
        // `report` counts every run this worker served; the log line is this run's.
        let before = (report.batches, report.speculative, report.reclaimed);
        let served = self.work(link, compute, &current, report);
        drop(stop);
        let _ = heartbeat.join();
        let _ = link.call(|c| {
            redis::cmd("DEL")
                .arg(self.keys.heartbeat(&self.name))
                .query::<i64>(c)
        });
        let ending = served?;
        match ending {
            Ending::Finished { .. } => log(&format!(
                "run {} finished; this worker observed {} batch(es) of it ({} speculative tasks, {} reclaimed)",
                self.spec.run,
                report.batches - before.0,
                report.speculative - before.1,
                report.reclaimed - before.2
            )),
            Ending::Abandoned => log(&format!(
                "run {} lost its coordinator and another run is active; moving on",
                self.spec.run
            )),
        }
        Ok(ending)
    }

    fn start_heartbeat(
        &self,
        current: Current,
        stopped: mpsc::Receiver<()>,
    ) -> Result<std::thread::JoinHandle<()>> {
        let mut link = Link::open(&self.redis, self.outage_limit)?;
        let key = self.keys.heartbeat(&self.name);
        let interval = Duration::from_millis(self.spec.heartbeat_ms);
        let ttl = self.spec.heartbeat_timeout_ms;
        let beat = move |link: &mut Link, value: &str| {
            link.call(|c| {
                redis::cmd("SET")
                    .arg(&key)
                    .arg(value)
                    .arg("PX")
                    .arg(ttl)
                    .query::<()>(c)
            })
        };
        beat(&mut link, "-")?;
        // The thread wakes only to beat: on a machine whose cores all run
        // the forward's matmul threads, frequent wake-ups (a 20 ms polling
        // loop) stalled the barrier-synchronised matmul and cost 20 % of a
        // SmolLM2 calibration's throughput on 2 cores.
        Ok(std::thread::spawn(move || {
            while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(interval) {
                let value = current.lock().map(|v| v.clone()).unwrap_or_default();
                if beat(&mut link, &value).is_err() {
                    // Redis is gone past the outage limit: the main loop will
                    // report it; stop beating so the worker reads as dead.
                    return;
                }
            }
        }))
    }

    /// Takes tasks and executes them until the run ends or is abandoned:
    /// a dead worker's task every [`Self::reclaim_every`], else the next
    /// queued one; with none queued, a dead worker's, else a straggler's
    /// (speculatively). The run's state and routes are reread at
    /// [`policy::check_state_now`].
    fn work(
        &self,
        link: &mut Link,
        compute: &dyn Compute,
        current: &Current,
        report: &mut WorkerReport,
    ) -> Result<Ending> {
        let every = self.reclaim_every();
        // The first check is at once: it learns whether the run routes
        // tasks to this worker.
        let mut last_state_check: Option<Instant> = None;
        let mut last_reclaim = Instant::now();
        let mut queue_gone = false;
        loop {
            if policy::check_state_now(queue_gone, last_state_check.map(|t| t.elapsed())) {
                last_state_check = Some(Instant::now());
                let (state, coordinator, routes): (Option<String>, bool, Vec<String>) =
                    link.call(|c| {
                        redis::pipe()
                            .cmd("GET")
                            .arg(self.keys.state())
                            .cmd("EXISTS")
                            .arg(self.keys.coordinator())
                            .cmd("SMEMBERS")
                            .arg(self.keys.routes())
                            .query(c)
                    })?;
                let mut routes = routes;
                // Sorted: looked up by binary search (a set's members come
                // in no order).
                routes.sort_unstable();
                *self.routes.borrow_mut() = routes;
                if state.as_deref() != Some("running") {
                    return Ok(Ending::Finished {
                        succeeded: state.as_deref() == Some("done"),
                    });
                }
                if self.follows_active && !coordinator && self.active_moved_on(link)? {
                    return Ok(Ending::Abandoned);
                }
                if std::mem::take(&mut queue_gone) {
                    // The coordinator is recreating the queue.
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
            if last_reclaim.elapsed() >= every {
                last_reclaim = Instant::now();
                if let Some(task) = self.reclaim(link, report)? {
                    report.reclaimed += 1;
                    self.execute(link, compute, current, &task, false, report)?;
                    continue;
                }
            }
            match self.next_task(link)? {
                Queue::Task(task) => {
                    self.execute(link, compute, current, &task, false, report)?;
                }
                Queue::Gone => queue_gone = true,
                Queue::Empty => {
                    if let Some(task) = self.reclaim(link, report)? {
                        report.reclaimed += 1;
                        self.execute(link, compute, current, &task, false, report)?;
                    } else if let Some(task) = self.speculate(link)? {
                        report.speculative += 1;
                        self.execute(link, compute, current, &task, true, report)?;
                    }
                }
            }
        }
    }

    /// Whether `qforge:active` names another run than this one (asked apart
    /// from the run's keys: on a Redis Cluster it lives in another slot).
    fn active_moved_on(&self, link: &mut Link) -> Result<bool> {
        let active: Option<String> = link.call(|c| redis::cmd("GET").arg(ACTIVE).query(c))?;
        Ok(active.as_deref() != Some(self.keys.run()))
    }

    /// How often this worker looks for dead workers' tasks (see
    /// [`policy::reclaim_every`]).
    pub(super) fn reclaim_every(&self) -> Duration {
        policy::reclaim_every(self.spec.heartbeat_timeout_ms)
    }

    /// Names the task being observed ("-": none) in the heartbeat at once,
    /// not only at the next beat, so the key never claims a finished task
    /// for long, nor misses a started one.
    pub(super) fn announce(&self, link: &mut Link, current: &Current, task: &str) -> Result<()> {
        if let Ok(mut c) = current.lock() {
            task.clone_into(&mut c);
        }
        link.call(|c| {
            redis::cmd("SET")
                .arg(self.keys.heartbeat(&self.name))
                .arg(task)
                .arg("PX")
                .arg(self.spec.heartbeat_timeout_ms)
                .query::<()>(c)
        })
    }
}
