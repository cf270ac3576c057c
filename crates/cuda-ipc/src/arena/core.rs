//! The accounting of an arena, independent of what its chunks are.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use offset_allocator::{Allocation, Allocator};

use super::{ArenaId, ArenaOptions, BufferView, ChunkBacking, ChunkId};
use crate::error::{Error, Result};

/// The most allocation units a chunk is split into: chunks larger than
/// `alignment << 30` bytes count in larger units (still multiples of the
/// alignment), which keeps the allocator's sizes well inside 32 bits.
const MAX_UNITS: u64 = 1 << 30;

/// One chunk: its identity, its length and what the backing made.
pub struct Chunk<B: ChunkBacking> {
    id: ChunkId,
    len: u64,
    inner: B::Chunk,
}

impl<B: ChunkBacking> Chunk<B> {
    /// The chunk's identity (the key of consumers' mapping caches).
    pub fn id(&self) -> ChunkId {
        self.id
    }

    /// The chunk's usable length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false: chunks are at least one allocation unit long.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// What the backing made (for [`DeviceChunks`](super::DeviceChunks),
    /// the device memory and its export).
    pub fn backing(&self) -> &B::Chunk {
        &self.inner
    }
}

impl<B: ChunkBacking> fmt::Debug for Chunk<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Chunk")
            .field("id", &self.id)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

/// A chunk in the arena's table, with its allocator and counts.
struct ChunkState<B: ChunkBacking> {
    chunk: Arc<Chunk<B>>,
    allocator: Allocator,
    /// Bytes per allocation unit: the alignment or a power-of-two multiple.
    unit: u64,
    /// Whole units in the chunk.
    units: u64,
    /// Ranges not yet given back.
    buffers: usize,
    /// Bytes those ranges take (whole units).
    used: u64,
    /// Pins held on the chunk.
    pins: usize,
    /// Whether one range takes the whole chunk (outside the allocator).
    whole: bool,
}

impl<B: ChunkBacking> ChunkState<B> {
    fn is_idle(&self) -> bool {
        self.buffers == 0 && self.pins == 0
    }

    /// Bytes free for other ranges (none while one range takes it whole).
    fn free(&self) -> u64 {
        if self.whole {
            0
        } else {
            self.units * self.unit - self.used
        }
    }
}

/// The unit that splits a chunk of `len` bytes into at most [`MAX_UNITS`].
fn unit_for(len: u64, alignment: u64) -> u64 {
    let mut unit = alignment;
    while len / unit > MAX_UNITS {
        unit *= 2;
    }
    unit
}

/// How a range was taken from its chunk.
#[derive(Clone, Copy)]
enum Slot {
    /// From the chunk's allocator.
    Range(Allocation),
    /// The whole chunk, outside the allocator.
    Whole,
}

/// A range just allocated: its chunk, its slot, the offset and the bytes
/// it takes.
type Found<B> = (Arc<Chunk<B>>, Slot, u64, u64);

struct Core<B: ChunkBacking> {
    chunks: BTreeMap<u64, ChunkState<B>>,
    next_index: u64,
    /// Bytes of the chunks in the table.
    chunk_bytes: u64,
    /// Bytes of chunks being created (outside the lock).
    pending: u64,
    /// Leases alive.
    leases: usize,
    /// Ranges the producer dropped that leases still hold.
    orphans: usize,
    /// Bytes asked for by the ranges alive.
    requested: u64,
    /// Chunks ever created, and ever released.
    created: u64,
    released: u64,
}

impl<B: ChunkBacking> Core<B> {
    /// Allocates `len` bytes from the first chunk that has room, or from
    /// chunk `only`.
    fn try_alloc(&mut self, len: u64, only: Option<u64>) -> Option<Found<B>> {
        for (index, state) in &mut self.chunks {
            if only.is_some_and(|o| o != *index) {
                continue;
            }
            let units = len.div_ceil(state.unit);
            if state.whole || units > state.units {
                continue;
            }
            // `units` <= MAX_UNITS, so it fits in 32 bits.
            let slot = match state.allocator.allocate(units as u32) {
                Some(a) => Slot::Range(a),
                // The allocator sorts free ranges into size classes about
                // 12% apart and may refuse a size close to a free range's
                // (its price for O(1)); an empty chunk serves it whole.
                None if state.buffers == 0 => {
                    state.whole = true;
                    Slot::Whole
                }
                None => continue,
            };
            let bytes = units * state.unit;
            state.buffers += 1;
            state.used += bytes;
            self.requested += len;
            let offset = match slot {
                Slot::Range(a) => u64::from(a.offset) * state.unit,
                Slot::Whole => 0,
            };
            return Some((state.chunk.clone(), slot, offset, bytes));
        }
        None
    }

    /// Takes the idle chunks out of the table (to be dropped after the lock).
    fn take_idle(&mut self) -> Vec<ChunkState<B>> {
        let idle: Vec<u64> = self
            .chunks
            .iter()
            .filter(|(_, s)| s.is_idle())
            .map(|(i, _)| *i)
            .collect();
        let mut out = Vec::with_capacity(idle.len());
        for i in idle {
            if let Some(s) = self.chunks.remove(&i) {
                self.chunk_bytes -= s.chunk.len;
                self.released += 1;
                out.push(s);
            }
        }
        out
    }
}

struct Shared<B: ChunkBacking> {
    id: ArenaId,
    backing: B,
    options: ArenaOptions,
    core: Mutex<Core<B>>,
}

impl<B: ChunkBacking> Shared<B> {
    fn lock(&self) -> MutexGuard<'_, Core<B>> {
        // The accounting is updated only by code that does not panic, so a
        // poisoned lock still guards consistent data.
        self.core.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A producer-side allocator of shareable memory: chunks exported once,
/// sub-allocated into buffers. See the [module documentation](super) for
/// the contract.
pub struct Arena<B: ChunkBacking> {
    shared: Arc<Shared<B>>,
}

impl<B: ChunkBacking> fmt::Debug for Arena<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Arena")
            .field("id", &self.shared.id)
            .field("options", &self.shared.options)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl<B: ChunkBacking> Arena<B> {
    /// An empty arena whose chunks `backing` makes. No chunk is created
    /// before the first allocation or [`Arena::reserve`].
    pub fn new(backing: B, options: ArenaOptions) -> Result<Self> {
        options.validate()?;
        let g = backing.granularity();
        if !g.is_power_of_two() {
            return Err(Error::arg(
                "chunk granularity",
                format!("{g} is not a power of two"),
            ));
        }
        Ok(Arena {
            shared: Arc::new(Shared {
                id: ArenaId::new(),
                backing,
                options,
                core: Mutex::new(Core {
                    chunks: BTreeMap::new(),
                    next_index: 0,
                    chunk_bytes: 0,
                    pending: 0,
                    leases: 0,
                    orphans: 0,
                    requested: 0,
                    created: 0,
                    released: 0,
                }),
            }),
        })
    }

    /// The arena's identity.
    pub fn id(&self) -> ArenaId {
        self.shared.id
    }

    /// The options the arena was made with.
    pub fn options(&self) -> &ArenaOptions {
        &self.shared.options
    }

    /// What makes the chunks.
    pub fn backing(&self) -> &B {
        &self.shared.backing
    }

    /// Allocates `len` bytes, from a chunk that has room or from a new one.
    /// No export happens unless a chunk is created.
    pub fn alloc(&self, len: u64) -> Result<ArenaBuffer<B>> {
        if len == 0 {
            return Err(Error::arg(
                "size",
                "cannot allocate an empty buffer from an arena; ask for at least one byte",
            ));
        }
        let mut core = self.shared.lock();
        if let Some(found) = core.try_alloc(len, None) {
            drop(core);
            return Ok(self.buffer(len, found));
        }
        let size = self.next_chunk_len(&core, len)?;
        let (core, index) = self.add_chunk(core, size, true)?;
        let mut core = core;
        match core.try_alloc(len, Some(index)) {
            Some(found) => {
                drop(core);
                Ok(self.buffer(len, found))
            }
            None => Err(Error::arg(
                "size",
                format!(
                    "{len} bytes do not fit in a new chunk of {size} bytes (the backing made a smaller chunk than asked)"
                ),
            )),
        }
    }

    /// Makes sure the chunks have at least `bytes` free (counting free bytes,
    /// not the largest free range), creating and exporting one chunk now if
    /// not: at least [`ArenaOptions::chunk_size`], and as large as what is
    /// missing. Returns the bytes of chunks created (0 if none was needed).
    /// Allocations still grow the arena on demand when fragmentation leaves
    /// no range large enough.
    pub fn reserve(&self, bytes: u64) -> Result<u64> {
        let mut created = 0;
        let mut core = self.shared.lock();
        // A second round only when the limit made room by trimming idle
        // chunks, whose free bytes counted in the first; it trims nothing
        // (it would trim the chunk just made).
        for trim in [true, false] {
            let free: u64 = core.chunks.values().map(ChunkState::free).sum::<u64>() + core.pending;
            if free >= bytes {
                break;
            }
            let size = self.round_chunk(bytes - free)?;
            core = self.add_chunk(core, size, trim)?.0;
            created += size;
        }
        Ok(created)
    }

    /// Releases every chunk that holds no buffer and no pin. Returns the
    /// bytes released.
    pub fn trim(&self) -> u64 {
        let idle = self.shared.lock().take_idle();
        let bytes = idle.iter().map(|s| s.chunk.len).sum();
        // Freed here, outside the lock (a device chunk's release is slow).
        drop(idle);
        bytes
    }

    /// Keeps chunk `id` out of [`Arena::trim`] while the pin lives (one per
    /// consumer that maps the chunk).
    pub fn pin(&self, id: ChunkId) -> Result<ChunkPin<B>> {
        if id.arena != self.shared.id {
            return Err(Error::arg(
                "chunk",
                format!(
                    "chunk {id} belongs to another arena than {}",
                    self.shared.id
                ),
            ));
        }
        let mut core = self.shared.lock();
        let state = core.chunks.get_mut(&id.index).ok_or_else(|| {
            Error::arg(
                "chunk",
                format!("chunk {id} is not in the arena (it was trimmed, or never made)"),
            )
        })?;
        state.pins += 1;
        Ok(ChunkPin {
            shared: self.shared.clone(),
            chunk: state.chunk.clone(),
        })
    }

    /// The chunk with this index, if the arena still has it.
    pub fn chunk(&self, index: u64) -> Option<Arc<Chunk<B>>> {
        self.shared
            .lock()
            .chunks
            .get(&index)
            .map(|s| s.chunk.clone())
    }

    /// Every chunk of the arena, in creation order, with its counts.
    pub fn chunks(&self) -> Vec<ChunkInfo> {
        self.shared
            .lock()
            .chunks
            .values()
            .map(|s| ChunkInfo {
                id: s.chunk.id,
                len: s.chunk.len,
                used: s.used,
                buffers: s.buffers,
                pins: s.pins,
                unit: s.unit,
                free: s.free(),
            })
            .collect()
    }

    /// The arena's counts.
    pub fn stats(&self) -> ArenaStats {
        let core = self.shared.lock();
        ArenaStats {
            chunks: core.chunks.len(),
            chunk_bytes: core.chunk_bytes,
            idle_chunks: core.chunks.values().filter(|s| s.is_idle()).count(),
            buffers: core.chunks.values().map(|s| s.buffers).sum(),
            used_bytes: core.chunks.values().map(|s| s.used).sum(),
            requested_bytes: core.requested,
            leases: core.leases,
            held_by_leases_only: core.orphans,
            pins: core.chunks.values().map(|s| s.pins).sum(),
            chunks_created: core.created,
            chunks_released: core.released,
        }
    }

    fn buffer(&self, len: u64, found: Found<B>) -> ArenaBuffer<B> {
        let (chunk, slot, offset, bytes) = found;
        ArenaBuffer {
            range: Arc::new(Range {
                shared: self.shared.clone(),
                chunk,
                slot,
                offset,
                len,
                bytes,
                leases: 0.into(),
                producer: true.into(),
            }),
        }
    }

    /// `len` rounded up to the granularity and to a whole number of units.
    fn round_chunk(&self, len: u64) -> Result<u64> {
        let o = &self.shared.options;
        let g = self.shared.backing.granularity();
        let too_large = || Error::arg("size", format!("{len} bytes is too large for a chunk"));
        let len = len.max(o.chunk_size);
        let rounded = len.checked_next_multiple_of(g).ok_or_else(too_large)?;
        rounded
            .checked_next_multiple_of(unit_for(rounded, o.alignment))
            .ok_or_else(too_large)
    }

    /// The size of the chunk to create for an allocation of `len` bytes.
    fn next_chunk_len(&self, core: &Core<B>, len: u64) -> Result<u64> {
        let o = &self.shared.options;
        let grown = core
            .chunk_bytes
            .saturating_add(core.pending)
            .clamp(o.chunk_size, o.max_chunk_size);
        self.round_chunk(grown.max(len))
    }

    /// Creates a chunk of `size` bytes (outside the lock) and puts it in the
    /// table; returns the lock again and the chunk's index. Where the limit
    /// would be passed, idle chunks are trimmed first if `trim`.
    fn add_chunk<'a>(
        &'a self,
        mut core: MutexGuard<'a, Core<B>>,
        size: u64,
        trim: bool,
    ) -> Result<(MutexGuard<'a, Core<B>>, u64)> {
        let o = &self.shared.options;
        let mut idle = Vec::new();
        if let Some(limit) = o.limit {
            if trim
                && core
                    .chunk_bytes
                    .saturating_add(core.pending)
                    .saturating_add(size)
                    > limit
            {
                idle = core.take_idle();
            }
            let held = core.chunk_bytes.saturating_add(core.pending);
            if held.saturating_add(size) > limit {
                drop(core);
                drop(idle);
                return Err(Error::Unsupported {
                    what: "growing the arena",
                    why: format!(
                        "a new chunk of {size} bytes would pass the arena's limit of {limit} bytes \
                         ({held} bytes of chunks are in use); drop buffers (and let their leases end), \
                         or raise ArenaOptions::limit"
                    ),
                });
            }
        }
        core.pending += size;
        drop(core);
        drop(idle);
        let made = self.shared.backing.create(size);
        let mut core = self.shared.lock();
        core.pending -= size;
        let inner = made?;
        let len = B::chunk_len(&inner);
        let unit = unit_for(len, o.alignment);
        let units = len / unit;
        if len < size || units == 0 {
            return Err(Error::arg(
                "chunk",
                format!("the backing made a chunk of {len} bytes when {size} were asked for"),
            ));
        }
        let index = core.next_index;
        core.next_index += 1;
        let chunk = Arc::new(Chunk {
            id: ChunkId {
                arena: self.shared.id,
                index,
            },
            len,
            inner,
        });
        let nodes = 2 * o.max_buffers_per_chunk + 2;
        core.chunks.insert(
            index,
            ChunkState {
                chunk,
                allocator: Allocator::with_max_allocs(units as u32, nodes),
                unit,
                units,
                buffers: 0,
                used: 0,
                pins: 0,
                whole: false,
            },
        );
        core.chunk_bytes += len;
        core.created += 1;
        Ok((core, index))
    }
}

/// A range of a chunk, alive while the producer's buffer or a lease holds it.
struct Range<B: ChunkBacking> {
    shared: Arc<Shared<B>>,
    chunk: Arc<Chunk<B>>,
    slot: Slot,
    offset: u64,
    len: u64,
    /// Bytes the range takes in its chunk (whole units).
    bytes: u64,
    /// Leases alive on this range; changed only under the arena's lock.
    leases: AtomicUsize,
    /// Whether the producer's buffer is alive; changed only under the lock.
    producer: AtomicBool,
}

impl<B: ChunkBacking> Range<B> {
    fn view(&self) -> BufferView {
        BufferView {
            chunk: self.chunk.id,
            offset: self.offset,
            len: self.len,
        }
    }
}

impl<B: ChunkBacking> Drop for Range<B> {
    fn drop(&mut self) {
        // The last holder is gone: the range goes back to its chunk, which
        // is still in the table (a chunk with a range is never trimmed).
        let mut core = self.shared.lock();
        core.requested -= self.len;
        if let Some(state) = core.chunks.get_mut(&self.chunk.id.index) {
            match self.slot {
                Slot::Range(a) => state.allocator.free(a),
                Slot::Whole => state.whole = false,
            }
            state.buffers -= 1;
            state.used -= self.bytes;
        }
    }
}

/// A buffer allocated from an [`Arena`]: a view of a chunk (chunk, offset,
/// length), owned by the producer. Its range goes back to the arena when
/// this is dropped **and** every [`ArenaLease`] on it has ended.
pub struct ArenaBuffer<B: ChunkBacking> {
    range: Arc<Range<B>>,
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
    pub fn len(&self) -> u64 {
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

/// Keeps a chunk out of [`Arena::trim`] while it lives: the exchange layer
/// holds one per consumer that maps the chunk.
pub struct ChunkPin<B: ChunkBacking> {
    shared: Arc<Shared<B>>,
    chunk: Arc<Chunk<B>>,
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

/// One chunk's counts, from [`Arena::chunks`].
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

/// An arena's counts, from [`Arena::stats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct ArenaStats {
    /// Chunks in the arena.
    pub chunks: usize,
    /// Their bytes: the device memory the arena holds.
    pub chunk_bytes: u64,
    /// Chunks with no range and no pin ([`Arena::trim`] would release them).
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
