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
//! Nothing is ever finished early. Work that never completes (a stream
//! waiting on the fence of a publisher that died) keeps its memory for as
//! long as the process lives, and the reaper logs it, once after
//! [`STALL_WARNING`] and then every minute, naming what waits. Finishing
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

/// How long a retired step may wait for its work before the reaper logs it.
pub const STALL_WARNING: Duration = Duration::from_secs(10);

/// How often a step still waiting is logged again.
const STALL_REPEAT: Duration = Duration::from_secs(60);

/// The longest nap between two polls of the events while steps wait.
const MAX_NAP: Duration = Duration::from_millis(1);

/// The first nap after a poll that found nothing done.
const FIRST_NAP: Duration = Duration::from_micros(20);

/// Events kept for reuse per context.
const EVENT_POOL: usize = 256;

type Finish = Box<dyn FnOnce() + Send>;

/// A step parked until its events have completed.
struct Parked {
    what: &'static str,
    events: Vec<CudaEvent>,
    ctx: Option<Arc<CudaContext>>,
    finish: Finish,
    since: Instant,
    warned: Option<Instant>,
}

/// A step waiting for a barrier over its whole context.
struct Barrier {
    what: &'static str,
    ctx: Arc<CudaContext>,
    finish: Finish,
}

#[derive(Default)]
struct State {
    /// Steps waiting for their events, not being polled now.
    parked: Vec<Parked>,
    /// Steps waiting for a context barrier, not being run now.
    barriers: Vec<Barrier>,
    /// Steps a reaper thread has taken and not yet put back or finished.
    in_hand: usize,
    /// When the barrier thread started the synchronisation under way.
    barrier_since: Option<Instant>,
    barrier_warned: Option<Instant>,
    /// Completed events, per context, for reuse.
    pool: HashMap<usize, Vec<CudaEvent>>,
    threads: Threads,
}

#[derive(Default)]
struct Threads {
    events: bool,
    barriers: bool,
}

struct Reaper {
    state: Mutex<State>,
    /// Wakes the event thread (new steps).
    wake: Condvar,
    /// Wakes the barrier thread (new barriers).
    wake_barriers: Condvar,
    /// Wakes `settle` (a step finished).
    done: Condvar,
}

fn reaper() -> &'static Reaper {
    static REAPER: OnceLock<Reaper> = OnceLock::new();
    REAPER.get_or_init(|| Reaper {
        state: Mutex::new(State::default()),
        wake: Condvar::new(),
        wake_barriers: Condvar::new(),
        done: Condvar::new(),
    })
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn ctx_key(ctx: &CudaContext) -> usize {
    ctx.cu_ctx() as usize
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
pub(crate) fn work_done<R>(f: impl FnOnce() -> R) -> R {
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
/// be recorded (the context is broken or gone), no more work can run in it,
/// and the step runs at the next poll.
pub(crate) fn after_streams<'a>(
    streams: impl IntoIterator<Item = &'a Arc<CudaStream>>,
    what: &'static str,
    finish: impl FnOnce() + Send + 'static,
) {
    if WORK_DONE.with(std::cell::Cell::get) {
        finish();
        return;
    }
    let mut events = Vec::new();
    let mut ctx = None;
    let mut seen: Vec<cudarc::driver::sys::CUstream> = Vec::new();
    for s in streams {
        if seen.contains(&s.cu_stream()) {
            continue;
        }
        seen.push(s.cu_stream());
        match record(s) {
            Ok(e) => events.push(e),
            Err(e) => {
                tracing::debug!(what, error = %e, "recording a release event failed; releasing without it");
            }
        }
        ctx.get_or_insert_with(|| s.context().clone());
    }
    park(Parked {
        what,
        events,
        ctx,
        finish: Box::new(finish),
        since: Instant::now(),
        warned: None,
    });
}

/// Retires `finish` until every stream of `ctx` has finished the work queued
/// before this call (a `cuCtxSynchronize` on the reaper's barrier thread,
/// shared by every barrier asked for before it starts), then runs it there.
/// For memory whose users queue work on streams we do not know (tensors and
/// arrays of PyTorch and CuPy). Never waits.
pub fn after_context(
    ctx: &Arc<CudaContext>,
    what: &'static str,
    finish: impl FnOnce() + Send + 'static,
) {
    let r = reaper();
    let mut st = lock(&r.state);
    st.barriers.push(Barrier {
        what,
        ctx: ctx.clone(),
        finish: Box::new(finish),
    });
    if !st.threads.barriers {
        if spawn("cuda-ipc-barriers", barrier_thread) {
            st.threads.barriers = true;
        } else {
            // No thread: synchronise here (the only wait left, and only
            // when the system refuses a thread).
            let taken = st.barriers.pop();
            drop(st);
            if let Some(b) = taken {
                let _ = b.ctx.synchronize();
                run(b.what, b.finish);
            }
            return;
        }
    }
    drop(st);
    r.wake_barriers.notify_one();
}

/// An event recorded on `s` now, from the pool when one is free.
fn record(s: &Arc<CudaStream>) -> Result<CudaEvent, cudarc::driver::DriverError> {
    let ctx = s.context();
    let pooled = lock(&reaper().state)
        .pool
        .get_mut(&ctx_key(ctx))
        .and_then(Vec::pop);
    let e = match pooled {
        Some(e) => e,
        None => ctx.new_event(None)?,
    };
    e.record(s)?;
    Ok(e)
}

fn park(p: Parked) {
    let r = reaper();
    let mut st = lock(&r.state);
    st.parked.push(p);
    if !st.threads.events {
        if spawn("cuda-ipc-reaper", event_thread) {
            st.threads.events = true;
        } else {
            // No thread: wait here (only when the system refuses a thread).
            let taken = st.parked.pop();
            drop(st);
            if let Some(p) = taken {
                for e in &p.events {
                    let _ = e.synchronize();
                }
                run(p.what, p.finish);
            }
            return;
        }
    }
    drop(st);
    r.wake.notify_one();
}

fn spawn(name: &str, body: fn()) -> bool {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(body)
        .map_err(|e| tracing::error!(error = %e, "cannot start the {name} thread; releases wait in drop"))
        .is_ok()
}

/// Whether all of `p`'s events have completed (or can never complete
/// because the context failed: then no queued work can run either).
fn is_done(p: &Parked) -> bool {
    if let Some(ctx) = &p.ctx
        && ctx.bind_to_thread().is_err()
    {
        return true;
    }
    p.events.iter().all(|e| e.try_is_complete().unwrap_or(true))
}

fn event_thread() {
    let r = reaper();
    let mut nap = FIRST_NAP;
    let mut st = lock(&r.state);
    loop {
        while st.parked.is_empty() {
            r.done.notify_all();
            st = r
                .wake
                .wait(st)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            nap = FIRST_NAP;
        }
        let work = std::mem::take(&mut st.parked);
        st.in_hand += work.len();
        drop(st);

        let mut waiting = Vec::with_capacity(work.len());
        let mut freed: Vec<CudaEvent> = Vec::new();
        let mut finished = 0usize;
        for mut p in work {
            if is_done(&p) {
                freed.append(&mut p.events);
                run(p.what, p.finish);
                finished += 1;
            } else {
                warn_if_stalled(&mut p);
                waiting.push(p);
            }
        }

        st = lock(&r.state);
        for e in freed {
            let pool = st.pool.entry(ctx_key(e.context())).or_default();
            if pool.len() < EVENT_POOL {
                pool.push(e);
            }
        }
        st.in_hand -= finished + waiting.len();
        let new_arrivals = !st.parked.is_empty();
        st.parked.extend(waiting);
        warn_if_barrier_stalled(&mut st);
        if finished > 0 {
            r.done.notify_all();
        }
        if new_arrivals || finished > 0 {
            nap = FIRST_NAP;
            continue;
        }
        if !st.parked.is_empty() {
            st = r
                .wake
                .wait_timeout(st, nap)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
            nap = (nap * 2).min(MAX_NAP);
        }
    }
}

fn warn_if_stalled(p: &mut Parked) {
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

fn warn_if_barrier_stalled(st: &mut State) {
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

fn barrier_thread() {
    let r = reaper();
    let mut st = lock(&r.state);
    loop {
        while st.barriers.is_empty() {
            r.done.notify_all();
            st = r
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
        let mut synced: Vec<usize> = Vec::new();
        for b in &work {
            let key = ctx_key(&b.ctx);
            if !synced.contains(&key) {
                synced.push(key);
                if let Err(e) = b.ctx.synchronize() {
                    tracing::debug!(error = %e, "a context barrier failed; releasing anyway (no work can run)");
                }
            }
        }
        let n = work.len();
        for b in work {
            run(b.what, b.finish);
        }
        st = lock(&r.state);
        st.in_hand -= n;
        st.barrier_since = None;
        r.done.notify_all();
    }
}

/// How many retired releases (unmaps, frees, lease releases) wait for
/// their GPU work or for the reaper to run them.
pub fn retiring() -> usize {
    let st = lock(&reaper().state);
    st.parked.len() + st.barriers.len() + st.in_hand
}

/// Waits up to `timeout` until every retired release has run (including
/// those retired by the releases themselves: a lease's release unmaps its
/// mappings). Returns whether none is left.
///
/// Drops never wait; call this where a program or test needs the effects
/// of its drops (memory unmapped, leases given back) before it goes on.
pub fn settle(timeout: Duration) -> bool {
    let r = reaper();
    let deadline = Instant::now() + timeout;
    let mut st = lock(&r.state);
    loop {
        if st.parked.is_empty() && st.barriers.is_empty() && st.in_hand == 0 {
            return true;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        st = r
            .done
            .wait_timeout(st, left.min(Duration::from_millis(5)))
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .0;
    }
}

/// Retires `finish` with no GPU work to wait for: it runs on the reaper
/// thread at its next poll.
#[cfg(test)]
pub(crate) fn soon(what: &'static str, finish: impl FnOnce() + Send + 'static) {
    after_streams(std::iter::empty(), what, finish);
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[test]
    fn a_step_with_nothing_to_wait_for_runs_on_the_reaper_and_settle_sees_it() {
        let ran = Arc::new(AtomicUsize::new(0));
        let caller = std::thread::current().id();
        let on = Arc::new(Mutex::new(None));
        for _ in 0..100 {
            let (ran, on) = (ran.clone(), on.clone());
            soon("test step", move || {
                ran.fetch_add(1, Ordering::SeqCst);
                *on.lock().unwrap() = Some(std::thread::current().id());
            });
        }
        assert!(
            settle(Duration::from_secs(5)),
            "{} still retiring",
            retiring()
        );
        assert_eq!(ran.load(Ordering::SeqCst), 100);
        assert_ne!(
            on.lock().unwrap().unwrap(),
            caller,
            "ran on the caller's thread"
        );
    }

    #[test]
    fn a_step_may_retire_another() {
        let ran = Arc::new(AtomicUsize::new(0));
        let r = ran.clone();
        soon("outer", move || {
            let r2 = r.clone();
            soon("inner", move || {
                std::thread::sleep(Duration::from_millis(20));
                r2.fetch_add(1, Ordering::SeqCst);
            });
            r.fetch_add(1, Ordering::SeqCst);
        });
        assert!(settle(Duration::from_secs(5)));
        assert_eq!(
            ran.load(Ordering::SeqCst),
            2,
            "settle waits for what steps retire"
        );
    }

    #[test]
    fn a_panicking_step_does_not_stop_the_reaper() {
        soon("panics", || panic!("on purpose"));
        let ran = Arc::new(AtomicUsize::new(0));
        let r = ran.clone();
        soon("after", move || {
            r.fetch_add(1, Ordering::SeqCst);
        });
        assert!(settle(Duration::from_secs(5)));
        assert_eq!(ran.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn settle_gives_up_at_its_deadline() {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        soon("blocked", move || {
            let _ = rx.recv_timeout(Duration::from_secs(5));
        });
        let started = Instant::now();
        assert!(!settle(Duration::from_millis(50)));
        assert!(started.elapsed() < Duration::from_secs(2));
        assert!(retiring() >= 1);
        tx.send(()).unwrap();
        assert!(settle(Duration::from_secs(5)));
    }
}
