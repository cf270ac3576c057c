//! The copy of one stream: page-locked staging buffers filled from the
//! checkpoint's files (`pread`) and copied to the device, double-buffered.
//! A piece that gathers rows is read into the stream's scratch buffer
//! (ordinary memory, as large as its largest such piece's file bytes,
//! reused) and its rows are gathered from there into the staging buffer.
// `unsafe`: the asynchronous copies into the chunks, with SAFETY notes.
#![allow(unsafe_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;

use cudarc::driver::CudaStream;

use super::schedule::{Step, slots_used, staging_len, stream_steps};
use crate::checkpoint::{Checkpoint, Piece, Plan};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::pinned::Staging;

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
    let outstanding: u64 = slots.iter().flatten().map(|s| s.queued).sum();
    let (synced, freed) = crate::pinned::release(stream, slots.into_iter().flatten());
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
    // The file bytes of gathering pieces: at most a piece's size.
    let mut scratch = Vec::new();
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
        copy_piece(
            job,
            stream,
            piece,
            slot,
            step.after.is_some(),
            &mut scratch,
            done,
        )
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
    scratch: &mut Vec<u8>,
    done: &Sender<u64>,
) -> Result<()> {
    if let Some(g) = piece.gather {
        // Read before waiting for the staging buffer: the read overlaps
        // its copy in flight.
        let file_bytes = read_rows(job, piece, scratch)?;
        if reused {
            let _ = done.send(slot.wait()?);
        }
        let base = chunk_base(job, piece)?;
        slot.fill(piece.len, |dst| g.apply(file_bytes, dst))?;
        return queue(base, stream, piece, slot);
    }
    if reused {
        // The buffer's previous copy must have read it before it is refilled.
        let _ = done.send(slot.wait()?);
    }
    let base = chunk_base(job, piece)?;
    slot.fill(piece.len, |dst| {
        job.ckpt.read_into(piece.file, piece.file_offset, dst)
    })?;
    queue(base, stream, piece, slot)
}

/// Reads the file bytes of a gathering `piece` into `scratch` (grown to
/// them, never shrunk) and returns them.
fn read_rows<'s>(job: &Job<'_>, piece: &Piece, scratch: &'s mut Vec<u8>) -> Result<&'s [u8]> {
    let len = usize::try_from(piece.file_len())
        .map_err(|_| Error::arg("gather", "larger than this machine's address space"))?;
    if scratch.len() < len {
        scratch
            .try_reserve_exact(len - scratch.len())
            .map_err(|e| Error::Io {
                context: format!("a gather buffer of {len} bytes"),
                source: std::io::Error::new(std::io::ErrorKind::OutOfMemory, e.to_string()),
            })?;
        scratch.resize(len, 0);
    }
    let bytes = &mut scratch[..len];
    job.ckpt.read_into(piece.file, piece.file_offset, bytes)?;
    Ok(bytes)
}

/// The device address of `piece`'s chunk; refused unless the piece lies
/// inside the chunk's buffer.
fn chunk_base(job: &Job<'_>, piece: &Piece) -> Result<u64> {
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
    Ok(base)
}

/// Queues the copy of `slot`'s first `piece.len` bytes to the piece's
/// place in its chunk, whose buffer starts at `base` ([`chunk_base`]).
fn queue(base: u64, stream: &Arc<CudaStream>, piece: &Piece, slot: &mut Staging) -> Result<()> {
    // SAFETY: the destination lies inside the chunk's buffer (checked by
    // `chunk_base`), which outlives the copy (the load synchronises the
    // stream before it returns).
    unsafe { slot.copy_to_device(base + piece.chunk_offset, piece.len, stream) }
}
