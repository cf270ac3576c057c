//! The publishing side: buffers served by name, updates, unpublishing.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;

use crate::Access;
use crate::arena::{DeviceArena, DeviceArenaBuffer, SetMember};
use crate::channel::{ChannelError, LeaseInfo, Replaced, Server, ServerConfig};
use crate::descriptor::{Descriptor, Dtype, Mechanism};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::event::IpcEvent;
use crate::handle::IpcEventHandle;
use crate::memory::DeviceMemory;
use crate::set::ArenaId;
use crate::share::SharedBuffer;

use super::publisher_config::PublisherConfig;
use super::ring::{RingPublisher, RingSync};
use super::set_book::PublisherArena;
use super::sync::{self, EntryFences};
use super::wire::FenceMeta;
use super::wire::{self, EntryMeta, RingMeta, UpdateBody};
use super::{Endpoint, lock};

/// The meta of an entry: the descriptor (which carries the event handle)
/// and the fence.
fn entry_meta(descriptor: &Descriptor, fence: Option<FenceMeta>) -> Result<Value> {
    wire::to_value(&EntryMeta::with_fence(descriptor, fence))
}

struct PublishedBuffer {
    buffer: Arc<SharedBuffer>,
    /// The entry's slot in the fence block.
    fence_slot: Option<u32>,
}

/// Serves device buffers by name to subscribers in other processes.
pub struct Publisher {
    pub(super) device: Device,
    pub(super) server: Server,
    pub(super) event: IpcEvent,
    pub(super) event_handle: IpcEventHandle,
    entries: Mutex<HashMap<String, PublishedBuffer>>,
    pub(super) fences: Option<Mutex<EntryFences>>,
    pub(super) arena: PublisherArena,
    /// Readers map read-only ([`PublisherConfig::read_only_readers`]).
    pub(super) read_only_readers: bool,
    /// The event recorded on a caller's stream that a buffer's or a set's
    /// stream then waits for ([`Publisher::update_after`],
    /// [`Publisher::update_set_after`]).
    pub(super) join: super::join::JoinEvent,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("path", &self.server.path())
            .finish_non_exhaustive()
    }
}

impl Publisher {
    /// Binds the socket (mode 0600, in a 0700 directory for names) and
    /// starts serving.
    ///
    /// # Errors
    /// [`PublisherConfig::validate`]'s, before anything else.
    pub fn bind(
        device: &Device,
        endpoint: impl Into<Endpoint>,
        config: PublisherConfig,
    ) -> Result<Self> {
        config.validate()?;
        let path = endpoint.into().path()?;
        let mut server_config = ServerConfig::new(path);
        if let Some(n) = config.max_request_bytes {
            server_config = server_config.with_max_request_bytes(n);
        }
        if let Some(spin) = config.spin {
            server_config.spin = spin;
        }
        server_config.listener.clone_from(&config.listener);
        server_config.call_handler.clone_from(&config.call_handler);
        server_config.restarts = config.restarts;
        server_config.accept_held = config.accept_held;
        for uid in config.allow_uids.iter().copied() {
            if !server_config.allowed_uids.contains(&uid) {
                server_config.allowed_uids.push(uid);
            }
        }
        let server = Server::bind(server_config)?;
        let fences = if config.no_fences {
            None
        } else {
            EntryFences::new(device).map(Mutex::new)
        };
        let event = IpcEvent::new(device)?;
        let event_handle = event.handle()?;
        tracing::info!(path = %server.path().display(), "publisher serving");
        Ok(Publisher {
            device: device.clone(),
            server,
            event,
            event_handle,
            entries: Mutex::new(HashMap::new()),
            fences,
            arena: PublisherArena::new(config.sharing),
            read_only_readers: config.read_only_readers,
            join: super::join::JoinEvent::default(),
        })
    }

    /// Whether readers map what this publisher publishes read-only
    /// ([`PublisherConfig::with_read_only_readers`]).
    pub fn read_only_readers(&self) -> bool {
        self.read_only_readers
    }

    /// Refuses `what` (a way of publishing without a set record) while
    /// readers must map read-only.
    fn refuse_without_record(&self, what: &str) -> Result<()> {
        if self.read_only_readers {
            return Err(Error::arg(
                "read-only readers",
                format!(
                    "this publisher's readers map read-only, a policy only sets carry; {what} \
                     has no set record to carry it: publish from the arena \
                     (Publisher::publish_buffer, Publisher::publish_set), or bind a publisher \
                     without read_only_readers"
                ),
            ));
        }
        Ok(())
    }

    /// The socket path subscribers connect to.
    pub fn path(&self) -> &Path {
        self.server.path()
    }

    /// The channel server underneath (leases, connection counts).
    pub fn server(&self) -> &Server {
        &self.server
    }

    /// Publishes `buffer` under `name` as elements of `dtype` (with an
    /// optional shape). An event is recorded after the work queued so far on
    /// the buffer's stream; subscribers wait on it before they read.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a publisher with read-only readers
    /// (see [`PublisherConfig::with_read_only_readers`]).
    #[tracing::instrument(level = "debug", skip(self, buffer, shape), fields(mechanism = %buffer.mechanism(), len = buffer.byte_len()))]
    pub fn publish(
        &self,
        name: &str,
        buffer: SharedBuffer,
        dtype: Dtype,
        shape: Option<Vec<u64>>,
    ) -> Result<Arc<SharedBuffer>> {
        self.refuse_without_record("Publisher::publish")?;
        let buffer = Arc::new(buffer);
        let export = buffer.export_region(0, buffer.byte_len() as u64, dtype, shape)?;
        self.event.record(buffer.stream())?;
        let mut descriptor = export.descriptor;
        descriptor.event = Some(self.event_handle);
        let mut fds = export.fds;
        let mut entries = lock(&self.entries);
        let (fence, fence_slot) = self.fence_entry(&buffer, &mut fds)?;
        if let Err(e) = self
            .server
            .publish(name, entry_meta(&descriptor, fence)?, fds)
        {
            self.give_back(fence_slot);
            return Err(e.into());
        }
        entries.insert(
            name.to_owned(),
            PublishedBuffer {
                buffer: buffer.clone(),
                fence_slot,
            },
        );
        Ok(buffer)
    }

    /// Takes a fence slot for a new entry, signals it after the work queued
    /// on the buffer's stream, and adds the block's descriptor to `fds`.
    fn fence_entry(
        &self,
        buffer: &SharedBuffer,
        fds: &mut Vec<std::os::fd::OwnedFd>,
    ) -> Result<(Option<FenceMeta>, Option<u32>)> {
        let Some(fences) = &self.fences else {
            return Ok((None, None));
        };
        let mut fences = lock(fences);
        let Some(slot) = fences.take() else {
            tracing::warn!("more entries than fence slots: this one goes with its event only");
            return Ok((None, None));
        };
        let signalled = fences
            .signal(buffer.stream(), slot)
            .and_then(|_| fences.export(slot, fds.len()));
        match signalled {
            Ok((meta, fd)) => {
                fds.push(fd);
                Ok((Some(meta), Some(slot)))
            }
            Err(e) => {
                fences.give_back(slot);
                Err(e)
            }
        }
    }

    fn give_back(&self, slot: Option<u32>) {
        if let (Some(fences), Some(slot)) = (&self.fences, slot) {
            lock(fences).give_back(slot);
        }
    }

    /// Tells every subscriber of `name` that new contents are ready: records
    /// the event after the work queued on the buffer's stream, then notifies.
    /// Returns the update's version: the count of updates of `name`, from 1.
    #[tracing::instrument(level = "debug", skip(self))]
    pub fn update(&self, name: &str) -> Result<u64> {
        self.update_as(name, None)
    }

    /// [`update`](Self::update), ordered also after the work queued so far
    /// on `after` (a caller's stream, PyTorch's current one for instance):
    /// the buffer's stream waits for it on the device (one event recorded
    /// there and waited for); nothing waits on the host. An arena buffer or
    /// a set goes through [`update_set_after`](Self::update_set_after).
    #[tracing::instrument(level = "debug", skip(self, after))]
    pub fn update_after(&self, name: &str, after: &cudarc::driver::CudaStream) -> Result<u64> {
        self.update_as(name, Some(after))
    }

    fn update_as(&self, name: &str, after: Option<&cudarc::driver::CudaStream>) -> Result<u64> {
        if self.is_arena_entry(name) {
            return self.update_set_as(name, after);
        }
        let mut phases = crate::phases::Phases::start("core.update");
        let (buffer, fence_slot) = lock(&self.entries)
            .get(name)
            .map(|e| (e.buffer.clone(), e.fence_slot))
            .ok_or_else(|| Error::from(ChannelError::NotFound { name: name.into() }))?;
        if let Some(after) = after {
            self.join.order(buffer.stream(), after)?;
            phases.mark("join");
        }
        self.event.record(buffer.stream())?;
        phases.mark("event");
        let fence_seq = match (&self.fences, fence_slot) {
            (Some(f), Some(slot)) => Some(lock(f).signal(buffer.stream(), slot)?),
            _ => None,
        };
        phases.mark("fence");
        let version = self
            .server
            .update(name, wire::to_value(&UpdateBody { fence_seq })?)?;
        phases.mark("notice");
        Ok(version)
    }

    /// The buffer published under `name`.
    pub fn buffer(&self, name: &str) -> Option<Arc<SharedBuffer>> {
        lock(&self.entries).get(name).map(|e| e.buffer.clone())
    }

    /// Hides `name` from new subscribers, tells its subscribers, and waits
    /// up to `timeout` (`None`: for ever) until every lease on it is
    /// released. Returns the buffer, which no other process uses any more.
    #[tracing::instrument(level = "debug", skip(self))]
    pub fn unpublish(&self, name: &str, timeout: Option<Duration>) -> Result<Arc<SharedBuffer>> {
        if self.is_arena_entry(name) {
            return Err(Error::arg(
                "unpublish",
                format!("{name:?} was published from the arena; use Publisher::unpublish_set"),
            ));
        }
        self.server.unpublish(name)?;
        self.server.wait_released(name, timeout)?;
        let entry = lock(&self.entries)
            .remove(name)
            .ok_or_else(|| Error::from(ChannelError::NotFound { name: name.into() }))?;
        self.give_back(entry.fence_slot);
        Ok(entry.buffer)
    }

    /// The current leases.
    pub fn leases(&self) -> Vec<LeaseInfo> {
        self.server.leases()
    }

    /// Creates a ring of `slots` buffers of `slot_bytes` each, shared with
    /// `mechanism` (`None`: the best available), under `name`; each frame
    /// records the ring's event and signals the slot's fence
    /// ([`RingSync::EventsAndFences`]).
    pub fn ring(
        &self,
        name: &str,
        slots: usize,
        slot_bytes: usize,
        mechanism: Option<Mechanism>,
    ) -> Result<RingPublisher> {
        self.ring_with(name, slots, slot_bytes, mechanism, RingSync::default())
    }

    /// As [`ring`](Self::ring), with how frames are synchronised: a
    /// [`RingSync::FencesOnly`] ring records no event per frame, its slots
    /// carry none, and its readers wait on the fence.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for a fences-only ring of a publisher without
    /// fences (turned off, or its device cannot signal them).
    pub fn ring_with(
        &self,
        name: &str,
        slots: usize,
        slot_bytes: usize,
        mechanism: Option<Mechanism>,
        sync: RingSync,
    ) -> Result<RingPublisher> {
        self.refuse_without_record("a ring")?;
        let events = sync == RingSync::EventsAndFences;
        if !events && self.fences.is_none() {
            return Err(Error::Unsupported {
                what: "a fences-only ring",
                why: "this publisher has no fences (PublisherConfig::with_fences(false), or its \
                      device cannot signal them); use RingSync::EventsAndFences"
                    .into(),
            });
        }
        let mut buffers = Vec::with_capacity(slots);
        let mut metas = Vec::with_capacity(slots);
        let fence = if self.fences.is_some() {
            sync::ring_fence(&self.device, slots)
        } else {
            None
        };
        for i in 0..slots {
            let b = SharedBuffer::alloc(&self.device, slot_bytes, mechanism)?;
            let mut e = b.export()?;
            e.descriptor.event = events.then_some(self.event_handle);
            let fence_meta = match &fence {
                Some(f) => {
                    let (meta, fd) = sync::export(f, i as u32, None, e.fds.len())?;
                    e.fds.push(fd);
                    Some(meta)
                }
                None => None,
            };
            metas.push((entry_meta(&e.descriptor, fence_meta)?, e.fds));
            buffers.push(b);
        }
        let producer =
            self.server
                .create_ring(name, wire::to_value(&RingMeta { slot_bytes })?, metas)?;
        let event = if events {
            let event = IpcEvent::new(&self.device)?;
            let handle = event.handle()?;
            Some((event, handle))
        } else {
            None
        };
        Ok(RingPublisher {
            producer,
            buffers,
            event,
            fence,
            frames: std::sync::atomic::AtomicU64::new(0),
            join: super::join::JoinEvent::default(),
        })
    }

    /// Publishes `members` as set `name` (as
    /// [`publish_set`](Self::publish_set)) with `access` for its readers:
    /// [`Access::ReadWrite`] on a publisher with
    /// [read-only readers](super::PublisherConfig::with_read_only_readers)
    /// is the policy's one exception, for a writer's staging version under
    /// a name only the writer is told; every other set keeps the policy.
    /// [`Access::ReadOnly`] puts `read_only` in the record whatever the
    /// policy (vmm chunks only).
    pub fn publish_set_with(
        &self,
        name: &str,
        members: &[SetMember<'_>],
        access: Access,
    ) -> Result<()> {
        self.publish_set_as(name, members, access == Access::ReadOnly, None)
    }

    /// Puts `members` in place of the published set `name` as its next
    /// version, with the publisher's policy: new attaches of `name` get
    /// the new record at once; every reader of the old one gets an update
    /// notice on its lease (its event recorded, its fence signalled, as
    /// [`update_set`](Self::update_set) does; nothing changed in the memory
    /// it maps) and keeps its mappings until it releases them, when the
    /// old version's ranges may go back to the arena. Readers move to the
    /// new version by attaching `name` again. The work queued on the
    /// members' streams is ordered before the new record's event and
    /// fence; work of another process (a writer) must be finished before
    /// this call.
    ///
    /// # Errors
    /// [`ChannelError::NotFound`] when `name` is not a published set; the
    /// record's and the driver's errors. On an error `name` keeps its
    /// old version.
    pub fn replace_set(&self, name: &str, members: &[SetMember<'_>]) -> Result<Replaced> {
        self.do_replace_set(name, members)
    }

    /// This publisher's arena, made at the first call (no chunk is
    /// allocated until the first [`Publisher::alloc`] or
    /// [`Arena::reserve`](crate::arena::Arena::reserve)).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a publisher configured
    /// [`Sharing::Isolated`](super::Sharing::Isolated); the device's errors if it cannot share memory.
    pub fn arena(&self) -> Result<&DeviceArena> {
        self.do_arena()
    }

    /// Makes this publisher's arena by taking back the chunks of arena
    /// `id`, which an earlier process made and whose file descriptors
    /// something kept (a restarted service's, from its keeper): each
    /// [`KeptChunk`](crate::arena::KeptChunk) is a VMM chunk's index in
    /// that arena, its file descriptor and size, and its ranges still in
    /// use. Returns one buffer per range, chunk by chunk, in the order
    /// given ([`Arena::restore`](crate::arena::Arena::restore)); publish
    /// them again as sets. Readers that still map a chunk find it under the
    /// same [`ChunkId`](crate::arena::ChunkId).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] once the arena is made (by an allocation
    /// or a publication), or for a publisher whose chunks are not VMM; the
    /// driver's, for a descriptor that is not such a chunk.
    pub fn restore_arena(
        &self,
        id: ArenaId,
        chunks: Vec<crate::arena::KeptChunk>,
    ) -> Result<Vec<Vec<DeviceArenaBuffer>>> {
        self.do_restore_arena(id, chunks)
    }

    /// Allocates `bytes` bytes from this publisher's arena: no export (a new
    /// chunk, exported once, only when no chunk has room).
    pub fn alloc(&self, bytes: u64) -> Result<DeviceArenaBuffer> {
        let arena = self.arena()?;
        lock(&self.arena.book).reap(&self.server);
        arena.alloc(bytes)
    }

    /// The set layouts this publisher keeps: a set published with the
    /// members of one before (the same names, types, shapes and places, in
    /// order) shares the entries checked and the table encoded then,
    /// instead of making and checking them again.
    pub fn set_layouts(&self) -> &crate::set::SetLayouts {
        &self.arena.layouts
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
        self.do_publish_buffer(name, buffer, dtype, shape)
    }

    /// Publishes `members`, buffers of this publisher's arena, as one set
    /// called `name`: one entry, one event recorded and one fence signalled
    /// (see [`SyncMode`](super::SyncMode)) after the work queued on the
    /// members' streams, no driver export. What later updates need (the
    /// set's distinct chunks and their streams, its fence slot) is worked
    /// out here, once. The record carries the publisher's
    /// [read-only policy](super::PublisherConfig::with_read_only_readers).
    #[tracing::instrument(level = "debug", skip(self, members), fields(members = members.len()))]
    pub fn publish_set(&self, name: &str, members: &[SetMember<'_>]) -> Result<()> {
        self.publish_set_as(name, members, self.read_only_readers, None)
    }

    /// [`publish_set`](Self::publish_set), ordered also after the work
    /// queued so far on `after`: a stream the members were written on that
    /// is not theirs, such as another library's (PyTorch's current stream,
    /// wrapped with [`CudaContext::wrap_borrowed_stream`](cudarc::driver::CudaContext::wrap_borrowed_stream)).
    /// The set's event waits for it on the device: nothing here waits on
    /// the host.
    pub fn publish_set_after(
        &self,
        name: &str,
        members: &[SetMember<'_>],
        after: &cudarc::driver::CudaStream,
    ) -> Result<()> {
        self.publish_set_as(name, members, self.read_only_readers, Some(after))
    }

    /// Tells every subscriber of the set (or arena buffer) `name` that new
    /// contents are ready, written in place: one event recorded and one
    /// fence signalled for the whole set, one notice per subscriber.
    /// Returns the update's version, from 1.
    ///
    /// Its cost does not depend on the set's size: the set's chunks, their
    /// streams and its fence slot were worked out when it was published
    /// (see [`publish_set`](Self::publish_set)); no member, lease or record
    /// entry is visited here, and the notice carries only the fence's
    /// sequence number.
    #[tracing::instrument(level = "debug", skip(self))]
    pub fn update_set(&self, name: &str) -> Result<u64> {
        self.update_set_as(name, None)
    }

    /// [`update_set`](Self::update_set), ordered also after the work queued
    /// so far on `after` (see [`publish_set_after`](Self::publish_set_after)):
    /// one more event recorded there and waited for on the device; nothing
    /// waits on the host.
    #[tracing::instrument(level = "debug", skip(self, after))]
    pub fn update_set_after(&self, name: &str, after: &cudarc::driver::CudaStream) -> Result<u64> {
        self.update_set_as(name, Some(after))
    }

    /// Hides the set (or arena buffer) `name` from new subscribers and tells
    /// its subscribers; its buffers' ranges stay allocated until the last
    /// lease on it ends. Waits up to `timeout` for that (`None`: returns at
    /// once; the ranges come back at a later call once the leases end).
    pub fn unpublish_set(&self, name: &str, timeout: Option<Duration>) -> Result<()> {
        self.do_unpublish_set(name, timeout)
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
