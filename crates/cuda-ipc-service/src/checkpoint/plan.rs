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
//! - **Shards** ([`Plan::for_shard`], the `tp` module): a tensor split
//!   along dimension 0, or replicated, is a contiguous range of its file,
//!   cut into pieces as above. One split along a later dimension is
//!   `rows` runs of bytes, one every `pitch` bytes of the file. Where a
//!   row's pitch fits in a piece, a piece takes as many whole rows as fit
//!   ([`Gather`]: one read of the file's bytes from its first run to its
//!   last, of at most `piece_size` bytes, whose runs are gathered into the
//!   staging buffer); where it does not, each run is cut into pieces of
//!   its own, contiguous in the file. Either way, no piece reads or
//!   stages more than `piece_size` bytes.

use std::ops::Range;

use super::TensorEntry;
use super::tp::{self, Slice, TpShard};
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
    /// Rows of a tensor split along a dimension after the first, gathered
    /// from the file; `None`: the piece is the `len` bytes of the file at
    /// `file_offset`.
    pub gather: Option<Gather>,
}

impl Piece {
    /// The bytes of the file the piece reads, from `file_offset`: `len`,
    /// or for a gather, from its first row's bytes to its last's.
    pub fn file_len(&self) -> u64 {
        match self.gather {
            Some(g) => (g.rows - 1) * g.pitch + self.len / g.rows,
            None => self.len,
        }
    }
}

/// How a [`Piece`] gathers its rows: it reads [`Piece::file_len`] bytes
/// from its `file_offset`, and row `r` of its bytes (`len / rows` each)
/// is the bytes at `r * pitch` there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Gather {
    /// The rows (at least 2).
    pub rows: u64,
    /// Bytes from one row's start to the next in the file (more than a
    /// row's width).
    pub pitch: u64,
}

impl Gather {
    /// Gathers `dst.len() / rows` items of every row of `src` (a piece's
    /// file bytes, or anything laid out like them) into `dst`, row after
    /// row.
    ///
    /// # Errors
    /// `dst` that does not hold `rows` rows, or `src` too short for them.
    pub fn apply<T: Copy>(&self, src: &[T], dst: &mut [T]) -> Result<()> {
        let rows = usize::try_from(self.rows).unwrap_or(usize::MAX);
        let pitch = usize::try_from(self.pitch).unwrap_or(usize::MAX);
        let width = dst.len() / rows.max(1);
        let need = (rows.saturating_sub(1))
            .checked_mul(pitch)
            .and_then(|n| n.checked_add(width));
        if rows == 0
            || width * rows != dst.len()
            || width > pitch
            || need.is_none_or(|n| n > src.len())
        {
            return Err(Error::arg(
                "gather",
                format!(
                    "{} rows of pitch {} do not fit {} bytes into {}",
                    self.rows,
                    self.pitch,
                    src.len(),
                    dst.len()
                ),
            ));
        }
        for (r, row) in dst.chunks_exact_mut(width.max(1)).enumerate() {
            row.copy_from_slice(&src[r * pitch..r * pitch + row.len()]);
        }
        Ok(())
    }
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
    shapes: Vec<Vec<u64>>,
    shard: Option<TpShard>,
}

impl Plan {
    /// Plans a load of `tensors`, in their order. Refused: options that do
    /// not validate; a tensor whose byte range is reversed or does not hold
    /// exactly its shape's elements; more than [`MAX_PIECES`] pieces; sizes
    /// that overflow 64 bits.
    pub fn new(tensors: &[TensorEntry], options: &PlanOptions) -> Result<Plan> {
        Plan::build(tensors, options, None, &|_, why| Error::arg("plan", why))
    }

    /// Plans a load of `shard`'s share of each of `tensors` (the `tp`
    /// module's rules): the placements, pieces and shapes of the shard.
    /// Refused: [`Plan::new`]'s refusals, and a tensor the shard cannot
    /// split, naming it and what to do.
    pub fn for_shard(
        tensors: &[TensorEntry],
        options: &PlanOptions,
        shard: &TpShard,
    ) -> Result<Plan> {
        Plan::build(tensors, options, Some(shard), &|t, why| {
            Error::arg(
                "tensor-parallel shard",
                format!("{}: {why}", shorten(&t.name, 80)),
            )
        })
    }

    /// The plan of `tensors` (or of `shard`'s share of them), `refuse`
    /// naming a tensor the shard cannot split.
    pub(crate) fn build(
        tensors: &[TensorEntry],
        options: &PlanOptions,
        shard: Option<&TpShard>,
        refuse: &dyn Fn(&TensorEntry, String) -> Error,
    ) -> Result<Plan> {
        options.validate()?;
        for t in tensors {
            check_tensor(t)?;
        }
        let slices = tp::slices(tensors, shard).map_err(|(i, why)| refuse(&tensors[i], why))?;
        let count = slices
            .iter()
            .map(|s| piece_count(s, options.piece_size))
            .fold(0u64, u64::saturating_add);
        if count > MAX_PIECES {
            return Err(Error::arg(
                "plan piece size",
                format!(
                    "{} bytes makes {count} pieces, more than {MAX_PIECES}: use a larger piece",
                    options.piece_size
                ),
            ));
        }
        let lens: Vec<u64> = slices.iter().map(Slice::len).collect();
        let (chunks, placements) = layout(&lens, options)?;
        let mut pieces = Vec::with_capacity(count as usize);
        for p in &placements {
            let mut add = |file_offset, len, at, gather| {
                pieces.push(Piece {
                    tensor: p.tensor,
                    stream: pieces.len() % options.streams,
                    file: tensors[p.tensor].file,
                    file_offset,
                    len,
                    chunk: p.chunk,
                    chunk_offset: p.offset + at,
                    gather,
                });
            };
            cut(&slices[p.tensor], options.piece_size, &mut add);
        }
        debug_assert_eq!(pieces.len() as u64, count, "piece_count agrees with cut");
        Ok(Plan {
            options: options.clone(),
            chunks,
            placements,
            pieces,
            payload: lens.iter().sum(),
            shapes: slices.into_iter().map(|s| s.shape).collect(),
            shard: shard.cloned(),
        })
    }

    /// Each tensor's shape as loaded (its shard's, for a shard's plan),
    /// in the order of the tensors given.
    pub fn shapes(&self) -> &[Vec<u64>] {
        &self.shapes
    }

    /// The shard the plan loads (`None`: whole tensors).
    pub fn shard(&self) -> Option<&TpShard> {
        self.shard.as_ref()
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

    /// The bytes of all tensors (their shards' for a shard's plan): what
    /// the load copies.
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

/// How many pieces [`cut`] makes of `s`.
fn piece_count(s: &Slice, piece_size: u64) -> u64 {
    if s.rows == 1 {
        s.width.div_ceil(piece_size)
    } else if s.pitch <= piece_size {
        s.rows.div_ceil(piece_size / s.pitch)
    } else {
        s.rows.saturating_mul(s.width.div_ceil(piece_size))
    }
}

/// Cuts `s` into pieces of at most `piece_size` bytes read and staged,
/// in order: `add(file_offset, len, offset in the tensor, gather)`.
fn cut(s: &Slice, piece_size: u64, add: &mut dyn FnMut(u64, u64, u64, Option<Gather>)) {
    let mut run = |file: u64, len: u64, at: u64| {
        let mut done = 0;
        while done < len {
            let n = piece_size.min(len - done);
            add(file + done, n, at + done, None);
            done += n;
        }
    };
    if s.rows == 1 || s.pitch > piece_size {
        // Contiguous, or rows too wide to read whole: each run on its own.
        for r in 0..s.rows {
            run(s.first + r * s.pitch, s.width, r * s.width);
        }
        return;
    }
    let per = piece_size / s.pitch;
    let mut r = 0;
    while r < s.rows {
        let rows = per.min(s.rows - r);
        let gather = (rows > 1).then_some(Gather {
            rows,
            pitch: s.pitch,
        });
        add(s.first + r * s.pitch, rows * s.width, r * s.width, gather);
        r += rows;
    }
}

/// The chunks and the place in them of every tensor of `lens` bytes.
fn layout(lens: &[u64], o: &PlanOptions) -> Result<(Vec<Chunk>, Vec<Placement>)> {
    let mut chunks = Vec::new();
    let mut placements: Vec<Placement> = Vec::with_capacity(lens.len());
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
    for (i, &len) in lens.iter().enumerate() {
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
    if !lens.is_empty() {
        close(&mut chunks, first, lens.len(), end)?;
    }
    Ok((chunks, placements))
}

#[cfg(test)]
mod tests;
