//! What the client hands out: its configuration, attachments, notices.

use std::os::fd::OwnedFd;
use std::time::Duration;

use serde_json::Value;

use crate::notices::{NoticePath, notice_path_from_env};
use crate::own_uid;
use crate::spin::{idle_tick_from_env, spin_from_env};

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
    /// [`DEFAULT_SPIN`]. A message that arrives within it is read without a
    /// wake-up of the waiting thread (5-10 µs on a busy machine, more from a
    /// deep idle state). It costs CPU only while a wait lasts, at most this
    /// long per wait; `Duration::ZERO` sleeps at once. The environment
    /// variable [`SPIN_ENV`] sets the default.
    pub spin: Duration,
    /// Whether to ask the server for notices (updates, ring frames) and
    /// acks through shared memory (see [`notices`](crate::notices));
    /// default from [`NOTICES_ENV`](crate::NOTICES_ENV), else
    /// [`NoticePath::Shm`]. The server may say no.
    pub notices: NoticePath,
    /// While a wait for a notice sleeps (after its spin), it wakes itself
    /// this often and looks again (`None`, the default: it sleeps until
    /// woken). On a virtual machine a processor idle for a millisecond or
    /// more can take 0.1 ms or longer to run a woken thread again, one
    /// idle a few tens of microseconds far less (`cuda-ipc info` measures
    /// it): a tick of a few tens of µs can shorten a waiting consumer's
    /// wake-up, at the cost of that many timer wake-ups a second while it
    /// waits (on one H200 machine a 50 µs tick shortened the bare wake-up
    /// after 1 ms idle by about a third and cost 7.8 % of a processor, and
    /// the bench's update rows did not move).
    /// Only notices through shared memory ([`NoticePath::Shm`]) tick. The
    /// environment variable [`IDLE_TICK_ENV`] sets the default.
    pub idle_tick: Option<Duration>,
}

/// How long a client polls for a message before it sleeps: about the
/// server's answer time to a request, so that replies and updates sent to
/// a consumer that is already waiting are taken without a wake-up.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);

/// The environment variable that sets the default spin in microseconds
/// (`0`: sleep at once), for programs that do not set it themselves.
pub const SPIN_ENV: &str = "CUDA_IPC_SPIN_US";

/// The environment variable that sets the default idle tick in
/// microseconds (see [`ClientConfig::idle_tick`]; `0` or unset: none).
pub const IDLE_TICK_ENV: &str = "CUDA_IPC_IDLE_TICK_US";

/// The default spin: [`SPIN_ENV`] if it holds only decimal digits, a
/// number of microseconds up to 10,000 (10 ms), else [`DEFAULT_SPIN`]
/// (with a warning saying why).
pub(crate) fn default_spin(env: Option<&str>) -> Duration {
    spin_from_env(SPIN_ENV, env, DEFAULT_SPIN)
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            timeout: Duration::from_secs(5),
            allowed_server_uids: vec![own_uid()],
            spin: default_spin(std::env::var(SPIN_ENV).ok().as_deref()),
            notices: notice_path_from_env(),
            idle_tick: idle_tick_from_env(
                IDLE_TICK_ENV,
                std::env::var(IDLE_TICK_ENV).ok().as_deref(),
            ),
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

    /// Sets the idle tick of a sleeping wait (see [`ClientConfig::idle_tick`]).
    #[must_use]
    pub fn with_idle_tick(mut self, tick: Option<Duration>) -> Self {
        self.idle_tick = tick;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spin_comes_from_the_environment_within_limits() {
        assert_eq!(default_spin(None), DEFAULT_SPIN);
        assert_eq!(default_spin(Some("0")), Duration::ZERO);
        assert_eq!(default_spin(Some(" 200 ")), Duration::from_micros(200));
        assert_eq!(default_spin(Some("10000")), Duration::from_millis(10));
        for bad in [
            "",
            "-1",
            "+5",
            "1.5",
            "lots",
            "10001",
            "1000000",
            "18446744073709551616",
        ] {
            assert_eq!(default_spin(Some(bad)), DEFAULT_SPIN, "{bad:?}");
        }
    }

    #[test]
    fn the_idle_tick_comes_from_the_environment_within_limits() {
        let tick = |env| idle_tick_from_env(IDLE_TICK_ENV, env);
        assert_eq!(tick(None), None);
        assert_eq!(tick(Some("0")), None);
        assert_eq!(tick(Some("")), None);
        assert_eq!(tick(Some(" 50 ")), Some(Duration::from_micros(50)));
        assert_eq!(tick(Some("10")), Some(Duration::from_micros(10)));
        assert_eq!(tick(Some("10000")), Some(Duration::from_millis(10)));
        for bad in [
            "9",
            "1",
            "-1",
            "+5",
            "1.5",
            "often",
            "10001",
            "18446744073709551616",
        ] {
            assert_eq!(tick(Some(bad)), None, "{bad:?}");
        }
    }
}
