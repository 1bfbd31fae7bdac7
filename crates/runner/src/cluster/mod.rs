//! The Redis backend: a coordinator and any number of worker processes, on
//! any machines, meeting in a Redis 7 server.
//!
//! # Keys
//!
//! Every key of run `R` carries the hash tag `{R}`, so a Redis Cluster keeps a
//! run on one shard and multi-key commands stay legal. `qforge:active` lies in
//! another slot: no command names it beside a run key. Connections follow the
//! cluster's redirections (`link.rs`).
//!
//! | key                         | type   | holds                                              |
//! |-----------------------------|--------|----------------------------------------------------|
//! | `qforge:active`             | string | the run workers without `--run` join               |
//! | `qforge:{R}:spec`           | string | the [`RunSpec`] (JSON)                             |
//! | `qforge:{R}:state`          | string | `running`, `done` or `failed`                      |
//! | `qforge:{R}:coordinator`    | string | the live coordinator's token (TTL)                 |
//! | `qforge:{R}:tasks`          | stream | one entry per task (batches, ids); group `workers` |
//! | `qforge:{R}:tasks:{worker}` | stream | tasks routed to a worker (see "Routing"), as above |
//! | `qforge:{R}:routes`         | set    | the workers with a routed task stream              |
//! | `qforge:{R}:results`        | stream | a task's merged `.qstats`, or a batch's error; MAC |
//! | `qforge:{R}:hb:{worker}`    | string | heartbeat (TTL), naming the tasks held             |
//! | `qforge:{R}:workers`        | hash   | worker → build, kernel tier, fingerprint, admitted |
//! | `qforge:{R}:reference`      | string | the fingerprint workers must match                 |
//! | `qforge:{R}:speculative`    | string | batches re-executed speculatively (counter)        |
//! | `qforge:{R}:spec:{task}`    | string | who re-executes a task speculatively (TTL)         |
//! | `qforge:{P}:rounding:{d}`   | string | GPTQ's rounding with digest `d`, for pipeline `P`  |
//!
//! # Protocol
//!
//! The coordinator writes the spec, enqueues the pending batches as tasks of
//! one or more batches (sized so that it merges faster than the workers
//! publish; see [`RedisBackend`]), at most two tasks per live worker (or 64
//! batches) in flight at a time so that Redis holds the results of the tasks
//! in flight, never the plan's, and reads the results stream, handing every
//! result to the generic coordinator (which merges each batch id once, and
//! retries the unmerged batches of a result that also covers merged ones). A
//! worker reads tasks through the consumer group, observes their batches,
//! merges those that succeed into one result, appends it (and an error entry
//! per failed batch), then acknowledges the task;
//! a heartbeat thread refreshes its key every interval. A task pending past
//! the timeout on a worker whose heartbeat expired, or does not name it, is
//! claimed (`XCLAIM`) by another worker, between two of its own batches, and
//! observed after its own task's (each task keeps its own result):
//! liveness comes from the heartbeat, never from how long a task has been
//! pending, so a live worker on a slow batch keeps it. With the queue
//! empty, idle workers re-execute the oldest pending tasks speculatively
//! (those held more than twice as long as the idle worker would take over
//! their batches),
//! at most `(speculation − 1) × planned` times per run. Redis may lose the last
//! second of writes (AOF `everysec`): the coordinator periodically checks that
//! every unresolved batch still has a queued or pending task and re-enqueues
//! the ones that vanished, so a lost write costs a recomputation, never a
//! missing or doubled batch. When the run ends the coordinator deletes the
//! task streams, which wakes the workers blocked reading them: they see the
//! state at once, so a pipeline's next pass does not wait for their next
//! check (every 250 ms).
//!
//! # Roundings
//!
//! With `gptq.sequential`, each pass runs the layers GPTQ rounded before it
//! with their rounding, which only the coordinator computed. Before such a
//! pass opens, the coordinator publishes every rounding it names that Redis
//! does not hold yet, under the pipeline's run `P` (the spec's `pipeline`),
//! keyed by digest: each once, for every pass after it. A worker fetches the
//! ones it lacks before it joins, and checks each against the digest the
//! pass names. A batch's hidden states stay with the worker that computed
//! them: a worker resumes the deepest state of the batch it kept that is
//! still valid (computed through the layers as this pass rounds them), or
//! runs it from the embedding, through the rounded layers; the same bits
//! either way, but not the same time, so a pipeline routes each batch back
//! to the worker that ran it last.
//! The coordinator deletes the roundings when the pipeline's last pass
//! succeeds; a pipeline that stops early leaves them to expire after a day,
//! as its runs' keys do (a resumed coordinator rounds the same layers again
//! and finds them).
//!
//! # Routing
//!
//! Every pass of a pipeline after its first knows, from the results of the
//! passes before, which worker last ran each batch: its holder
//! ([`RedisBackend::routed`]). The coordinator gives each holder a task
//! stream of its own (`tasks:{worker}`, listed in `routes`) and enqueues a
//! batch there while its holder lives (presumed for one heartbeat timeout
//! after the pass opens, as workers join after it), else on the stream of
//! another live holder in turn; a worker that joins the pass late gets a
//! stream at the coordinator's next check. A worker reads its own stream,
//! then the shared one, then steals: from the routed stream with the most
//! unread tasks, if its owner has no heartbeat or a backlog worth the
//! layers the thief reruns, or from an owner stuck so long on its current
//! task that its oldest unread one is overdue. Only then does it wait on
//! its own stream. Its heartbeat names a
//! routed task as `{owner}/{id}` (ids of two streams may coincide). Workers
//! reclaim from the shared stream only; the coordinator, at each check,
//! takes back the tasks that dead workers hold on routed streams and
//! enqueues their batches on the shared stream, where the count of
//! deliveries that fails a batch killing every worker applies. Speculation
//! and reconciliation cover every stream.
//!
//! # Code
//!
//! `redis_backend.rs` (and `redis_backend/`) is the coordinator's side,
//! `worker.rs` (and `worker/`) the worker's. Both read Redis and carry out
//! what `policy.rs` decides: which task to take, whom to steal from, what
//! to reclaim or re-execute, how to size, pace and route tasks, and what a
//! dead worker or Redis lost. The decisions are plain functions of what was
//! read, tested table by table without a server.

mod auth;
mod keys;
mod link;
mod policy;
mod receive;
mod redis_backend;
mod rounding;
mod spec;
mod worker;

pub use auth::{ClusterKey, KEY_VARIABLE, MAC_FIELD, RunKey};
pub use keys::RunKeys;
pub use link::RedisAddress;
pub use redis_backend::{ClusterOptions, Pace, RedisBackend};
pub use spec::{FileRef, RunSpec};
pub use worker::{
    Compute, ModelForward, WorkerOptions, WorkerReport, hostname, run_worker, run_worker_with,
};
