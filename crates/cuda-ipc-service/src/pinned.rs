//! Page-locked staging buffers: what the loader fills from files and copies
//! to the device, and what the saver copies from the device and writes to
//! a file. Each carries the event recorded after the last copy that used
//! it, and is never freed (nor touched by the host) under a copy.
// `unsafe`: page-locked host memory (`cuMemHostAlloc`/`cuMemFreeHost`) and
// the asynchronous copies that use it, each block with its SAFETY note.
#![allow(unsafe_code)]

use std::ffi::c_void;

use cudarc::driver::{CudaEvent, CudaStream};

use crate::device::Device;
use crate::driver::result::mem;
use crate::error::{Error, Result, from_cudarc};

/// One page-locked staging buffer and the event recorded after the last
/// copy that used it.
///
/// Freed by [`Staging::free`] once its stream has passed that copy. A
/// buffer dropped otherwise (an unwinding panic, an error path that could
/// not synchronise) is freed only if the event says the copy finished, and
/// leaked if not: never freed under a copy, and `Drop` never waits.
pub(crate) struct Staging {
    ptr: *mut c_void,
    len: usize,
    event: CudaEvent,
    /// Whether a copy was queued since the event was last waited for.
    in_flight: bool,
    /// The bytes of the last copy queued, not yet reported done.
    pub queued: u64,
}

impl Staging {
    /// `len` bytes of page-locked host memory for `device`'s context, zeroed.
    #[doc(alias = "cuMemHostAlloc")]
    pub fn new(device: &Device, len: usize) -> Result<Staging> {
        let event = device
            .context()
            .new_event(None)
            .map_err(|e| from_cudarc("cuEventCreate", e))?;
        device.bind()?;
        let ptr = mem::host_alloc(len.max(1))?;
        // SAFETY: `host_alloc` returned `len` bytes of host memory that
        // nothing else uses yet; zeroed once, so that every slice handed
        // out holds initialised bytes.
        unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0, len) };
        Ok(Staging {
            ptr,
            len,
            event,
            in_flight: false,
            queued: 0,
        })
    }

    /// Waits until the last copy queued on the buffer has finished, and
    /// returns the bytes it moved (0 when none was in flight).
    pub fn wait(&mut self) -> Result<u64> {
        if self.in_flight {
            self.event
                .synchronize()
                .map_err(|e| from_cudarc("cuEventSynchronize", e))?;
            self.in_flight = false;
        }
        Ok(std::mem::take(&mut self.queued))
    }

    fn checked_len(&self, len: u64) -> Result<usize> {
        usize::try_from(len)
            .ok()
            .filter(|&l| l <= self.len)
            .ok_or_else(|| {
                Error::arg(
                    "staging buffer",
                    format!("a piece of {len} bytes exceeds its {}", self.len),
                )
            })
    }

    /// Fills the buffer's first `len` bytes with `read`, which is given
    /// them as a slice (a checkpoint's `pread` into page-locked memory:
    /// one copy, from the page cache). Waits for the last copy first.
    pub fn fill(&mut self, len: u64, read: impl FnOnce(&mut [u8]) -> Result<()>) -> Result<()> {
        let len = self.checked_len(len)?;
        self.wait()?;
        // SAFETY: `ptr` holds `self.len >= len` initialised bytes (zeroed
        // in `new`) of host memory that only this buffer uses; no queued
        // copy uses them (waited for above); the slice lives only for this
        // call, and `&mut self` keeps every other use of the buffer out.
        let dst = unsafe { std::slice::from_raw_parts_mut(self.ptr.cast::<u8>(), len) };
        read(dst)
    }

    /// Hands the buffer's first `len` bytes to `write` (the saver's
    /// `pwrite` of what a copy from the device left there). Waits for the
    /// last copy first.
    pub fn drain(&mut self, len: u64, write: impl FnOnce(&[u8]) -> Result<()>) -> Result<()> {
        let len = self.checked_len(len)?;
        self.wait()?;
        // SAFETY: as in `fill`: initialised bytes, no copy in flight, the
        // slice lives only for this call.
        let src = unsafe { std::slice::from_raw_parts(self.ptr.cast::<u8>(), len) };
        write(src)
    }

    /// Queues a copy of the buffer's first `len` bytes to device address
    /// `dst` on `stream`, and records the buffer's event after it.
    ///
    /// # Safety
    /// `dst..dst+len` is device memory that stays allocated (and mapped)
    /// until `stream` has passed the copy.
    pub unsafe fn copy_to_device(&mut self, dst: u64, len: u64, stream: &CudaStream) -> Result<()> {
        let n = self.checked_len(len)?;
        self.wait()?;
        // SAFETY: the source is this buffer's first `n` bytes, untouched by
        // the host until the event recorded below has passed (every host
        // use waits for it); the destination is the caller's contract.
        unsafe { mem::copy_htod_async(dst, self.ptr.cast_const(), n, stream.cu_stream())? };
        self.queued(len, stream)
    }

    /// Queues a copy of `len` bytes from device address `src` into the
    /// buffer's first bytes on `stream`, and records the buffer's event.
    ///
    /// # Safety
    /// `src..src+len` is device memory that stays allocated (and mapped)
    /// until `stream` has passed the copy.
    pub unsafe fn copy_from_device(
        &mut self,
        src: u64,
        len: u64,
        stream: &CudaStream,
    ) -> Result<()> {
        let n = self.checked_len(len)?;
        self.wait()?;
        // SAFETY: the destination is this buffer's first `n` bytes, which
        // the host neither reads nor writes until the event recorded below
        // has passed; the source is the caller's contract.
        unsafe { mem::copy_dtoh_async(self.ptr, src, n, stream.cu_stream())? };
        self.queued(len, stream)
    }

    fn queued(&mut self, len: u64, stream: &CudaStream) -> Result<()> {
        self.event
            .record(stream)
            .map_err(|e| from_cudarc("cuEventRecord", e))?;
        self.in_flight = true;
        self.queued = len;
        Ok(())
    }

    /// Frees the buffer. The caller has synchronised the stream that used it.
    #[doc(alias = "cuMemFreeHost")]
    pub fn free(mut self) -> Result<()> {
        let ptr = std::mem::replace(&mut self.ptr, std::ptr::null_mut());
        // SAFETY: from `host_alloc`, freed once (the pointer is taken), and
        // the stream that used it has finished (the caller's contract).
        unsafe { mem::host_free(ptr) }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if self.ptr.is_null() {
            return;
        }
        // Reached only when `free` was not: free the buffer if its last
        // copy is done, else leak it rather than wait.
        if !self.in_flight || self.event.try_is_complete() == Ok(true) {
            // SAFETY: from `host_alloc`, not yet freed, no copy uses it.
            let _ = unsafe { mem::host_free(self.ptr) };
        } else {
            tracing::warn!(
                len = self.len,
                "a staging buffer dropped under a copy is leaked, not freed"
            );
        }
    }
}

/// The end of a stream's copies, whatever happened: waits for `stream`,
/// then frees `slots` if it finished, else drops them (each freed only if
/// its own copy is known to be done). Returns the wait's result, then the
/// frees'.
pub(crate) fn release(
    stream: &CudaStream,
    slots: impl IntoIterator<Item = Staging>,
) -> (Result<()>, Result<()>) {
    let synced = stream
        .synchronize()
        .map_err(|e| from_cudarc("cuStreamSynchronize", e));
    let mut freed = Ok(());
    for s in slots {
        if synced.is_ok() {
            freed = freed.and(s.free());
        } else {
            drop(s);
        }
    }
    (synced, freed)
}

/// Runs `work(i, done)` for every stream `i` of `streams` on a thread of
/// its own, each sending the bytes it finished on `done`; reports them
/// here, as `progress(done, total)`, from 0; returns once every thread has
/// ended, with the first error (a panic is one: `what` names the work).
pub(crate) fn on_stream_threads(
    streams: usize,
    total: u64,
    progress: &mut dyn FnMut(u64, u64),
    what: &'static str,
    work: impl Fn(usize, &std::sync::mpsc::Sender<u64>) -> Result<()> + Sync,
) -> Result<()> {
    progress(0, total);
    let (tx, rx) = std::sync::mpsc::channel::<u64>();
    let results: Vec<Result<()>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..streams)
            .map(|i| {
                let (work, tx) = (&work, tx.clone());
                scope.spawn(move || work(i, &tx))
            })
            .collect();
        drop(tx);
        let mut done = 0u64;
        for n in rx {
            if n > 0 {
                done += n;
                progress(done.min(total), total);
            }
        }
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(Error::arg(what, "a copy thread panicked; this is a bug"))
                })
            })
            .collect()
    });
    results.into_iter().collect()
}
