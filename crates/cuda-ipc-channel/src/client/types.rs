//! What the client hands out: its configuration, attachments, notices.

use std::os::fd::OwnedFd;
use std::time::Duration;

use serde_json::Value;

use crate::notices::NoticePath;
use crate::own_uid;

/// How a [`Client`](super::Client) connects.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ClientConfig {
    /// How long a request may take, and how long [`Client::connect`](super::Client::connect) may
    /// take; default 5 s.
    pub timeout: Duration,
    /// The user ids the server may run as (`SO_PEERCRED`); default: only ours.
    pub allowed_server_uids: Vec<u32>,
    /// How long a wait for the server's answer or an update first polls the
    /// socket without sleeping, before it sleeps in `poll(2)` (ring frames,
    /// which come in streams, are waited for without a spin, but by
    /// [`Client::next_frame_spinning`](super::Client::next_frame_spinning)); default
    /// [`DEFAULT_SPIN`] (50 µs). A message that arrives within it is read
    /// without a wake-up of the waiting thread (5-10 µs on a busy machine,
    /// more from a deep idle state). It costs CPU only while a wait lasts,
    /// at most this long per wait; `Duration::ZERO` sleeps at once. This is
    /// the only place it is set: the library reads no environment variable
    /// for it (a program that wants one reads it and calls
    /// [`ClientConfig::with_spin`]).
    pub spin: Duration,
    /// How notices and acks travel; default [`NoticePath::Shm`]: through
    /// shared memory (see [`notices`](crate::notices)) when the server
    /// grants it, else on the socket, which is also where a notice goes that
    /// does not fit in the ring. [`NoticePath::Socket`] does not ask, so
    /// everything takes the socket: the fallback path, for tests and
    /// comparisons.
    pub notices: NoticePath,
}

/// How long a client polls for a message before it sleeps: about the
/// server's answer time to a request, so that replies and updates sent to
/// a consumer that is already waiting are taken without a wake-up.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            timeout: Duration::from_secs(5),
            allowed_server_uids: vec![own_uid()],
            spin: DEFAULT_SPIN,
            notices: NoticePath::Shm,
        }
    }
}

impl ClientConfig {
    /// Sets how long a request (and [`Client::connect`](super::Client::connect)) may take.
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets how long a wait polls before it sleeps (see [`ClientConfig::spin`]).
    #[must_use]
    pub fn with_spin(mut self, spin: Duration) -> Self {
        self.spin = spin;
        self
    }

    /// Sets how notices and acks travel (see [`ClientConfig::notices`]).
    #[must_use]
    pub fn with_notices(mut self, path: NoticePath) -> Self {
        self.notices = path;
        self
    }

    /// Sets the user ids the server may run as (replacing the default, ours).
    #[must_use]
    pub fn with_allowed_server_uids(mut self, uids: impl IntoIterator<Item = u32>) -> Self {
        self.allowed_server_uids = uids.into_iter().collect();
        self
    }
}

/// Which path a client's notices and acks took (see
/// [`Client::notice_stats`](super::Client::notice_stats)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct NoticeStats {
    /// The path agreed in the handshake.
    pub path: NoticePath,
    /// Notices (updates, ring frames, unpublished and late notices)
    /// received through shared memory.
    pub shm_notices: u64,
    /// Notices received on the socket (all of them on the socket path; on
    /// the shared-memory path, those that did not fit in the ring).
    pub socket_notices: u64,
    /// Acks sent through shared memory.
    pub shm_acks: u64,
    /// Acks sent on the socket.
    pub socket_acks: u64,
    /// Requests (pings, attaches, releases) sent through shared memory,
    /// when the server granted it (the others went on the socket).
    pub shm_requests: u64,
    /// Answers received through shared memory.
    pub shm_replies: u64,
}

/// A lease on a plain entry, with the entry's metadata and descriptors.
///
/// Layers: this is the channel's view, raw descriptors and JSON (no CUDA).
/// The core's `cuda_ipc::exchange::Attachment<T>` is made from one: it
/// imports the descriptors and holds the mapped buffer and this lease.
#[derive(Debug)]
#[non_exhaustive]
pub struct Attachment {
    /// The lease id; pass it to [`Client::release`](super::Client::release).
    pub lease: u64,
    /// The entry's name.
    pub name: String,
    /// The producer's metadata.
    pub meta: Value,
    /// This process's own duplicates of the entry's descriptors.
    pub fds: Vec<OwnedFd>,
}

/// A subscription to a ring, with every slot's metadata and descriptors.
///
/// Layers: this is the channel's view, raw descriptors and JSON (no CUDA);
/// the name pairs it with [`Attachment`]. The core's
/// `cuda_ipc::exchange::RingSubscriber<T>` is made from one: it maps every
/// slot and holds this lease.
#[derive(Debug)]
#[non_exhaustive]
pub struct RingAttachment {
    /// The lease id; pass it to [`Client::next_frame`](super::Client::next_frame), [`Client::ack`](super::Client::ack)
    /// and [`Client::release`](super::Client::release).
    pub lease: u64,
    /// The ring's name.
    pub name: String,
    /// The ring's metadata.
    pub meta: Value,
    /// Each slot's metadata and descriptors, by slot index (so
    /// `slots.len()` is the ring's slot count).
    pub slots: Vec<(Value, Vec<OwnedFd>)>,
}

/// What happened to an entry the client holds a lease on.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Notice {
    /// The producer called [`Server::update`](crate::Server::update).
    Updated {
        /// The entry's version: its update counter, from 1, without gaps
        /// (not an allocation's generation, which is its identity).
        version: u64,
        /// The producer's notice.
        data: Value,
    },
    /// The producer unpublished the entry. The lease stays valid (the
    /// producer keeps the entry until it is released); release it when done.
    Unpublished,
}

/// A notice about a leased entry (see [`Client::next_update`](super::Client::next_update)).
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Update {
    /// The lease it concerns.
    pub lease: u64,
    /// The entry's name.
    pub name: String,
    /// What happened.
    pub notice: Notice,
}

/// The notice that the producer filled ring slot `slot` (see
/// [`Client::next_frame`](super::Client::next_frame)): the ring's
/// counterpart of [`Update`]. It carries no memory; the core's
/// `cuda_ipc::exchange::RingFrame` is the mapped frame built from it.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct FrameNotice {
    /// The ring lease.
    pub lease: u64,
    /// The slot the producer filled.
    pub slot: u32,
    /// The ring's frame counter, from 1.
    pub seq: u64,
    /// The producer's notice.
    pub notice: Value,
}
