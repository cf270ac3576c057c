//! The copy of one stream: page-locked staging buffers filled from the
//! checkpoint's files (`pread`) and copied to the device, double-buffered.
// `unsafe`: page-locked host memory (`cuMemHostAlloc`/`cuMemFreeHost`) and
// the asynchronous copies that read it, each block with its SAFETY note.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;

use cudarc::driver::{CudaEvent, CudaStream};

use super::schedule::{Step, slots_used, staging_len, stream_steps};
use crate::checkpoint::{Checkpoint, Piece, Plan};
use crate::device::Device;
use crate::driver::result::mem;
use crate::error::{Error, Result, from_cudarc};

/// One page-locked staging buffer and the event recorded after the last
/// copy that read it.
///
/// Freed by [`Staging::free`] once its stream has passed that copy. A
/// buffer dropped otherwise (an unwinding panic) is freed only if the
/// event says the copy finished, and leaked if not: never freed under a
/// copy, and `Drop` never waits.
struct Staging {
    ptr: *mut c_void,
    len: usize,
    event: CudaEvent,
    /// The bytes of the last copy queued from it, not yet reported done.
    queued: u64,
}

impl Staging {
    #[doc(alias = "cuMemHostAlloc")]
    fn new(device: &Device, len: usize) -> Result<Staging> {
        let event = device
            .context()
            .new_event(None)
            .map_err(|e| from_cudarc("cuEventCreate", e))?;
        device.bind()?;
        let ptr = mem::host_alloc(len)?;
        // SAFETY: `host_alloc` returned `len` bytes of host memory that
        // nothing else uses yet; zeroed once, so that `fill` hands out
        // initialised bytes.
        unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0, len) };
        Ok(Staging {
            ptr,
            len,
            event,
            queued: 0,
        })
    }

    /// Fills the buffer's first `len` bytes with `read`, which is given
    /// them as a slice (the checkpoint's `pread` into page-locked memory:
    /// one copy, from the page cache).
    fn fill(&mut self, len: u64, read: impl FnOnce(&mut [u8]) -> Result<()>) -> Result<()> {
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l <= self.len)
            .ok_or_else(|| {
                Error::arg(
                    "staging buffer",
                    format!("a piece of {len} bytes exceeds its {}", self.len),
                )
            })?;
        // SAFETY: `ptr` holds `self.len >= len` initialised bytes (zeroed
        // in `new`) of host memory that only this buffer uses; no queued
        // copy reads them (the caller
        // waited on `event` after the last copy); the slice lives only for
        // this call, and `&mut self` keeps every other use of the buffer
        // out.
        let dst = unsafe { std::slice::from_raw_parts_mut(self.ptr.cast::<u8>(), len) };
        read(dst)
    }

    /// Frees the buffer. The caller has synchronised the stream that read it.
    #[doc(alias = "cuMemFreeHost")]
    fn free(mut self) -> Result<()> {
        let ptr = std::mem::replace(&mut self.ptr, std::ptr::null_mut());
        // SAFETY: from `host_alloc`, freed once (the pointer is taken), and
        // the stream that read it has finished (the caller's contract).
        unsafe { mem::host_free(ptr) }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if self.ptr.is_null() {
            return;
        }
        // Reached only when `free` was not (a panic unwinding): free the
        // buffer if its last copy is done, else leak it rather than wait.
        if self.event.try_is_complete() == Ok(true) {
            // SAFETY: from `host_alloc`, not yet freed, no copy reads it.
            let _ = unsafe { mem::host_free(self.ptr) };
        } else {
            tracing::warn!(
                len = self.len,
                "a staging buffer dropped under a copy is leaked, not freed"
            );
        }
    }
}

/// What every stream's copy shares.
pub(super) struct Job<'a> {
    pub device: &'a Device,
    pub ckpt: &'a Checkpoint,
    pub plan: &'a Plan,
    /// The device address of each plan chunk's buffer, and its length.
    pub chunks: Vec<(u64, u64)>,
    /// Set when a stream failed: the others stop.
    pub abort: AtomicBool,
    /// Set by the caller to stop the load (a service stopping).
    pub stop: &'a AtomicBool,
}

impl Job<'_> {
    /// `e`, naming the file and the tensor of `piece`.
    fn name(&self, piece: &Piece, e: Error) -> Error {
        let tensor = self
            .ckpt
            .tensors()
            .get(piece.tensor)
            .map_or_else(|| format!("#{}", piece.tensor), |t| t.name.clone());
        let file = self.ckpt.files().get(piece.file).map_or_else(
            || self.ckpt.path().to_path_buf(),
            |f| f.path().to_path_buf(),
        );
        Error::Load {
            file,
            tensor,
            source: Box::new(e),
        }
    }
}

/// Copies the pieces of stream `index` on `stream`, sending the bytes of
/// each copy once it has finished. On an error, the copies queued so far
/// are waited for before the staging buffers are freed; the error names
/// the piece's file and tensor.
pub(super) fn copy_stream(
    job: &Job<'_>,
    index: usize,
    stream: &Arc<CudaStream>,
    done: &Sender<u64>,
) -> Result<()> {
    let steps = stream_steps(job.plan, index);
    if steps.is_empty() {
        return Ok(());
    }
    job.device.bind()?;
    let len = usize::try_from(staging_len(job.plan, &steps))
        .map_err(|_| Error::arg("staging size", "larger than this machine's address space"))?;
    // Each buffer is page-locked at its first use, so that pinning the
    // second overlaps the first one's copy (pinning costs about as much
    // as copying the same bytes).
    let mut slots: Vec<Option<Staging>> = (0..slots_used(&steps)).map(|_| None).collect();
    let copied = copy_steps(job, stream, &steps, &mut slots, len, done);
    // Whatever happened, the copies queued so far read the buffers.
    let synced = stream
        .synchronize()
        .map_err(|e| from_cudarc("cuStreamSynchronize", e));
    let outstanding: u64 = slots.iter().flatten().map(|s| s.queued).sum();
    let mut freed = Ok(());
    for s in slots.into_iter().flatten() {
        if synced.is_ok() {
            freed = freed.and(s.free());
        } else {
            drop(s); // freed only if its copy is known to be done
        }
    }
    if copied.is_err() || synced.is_err() {
        job.abort.store(true, Ordering::Relaxed);
    }
    copied?;
    synced?;
    let _ = done.send(outstanding);
    freed
}

fn copy_steps(
    job: &Job<'_>,
    stream: &Arc<CudaStream>,
    steps: &[Step],
    slots: &mut [Option<Staging>],
    len: usize,
    done: &Sender<u64>,
) -> Result<()> {
    for step in steps {
        if job.abort.load(Ordering::Relaxed) {
            return Ok(()); // another stream failed and reports it
        }
        if job.stop.load(Ordering::Relaxed) {
            return Err(Error::Io {
                context: "the load was stopped before it finished".into(),
                source: std::io::ErrorKind::Interrupted.into(),
            });
        }
        let piece = &job.plan.pieces()[step.piece];
        let slot = match &mut slots[step.slot] {
            Some(slot) => slot,
            empty => empty.insert(Staging::new(job.device, len)?),
        };
        copy_piece(job, stream, piece, slot, step.after.is_some(), done)
            .map_err(|e| job.name(piece, e))?;
    }
    Ok(())
}

fn copy_piece(
    job: &Job<'_>,
    stream: &Arc<CudaStream>,
    piece: &Piece,
    slot: &mut Staging,
    reused: bool,
    done: &Sender<u64>,
) -> Result<()> {
    if reused {
        // The buffer's previous copy must have read it before it is refilled.
        slot.event
            .synchronize()
            .map_err(|e| from_cudarc("cuEventSynchronize", e))?;
        let _ = done.send(std::mem::take(&mut slot.queued));
    }
    let &(base, chunk_len) = job
        .chunks
        .get(piece.chunk)
        .ok_or_else(|| Error::arg("load", format!("no buffer for chunk {}", piece.chunk)))?;
    if Error::check_range(piece.chunk_offset, piece.len, chunk_len).is_err() {
        return Err(Error::OutOfBounds {
            offset: piece.chunk_offset,
            len: piece.len,
            size: chunk_len,
        });
    }
    slot.fill(piece.len, |dst| {
        job.ckpt.read_into(piece.file, piece.file_offset, dst)
    })?;
    // SAFETY: the destination lies inside the chunk's buffer (checked
    // above), which outlives the copy (the load synchronises the stream
    // before it returns); the source is the staging buffer's first
    // `piece.len` bytes (filled above, within its length), which stay
    // untouched until `event` has passed.
    unsafe {
        mem::copy_htod_async(
            base + piece.chunk_offset,
            slot.ptr.cast_const(),
            piece.len as usize,
            stream.cu_stream(),
        )?;
    }
    slot.event
        .record(stream)
        .map_err(|e| from_cudarc("cuEventRecord", e))?;
    slot.queued = piece.len;
    Ok(())
}
