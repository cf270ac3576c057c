//! What a set's event is recorded after, worked out once when the set is
//! published, so that an update costs the same whatever the set's size.
//!
//! Publishing a set visits every member once: it takes a lease per member
//! and finds the set's distinct chunks and the distinct streams of those
//! chunks ([`SetHold::new`]). The book keeps that ([`SetOrder`], shared
//! behind an `Arc`) for as long as the set is published, and
//! [`Publisher::update_set`](super::Publisher::update_set) takes it from
//! there: no member, lease or entry of the record is looked at again.
//!
//! # Why the streams stay right
//! A chunk's stream is its memory's own ([`DeviceMemory::stream`]): the
//! arena owns the chunk's buffer and never changes its stream (a
//! `with_stream` takes a buffer by value, and no arena buffer has one), so
//! the streams found at publish are the streams at every update. What can
//! change is whether a chunk's memory was used on *other* streams (cudarc
//! launches and copies given another stream, see
//! [`ForeignUse`](crate::memory::ForeignUse)): each update asks every
//! distinct chunk for its stream again ([`SetOrder::ordered_streams`]),
//! which orders those uses before it. That is one atomic load per chunk
//! when there were none; chunks grow with the arena's bytes (logarithmically
//! up to the largest chunk size), never with the number of buffers.

use std::collections::HashSet;
use std::sync::Arc;

use cudarc::driver::CudaStream;

use crate::arena::{ArenaLease, Chunk, ChunkBacking, DeviceChunk};
use crate::memory::DeviceMemory;

/// A chunk whose memory is ordered by a stream: the stream that a set's
/// event is recorded after (for device chunks, a CUDA stream). Compared by
/// identity (`Arc::ptr_eq`).
pub(super) trait ChunkStream {
    /// The stream type.
    type Stream: Send + Sync + 'static;

    /// The chunk's stream, made to wait first for the chunk's uses on
    /// other streams so far.
    fn stream(&self) -> &Arc<Self::Stream>;
}

impl ChunkStream for DeviceChunk {
    type Stream = CudaStream;

    fn stream(&self) -> &Arc<CudaStream> {
        // The chunk buffer's stream, after its uses elsewhere (ForeignUse::order).
        DeviceMemory::stream(self.buffer())
    }
}

/// The stream type of the chunks of backing `B`.
pub(super) type StreamOf<B> = <<B as ChunkBacking>::Chunk as ChunkStream>::Stream;

/// A set's distinct chunks and the distinct streams of those chunks, in
/// the order the members first use them.
pub(super) struct SetOrder<B: ChunkBacking>
where
    B::Chunk: ChunkStream,
{
    chunks: Box<[Arc<Chunk<B>>]>,
    streams: Box<[Arc<StreamOf<B>>]>,
}

impl<B: ChunkBacking> SetOrder<B>
where
    B::Chunk: ChunkStream,
{
    /// The distinct chunks of `chunks` (by identity) and their distinct
    /// streams: one pass, a set lookup per member.
    fn of<'a>(chunks: impl IntoIterator<Item = &'a Arc<Chunk<B>>>) -> Self {
        let mut seen = HashSet::with_hasher(foldhash::fast::RandomState::default());
        let mut distinct: Vec<Arc<Chunk<B>>> = Vec::new();
        for c in chunks {
            // Members mostly follow each other in a chunk: one already
            // seen last needs no look-up.
            if distinct.last().is_some_and(|last| Arc::ptr_eq(last, c)) {
                continue;
            }
            if seen.insert(c.id()) {
                distinct.push(Arc::clone(c));
            }
        }
        let mut streams: Vec<Arc<StreamOf<B>>> = Vec::new();
        for c in &distinct {
            let s = c.backing().stream();
            // Streams are few (one per device for an arena's chunks).
            if !streams.iter().any(|o| Arc::ptr_eq(o, s)) {
                streams.push(Arc::clone(s));
            }
        }
        SetOrder {
            chunks: distinct.into_boxed_slice(),
            streams: streams.into_boxed_slice(),
        }
    }

    /// The set's distinct chunks.
    pub(super) fn chunks(&self) -> &[Arc<Chunk<B>>] {
        &self.chunks
    }

    /// The distinct streams of the set's chunks, as found at publish.
    #[cfg(test)]
    pub(super) fn streams(&self) -> &[Arc<StreamOf<B>>] {
        &self.streams
    }

    /// The distinct streams, each made to wait first for its chunks' uses
    /// on other streams so far (one atomic load per chunk where there were
    /// none): what the set's event must be recorded after.
    pub(super) fn ordered_streams(&self) -> &[Arc<StreamOf<B>>] {
        for c in &self.chunks {
            // Called for its ordering; the stream itself is cached.
            let _ = c.backing().stream();
        }
        &self.streams
    }
}

/// What the book holds for a published set: a lease on every member's
/// buffer and the set's [`SetOrder`], worked out from the same leases.
pub(super) struct SetHold<B: ChunkBacking>
where
    B::Chunk: ChunkStream,
{
    pub(super) leases: Vec<ArenaLease<B>>,
    pub(super) order: Arc<SetOrder<B>>,
}

impl<B: ChunkBacking> SetHold<B>
where
    B::Chunk: ChunkStream,
{
    /// Holds `leases` (one per member) and works out their order.
    pub(super) fn new(leases: Vec<ArenaLease<B>>) -> Self {
        let order = Arc::new(SetOrder::of(leases.iter().map(ArenaLease::chunk)));
        SetHold { leases, order }
    }

    /// The set's order, shared with the book.
    pub(super) fn order(&self) -> &Arc<SetOrder<B>> {
        &self.order
    }
}
