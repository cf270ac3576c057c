//! The exchange channel: versioned messages over a Unix socket, with
//! file descriptors (`SCM_RIGHTS`), peer credentials, names, leases, updates
//! and rings. Independent of CUDA, so it is fully testable without a GPU.
//!
//! A producer binds a [`Server`] on a socket path and publishes named
//! entries: a JSON `meta` value plus up to [`MAX_FDS`] file descriptors. A
//! consumer connects a [`Client`], lists the entries, and attaches to one by
//! name; it receives the metadata and its own duplicates of the file
//! descriptors, and holds a *lease* until it releases it or its connection
//! ends (it exits, crashes or is killed). The producer can wait for every
//! lease on an entry to be released before it reuses or frees what the file
//! descriptors refer to, and push per-entry notices ([`Server::update`]).
//! A *ring* ([`Server::create_ring`]) is a fixed set of slots that the
//! producer fills in turn, with back-pressure: a slot is reused only when
//! every subscriber that was sent it has acknowledged it or gone away.
//! A server may also answer *calls* ([`Client::call`]: a method name and a
//! JSON body) through its [`CallHandler`], which sees the caller's
//! credentials; a service built on the channel (`cuda-ipc serve
//! --service`) speaks its admin protocol that way.
//!
//! # Layers
//! - [`wire`]: the wire format, pure functions (a 16-byte header and a
//!   UTF-8 JSON payload, together a *wire message*);
//! - `socket` (private): sending and receiving wire messages with file
//!   descriptors, with a deadline on every wait, and peer credentials;
//! - [`notices`]: the path notices and acks take, the socket or a
//!   shared-memory ring per connection (the default), and the order rule
//!   that keeps the two in step;
//! - [`server`] and [`client`]: the two ends.
//!
//! # Security
//! Both ends check the other's user id with `SO_PEERCRED` (the kernel's
//! record of who connected, which cannot be forged): the server against
//! [`ServerConfig::allowed_uids`], the client against
//! [`ClientConfig::allowed_server_uids`]; both default to the user we run
//! as. The socket file is created with mode `0600`, and
//! [`default_socket_dir`] is a directory only its owner can enter. File
//! descriptors are capabilities: only a process that passed the checks ever
//! receives one.
//!
//! # Namespaces (containers)
//! The two ends may live in different PID, IPC, mount, network and user
//! namespaces: they need only reach the same socket file (a shared volume
//! or a bind mount at any path) and the same kernel.
//! - PID: a peer whose PID namespace ours cannot see has pid 0 in
//!   [`Ucred`]; that is not an error. Whether the peer is alive comes from
//!   the connection (it closes when the peer exits), never from its pid.
//! - Users: the allowlists match the peer's uid as the kernel maps it into
//!   *our* user namespace. A peer in a user namespace whose uids map onto
//!   ours (a container's `uid_map`, `unshare --map-root-user`) shows the uid
//!   it has outside, so allow that one. A uid with no mapping into our
//!   namespace reads as the overflow uid (`/proc/sys/kernel/overflowuid`,
//!   normally 65534): allowing 65534 allows every peer whose user we cannot
//!   see, and a process in an unmapped user namespace is itself 65534 there,
//!   so its default allowlist accepts any such server. Map the uids instead.
//!
//! # Errors
//! Every fallible function returns [`ChannelError`]; it converts into the
//! `cuda_ipc::Error` with `?`.

#![deny(unsafe_code)]

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

pub mod client;
mod deadline;
mod limits;
pub mod notices;
mod paths;
pub mod server;
// `SO_PEERCRED` and `SIOCOUTQ`, which rustix does not wrap: the crate's only unsafe code.
#[allow(unsafe_code)]
mod socket;
mod spin;
pub mod wire;

pub use client::{
    Attachment, Client, ClientConfig, DEFAULT_SPIN, FrameNotice, Notice, NoticeStats, PushedEntry,
    RingAttachment, Update,
};
pub use deadline::deadline_in;
pub use limits::{
    MAX_ENTRY_NAME_LEN, MAX_META_BYTES, MAX_RING_SLOTS, UNLISTED_ENTRY_PREFIX, validate_entry_name,
};
pub use notices::{NOTICE_RING_BYTES, NoticePath};
pub use paths::{
    MAX_SOCKET_NAME_LEN, default_socket_dir, default_socket_path, ensure_private_dir,
    validate_socket_name,
};
pub use server::{
    CallContext, CallError, CallHandler, CpuBudget, DEFAULT_SERVER_SPIN, LatePolicy, LeaseEvent,
    LeaseInfo, PushReport, Replaced, Server, ServerConfig, ServerRing, StallBudget,
};
pub use socket::{Ucred, peer_credentials};
pub use wire::{
    EntryKind, ListedEntry, MAX_FDS, MAX_PAYLOAD, Message, Meta, PUSHED_KEY, WireError,
};

/// What went wrong, in the classes a caller acts on (see [`ChannelError::kind`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ChannelErrorKind {
    /// The caller's input or the peer's message was malformed or not allowed
    /// (a name, an argument, a message, a request the state does not allow).
    InvalidInput,
    /// The other process is gone, or refused us, or reported an error.
    Peer,
    /// A wait ran out of time.
    Timeout,
    /// A system call failed, or the server cannot serve.
    Failed,
}

/// Which end of a connection refused the other (see [`ChannelError::Refused`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Side {
    /// The server refused this client: the client's user id is not in
    /// [`ServerConfig::allowed_uids`].
    Server,
    /// This client refused the server: the server's user id is not in
    /// [`ClientConfig::allowed_server_uids`].
    Client,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Server => "server",
            Side::Client => "client",
        })
    }
}

/// Errors of the exchange channel.
///
/// Messages are sentences that say what happened and what to do. After
/// [`PeerGone`](Self::PeerGone), [`Protocol`](Self::Protocol) and
/// [`Wire`](Self::Wire) errors the connection is closed; a
/// [`Timeout`](Self::Timeout) leaves it usable.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChannelError {
    /// A system call failed.
    #[error("{context}: {source}")]
    Io {
        /// What we were doing, as a sentence fragment.
        context: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// The peer closed the connection or died.
    #[error(
        "the peer closed the connection (it exited, was killed, or dropped its end); \
         reconnect once it is back"
    )]
    PeerGone,

    /// A wait ran out of time.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout {
        /// What we were waiting for.
        what: String,
        /// How long we waited.
        after: Duration,
    },

    /// The peer runs as a user that is not allowed.
    #[error("{}", refused_text(*by, *uid, allowed))]
    Refused {
        /// Which end refused the connection.
        by: Side,
        /// The refused user id: ours when the server refused us, the
        /// server's when we refused it.
        uid: u32,
        /// The user ids the refusing end accepts.
        allowed: Vec<u32>,
    },

    /// The peer broke the protocol (an unexpected message, a failed
    /// handshake, a request the state does not allow).
    #[error("protocol violation: {reason}")]
    Protocol {
        /// What was wrong.
        reason: String,
    },

    /// A message on the wire was malformed (see [`WireError`]).
    #[error("malformed message on the wire: {0}")]
    Wire(#[from] WireError),

    /// The other side answered with an error message.
    #[error("the other side reported an error ({code}): {message}")]
    Remote {
        /// A machine-readable code, for example `"wrong_kind"`.
        code: String,
        /// The other side's explanation.
        message: String,
    },

    /// No entry of that name is published.
    #[error(
        "no entry named {name:?} is published; list the published entries (Client::list) \
         and check the name, or start the producer first"
    )]
    NotFound {
        /// The name that was asked for.
        name: String,
    },

    /// An entry of that name is already published.
    #[error(
        "an entry named {name:?} is already published; unpublish it first or choose another name"
    )]
    AlreadyExists {
        /// The name.
        name: String,
    },

    /// A name is not acceptable.
    #[error("invalid name {name:?}: {reason}")]
    InvalidName {
        /// The name as given.
        name: String,
        /// What is wrong and what is accepted.
        reason: String,
    },

    /// An argument is out of its domain.
    #[error("invalid {what}: {reason}")]
    InvalidArgument {
        /// The argument, for example "slot".
        what: &'static str,
        /// What is wrong and what is accepted.
        reason: String,
    },

    /// A socket directory is not private to us.
    #[error("refusing to use the socket directory {}: {reason}", path.display())]
    InsecureDirectory {
        /// The directory.
        path: PathBuf,
        /// What is wrong with it and how to fix it.
        reason: String,
    },

    /// Another server is listening on the socket path.
    #[error(
        "another publisher is serving {}; stop it first or choose another socket path",
        path.display()
    )]
    Busy {
        /// The socket path.
        path: PathBuf,
    },

    /// The producer unpublished a ring this client subscribes to.
    #[error(
        "the producer unpublished {name:?} (lease {lease}); release the lease and attach \
         again once it is published anew"
    )]
    Unpublished {
        /// The ring's name.
        name: String,
        /// The lease that ended.
        lease: u64,
    },

    /// This process ran out of file descriptors (`EMFILE`) while
    /// receiving an answer's descriptors: the kernel dropped them. The
    /// connection is still usable.
    #[error(
        "this process has run out of file descriptors (EMFILE: its open-file limit, ulimit -n, \
         is {limit}), so the kernel could not give it the {expected} descriptor(s) of the \
         server's {kind:?} answer; close descriptors this process no longer uses or raise the \
         limit, then try again (the connection is still usable)"
    )]
    OutOfDescriptors {
        /// The answer whose descriptors were lost.
        kind: &'static str,
        /// How many descriptors it carried.
        expected: usize,
        /// This process's soft `RLIMIT_NOFILE`.
        limit: String,
    },

    /// The producer ended this ring subscription: the subscriber did not
    /// ack in time, or the producer evicted it.
    #[error("ring {name:?} (lease {lease}) ended for this subscriber: {reason}")]
    Evicted {
        /// The ring's name.
        name: String,
        /// The subscription's lease, which is over.
        lease: u64,
        /// The producer's reason.
        reason: String,
    },

    /// The producer skipped this ring subscriber for acking late: frames up
    /// to `stale_through` were withdrawn (their slots may be refilled), and
    /// the next frame published is delivered as usual.
    #[error(
        "ring {name:?} (lease {lease}) skipped this subscriber: {reason}; frames up to \
         {stale_through} were withdrawn, take the next one (and ack each frame within the \
         producer's deadline)"
    )]
    Lagged {
        /// The ring's name.
        name: String,
        /// The subscription's lease, which goes on.
        lease: u64,
        /// The last withdrawn frame.
        stale_through: u64,
        /// The producer's reason.
        reason: String,
    },

    /// The server was shut down.
    #[error("the channel server has been shut down; bind a new one to publish again")]
    ShutDown,
}

fn refused_text(by: Side, uid: u32, allowed: &[u32]) -> String {
    match by {
        Side::Server => format!(
            "the server refused this connection: this process runs as uid {uid}, which is not \
             among the server's allowed uids {allowed:?}; add it to ServerConfig::allowed_uids \
             in the producer"
        ),
        Side::Client => format!(
            "refusing to talk to the server: it runs as uid {uid}, which is not among \
             ClientConfig::allowed_server_uids {allowed:?}; add it if you trust that user \
             (otherwise another user may have put a socket at this path)"
        ),
    }
}

impl ChannelError {
    /// The class of this error.
    pub fn kind(&self) -> ChannelErrorKind {
        match self {
            ChannelError::PeerGone
            | ChannelError::Refused { .. }
            | ChannelError::Remote { .. }
            | ChannelError::Unpublished { .. }
            | ChannelError::Evicted { .. }
            | ChannelError::Lagged { .. } => ChannelErrorKind::Peer,
            ChannelError::Timeout { .. } => ChannelErrorKind::Timeout,
            ChannelError::Protocol { .. }
            | ChannelError::Wire(_)
            | ChannelError::InvalidName { .. }
            | ChannelError::InvalidArgument { .. }
            | ChannelError::NotFound { .. }
            | ChannelError::AlreadyExists { .. } => ChannelErrorKind::InvalidInput,
            ChannelError::Io { .. }
            | ChannelError::InsecureDirectory { .. }
            | ChannelError::Busy { .. }
            | ChannelError::OutOfDescriptors { .. }
            | ChannelError::ShutDown => ChannelErrorKind::Failed,
        }
    }

    /// An I/O error with a sentence of context.
    pub(crate) fn io(context: impl Into<String>, source: impl Into<std::io::Error>) -> Self {
        ChannelError::Io {
            context: context.into(),
            source: source.into(),
        }
    }

    /// A protocol violation.
    pub(crate) fn protocol(reason: impl Into<String>) -> Self {
        ChannelError::Protocol {
            reason: reason.into(),
        }
    }

    /// An invalid argument.
    pub(crate) fn arg(what: &'static str, reason: impl Into<String>) -> Self {
        ChannelError::InvalidArgument {
            what,
            reason: reason.into(),
        }
    }
}

/// Locks a mutex, ignoring poisoning: every critical section in this module
/// leaves its state consistent before anything that could panic, so the
/// data behind a poisoned lock is still valid, and the channel must keep
/// serving (and `Drop` must not panic) after a panic in another thread.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The effective user id of this process, which is what `SO_PEERCRED`
/// reports to our peers.
pub(crate) fn own_uid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// The id of this process.
pub(crate) fn own_pid() -> u32 {
    rustix::process::getpid().as_raw_nonzero().get() as u32
}
