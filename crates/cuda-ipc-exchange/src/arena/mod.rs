//! Arenas: export once, hand off many.
//!
//! Exporting a buffer costs far more than handing it off
//! (`cuMemExportToShareableHandle` takes 0.6-0.85 ms per allocation on an
//! H200, and the consumer's import and map another 0.15-0.25 ms). An
//! [`Arena`] pays that once per *chunk*: it allocates large chunks of
//! shareable device memory, exports each once when it is created, and hands
//! out sub-allocations of them ([`ArenaBuffer`]). A consumer maps each chunk
//! once and sees every buffer in it as a view: chunk, offset, length
//! ([`BufferView`]). Handing off a buffer is then an offset and a message.
//!
//! The accounting (ranges, alignment, leases, growth, trimming) is generic
//! over a [`ChunkBacking`], the thing that makes chunks, and does not need a
//! GPU; [`DeviceChunks`] is the backing of device memory, one
//! [`SharedBuffer`](crate::share::SharedBuffer) per chunk, of any mechanism
//! (VMM by default; pool or legacy chunks where VMM file descriptors do not
//! work). Ranges within a chunk come from the `offset-allocator` crate (a
//! two-level segregated-fit allocator, O(1) per allocation and free).
//!
//! # The contract
//! - **Who owns chunks.** The arena does. A chunk lives while the arena has
//!   it in its table, and beyond that while any buffer, lease or pin of it
//!   lives: dropping the [`Arena`] handle frees nothing that is still in
//!   use. [`Arena::trim`] releases the chunks that hold no buffer and no
//!   pin; nothing else releases a chunk.
//! - **When a range is reused.** A sub-allocation goes back to the arena
//!   only when the producer has dropped its [`ArenaBuffer`] **and** every
//!   [`ArenaLease`] on it has ended. The exchange layer takes one lease per
//!   consumer a buffer is handed to ([`ArenaBuffer::lease`]) and drops it
//!   when that consumer releases the buffer or dies, so memory a consumer
//!   still reads is never handed to a new buffer. A range handed out again
//!   holds whatever its last user wrote (like `malloc`). Work the producer
//!   queued on the range before dropping its buffer is ordered by the stream
//!   as usual; a consumer must have finished with a range when it releases
//!   its lease.
//! - **Identity.** Every chunk has a [`ChunkId`]: the arena's [`ArenaId`]
//!   (random per arena, never reused by another arena of any process in
//!   practice) and an index that the arena never reuses, even after
//!   trimming. Consumers key their mapping caches by it, never by an
//!   address, so a trimmed chunk and a new chunk at the same address are
//!   never confused.
//! - **Pins.** A consumer that mapped a chunk keeps a view of it even when it
//!   holds no buffer of it (a cached mapping). For legacy and pool chunks the
//!   exporter must not free memory that another process still maps, so the
//!   exchange layer holds a [`ChunkPin`] per consumer that maps a chunk, and
//!   [`Arena::trim`] skips pinned chunks. (VMM chunks are reference counted
//!   by the driver, so a trimmed VMM chunk stays valid in a consumer until
//!   it unmaps; pins still tell the producer which chunks are in use.)
//! - **Alignment.** Every buffer starts at a multiple of
//!   [`ArenaOptions::alignment`] (256 bytes by default) from the start of
//!   its chunk, and takes a whole number of alignment units. Chunks start at
//!   2 MiB on VMM and at least 256 bytes on every mechanism, so the device
//!   address is as aligned as the offset up to that.
//! - **Growth.** An allocation that fits no chunk creates one:
//!   as large as the arena already is (so the number of chunks grows
//!   logarithmically), at least [`ArenaOptions::chunk_size`] and at most
//!   [`ArenaOptions::max_chunk_size`]; a buffer larger than that gets a chunk
//!   of its own. [`Arena::reserve`] creates chunks ahead of time so that the
//!   exports happen before the hand-off path, and [`ArenaOptions::limit`]
//!   caps the device memory an arena takes.
//! - **Threads.** An arena, its buffers, leases and pins are `Send + Sync`
//!   (when the backing is); one mutex guards the accounting and is never
//!   held while a chunk is created or freed.
//!
//! # Security
//! A consumer that maps a chunk can read (and, for writable mappings,
//! write) **every** buffer in that chunk, not only those handed to it. Keep
//! one arena per publisher, and give data that some consumers must not see
//! its own arena (or per-buffer exports): a
//! [`Publisher`](crate::exchange::Publisher) has an arena of its own, and
//! [`Sharing::Isolated`](crate::exchange::Sharing::Isolated) exports every
//! buffer on its own.
//!
//! ```no_run
//! use cuda_ipc_exchange::arena::{Arena, ArenaOptions, DeviceChunks};
//! use cuda_ipc_core::Device;
//!
//! # fn main() -> cuda_ipc_core::Result<()> {
//! let device = Device::open(0)?;
//! let arena = Arena::new(DeviceChunks::new(&device, None)?, ArenaOptions::default())?;
//! arena.reserve(64 << 20)?; // one chunk, exported now
//! let weights = arena.alloc(4 << 20)?; // no export: an offset in that chunk
//! let lease = weights.lease(); // what the exchange holds per consumer
//! drop(weights); // the range stays allocated ...
//! drop(lease); // ... until the last lease ends
//! # Ok(())
//! # }
//! ```

mod core;
mod device;
mod handles;
mod state;
#[cfg(test)]
mod tests;

use std::fmt;

use crate::error::{Error, Result};

pub use self::core::Arena;
pub use self::device::{
    DeviceArena, DeviceArenaBuffer, DeviceChunk, DeviceChunks, KeptChunk, SetMember,
};
pub use self::handles::{ArenaBuffer, ArenaLease, ArenaStats, ChunkInfo, ChunkPin};
pub use self::state::Chunk;
/// An arena's identity is part of the set record's vocabulary (records
/// name the arena their chunks come from), so it lives in [`crate::set`].
pub use crate::set::ArenaId;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// A chunk to take back into an arena with [`Arena::restore`]: its index
/// in the arena it came from, what the backing made of it again
/// ([`DeviceChunks::adopt`] for device memory), and the ranges still in
/// use in it, as (offset, length) in bytes.
#[non_exhaustive]
pub struct RestoredChunk<B: ChunkBacking> {
    /// Its index in its arena.
    pub index: u64,
    /// The chunk.
    pub chunk: B::Chunk,
    /// Its ranges in use: (offset, length) in bytes.
    pub ranges: Vec<(u64, u64)>,
}

impl<B: ChunkBacking> RestoredChunk<B> {
    /// Chunk `index` with its ranges in use.
    pub fn new(index: u64, chunk: B::Chunk, ranges: Vec<(u64, u64)>) -> Self {
        RestoredChunk {
            index,
            chunk,
            ranges,
        }
    }
}

/// What makes the chunks of an [`Arena`]: device memory for
/// [`DeviceChunks`], anything with a length for tests and other backings.
pub trait ChunkBacking: Send + Sync + 'static {
    /// One chunk, exported (where exporting applies) when it is created.
    type Chunk: Send + Sync + 'static;

    /// The size that chunk lengths are rounded up to: a power of two (the
    /// VMM allocation granularity, 2 MiB on current GPUs).
    fn granularity(&self) -> u64;

    /// Creates a chunk of `len` bytes (a multiple of
    /// [`ChunkBacking::granularity`]).
    fn create(&self, len: u64) -> Result<Self::Chunk>;

    /// The usable length of `chunk` in bytes: at least what
    /// [`ChunkBacking::create`] was asked for.
    fn chunk_len(chunk: &Self::Chunk) -> u64;
}

/// The identity of a chunk: its arena and an index the arena never reuses.
/// The key of a consumer's mapping cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkId {
    /// The arena that made the chunk.
    pub arena: ArenaId,
    /// The chunk's number in its arena (0, 1, 2, ... in creation order).
    pub index: u64,
}

impl fmt::Display for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.arena, self.index)
    }
}

/// Where a buffer lives: plain data that consumers resolve against their
/// mapping of the chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct BufferView {
    /// The chunk.
    pub chunk: ChunkId,
    /// Bytes from the start of the chunk to the buffer's first byte.
    pub offset: u64,
    /// The buffer's length in bytes.
    pub byte_len: u64,
}

/// How an [`Arena`] sizes, aligns and limits its chunks.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ArenaOptions {
    /// The size of the first chunk, and the least size of every chunk
    /// (rounded up to the backing's granularity). Default 256 MiB.
    pub chunk_size: u64,
    /// The largest chunk that growth makes (buffers larger than this get a
    /// chunk of exactly their size). Default 2 GiB.
    pub max_chunk_size: u64,
    /// The alignment of every buffer's offset in its chunk: a power of two
    /// from 1 byte to 2 MiB. Default 256 bytes.
    pub alignment: u64,
    /// The most bytes of chunks the arena holds at once, if limited. When an
    /// allocation would pass it, empty chunks are trimmed first; if that is
    /// not enough, the allocation fails. Default: no limit.
    pub limit: Option<u64>,
    /// How many buffers each chunk can hold at least, whatever their sizes
    /// (the allocator's bookkeeping takes 64 bytes of host memory per
    /// buffer per chunk, allocated with the chunk). Default 16,384.
    pub max_buffers_per_chunk: u32,
}

impl Default for ArenaOptions {
    fn default() -> Self {
        ArenaOptions {
            chunk_size: 256 * MIB,
            max_chunk_size: 2 * GIB,
            alignment: DEFAULT_ALIGNMENT,
            limit: None,
            max_buffers_per_chunk: 16 * 1024,
        }
    }
}

/// The default alignment of a buffer's offset in its chunk
/// ([`ArenaOptions::alignment`]): 256 bytes, what the driver gives
/// `cudaMalloc` allocations and what vectorised kernels expect.
pub const DEFAULT_ALIGNMENT: u64 = 256;

/// The largest `max_buffers_per_chunk`: the allocator counts its nodes
/// (two per buffer, one more per chunk) in 32 bits.
const MAX_BUFFERS_PER_CHUNK: u32 = (u32::MAX - 4) / 2;

/// The largest alignment: the VMM granularity, the least that chunks are
/// aligned to on VMM.
const MAX_ALIGNMENT: u64 = 2 * MIB;

impl ArenaOptions {
    /// The size of the first chunk and the least of every chunk.
    #[must_use]
    pub fn with_chunk_size(mut self, bytes: u64) -> Self {
        self.chunk_size = bytes;
        self
    }

    /// The largest chunk that growth makes.
    #[must_use]
    pub fn with_max_chunk_size(mut self, bytes: u64) -> Self {
        self.max_chunk_size = bytes;
        self
    }

    /// The alignment of every buffer's offset in its chunk.
    #[must_use]
    pub fn with_alignment(mut self, bytes: u64) -> Self {
        self.alignment = bytes;
        self
    }

    /// The most bytes of chunks held at once (`None`: no limit).
    #[must_use]
    pub fn with_limit(mut self, bytes: Option<u64>) -> Self {
        self.limit = bytes;
        self
    }

    /// How many buffers each chunk can hold at least.
    #[must_use]
    pub fn with_max_buffers_per_chunk(mut self, count: u32) -> Self {
        self.max_buffers_per_chunk = count;
        self
    }

    /// Checks that the options make sense together.
    pub fn validate(&self) -> Result<()> {
        if !self.alignment.is_power_of_two() || self.alignment > MAX_ALIGNMENT {
            return Err(Error::arg(
                "arena alignment",
                format!(
                    "{} is not a power of two from 1 byte to {} KiB",
                    self.alignment,
                    MAX_ALIGNMENT / KIB
                ),
            ));
        }
        if self.chunk_size == 0 {
            return Err(Error::arg(
                "arena chunk size",
                "must be at least one byte (256 MiB suits model weights)",
            ));
        }
        if self.max_chunk_size < self.chunk_size {
            return Err(Error::arg(
                "arena max chunk size",
                format!(
                    "{} bytes is less than the chunk size, {} bytes",
                    self.max_chunk_size, self.chunk_size
                ),
            ));
        }
        if self.max_buffers_per_chunk == 0 || self.max_buffers_per_chunk > MAX_BUFFERS_PER_CHUNK {
            return Err(Error::arg(
                "arena buffers per chunk",
                format!(
                    "{} is not from 1 to {MAX_BUFFERS_PER_CHUNK}",
                    self.max_buffers_per_chunk
                ),
            ));
        }
        Ok(())
    }
}
