//! The cluster's scheduling decisions, apart from Redis: where a worker
//! looks for its next task, whose tasks it steals, reclaims or re-executes
//! speculatively and how often it looks (`policy/worker.rs`); how the
//! coordinator sizes and paces tasks, routes a batch to the worker holding
//! its hidden states, takes back what a dead worker held and re-enqueues
//! what Redis lost (`policy/coordinator.rs`).
//!
//! Each decision is a plain function of what the caller read from Redis
//! (heartbeats, pending entries, backlogs, the time), so the worker and the
//! coordinator only read snapshots and carry decisions out, and each file's
//! tests check every threshold, table by table, without a server. The
//! protocol these decisions serve is described in the module doc of
//! `cluster/mod.rs`.

mod coordinator;
mod worker;

pub(crate) use coordinator::{
    Pacing, Routing, StreamTasks, abandoned, issue, per_task, reconcile, settle, smooth,
    unresolved, workers_counted,
};
pub(crate) use worker::{
    Claimed, Holder, RoutedBacklog, Source, Steal, StealSnapshot, Unread, check_state_now, claimed,
    is_straggler, overdue, reclaim_between_batches, reclaim_every, steal, straggler_floor,
    suspects, task_size, task_sources, within_speculation_budget,
};

/// What the tables of both files' tests are written in.
#[cfg(test)]
mod test_support {
    use std::time::Duration;

    /// The unit of the tables' times.
    pub(super) const MS: Duration = Duration::from_millis(1);

    /// Worker names, owned as Redis hands them back.
    pub(super) fn names(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| (*n).to_owned()).collect()
    }
}
