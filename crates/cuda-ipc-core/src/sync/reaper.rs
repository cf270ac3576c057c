//! Deferred destruction: drops that never wait.
//!
//! Memory that the GPU may still use cannot be unmapped or freed, and a
//! lease cannot be given back to its publisher, until the work queued on it
//! has finished. Waiting for that in `Drop` would block the dropping thread
//! (in Python: with the GIL held) on the GPU, and on a publisher's fence
//! that may never be written. So a drop **retires** what it owned instead:
//!
//! 1. it records an event on every stream that used the memory (a few
//!    microseconds, no wait), or, where the streams are not known (memory
//!    handed to PyTorch or CuPy, which queue work on streams of their own),
//!    asks for a barrier over the whole context;
//! 2. it hands the finishing step (the unmap, the free, the lease release)
//!    to this module's reaper thread, and returns.
//!
//! The reaper polls the events (`cuEventQuery`) and runs each finishing
//! step once its work is done, in the order the steps became ready.
//! Context barriers run on a second thread (`cuCtxSynchronize`), batched:
//! one synchronisation serves every barrier asked for before it started.
//! The model is wgpu-core's life tracker (`device/life.rs`): a resource the
//! GPU may still use is parked with the work it waits for and freed by a
//! later poll.
//!
//! Nothing is ever finished early, and a driver call that fails never
//! counts as work done. A step whose event cannot be created, recorded or
//! queried (no memory for an event, a context that cannot be made
//! current) waits for a barrier over its whole context instead; a step
//! whose barrier fails too is kept, never run, for as long as the process
//! lives (logged as an error): what it holds leaks rather than being freed
//! under work that may still run. Work that never completes (a stream
//! waiting on the fence of a publisher that died) keeps its memory for as
//! long as the process lives, and the reaper logs it, once after
//! 10 seconds and then every minute, naming what waits. Finishing
//! steps that talk to a peer (a lease release) send without waiting for an
//! answer, within the channel's request timeout.
//!
//! [`settle`] waits (with a deadline) until everything retired so far is
//! finished: for tests and programs that check memory or descriptor counts
//! after dropping what they held. [`retiring`] says how many steps wait.
#![warn(missing_docs)]

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

use crate::error::{Error, from_cudarc};

/// How long a retired step may wait for its work before the reaper logs it.
pub(crate) const STALL_WARNING: Duration = Duration::from_secs(10);

/// How often a step still waiting is logged again.
const STALL_REPEAT: Duration = Duration::from_secs(60);

/// The longest nap between two polls of the events while steps wait.
const MAX_NAP: Duration = Duration::from_millis(1);

/// The first nap after a poll that found nothing done.
const FIRST_NAP: Duration = Duration::from_micros(20);

/// Events kept for reuse per context.
const EVENT_POOL: usize = 256;

type Finish = Box<dyn FnOnce() + Send>;

/// The driver calls the reaper makes: the CUDA driver in the library
/// ([`Cuda`]), a stand-in in the tests that makes them fail on purpose.
pub(crate) trait Driver: Send + Sync + 'static {
    /// A context: what a barrier synchronises.
    type Context: Clone + Send + 'static;
    /// A stream: where an event is recorded.
    type Stream;
    /// An event recorded on a stream.
    type Event: Send + 'static;

    /// The context of `stream`.
    fn context_of(&self, stream: &Self::Stream) -> Self::Context;
    /// A number that tells contexts apart.
    fn context_id(&self, ctx: &Self::Context) -> usize;
    /// A number that tells streams apart.
    fn stream_id(&self, stream: &Self::Stream) -> usize;
    /// The id of the context `event` was made in.
    fn event_context_id(&self, event: &Self::Event) -> usize;
    /// A new event in `ctx`.
    fn new_event(&self, ctx: &Self::Context) -> Result<Self::Event, Error>;
    /// Records `event` (of `stream`'s context) after the work queued on `stream`.
    fn record(&self, event: &Self::Event, stream: &Self::Stream) -> Result<(), Error>;
    /// Makes `ctx` current on this thread (before [`Driver::query`]).
    fn bind(&self, ctx: &Self::Context) -> Result<(), Error>;
    /// Whether the work `event` was recorded after has completed.
    fn query(&self, event: &Self::Event) -> Result<bool, Error>;
    /// Waits for the work recorded by `event`.
    fn wait(&self, event: &Self::Event) -> Result<(), Error>;
    /// Waits for every stream of `ctx` (a barrier).
    fn synchronize(&self, ctx: &Self::Context) -> Result<(), Error>;
}

/// The CUDA driver, through cudarc.
pub(crate) struct Cuda;

impl Driver for Cuda {
    type Context = Arc<CudaContext>;
    type Stream = Arc<CudaStream>;
    type Event = CudaEvent;

    fn context_of(&self, stream: &Arc<CudaStream>) -> Arc<CudaContext> {
        stream.context().clone()
    }
    fn context_id(&self, ctx: &Arc<CudaContext>) -> usize {
        ctx.cu_ctx() as usize
    }
    fn stream_id(&self, stream: &Arc<CudaStream>) -> usize {
        stream.cu_stream() as usize
    }
    fn event_context_id(&self, event: &CudaEvent) -> usize {
        event.context().cu_ctx() as usize
    }
    fn new_event(&self, ctx: &Arc<CudaContext>) -> Result<CudaEvent, Error> {
        ctx.new_event(None)
            .map_err(|e| from_cudarc("cuEventCreate", e))
    }
    fn record(&self, event: &CudaEvent, stream: &Arc<CudaStream>) -> Result<(), Error> {
        event
            .record(stream)
            .map_err(|e| from_cudarc("cuEventRecord", e))
    }
    fn bind(&self, ctx: &Arc<CudaContext>) -> Result<(), Error> {
        ctx.bind_to_thread()
            .map_err(|e| from_cudarc("cuCtxSetCurrent", e))
    }
    fn query(&self, event: &CudaEvent) -> Result<bool, Error> {
        event
            .try_is_complete()
            .map_err(|e| from_cudarc("cuEventQuery", e))
    }
    fn wait(&self, event: &CudaEvent) -> Result<(), Error> {
        event
            .synchronize()
            .map_err(|e| from_cudarc("cuEventSynchronize", e))
    }
    fn synchronize(&self, ctx: &Arc<CudaContext>) -> Result<(), Error> {
        ctx.synchronize()
            .map_err(|e| from_cudarc("cuCtxSynchronize", e))
    }
}

/// A step parked until its events have completed.
struct Parked<D: Driver> {
    what: &'static str,
    events: Vec<D::Event>,
    /// The contexts of the streams it waits for: bound before its events
    /// are queried, and synchronised instead if a query fails.
    ctxs: Vec<D::Context>,
    finish: Finish,
    since: Instant,
    warned: Option<Instant>,
}

/// A step waiting for a barrier over whole contexts.
struct Barrier<D: Driver> {
    what: &'static str,
    ctxs: Vec<D::Context>,
    finish: Finish,
}

struct State<D: Driver> {
    /// Steps waiting for their events, not being polled now.
    parked: Vec<Parked<D>>,
    /// Steps waiting for a context barrier, not being run now.
    barriers: Vec<Barrier<D>>,
    /// Steps a reaper thread has taken and not yet put back or finished.
    in_hand: usize,
    /// Steps kept for ever: their barrier failed, so their work was never
    /// seen to finish.
    kept: Vec<Finish>,
    /// When the barrier thread started the synchronisation under way.
    barrier_since: Option<Instant>,
    barrier_warned: Option<Instant>,
    /// Completed events, per context, for reuse.
    pool: HashMap<usize, Vec<D::Event>>,
    threads: Threads,
}

impl<D: Driver> Default for State<D> {
    fn default() -> Self {
        State {
            parked: Vec::new(),
            barriers: Vec::new(),
            in_hand: 0,
            kept: Vec::new(),
            barrier_since: None,
            barrier_warned: None,
            pool: HashMap::new(),
            threads: Threads::default(),
        }
    }
}

#[derive(Default)]
struct Threads {
    events: bool,
    barriers: bool,
}

/// A reaper: its steps, its threads' wake-ups and the driver it calls.
/// The library has one, over [`Cuda`]; tests make their own.
pub(crate) struct Reaper<D: Driver> {
    driver: D,
    state: Mutex<State<D>>,
    /// Wakes the event thread (new steps).
    wake: Condvar,
    /// Wakes the barrier thread (new barriers).
    wake_barriers: Condvar,
    /// Wakes `settle` (a step finished).
    done: Condvar,
}

fn reaper() -> &'static Reaper<Cuda> {
    static REAPER: OnceLock<Reaper<Cuda>> = OnceLock::new();
    REAPER.get_or_init(|| Reaper::new(Cuda))
}

fn lock<D: Driver>(m: &Mutex<State<D>>) -> MutexGuard<'_, State<D>> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Runs a finishing step, keeping the reaper alive if it panics.
fn run(what: &'static str, finish: Finish) {
    if std::panic::catch_unwind(AssertUnwindSafe(finish)).is_err() {
        tracing::error!(what, "a deferred release panicked; what it held is leaked");
    }
}

thread_local! {
    /// Set inside [`work_done`]: the streams that used what is dropped there
    /// have finished already.
    static WORK_DONE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f`, in which releases retired with [`after_streams`] run at once
/// instead of being parked: for a caller that has already waited for every
/// stream that used what `f` drops (a lease's release, after its events).
/// This keeps the order the driver asks for: the mappings a lease covered
/// are undone before the lease is given back, and the publisher frees.
#[doc(hidden)]
pub fn work_done<R>(f: impl FnOnce() -> R) -> R {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            WORK_DONE.with(|w| w.set(self.0));
        }
    }
    let _reset = Reset(WORK_DONE.with(|w| w.replace(true)));
    f()
}

/// Retires `finish` until the work queued so far on every stream in
/// `streams` has completed, then runs it on the reaper thread. Never waits.
/// Inside [`work_done`] it runs `finish` at once.
///
/// `what` names the step in the reaper's log lines. When an event cannot
/// be made or recorded, the step waits for a barrier over the streams'
/// contexts instead (see the module's notes).
pub(crate) fn after_streams<'a>(
    streams: impl IntoIterator<Item = &'a Arc<CudaStream>>,
    what: &'static str,
    finish: impl FnOnce() + Send + 'static,
) {
    if WORK_DONE.with(std::cell::Cell::get) {
        finish();
        return;
    }
    reaper().after_streams(streams, what, Box::new(finish));
}

/// Retires `finish` until every stream of `ctx` has finished the work queued
/// before this call (a `cuCtxSynchronize` on the reaper's barrier thread,
/// shared by every barrier asked for before it starts), then runs it there.
/// For memory whose users queue work on streams we do not know (tensors and
/// arrays of PyTorch and CuPy). Never waits. If the synchronisation fails,
/// `finish` never runs (what it holds is kept for the life of the process).
pub fn after_context(
    ctx: &Arc<CudaContext>,
    what: &'static str,
    finish: impl FnOnce() + Send + 'static,
) {
    reaper().after_contexts(vec![ctx.clone()], what, Box::new(finish));
}

/// How many retired releases (unmaps, frees, lease releases) wait for
/// their GPU work or for the reaper to run them, counting those kept for
/// ever because a barrier over their context failed.
pub fn retiring() -> usize {
    reaper().retiring()
}

/// Waits up to `timeout` until every retired release has run (including
/// those retired by the releases themselves: a lease's release unmaps its
/// mappings). Returns whether none is left; false at once when the only
/// ones left are kept for ever (their context's barrier failed).
///
/// Drops never wait; call this where a program or test needs the effects
/// of its drops (memory unmapped, leases given back) before it goes on.
pub fn settle(timeout: Duration) -> bool {
    reaper().settle(timeout)
}

/// Retires `finish` with no GPU work to wait for: it runs on the reaper
/// thread at its next poll.
#[doc(hidden)]
pub fn soon(what: &'static str, finish: impl FnOnce() + Send + 'static) {
    after_streams(std::iter::empty(), what, finish);
}

impl<D: Driver> Reaper<D> {
    /// A reaper over `driver`, with no thread started yet.
    pub(crate) fn new(driver: D) -> Self {
        Reaper {
            driver,
            state: Mutex::new(State::default()),
            wake: Condvar::new(),
            wake_barriers: Condvar::new(),
            done: Condvar::new(),
        }
    }

    /// [`after_streams`] on this reaper (without the [`work_done`] check).
    pub(crate) fn after_streams<'a>(
        &'static self,
        streams: impl IntoIterator<Item = &'a D::Stream>,
        what: &'static str,
        finish: Finish,
    ) {
        let mut events = Vec::new();
        let mut ctxs: Vec<D::Context> = Vec::new();
        let mut seen: Vec<usize> = Vec::new();
        let mut failed = false;
        for s in streams {
            let id = self.driver.stream_id(s);
            if seen.contains(&id) {
                continue;
            }
            seen.push(id);
            let ctx = self.driver.context_of(s);
            if !failed {
                match self.record(&ctx, s) {
                    Ok(e) => events.push(e),
                    Err(e) => {
                        tracing::debug!(what, error = %e, "recording a release event failed; waiting for the whole context instead");
                        failed = true;
                    }
                }
            }
            let cid = self.driver.context_id(&ctx);
            if !ctxs.iter().any(|c| self.driver.context_id(c) == cid) {
                ctxs.push(ctx);
            }
        }
        if failed {
            self.give_back(events);
            self.after_contexts(ctxs, what, finish);
            return;
        }
        self.park(Parked {
            what,
            events,
            ctxs,
            finish,
            since: Instant::now(),
            warned: None,
        });
    }

    /// [`after_context`] on this reaper, over every context of `ctxs`.
    pub(crate) fn after_contexts(
        &'static self,
        ctxs: Vec<D::Context>,
        what: &'static str,
        finish: Finish,
    ) {
        let mut st = lock(&self.state);
        st.barriers.push(Barrier { what, ctxs, finish });
        if !st.threads.barriers {
            if spawn("cuda-ipc-barriers", move || self.barrier_thread()) {
                st.threads.barriers = true;
            } else {
                // No thread: synchronise here (the only wait left, and only
                // when the system refuses a thread).
                let taken = st.barriers.pop();
                drop(st);
                if let Some(b) = taken {
                    let ok = b.ctxs.iter().all(|c| self.sync_ok(c));
                    self.finish_barrier(b, ok);
                }
                return;
            }
        }
        drop(st);
        self.wake_barriers.notify_one();
    }

    /// [`retiring`] on this reaper.
    pub(crate) fn retiring(&self) -> usize {
        let st = lock(&self.state);
        st.parked.len() + st.barriers.len() + st.in_hand + st.kept.len()
    }

    /// [`settle`] on this reaper.
    pub(crate) fn settle(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut st = lock(&self.state);
        loop {
            if st.parked.is_empty() && st.barriers.is_empty() && st.in_hand == 0 {
                return st.kept.is_empty();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            st = self
                .done
                .wait_timeout(st, left.min(Duration::from_millis(5)))
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }

    /// An event recorded on `s` (of context `ctx`) now, from the pool when
    /// one is free.
    fn record(&self, ctx: &D::Context, s: &D::Stream) -> Result<D::Event, Error> {
        let pooled = lock(&self.state)
            .pool
            .get_mut(&self.driver.context_id(ctx))
            .and_then(Vec::pop);
        let e = match pooled {
            Some(e) => e,
            None => self.driver.new_event(ctx)?,
        };
        self.driver.record(&e, s)?;
        Ok(e)
    }

    /// Puts events back in the pool (their recorded work is not waited
    /// for: a later record replaces it).
    fn give_back(&self, events: Vec<D::Event>) {
        if events.is_empty() {
            return;
        }
        let mut st = lock(&self.state);
        for e in events {
            let pool = st.pool.entry(self.driver.event_context_id(&e)).or_default();
            if pool.len() < EVENT_POOL {
                pool.push(e);
            }
        }
    }

    fn park(&'static self, p: Parked<D>) {
        let mut st = lock(&self.state);
        st.parked.push(p);
        if !st.threads.events {
            if spawn("cuda-ipc-reaper", move || self.event_thread()) {
                st.threads.events = true;
            } else {
                // No thread: wait here (only when the system refuses a thread).
                let taken = st.parked.pop();
                drop(st);
                if let Some(p) = taken {
                    let waited = p.ctxs.iter().all(|c| self.driver.bind(c).is_ok())
                        && p.events.iter().all(|e| self.driver.wait(e).is_ok());
                    if waited {
                        run(p.what, p.finish);
                    } else {
                        self.after_contexts(p.ctxs, p.what, p.finish);
                    }
                }
                return;
            }
        }
        drop(st);
        self.wake.notify_one();
    }

    /// Whether all of `p`'s events have completed: `Some(true)` or
    /// `Some(false)`, or `None` when the driver cannot tell (a context
    /// cannot be made current, a query fails): the step then waits for a
    /// barrier over its contexts.
    fn is_done(&self, p: &Parked<D>) -> Option<bool> {
        for ctx in &p.ctxs {
            if let Err(e) = self.driver.bind(ctx) {
                tracing::debug!(what = p.what, error = %e, "making a context current failed; waiting for the whole context instead");
                return None;
            }
        }
        for e in &p.events {
            match self.driver.query(e) {
                Ok(true) => {}
                Ok(false) => return Some(false),
                Err(err) => {
                    tracing::debug!(what = p.what, error = %err, "querying a release event failed; waiting for the whole context instead");
                    return None;
                }
            }
        }
        Some(true)
    }

    fn event_thread(&'static self) {
        let mut nap = FIRST_NAP;
        let mut st = lock(&self.state);
        loop {
            while st.parked.is_empty() {
                self.done.notify_all();
                st = self
                    .wake
                    .wait(st)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                nap = FIRST_NAP;
            }
            let work = std::mem::take(&mut st.parked);
            st.in_hand += work.len();
            drop(st);

            let mut waiting = Vec::with_capacity(work.len());
            let mut freed: Vec<D::Event> = Vec::new();
            let mut finished = 0usize;
            for mut p in work {
                match self.is_done(&p) {
                    Some(true) => {
                        freed.append(&mut p.events);
                        run(p.what, p.finish);
                        finished += 1;
                    }
                    Some(false) => {
                        warn_if_stalled(&mut p);
                        waiting.push(p);
                    }
                    None => {
                        // Handed to the barrier thread: counted there now.
                        self.after_contexts(p.ctxs, p.what, p.finish);
                        finished += 1;
                    }
                }
            }

            self.give_back(freed);
            st = lock(&self.state);
            st.in_hand -= finished + waiting.len();
            let new_arrivals = !st.parked.is_empty();
            st.parked.extend(waiting);
            warn_if_barrier_stalled(&mut st);
            if finished > 0 {
                self.done.notify_all();
            }
            if new_arrivals || finished > 0 {
                nap = FIRST_NAP;
                continue;
            }
            if !st.parked.is_empty() {
                st = self
                    .wake
                    .wait_timeout(st, nap)
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .0;
                nap = (nap * 2).min(MAX_NAP);
            }
        }
    }

    /// Synchronises `ctx`; false (logged) when that fails.
    fn sync_ok(&self, ctx: &D::Context) -> bool {
        match self.driver.synchronize(ctx) {
            Ok(()) => true,
            Err(e) => {
                tracing::error!(error = %e, "a context barrier failed: the releases that wait for it are kept (their memory stays mapped, their leases held) until the process exits");
                false
            }
        }
    }

    /// Runs a barrier's step when its contexts were synchronised, else
    /// keeps it for ever.
    fn finish_barrier(&self, b: Barrier<D>, synced: bool) {
        if synced {
            run(b.what, b.finish);
        } else {
            tracing::error!(
                what = b.what,
                "kept for the life of the process: its GPU work was never seen to finish"
            );
            lock(&self.state).kept.push(b.finish);
        }
    }

    fn barrier_thread(&'static self) {
        let mut st = lock(&self.state);
        loop {
            while st.barriers.is_empty() {
                self.done.notify_all();
                st = self
                    .wake_barriers
                    .wait(st)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
            }
            let work = std::mem::take(&mut st.barriers);
            st.in_hand += work.len();
            st.barrier_since = Some(Instant::now());
            st.barrier_warned = None;
            drop(st);
            // One synchronisation per context serves every barrier taken.
            let mut synced: Vec<(usize, bool)> = Vec::new();
            for b in &work {
                for ctx in &b.ctxs {
                    let id = self.driver.context_id(ctx);
                    if !synced.iter().any(|(c, _)| *c == id) {
                        synced.push((id, self.sync_ok(ctx)));
                    }
                }
            }
            let n = work.len();
            for b in work {
                let ok = b.ctxs.iter().all(|c| {
                    let id = self.driver.context_id(c);
                    synced.iter().any(|(s, ok)| *s == id && *ok)
                });
                self.finish_barrier(b, ok);
            }
            st = lock(&self.state);
            st.in_hand -= n;
            st.barrier_since = None;
            self.done.notify_all();
        }
    }
}

fn spawn(name: &str, body: impl FnOnce() + Send + 'static) -> bool {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(body)
        .map_err(|e| tracing::error!(error = %e, "cannot start the {name} thread; releases wait in drop"))
        .is_ok()
}

fn warn_if_stalled<D: Driver>(p: &mut Parked<D>) {
    let age = p.since.elapsed();
    let due = match p.warned {
        None => age >= STALL_WARNING,
        Some(at) => at.elapsed() >= STALL_REPEAT,
    };
    if due {
        p.warned = Some(Instant::now());
        tracing::warn!(
            what = p.what,
            waited_s = age.as_secs(),
            "still waiting for GPU work queued on this memory before releasing it (a stream \
             may wait on a fence of a publisher that is gone); it stays mapped until then"
        );
    }
}

fn warn_if_barrier_stalled<D: Driver>(st: &mut State<D>) {
    let Some(since) = st.barrier_since else {
        return;
    };
    let due = match st.barrier_warned {
        None => since.elapsed() >= STALL_WARNING,
        Some(at) => at.elapsed() >= STALL_REPEAT,
    };
    if due {
        st.barrier_warned = Some(Instant::now());
        tracing::warn!(
            waited_s = since.elapsed().as_secs(),
            "still waiting for the context's work before releasing memory handed to a framework"
        );
    }
}

#[cfg(test)]
#[path = "reaper_tests.rs"]
mod tests;
