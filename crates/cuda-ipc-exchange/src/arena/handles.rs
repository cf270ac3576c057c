//! What an arena hands out: buffers, leases on their ranges, chunk pins,
//! and the figures it reports.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::state::{Chunk, Range, Shared};
use super::{BufferView, ChunkBacking, ChunkId};

/// A buffer allocated from an [`Arena`](super::Arena): a view of a chunk (chunk, offset,
/// length), owned by the producer. Its range goes back to the arena when
/// this is dropped **and** every [`ArenaLease`] on it has ended.
pub struct ArenaBuffer<B: ChunkBacking> {
    pub(super) range: Arc<Range<B>>,
}

impl<B: ChunkBacking> ArenaBuffer<B> {
    /// Where the buffer lives: chunk, offset, length.
    pub fn view(&self) -> BufferView {
        self.range.view()
    }

    /// The chunk the buffer lives in.
    pub fn chunk(&self) -> &Arc<Chunk<B>> {
        &self.range.chunk
    }

    /// Bytes from the start of the chunk to the buffer's first byte (a
    /// multiple of the arena's alignment).
    pub fn offset(&self) -> u64 {
        self.range.offset
    }

    /// The length in bytes, as asked for.
    pub fn byte_len(&self) -> u64 {
        self.range.len
    }

    /// Always false: empty buffers are refused at allocation.
    pub fn is_empty(&self) -> bool {
        self.range.len == 0
    }

    /// The bytes the buffer takes in its chunk: its length rounded up to the
    /// allocation unit (the alignment, or a multiple of it in huge chunks).
    pub fn reserved_len(&self) -> u64 {
        self.range.bytes
    }

    /// A new lease on the buffer: the range stays allocated while it lives,
    /// even after this buffer is dropped. The exchange layer holds one per
    /// consumer the buffer is handed to.
    pub fn lease(&self) -> ArenaLease<B> {
        ArenaLease::new(&self.range)
    }

    /// A lease on each of `buffers`, in order, as [`lease`](Self::lease)
    /// takes one, with the arena's lock taken once for each run of
    /// buffers of one arena (a set of thousands of buffers takes it once).
    pub fn lease_each<'a>(
        buffers: impl IntoIterator<Item = &'a ArenaBuffer<B>>,
    ) -> Vec<ArenaLease<B>>
    where
        B: 'a,
    {
        let buffers = buffers.into_iter();
        let mut out = Vec::with_capacity(buffers.size_hint().0);
        let mut held = None;
        for b in buffers {
            let shared = &b.range.shared;
            if !held.as_ref().is_some_and(|(s, _)| Arc::ptr_eq(*s, shared)) {
                // The lock held for the run before goes first.
                drop(held.take());
                held = Some((shared, shared.lock()));
            }
            if let Some((_, core)) = held.as_mut() {
                b.range.leases.fetch_add(1, Ordering::Relaxed);
                core.leases += 1;
            }
            out.push(ArenaLease {
                range: Arc::clone(&b.range),
            });
        }
        out
    }

    /// How many leases on the buffer are alive.
    pub fn leases(&self) -> usize {
        self.range.leases.load(Ordering::Relaxed)
    }
}

impl<B: ChunkBacking> fmt::Debug for ArenaBuffer<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ArenaBuffer")
            .field("view", &self.view())
            .field("leases", &self.leases())
            .finish()
    }
}

impl<B: ChunkBacking> Drop for ArenaBuffer<B> {
    fn drop(&mut self) {
        let mut core = self.range.shared.lock();
        self.range.producer.store(false, Ordering::Relaxed);
        if self.range.leases.load(Ordering::Relaxed) > 0 {
            core.orphans += 1;
        }
        // The range itself goes back when the last `Arc` drops, after this.
    }
}

/// One lease on an [`ArenaBuffer`]'s range: while it lives the range is
/// not handed to another buffer. Cloning takes another lease.
pub struct ArenaLease<B: ChunkBacking> {
    range: Arc<Range<B>>,
}

impl<B: ChunkBacking> ArenaLease<B> {
    fn new(range: &Arc<Range<B>>) -> Self {
        let mut core = range.shared.lock();
        range.leases.fetch_add(1, Ordering::Relaxed);
        core.leases += 1;
        ArenaLease {
            range: range.clone(),
        }
    }

    /// Where the leased buffer lives.
    pub fn view(&self) -> BufferView {
        self.range.view()
    }

    /// The chunk the leased buffer lives in.
    pub fn chunk(&self) -> &Arc<Chunk<B>> {
        &self.range.chunk
    }
}

impl<B: ChunkBacking> Clone for ArenaLease<B> {
    fn clone(&self) -> Self {
        ArenaLease::new(&self.range)
    }
}

impl<B: ChunkBacking> fmt::Debug for ArenaLease<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ArenaLease")
            .field("view", &self.view())
            .finish()
    }
}

impl<B: ChunkBacking> Drop for ArenaLease<B> {
    fn drop(&mut self) {
        let mut core = self.range.shared.lock();
        let left = self.range.leases.fetch_sub(1, Ordering::Relaxed) - 1;
        core.leases -= 1;
        if left == 0 && !self.range.producer.load(Ordering::Relaxed) {
            core.orphans -= 1;
        }
    }
}

/// Keeps a chunk out of [`Arena::trim`](super::Arena::trim) while it lives: the exchange layer
/// holds one per consumer that maps the chunk.
pub struct ChunkPin<B: ChunkBacking> {
    pub(super) shared: Arc<Shared<B>>,
    pub(super) chunk: Arc<Chunk<B>>,
}

impl<B: ChunkBacking> ChunkPin<B> {
    /// The pinned chunk.
    pub fn chunk(&self) -> &Arc<Chunk<B>> {
        &self.chunk
    }
}

impl<B: ChunkBacking> fmt::Debug for ChunkPin<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChunkPin")
            .field("chunk", &self.chunk.id)
            .finish_non_exhaustive()
    }
}

impl<B: ChunkBacking> Drop for ChunkPin<B> {
    fn drop(&mut self) {
        let mut core = self.shared.lock();
        if let Some(state) = core.chunks.get_mut(&self.chunk.id.index) {
            state.pins -= 1;
        }
    }
}

/// One chunk's counts, from [`Arena::chunks`](super::Arena::chunks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ChunkInfo {
    /// The chunk's identity.
    pub id: ChunkId,
    /// Its usable length in bytes.
    pub len: u64,
    /// Bytes its live ranges take.
    pub used: u64,
    /// Its live ranges (buffers, or ranges held by leases).
    pub buffers: usize,
    /// Pins held on it.
    pub pins: usize,
    /// Its allocation unit in bytes (the alignment, or a multiple of it).
    pub unit: u64,
    /// Bytes free for new ranges (not necessarily in one piece).
    pub free: u64,
}

/// An arena's counts, from [`Arena::stats`](super::Arena::stats).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct ArenaStats {
    /// Chunks in the arena.
    pub chunks: usize,
    /// Their bytes: the device memory the arena holds.
    pub chunk_bytes: u64,
    /// Chunks with no range and no pin ([`Arena::trim`](super::Arena::trim) would release them).
    pub idle_chunks: usize,
    /// Live ranges: buffers, and ranges whose buffer is dropped but leased.
    pub buffers: usize,
    /// Bytes the live ranges take (whole allocation units).
    pub used_bytes: u64,
    /// Bytes the live ranges were asked for.
    pub requested_bytes: u64,
    /// Leases alive.
    pub leases: usize,
    /// Ranges whose buffer the producer dropped, kept by leases.
    pub held_by_leases_only: usize,
    /// Pins alive.
    pub pins: usize,
    /// Chunks created since the arena was made.
    pub chunks_created: u64,
    /// Chunks released since the arena was made.
    pub chunks_released: u64,
}
