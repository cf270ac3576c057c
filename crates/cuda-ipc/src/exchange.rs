//! Publishers and subscribers: device buffers shared by name over the
//! [`channel`], with leases, per-publish events, a mapping
//! cache and rings.
//!
//! ```no_run
//! use cuda_ipc::exchange::{Publisher, Subscriber};
//! use cuda_ipc::kernels::{self, Pattern, Speed};
//! use cuda_ipc::{Device, Dtype, share::SharedBuffer};
//!
//! // Producer
//! let device = Device::open(0)?;
//! let publisher = Publisher::bind(&device, "frames", Default::default())?;
//! let buffer = SharedBuffer::alloc(&device, 64 << 20, None)?;
//! kernels::fill_u32(&buffer, Pattern::ramp(0, 1), Speed::Full)?;
//! publisher.publish("weights", buffer, Dtype::U32, None)?; // records an event after the fill
//!
//! // Consumer (another process)
//! let subscriber = Subscriber::connect(&device, "frames", Default::default())?;
//! let weights = subscriber.attach::<u32>("weights")?; // mapped; its stream waits on the event
//! assert_eq!(kernels::check_u32(weights.buffer(), Pattern::ramp(0, 1))?, None);
//! subscriber.release(weights)?; // the producer may now free it
//! # Ok::<(), cuda_ipc::Error>(())
//! ```
//!
//! # Synchronisation
//! The publisher records one interprocess event after the writes queued on
//! a buffer's stream at every [`Publisher::publish`] and
//! [`Publisher::update`] and then notifies; the subscriber makes the
//! mapping's stream wait on that event at [`Subscriber::attach`] and at
//! every [`Subscriber::wait_update`]. Every update, not only the first
//! attach. One event per publisher serves every buffer, so a subscriber
//! opens it once.
//!
//! # Lifetimes
//! Every attach is a lease held by the subscriber's connection.
//! [`Publisher::unpublish`] hides a buffer from new subscribers and waits
//! (with a timeout) until its last lease is released before handing the
//! buffer back to be freed. A subscriber that exits or is killed releases
//! its leases (the socket closes). If the publisher dies, the subscriber's
//! next call fails within a second with [`ChannelError::PeerGone`];
//! [`Subscriber::is_alive`] polls for it.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use bytemuck::Pod;
use serde_json::{Value, json};

use crate::buffer::{MappedBuffer, Mapping};
use crate::channel::{
    self, ChannelError, Client, ClientConfig, LeaseInfo, Notice, Server, ServerConfig,
};
use crate::descriptor::{Descriptor, Dtype, Mechanism};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::event::IpcEvent;
use crate::handle::IpcEventHandle;
use crate::memory::DeviceMemory;
use crate::share::{self, SharedBuffer};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Where the socket is: a name under the default socket directory
/// (`$XDG_RUNTIME_DIR/cuda-ipc/<name>.sock`) or an explicit path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// A name in the default, private socket directory.
    Name(String),
    /// An explicit socket path.
    Path(PathBuf),
}

impl Endpoint {
    /// The socket path.
    pub fn path(&self) -> Result<PathBuf> {
        match self {
            Endpoint::Name(n) => Ok(channel::default_socket_path(n)?),
            Endpoint::Path(p) => Ok(p.clone()),
        }
    }
}

impl From<&str> for Endpoint {
    /// A string with a `/` is a path; anything else is a name.
    fn from(s: &str) -> Self {
        if s.contains('/') {
            Endpoint::Path(s.into())
        } else {
            Endpoint::Name(s.into())
        }
    }
}

impl From<&Path> for Endpoint {
    fn from(p: &Path) -> Self {
        Endpoint::Path(p.into())
    }
}

impl From<PathBuf> for Endpoint {
    fn from(p: PathBuf) -> Self {
        Endpoint::Path(p)
    }
}

/// How a [`Publisher`] serves.
#[derive(Clone, Debug, Default)]
pub struct PublisherConfig {
    /// User ids allowed to connect besides our own (peer credentials are
    /// checked on every connection).
    pub allow_uids: Vec<u32>,
}

/// The meta of an entry: the descriptor plus the event handle.
fn entry_meta(descriptor: &Descriptor) -> Value {
    json!({ "descriptor": descriptor.to_value() })
}

struct PublishedBuffer {
    buffer: Arc<SharedBuffer>,
}

/// Serves device buffers by name to subscribers in other processes.
pub struct Publisher {
    device: Device,
    server: Server,
    event: IpcEvent,
    event_handle: IpcEventHandle,
    entries: Mutex<HashMap<String, PublishedBuffer>>,
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
    pub fn bind(
        device: &Device,
        endpoint: impl Into<Endpoint>,
        config: PublisherConfig,
    ) -> Result<Self> {
        let path = endpoint.into().path()?;
        let mut server_config = ServerConfig::new(path);
        for uid in config.allow_uids {
            if !server_config.allowed_uids.contains(&uid) {
                server_config.allowed_uids.push(uid);
            }
        }
        let server = Server::bind(server_config)?;
        let event = IpcEvent::new(device)?;
        let event_handle = event.handle()?;
        tracing::info!(path = %server.path().display(), "publisher serving");
        Ok(Publisher {
            device: device.clone(),
            server,
            event,
            event_handle,
            entries: Mutex::new(HashMap::new()),
        })
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
    #[tracing::instrument(level = "debug", skip(self, buffer, shape), fields(mechanism = %buffer.mechanism(), len = buffer.len()))]
    pub fn publish(
        &self,
        name: &str,
        buffer: SharedBuffer,
        dtype: Dtype,
        shape: Option<Vec<u64>>,
    ) -> Result<Arc<SharedBuffer>> {
        let buffer = Arc::new(buffer);
        let export = buffer.export_region(0, buffer.len() as u64, dtype, shape)?;
        self.event.record(buffer.stream())?;
        let mut descriptor = export.descriptor;
        descriptor.event = Some(self.event_handle);
        let mut entries = lock(&self.entries);
        self.server
            .publish(name, entry_meta(&descriptor), export.fds)?;
        entries.insert(
            name.to_owned(),
            PublishedBuffer {
                buffer: buffer.clone(),
            },
        );
        Ok(buffer)
    }

    /// Tells every subscriber of `name` that new contents are ready: records
    /// the event after the work queued on the buffer's stream, then notifies.
    /// Returns the update's generation (from 1).
    #[tracing::instrument(level = "debug", skip(self))]
    pub fn update(&self, name: &str) -> Result<u64> {
        let buffer = lock(&self.entries)
            .get(name)
            .map(|e| e.buffer.clone())
            .ok_or_else(|| Error::from(ChannelError::NotFound { name: name.into() }))?;
        self.event.record(buffer.stream())?;
        Ok(self.server.update(name, json!({}))?)
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
        self.server.unpublish(name)?;
        self.server.wait_released(name, timeout)?;
        let entry = lock(&self.entries)
            .remove(name)
            .ok_or_else(|| Error::from(ChannelError::NotFound { name: name.into() }))?;
        Ok(entry.buffer)
    }

    /// The current leases.
    pub fn leases(&self) -> Vec<LeaseInfo> {
        self.server.leases()
    }

    /// Creates a ring of `slots` buffers of `slot_bytes` each, shared with
    /// `mechanism` (`None`: the best available), under `name`.
    pub fn ring(
        &self,
        name: &str,
        slots: usize,
        slot_bytes: usize,
        mechanism: Option<Mechanism>,
    ) -> Result<RingPublisher> {
        let mut buffers = Vec::with_capacity(slots);
        let mut metas = Vec::with_capacity(slots);
        for _ in 0..slots {
            let b = SharedBuffer::alloc(&self.device, slot_bytes, mechanism)?;
            let mut e = b.export()?;
            e.descriptor.event = Some(self.event_handle);
            metas.push((entry_meta(&e.descriptor), e.fds));
            buffers.push(b);
        }
        let producer = self
            .server
            .create_ring(name, json!({ "slot_bytes": slot_bytes }), metas)?;
        let event = IpcEvent::new(&self.device)?;
        let event_handle = event.handle()?;
        Ok(RingPublisher {
            producer,
            buffers,
            event,
            event_handle,
        })
    }
}

/// The producer's side of a ring of buffers with back-pressure.
pub struct RingPublisher {
    producer: channel::RingProducer,
    buffers: Vec<SharedBuffer>,
    event: IpcEvent,
    event_handle: IpcEventHandle,
}

impl RingPublisher {
    /// Waits (up to `timeout`) until the next slot is free, and returns its
    /// index and buffer to fill.
    pub fn acquire(&self, timeout: Option<Duration>) -> Result<(usize, &SharedBuffer)> {
        let slot = self.producer.acquire(timeout)? as usize;
        Ok((slot, &self.buffers[slot]))
    }

    /// Publishes a filled slot: records the ring's event after the work
    /// queued on the slot's stream and sends the frame. Returns its sequence number.
    pub fn publish(&self, slot: usize) -> Result<u64> {
        self.publish_with(slot, serde_json::Map::new())
    }

    /// As [`RingPublisher::publish`], with extra fields for the subscriber
    /// in the frame's notice (a timestamp, a frame number; small).
    pub fn publish_with(
        &self,
        slot: usize,
        mut extra: serde_json::Map<String, Value>,
    ) -> Result<u64> {
        let buffer = self.buffers.get(slot).ok_or_else(|| {
            Error::arg("slot", format!("the ring has {} slots", self.buffers.len()))
        })?;
        self.event.record(buffer.stream())?;
        extra.insert("event".into(), self.event_handle.to_hex().into());
        Ok(self.producer.publish(slot as u32, Value::Object(extra))?)
    }

    /// The number of slots.
    pub fn slots(&self) -> usize {
        self.buffers.len()
    }

    /// The current subscribers.
    pub fn subscribers(&self) -> Vec<LeaseInfo> {
        self.producer.subscribers()
    }
}

/// How a [`Subscriber`] connects.
#[derive(Clone, Debug)]
pub struct SubscriberConfig {
    /// How long a request may take (5 s by default).
    pub timeout: Duration,
    /// User ids the publisher may run as besides our own.
    pub allow_uids: Vec<u32>,
}

impl Default for SubscriberConfig {
    fn default() -> Self {
        SubscriberConfig {
            timeout: Duration::from_secs(5),
            allow_uids: Vec::new(),
        }
    }
}

/// Cache key of a mapping: the exporter and its allocation's generation
/// (never the address, which a freed allocation gives to the next one).
type CacheKey = (u32, u64);

/// Connects to a [`Publisher`] and maps what it publishes.
pub struct Subscriber {
    device: Device,
    client: Client,
    cache: Mutex<HashMap<CacheKey, Weak<dyn Mapping>>>,
    events: Mutex<HashMap<IpcEventHandle, Arc<IpcEvent>>>,
    pending: Mutex<HashMap<u64, VecDeque<Notice>>>,
    opens: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Subscriber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscriber")
            .field("server_pid", &self.client.server_pid())
            .finish_non_exhaustive()
    }
}

/// A buffer attached from a publisher: a lease and a typed mapping.
#[derive(Debug)]
pub struct Attached<T> {
    lease: u64,
    name: String,
    buffer: MappedBuffer<T>,
    event: Arc<IpcEvent>,
    descriptor: Descriptor,
}

impl<T: Pod> Attached<T> {
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
}

impl Subscriber {
    /// Connects to the publisher at `endpoint` (checking its peer credentials).
    pub fn connect(
        device: &Device,
        endpoint: impl Into<Endpoint>,
        config: SubscriberConfig,
    ) -> Result<Self> {
        let path = endpoint.into().path()?;
        let mut client_config = ClientConfig::default().with_timeout(config.timeout);
        client_config.allowed_server_uids.extend(config.allow_uids);
        let client = Client::connect(path, client_config)?;
        Ok(Subscriber {
            device: device.clone(),
            client,
            cache: Mutex::new(HashMap::new()),
            events: Mutex::new(HashMap::new()),
            pending: Mutex::new(HashMap::new()),
            opens: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// The names published now.
    pub fn list(&self) -> Result<Vec<String>> {
        Ok(self.client.list()?.into_iter().map(|e| e.name).collect())
    }

    /// Whether the publisher is still there (does not block).
    pub fn is_alive(&self) -> bool {
        self.client.is_alive()
    }

    /// How many mappings this subscriber has opened (cache misses).
    pub fn opens(&self) -> u64 {
        self.opens.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn event(&self, handle: IpcEventHandle) -> Result<Arc<IpcEvent>> {
        let mut events = lock(&self.events);
        if let Some(e) = events.get(&handle) {
            return Ok(e.clone());
        }
        let e = Arc::new(IpcEvent::open(&self.device, handle)?);
        events.insert(handle, e.clone());
        Ok(e)
    }

    fn mapping(
        &self,
        descriptor: &Descriptor,
        fds: Vec<std::os::fd::OwnedFd>,
    ) -> Result<Arc<dyn Mapping>> {
        let key = descriptor.generation.map(|g| (descriptor.pid, g));
        if let Some(key) = key
            && let Some(m) = lock(&self.cache).get(&key).and_then(Weak::upgrade)
        {
            return Ok(m);
        }
        let m = share::open_mapping(&self.device, descriptor, fds)?;
        self.opens
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Some(key) = key {
            let mut cache = lock(&self.cache);
            cache.retain(|_, w| w.strong_count() > 0);
            cache.insert(key, Arc::downgrade(&m));
        }
        Ok(m)
    }

    fn open_descriptor<T: Pod>(
        &self,
        meta: &Value,
        fds: Vec<std::os::fd::OwnedFd>,
    ) -> Result<(Descriptor, MappedBuffer<T>, Arc<IpcEvent>)> {
        let descriptor = Descriptor::from_value(&meta["descriptor"])?;
        let handle = descriptor.event.ok_or_else(|| Error::Descriptor {
            field: "event".into(),
            reason: "a published buffer must carry the publisher's event".into(),
        })?;
        let event = self.event(handle)?;
        let mapping = self.mapping(&descriptor, fds)?;
        let buffer = MappedBuffer::<T>::from_bytes(mapping, descriptor.offset, descriptor.len)?;
        event.wait_on(buffer.stream())?;
        Ok((descriptor, buffer, event))
    }

    /// Attaches to the buffer published as `name`: takes a lease, maps the
    /// memory (reusing a mapping this subscriber already holds for the same
    /// allocation) and makes the buffer's stream wait on the publisher's event.
    #[tracing::instrument(level = "debug", skip(self))]
    pub fn attach<T: Pod>(&self, name: &str) -> Result<Attached<T>> {
        let a = self.client.attach(name)?;
        match self.open_descriptor::<T>(&a.meta, a.fds) {
            Ok((descriptor, buffer, event)) => Ok(Attached {
                lease: a.lease,
                name: a.name,
                buffer,
                event,
                descriptor,
            }),
            Err(e) => {
                let _ = self.client.release(a.lease);
                Err(e)
            }
        }
    }

    /// Waits up to `timeout` for the publisher's next update of `attached`,
    /// then makes its buffer's stream wait on the event recorded with it.
    /// Returns the update's generation; [`ChannelError::Unpublished`] when
    /// the publisher wants the buffer back (release it).
    pub fn wait_update<T: Pod>(&self, attached: &Attached<T>, timeout: Duration) -> Result<u64> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(notice) = lock(&self.pending)
                .get_mut(&attached.lease)
                .and_then(VecDeque::pop_front)
            {
                return Self::apply(attached, &notice);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let u = self.client.next_update(left)?;
            if u.lease == attached.lease {
                return Self::apply(attached, &u.notice);
            }
            lock(&self.pending)
                .entry(u.lease)
                .or_default()
                .push_back(u.notice);
        }
    }

    fn apply<T: Pod>(attached: &Attached<T>, notice: &Notice) -> Result<u64> {
        match notice {
            Notice::Updated { generation, .. } => {
                attached.event.wait_on(attached.buffer.stream())?;
                Ok(*generation)
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

    /// Releases a lease: waits for the work queued on the buffer's stream,
    /// drops the mapping (unless another attachment shares it), then tells
    /// the publisher.
    #[tracing::instrument(level = "debug", skip_all, fields(lease = attached.lease))]
    pub fn release<T: Pod>(&self, attached: Attached<T>) -> Result<()> {
        attached.buffer.synchronize()?;
        let lease = attached.lease;
        drop(attached);
        lock(&self.pending).remove(&lease);
        Ok(self.client.release(lease)?)
    }

    /// Subscribes to the ring `name`: maps every slot once.
    pub fn attach_ring<T: Pod>(&self, name: &str) -> Result<RingSubscriber<T>> {
        let a = self.client.attach_ring(name)?;
        let mut slots = Vec::with_capacity(a.slots.len());
        for (meta, fds) in a.slots {
            match self.open_descriptor::<T>(&meta, fds) {
                Ok((_, buffer, _)) => slots.push(buffer),
                Err(e) => {
                    let _ = self.client.release(a.lease);
                    return Err(e);
                }
            }
        }
        Ok(RingSubscriber {
            lease: a.lease,
            slots,
        })
    }

    /// The next frame of `ring`, within `timeout`: the slot's buffer, whose
    /// stream has been made to wait on the frame's event.
    pub fn next_frame<'r, T: Pod>(
        &self,
        ring: &'r RingSubscriber<T>,
        timeout: Duration,
    ) -> Result<Frame<'r, T>> {
        let f = self.client.next_frame(ring.lease, timeout)?;
        let buffer = ring.slots.get(f.slot as usize).ok_or_else(|| {
            Error::arg(
                "ring frame",
                format!("slot {} of {}", f.slot, ring.slots.len()),
            )
        })?;
        let handle: IpcEventHandle = f.notice["event"]
            .as_str()
            .ok_or_else(|| Error::arg("ring frame", "no event in the frame"))?
            .parse()?;
        self.event(handle)?.wait_on(buffer.stream())?;
        Ok(Frame {
            slot: f.slot as usize,
            seq: f.seq,
            buffer,
            notice: f.notice,
        })
    }

    /// Hands a frame's slot back to the producer, after the work queued on
    /// its stream has finished.
    #[allow(clippy::needless_pass_by_value)] // taking the frame ends its use
    pub fn ack<T: Pod>(&self, ring: &RingSubscriber<T>, frame: Frame<'_, T>) -> Result<()> {
        frame.buffer.synchronize()?;
        Ok(self.client.ack(ring.lease, frame.slot as u32, frame.seq)?)
    }

    /// Ends a ring subscription.
    pub fn release_ring<T: Pod>(&self, ring: RingSubscriber<T>) -> Result<()> {
        for s in &ring.slots {
            s.synchronize()?;
        }
        let lease = ring.lease;
        drop(ring);
        Ok(self.client.release(lease)?)
    }
}

/// A subscription to a ring: every slot mapped.
#[derive(Debug)]
pub struct RingSubscriber<T> {
    lease: u64,
    slots: Vec<MappedBuffer<T>>,
}

impl<T: Pod> RingSubscriber<T> {
    /// The number of slots.
    pub fn slots(&self) -> usize {
        self.slots.len()
    }
}

/// One received frame of a ring.
#[derive(Debug)]
#[must_use = "acknowledge the frame with Subscriber::ack so the producer can reuse the slot"]
pub struct Frame<'r, T> {
    /// The slot.
    pub slot: usize,
    /// The frame's sequence number (from 1).
    pub seq: u64,
    /// The slot's buffer.
    pub buffer: &'r MappedBuffer<T>,
    /// The producer's notice (its extra fields and the event).
    pub notice: Value,
}
