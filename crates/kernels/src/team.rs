//! A team of threads for many short parallel steps.
//!
//! A decode step runs ≈ 120 GEMVs of 10–200 µs each; handing each to rayon
//! costs a wake-up of an idle worker, and with SmolLM2 on 2 cores that cost
//! ate the second core's bandwidth (215 tokens/s on one thread, 206–211 on
//! two through rayon). A team's helpers instead spin on a shared counter
//! between steps, so a hand-off is a cache-line transfer, and park once the
//! team has been idle for [`SPIN_BEFORE_PARKING`].

use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::gemm::share;

/// How long an idle helper spins before it parks.
pub const SPIN_BEFORE_PARKING: Duration = Duration::from_micros(200);

/// A job's address with its lifetime erased; see [`Team::run`] for why that
/// is sound.
#[derive(Clone, Copy)]
struct JobRef(*const (dyn Fn(usize) + Sync + 'static));

// SAFETY: the job is `Sync`, so calling it from another thread is allowed;
// `Team::run` keeps it alive until every helper is done with it.
unsafe impl Send for JobRef {}

struct Shared {
    /// Bumped once per job; helpers run the job when it changes.
    epoch: AtomicUsize,
    /// Helpers done with the current job.
    finished: AtomicUsize,
    job: Mutex<Option<JobRef>>,
    /// Per helper: parked (or about to park) and needs an unpark.
    parked: Vec<AtomicBool>,
    panicked: AtomicBool,
    quit: AtomicBool,
}

/// The calling thread plus `threads − 1` spinning helpers (see the module
/// docs). Dropping the team stops and joins the helpers.
pub struct Team {
    shared: Arc<Shared>,
    helpers: Vec<JoinHandle<()>>,
    /// [`Team::run_rows_by_cost`]'s first row of each thread's share (and
    /// the end), kept so that a run allocates nothing.
    bounds: Vec<usize>,
}

impl std::fmt::Debug for Team {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Team")
            .field("threads", &self.threads())
            .finish()
    }
}

impl Team {
    /// A team of `threads` (at least 1: the caller alone).
    pub fn new(threads: usize) -> std::io::Result<Self> {
        let helpers = threads.max(1) - 1;
        let shared = Arc::new(Shared {
            epoch: AtomicUsize::new(0),
            finished: AtomicUsize::new(0),
            job: Mutex::new(None),
            parked: (0..helpers).map(|_| AtomicBool::new(false)).collect(),
            panicked: AtomicBool::new(false),
            quit: AtomicBool::new(false),
        });
        let mut team = Self {
            shared,
            helpers: Vec::with_capacity(helpers),
            bounds: Vec::with_capacity(helpers + 2),
        };
        for index in 0..helpers {
            let shared = Arc::clone(&team.shared);
            // On an error `team` drops here, which stops the helpers started.
            team.helpers.push(
                std::thread::Builder::new()
                    .name(format!("qforge-team-{}", index + 1))
                    .spawn(move || helper(&shared, index))?,
            );
        }
        Ok(team)
    }

    /// Threads in the team, the caller included.
    pub fn threads(&self) -> usize {
        self.helpers.len() + 1
    }

    /// Cuts `data` into [`Team::threads`] chunks, each a whole number of
    /// `unit`s and as equal as units allow (a remainder shorter than a unit
    /// goes to nobody), and runs `f(start, chunk)` for each, where `start` is
    /// the chunk's first index in `data`; the first chunk runs on the caller.
    /// Returns when all are done.
    ///
    /// # Panics
    /// If `unit` is 0, or if `f` panicked on any thread.
    pub fn run_chunks<T: Send, F: Fn(usize, &mut [T]) + Sync>(
        &mut self,
        data: &mut [T],
        unit: usize,
        f: F,
    ) {
        assert!(unit > 0, "run_chunks: a unit of 0 elements");
        let units = data.len() / unit;
        self.run_rows(units, [&mut data[..units * unit]], |rows, [chunk]| {
            f(rows.start * unit, chunk)
        });
    }

    /// Runs `f(rows, chunks)` on every thread for its share of `0..rows`
    /// (as equal as whole rows allow; the first share on the caller), where
    /// `chunks[b]` is those rows of `buffers[b]`, a buffer of `rows` rows of
    /// `buffers[b].len() / rows` values each: one parallel pass that writes
    /// the same rows of several buffers. Returns when all are done.
    ///
    /// # Panics
    /// If a buffer's length is not a multiple of `rows`, or if `f` panicked
    /// on any thread.
    pub fn run_rows<T: Send, const B: usize, F>(
        &mut self,
        rows: usize,
        buffers: [&mut [T]; B],
        f: F,
    ) where
        F: Fn(Range<usize>, [&mut [T]; B]) + Sync,
    {
        let threads = self.threads();
        self.run_shares(rows, buffers, |thread| share(rows, threads, thread), f);
    }

    /// [`Team::run_rows`] with shares of near-equal cost instead of
    /// near-equal length: row `r` costs `cost(r)`, and each thread takes
    /// the consecutive whole rows whose costs start in its `1 / threads` of
    /// the total. For passes whose rows differ in work, such as attention
    /// over caches of different lengths, where equal rows leave one thread
    /// waiting for the other.
    ///
    /// # Panics
    /// As [`Team::run_rows`].
    pub fn run_rows_by_cost<T: Send, const B: usize, F, C>(
        &mut self,
        rows: usize,
        cost: C,
        buffers: [&mut [T]; B],
        f: F,
    ) where
        F: Fn(Range<usize>, [&mut [T]; B]) + Sync,
        C: Fn(usize) -> usize + Sync,
    {
        // The bounds are found here, once, so that the shares are disjoint
        // whatever `cost` returns.
        let threads = self.threads();
        let mut bounds = std::mem::take(&mut self.bounds);
        bounds.clear();
        bounds.push(0);
        let total: usize = (0..rows).map(&cost).sum();
        let mut before = 0;
        for r in 0..rows {
            // Row `r` goes to the thread whose part of the total holds the
            // cost before it: thread `t` owns [total·t, total·(t+1)) / threads.
            let owner = (before * threads).checked_div(total).unwrap_or(0);
            while bounds.len() <= owner.min(threads - 1) {
                bounds.push(r);
            }
            before += cost(r);
        }
        bounds.resize(threads + 1, rows);
        let share_by_cost = |thread: usize| bounds[thread]..bounds[thread + 1];
        self.run_shares(rows, buffers, share_by_cost, f);
        self.bounds = bounds;
    }

    /// Runs `f(share(thread), chunks)` on every thread, where the shares
    /// are disjoint ranges of `0..rows` and `chunks[b]` is those rows of
    /// `buffers[b]` (see [`Team::run_rows`]).
    fn run_shares<T: Send, const B: usize, F, S>(
        &mut self,
        rows: usize,
        buffers: [&mut [T]; B],
        share: S,
        f: F,
    ) where
        F: Fn(Range<usize>, [&mut [T]; B]) + Sync,
        S: Fn(usize) -> Range<usize> + Sync,
    {
        let widths = buffers.each_ref().map(|b| {
            assert!(
                rows > 0 && b.len().is_multiple_of(rows) || b.is_empty(),
                "run_rows: a buffer of {} values is not {rows} whole rows",
                b.len()
            );
            b.len().checked_div(rows).unwrap_or(0)
        });
        let bases = buffers.map(|b| SendPtr(b.as_mut_ptr()));
        self.run(&|thread| {
            let share = share(thread);
            // SAFETY: every thread index runs exactly once per `run`, the
            // shares of distinct threads are disjoint row ranges, so their
            // chunks are disjoint ranges of each buffer, and every buffer is
            // borrowed mutably for the whole run.
            let chunks = std::array::from_fn(|b| unsafe {
                std::slice::from_raw_parts_mut(
                    bases[b].0.add(share.start * widths[b]),
                    share.len() * widths[b],
                )
            });
            f(share, chunks);
        });
    }

    fn run(&mut self, job: &(dyn Fn(usize) + Sync)) {
        if self.helpers.is_empty() {
            job(0);
            return;
        }
        let shared = &*self.shared;
        // SAFETY: only the lifetime is erased. The helpers call the job only
        // between the epoch bump below and their `finished` increment, and
        // this function does not return, nor unwind, before every helper has
        // incremented `finished` (the `WaitForHelpers` guard).
        let erased: *const (dyn Fn(usize) + Sync + 'static) =
            unsafe { std::mem::transmute(job as *const (dyn Fn(usize) + Sync)) };
        *lock(&shared.job) = Some(JobRef(erased));
        shared.finished.store(0, Ordering::Relaxed);
        shared.panicked.store(false, Ordering::Relaxed);
        shared.epoch.fetch_add(1, Ordering::SeqCst);
        for (handle, parked) in self.helpers.iter().zip(&shared.parked) {
            if parked.load(Ordering::SeqCst) {
                handle.thread().unpark();
            }
        }
        let wait = WaitForHelpers {
            shared,
            helpers: &self.helpers,
        };
        job(0);
        drop(wait);
        if shared.panicked.swap(false, Ordering::Relaxed) {
            panic!("a thread of the decode team panicked");
        }
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        self.shared.quit.store(true, Ordering::SeqCst);
        self.shared.epoch.fetch_add(1, Ordering::SeqCst);
        for handle in self.helpers.drain(..) {
            handle.thread().unpark();
            // A helper catches the jobs' panics, so join has nothing to report.
            let _ = handle.join();
        }
    }
}

struct SendPtr<T>(*mut T);

// SAFETY: used only by `run_rows`, whose chunks are disjoint.
unsafe impl<T: Send> Sync for SendPtr<T> {}

/// Waits, also while unwinding, until every helper has finished the job.
struct WaitForHelpers<'a> {
    shared: &'a Shared,
    helpers: &'a [JoinHandle<()>],
}

impl Drop for WaitForHelpers<'_> {
    fn drop(&mut self) {
        let mut spins = 0u32;
        while self.shared.finished.load(Ordering::Acquire) < self.helpers.len() {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) {
                // A helper may have been descheduled: let it run. One that
                // parked without seeing the job (which the protocol rules
                // out, but an emulator once broke) is woken again: a hang
                // costs more than a spare unpark.
                for (handle, parked) in self.helpers.iter().zip(&self.shared.parked) {
                    if parked.load(Ordering::SeqCst) {
                        handle.thread().unpark();
                    }
                }
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        *lock(&self.shared.job) = None;
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // The lock guards a plain pointer; a panic cannot leave it half-written.
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn helper(shared: &Shared, index: usize) {
    let mut seen = 0;
    loop {
        let mut idle_since = Instant::now();
        let mut spins = 0u32;
        loop {
            let epoch = shared.epoch.load(Ordering::Acquire);
            if epoch != seen {
                seen = epoch;
                break;
            }
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(256) {
                std::hint::spin_loop();
            } else if idle_since.elapsed() >= SPIN_BEFORE_PARKING {
                // Announce first, then look again: `run` bumps the epoch
                // before it reads `parked`, so one of the two sees the other.
                shared.parked[index].store(true, Ordering::SeqCst);
                // The language's model already orders a SeqCst store before a
                // SeqCst load, and so does Armv8 hardware; qemu-aarch64 on an
                // x86-64 host does not (it emits a release store and an
                // acquire load, which x86 lets pass each other). There this
                // helper parked unseen and the test suite hung. A full fence
                // is an `mfence` there, and costs nothing that matters on a
                // path that is about to sleep.
                std::sync::atomic::fence(Ordering::SeqCst);
                if shared.epoch.load(Ordering::SeqCst) == seen {
                    std::thread::park();
                }
                shared.parked[index].store(false, Ordering::SeqCst);
                idle_since = Instant::now();
            }
        }
        if shared.quit.load(Ordering::SeqCst) {
            return;
        }
        let job = *lock(&shared.job);
        if let Some(JobRef(job)) = job {
            // SAFETY: see `Team::run`: the job outlives this call.
            let outcome = catch_unwind(AssertUnwindSafe(|| unsafe { (*job)(index + 1) }));
            if outcome.is_err() {
                shared.panicked.store(true, Ordering::Relaxed);
            }
        }
        shared.finished.fetch_add(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_thread_gets_its_own_chunk_once_per_run() {
        for threads in [1, 2, 3] {
            let mut team = Team::new(threads).unwrap();
            let mut data = vec![0usize; threads * 10 + 1];
            for round in 1..=200 {
                team.run_chunks(&mut data, 2, |start, chunk| {
                    let thread = start / 10;
                    assert_eq!(chunk.len(), 10);
                    for v in chunk {
                        *v += thread + 1;
                    }
                });
                if round == 100 {
                    // Long enough for the helpers to park.
                    std::thread::sleep(SPIN_BEFORE_PARKING * 5);
                }
            }
            let want: Vec<usize> = (0..data.len())
                .map(|i| {
                    if i / 10 < threads {
                        200 * (i / 10 + 1)
                    } else {
                        0
                    }
                })
                .collect();
            assert_eq!(data, want);
        }
    }

    #[test]
    fn shares_by_cost_cover_every_row_once_and_balance_the_cost() {
        for threads in [1, 2, 3] {
            let mut team = Team::new(threads).unwrap();
            // One expensive row, then many cheap ones: equal rows would
            // give the first thread most of the work.
            let cost = |r: usize| if r == 0 { 90 } else { 1 + r % 3 };
            let rows = 60;
            let mut owner = vec![usize::MAX; rows];
            team.run_rows_by_cost(rows, cost, [&mut owner], |share, [owner]| {
                let thread = std::thread::current().name().map_or(0, |name| {
                    name.rsplit('-')
                        .next()
                        .and_then(|i| i.parse().ok())
                        .unwrap_or(0)
                });
                for (o, r) in owner.iter_mut().zip(share) {
                    assert_eq!(*o, usize::MAX, "row {r} given twice");
                    *o = thread;
                }
            });
            assert!(owner.iter().all(|&o| o < threads), "{owner:?}");
            // Row `r` belongs to the thread whose part of the total holds
            // the cost before it.
            let total: usize = (0..rows).map(cost).sum();
            let mut before = 0;
            for (r, &o) in owner.iter().enumerate() {
                assert_eq!(o, (before * threads / total).min(threads - 1), "row {r}");
                before += cost(r);
            }
            if threads == 2 {
                // The expensive row's thread takes far fewer rows.
                assert!(owner.iter().filter(|&&o| o == 0).count() < rows / 3);
            }
            // Rows without cost all go to the first thread.
            let mut none = vec![usize::MAX; 4];
            team.run_rows_by_cost(
                4,
                |_| 0,
                [&mut none],
                |share, [none]| {
                    none.fill(share.start);
                },
            );
            assert_eq!(none, vec![0; 4]);
        }
    }

    #[test]
    fn chunks_are_whole_units_and_as_equal_as_units_allow() {
        let mut team = Team::new(2).unwrap();
        // Nine heads of four values over two threads: four and five heads.
        let mut data = vec![0usize; 9 * 4 + 3];
        team.run_chunks(&mut data, 4, |start, chunk| chunk.fill(start + chunk.len()));
        assert_eq!(&data[..16], &[16; 16]);
        assert_eq!(&data[16..36], &[36; 20]);
        assert_eq!(&data[36..], &[0; 3]);
    }

    #[test]
    fn a_panic_on_a_helper_reaches_the_caller_and_the_team_goes_on() {
        let mut team = Team::new(2).unwrap();
        let mut data = [0u8; 2];
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            team.run_chunks(&mut data, 1, |start, _| {
                if start == 1 {
                    panic!("boom");
                }
            })
        }));
        assert!(outcome.is_err());
        team.run_chunks(&mut data, 1, |_, chunk| chunk[0] = 7);
        assert_eq!(data, [7, 7]);
    }
}
