//! Streams: a worker thread each, running its queued operations in order,
//! so that asynchronous work really is asynchronous; stream memory
//! operations (fences) and host functions.

use std::collections::{HashMap, VecDeque};
use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use cudarc::driver::sys::{
    CUcontext, CUdeviceptr, CUhostFn, CUstream, CUstreamWaitValue_flags as W, cudaError_enum as E,
    cuuint64_t,
};

use crate::registry::registry;
use crate::{Res, ctx_ok, lock, put};

/// A range of device memory an operation reads or writes.
pub(crate) type Use = (u64, u64);

/// One queued operation.
pub(crate) struct Op {
    /// What it is, for the message when memory is freed under it.
    pub(crate) what: &'static str,
    /// The device memory it touches, checked when memory is freed.
    pub(crate) uses: Vec<Use>,
    /// The work itself, run on the stream's worker.
    pub(crate) run: Box<dyn FnOnce() + Send>,
}

/// The queue of one stream.
#[derive(Default)]
struct Queue {
    /// Operations not started, with their sequence numbers.
    pending: VecDeque<(u64, Op)>,
    /// The operation being run: its name and uses.
    running: Option<(&'static str, Vec<Use>)>,
    /// Sequence number of the last operation queued.
    queued: u64,
    /// Sequence number of the last operation finished.
    done: u64,
    /// Destroyed: the worker exits once the queue is empty.
    closed: bool,
}

/// A stream of this process.
pub(crate) struct Stream {
    queue: Mutex<Queue>,
    cond: Condvar,
    flags: c_uint,
}

/// Streams by handle (the handle is the `Stream`'s address).
static STREAMS: Mutex<Option<HashMap<usize, Arc<Stream>>>> = Mutex::new(None);
/// Every stream whose worker still runs, destroyed ones included.
static ALL: Mutex<Vec<Weak<Stream>>> = Mutex::new(Vec::new());
/// The stream behind the special handles 0, 1 and 2.
static DEFAULT: Mutex<Option<Arc<Stream>>> = Mutex::new(None);

/// `CUDA_IPC_FAKE_DELAY_US`: a delay before every queued operation.
fn delay() -> Option<Duration> {
    static DELAY: OnceLock<Option<Duration>> = OnceLock::new();
    *DELAY.get_or_init(|| {
        let us: u64 = std::env::var("CUDA_IPC_FAKE_DELAY_US").ok()?.parse().ok()?;
        (us > 0).then(|| Duration::from_micros(us))
    })
}

impl Stream {
    /// A new stream with its worker thread.
    fn start(flags: c_uint) -> Result<Arc<Stream>, cudarc::driver::sys::CUresult> {
        let s = Arc::new(Stream {
            queue: Mutex::new(Queue::default()),
            cond: Condvar::new(),
            flags,
        });
        let worker = s.clone();
        std::thread::Builder::new()
            .name("fake-cuda-stream".into())
            .spawn(move || worker.work())
            .map_err(|_| E::CUDA_ERROR_OUT_OF_MEMORY)?;
        let mut all = lock(&ALL);
        all.retain(|w| w.strong_count() > 0);
        all.push(Arc::downgrade(&s));
        Ok(s)
    }

    /// The worker: runs operations in order until destroyed and drained.
    fn work(&self) {
        loop {
            let op = {
                let mut q = lock(&self.queue);
                loop {
                    if let Some((seq, op)) = q.pending.pop_front() {
                        q.running = Some((op.what, op.uses.clone()));
                        break Some((seq, op));
                    }
                    if q.closed {
                        break None;
                    }
                    q = self
                        .cond
                        .wait(q)
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                }
            };
            let Some((seq, op)) = op else { return };
            if let Some(d) = delay() {
                std::thread::sleep(d);
            }
            (op.run)();
            let mut q = lock(&self.queue);
            q.running = None;
            q.done = seq;
            self.cond.notify_all();
        }
    }

    /// Queues `op`; returns its sequence number.
    pub(crate) fn push(&self, op: Op) -> u64 {
        let mut q = lock(&self.queue);
        q.queued += 1;
        let seq = q.queued;
        q.pending.push_back((seq, op));
        self.cond.notify_all();
        seq
    }

    /// Waits until every operation queued so far has finished.
    pub(crate) fn synchronize(&self) {
        let mut q = lock(&self.queue);
        let target = q.queued;
        while q.done < target {
            q = self
                .cond
                .wait(q)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }

    /// Whether every operation queued so far has finished.
    pub(crate) fn idle(&self) -> bool {
        let q = lock(&self.queue);
        q.done == q.queued
    }

    /// A description of an unfinished operation of this stream that uses
    /// `base..base + size`.
    fn user_of(&self, base: u64, size: u64) -> Option<String> {
        let q = lock(&self.queue);
        let overlaps = |uses: &[Use]| uses.iter().any(|(b, l)| *b < base + size && base < b + l);
        let running = q
            .running
            .iter()
            .filter(|(_, u)| overlaps(u))
            .map(|(w, _)| *w);
        let pending = q
            .pending
            .iter()
            .filter(|(_, op)| overlaps(&op.uses))
            .map(|(_, op)| op.what);
        running
            .chain(pending)
            .next()
            .map(|what| format!("{what} on stream {:p}", std::ptr::from_ref(self)))
    }
}

/// An unfinished operation of any stream of this process that uses
/// `base..base + size`, described.
pub(crate) fn in_flight_user(base: u64, size: u64) -> Option<String> {
    let streams: Vec<Arc<Stream>> = lock(&ALL).iter().filter_map(Weak::upgrade).collect();
    streams.iter().find_map(|s| s.user_of(base, size))
}

/// Waits for every stream of this process.
pub(crate) fn synchronize_all() {
    let streams: Vec<Arc<Stream>> = lock(&ALL).iter().filter_map(Weak::upgrade).collect();
    for s in streams {
        s.synchronize();
    }
}

/// The stream behind handle `h`: 0, 1 and 2 are the default stream.
pub(crate) fn lookup(h: CUstream) -> Result<Arc<Stream>, cudarc::driver::sys::CUresult> {
    if (h as usize) <= 2 {
        let mut default = lock(&DEFAULT);
        if let Some(s) = &*default {
            return Ok(s.clone());
        }
        let s = Stream::start(0)?;
        *default = Some(s.clone());
        return Ok(s);
    }
    lock(&STREAMS)
        .as_ref()
        .and_then(|m| m.get(&(h as usize)))
        .cloned()
        .ok_or(E::CUDA_ERROR_INVALID_HANDLE)
}

/// Polls `done` until it says yes: spinning briefly, then sleeping longer
/// and longer (up to 200 µs), as a GPU polling a word in memory would
/// notice a change soon but not at once.
pub(crate) fn wait_until(mut done: impl FnMut() -> bool) {
    let started = Instant::now();
    let mut nap = Duration::from_micros(1);
    while !done() {
        if started.elapsed() < Duration::from_micros(20) {
            std::hint::spin_loop();
            continue;
        }
        std::thread::sleep(nap);
        nap = (nap * 2).min(Duration::from_micros(200));
    }
}

/// A raw pointer or address moved to a worker thread.
#[derive(Clone, Copy)]
pub(crate) struct Raw(pub(crate) usize);

fake! {
    /// `cuStreamCreate`: a stream with its own worker thread.
    fn cuStreamCreate(phStream: *mut CUstream, Flags: c_uint) {
        ctx_ok()?;
        if Flags > 1 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let s = Stream::start(Flags)?;
        let h = Arc::as_ptr(&s) as usize;
        lock(&STREAMS).get_or_insert_with(HashMap::new).insert(h, s);
        // SAFETY: the caller's out-pointer.
        unsafe { put(phStream, h as CUstream) }
    }
}

fake! {
    /// `cuStreamCreateWithPriority`: priorities are ignored.
    fn cuStreamCreateWithPriority(phStream: *mut CUstream, flags: c_uint, priority: c_int) {
        let _ = priority;
        // SAFETY: the caller's out-pointer, passed on.
        match unsafe { cuStreamCreate(phStream, flags) } {
            E::CUDA_SUCCESS => Ok(()),
            e => Err(e),
        }
    }
}

fake! {
    /// `cuStreamDestroy_v2`: returns at once; queued work still runs.
    fn cuStreamDestroy_v2(hStream: CUstream) {
        ctx_ok()?;
        let s = lock(&STREAMS)
            .as_mut()
            .and_then(|m| m.remove(&(hStream as usize)))
            .ok_or(E::CUDA_ERROR_INVALID_HANDLE)?;
        lock(&s.queue).closed = true;
        s.cond.notify_all();
        Ok(())
    }
}

fake! {
    /// `cuStreamSynchronize`.
    fn cuStreamSynchronize(hStream: CUstream) {
        ctx_ok()?;
        lookup(hStream)?.synchronize();
        ctx_ok()
    }
}

fake! {
    /// `cuStreamQuery`: `CUDA_ERROR_NOT_READY` while work is queued.
    fn cuStreamQuery(hStream: CUstream) {
        ctx_ok()?;
        if lookup(hStream)?.idle() { ctx_ok() } else { Err(E::CUDA_ERROR_NOT_READY) }
    }
}

fake! {
    /// `cuStreamGetCtx`: the one context, for any stream the fake knows.
    fn cuStreamGetCtx(hStream: CUstream, pctx: *mut CUcontext) {
        ctx_ok()?;
        lookup(hStream)?;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: a valid out-pointer to a local.
        unsafe { crate::device::cuCtxGetCurrent(&raw mut ctx) };
        // SAFETY: the caller's out-pointer.
        unsafe { put(pctx, ctx) }
    }
}

fake! {
    /// `cuStreamGetFlags`.
    fn cuStreamGetFlags(hStream: CUstream, flags: *mut c_uint) {
        ctx_ok()?;
        let f = lookup(hStream)?.flags;
        // SAFETY: the caller's out-pointer.
        unsafe { put(flags, f) }
    }
}

fake! {
    /// `cuLaunchHostFunc`: runs `fn_(userData)` on the stream's worker, in order.
    fn cuLaunchHostFunc(hStream: CUstream, fn_: CUhostFn, userData: *mut c_void) {
        ctx_ok()?;
        let f = fn_.ok_or(E::CUDA_ERROR_INVALID_VALUE)?;
        let data = Raw(userData as usize);
        lookup(hStream)?.push(Op {
            what: "a host function (cuLaunchHostFunc)",
            uses: Vec::new(),
            run: Box::new(move || {
                let data = data;
                // SAFETY: the caller's function and data, called once, in stream order.
                unsafe { f(data.0 as *mut c_void) }
            }),
        });
        Ok(())
    }
}

/// The 64-bit word at `addr`, which the caller checked is device memory
/// (registered host memory for fences).
fn word(addr: u64) -> &'static AtomicU64 {
    // SAFETY: 8-byte aligned (checked by the callers) memory that stays
    // mapped while operations that use it are queued (freeing it earlier
    // aborts, see registry::assert_unused).
    unsafe { &*(addr as *const AtomicU64) }
}

/// Checks that a stream memory operation's word is aligned device memory.
fn check_word(addr: u64, write: bool) -> Res {
    if !addr.is_multiple_of(8) {
        return Err(E::CUDA_ERROR_INVALID_VALUE);
    }
    registry().check(addr, 8, write)
}

fake! {
    /// `cuStreamWriteValue64_v2`: stores `value` at `addr` in stream order.
    fn cuStreamWriteValue64_v2(stream: CUstream, addr: CUdeviceptr, value: cuuint64_t, flags: c_uint) {
        ctx_ok()?;
        if flags != 0 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        check_word(addr, true)?;
        lookup(stream)?.push(Op {
            what: "a stream write (cuStreamWriteValue64)",
            uses: vec![(addr, 8)],
            run: Box::new(move || word(addr).store(value, Ordering::SeqCst)),
        });
        Ok(())
    }
}

fake! {
    /// `cuStreamWaitValue64_v2`: holds the stream until the word at `addr`
    /// passes the test (GEQ, EQ, AND or NOR), polling it.
    fn cuStreamWaitValue64_v2(stream: CUstream, addr: CUdeviceptr, value: cuuint64_t, flags: c_uint) {
        ctx_ok()?;
        let test: fn(u64, u64) -> bool = match flags & !(W::CU_STREAM_WAIT_VALUE_FLUSH as c_uint) {
            f if f == W::CU_STREAM_WAIT_VALUE_GEQ as c_uint => |w, v| (w.wrapping_sub(v) as i64) >= 0,
            f if f == W::CU_STREAM_WAIT_VALUE_EQ as c_uint => |w, v| w == v,
            f if f == W::CU_STREAM_WAIT_VALUE_AND as c_uint => |w, v| w & v != 0,
            f if f == W::CU_STREAM_WAIT_VALUE_NOR as c_uint => |w, v| !(w | v) != 0,
            _ => return Err(E::CUDA_ERROR_INVALID_VALUE),
        };
        check_word(addr, false)?;
        lookup(stream)?.push(Op {
            what: "a stream wait (cuStreamWaitValue64)",
            uses: vec![(addr, 8)],
            run: Box::new(move || wait_until(|| test(word(addr).load(Ordering::SeqCst), value))),
        });
        Ok(())
    }
}
