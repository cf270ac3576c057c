//! Publishers and subscribers: device buffers shared by name over the
//! [`channel`], with leases, per-publish events, a mapping
//! cache and rings.
//!
//! ```no_run
//! use cuda_ipc_exchange::exchange::{Publisher, Subscriber};
//! use cuda_ipc_core::kernels::{self, Pattern, Speed};
//! use cuda_ipc_core::{Device, Dtype, share::SharedBuffer};
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
//! # Ok::<(), cuda_ipc_core::Error>(())
//! ```
//!
//! # Arenas and sets
//! Many buffers (a model's weights) travel as one **set** from the
//! publisher's arena: [`Publisher::publish_set`], [`Subscriber::attach_set`],
//! [`Publisher::update_set`] with [`Subscriber::wait_set_update`],
//! [`Subscriber::release_set`]; one buffer with [`Publisher::publish_buffer`]
//! and the usual [`Subscriber::attach`].
//!
//! A [`Publisher`] that shares through an arena ([`Sharing::Arena`], the
//! default) publishes each chunk of its arena **once**, as a hidden channel
//! entry carrying the chunk's descriptor and file descriptors (exported once
//! when the chunk was made). A buffer or a set is then an entry whose
//! metadata is a [set record](crate::set): names, types, shapes and
//! (chunk, offset, length) views, and no file descriptor. A subscriber
//! attaches a chunk's hidden entry only the first time it maps that chunk,
//! and keeps the mapping (and that lease, which tells the publisher the
//! chunk is mapped) in its cache until the [`MappingBudget`] evicts it. So a
//! hand-off from an arena is one event record and one message; a chunk's
//! file descriptors travel once per subscriber, in a frame of their own (at
//! most 16 per frame, one chunk per frame).
//!
//! An update of a set ([`Publisher::update_set`]) costs the same whatever
//! the set's size: one event recorded and one fence signalled after the
//! set's streams, and one notice per subscriber, carrying no part of the
//! record. What it needs of the set (its distinct chunks, their streams,
//! its fence slot) is worked out once, when the set is published.
//!
//! A set whose entry table is at least [`TABLE_REF_MIN_BYTES`] long (about
//! 300 buffers) names its table instead of carrying it (set format 3,
//! [`TableRef`](crate::set::TableRef)): the table is published once per
//! layout as hidden entries, which stay while a set naming them is
//! published or leased (and the two used last besides), and a subscriber
//! that kept the table ([`Subscriber::entry_tables`]) reads only the short
//! record. A set record larger than [`SET_PART_BYTES`] travels in several
//! parts, hidden entries of its own, read a batch at a time.
//!
//! **Lifetimes.** A published buffer or set holds an [`ArenaLease`](crate::arena::ArenaLease) on each
//! of its buffers while it is published and, after it is unpublished, until
//! the last consumer's lease on it has ended (released, or closed with the
//! consumer's connection when it exits or is killed); only then can its
//! ranges go back to the arena, and only if the producer has dropped its
//! [`ArenaBuffer`](crate::arena::ArenaBuffer)s too. The publisher checks
//! for ended leases at each of its arena calls and at [`Publisher::reap`].
//!
//! # Read-only readers
//! A publisher bound with [`PublisherConfig::with_read_only_readers`] puts
//! `read_only` in the record of every set and arena buffer it publishes,
//! from an arena of vmm chunks; every subscriber then maps their chunks
//! read-only (`cuMemSetAccess` with `CU_MEM_ACCESS_FLAGS_PROT_READ`), so a
//! kernel or copy that writes through them fails and the publisher's bytes
//! do not change. A subscriber may also ask for read-only itself, for all
//! it attaches ([`SubscriberConfig::with_access`]) or for one set
//! ([`Subscriber::attach_set_with`]). [`SetAttachment::read_only`],
//! [`Attachment::read_only`] and each view's
//! [`Mapping::read_only`](cuda_ipc_core::Mapping::read_only) say how it
//! is mapped. A read-only and a read-write mapping of one chunk are cached
//! apart. Only VMM memory can be mapped read-only: a publisher with
//! read-only readers refuses legacy and pool arenas, isolated buffers
//! ([`Publisher::publish`]) and rings, and a read-only attach of legacy or
//! pool memory is [`Error::Unsupported`](cuda_ipc_core::Error::Unsupported). It
//! guards against mistakes, not malice: a reader holds the chunks' file
//! descriptors and could map them again read-write (the hidden chunk
//! entries carry no policy of their own).
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
//! Every publish, update and ring frame, and every set and arena buffer
//! published or updated, also signals a GPU-side fence (see [`SyncMode`]):
//! a subscriber that cannot open the event (its own `/dev/shm`, as in a
//! container) waits on the fence instead.
//!
//! # Lifetimes
//! Every attach is a lease held by every view of the attached buffer (its
//! clones, slices and casts; for a set, every view of every entry), and
//! each lease holds the connection that carries it: dropping (or
//! [closing](Subscriber::close)) a [`Subscriber`] while views live leaves the
//! connection open, so the publisher keeps the memory, until the last view
//! is gone. The lease is released when the last view drops, or by
//! [`Subscriber::release`], which refuses while other views are alive
//! ([`Error::ViewsAlive`](cuda_ipc_core::Error::ViewsAlive)).
//!
//! **No drop waits.** Dropping the last view retires the release to the
//! [`reaper`](crate::reaper): events are recorded on every stream the views
//! used, and once they have passed, the mappings are undone and the
//! publisher is told (without waiting for its answer). So the publisher
//! never frees or reuses memory that queued work still uses, and a drop
//! returns at once even while the GPU is busy or the publisher is stopped.
//! [`reaper::settle`](crate::reaper::settle) waits for the retired releases
//! where a program needs their effect. Explicit calls
//! ([`Subscriber::release`], [`Subscriber::release_set`], [`Subscriber::close`])
//! do wait, within the connection's timeout.
//!
//! [`Publisher::unpublish`] hides a buffer from new subscribers and waits
//! (with a timeout) until its last lease is released before handing the
//! buffer back to be freed. A subscriber that exits or is killed releases
//! its leases (the socket closes). If the publisher dies, the subscriber's
//! next call fails within a second with [`ChannelError::PeerGone`](crate::channel::ChannelError::PeerGone);
//! [`Subscriber::is_alive`] polls for it. A publisher that another process
//! follows on the same socket, from the same memory (the weight service
//! under its keeper, [`PublisherConfig::with_restarts`]), says so: its
//! subscribers connect again instead and take their leases back, their
//! mappings untouched ([`Subscriber::reconnect`], [`Reconnect`]).

mod attach;
mod attachment;
mod budget;
mod chunk_cache;
mod join;
mod lease;
mod link;
mod publisher;
mod publisher_config;
mod push;
mod reconnect;
mod reconnected;
mod ring;
mod ring_attach;
mod set;
mod set_attach;
mod set_attachment;
mod set_book;
mod set_commit;
mod set_order;
mod set_text;
mod sharing;
mod sleep;
mod slept;
mod subscriber;
mod subscriber_config;
mod sync;
mod waiting;
mod wire;

#[cfg(test)]
mod read_only_tests;

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use crate::channel;
use crate::error::Result;

pub use budget::MappingBudget;
pub use link::{READY_METHOD, RECONNECTED_METHOD, Reconnect};
pub use publisher::Publisher;
pub use publisher_config::PublisherConfig;
pub use push::{PUSH_LIMIT, Stream};
pub use reconnected::Reconnected;
pub use ring::{RingFrame, RingPublisher, RingSubscriber, RingSync};
pub use set_attachment::{EntryPlace, SetAttachment};
pub use set_book::{HIDDEN_ENTRY_PREFIX, TABLE_REF_MIN_BYTES, chunk_entry_name};
pub use set_text::SET_PART_BYTES;
pub use sharing::Sharing;
pub use slept::Slept;
pub use subscriber::{Attachment, Subscriber};
pub use subscriber_config::SubscriberConfig;
pub use sync::SyncMode;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Where the socket is: a name under the default socket directory
/// (`$XDG_RUNTIME_DIR/cuda-ipc/<name>.sock`) or an explicit path.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
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
