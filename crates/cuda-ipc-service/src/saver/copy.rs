//! The copy of one stream of a save: each piece copied from the device
//! into one of two page-locked staging buffers, and written to the file
//! from there while the other buffer's copy runs.
// `unsafe`: the asynchronous copies out of the set's mappings, with SAFETY
// notes.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;

use cudarc::driver::CudaStream;

use super::layout::{Layout, Piece};
use super::output::Output;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::pinned::{Staging, release};

/// What every stream's copy shares.
pub(super) struct Job<'a> {
    pub device: &'a Device,
    pub layout: &'a Layout,
    /// The device address of each of the layout's tensors.
    pub addresses: Vec<u64>,
    pub out: &'a Output,
    /// Set when a stream failed: the others stop at their next piece.
    pub abort: AtomicBool,
}

impl Job<'_> {
    fn name(&self, piece: &Piece, e: Error) -> Error {
        let tensor = self
            .layout
            .tensors
            .get(piece.tensor)
            .map_or_else(|| format!("#{}", piece.tensor), |t| t.name.clone());
        Error::Save {
            file: self.out.path().to_path_buf(),
            tensor,
            source: Box::new(e),
        }
    }
}

/// Copies and writes `pieces` on `stream`, sending the bytes of each piece
/// once it is in the file. On an error the copies queued so far are
/// waited for before the staging buffers are freed.
pub(super) fn save_stream(
    job: &Job<'_>,
    pieces: &[Piece],
    stream: &CudaStream,
    done: &Sender<u64>,
) -> Result<()> {
    let Some(len) = pieces.iter().map(|p| p.len).max() else {
        return Ok(());
    };
    job.device.bind()?;
    let len = usize::try_from(len)
        .map_err(|_| Error::arg("staging size", "larger than this machine's address space"))?;
    let mut slots: [Option<Staging>; 2] = [None, None];
    let mut pending: [Option<Piece>; 2] = [None, None];
    let result = save_pieces(job, pieces, stream, &mut slots, &mut pending, len, done);
    let (synced, freed) = release(stream, slots.into_iter().flatten());
    if result.is_err() || synced.is_err() {
        job.abort.store(true, Ordering::Relaxed);
    }
    result?;
    synced?;
    freed
}

fn save_pieces(
    job: &Job<'_>,
    pieces: &[Piece],
    stream: &CudaStream,
    slots: &mut [Option<Staging>; 2],
    pending: &mut [Option<Piece>; 2],
    len: usize,
    done: &Sender<u64>,
) -> Result<()> {
    for (k, piece) in pieces.iter().enumerate() {
        if job.abort.load(Ordering::Relaxed) {
            return Ok(()); // another stream failed and reports it
        }
        let slot = match &mut slots[k % 2] {
            Some(slot) => slot,
            empty => empty.insert(Staging::new(job.device, len)?),
        };
        // The buffer's last piece goes to the file (while the other
        // buffer's copy runs) before the buffer takes this one.
        if let Some(last) = pending[k % 2].take() {
            write(job, slot, &last, done).map_err(|e| job.name(&last, e))?;
        }
        let src = job.addresses[piece.tensor] + piece.offset;
        // SAFETY: `src..src+len` lies in the tensor's place in the set's
        // mapping (the save checked every place against its mapping, and
        // a piece lies inside its tensor), which stays mapped until the
        // stream has passed the copy: the save holds the set and
        // synchronises every stream before it returns.
        unsafe { slot.copy_from_device(src, piece.len, stream) }.map_err(|e| job.name(piece, e))?;
        pending[k % 2] = Some(*piece);
    }
    // The last two pieces, in the order they were copied.
    let n = pieces.len();
    for k in [n, n + 1] {
        if let (Some(last), Some(slot)) = (pending[k % 2].take(), slots[k % 2].as_mut()) {
            write(job, slot, &last, done).map_err(|e| job.name(&last, e))?;
        }
    }
    Ok(())
}

/// Waits for `piece`'s copy into `slot`, then writes it at its place.
fn write(job: &Job<'_>, slot: &mut Staging, piece: &Piece, done: &Sender<u64>) -> Result<()> {
    let at = job.layout.tensors[piece.tensor].file_offset + piece.offset;
    slot.drain(piece.len, |bytes| job.out.write_at(bytes, at))?;
    let _ = done.send(piece.len);
    Ok(())
}
