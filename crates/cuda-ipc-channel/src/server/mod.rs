//! The producer's end: a Unix socket server that publishes named entries,
//! hands out leases, pushes updates and runs rings.
//!
//! # Threads
//! [`Server::bind`] starts one accept thread. Each admitted connection gets
//! a reader thread, which answers requests, and a writer thread, the only
//! one that writes to the socket: requests, [`Server::update`] and
//! [`ServerRing::publish`] only queue frames for it, so a slow or stuck
//! client never blocks the producer or other clients. A client that leaves
//! more than [`ServerConfig::max_queued_frames`] messages unread, or does not
//! read for [`ServerConfig::send_timeout`], is disconnected.
//! Notices to a client that asked for shared memory go into its ring
//! instead, from the calling thread, when nothing waits for the socket
//! (see [`notices`](crate::notices)); its reader thread polls the socket
//! and the wake-up socket of the client's ack ring together. After each message
//! it receives, a reader polls without sleeping for up to
//! [`ServerConfig::spin`] (50 µs by default, backing off when its spins
//! catch nothing), so that a request following closely is answered
//! without a thread wake-up.
//!
//! # Leases
//! A lease is held by a connection. When the connection ends for any reason
//! (release, close, crash, `SIGKILL`, a malformed message), all its leases and
//! ring subscriptions end at once and waiters
//! ([`Server::wait_released`], [`ServerRing::acquire`]) wake up.
//!
//! # File descriptors
//! [`Server::publish`] and [`Server::create_ring`] take ownership of the
//! descriptors. Every attach sends the client duplicates (`dup`), queued
//! with the message and closed once the message is sent; the kernel gives the
//! client its own descriptors for the same open files. The originals are
//! closed when the entry is gone: unpublished and its last lease released,
//! or the server shut down.

use std::collections::BTreeSet;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::event::{EventfdFlags, eventfd};
use rustix::net::{SocketAddrUnix, listen};
use serde_json::Value;

use super::limits::{MAX_RING_SLOTS, validate_entry_name};
use super::socket::RecvLimits;
use super::wire::{EntryKind, MAX_FDS, MAX_PAYLOAD, Message, Meta};
use super::{ChannelError, lock, own_pid};

/// A listing page stops growing at about this many bytes.
const LISTING_PAGE_BYTES: usize = 512 * 1024;

/// How long a refused or turned-away peer gets to take its error message.
const REFUSE_SEND_TIMEOUT: Duration = Duration::from_millis(200);

/// The longest a closing connection may take to send its final error message.
const FINAL_SEND_TIMEOUT: Duration = Duration::from_secs(1);

/// A connection's reader takes no new request while this many messages wait
/// to be sent to it: a client that sends requests without reading the
/// answers slows down instead of making the server queue (and hold the
/// duplicated descriptors of) an unbounded number of answers.
const RESPONSE_WINDOW: usize = 64;

/// The backlog of the listening socket.
const LISTEN_BACKLOG: i32 = 128;

/// The longest path a Unix socket address holds (`sun_path` less its NUL).
const MAX_SOCKET_PATH: usize = 107;

/// One lease, as [`Server::leases`] reports it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct LeaseInfo {
    /// The lease id.
    pub lease: u64,
    /// The id of the entry or ring it holds (as [`Replaced::old_entry`]
    /// names one: an entry replaced under the same name has its own).
    pub entry: u64,
    /// The entry's or ring's name.
    pub name: String,
    /// Whether the lease is on a plain entry or a ring.
    pub kind: EntryKind,
    /// The holder's process id (`SO_PEERCRED`), or 0 when the holder runs
    /// in a PID namespace this server cannot see (a container).
    pub pid: u32,
    /// The holder's user id (`SO_PEERCRED`).
    pub uid: u32,
    /// The holder's connection ([`CallContext::connection`] of its calls).
    pub connection: u64,
}

/// `n` copies of `value`: clones first, the value itself last.
fn copies<T: Clone>(value: T, n: usize) -> impl Iterator<Item = T> {
    let mut value = Some(value);
    (0..n).filter_map(move |i| {
        if i + 1 == n {
            value.take()
        } else {
            value.clone()
        }
    })
}

impl Server {
    /// Sends `notice` as version `version` of entry `name` to every
    /// `(lease, connection)` of `holders` (never blocking on a client).
    fn send_updates<C: AsRef<Conn>>(
        &self,
        holders: &[(u64, C)],
        name: &str,
        version: u64,
        notice: Value,
    ) {
        for ((lease, conn), notice) in holders.iter().zip(copies(notice, holders.len())) {
            conn.as_ref().push(
                Message::Update {
                    lease: *lease,
                    name: name.into(),
                    version,
                    notice,
                },
                Vec::new(),
                self.shared.max_queued,
            );
        }
    }
}

/// The error message for a request or a connection.
fn error_frame(id: Option<u64>, code: &str, message: impl Into<String>) -> Message {
    Message::Error {
        id,
        code: code.into(),
        message: message.into(),
        details: Value::Null,
    }
}

mod accept;
mod call;
mod checks;
mod config;
mod conn;
mod listen;
mod push;
mod replace;
mod ring;
#[cfg(test)]
mod ring_tests;
mod session;
mod stall;
mod state;

use accept::{LogLimit, accept_loop};
pub use call::{
    CallContext, CallError, CallFn, CallHandler, ClosedFn, MAX_METHOD_LEN, validate_method,
};
use checks::{bound_socket, check_config, check_fds, encoded_meta, json_size};
pub use config::{DEFAULT_SERVER_SPIN, ServerConfig};
use conn::Conn;
use conn::SlotSource;
pub use push::PushReport;
pub use replace::Replaced;
pub use ring::ServerRing;
pub use stall::{CpuBudget, StallBudget};
use state::{Body, Entry, Ring, State};
pub use state::{LatePolicy, LeaseEvent, LeaseFn};

struct Shared {
    path: PathBuf,
    allowed_uids: Vec<u32>,
    handshake_timeout: Duration,
    send_timeout: Duration,
    max_connections: usize,
    reserved: usize,
    max_queued: usize,
    max_queued_bytes: usize,
    max_unread_fds: usize,
    max_per_uid: usize,
    max_per_pid: usize,
    idle_timeout: Duration,
    max_leases: usize,
    recv_limits: RecvLimits,
    /// Whether clients that ask get notices through shared memory.
    notices: crate::NoticePath,
    /// How long a reader polls after a message before it sleeps.
    spin: Duration,
    /// How many readers may spin at once.
    spinners: crate::spin::Spinners,
    pid: u32,
    /// Whether the welcome says another process serves after this one.
    restarts: bool,
    /// Our user id: its connections are never charged, and spin first.
    uid: u32,
    state: Mutex<State>,
    /// Signalled whenever a lease ends, a slot is acked, or an entry is
    /// unpublished, and at shutdown.
    changed: Condvar,
    /// Acks that freed a subscriber's hold on a slot, counted: what a
    /// producer's [`ServerRing::acquire`] spins on before it waits on
    /// `changed`.
    acks: std::sync::atomic::AtomicU64,
    /// Wakes the accept thread at shutdown and when it may start
    /// accepting.
    wake: OwnedFd,
    /// False until [`Server::start_accepting`] where the configuration
    /// holds the accepts back.
    accepting: std::sync::atomic::AtomicBool,
    /// The connection threads, joined at shutdown.
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// Log lines about refused, turned-away and evicted connections: at
    /// most one a second each.
    refusal_log: LogLimit,
    busy_log: LogLimit,
    evict_log: LogLimit,
    /// Answers [`Message::Call`]s (`None`: every call is refused).
    call_handler: Mutex<Option<CallHandler>>,
    /// What other users' connections may take of the processor, and each
    /// such user's account.
    peer_cpu: Option<CpuBudget>,
    cpu_accounts: Mutex<std::collections::HashMap<u32, Arc<Mutex<stall::Bucket>>>>,
}

impl Shared {
    /// The meter of a connection of user `uid`, if its processor time is
    /// charged (a user other than ours, with a budget set).
    fn cpu_meter(&self, uid: u32) -> Option<stall::CpuMeter> {
        let budget = self.peer_cpu.filter(|_| uid != self.uid)?;
        let account = Arc::clone(lock(&self.cpu_accounts).entry(uid).or_insert_with(|| {
            Arc::new(Mutex::new(stall::Bucket::full(
                budget.burst,
                Instant::now(),
            )))
        }));
        Some(stall::CpuMeter::new(budget, account))
    }
}

/// A channel server: the producer's end.
///
/// Bind it to a socket path, publish entries and rings, and drop it (or call
/// [`shutdown`](Self::shutdown)) to stop serving: threads stop, connections
/// close, the socket file is removed, and the descriptors of every entry are
/// closed. `Server` is `Send` and `Sync`; share it with `Arc` to publish from
/// several threads.
///
/// ```no_run
/// use cuda_ipc_channel::{Server, ServerConfig};
/// # fn main() -> Result<(), cuda_ipc_channel::ChannelError> {
/// let path = cuda_ipc_channel::default_socket_path("demo")?;
/// let server = Server::bind(ServerConfig::new(path))?;
/// # let fd: std::os::fd::OwnedFd = todo!();
/// server.publish("weights", serde_json::json!({"len": 4096}), vec![fd])?;
/// server.wait_released("weights", None)?;
/// # Ok(()) }
/// ```
pub struct Server {
    shared: Arc<Shared>,
    accept: Mutex<Option<JoinHandle<()>>>,
    /// The device and inode of the socket file we bound, so that shutdown
    /// removes our socket and never one that replaced it.
    socket_id: (u64, u64),
    /// The listening socket (a duplicate of the accept thread's).
    listener: OwnedFd,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("path", &self.shared.path)
            .field("allowed_uids", &self.shared.allowed_uids)
            .finish_non_exhaustive()
    }
}

impl Server {
    /// Binds a server to `config.path` and starts serving.
    ///
    /// First it makes sure this process's soft open-file limit
    /// (`RLIMIT_NOFILE`, which the kernel also applies to the descriptors a
    /// user has in flight) carries what the configuration lets clients
    /// leave unread (see [`ServerConfig::max_unread_fds`]): it raises the
    /// soft limit up to the hard one, or refuses with
    /// [`ChannelError::InvalidArgument`] saying what to lower.
    ///
    /// A socket file left at the path by a server that exited is removed
    /// (nothing accepts connections on it); if a server is listening there
    /// the result is [`ChannelError::Busy`]. Any other kind of file at the
    /// path is left alone and refused. The socket file gets mode `0600`.
    ///
    /// # References
    /// [bind(2)](https://man7.org/linux/man-pages/man2/bind.2.html),
    /// [unix(7)](https://man7.org/linux/man-pages/man7/unix.7.html).
    pub fn bind(config: ServerConfig) -> Result<Server, ChannelError> {
        let path = config.path.clone();
        check_config(&config)?;
        let len = path.as_os_str().len();
        if len == 0 || len > MAX_SOCKET_PATH {
            return Err(ChannelError::arg(
                "socket path",
                format!(
                    "{} is {len} bytes long, but a Unix socket path must have 1 to \
                     {MAX_SOCKET_PATH}; choose a shorter path",
                    path.display()
                ),
            ));
        }
        let addr = SocketAddrUnix::new(&path).map_err(|e| {
            ChannelError::io(format!("{} is not a valid socket path", path.display()), e)
        })?;
        let (listener, kept) = match &config.listener {
            Some(kept) => (listen::adopt(kept, &path, &addr)?, true),
            None => (listen::bind_new(&path, &addr)?, false),
        };
        // From here on the socket file is ours: remove it on failure.
        let cleanup = |e: ChannelError| {
            let _ = rustix::fs::unlink(&path);
            e
        };
        // No chmod by path: the path could be swapped for a symlink between
        // bind and chmod, and the chmod would follow it. The mode came from
        // the fchmod above; check what the path holds now without following
        // links.
        let st = bound_socket(&path).map_err(cleanup)?;
        if !kept {
            listen(&listener, LISTEN_BACKLOG)
                .map_err(|e| ChannelError::io(format!("cannot listen on {}", path.display()), e))
                .map_err(cleanup)?;
        }
        let kept_listener = listener
            .try_clone()
            .map_err(|e| ChannelError::io("cannot duplicate the listening socket", e))
            .map_err(cleanup)?;
        let wake = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
            .map_err(|e| ChannelError::io("cannot create an eventfd", e))
            .map_err(cleanup)?;

        let shared = Arc::new(Shared {
            path: path.clone(),
            allowed_uids: config.allowed_uids,
            handshake_timeout: config.handshake_timeout,
            send_timeout: config.send_timeout,
            max_connections: config.max_connections,
            reserved: config.reserved_connections,
            max_queued: config.max_queued_frames,
            max_queued_bytes: config.max_queued_bytes,
            max_unread_fds: config.max_unread_fds.max(MAX_FDS),
            max_per_uid: config.max_connections_per_uid,
            max_per_pid: config.max_connections_per_pid,
            idle_timeout: config.idle_timeout,
            max_leases: config.max_leases_per_connection,
            recv_limits: RecvLimits {
                max_payload: config.max_request_bytes.min(MAX_PAYLOAD),
                strict_deadline: false,
                // The session spins after a message (`session::spin`), not here.
                spin: Duration::ZERO,
            },
            notices: config.notices,
            spin: config.spin,
            spinners: crate::spin::Spinners::for_this_machine(),
            pid: own_pid(),
            restarts: config.restarts,
            uid: super::own_uid(),
            state: Mutex::new(State {
                lease_watch: config
                    .call_handler
                    .as_ref()
                    .and_then(CallHandler::lease_watch),
                ..State::default()
            }),
            changed: Condvar::new(),
            acks: std::sync::atomic::AtomicU64::new(0),
            wake,
            accepting: std::sync::atomic::AtomicBool::new(!config.accept_held),
            threads: Mutex::new(Vec::new()),
            refusal_log: LogLimit::new(),
            busy_log: LogLimit::new(),
            evict_log: LogLimit::new(),
            call_handler: Mutex::new(config.call_handler),
            peer_cpu: config.peer_cpu_budget,
            cpu_accounts: Mutex::new(std::collections::HashMap::new()),
        });
        let accept_shared = Arc::clone(&shared);
        let accept = std::thread::Builder::new()
            .name("cuda-ipc-accept".into())
            .spawn(move || accept_loop(&accept_shared, &listener))
            .map_err(|e| ChannelError::io("cannot start the accept thread", e))
            .map_err(cleanup)?;
        tracing::debug!(path = %path.display(), "channel server listening");
        Ok(Server {
            shared,
            accept: Mutex::new(Some(accept)),
            socket_id: (st.st_dev, st.st_ino),
            listener: kept_listener,
        })
    }

    /// A duplicate of the listening socket, to keep across a restart
    /// (a keeper's or systemd's file-descriptor store): a server bound
    /// later with [`ServerConfig::with_listener`] takes it over, and
    /// clients that connect in between wait in its backlog instead of
    /// being refused.
    ///
    /// # Errors
    /// [`ChannelError::Io`] when the process is out of descriptors.
    pub fn listener(&self) -> Result<OwnedFd, ChannelError> {
        self.listener
            .try_clone()
            .map_err(|e| ChannelError::io("cannot duplicate the listening socket", e))
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.shared.path
    }

    /// Publishes an entry: `meta` (at most [`MAX_META_BYTES`](crate::MAX_META_BYTES) of JSON: a
    /// JSON value, or a [`Meta`] whose text [`Meta::encoded`] made already,
    /// which is then not encoded again) and up to [`MAX_FDS`] file
    /// descriptors, which the server now owns.
    ///
    /// Fails with [`ChannelError::AlreadyExists`] if the name is published;
    /// a name that was unpublished may be published again at once, even
    /// while leases on the old entry remain.
    pub fn publish(
        &self,
        name: &str,
        meta: impl Into<Meta>,
        fds: Vec<OwnedFd>,
    ) -> Result<(), ChannelError> {
        validate_entry_name(name)?;
        check_fds(fds.len())?;
        let (meta, meta_bytes) = encoded_meta(meta.into())?;
        self.insert(name, meta, meta_bytes, Body::Plain { fds, version: 0 })?;
        Ok(())
    }

    /// Adds a published entry under `name`, unless the server shut down or
    /// the name is taken, and returns its id.
    fn insert(
        &self,
        name: &str,
        meta: Meta,
        meta_bytes: usize,
        body: Body,
    ) -> Result<u64, ChannelError> {
        let mut st = lock(&self.shared.state);
        if st.closed {
            return Err(ChannelError::ShutDown);
        }
        if st.names.contains_key(name) {
            return Err(ChannelError::AlreadyExists { name: name.into() });
        }
        let id = st.new_id();
        st.entries.insert(
            id,
            Entry {
                name: name.into(),
                meta: Arc::new(meta),
                meta_bytes,
                published: true,
                leases: BTreeSet::new(),
                body,
            },
        );
        st.names.insert(name.into(), id);
        Ok(id)
    }

    /// Sends `notice` to every client holding a lease on `name`, as an
    /// [`Update`](super::Update) with the entry's next version (its update
    /// counter, from 1), which it returns. Never blocks on clients.
    pub fn update(&self, name: &str, notice: Value) -> Result<u64, ChannelError> {
        json_size(&notice, "notice")?;
        let mut st = lock(&self.shared.state);
        let st = &mut *st;
        let id = st.published_id(name)?;
        let Some(entry) = st.entries.get_mut(&id) else {
            return Err(ChannelError::NotFound { name: name.into() });
        };
        let Body::Plain { version, .. } = &mut entry.body else {
            return Err(ChannelError::arg(
                "entry",
                format!("{name:?} is a ring; publish its frames with ServerRing::publish"),
            ));
        };
        *version += 1;
        let version = *version;
        let holders: Vec<(u64, &Arc<Conn>)> = entry
            .leases
            .iter()
            .filter_map(|lease| Some((*lease, st.conns.get(&st.leases.get(lease)?.conn)?)))
            .collect();
        self.send_updates(&holders, name, version, notice);
        Ok(version)
    }

    /// Unpublishes an entry or ring: no new attaches; every lease holder
    /// gets an `unpublished` notice; the entry and its descriptors are
    /// dropped when its last lease is released (at once if there is none).
    pub fn unpublish(&self, name: &str) -> Result<(), ChannelError> {
        let mut st = lock(&self.shared.state);
        let id = st.published_id(name)?;
        st.unpublish(id, self.shared.max_queued);
        drop(st);
        self.shared.changed.notify_all();
        Ok(())
    }

    /// Blocks until no lease on an entry or ring called `name` remains,
    /// published or not, or `timeout` passes ([`ChannelError::Timeout`];
    /// `None` waits for ever). Returns at once if there is none.
    pub fn wait_released(&self, name: &str, timeout: Option<Duration>) -> Result<(), ChannelError> {
        let deadline = timeout.map(crate::deadline_in);
        let mut st = lock(&self.shared.state);
        loop {
            let n = st.lease_count(name);
            if n == 0 {
                return Ok(());
            }
            st = match deadline {
                None => self
                    .shared
                    .changed
                    .wait(st)
                    .unwrap_or_else(std::sync::PoisonError::into_inner),
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(ChannelError::Timeout {
                            what: format!("the {n} lease(s) on {name:?} to be released"),
                            after: timeout.unwrap_or_default(),
                        });
                    }
                    self.shared
                        .changed
                        .wait_timeout(st, left)
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .0
                }
            };
        }
    }

    /// Every lease held now, in lease order.
    pub fn leases(&self) -> Vec<LeaseInfo> {
        let st = lock(&self.shared.state);
        let mut out: Vec<LeaseInfo> = st
            .leases
            .iter()
            .filter_map(|(id, l)| st.lease_info(*id, l))
            .collect();
        out.sort_by_key(|l| l.lease);
        out
    }

    /// Refuses every new lease on the name `name` (an attach of the entry
    /// or ring published under it now or later) with the error `code` and
    /// `message`, until [`allow_attaches`](Self::allow_attaches); the
    /// leases held now are kept. A name is refused at most once: a second
    /// call replaces the refusal.
    pub fn refuse_attaches(&self, name: &str, code: &str, message: &str) {
        lock(&self.shared.state)
            .refused
            .insert(name.to_owned(), (code.to_owned(), message.to_owned()));
    }

    /// Takes back [`refuse_attaches`](Self::refuse_attaches) of `name`.
    pub fn allow_attaches(&self, name: &str) {
        lock(&self.shared.state).refused.remove(name);
    }

    /// The number of leases on entries or rings called `name`, published or not.
    pub fn lease_count(&self, name: &str) -> usize {
        lock(&self.shared.state).lease_count(name)
    }

    /// The number of connected clients.
    pub fn connection_count(&self) -> usize {
        lock(&self.shared.state).conns.len()
    }

    /// Publishes a ring called `name` with one slot per element of `slots`
    /// (1 to [`MAX_RING_SLOTS`]), each with its metadata and up to
    /// [`MAX_FDS`] descriptors, and returns the producer's handle.
    ///
    /// Subscribers attach with [`Client::attach_ring`](super::Client::attach_ring)
    /// and receive every slot's metadata and descriptors once (each slot's
    /// message is made as the subscriber takes the previous ones, so one
    /// that does not read pins no more than one message's duplicates); afterwards
    /// only small [`FrameNotice`](super::FrameNotice)s travel. Dropping
    /// the [`ServerRing`] unpublishes the ring.
    pub fn create_ring(
        &self,
        name: &str,
        meta: Value,
        slots: Vec<(Value, Vec<OwnedFd>)>,
    ) -> Result<ServerRing, ChannelError> {
        validate_entry_name(name)?;
        let (meta, meta_bytes) = encoded_meta(meta.into())?;
        if slots.is_empty() || slots.len() > MAX_RING_SLOTS {
            return Err(ChannelError::arg(
                "slots",
                format!(
                    "a ring has 1 to {MAX_RING_SLOTS} slots, not {}",
                    slots.len()
                ),
            ));
        }
        for (meta, fds) in &slots {
            json_size(meta, "slot meta")?;
            check_fds(fds.len())?;
        }
        let count = slots.len();
        let sources: Arc<[SlotSource]> = slots
            .into_iter()
            .map(|(meta, fds)| SlotSource { meta, fds })
            .collect();
        let id = self.insert(name, meta, meta_bytes, Body::Ring(Ring::new(sources)))?;
        Ok(ServerRing {
            shared: Arc::clone(&self.shared),
            entry: id,
            name: name.into(),
            slot_count: count,
            backoff: Mutex::new(crate::spin::Backoff::default()),
        })
    }

    /// Starts accepting connections, for a server configured with
    /// [`ServerConfig::with_accept_held`] (those that waited in the backlog
    /// first); otherwise it already does.
    pub fn start_accepting(&self) {
        if !self
            .shared
            .accepting
            .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            let _ = rustix::io::write(&self.shared.wake, &1u64.to_ne_bytes());
        }
    }

    /// Stops serving: stops the threads, closes every connection (clients
    /// see [`ChannelError::PeerGone`]), closes every entry's descriptors and
    /// removes the socket file. Idempotent; `Drop` calls it.
    pub fn shutdown(&self) {
        let Some(accept) = lock(&self.accept).take() else {
            return;
        };
        lock(&self.shared.state).closed = true;
        let _ = rustix::io::write(&self.shared.wake, &1u64.to_ne_bytes());
        let _ = accept.join();
        let conns: Vec<Arc<Conn>> = lock(&self.shared.state).conns.values().cloned().collect();
        for conn in conns {
            conn.abort();
        }
        let threads = std::mem::take(&mut *lock(&self.shared.threads));
        for t in threads {
            let _ = t.join();
        }
        {
            let mut st = lock(&self.shared.state);
            st.names.clear();
            st.leases.clear();
            st.conns.clear();
            st.lingering.clear();
            st.entries.clear();
        }
        self.shared.changed.notify_all();
        // Remove the socket file only if it is still the one we bound.
        if let Ok(st) = rustix::fs::lstat(&self.shared.path)
            && (st.st_dev, st.st_ino) == self.socket_id
        {
            let _ = rustix::fs::unlink(&self.shared.path);
        }
        tracing::debug!(path = %self.shared.path.display(), "channel server shut down");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown();
    }
}
