//! The plan of a load: where each tensor goes, and the copies that put it
//! there. Pure data; the copies themselves belong to the loader.
//!
//! - **Layout.** Tensors are placed in the order given, each at the next
//!   multiple of [`PlanOptions::alignment`] in the current chunk, as the
//!   arena places buffers. A tensor that would pass
//!   [`PlanOptions::chunk_size`] starts a new chunk; a tensor larger than
//!   that gets a chunk of its own. A chunk's length is its last tensor's
//!   end rounded up to the alignment (at least one alignment unit, so that
//!   no chunk is empty).
//! - **Schedule.** Each tensor's bytes are split into pieces of at most
//!   [`PlanOptions::piece_size`] (the size of a staging buffer), in order;
//!   piece `i` of the whole plan goes to stream `i % streams`. A piece never
//!   spans two tensors, and the pieces of a tensor cover its bytes exactly
//!   once, in the file and in the chunk.

use std::ops::Range;

use super::TensorEntry;
use crate::arena::{ArenaOptions, DEFAULT_ALIGNMENT};
use crate::error::{Error, Result};
use crate::units::{MIB, shorten};

/// The most pieces a plan holds (a larger count means a piece size far too
/// small for the checkpoint).
pub const MAX_PIECES: u64 = 1 << 24;

/// The most streams a plan assigns pieces to.
const MAX_STREAMS: usize = 1024;

/// How a [`Plan`] lays out tensors and splits the copy.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PlanOptions {
    /// The largest chunk the layout fills (a tensor larger than this gets
    /// a chunk of its own). A multiple of `alignment`. Default: the arena's
    /// default largest chunk ([`ArenaOptions::max_chunk_size`], 2 GiB).
    pub chunk_size: u64,
    /// The alignment of every tensor's offset in its chunk: a power of two.
    /// Default [`DEFAULT_ALIGNMENT`], the arena's.
    pub alignment: u64,
    /// The largest piece of a copy (the size of one staging buffer).
    /// Default 2 MiB: pinning a staging buffer costs about as much as
    /// copying its bytes, so small ones load faster (measured on the H200,
    /// `docs/SERVICE.md`).
    pub piece_size: u64,
    /// How many streams the pieces are spread over, round-robin (1 to
    /// 1,024). Default 8: one host thread each fills its staging buffers
    /// from the page cache, and 8 made the most of the H200's host.
    pub streams: usize,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            chunk_size: ArenaOptions::default().max_chunk_size,
            alignment: DEFAULT_ALIGNMENT,
            piece_size: 2 * MIB,
            streams: 8,
        }
    }
}

impl PlanOptions {
    /// The largest chunk the layout fills.
    #[must_use]
    pub fn with_chunk_size(mut self, bytes: u64) -> Self {
        self.chunk_size = bytes;
        self
    }

    /// The alignment of every tensor's offset in its chunk.
    #[must_use]
    pub fn with_alignment(mut self, bytes: u64) -> Self {
        self.alignment = bytes;
        self
    }

    /// The largest piece of a copy.
    #[must_use]
    pub fn with_piece_size(mut self, bytes: u64) -> Self {
        self.piece_size = bytes;
        self
    }

    /// How many streams the pieces are spread over.
    #[must_use]
    pub fn with_streams(mut self, streams: usize) -> Self {
        self.streams = streams;
        self
    }

    /// Checks that the options make sense together.
    pub fn validate(&self) -> Result<()> {
        if !self.alignment.is_power_of_two() {
            return Err(Error::arg(
                "plan alignment",
                format!("{} is not a power of two", self.alignment),
            ));
        }
        if self.chunk_size == 0 || !self.chunk_size.is_multiple_of(self.alignment) {
            return Err(Error::arg(
                "plan chunk size",
                format!(
                    "{} is not a positive multiple of the alignment, {}",
                    self.chunk_size, self.alignment
                ),
            ));
        }
        if self.piece_size == 0 {
            return Err(Error::arg(
                "plan piece size",
                "must be at least one byte (2 MiB suits a staging buffer)",
            ));
        }
        if self.streams == 0 || self.streams > MAX_STREAMS {
            return Err(Error::arg(
                "plan streams",
                format!("{} is not from 1 to {MAX_STREAMS}", self.streams),
            ));
        }
        Ok(())
    }
}

/// One chunk of the layout.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Chunk {
    /// Its length in bytes: a multiple of the alignment.
    pub len: u64,
    /// The tensors placed in it: a range of [`Plan::placements`].
    pub placements: Range<usize>,
}

/// Where one tensor goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Placement {
    /// The tensor: an index into the list the plan was made from.
    pub tensor: usize,
    /// The chunk: an index into [`Plan::chunks`].
    pub chunk: usize,
    /// Bytes from the chunk's start: a multiple of the alignment.
    pub offset: u64,
    /// The tensor's length in bytes.
    pub len: u64,
}

/// One copy: a range of a file to a range of a chunk, on one stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Piece {
    /// The tensor it belongs to (an index into the list the plan was made
    /// from).
    pub tensor: usize,
    /// The stream that copies it (`0..streams`).
    pub stream: usize,
    /// The file it is read from ([`TensorEntry::file`]).
    pub file: usize,
    /// Where in the file it starts.
    pub file_offset: u64,
    /// Its length in bytes (1 to the piece size).
    pub len: u64,
    /// The chunk it is written to.
    pub chunk: usize,
    /// Where in the chunk it starts.
    pub chunk_offset: u64,
}

/// The layout of a list of tensors in chunks, and the copy schedule that
/// fills them. See the module docs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    options: PlanOptions,
    chunks: Vec<Chunk>,
    placements: Vec<Placement>,
    pieces: Vec<Piece>,
    payload: u64,
}

impl Plan {
    /// Plans a load of `tensors`, in their order. Refused: options that do
    /// not validate; a tensor whose byte range is reversed or does not hold
    /// exactly its shape's elements; more than [`MAX_PIECES`] pieces; sizes
    /// that overflow 64 bits.
    pub fn new(tensors: &[TensorEntry], options: &PlanOptions) -> Result<Plan> {
        options.validate()?;
        let mut count = 0u64;
        for t in tensors {
            check_tensor(t)?;
            count += t.len().div_ceil(options.piece_size);
        }
        if count > MAX_PIECES {
            return Err(Error::arg(
                "plan piece size",
                format!(
                    "{} bytes makes {count} pieces, more than {MAX_PIECES}: use a larger piece",
                    options.piece_size
                ),
            ));
        }
        let (chunks, placements) = layout(tensors, options)?;
        let mut pieces = Vec::with_capacity(count as usize);
        for p in &placements {
            let t = &tensors[p.tensor];
            let mut done = 0;
            while done < p.len {
                let len = options.piece_size.min(p.len - done);
                pieces.push(Piece {
                    tensor: p.tensor,
                    stream: pieces.len() % options.streams,
                    file: t.file,
                    file_offset: t.range.start + done,
                    len,
                    chunk: p.chunk,
                    chunk_offset: p.offset + done,
                });
                done += len;
            }
        }
        Ok(Plan {
            options: options.clone(),
            chunks,
            placements,
            pieces,
            payload: tensors.iter().map(TensorEntry::len).sum(),
        })
    }

    /// The options the plan was made with.
    pub fn options(&self) -> &PlanOptions {
        &self.options
    }

    /// The chunks, in order.
    pub fn chunks(&self) -> &[Chunk] {
        &self.chunks
    }

    /// Where each tensor goes, in the order of the tensors given.
    pub fn placements(&self) -> &[Placement] {
        &self.placements
    }

    /// Every copy, in order.
    pub fn pieces(&self) -> &[Piece] {
        &self.pieces
    }

    /// The copies of stream `stream`, in order.
    pub fn stream_pieces(&self, stream: usize) -> impl Iterator<Item = &Piece> {
        self.pieces.iter().filter(move |p| p.stream == stream)
    }

    /// The bytes of all chunks: what the load allocates.
    pub fn total_bytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.len).sum()
    }

    /// The bytes of all tensors: what the load copies.
    pub fn payload_bytes(&self) -> u64 {
        self.payload
    }
}

/// A tensor's byte range must hold exactly its elements.
fn check_tensor(t: &TensorEntry) -> Result<()> {
    let elements = t.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
    let bytes = elements.and_then(|e| e.checked_mul(t.dtype.size()));
    if t.range.start > t.range.end || bytes != Some(t.range.end - t.range.start) {
        return Err(Error::arg(
            "plan tensor",
            format!(
                "{}: bytes {}..{} do not hold a {} tensor of shape {:?}",
                shorten(&t.name, 80),
                t.range.start,
                t.range.end,
                t.dtype,
                t.shape
            ),
        ));
    }
    Ok(())
}

/// `n` rounded up to a multiple of `align` (a power of two).
fn align_up(n: u64, align: u64) -> Result<u64> {
    n.checked_add(align - 1)
        .map(|v| v & !(align - 1))
        .ok_or_else(|| Error::arg("plan", format!("{n} bytes overflow 64 bits when aligned")))
}

/// The chunks and every tensor's place in them.
fn layout(tensors: &[TensorEntry], o: &PlanOptions) -> Result<(Vec<Chunk>, Vec<Placement>)> {
    let mut chunks = Vec::new();
    let mut placements: Vec<Placement> = Vec::with_capacity(tensors.len());
    // The open chunk: its first placement and where its bytes end.
    let mut first = 0;
    let mut end = 0u64;
    let close = |chunks: &mut Vec<Chunk>, first: usize, last: usize, end: u64| -> Result<()> {
        chunks.push(Chunk {
            len: align_up(end, o.alignment)?.max(o.alignment),
            placements: first..last,
        });
        Ok(())
    };
    for (i, t) in tensors.iter().enumerate() {
        let len = t.len();
        let mut offset = align_up(end, o.alignment)?;
        let fits = offset.checked_add(len).is_some_and(|e| e <= o.chunk_size);
        if !fits && i > first {
            close(&mut chunks, first, i, end)?;
            first = i;
            offset = 0;
        }
        placements.push(Placement {
            tensor: i,
            chunk: chunks.len(),
            offset,
            len,
        });
        end = offset
            .checked_add(len)
            .ok_or_else(|| Error::arg("plan", "a chunk's length overflows 64 bits"))?;
    }
    if !tensors.is_empty() {
        close(&mut chunks, first, tensors.len(), end)?;
    }
    Ok((chunks, placements))
}

#[cfg(test)]
mod tests;
