//! Publishing from an arena, and sets (documented in the parent module).

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use serde_json::{Value, json};

use crate::arena::{
    Arena, ArenaLease, ArenaOptions, Chunk, ChunkBacking, ChunkId, ChunkPin, DeviceArena,
    DeviceArenaBuffer, DeviceChunk, DeviceChunks, SetMember,
};
use crate::channel::{ChannelError, Server};
use crate::descriptor::{Dtype, Mechanism};
use crate::error::{Error, Result};
use crate::memory::DeviceMemory;
use crate::set::SET_VERSION_KEY;

use super::lock;
use super::publisher::Publisher;
use super::sync::{self, FenceSlot, SetFence};
use super::wire::{self, EntryMeta, UpdateNotice};

/// How a [`Publisher`] shares memory.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Sharing {
    /// Buffers come from one arena per publisher ([`Publisher::alloc`]):
    /// chunks exported once, hand-offs with no export. A consumer that maps
    /// a chunk can read every buffer in it.
    Arena {
        /// The chunks' mechanism (`None`: auto, VMM where VMM file
        /// descriptors work, else pool or legacy).
        mechanism: Option<Mechanism>,
        /// Chunk sizes, alignment, limit.
        options: ArenaOptions,
    },
    /// No arena: every buffer is its own allocation, exported when it is
    /// published ([`Publisher::publish`]); a consumer maps only what it is
    /// handed.
    Isolated,
}

impl Default for Sharing {
    /// `auto`: an arena of the best mechanism, with the default options.
    fn default() -> Self {
        Sharing::auto()
    }
}

impl Sharing {
    /// An arena of the best mechanism the device supports, default options.
    pub fn auto() -> Self {
        Sharing::Arena {
            mechanism: None,
            options: ArenaOptions::default(),
        }
    }

    /// An arena whose chunks use `mechanism`, default options.
    pub fn arena(mechanism: Mechanism) -> Self {
        Sharing::Arena {
            mechanism: Some(mechanism),
            options: ArenaOptions::default(),
        }
    }
}

/// Set records longer than this (bytes of JSON) travel in parts.
pub const SET_PART_BYTES: usize = 96 * 1024;

/// The most parts a set record travels in (96 MiB of JSON, far more than
/// the most entries a record holds take).
pub(super) const MAX_PARTS: usize = 1024;

/// The key of a set entry's metadata that lists the parts of its record.
pub(super) const PARTS_KEY: &str = "cuda_ipc_set_parts";

/// The prefix of the hidden entries a publisher makes for its arena.
pub const HIDDEN_ENTRY_PREFIX: &str = ".cuda-ipc/";

/// The hidden entry that carries a chunk's descriptor and descriptors.
pub fn chunk_entry_name(id: ChunkId) -> String {
    format!("{HIDDEN_ENTRY_PREFIX}chunk/{}/{}", id.arena, id.index)
}

/// Whether an entry's metadata is a set record (or the parts of one).
pub(super) fn is_set_meta(meta: &Value) -> bool {
    meta.get(SET_VERSION_KEY).is_some() || meta.get(PARTS_KEY).is_some()
}

/// A chunk that can be published as a hidden entry: its metadata and
/// copies of its file descriptors (no new export).
pub(super) trait ChunkEntry {
    fn entry(&self) -> Result<(Value, Vec<OwnedFd>)>;
}

impl ChunkEntry for DeviceChunk {
    fn entry(&self) -> Result<(Value, Vec<OwnedFd>)> {
        let fds = self
            .fds()
            .iter()
            .map(|fd| {
                fd.try_clone()
                    .map_err(|e| Error::arg("chunk descriptor", format!("cannot dup: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((wire::to_value(&EntryMeta::new(self.descriptor()))?, fds))
    }
}

struct Published<B: ChunkBacking> {
    leases: Vec<ArenaLease<B>>,
    chunks: Vec<Arc<Chunk<B>>>,
    parts: Vec<String>,
    /// The set's fence slot, if it has one.
    fence: Option<FenceSlot>,
}

/// What stays alive after an entry is unpublished, until its last lease ends.
struct Retired<B: ChunkBacking> {
    names: Vec<String>,
    _leases: Vec<ArenaLease<B>>,
    _pin: Option<ChunkPin<B>>,
    _fence: Option<FenceSlot>,
}

/// The publisher's bookkeeping of arena entries: which chunks are published
/// as hidden entries, which sets hold which leases, what waits for its last
/// consumer. Generic over the backing so that it runs without a GPU.
pub(super) struct Book<B: ChunkBacking> {
    sets: HashMap<String, Published<B>>,
    chunks: HashMap<u64, ChunkPin<B>>,
    retired: Vec<Retired<B>>,
    parts: u64,
}

impl<B: ChunkBacking> Default for Book<B> {
    fn default() -> Self {
        Book {
            sets: HashMap::new(),
            chunks: HashMap::new(),
            retired: Vec::new(),
            parts: 0,
        }
    }
}

impl<B: ChunkBacking> Book<B>
where
    B::Chunk: ChunkEntry,
{
    /// Publishes `chunk` as a hidden entry unless it is already.
    fn ensure_chunk(&mut self, server: &Server, arena: &Arena<B>, chunk: &Chunk<B>) -> Result<()> {
        let id = chunk.id();
        if self.chunks.contains_key(&id.index) {
            return Ok(());
        }
        let pin = arena.pin(id)?;
        let (meta, fds) = chunk.backing().entry()?;
        server.publish(&chunk_entry_name(id), meta, fds)?;
        self.chunks.insert(id.index, pin);
        Ok(())
    }

    /// Publishes a set record under `name`, holding `leases` (and the
    /// fence's slot) while it is published and leased. The fence, if any,
    /// travels beside the record: its metadata under
    /// [`SET_FENCE_KEY`](sync::SET_FENCE_KEY), its file descriptor as the
    /// entry's only one.
    pub(super) fn publish(
        &mut self,
        server: &Server,
        arena: &Arena<B>,
        name: &str,
        record: Value,
        leases: Vec<ArenaLease<B>>,
        fence: Option<SetFence>,
    ) -> Result<()> {
        self.reap(server);
        if self.sets.contains_key(name) {
            return Err(ChannelError::AlreadyExists { name: name.into() }.into());
        }
        let mut chunks: Vec<Arc<Chunk<B>>> = Vec::new();
        for l in &leases {
            if !chunks.iter().any(|c| c.id() == l.chunk().id()) {
                chunks.push(l.chunk().clone());
            }
        }
        for c in &chunks {
            self.ensure_chunk(server, arena, c)?;
        }
        let text = record.to_string();
        let mut parts: Vec<String> = Vec::new();
        let mut meta = if text.len() <= SET_PART_BYTES {
            record
        } else {
            self.parts += 1;
            let pieces = split_utf8(&text, SET_PART_BYTES);
            for (i, piece) in pieces.iter().enumerate() {
                let part = format!(
                    "{HIDDEN_ENTRY_PREFIX}set-part/{}/{}/{i}",
                    arena.id(),
                    self.parts
                );
                if let Err(e) = server.publish(&part, json!({ "text": piece }), Vec::new()) {
                    for p in &parts {
                        let _ = server.unpublish(p);
                    }
                    return Err(e.into());
                }
                parts.push(part);
            }
            json!({ PARTS_KEY: parts, "bytes": text.len() })
        };
        let (fds, fence) = match fence {
            Some(f) => {
                if let Err(e) = sync::add_set_fence(&mut meta, &f.meta) {
                    for p in &parts {
                        let _ = server.unpublish(p);
                    }
                    return Err(e);
                }
                (vec![f.fd], Some(f.slot))
            }
            None => (Vec::new(), None),
        };
        if let Err(e) = server.publish(name, meta, fds) {
            for p in &parts {
                let _ = server.unpublish(p);
            }
            return Err(e.into());
        }
        self.sets.insert(
            name.to_owned(),
            Published {
                leases,
                chunks,
                parts,
                fence,
            },
        );
        Ok(())
    }

    /// The fence slot of a published set, if it has one.
    pub(super) fn fence_slot(&self, name: &str) -> Option<u32> {
        self.sets
            .get(name)
            .and_then(|s| s.fence.as_ref())
            .map(FenceSlot::slot)
    }

    /// The chunks of a published set, for recording its event.
    pub(super) fn chunks_of(&self, name: &str) -> Option<Vec<Arc<Chunk<B>>>> {
        self.sets.get(name).map(|s| s.chunks.clone())
    }

    /// Whether `name` is a set (or arena buffer) of this book.
    pub(super) fn contains(&self, name: &str) -> bool {
        self.sets.contains_key(name)
    }

    /// Unpublishes a set: no new attaches; its leases stay until its last
    /// consumer's lease ends.
    pub(super) fn unpublish(&mut self, server: &Server, name: &str) -> Result<()> {
        let set = self
            .sets
            .remove(name)
            .ok_or_else(|| Error::from(ChannelError::NotFound { name: name.into() }))?;
        let mut names = vec![name.to_owned()];
        let r = server.unpublish(name);
        for p in set.parts {
            let _ = server.unpublish(&p);
            names.push(p);
        }
        self.retired.push(Retired {
            names,
            _leases: set.leases,
            _pin: None,
            _fence: set.fence,
        });
        self.reap(server);
        Ok(r?)
    }

    /// Drops what waited for consumers whose leases have all ended; returns
    /// how many retired entries were let go.
    pub(super) fn reap(&mut self, server: &Server) -> usize {
        let before = self.retired.len();
        self.retired
            .retain(|r| r.names.iter().any(|n| server.lease_count(n) > 0));
        before - self.retired.len()
    }

    /// Unpublishes the hidden entries of chunks that hold no buffer, then
    /// trims the arena: a chunk goes when no consumer maps it any more.
    pub(super) fn trim(&mut self, server: &Server, arena: &Arena<B>) -> u64 {
        let idle: Vec<u64> = arena
            .chunks()
            .into_iter()
            .filter(|c| c.buffers == 0)
            .map(|c| c.id.index)
            .collect();
        for index in idle {
            if let Some(pin) = self.chunks.remove(&index) {
                let name = chunk_entry_name(pin.chunk().id());
                let _ = server.unpublish(&name);
                self.retired.push(Retired {
                    names: vec![name],
                    _leases: Vec::new(),
                    _pin: Some(pin),
                    _fence: None,
                });
            }
        }
        self.reap(server);
        arena.trim()
    }

    /// Entries waiting for their last consumer.
    pub(super) fn retired(&self) -> usize {
        self.retired.len()
    }
}

/// `text` in pieces of at most `max` bytes, cut at character boundaries.
fn split_utf8(text: &str, max: usize) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let mut cut = max.min(rest.len());
        while !rest.is_char_boundary(cut) {
            cut -= 1;
        }
        let (a, b) = rest.split_at(cut);
        out.push(a);
        rest = b;
    }
    out
}

/// The arena side of a [`Publisher`]: its arena (made at the first use) and
/// the bookkeeping of what it published from it.
pub(super) struct PublisherArena {
    sharing: Sharing,
    arena: OnceLock<DeviceArena>,
    pub(super) book: std::sync::Mutex<Book<DeviceChunks>>,
}

impl PublisherArena {
    pub(super) fn new(sharing: Sharing) -> Self {
        PublisherArena {
            sharing,
            arena: OnceLock::new(),
            book: std::sync::Mutex::new(Book::default()),
        }
    }
}

impl Publisher {
    /// This publisher's arena, made at the first call (no chunk is
    /// allocated until the first [`Publisher::alloc`] or
    /// [`Arena::reserve`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a publisher configured
    /// [`Sharing::Isolated`]; the device's errors if it cannot share memory.
    pub fn arena(&self) -> Result<&DeviceArena> {
        if let Some(a) = self.arena.arena.get() {
            return Ok(a);
        }
        let Sharing::Arena { mechanism, options } = &self.arena.sharing else {
            return Err(Error::arg(
                "publisher",
                "it is configured isolated (no arena); publish SharedBuffers with \
                 Publisher::publish, or configure Sharing::Arena",
            ));
        };
        let arena = Arena::new(
            DeviceChunks::new(&self.device, *mechanism)?,
            options.clone(),
        )?;
        let _ = self.arena.arena.set(arena);
        self.arena
            .arena
            .get()
            .ok_or_else(|| Error::arg("publisher", "its arena could not be kept"))
    }

    /// Allocates `bytes` bytes from this publisher's arena: no export (a new
    /// chunk, exported once, only when no chunk has room).
    pub fn alloc(&self, bytes: u64) -> Result<DeviceArenaBuffer> {
        let arena = self.arena()?;
        lock(&self.arena.book).reap(&self.server);
        arena.alloc(bytes)
    }

    /// Publishes one arena buffer under `name` as elements of `dtype` with
    /// `shape` (a set of one, which [`Subscriber::attach`](super::Subscriber::attach) also opens): no
    /// driver export, one event record, one message.
    pub fn publish_buffer(
        &self,
        name: &str,
        buffer: &DeviceArenaBuffer,
        dtype: Dtype,
        shape: &[u64],
    ) -> Result<()> {
        self.publish_set(
            name,
            &[SetMember {
                name,
                dtype,
                shape,
                buffer,
                offset: 0,
            }],
        )
    }

    /// Publishes `members`, buffers of this publisher's arena, as one set
    /// called `name`: one entry, one event recorded and one fence signalled
    /// (see [`SyncMode`](super::SyncMode)) after the work queued on the
    /// members' streams, no driver export.
    #[tracing::instrument(level = "debug", skip(self, members), fields(members = members.len()))]
    pub fn publish_set(&self, name: &str, members: &[SetMember<'_>]) -> Result<()> {
        let arena = self.arena()?;
        let mut record = arena.describe_set(name, members.iter().copied())?;
        record.event = Some(self.event_handle);
        let mut chunks: Vec<&Arc<Chunk<DeviceChunks>>> = Vec::new();
        for m in members {
            if !chunks.iter().any(|c| c.id() == m.buffer.chunk().id()) {
                chunks.push(m.buffer.chunk());
            }
        }
        let stream = self.record_after(chunks.iter().copied())?;
        let fence = self.set_fence(&stream)?;
        let leases = members.iter().map(|m| m.buffer.lease()).collect();
        lock(&self.arena.book).publish(&self.server, arena, name, record.to_value(), leases, fence)
    }

    /// Takes a fence slot for a new set and signals it after the work queued
    /// on `stream`; `None` when this publisher has no fences (or no free
    /// slot: the set then goes with its event only).
    fn set_fence(&self, stream: &Arc<cudarc::driver::CudaStream>) -> Result<Option<SetFence>> {
        let Some(fences) = &self.fences else {
            return Ok(None);
        };
        let fences = lock(fences);
        let Some(slot) = fences.take_held() else {
            tracing::warn!("more entries than fence slots: this set goes with its event only");
            return Ok(None);
        };
        fences.signal(stream, slot.slot())?;
        let (meta, fd) = fences.export(slot.slot(), 0)?;
        Ok(Some(SetFence { meta, fd, slot }))
    }

    /// Records the publisher's event after the work queued on the streams
    /// of `chunks` (joined into the first, which it returns).
    fn record_after<'a>(
        &self,
        chunks: impl Iterator<Item = &'a Arc<Chunk<DeviceChunks>>>,
    ) -> Result<Arc<cudarc::driver::CudaStream>> {
        let mut streams: Vec<&Arc<cudarc::driver::CudaStream>> = Vec::new();
        for c in chunks {
            let s = c.backing().buffer().stream();
            if !streams.iter().any(|o| Arc::ptr_eq(o, s)) {
                streams.push(s);
            }
        }
        let Some(first) = streams.first() else {
            return Err(Error::arg("set", "it has no buffer, so nothing to record"));
        };
        for other in &streams[1..] {
            first.join(other).map_err(|e| {
                Error::arg("stream", format!("cannot order the set's streams: {e}"))
            })?;
        }
        self.event.record(first)?;
        Ok(Arc::clone(first))
    }

    /// Tells every subscriber of the set (or arena buffer) `name` that new
    /// contents are ready, written in place: one event recorded and one
    /// fence signalled for the whole set, one notice per subscriber.
    /// Returns the update's version, from 1.
    #[tracing::instrument(level = "debug", skip(self))]
    pub fn update_set(&self, name: &str) -> Result<u64> {
        let (chunks, slot) = {
            let book = lock(&self.arena.book);
            let chunks = book
                .chunks_of(name)
                .ok_or_else(|| Error::from(ChannelError::NotFound { name: name.into() }))?;
            (chunks, book.fence_slot(name))
        };
        let stream = self.record_after(chunks.iter())?;
        let fence_seq = match (&self.fences, slot) {
            (Some(f), Some(slot)) => Some(lock(f).signal(&stream, slot)?),
            _ => None,
        };
        Ok(self
            .server
            .update(name, wire::to_value(&UpdateNotice { fence_seq })?)?)
    }

    /// Whether `name` was published from the arena (a set or an arena buffer).
    pub(super) fn is_arena_entry(&self, name: &str) -> bool {
        lock(&self.arena.book).contains(name)
    }

    /// Hides the set (or arena buffer) `name` from new subscribers and tells
    /// its subscribers; its buffers' ranges stay allocated until the last
    /// lease on it ends. Waits up to `timeout` for that (`None`: returns at
    /// once; the ranges come back at a later call once the leases end).
    pub fn unpublish_set(&self, name: &str, timeout: Option<Duration>) -> Result<()> {
        lock(&self.arena.book).unpublish(&self.server, name)?;
        if let Some(t) = timeout {
            self.server.wait_released(name, Some(t))?;
            self.reap();
        }
        Ok(())
    }

    /// Lets go of the buffers of unpublished sets whose last lease has
    /// ended (released, or its consumer gone); returns how many sets.
    pub fn reap(&self) -> usize {
        lock(&self.arena.book).reap(&self.server)
    }

    /// Unpublished sets still leased by a consumer.
    pub fn retired_sets(&self) -> usize {
        lock(&self.arena.book).retired()
    }

    /// Releases the arena's chunks that hold no buffer and that no consumer
    /// maps any more; returns the bytes released.
    pub fn trim(&self) -> Result<u64> {
        let arena = self.arena()?;
        Ok(lock(&self.arena.book).trim(&self.server, arena))
    }
}

#[cfg(test)]
#[path = "set_tests.rs"]
mod tests;
