//! Events, interprocess events included: a record is a numbered position
//! in a stream; an event is complete once its latest record has run.
//!
//! The numbers live in three words: `recorded` (the latest record queued)
//! and `completed` (the latest record run), and the time of that run. An
//! interprocess event keeps them in a file under `/dev/shm`, as the real
//! driver keeps its interprocess events there: another process that opens
//! the handle maps the same words, so it sees the exporter's records, and a
//! process with a /dev/shm of its own cannot open it.

use std::collections::HashMap;
use std::ffi::{CString, c_uint};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{
    CUevent, CUevent_flags as F, CUipcEventHandle, CUresult, CUstream, cudaError_enum as E,
};
use rustix::fs::{Mode, OFlags};
use rustix::mm::ProtFlags;

use crate::stream::{Op, lookup, wait_until};
use crate::{Res, ctx_ok, lock, put};

/// The words of one event.
#[repr(C)]
struct Words {
    /// The number of the latest record queued.
    recorded: AtomicU64,
    /// The number of the latest record run.
    completed: AtomicU64,
    /// When the latest record ran (CLOCK_MONOTONIC, nanoseconds).
    time_ns: AtomicU64,
}

/// The first bytes of an interprocess event handle of this fake.
const MAGIC: &[u8; 8] = b"cuFAKEev";
/// Where interprocess events live.
const SHM: &str = "/dev/shm";
/// The prefix of every file this fake makes in /dev/shm.
pub(crate) const SHM_PREFIX: &str = "cuda-ipc-fake.";

/// One event of this process.
pub(crate) struct Event {
    flags: c_uint,
    /// The words: in `own` for a private event, else in a mapping of the
    /// /dev/shm file.
    words: *const Words,
    own: Option<Box<Words>>,
    /// The mapping of an interprocess event, unmapped when the event goes.
    shared: Option<u64>,
    /// The file's name in /dev/shm, and whether this process made it
    /// (and unlinks it when the event is destroyed).
    name: Option<(String, bool)>,
}

// SAFETY: the words are atomics; the rest is immutable after creation.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Drop for Event {
    fn drop(&mut self) {
        if let Some(addr) = self.shared {
            // SAFETY: our mapping of the words; this was its last user.
            unsafe { crate::registry::unmap(addr, size_of::<Words>() as u64) };
        }
        if let Some((name, true)) = &self.name {
            let _ = rustix::fs::unlink(format!("{SHM}/{name}"));
        }
    }
}

impl Event {
    fn words(&self) -> &Words {
        match &self.own {
            Some(w) => w,
            // SAFETY: a mapping of at least one `Words`, alive as long as `self`.
            None => unsafe { &*self.words },
        }
    }

    /// Whether the latest record queued (by any process) has run.
    fn complete(&self) -> bool {
        let w = self.words();
        w.completed.load(Ordering::Acquire) >= w.recorded.load(Ordering::Acquire)
    }

    fn timing(&self) -> bool {
        self.flags & F::CU_EVENT_DISABLE_TIMING as c_uint == 0
    }

    /// Maps the words of the /dev/shm file `name`, creating it when asked.
    fn map_shared(name: &str, create: bool) -> Result<u64, CUresult> {
        let path = format!("{SHM}/{name}");
        let flags = OFlags::RDWR | OFlags::CLOEXEC;
        let flags = if create {
            flags | OFlags::CREATE | OFlags::EXCL
        } else {
            flags
        };
        let fd =
            rustix::fs::open(path.as_str(), flags, Mode::from_raw_mode(0o600)).map_err(|_| {
                if create {
                    E::CUDA_ERROR_OUT_OF_MEMORY
                } else {
                    E::CUDA_ERROR_MAP_FAILED
                }
            })?;
        let len = size_of::<Words>() as u64;
        if create {
            rustix::fs::ftruncate(&fd, len).map_err(|_| E::CUDA_ERROR_OUT_OF_MEMORY)?;
        } else if rustix::fs::fstat(&fd)
            .map_err(|_| E::CUDA_ERROR_MAP_FAILED)?
            .st_size
            < len as i64
        {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        crate::registry::map(fd.as_fd(), len, ProtFlags::READ | ProtFlags::WRITE)
    }
}

/// Events by handle (the handle is the `Event`'s address).
static EVENTS: Mutex<Option<HashMap<usize, Arc<Event>>>> = Mutex::new(None);

/// The event behind handle `h`.
fn lookup_event(h: CUevent) -> Result<Arc<Event>, CUresult> {
    lock(&EVENTS)
        .as_ref()
        .and_then(|m| m.get(&(h as usize)))
        .cloned()
        .ok_or(E::CUDA_ERROR_INVALID_HANDLE)
}

/// Keeps `e` and writes its handle to `out`.
///
/// # Safety
/// `out` is a valid out-pointer.
unsafe fn register(out: *mut CUevent, e: Event) -> Res {
    let e = Arc::new(e);
    let h = Arc::as_ptr(&e) as usize;
    lock(&EVENTS).get_or_insert_with(HashMap::new).insert(h, e);
    // SAFETY: the caller's contract.
    unsafe { put(out, h as CUevent) }
}

/// Now, on the clock every process shares.
fn now_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

fake! {
    /// `cuEventCreate`: `CU_EVENT_INTERPROCESS` needs `CU_EVENT_DISABLE_TIMING`.
    fn cuEventCreate(phEvent: *mut CUevent, Flags: c_uint) {
        ctx_ok()?;
        let ipc = Flags & F::CU_EVENT_INTERPROCESS as c_uint != 0;
        if Flags > 0xf || (ipc && Flags & F::CU_EVENT_DISABLE_TIMING as c_uint == 0) {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let e = if ipc {
            static NEXT: AtomicU64 = AtomicU64::new(0);
            let name = format!(
                "{SHM_PREFIX}{}.ev{}.{:x}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed),
                now_ns() & 0xff_ffff
            );
            let addr = Event::map_shared(&name, true)?;
            Event { flags: Flags, words: addr as *const Words, own: None, shared: Some(addr), name: Some((name, true)) }
        } else {
            let own = Box::new(Words { recorded: AtomicU64::new(0), completed: AtomicU64::new(0), time_ns: AtomicU64::new(0) });
            Event { flags: Flags, words: std::ptr::null(), own: Some(own), shared: None, name: None }
        };
        // SAFETY: the caller's out-pointer.
        unsafe { register(phEvent, e) }
    }
}

fake! {
    /// `cuEventDestroy_v2`: queued records still run.
    fn cuEventDestroy_v2(hEvent: CUevent) {
        ctx_ok()?;
        lock(&EVENTS)
            .as_mut()
            .and_then(|m| m.remove(&(hEvent as usize)))
            .map(drop)
            .ok_or(E::CUDA_ERROR_INVALID_HANDLE)
    }
}

fake! {
    /// `cuEventRecord`: the next record number, completed when the stream
    /// reaches it.
    fn cuEventRecord(hEvent: CUevent, hStream: CUstream) {
        ctx_ok()?;
        let e = lookup_event(hEvent)?;
        let s = lookup(hStream)?;
        let n = e.words().recorded.fetch_add(1, Ordering::AcqRel) + 1;
        s.push(Op {
            what: "an event record",
            uses: Vec::new(),
            run: Box::new(move || {
                let w = e.words();
                w.time_ns.store(now_ns(), Ordering::Release);
                w.completed.fetch_max(n, Ordering::AcqRel);
            }),
        });
        Ok(())
    }
}

fake! {
    /// `cuEventQuery`: `CUDA_ERROR_NOT_READY` until the latest record ran.
    fn cuEventQuery(hEvent: CUevent) {
        ctx_ok()?;
        if lookup_event(hEvent)?.complete() { ctx_ok() } else { Err(E::CUDA_ERROR_NOT_READY) }
    }
}

fake! {
    /// `cuEventSynchronize`: waits for the latest record made before the call.
    fn cuEventSynchronize(hEvent: CUevent) {
        ctx_ok()?;
        let e = lookup_event(hEvent)?;
        let target = e.words().recorded.load(Ordering::Acquire);
        wait_until(|| e.words().completed.load(Ordering::Acquire) >= target);
        ctx_ok()
    }
}

fake! {
    /// `cuStreamWaitEvent`: the stream waits for the latest record made
    /// before this call, in whichever process it was made.
    fn cuStreamWaitEvent(hStream: CUstream, hEvent: CUevent, Flags: c_uint) {
        ctx_ok()?;
        let _ = Flags;
        let e = lookup_event(hEvent)?;
        let s = lookup(hStream)?;
        let target = e.words().recorded.load(Ordering::Acquire);
        s.push(Op {
            what: "a wait for an event",
            uses: Vec::new(),
            run: Box::new(move || wait_until(|| e.words().completed.load(Ordering::Acquire) >= target)),
        });
        Ok(())
    }
}

fake! {
    /// `cuEventElapsedTime_v2`: milliseconds between the two records' runs.
    fn cuEventElapsedTime_v2(pMilliseconds: *mut f32, hStart: CUevent, hEnd: CUevent) {
        ctx_ok()?;
        let (a, b) = (lookup_event(hStart)?, lookup_event(hEnd)?);
        if !a.timing() || !b.timing() {
            return Err(E::CUDA_ERROR_INVALID_HANDLE);
        }
        if a.words().recorded.load(Ordering::Acquire) == 0 || b.words().recorded.load(Ordering::Acquire) == 0 {
            return Err(E::CUDA_ERROR_INVALID_HANDLE);
        }
        if !a.complete() || !b.complete() {
            return Err(E::CUDA_ERROR_NOT_READY);
        }
        let (ta, tb) = (a.words().time_ns.load(Ordering::Acquire), b.words().time_ns.load(Ordering::Acquire));
        let ms = (tb as f64 - ta as f64) / 1e6;
        // SAFETY: the caller's out-pointer.
        unsafe { put(pMilliseconds, ms as f32) }
    }
}

fake! {
    /// `cuIpcGetEventHandle`: names the event's file in /dev/shm.
    fn cuIpcGetEventHandle(pHandle: *mut CUipcEventHandle, event: CUevent) {
        ctx_ok()?;
        let e = lookup_event(event)?;
        let Some((name, _)) = &e.name else {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        };
        let mut h = CUipcEventHandle { reserved: [0; 64] };
        for (d, s) in h.reserved.iter_mut().zip(MAGIC.iter().chain(name.as_bytes())) {
            *d = *s as std::ffi::c_char;
        }
        // SAFETY: the caller's out-pointer.
        unsafe { put(pHandle, h) }
    }
}

fake! {
    /// `cuIpcOpenEventHandle`: maps the exporter's words;
    /// `CUDA_ERROR_MAP_FAILED` where this process's /dev/shm lacks them.
    fn cuIpcOpenEventHandle(phEvent: *mut CUevent, handle: CUipcEventHandle) {
        ctx_ok()?;
        let bytes: Vec<u8> = handle.reserved.iter().map(|c| *c as u8).collect();
        if &bytes[..8] != MAGIC {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let name = CString::new(bytes[8..].iter().take_while(|b| **b != 0).copied().collect::<Vec<u8>>())
            .map_err(|_| E::CUDA_ERROR_INVALID_VALUE)?;
        let name = name.to_str().map_err(|_| E::CUDA_ERROR_INVALID_VALUE)?;
        if !name.starts_with(SHM_PREFIX) || name.contains('/') {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        if name.starts_with(&format!("{SHM_PREFIX}{}.", std::process::id())) {
            return Err(E::CUDA_ERROR_INVALID_CONTEXT);
        }
        let addr = Event::map_shared(name, false)?;
        let flags = F::CU_EVENT_INTERPROCESS as c_uint | F::CU_EVENT_DISABLE_TIMING as c_uint;
        let e = Event { flags, words: addr as *const Words, own: None, shared: Some(addr), name: Some((name.to_string(), false)) };
        // SAFETY: the caller's out-pointer.
        unsafe { register(phEvent, e) }
    }
}
