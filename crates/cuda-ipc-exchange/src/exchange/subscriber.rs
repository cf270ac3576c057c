//! The subscribing side: attaching, the mapping cache, updates, releases.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use std::os::fd::OwnedFd;

use bytemuck::Pod;
use cudarc::driver::CudaStream;
use serde_json::Value;

use crate::Access;
use crate::channel::{ChannelError, Client, ClientConfig, Notice};
use crate::descriptor::Descriptor;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::event::IpcEvent;
use crate::fence::FenceMapping;
use crate::handle::IpcEventHandle;
use crate::memory::DeviceMemory;
use crate::memory::buffer::{MappedBuffer, Mapping};
use crate::share;

use super::chunk_cache::ChunkCache;
use super::lease::{LeaseGuard, Pending};
use super::ring::{RingFrame, RingSubscriber};
use super::set_attachment::SetAttachment;
use super::slept::Slept;
use super::subscriber_config::SubscriberConfig;
use super::sync::{self, SyncMode, Waiter};
use super::wire::EntryMeta;
use super::{Endpoint, lock};

/// Cache key of a mapping: the exporter, its allocation's generation (never
/// the address, which a freed allocation gives to the next one) and the
/// access (a read-only and a read-write mapping are never shared).
type CacheKey = (u32, u64, Access);

/// `mapping`, unless it sleeps: a new attach does not hand out memory
/// that faults.
pub(super) fn awake(mapping: Arc<dyn Mapping>) -> Result<Arc<dyn Mapping>> {
    if mapping.asleep() {
        return Err(Error::arg(
            "attach",
            "the subscriber sleeps (Subscriber::sleep): call wake() before attaching again",
        ));
    }
    Ok(mapping)
}

/// Connects to a [`Publisher`](super::Publisher) and maps what it publishes.
pub struct Subscriber {
    /// Cached chunk mappings, unmapped before the connection (and with it
    /// the chunk leases) closes: fields drop in declaration order.
    pub(super) chunks: Mutex<ChunkCache>,
    pub(super) device: Device,
    pub(super) client: Arc<Client>,
    pub(super) cache: Mutex<HashMap<CacheKey, Weak<dyn Mapping>>>,
    events: Mutex<HashMap<IpcEventHandle, Arc<IpcEvent>>>,
    pub(super) fences: Mutex<HashMap<u64, Arc<FenceMapping>>>,
    pub(super) sync: SyncMode,
    timeout: Duration,
    /// How attaches map, unless a set's publisher asks for read-only.
    pub(super) access: Access,
    pub(super) pending: Arc<Pending>,
    opens: std::sync::atomic::AtomicU64,
    /// Every mapping opened, while it lives: what a sleep unmaps.
    pub(super) live: Mutex<Vec<Weak<dyn Mapping>>>,
    /// The set entry tables read last, for sets of a layout seen before.
    pub(super) tables: crate::set::EntryTables,
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        // Cached chunks that nothing holds are let go of without waiting;
        // those that views hold stay mapped (the views hold the mappings)
        // and leased (the views' leases keep the connection open) until
        // the views are gone.
        let idle = lock(&self.chunks).drain_idle();
        for c in idle {
            c.retire(&self.client);
        }
    }
}

impl std::fmt::Debug for Subscriber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscriber")
            .field("server_pid", &self.client.server_pid())
            .finish_non_exhaustive()
    }
}

/// A buffer attached from a publisher: a lease and a typed mapping. The
/// buffer and every view made from it hold the lease.
///
/// Layers: made from the channel's [`Attachment`](crate::channel::Attachment)
/// (the lease, the metadata and raw descriptors) by importing the
/// descriptors; the same word, one layer up.
///
/// Its buffer lends out only `&dyn Mapping`, so no view can be made
/// around its lease:
///
/// ```compile_fail
/// # fn f(a: cuda_ipc_exchange::exchange::Attachment<u8>) -> cuda_ipc_core::Result<()> {
/// use cuda_ipc_core::MappedBuffer;
/// // error: expected `Arc<dyn Mapping>`, found `&dyn Mapping`
/// let unleased = MappedBuffer::<u8>::new(a.buffer().mapping().clone(), 0, 1)?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Attachment<T> {
    lease: u64,
    name: String,
    guard: Arc<LeaseGuard>,
    buffer: MappedBuffer<T>,
    waiter: Waiter,
    descriptor: Descriptor,
}

impl<T: Pod> Attachment<T> {
    pub(super) fn from_parts(
        lease: u64,
        name: String,
        guard: Arc<LeaseGuard>,
        buffer: MappedBuffer<T>,
        waiter: Waiter,
        descriptor: Descriptor,
    ) -> Self {
        Attachment {
            lease,
            name,
            guard,
            buffer,
            waiter,
            descriptor,
        }
    }

    /// The mapped buffer; its stream waits on the publisher's event.
    pub fn buffer(&self) -> &MappedBuffer<T> {
        &self.buffer
    }
    /// The entry's name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The lease id.
    pub fn lease(&self) -> u64 {
        self.lease
    }
    /// The descriptor the publisher sent.
    pub fn descriptor(&self) -> &Descriptor {
        &self.descriptor
    }
    /// Whether this buffer waits on the publisher's fence (rather than its
    /// event).
    pub fn uses_fence(&self) -> bool {
        self.waiter.is_fence()
    }
    /// Whether the buffer is mapped read-only (the subscriber's
    /// [`SubscriberConfig::access`], or an arena buffer whose publisher
    /// asks for read-only readers): writing through it fails.
    pub fn read_only(&self) -> bool {
        self.buffer.mapping().read_only()
    }
}

impl Subscriber {
    /// Connects to the publisher at `endpoint` (checking its peer credentials).
    pub fn connect(
        device: &Device,
        endpoint: impl Into<Endpoint>,
        config: SubscriberConfig,
    ) -> Result<Self> {
        let path = endpoint.into().path()?;
        let mut client_config = ClientConfig::default()
            .with_timeout(config.timeout)
            .with_spin(config.spin);
        client_config.allowed_server_uids.extend(config.allow_uids);
        let client = Arc::new(Client::connect(path, client_config)?);
        Ok(Subscriber {
            device: device.clone(),
            client,
            cache: Mutex::new(HashMap::new()),
            events: Mutex::new(HashMap::new()),
            fences: Mutex::new(HashMap::new()),
            sync: config.sync,
            timeout: config.timeout,
            access: config.access,
            pending: Arc::new(Mutex::new(HashMap::new())),
            opens: std::sync::atomic::AtomicU64::new(0),
            live: Mutex::new(Vec::new()),
            tables: crate::set::EntryTables::new(),
            chunks: Mutex::new(ChunkCache::new(config.mapping_budget)),
        })
    }

    /// The names published now (not the hidden entries of arena chunks
    /// and set record parts, which start with `.cuda-ipc/`).
    pub fn list(&self) -> Result<Vec<String>> {
        Ok(self
            .client
            .list()?
            .into_iter()
            .map(|e| e.name)
            .filter(|n| !n.starts_with(super::set_book::HIDDEN_ENTRY_PREFIX))
            .collect())
    }

    /// Calls `method` of the publisher's call handler (a service's, see
    /// `cuda_ipc_service::service::admin`) with `body` on this subscriber's
    /// connection, waiting up to `timeout` (`None`: the subscriber's
    /// timeout). What a call makes the connection hold (a service's write
    /// lock) ends with it.
    ///
    /// # Errors
    /// [`ChannelError::Remote`](crate::channel::ChannelError::Remote) with
    /// the handler's code and message; the connection's errors.
    pub fn call(
        &self,
        method: &str,
        body: &serde_json::Value,
        timeout: Option<Duration>,
    ) -> Result<serde_json::Value> {
        Ok(self
            .client
            .call_within(method, body, timeout.unwrap_or(self.timeout))?)
    }

    /// The device this subscriber maps on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Whether the publisher is still there (does not block).
    pub fn is_alive(&self) -> bool {
        self.client.is_alive()
    }

    /// How many mappings this subscriber has opened (cache misses).
    pub fn opens(&self) -> u64 {
        self.opens.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The set entry tables this subscriber keeps: a set whose layout it
    /// attached before (the same table over the same chunks) shares the
    /// entries read then, checked, instead of decoding them again.
    pub fn entry_tables(&self) -> &crate::set::EntryTables {
        &self.tables
    }

    /// Counts a mapping just opened and notes it for [`Subscriber::sleep`].
    pub(super) fn opened(&self, mapping: &Arc<dyn Mapping>) {
        self.opens
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut live = lock(&self.live);
        live.retain(|w| w.strong_count() > 0);
        live.push(Arc::downgrade(mapping));
    }

    pub(super) fn event(&self, handle: IpcEventHandle) -> Result<Arc<IpcEvent>> {
        let mut events = lock(&self.events);
        if let Some(e) = events.get(&handle) {
            return Ok(e.clone());
        }
        let e = Arc::new(IpcEvent::open(&self.device, handle)?);
        events.insert(handle, e.clone());
        Ok(e)
    }

    /// The fence block `meta` names, mapped once per subscriber.
    fn fence(&self, meta: &super::wire::FenceMeta, fd: OwnedFd) -> Result<Arc<FenceMapping>> {
        let mut fences = lock(&self.fences);
        if let Some(f) = fences.get(&meta.block.id()) {
            return Ok(f.clone());
        }
        let f = Arc::new(FenceMapping::open(&self.device, &meta.block, vec![fd])?);
        fences.insert(meta.block.id(), f.clone());
        Ok(f)
    }

    /// Chooses how to wait for an entry's work, per this subscriber's
    /// [`SyncMode`]: on the publisher's event `handle` (which `what`, the
    /// kind of entry, must carry unless it waits on the fence) or on
    /// `fence`, whose file descriptor is taken out of `fds`.
    pub(super) fn waiter(
        &self,
        handle: Option<IpcEventHandle>,
        fence: Option<super::wire::FenceMeta>,
        fds: &mut Vec<OwnedFd>,
        what: &str,
    ) -> Result<Waiter> {
        // A pushed entry comes without descriptors: its fence must be one
        // this subscriber mapped already.
        let cached = match &fence {
            Some(meta) if fds.is_empty() => {
                let known = lock(&self.fences).get(&meta.block.id()).cloned();
                Some(known.ok_or_else(|| Error::Descriptor {
                    field: "fence".into(),
                    reason: format!("{what} came without its fence's descriptor, and that fence is not mapped here"),
                })?)
            }
            _ => None,
        };
        let fence = match cached {
            Some(_) => fence.map(|meta| (None, meta)),
            None => sync::take_fence_fd(fence, fds)?.map(|(fd, meta)| (Some(fd), meta)),
        };
        // Nothing to open but the fence (a fences-only ring's slots carry
        // no event): Auto takes it without trying, or logging, an event,
        // and Event cannot be served.
        let fence_only = handle.is_none() && fence.is_some();
        let mode = match self.sync {
            SyncMode::Event if fence_only => {
                return Err(Error::Unsupported {
                    what: "waiting on the publisher's events",
                    why: format!(
                        "{what} carries no event of the publisher, only its fence (as a \
                         fences-only ring's slots do: RingSync::FencesOnly); attach with \
                         SyncMode::Auto, Fence or HostFence"
                    ),
                });
            }
            SyncMode::Auto if fence_only => SyncMode::Fence,
            mode => mode,
        };
        sync::choose(
            mode,
            || {
                let handle = handle.ok_or_else(|| Error::Descriptor {
                    field: "event".into(),
                    reason: format!("{what} must carry the publisher's event"),
                })?;
                self.event(handle)
            },
            fence.as_ref().map(|(fd, meta)| {
                (meta, move || match (fd, &cached) {
                    (_, Some(mapping)) => Ok(mapping.clone()),
                    (Some(fd), None) => self.fence(
                        meta,
                        fd.try_clone()
                            .map_err(|e| Error::io("duplicating the fence's descriptor", e))?,
                    ),
                    (None, None) => Err(Error::arg("fence", "no descriptor and none mapped")),
                })
            }),
        )
    }

    /// Makes `stream` wait for the publisher's latest work (at attach), with
    /// this subscriber's deadline; abandons a fence when the publisher is gone.
    pub(super) fn wait_latest(&self, waiter: &Waiter, stream: &Arc<CudaStream>) -> Result<()> {
        let client = self.client.clone();
        waiter.wait_latest(stream, &move || client.is_alive(), self.timeout)
    }

    /// Makes `stream` wait for the work of the update whose notice carried
    /// `data` (see [`Waiter::wait_update`]).
    pub(super) fn wait_notice(
        &self,
        waiter: &Waiter,
        stream: &Arc<CudaStream>,
        data: &Value,
    ) -> Result<()> {
        let client = self.client.clone();
        waiter.wait_update(stream, data, &move || client.is_alive(), self.timeout)
    }

    /// Makes `stream` wait (GPU-side, after a host-side deadline) until the
    /// fence reaches `seq`; abandons it when the publisher is gone.
    pub(super) fn wait_fence(
        &self,
        waiter: &Waiter,
        stream: &Arc<CudaStream>,
        seq: u64,
    ) -> Result<()> {
        let client = self.client.clone();
        waiter.wait_seq(stream, seq, &move || client.is_alive(), self.timeout)
    }

    fn mapping(
        &self,
        descriptor: &Descriptor,
        fds: Vec<std::os::fd::OwnedFd>,
    ) -> Result<Arc<dyn Mapping>> {
        let key = descriptor
            .generation
            .map(|g| (descriptor.pid, g, self.access));
        if let Some(key) = key
            && let Some(m) = lock(&self.cache).get(&key).and_then(Weak::upgrade)
        {
            return awake(m);
        }
        let m = share::open_mapping(&self.device, descriptor, fds, self.access)?;
        self.opened(&m);
        if let Some(key) = key {
            let mut cache = lock(&self.cache);
            cache.retain(|_, w| w.strong_count() > 0);
            cache.insert(key, Arc::downgrade(&m));
        }
        Ok(m)
    }

    pub(super) fn open_descriptor<T: Pod>(
        &self,
        meta: &Value,
        fds: Vec<std::os::fd::OwnedFd>,
        what: &str,
    ) -> Result<(Descriptor, MappedBuffer<T>, Waiter)> {
        let (descriptor, fence) = EntryMeta::decode_with_fence(meta)?;
        let mut fds = fds;
        let waiter = self.waiter(descriptor.event, fence, &mut fds, what)?;
        let mapping = self.mapping(&descriptor, fds)?;
        let buffer =
            MappedBuffer::<T>::from_bytes(mapping, descriptor.offset, descriptor.byte_len)?;
        self.wait_latest(&waiter, buffer.stream())?;
        Ok((descriptor, buffer, waiter))
    }

    /// Attaches to the buffer published as `name`: takes a lease, maps the
    /// memory (reusing a mapping this subscriber already holds for the same
    /// allocation) and makes the buffer's stream wait on the publisher's event.
    #[tracing::instrument(level = "debug", skip(self))]
    pub fn attach<T: Pod>(&self, name: &str) -> Result<Attachment<T>> {
        let mut phases = crate::phases::Phases::start("core.attach");
        let a = self.client.attach(name)?;
        phases.mark("request");
        if super::set_book::is_set_meta(&a.meta) {
            return self.attach_arena_buffer(a, &mut phases);
        }
        let opened = self.open_descriptor::<T>(&a.meta, a.fds, "a published buffer");
        phases.mark("open");
        match opened {
            Ok((descriptor, buffer, waiter)) => {
                let guard = LeaseGuard::new(
                    &self.client,
                    &self.pending,
                    a.lease,
                    a.name.clone(),
                    vec![buffer.mapping_arc().clone()],
                );
                Ok(Attachment {
                    lease: a.lease,
                    name: a.name,
                    buffer: buffer.hold(guard.clone()),
                    guard,
                    waiter,
                    descriptor,
                })
            }
            Err(e) => {
                let _ = self.client.release(a.lease);
                Err(e)
            }
        }
    }

    /// Waits up to `timeout` for the publisher's next update of `attached`,
    /// then makes its buffer's stream wait on the event recorded with it.
    /// Returns the update's version (the count of updates, from 1; not the
    /// allocation's generation); [`ChannelError::Unpublished`] when
    /// the publisher wants the buffer back (release it).
    pub fn wait_update<T: Pod>(&self, attached: &Attachment<T>, timeout: Duration) -> Result<u64> {
        let deadline = crate::channel::deadline_in(timeout);
        loop {
            if let Some(notice) = lock(&self.pending)
                .get_mut(&attached.lease)
                .and_then(VecDeque::pop_front)
            {
                return self.apply(attached, &notice);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let u = self.client.next_update(left)?;
            if u.lease == attached.lease {
                return self.apply(attached, &u.notice);
            }
            lock(&self.pending)
                .entry(u.lease)
                .or_default()
                .push_back(u.notice);
        }
    }

    fn apply<T: Pod>(&self, attached: &Attachment<T>, notice: &Notice) -> Result<u64> {
        match notice {
            Notice::Updated { version, data } => {
                let mut phases = crate::phases::Phases::start("core.wait_update");
                self.wait_notice(&attached.waiter, attached.buffer.stream(), data)?;
                phases.mark("stream_wait");
                Ok(*version)
            }
            Notice::Unpublished => Err(ChannelError::Unpublished {
                name: attached.name.clone(),
                lease: attached.lease,
            }
            .into()),
            other => Err(ChannelError::Protocol {
                reason: format!("a notice this version does not know: {other:?}"),
            }
            .into()),
        }
    }

    /// Closes the connection now, after unmapping the cached chunks and
    /// releasing their leases.
    ///
    /// Dropping a subscriber never cuts off what its views hold: the
    /// connection (and every lease on it) then stays open until the last
    /// view, attachment or set is gone. `close` is for a caller that wants
    /// the connection gone now, and says so when it cannot be.
    ///
    /// # Errors
    /// [`Error::StillInUse`] while attachments, sets, rings or views made
    /// from them are alive (the subscriber is dropped all the same, and
    /// its connection closes when the last of them goes).
    pub fn close(self) -> Result<()> {
        let users = |s: &Self| Arc::strong_count(&s.pending).saturating_sub(1);
        if users(&self) > 0 {
            // Releases already retired hold the book until they have run.
            crate::reaper::settle(self.timeout);
        }
        let users = users(&self);
        if users > 0 {
            return Err(Error::StillInUse {
                what: "the subscriber's connection",
                users,
                then: "drop them first; the connection closes when the last of them is gone",
            });
        }
        let idle = lock(&self.chunks).drain_idle();
        self.drop_chunks(idle);
        Ok(())
    }

    /// Releases a lease now: waits for the work queued on every stream the
    /// buffer's views used, drops the mapping (unless another attachment
    /// shares it), then tells the publisher.
    ///
    /// # Errors
    /// [`Error::ViewsAlive`] while clones, slices or casts of the buffer are
    /// alive: the lease then stays until the last of them drops.
    #[tracing::instrument(level = "debug", skip_all, fields(lease = attached.lease))]
    pub fn release<T: Pod>(&self, attached: Attachment<T>) -> Result<()> {
        let Attachment { guard, buffer, .. } = attached;
        drop(buffer);
        guard.check_no_views(1)?;
        guard.end()
    }

    /// Attaches the set published as `name`: one lease for the whole set,
    /// each of its chunks mapped once (reusing the chunks this subscriber
    /// has mapped already: then the hand-off is one message), and the
    /// device stream made to wait on the set's event. The chunks are mapped
    /// with the subscriber's [access](super::SubscriberConfig::access), or
    /// read-only where the publisher asks for read-only readers.
    #[tracing::instrument(level = "debug", skip(self))]
    pub fn attach_set(&self, name: &str) -> Result<SetAttachment> {
        self.attach_set_with(name, self.access)
    }

    /// As [`Subscriber::attach_set`], mapping with `access` instead of the
    /// subscriber's own (still read-only where the publisher asks for it).
    /// A read-only and a read-write attach of one set map its chunks
    /// twice: the two mappings are cached apart, never one for the other.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for a read-only attach of a set whose chunks
    /// are legacy or pool memory (only VMM memory can be mapped read-only).
    #[tracing::instrument(level = "debug", skip(self))]
    pub fn attach_set_with(&self, name: &str, access: Access) -> Result<SetAttachment> {
        self.do_attach_set_with(name, access)
    }

    /// Waits up to `timeout` for the publisher's next update of `set`, then
    /// makes the device stream wait on the event recorded or the fence
    /// signalled with it (a fence wait has this subscriber's deadline and
    /// fails with [`ChannelError::PeerGone`] if the publisher goes). Returns
    /// the update's version; [`ChannelError::Unpublished`] when the publisher
    /// wants the set back (release it).
    pub fn wait_set_update(&self, set: &SetAttachment, timeout: Duration) -> Result<u64> {
        self.do_wait_set_update(set, timeout)
    }

    /// Releases a set as a whole: waits for the work queued on the streams
    /// its views used, then tells the publisher. Its chunks stay mapped in
    /// the cache for the next set, within the mapping budget.
    ///
    /// # Errors
    /// [`Error::ViewsAlive`] while views of its buffers are alive: the lease
    /// then stays until the last of them drops.
    pub fn release_set(&self, set: SetAttachment) -> Result<()> {
        self.do_release_set(set)
    }

    /// Unmaps every cached chunk that no set or buffer holds, and tells the
    /// publisher (so that it may trim them).
    pub fn drop_idle_mappings(&self) {
        let idle = lock(&self.chunks).drain_idle();
        self.drop_chunks(idle);
    }

    /// Cached chunk mappings and their bytes.
    pub fn cached_mappings(&self) -> (usize, u64) {
        lock(&self.chunks).usage()
    }

    /// Unmaps every mapping this subscriber holds, keeping their address
    /// ranges and leases; blocks until the work queued through them has
    /// finished. Mappings that already sleep are left as they are. If one
    /// fails, those put to sleep by this call are woken again.
    ///
    /// Only mappings nothing else holds sleep: their sets, attachments,
    /// rings, views and tensors must be gone (the cached chunks of released
    /// sets stay mapped for reuse: those sleep, and an attach after the
    /// wake finds them at the same addresses). To keep views or CUDA graphs
    /// over them across the sleep, see [`Subscriber::sleep_unchecked`].
    ///
    /// # Errors
    /// Refused, before anything is unmapped: [`Error::Unsupported`] when a
    /// mapping cannot sleep (legacy IPC or pool memory);
    /// [`Error::StillInUse`] while anything but the subscriber holds one
    /// (views dropped just before are waited for, within the reaper's
    /// settle time).
    pub fn sleep(&self) -> Result<Slept> {
        self.do_sleep()
    }

    /// Maps every sleeping mapping of this subscriber again at the
    /// addresses it had, with the access it had. Returns what it mapped;
    /// the first failure stops it (the rest still sleep: call again).
    pub fn wake(&self) -> Result<Slept> {
        self.do_wake()
    }

    /// Whether any mapping of this subscriber sleeps.
    pub fn asleep(&self) -> bool {
        self.live_mappings().iter().any(|m| m.asleep())
    }

    /// Subscribes to the ring `name`: maps every slot once.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for a subscriber that waits on events
    /// ([`SyncMode::Event`](super::SyncMode::Event)) and a fences-only ring
    /// ([`RingSync::FencesOnly`](super::RingSync::FencesOnly)), which records none.
    pub fn attach_ring<T: Pod>(&self, name: &str) -> Result<RingSubscriber<T>> {
        self.do_attach_ring(name)
    }

    /// The next frame of `ring`, within `timeout`: a view of the slot's
    /// buffer, whose stream has been made to wait on the frame's event.
    pub fn next_frame<T: Pod>(
        &self,
        ring: &RingSubscriber<T>,
        timeout: Duration,
    ) -> Result<RingFrame<T>> {
        self.do_next_frame(ring, timeout)
    }

    /// Hands a frame's slot back to the producer, after the work queued on
    /// every stream its views used (the frame's own, and any given with
    /// `with_stream`) has finished.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a frame of another subscription than
    /// `ring` (nothing is acknowledged).
    #[allow(clippy::needless_pass_by_value)] // taking the frame ends its use
    pub fn ack<T: Pod>(&self, ring: &RingSubscriber<T>, frame: RingFrame<T>) -> Result<()> {
        self.do_ack(ring, frame)
    }

    /// Ends a ring subscription now, after the work queued on every stream
    /// the slots' views used.
    ///
    /// # Errors
    /// [`Error::ViewsAlive`] while clones, slices or casts of a slot's buffer
    /// are alive: the subscription then ends when the last of them drops.
    pub fn release_ring<T: Pod>(&self, ring: RingSubscriber<T>) -> Result<()> {
        ring.release()
    }
}
