//! Where the passes of a pipeline run. An [`Executor`] runs one pass at a
//! time: it opens a [`Backend`] for the pass's job (the model after the
//! transforms earlier passes implied) and lets the coordinator merge its
//! results. The embedded executor observes on threads of this process; the
//! Redis executor publishes each pass as a run that `qforge worker`
//! processes serve, chaining the runs so the workers follow every pass.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::num::NonZeroUsize;
use std::time::Duration;

use qforge_calib::{Job, Pass, Session, Weights};

use crate::backend::Embedded;
use crate::cluster::{ClusterKey, ClusterOptions, Pace, RedisAddress, RedisBackend, RunSpec};
use crate::coordinator::{RunOptions, run};
use crate::error::{Error, Result};
use crate::record::{Progress, RunSummary};

/// A pass's place in its pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PassPosition {
    /// 1-based index.
    pub index: usize,
    /// Passes in the pipeline.
    pub count: usize,
}

impl PassPosition {
    /// The only pass of a single-pass calibration.
    pub const ONLY: PassPosition = PassPosition { index: 1, count: 1 };
}

/// What a pass reports while it runs.
#[derive(Debug, Clone)]
pub enum PassEvent {
    /// The pass is open for work. `run` names the Redis run workers join
    /// (`None` on the embedded backend).
    Opened {
        /// The Redis run, if any.
        run: Option<String>,
        /// Batches planned.
        batches: usize,
    },
    /// After each outcome the coordinator handled.
    Progress(Progress),
}

/// What a calibration (one pass, or a pipeline's) reports while it runs.
/// Every method has a default that ignores the event, so `()` listens to
/// nothing.
pub trait Listener {
    /// A line of progress for a person (`warning: …` for a warning).
    fn message(&mut self, _line: &str) {}
    /// An event of calibration pass `pass`.
    fn pass_event(&mut self, _pass: PassPosition, _event: &PassEvent) {}
}

impl Listener for () {}

/// Runs the passes of a calibration pipeline, one at a time.
pub trait Executor {
    /// `embedded` or `redis`, as reports name the backend.
    fn name(&self) -> &'static str;

    /// Whether the process driving this executor needs the model's weights
    /// to run a pass (a Redis coordinator only plans; its workers observe).
    fn weights(&self) -> Weights;

    /// Runs `job` over the plan of `session` as pass `position`, merging
    /// every batch exactly once.
    fn run_pass(
        &self,
        session: &Session,
        job: &Job,
        position: PassPosition,
        options: &RunOptions,
        events: &mut dyn FnMut(PassEvent),
    ) -> Result<RunSummary>;

    /// Says that pass `position`, which the pass before it named as its
    /// successor, will not run (a method search stopped before it), so that
    /// workers following the pipeline leave instead of waiting for it.
    /// `job` is what the spec of the skipped pass records. Threads here
    /// follow nothing: the default does nothing.
    fn skip_pass(&self, _session: &Session, _job: &Job, _position: PassPosition) -> Result<()> {
        Ok(())
    }

    /// How many workers ran the pass `summary` records: by default those
    /// that reported.
    fn workers(&self, summary: &RunSummary) -> usize {
        summary.workers.len()
    }
}

/// Worker threads in this process (the default: no services needed).
#[derive(Debug, Clone, Copy)]
pub struct EmbeddedExecutor {
    /// Worker threads (at least 1).
    pub threads: usize,
}

impl EmbeddedExecutor {
    /// One thread per available core.
    pub fn per_core() -> Self {
        Self {
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }
}

impl Executor for EmbeddedExecutor {
    fn name(&self) -> &'static str {
        "embedded"
    }

    fn weights(&self) -> Weights {
        Weights::Load
    }

    fn run_pass(
        &self,
        session: &Session,
        job: &Job,
        _position: PassPosition,
        options: &RunOptions,
        events: &mut dyn FnMut(PassEvent),
    ) -> Result<RunSummary> {
        let backend = Embedded::new(session.pass_target(job)?, job.clone(), self.threads)
            .with_hidden_states(session.hidden_states.clone());
        events(PassEvent::Opened {
            run: None,
            batches: session.plan.batches.len(),
        });
        run(job, &session.plan, &backend, options, &mut |p| {
            events(PassEvent::Progress(p))
        })
    }
    /// Every thread, whether or not a batch reached it.
    fn workers(&self, _summary: &RunSummary) -> usize {
        self.threads
    }
}

/// How a Redis run admits and watches its workers.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterSettings {
    /// Workers heartbeat this often.
    pub heartbeat: Duration,
    /// A worker silent this long is dead and its batch is redone elsewhere.
    pub heartbeat_timeout: Duration,
    /// Admit workers whose determinism fingerprint differs from the first
    /// worker's (the statistics are then exact only up to forward-pass
    /// rounding, and say so).
    pub allow_mixed_hardware: bool,
    /// Cap on executions as a multiple of the planned batches.
    pub speculation: f64,
    /// Give up when Redis stays unreachable this long.
    pub outage_limit: Duration,
    /// Batches per task; `None`: sized from what the run measures (see
    /// [`RedisBackend`]).
    pub batches_per_task: Option<NonZeroUsize>,
}

impl Default for ClusterSettings {
    fn default() -> Self {
        Self {
            heartbeat: Duration::from_millis(500),
            heartbeat_timeout: Duration::from_millis(2000),
            allow_mixed_hardware: false,
            speculation: 1.2,
            outage_limit: Duration::from_secs(60),
            batches_per_task: None,
        }
    }
}

impl ClusterSettings {
    /// Checks the values; the error says which flag is wrong.
    pub fn validate(&self) -> Result<()> {
        if self.heartbeat.is_zero() || self.heartbeat_timeout <= self.heartbeat {
            return Err(Error::Request(
                "the heartbeat timeout must exceed the heartbeat interval, which must be at least 1 ms"
                    .into(),
            ));
        }
        if !(1.0..=2.0).contains(&self.speculation) || self.outage_limit.is_zero() {
            return Err(Error::Request(
                "speculation must be in [1, 2] and the outage limit positive".into(),
            ));
        }
        Ok(())
    }
}

/// A Redis server that `qforge worker` processes serve. Pass 1 of run `R`
/// runs as run `R`, pass k > 1 as `R.passk`; each pass's spec names the
/// next, and its workers follow.
#[derive(Debug, Clone)]
pub struct RedisExecutor {
    redis: RedisAddress,
    key: ClusterKey,
    run: Option<String>,
    resume: bool,
    settings: ClusterSettings,
    /// The last pace each kind of pass measured ([`pass_kind`]): a
    /// `--sequential` pipeline runs one pass of each kind per layer, and a
    /// pass too short to measure its own would run one batch a task.
    paces: RefCell<BTreeMap<String, Pace>>,
    /// The worker whose result last covered each batch, over the passes
    /// run so far: each pass routes a batch's tasks to the worker holding
    /// its hidden states.
    holders: RefCell<BTreeMap<usize, String>>,
}

impl RedisExecutor {
    /// Passes published on the Redis at `redis`, pass 1 as run `run`
    /// (`None`: the session's [`Session::run_name`]), sealed under run keys
    /// derived from `key`; `resume` continues each pass's results and
    /// workers instead of starting clean.
    pub fn new(
        redis: RedisAddress,
        key: ClusterKey,
        run: Option<String>,
        resume: bool,
        settings: ClusterSettings,
    ) -> Self {
        Self {
            redis,
            key,
            run,
            resume,
            settings,
            paces: RefCell::default(),
            holders: RefCell::default(),
        }
    }

    /// The spec of pass `position` of `job` over `session`, with the run of
    /// the pass after it, if any, for the workers to follow.
    fn spec(&self, session: &Session, job: &Job, position: PassPosition) -> Result<RunSpec> {
        self.settings.validate()?;
        let mut spec = RunSpec::new(&self.pass_run(session, position.index), session, job)?;
        spec.pipeline = self.pass_run(session, 1);
        spec.next_pass =
            (position.index < position.count).then(|| self.pass_run(session, position.index + 1));
        let s = &self.settings;
        spec.heartbeat_ms = s.heartbeat.as_millis() as u64;
        spec.heartbeat_timeout_ms = s.heartbeat_timeout.as_millis() as u64;
        spec.allow_mixed_hardware = s.allow_mixed_hardware;
        spec.speculation = s.speculation;
        Ok(spec)
    }

    /// How the coordinator reaches Redis.
    fn cluster_options(&self) -> ClusterOptions {
        ClusterOptions {
            redis: self.redis.clone(),
            resume: self.resume,
            outage_limit: self.settings.outage_limit,
            batches_per_task: self.settings.batches_per_task,
            key: self.key.clone(),
        }
    }

    /// The Redis run of pass `index` (1-based) over `session`.
    pub fn pass_run(&self, session: &Session, index: usize) -> String {
        let run = self.run.clone().unwrap_or_else(|| session.run_name());
        if index == 1 {
            run
        } else {
            format!("{run}.pass{index}")
        }
    }
}

impl Executor for RedisExecutor {
    fn name(&self) -> &'static str {
        "redis"
    }

    fn weights(&self) -> Weights {
        Weights::Skip
    }

    fn run_pass(
        &self,
        session: &Session,
        job: &Job,
        position: PassPosition,
        options: &RunOptions,
        events: &mut dyn FnMut(PassEvent),
    ) -> Result<RunSummary> {
        let spec = self.spec(session, job, position)?;
        let run_name = spec.run.clone();
        let kind = pass_kind(&spec.recipe.pass);
        let mut backend = RedisBackend::open(spec, &self.cluster_options(), &session.rounded)?;
        if let Some(&pace) = self.paces.borrow().get(&kind) {
            backend = backend.paced(pace);
        }
        if !self.holders.borrow().is_empty() {
            backend = backend.routed(self.holders.take());
        }
        events(PassEvent::Opened {
            run: Some(run_name),
            batches: session.plan.batches.len(),
        });
        let summary = run(job, &session.plan, &backend, options, &mut |p| {
            events(PassEvent::Progress(p))
        });
        backend.finish(summary.is_ok())?;
        if let Some(pace) = backend.pace() {
            self.paces.borrow_mut().insert(kind, pace);
        }
        *self.holders.borrow_mut() = backend.holders();
        summary
    }

    fn skip_pass(&self, session: &Session, job: &Job, position: PassPosition) -> Result<()> {
        let mut spec = self.spec(session, job, position)?;
        spec.next_pass = None;
        RedisBackend::skip(spec, &self.cluster_options())
    }
}

/// What a pass observes, its layers' numbers left out: the passes of a
/// `--sequential` pipeline at every depth are of a few kinds, whose
/// results and batches take alike (SmolLM2's `down_proj` pass: a 1 536-wide
/// Gram, 18.9 MB a result, where its other passes' are 576 wide).
fn pass_kind(pass: &Pass) -> String {
    let mut kind = pass.name().to_owned();
    let points = match pass {
        Pass::Hessian(hessian) | Pass::ActivationAndHessian(hessian) => hessian.points.keys(),
        Pass::Activation | Pass::Smoothing => Default::default(),
    };
    for point in points {
        kind.push(' ');
        let mut in_number = false;
        for c in point.chars() {
            if !c.is_ascii_digit() {
                kind.push(c);
            } else if !in_number {
                kind.push('#');
            }
            in_number = c.is_ascii_digit();
        }
    }
    kind
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use qforge_calib::{HessianPass, Pass};

    use super::pass_kind;

    fn hessian(points: &[&str]) -> Pass {
        Pass::Hessian(HessianPass {
            points: points.iter().map(|p| (p.to_string(), -20)).collect(),
            rounded: BTreeMap::new(),
        })
    }

    #[test]
    fn passes_of_one_kind_at_any_depth_share_their_kind() {
        let down = |layer: usize| hessian(&[&format!("model.layers.{layer}.mlp.down_proj")]);
        assert_eq!(pass_kind(&down(3)), pass_kind(&down(117)));
        assert_eq!(pass_kind(&down(3)), "hessian model.layers.#.mlp.down_proj");
        let gate_up = hessian(&["model.layers.3.mlp.gate_proj", "model.layers.3.mlp.up_proj"]);
        assert_ne!(pass_kind(&gate_up), pass_kind(&down(3)));
        assert_ne!(pass_kind(&Pass::Activation), pass_kind(&Pass::Smoothing));
    }
}
