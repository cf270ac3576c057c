//! The subscribing side: connecting, and every public method of a
//! subscriber (their work is in the files named after it: `attachment.rs`,
//! `set_attach.rs`, `ring_attach.rs`, `sleep.rs`, `waiting.rs`,
//! `reconnect.rs`).

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytemuck::Pod;

use crate::Access;
use crate::channel::ClientConfig;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::event::IpcEvent;
use crate::fence::FenceMapping;
use crate::handle::IpcEventHandle;
use crate::memory::buffer::Mapping;

pub use super::attachment::Attachment;
use super::chunk_cache::ChunkCache;
use super::lease::{LeaseGuard, Pending};
use super::link::Link;
use super::reconnected::{KeptCall, Reconnected};
use super::ring::{RingFrame, RingSubscriber};
use super::set_attachment::SetAttachment;
use super::slept::Slept;
use super::subscriber_config::SubscriberConfig;
use super::sync::SyncMode;
use super::{Endpoint, lock};

/// Cache key of a mapping: the exporter, its allocation's generation (never
/// the address, which a freed allocation gives to the next one) and the
/// access (a read-only and a read-write mapping are never shared).
pub(super) type CacheKey = (u32, u64, Access);

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
///
/// # When the publisher's process ends
/// A subscriber whose publisher said that another process serves its
/// socket after it (the weight service under its keeper), or one
/// configured to ([`SubscriberConfig::with_reconnect`]), connects again at
/// its next call (an attach, a wait for an update, a release, a call, or
/// [`Subscriber::reconnect`]): within its timeout, then an error naming the
/// socket. Its mappings and their addresses stay; it takes back the lease
/// of each cached chunk and of each set it holds whose version the
/// publisher still serves, and says which sets it holds an old version of
/// (see [`Subscriber::reconnect`]). Any other subscriber gets
/// [`ChannelError::PeerGone`](crate::channel::ChannelError::PeerGone) at
/// once, as ever.
pub struct Subscriber {
    /// Cached chunk mappings, unmapped before the connection (and with it
    /// the chunk leases) closes: fields drop in declaration order.
    pub(super) chunks: Mutex<ChunkCache>,
    pub(super) device: Device,
    /// The connection now (another after a reconnect).
    pub(super) link: Arc<Link>,
    pub(super) cache: Mutex<HashMap<CacheKey, Weak<dyn Mapping>>>,
    pub(super) events: Mutex<HashMap<IpcEventHandle, Arc<IpcEvent>>>,
    pub(super) fences: Mutex<HashMap<u64, Arc<FenceMapping>>>,
    pub(super) sync: SyncMode,
    pub(super) timeout: Duration,
    /// How attaches map, unless a set's publisher asks for read-only.
    pub(super) access: Access,
    pub(super) pending: Arc<Pending>,
    opens: std::sync::atomic::AtomicU64,
    /// Every mapping opened, while it lives: what a sleep unmaps.
    pub(super) live: Mutex<Vec<Weak<dyn Mapping>>>,
    /// The set entry tables read last, for sets of a layout seen before.
    pub(super) tables: crate::set::EntryTables,
    /// The leases of the sets attached by name, which a reconnect takes
    /// back.
    pub(super) held: Mutex<Vec<Weak<LeaseGuard>>>,
    /// Whether a lease is left to take back (refused at the last try, or
    /// taken on a connection that ended meanwhile).
    pub(super) retake_due: AtomicBool,
    /// Set on a new connection until the publisher was told that it took
    /// back all it holds (`reconnect.rs`, `tell_reconnected`).
    pub(super) reconnected_due: AtomicBool,
    /// Calls made again on each new connection ([`Subscriber::call_and_keep`]).
    pub(super) kept_calls: Mutex<Vec<KeptCall>>,
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        // Cached chunks that nothing holds are let go of without waiting;
        // those that views hold stay mapped (the views hold the mappings)
        // and leased (the views' leases keep the connection open) until
        // the views are gone. Never connects again.
        let idle = lock(&self.chunks).drain_idle();
        for c in idle {
            c.retire(&self.link, &self.pending);
        }
    }
}

impl std::fmt::Debug for Subscriber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscriber")
            .field("server_pid", &self.link.client().server_pid())
            .field("link", &self.link)
            .finish_non_exhaustive()
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
        let link = Link::connect(path, client_config, config.reconnect)?;
        Ok(Subscriber {
            device: device.clone(),
            link: Arc::new(link),
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
            held: Mutex::new(Vec::new()),
            retake_due: AtomicBool::new(false),
            reconnected_due: AtomicBool::new(false),
            kept_calls: Mutex::new(Vec::new()),
        })
    }

    /// The names published now (not the hidden entries of arena chunks
    /// and set record parts, which start with `.cuda-ipc/`).
    pub fn list(&self) -> Result<Vec<String>> {
        let listed = self.on_link(true, |conn| Ok(conn.client.list()?))?;
        Ok(listed
            .into_iter()
            .map(|e| e.name)
            .filter(|n| !n.starts_with(super::set_book::HIDDEN_ENTRY_PREFIX))
            .collect())
    }

    /// Calls `method` of the publisher's call handler (a service's, see
    /// `cuda_ipc_service::service::admin`) with `body` on this subscriber's
    /// connection, waiting up to `timeout` (`None`: the subscriber's
    /// timeout). What a call makes the connection hold (a service's write
    /// lock) ends with it. A reconnecting subscriber connects again first
    /// if the connection ended; a call cut off by its end is not made
    /// again (it may have been answered).
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
        let timeout = timeout.unwrap_or(self.timeout);
        self.on_link(false, |conn| {
            Ok(conn.client.call_within(method, body, timeout)?)
        })
    }

    /// [`Subscriber::call`], and on success, the same call again on every
    /// connection a reconnect makes, before it takes leases back, until
    /// [`Subscriber::forget_kept_call`] with the same `method` and `key`
    /// (a later call with them replaces it): for what a connection holds
    /// for its caller (a service reader's `aside`).
    ///
    /// # Errors
    /// As [`Subscriber::call`] (nothing is kept).
    pub fn call_and_keep(
        &self,
        method: &str,
        key: &str,
        body: &serde_json::Value,
        timeout: Option<Duration>,
    ) -> Result<serde_json::Value> {
        let answer = self.call(method, body, timeout)?;
        self.keep_call(method, key, body, timeout.unwrap_or(self.timeout));
        Ok(answer)
    }

    /// Stops making the call kept by [`Subscriber::call_and_keep`] with
    /// `method` and `key` on new connections.
    pub fn forget_kept_call(&self, method: &str, key: &str) {
        lock(&self.kept_calls).retain(|c| !c.is(method, key));
    }

    /// Makes sure the connection is up: connects again if it has ended
    /// (whatever [`SubscriberConfig::with_reconnect`] says: this call asks
    /// for it), takes back the lease of each cached chunk and of each set
    /// held whose version the publisher still serves (sets refused before,
    /// as while a write in place runs, are tried again), and says what it
    /// did. Mappings and addresses stay as they are; nothing is mapped
    /// again. Within the subscriber's timeout.
    ///
    /// # Errors
    /// A [`ChannelError::Timeout`](crate::channel::ChannelError::Timeout)
    /// naming the socket when no publisher answered there; a
    /// [`ChannelError::Refused`](crate::channel::ChannelError::Refused) one
    /// that refuses this process.
    pub fn reconnect(&self) -> Result<Reconnected> {
        self.do_reconnect()
    }

    /// Whether this subscriber connects again when its publisher's process
    /// ends ([`SubscriberConfig::with_reconnect`], and what the publisher
    /// said when it welcomed it).
    pub fn reconnects(&self) -> bool {
        self.link.reconnects()
    }

    /// The device this subscriber maps on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Whether the publisher is still there (does not block, does not
    /// connect again).
    pub fn is_alive(&self) -> bool {
        self.link.is_alive()
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

    /// Attaches to the buffer published as `name`: takes a lease, maps the
    /// memory (reusing a mapping this subscriber already holds for the same
    /// allocation) and makes the buffer's stream wait on the publisher's event.
    #[tracing::instrument(level = "debug", skip(self))]
    pub fn attach<T: Pod>(&self, name: &str) -> Result<Attachment<T>> {
        self.on_link(true, |conn| self.do_attach(conn, name))
    }

    /// Waits up to `timeout` for the publisher's next update of `attached`,
    /// then makes its buffer's stream wait on the event recorded with it.
    /// Returns the update's version (the count of updates, from 1; not the
    /// allocation's generation); [`ChannelError::Unpublished`](crate::channel::ChannelError::Unpublished) when
    /// the publisher wants the buffer back (release it). For a
    /// reconnecting subscriber, see [`Subscriber::wait_set_update`].
    pub fn wait_update<T: Pod>(&self, attached: &Attachment<T>, timeout: Duration) -> Result<u64> {
        self.do_wait_update(attached, timeout)
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
    #[tracing::instrument(level = "debug", skip_all, fields(lease = attached.lease()))]
    pub fn release<T: Pod>(&self, attached: Attachment<T>) -> Result<()> {
        self.before_release();
        let (guard, buffer) = attached.into_parts();
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
        self.on_link(true, |conn| self.do_attach_set_with(conn, name, access))
    }

    /// Waits up to `timeout` for the publisher's next update of `set`, then
    /// makes the device stream wait on the event recorded or the fence
    /// signalled with it (a fence wait has this subscriber's deadline and
    /// fails with [`ChannelError::PeerGone`](crate::channel::ChannelError::PeerGone) if the publisher goes). Returns
    /// the update's version; [`ChannelError::Unpublished`](crate::channel::ChannelError::Unpublished) when the publisher
    /// wants the set back (release it).
    ///
    /// A reconnecting subscriber whose publisher's process ends connects
    /// again and waits on. If the publisher then serves another version of
    /// the set than the one held, this returns at once, as for an update
    /// (attach the set again for the current version; the one held stays
    /// mapped); if it serves none, it is `Unpublished`; if it refuses the
    /// set for now (a write in place, a torn set), its refusal.
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

    /// The address ranges (base, bytes) of the mappings that sleep now,
    /// in address order: what a use while asleep would fault on (a
    /// language binding checks its tensors against them).
    pub fn sleeping_ranges(&self) -> Vec<(u64, u64)> {
        self.live_mappings()
            .iter()
            .filter(|m| m.asleep())
            .map(|m| (m.base(), m.size()))
            .collect()
    }

    /// Subscribes to the ring `name`: maps every slot once.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for a subscriber that waits on events
    /// ([`SyncMode::Event`](super::SyncMode::Event)) and a fences-only ring
    /// ([`RingSync::FencesOnly`](super::RingSync::FencesOnly)), which records none.
    pub fn attach_ring<T: Pod>(&self, name: &str) -> Result<RingSubscriber<T>> {
        self.on_link(true, |conn| self.do_attach_ring(conn, name))
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
