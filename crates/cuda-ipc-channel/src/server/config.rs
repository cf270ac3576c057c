//! How a server is set up: [`ServerConfig`].

use std::path::PathBuf;
use std::time::Duration;

use crate::notices::NoticePath;

/// How long a connection's reader polls for the client's next message
/// after one it received, before it sleeps (see [`ServerConfig::spin`]).
pub const DEFAULT_SERVER_SPIN: Duration = Duration::from_micros(50);

use crate::own_uid;
use crate::wire::MAX_FDS;

use super::{CallHandler, CpuBudget};

#[allow(unused_imports)] // for the documentation's links
use super::Server;

/// How a [`Server`] is set up.
///
/// Build it with [`ServerConfig::new`] (there is no `Default`: the socket
/// path has none) and change what you need with the setters:
/// `ServerConfig::new(path).with_allowed_uids([1000, 1001])`.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ServerConfig {
    /// The socket path (see [`default_socket_path`](crate::default_socket_path)).
    pub path: PathBuf,
    /// The user ids allowed to connect (`SO_PEERCRED`); default: only ours.
    pub allowed_uids: Vec<u32>,
    /// How long a new connection has to send its `hello`; default 5 s.
    pub handshake_timeout: Duration,
    /// How long a client may leave a message unread before it is
    /// disconnected; default 5 s.
    pub send_timeout: Duration,
    /// The most connections served at once; default 256. A connection
    /// that ended while descriptors we sent it were still unread counts
    /// until its process reads them or closes its socket (the kernel
    /// charges them to our user until then).
    pub max_connections: usize,
    /// How many of [`max_connections`](Self::max_connections) are kept for
    /// the server's own user: other users together get at most the rest;
    /// default 32.
    pub reserved_connections: usize,
    /// The most messages queued for one client before it is disconnected as
    /// stuck; default 4096. (A new ring subscriber's slot messages are not
    /// queued: they are made one at a time as it reads them.)
    pub max_queued_frames: usize,
    /// The most bytes of replies and notices queued for one client before
    /// it is disconnected as stuck; default 16 MiB. (A client that does not
    /// read stops being served new requests long before: its requests wait
    /// while 64 KiB of answers wait for it.)
    pub max_queued_bytes: usize,
    /// The most descriptors sent to one client that it has not received
    /// yet; default and minimum [`MAX_FDS`] (one answer's worth).
    /// Descriptors in flight count against the sending user's open-file
    /// limit (`RLIMIT_NOFILE`) in the kernel, so this is what keeps clients
    /// that do not read from exhausting it: at most this many per
    /// connection, connections that ended with descriptors unread
    /// included, so at most this times
    /// [`max_connections`](Self::max_connections) in all (4,096 at the
    /// defaults). [`Server::bind`] raises the soft limit to carry that, or
    /// refuses a configuration the hard limit cannot carry.
    pub max_unread_fds: usize,
    /// The most connections of one user id at once; default 128. At this
    /// limit (and at [`max_connections`](Self::max_connections)), the
    /// oldest connection of the user with the most connections that holds
    /// no lease, has nothing in transit and was silent for a second is
    /// closed with an `evicted` error to make room, so that idle
    /// connections cannot lock anyone out.
    pub max_connections_per_uid: usize,
    /// The most connections of one process at once; default 64.
    pub max_connections_per_pid: usize,
    /// A connection that holds no lease and sends nothing for this long is
    /// closed; default 15 minutes (long enough for a consumer that connects
    /// early and attaches once its producer is ready, or between the
    /// sections of a long benchmark). It frees what abandoned connections
    /// hold; the per-uid and per-pid limits are what keep idle connections
    /// from locking others out. Once a message has begun it must end
    /// within 5 s of its first byte, whatever this timeout.
    pub idle_timeout: Duration,
    /// The most leases (entry leases and ring subscriptions) one connection
    /// may hold; default 1024.
    pub max_leases_per_connection: usize,
    /// The longest request payload accepted, in bytes; default 4 KiB (the
    /// longest valid request, an attach with a 256-byte name, is about 300).
    pub max_request_bytes: u32,
    /// How notices and acks travel to clients that ask for shared memory
    /// (see [`notices`](crate::notices)); default [`NoticePath::Shm`]:
    /// through the rings when the client asks and they can be set up, else
    /// on the socket (the automatic fallback, which also takes a notice
    /// that does not fit). [`NoticePath::Socket`] grants no client the
    /// rings: the fallback path for every connection, for tests and
    /// comparisons.
    pub notices: NoticePath,
    /// How long a connection's reader thread polls for the client's next
    /// request (or ack) after it received one, before it sleeps in
    /// `poll(2)`; default [`DEFAULT_SERVER_SPIN`] (50 µs; this field is the
    /// only place it is set: the library reads no environment variable for
    /// it). A request that comes within it is
    /// answered without a wake-up of the reader (a request that follows
    /// another, such as the attach after a release). The spin follows
    /// only a received message: a connection that sends nothing costs no
    /// CPU, and each message the client sends costs at most this long of
    /// busy waiting. After three spins in a row that caught nothing, the
    /// reader sleeps at once for the next 1, 3, 7, ... up to 63 waits, so a
    /// client whose messages come far apart (or that shares the reader's
    /// core and cannot run while it spins) soon costs at most one spin in
    /// 64 messages; a spin that catches a message turns it back on. No
    /// more readers spin at once than a quarter of the machine's cores
    /// (at least one); a reader that finds them all spinning sleeps at
    /// once, so however many connections clients open and however they
    /// time their messages, the readers' spins take at most that many
    /// cores.
    /// The same spin, with its own back-off, is how long
    /// [`ServerRing::acquire`](crate::ServerRing::acquire) waits for an
    /// ack before it sleeps (on the producer's thread, at most once per
    /// call). `Duration::ZERO` sleeps at once, as before this setting
    /// existed.
    pub spin: Duration,
    /// How much of the server's processor time the connections of one
    /// user other than the server's own may take (see [`CpuBudget`]);
    /// default [`CpuBudget::DEFAULT`], a quarter of one core. `None`
    /// charges nobody: only where every allowed user is trusted. The
    /// server's own user is never charged.
    pub peer_cpu_budget: Option<CpuBudget>,
    /// Answers clients' calls ([`Message::Call`](crate::Message::Call));
    /// default none: every call is refused with the error `no_handler`.
    /// See also [`Server::set_call_handler`].
    pub call_handler: Option<CallHandler>,
    /// A listening socket to serve on instead of binding a new one (see
    /// [`ServerConfig::with_listener`]).
    pub listener: Option<std::sync::Arc<std::os::fd::OwnedFd>>,
    /// Whether the server tells clients that another process serves this
    /// socket after this one ends, with what it published (a keeper holds
    /// the listening socket and the state: the weight service under its
    /// keeper); default `false`. Clients read it with
    /// [`Client::server_restarts`](crate::Client::server_restarts) and may
    /// connect again after this process is gone instead of giving up.
    pub restarts: bool,
    /// Whether the server accepts no connection until
    /// [`Server::start_accepting`](super::Server::start_accepting); default
    /// `false`. Clients that connect meanwhile wait in the listening
    /// socket's backlog (up to their timeout): for a server that must
    /// publish what it serves first (the weight service taking back what
    /// it kept through a restart), so that no client finds it half ready.
    pub accept_held: bool,
}

impl ServerConfig {
    /// The default configuration for a socket at `path`.
    pub fn new(path: impl Into<PathBuf>) -> ServerConfig {
        ServerConfig {
            path: path.into(),
            allowed_uids: vec![own_uid()],
            handshake_timeout: Duration::from_secs(5),
            send_timeout: Duration::from_secs(5),
            max_connections: 256,
            reserved_connections: 32,
            max_queued_frames: 4096,
            max_queued_bytes: 16 << 20,
            max_unread_fds: MAX_FDS,
            max_connections_per_uid: 128,
            max_connections_per_pid: 64,
            idle_timeout: Duration::from_secs(15 * 60),
            max_leases_per_connection: 1024,
            max_request_bytes: 4096,
            notices: NoticePath::Shm,
            spin: DEFAULT_SERVER_SPIN,
            peer_cpu_budget: Some(CpuBudget::DEFAULT),
            call_handler: None,
            listener: None,
            restarts: false,
            accept_held: false,
        }
    }

    /// Serves on `listener`, a listening Unix stream socket already bound
    /// at the configured path (from [`Server::listener`] of a process
    /// before, kept by a keeper or systemd), instead of binding a new
    /// one: connections made while no process served wait in its backlog.
    /// Checked at [`Server::bind`]: a socket bound elsewhere, or not
    /// listening, is refused.
    #[must_use]
    pub fn with_listener(mut self, listener: std::os::fd::OwnedFd) -> Self {
        self.listener = Some(std::sync::Arc::new(listener));
        self
    }

    /// Tells clients that another process serves this socket after this
    /// one ends (see [`ServerConfig::restarts`]).
    #[must_use]
    pub fn with_restarts(mut self, on: bool) -> Self {
        self.restarts = on;
        self
    }

    /// Accepts no connection until [`Server::start_accepting`](super::Server::start_accepting)
    /// (see [`ServerConfig::accept_held`]).
    #[must_use]
    pub fn with_accept_held(mut self, on: bool) -> Self {
        self.accept_held = on;
        self
    }

    /// Sets the most bytes queued for one client before it is disconnected.
    #[must_use]
    pub fn with_max_queued_bytes(mut self, n: usize) -> Self {
        self.max_queued_bytes = n;
        self
    }

    /// Sets the most descriptors in flight to one client (at least
    /// [`MAX_FDS`] is used).
    #[must_use]
    pub fn with_max_unread_fds(mut self, n: usize) -> Self {
        self.max_unread_fds = n;
        self
    }

    /// Sets the most connections of one user id.
    #[must_use]
    pub fn with_max_connections_per_uid(mut self, n: usize) -> Self {
        self.max_connections_per_uid = n;
        self
    }

    /// Sets the most connections of one process.
    #[must_use]
    pub fn with_max_connections_per_pid(mut self, n: usize) -> Self {
        self.max_connections_per_pid = n;
        self
    }

    /// Sets how long a connection without leases may stay silent.
    #[must_use]
    pub fn with_idle_timeout(mut self, timeout: Duration) -> Self {
        self.idle_timeout = timeout;
        self
    }

    /// Sets the most leases one connection may hold.
    #[must_use]
    pub fn with_max_leases_per_connection(mut self, n: usize) -> Self {
        self.max_leases_per_connection = n;
        self
    }

    /// Sets the longest request payload accepted (at most
    /// [`MAX_PAYLOAD`](crate::wire::MAX_PAYLOAD)).
    #[must_use]
    pub fn with_max_request_bytes(mut self, n: u32) -> Self {
        self.max_request_bytes = n;
        self
    }

    /// Sets the user ids allowed to connect (replacing the default, ours).
    #[must_use]
    pub fn with_allowed_uids(mut self, uids: impl IntoIterator<Item = u32>) -> Self {
        self.allowed_uids = uids.into_iter().collect();
        self
    }

    /// Sets how long a new connection has to send its `hello`.
    #[must_use]
    pub fn with_handshake_timeout(mut self, timeout: Duration) -> Self {
        self.handshake_timeout = timeout;
        self
    }

    /// Sets how long a client may leave a reply unread before it is
    /// disconnected.
    #[must_use]
    pub fn with_send_timeout(mut self, timeout: Duration) -> Self {
        self.send_timeout = timeout;
        self
    }

    /// Sets how many connections are kept for the server's own user.
    #[must_use]
    pub fn with_reserved_connections(mut self, n: usize) -> Self {
        self.reserved_connections = n;
        self
    }

    /// Sets the most connections served at once.
    #[must_use]
    pub fn with_max_connections(mut self, n: usize) -> Self {
        self.max_connections = n;
        self
    }

    /// Sets the handler that answers calls (see [`CallHandler`]).
    #[must_use]
    pub fn with_call_handler(mut self, handler: CallHandler) -> Self {
        self.call_handler = Some(handler);
        self
    }

    /// Sets the most replies queued for one client before it is
    /// disconnected as stuck.
    #[must_use]
    pub fn with_max_queued_frames(mut self, n: usize) -> Self {
        self.max_queued_frames = n;
        self
    }

    /// Sets how long a connection's reader polls for the next request
    /// before it sleeps (see [`ServerConfig::spin`]).
    #[must_use]
    pub fn with_spin(mut self, spin: Duration) -> Self {
        self.spin = spin;
        self
    }

    /// Sets how much processor time one other user's connections may take
    /// (see [`ServerConfig::peer_cpu_budget`]).
    #[must_use]
    pub fn with_peer_cpu_budget(mut self, budget: Option<CpuBudget>) -> Self {
        self.peer_cpu_budget = budget;
        self
    }

    /// Sets how notices and acks travel (see [`ServerConfig::notices`]).
    #[must_use]
    pub fn with_notices(mut self, path: NoticePath) -> Self {
        self.notices = path;
        self
    }
}
