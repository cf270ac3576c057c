//! The accounting of an arena, independent of what its chunks are.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use offset_allocator::Allocator;

use super::handles::{ArenaBuffer, ArenaStats, ChunkInfo, ChunkPin};
use super::state::{Chunk, ChunkState, Core, Found, Range, Shared, Slot, unit_for};
use super::{ArenaId, ArenaOptions, ChunkBacking, ChunkId, RestoredChunk};
use crate::error::{Error, Result};

/// The options' and the backing's checks, before an arena is made.
fn check_backing<B: ChunkBacking>(backing: &B, options: &ArenaOptions) -> Result<()> {
    options.validate()?;
    let g = backing.granularity();
    if !g.is_power_of_two() {
        return Err(Error::arg(
            "chunk granularity",
            format!("{g} is not a power of two"),
        ));
    }
    Ok(())
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
        check_backing(&backing, &options)?;
        Ok(Self::with_id(backing, options, ArenaId::new()))
    }

    fn with_id(backing: B, options: ArenaOptions, id: ArenaId) -> Self {
        Arena {
            shared: Arc::new(Shared {
                id,
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
        }
    }

    /// An arena that takes back the chunks of arena `id`, made by another
    /// process (or an earlier run of this program) that is gone: each
    /// [`RestoredChunk`] keeps its index, so consumers that cached its
    /// mapping by [`ChunkId`] still find it, and its ranges in use come
    /// back as buffers, in the order given (one `Vec` per chunk). A restored
    /// chunk hands out no new range: new allocations make new chunks,
    /// numbered after the largest index, and a restored chunk goes at
    /// [`Arena::trim`] once its last range has gone back.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an index given twice, a chunk
    /// shorter than the backing's granularity, or a range that is empty,
    /// ends past its chunk, or overlaps another.
    pub fn restore(
        backing: B,
        options: ArenaOptions,
        id: ArenaId,
        chunks: Vec<RestoredChunk<B>>,
    ) -> Result<(Self, Vec<Vec<ArenaBuffer<B>>>)> {
        check_backing(&backing, &options)?;
        let arena = Self::with_id(backing, options, id);
        let mut out = Vec::with_capacity(chunks.len());
        for restored in chunks {
            out.push(arena.take_back(restored)?);
        }
        Ok((arena, out))
    }

    /// Puts one restored chunk in the table and makes its ranges buffers.
    fn take_back(&self, restored: RestoredChunk<B>) -> Result<Vec<ArenaBuffer<B>>> {
        let RestoredChunk {
            index,
            chunk,
            mut ranges,
        } = restored;
        let o = &self.shared.options;
        let len = B::chunk_len(&chunk);
        let bad = |why: String| Error::arg("restored chunk", format!("chunk {index}: {why}"));
        if len < self.shared.backing.granularity() {
            return Err(bad(format!("{len} bytes is less than the granularity")));
        }
        let unit = unit_for(len, o.alignment);
        let mut order: Vec<usize> = (0..ranges.len()).collect();
        order.sort_by_key(|&i| ranges[i].0);
        let mut end = 0;
        for &i in &order {
            let (offset, n) = ranges[i];
            if n == 0 || offset < end || Error::check_range(offset, n, len).is_err() {
                return Err(bad(format!(
                    "the range of {n} bytes at {offset} is empty, overlaps another or ends past \
                     the chunk's {len} bytes"
                )));
            }
            end = offset + n;
        }
        let mut core = self.shared.lock();
        if core.chunks.contains_key(&index) {
            return Err(bad("the index is given twice".into()));
        }
        let chunk = Arc::new(Chunk {
            id: ChunkId {
                arena: self.shared.id,
                index,
            },
            len,
            inner: chunk,
        });
        let used: u64 = ranges.iter().map(|r| r.1.div_ceil(unit) * unit).sum();
        core.chunks.insert(
            index,
            ChunkState {
                chunk: chunk.clone(),
                allocator: Allocator::with_max_allocs(1, 2),
                unit,
                units: len / unit,
                buffers: ranges.len(),
                used,
                pins: 0,
                whole: false,
                restored: true,
            },
        );
        core.next_index = core.next_index.max(index + 1);
        core.chunk_bytes += len;
        core.requested += ranges.iter().map(|r| r.1).sum::<u64>();
        drop(core);
        Ok(ranges
            .drain(..)
            .map(|(offset, n)| {
                self.buffer(
                    n,
                    (
                        chunk.clone(),
                        Slot::Restored,
                        offset,
                        n.div_ceil(unit) * unit,
                    ),
                )
            })
            .collect())
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
                restored: false,
            },
        );
        core.chunk_bytes += len;
        core.created += 1;
        Ok((core, index))
    }
}
