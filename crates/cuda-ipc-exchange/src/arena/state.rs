//! The arena's shared state: its chunks with their allocators and counts,
//! and the ranges alive in them, which every handle the arena gives out
//! points into.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use offset_allocator::{Allocation, Allocator};

use super::{ArenaId, ArenaOptions, BufferView, ChunkBacking, ChunkId};

/// The most allocation units a chunk is split into: chunks larger than
/// `alignment << 30` bytes count in larger units (still multiples of the
/// alignment), which keeps the allocator's sizes well inside 32 bits.
pub(super) const MAX_UNITS: u64 = 1 << 30;

/// One chunk: its identity, its length and what the backing made.
pub struct Chunk<B: ChunkBacking> {
    pub(super) id: ChunkId,
    pub(super) len: u64,
    pub(super) inner: B::Chunk,
}

impl<B: ChunkBacking> Chunk<B> {
    /// The chunk's identity (the key of consumers' mapping caches).
    pub fn id(&self) -> ChunkId {
        self.id
    }

    /// The chunk's usable length in bytes.
    pub fn byte_len(&self) -> u64 {
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
pub(super) struct ChunkState<B: ChunkBacking> {
    pub(super) chunk: Arc<Chunk<B>>,
    pub(super) allocator: Allocator,
    /// Bytes per allocation unit: the alignment or a power-of-two multiple.
    pub(super) unit: u64,
    /// Whole units in the chunk.
    pub(super) units: u64,
    /// Ranges not yet given back.
    pub(super) buffers: usize,
    /// Bytes those ranges take (whole units).
    pub(super) used: u64,
    /// Pins held on the chunk.
    pub(super) pins: usize,
    /// Whether one range takes the whole chunk (outside the allocator).
    pub(super) whole: bool,
    /// Whether the chunk was taken back with its ranges
    /// ([`Arena::restore`](super::Arena::restore)): it gives no new ones.
    pub(super) restored: bool,
}

impl<B: ChunkBacking> ChunkState<B> {
    pub(super) fn is_idle(&self) -> bool {
        self.buffers == 0 && self.pins == 0
    }

    /// Bytes free for other ranges (none while one range takes it whole).
    pub(super) fn free(&self) -> u64 {
        if self.whole || self.restored {
            0
        } else {
            self.units * self.unit - self.used
        }
    }
}

/// The unit that splits a chunk of `len` bytes into at most [`MAX_UNITS`].
pub(super) fn unit_for(len: u64, alignment: u64) -> u64 {
    let mut unit = alignment;
    while len / unit > MAX_UNITS {
        unit *= 2;
    }
    unit
}

/// How a range was taken from its chunk.
#[derive(Clone, Copy)]
pub(super) enum Slot {
    /// From the chunk's allocator.
    Range(Allocation),
    /// The whole chunk, outside the allocator.
    Whole,
    /// A range of a restored chunk, outside the allocator.
    Restored,
}

/// A range just allocated: its chunk, its slot, the offset and the bytes
/// it takes.
pub(super) type Found<B> = (Arc<Chunk<B>>, Slot, u64, u64);

pub(super) struct Core<B: ChunkBacking> {
    pub(super) chunks: BTreeMap<u64, ChunkState<B>>,
    pub(super) next_index: u64,
    /// Bytes of the chunks in the table.
    pub(super) chunk_bytes: u64,
    /// Bytes of chunks being created (outside the lock).
    pub(super) pending: u64,
    /// Leases alive.
    pub(super) leases: usize,
    /// Ranges the producer dropped that leases still hold.
    pub(super) orphans: usize,
    /// Bytes asked for by the ranges alive.
    pub(super) requested: u64,
    /// Chunks ever created, and ever released.
    pub(super) created: u64,
    pub(super) released: u64,
}

impl<B: ChunkBacking> Core<B> {
    /// Allocates `len` bytes from the first chunk that has room, or from
    /// chunk `only`.
    pub(super) fn try_alloc(&mut self, len: u64, only: Option<u64>) -> Option<Found<B>> {
        for (index, state) in &mut self.chunks {
            if only.is_some_and(|o| o != *index) {
                continue;
            }
            let units = len.div_ceil(state.unit);
            if state.whole || state.restored || units > state.units {
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
                Slot::Whole | Slot::Restored => 0,
            };
            return Some((state.chunk.clone(), slot, offset, bytes));
        }
        None
    }

    /// Takes the idle chunks out of the table (to be dropped after the lock).
    pub(super) fn take_idle(&mut self) -> Vec<ChunkState<B>> {
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

pub(super) struct Shared<B: ChunkBacking> {
    pub(super) id: ArenaId,
    pub(super) backing: B,
    pub(super) options: ArenaOptions,
    pub(super) core: Mutex<Core<B>>,
}

impl<B: ChunkBacking> Shared<B> {
    pub(super) fn lock(&self) -> MutexGuard<'_, Core<B>> {
        // The accounting is updated only by code that does not panic, so a
        // poisoned lock still guards consistent data.
        self.core.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A range of a chunk, alive while the producer's buffer or a lease holds it.
pub(super) struct Range<B: ChunkBacking> {
    pub(super) shared: Arc<Shared<B>>,
    pub(super) chunk: Arc<Chunk<B>>,
    pub(super) slot: Slot,
    pub(super) offset: u64,
    pub(super) len: u64,
    /// Bytes the range takes in its chunk (whole units).
    pub(super) bytes: u64,
    /// Leases alive on this range; changed only under the arena's lock.
    pub(super) leases: AtomicUsize,
    /// Whether the producer's buffer is alive; changed only under the lock.
    pub(super) producer: AtomicBool,
}

impl<B: ChunkBacking> Range<B> {
    pub(super) fn view(&self) -> BufferView {
        BufferView {
            chunk: self.chunk.id,
            offset: self.offset,
            byte_len: self.len,
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
                Slot::Restored => {}
            }
            state.buffers -= 1;
            state.used -= self.bytes;
        }
    }
}
