//! The producer's end: a Unix socket server that publishes named entries,
//! hands out leases, pushes updates and runs rings.
//!
//! # Threads
//! [`Server::bind`] starts one accept thread. Each admitted connection gets
//! a reader thread, which answers requests, and a writer thread, the only
//! one that writes to the socket: requests, [`Server::update`] and
//! [`RingProducer::publish`] only queue frames for it, so a slow or stuck
//! client never blocks the producer or other clients. A client that leaves
//! more than [`ServerConfig::max_queued_frames`] frames unread, or does not
//! read for [`ServerConfig::send_timeout`], is disconnected.
//!
//! # Leases
//! A lease is held by a connection. When the connection ends for any reason
//! (release, close, crash, `SIGKILL`, a malformed frame), all its leases and
//! ring subscriptions end at once and waiters
//! ([`Server::wait_released`], [`RingProducer::acquire`]) wake up.
//!
//! # File descriptors
//! [`Server::publish`] and [`Server::create_ring`] take ownership of the
//! descriptors. Every attach sends the client duplicates (`dup`), queued
//! with the frame and closed once the frame is sent; the kernel gives the
//! client its own descriptors for the same open files. The originals are
//! closed when the entry is gone: unpublished and its last lease released,
//! or the server shut down.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::event::{EventfdFlags, PollFd, PollFlags, eventfd, poll};
use rustix::fs::{FileType, Mode};
use rustix::io::Errno;
use rustix::net::{
    AddressFamily, Shutdown, SocketAddrUnix, SocketFlags, SocketType, accept_with, bind, connect,
    listen, shutdown, socket_with,
};
use serde_json::{Value, json};

use super::socket::{
    Ucred, peer_credentials, recv_message, send_bytes, send_message, try_send_message,
};
use super::wire::{EntryKind, ListedEntry, MAX_FDS, Message, PROTOCOL_VERSION};
use super::{ChannelError, Side, lock, own_pid, own_uid, refused_text};

/// The largest `meta` or `notice` value, in bytes of JSON (256 KiB), so that
/// every message fits in a frame.
pub const MAX_META_BYTES: usize = 256 * 1024;

/// The longest entry name, in bytes.
pub const MAX_ENTRY_NAME_LEN: usize = 256;

/// The most slots a ring may have.
pub const MAX_RING_SLOTS: usize = 1024;

/// A listing page stops growing at about this many bytes.
const LISTING_PAGE_BYTES: usize = 512 * 1024;

/// How long a refused or turned-away peer gets to take its error frame.
const REFUSE_SEND_TIMEOUT: Duration = Duration::from_millis(200);

/// The longest a closing connection may take to send its final error frame.
const FINAL_SEND_TIMEOUT: Duration = Duration::from_secs(1);

/// A connection's reader takes no new request while this many frames wait
/// to be sent to it: a client that sends requests without reading the
/// answers slows down instead of making the server queue (and hold the
/// duplicated descriptors of) an unbounded number of answers.
const RESPONSE_WINDOW: usize = 64;

/// The backlog of the listening socket.
const LISTEN_BACKLOG: i32 = 128;

/// The longest path a Unix socket address holds (`sun_path` less its NUL).
const MAX_SOCKET_PATH: usize = 107;

/// How a [`Server`] is set up.
///
/// Build it with [`ServerConfig::new`] and change fields as needed:
/// `ServerConfig { allowed_uids: vec![1000, 1001], ..ServerConfig::new(path) }`.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The socket path (see [`default_socket_path`](super::default_socket_path)).
    pub path: PathBuf,
    /// The user ids allowed to connect (`SO_PEERCRED`); default: only ours.
    pub allowed_uids: Vec<u32>,
    /// How long a new connection has to send its `hello`; default 5 s.
    pub handshake_timeout: Duration,
    /// How long a client may leave a frame unread before it is
    /// disconnected; default 5 s.
    pub send_timeout: Duration,
    /// The most connections served at once; default 256.
    pub max_connections: usize,
    /// The most frames queued for one client before it is disconnected as
    /// stuck; default 4096. Must exceed the slot count of every ring, since
    /// a new subscriber is sent one frame per slot at once.
    pub max_queued_frames: usize,
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
            max_queued_frames: 4096,
        }
    }
}

/// One lease, as [`Server::leases`] reports it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LeaseInfo {
    /// The lease id.
    pub lease: u64,
    /// The entry's or ring's name.
    pub name: String,
    /// Whether the lease is on a plain entry or a ring.
    pub kind: EntryKind,
    /// The holder's process id (`SO_PEERCRED`).
    pub pid: u32,
    /// The holder's user id (`SO_PEERCRED`).
    pub uid: u32,
}

/// Checks an entry or ring name: 1 to [`MAX_ENTRY_NAME_LEN`] bytes of UTF-8
/// without control characters.
pub fn validate_entry_name(name: &str) -> Result<(), ChannelError> {
    let invalid = |reason: String| ChannelError::InvalidName {
        name: name.to_owned(),
        reason,
    };
    if name.is_empty() {
        return Err(invalid("an entry name must not be empty".into()));
    }
    if name.len() > MAX_ENTRY_NAME_LEN {
        return Err(invalid(format!(
            "an entry name has at most {MAX_ENTRY_NAME_LEN} bytes, this one has {}",
            name.len()
        )));
    }
    if let Some(c) = name.chars().find(|c| c.is_control()) {
        return Err(invalid(format!(
            "control character {c:?} is not allowed in an entry name"
        )));
    }
    Ok(())
}

/// The size of a value's JSON, refused above [`MAX_META_BYTES`].
fn json_size(value: &Value, what: &'static str) -> Result<usize, ChannelError> {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    // Writing a `Value` into a counter cannot fail.
    let _ = serde_json::to_writer(&mut count, value);
    if count.0 > MAX_META_BYTES {
        return Err(ChannelError::arg(
            what,
            format!(
                "its JSON is {} bytes, more than the limit of {MAX_META_BYTES}; put large data \
                 in shared memory and describe it here",
                count.0
            ),
        ));
    }
    Ok(count.0)
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

fn check_fds(count: usize) -> Result<(), ChannelError> {
    if count > MAX_FDS {
        return Err(ChannelError::arg(
            "file descriptors",
            format!("an entry or slot carries at most {MAX_FDS} file descriptors, not {count}"),
        ));
    }
    Ok(())
}

/// The error frame for a request or a connection.
fn error_frame(id: Option<u64>, code: &str, message: impl Into<String>) -> Message {
    Message::Error {
        id,
        code: code.into(),
        message: message.into(),
        details: Value::Null,
    }
}

// ---------------------------------------------------------------------------
// State

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotState {
    /// The producer may acquire it.
    Free,
    /// The producer acquired it and has not published it yet.
    Acquired,
    /// Published; waiting for the subscribers in `pending`.
    InFlight,
}

struct Slot {
    meta: Value,
    fds: Vec<OwnedFd>,
    state: SlotState,
    /// The sequence number of the slot's latest frame.
    seq: u64,
    /// The leases that were sent the latest frame and have not acked it.
    pending: BTreeSet<u64>,
}

struct Ring {
    slots: Vec<Slot>,
    /// The slot `acquire` hands out next.
    next: usize,
    /// The last sequence number used.
    seq: u64,
}

enum Body {
    Plain { fds: Vec<OwnedFd>, generation: u64 },
    Ring(Ring),
}

struct Entry {
    name: String,
    meta: Value,
    /// The size of `meta`'s JSON.
    meta_bytes: usize,
    /// False once unpublished: no new leases; dropped with its last lease.
    published: bool,
    leases: BTreeSet<u64>,
    body: Body,
}

impl Entry {
    fn kind(&self) -> EntryKind {
        match self.body {
            Body::Plain { .. } => EntryKind::Entry,
            Body::Ring(_) => EntryKind::Ring,
        }
    }
}

struct Lease {
    entry: u64,
    conn: u64,
    pid: u32,
    uid: u32,
}

#[derive(Default)]
struct State {
    closed: bool,
    /// Ids for entries, leases and connections, never reused.
    last_id: u64,
    /// Published names and their entries.
    names: BTreeMap<String, u64>,
    /// Every live entry, published or waiting for its last lease.
    entries: HashMap<u64, Entry>,
    leases: HashMap<u64, Lease>,
    conns: HashMap<u64, Arc<Conn>>,
}

impl State {
    fn new_id(&mut self) -> u64 {
        self.last_id += 1;
        self.last_id
    }

    /// Ends a lease; drops its entry if that was the last lease on an
    /// unpublished entry. The caller notifies waiters.
    fn end_lease(&mut self, lease: u64) -> Option<Lease> {
        let l = self.leases.remove(&lease)?;
        let mut drop_entry = false;
        if let Some(e) = self.entries.get_mut(&l.entry) {
            e.leases.remove(&lease);
            if let Body::Ring(ring) = &mut e.body {
                for slot in &mut ring.slots {
                    if slot.pending.remove(&lease)
                        && slot.pending.is_empty()
                        && slot.state == SlotState::InFlight
                    {
                        slot.state = SlotState::Free;
                    }
                }
            }
            drop_entry = !e.published && e.leases.is_empty();
        }
        if drop_entry {
            self.entries.remove(&l.entry);
        }
        Some(l)
    }

    /// Unpublishes an entry: tells its lease holders, and drops it if no
    /// lease remains. The caller notifies waiters.
    fn unpublish(&mut self, id: u64, max_queued: usize) {
        let Some(e) = self.entries.get_mut(&id) else {
            return;
        };
        if !e.published {
            return;
        }
        e.published = false;
        if self.names.get(&e.name) == Some(&id) {
            self.names.remove(&e.name);
        }
        for lease in &e.leases {
            if let Some(conn) = self.leases.get(lease).and_then(|l| self.conns.get(&l.conn)) {
                conn.push(
                    Message::Unpublished {
                        lease: *lease,
                        name: e.name.clone(),
                    },
                    Vec::new(),
                    max_queued,
                );
            }
        }
        if e.leases.is_empty() {
            self.entries.remove(&id);
        }
    }

    /// The number of leases on entries called `name`, published or not.
    fn lease_count(&self, name: &str) -> usize {
        self.entries
            .values()
            .filter(|e| e.name == name)
            .map(|e| e.leases.len())
            .sum()
    }

    fn lease_info(&self, lease: u64, l: &Lease) -> Option<LeaseInfo> {
        let e = self.entries.get(&l.entry)?;
        Some(LeaseInfo {
            lease,
            name: e.name.clone(),
            kind: e.kind(),
            pid: l.pid,
            uid: l.uid,
        })
    }
}

// ---------------------------------------------------------------------------
// Connections

/// What waits for the writer thread.
enum Outgoing {
    /// A frame, with the descriptors it carries.
    Frame { message: Message, fds: Vec<OwnedFd> },
    /// The end of a frame whose start (and descriptors) already went.
    Rest(Vec<u8>),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum OutState {
    /// Accepting frames.
    Open,
    /// Send what is queued, then stop.
    Draining,
    /// Stop now; the queue is cleared.
    Closed,
}

struct Outbox {
    queue: VecDeque<Outgoing>,
    state: OutState,
    /// The writer thread is sending a frame it took from the queue.
    sending: bool,
}

struct Conn {
    id: u64,
    stream: UnixStream,
    cred: Ucred,
    out: Mutex<Outbox>,
    out_ready: Condvar,
}

impl Conn {
    /// Sends a frame: at once from the calling thread when nothing is
    /// queued or being sent and the socket takes it without waiting (no
    /// thread hop), else through the writer thread's queue. A client with
    /// too many unread frames is disconnected. Returns whether the frame
    /// was sent or queued.
    fn push(&self, message: Message, fds: Vec<OwnedFd>, max_queued: usize) -> bool {
        let mut out = lock(&self.out);
        if out.state != OutState::Open {
            return false;
        }
        if out.queue.is_empty() && !out.sending {
            // Under the lock, so that no other frame can start meanwhile.
            let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(AsFd::as_fd).collect();
            match try_send_message(&self.stream, &message, &borrowed) {
                Ok((bytes, sent)) if sent == bytes.len() => return true,
                Ok((bytes, 0)) => drop(bytes),
                Ok((mut bytes, sent)) => {
                    bytes.drain(..sent);
                    out.queue.push_back(Outgoing::Rest(bytes));
                    drop(out);
                    self.out_ready.notify_all();
                    return true;
                }
                Err(e) => {
                    drop(out);
                    self.send_failed(&e);
                    return false;
                }
            }
        }
        if out.queue.len() >= max_queued {
            tracing::warn!(
                pid = self.cred.pid,
                uid = self.cred.uid,
                queued = out.queue.len(),
                "disconnecting a client that does not read its socket"
            );
            out.queue.clear();
            out.state = OutState::Closed;
            drop(out);
            self.out_ready.notify_all();
            let _ = shutdown(&self.stream, Shutdown::Both);
            return false;
        }
        out.queue.push_back(Outgoing::Frame { message, fds });
        drop(out);
        self.out_ready.notify_all();
        true
    }

    /// Logs a failed send (unless the client simply went away) and stops
    /// the connection: a frame may have been cut in half.
    fn send_failed(&self, e: &ChannelError) {
        if !matches!(e, ChannelError::PeerGone) {
            tracing::warn!(
                pid = self.cred.pid,
                uid = self.cred.uid,
                error = %e,
                "disconnecting a client that could not be sent a frame"
            );
        }
        self.abort();
    }

    /// Lets the writer send `last` (if any) and stop; drops queued frames.
    fn finish(&self, last: Option<Message>) {
        let mut out = lock(&self.out);
        out.queue.clear();
        if out.state == OutState::Open {
            if let Some(message) = last {
                out.queue.push_back(Outgoing::Frame {
                    message,
                    fds: Vec::new(),
                });
            }
            out.state = OutState::Draining;
        }
        drop(out);
        self.out_ready.notify_all();
    }

    /// Waits until fewer than `limit` frames are queued, or the connection
    /// stops. (A client that never reads is cut off by the writer's send
    /// timeout, which ends this wait.)
    fn wait_for_room(&self, limit: usize) {
        let mut out = lock(&self.out);
        while out.state == OutState::Open && out.queue.len() >= limit {
            out = self
                .out_ready
                .wait(out)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }

    /// Stops the connection now: the writer stops, and the reader sees end
    /// of file.
    fn abort(&self) {
        let mut out = lock(&self.out);
        out.queue.clear();
        out.state = OutState::Closed;
        drop(out);
        self.out_ready.notify_all();
        let _ = shutdown(&self.stream, Shutdown::Both);
    }

    /// The writer thread's loop.
    fn write_loop(&self, send_timeout: Duration) {
        loop {
            let (next, draining) = {
                let mut out = lock(&self.out);
                loop {
                    if let Some(o) = out.queue.pop_front() {
                        out.sending = true;
                        // The reader may be waiting for room.
                        self.out_ready.notify_all();
                        break (o, out.state == OutState::Draining);
                    }
                    if out.state != OutState::Open {
                        return;
                    }
                    out = self
                        .out_ready
                        .wait(out)
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                }
            };
            let timeout = if draining {
                send_timeout.min(FINAL_SEND_TIMEOUT)
            } else {
                send_timeout
            };
            let deadline = Some(Instant::now() + timeout);
            let sent = match &next {
                Outgoing::Frame { message, fds } => {
                    let fds: Vec<BorrowedFd<'_>> = fds.iter().map(AsFd::as_fd).collect();
                    send_message(&self.stream, message, &fds, deadline)
                }
                Outgoing::Rest(bytes) => send_bytes(&self.stream, bytes, &[], deadline),
            };
            lock(&self.out).sending = false;
            if let Err(e) = sent {
                self.send_failed(&e);
                return;
            }
            // `next` drops here: our duplicates of the descriptors close; the
            // client has its own.
        }
    }
}

// ---------------------------------------------------------------------------
// The server

struct Shared {
    path: PathBuf,
    allowed_uids: Vec<u32>,
    handshake_timeout: Duration,
    send_timeout: Duration,
    max_connections: usize,
    max_queued: usize,
    pid: u32,
    state: Mutex<State>,
    /// Signalled whenever a lease ends, a slot is acked, or an entry is
    /// unpublished, and at shutdown.
    changed: Condvar,
    /// Wakes the accept thread at shutdown.
    wake: OwnedFd,
    /// The connection threads, joined at shutdown.
    threads: Mutex<Vec<JoinHandle<()>>>,
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
        if config.allowed_uids.is_empty() {
            return Err(ChannelError::arg(
                "allowed_uids",
                "the list is empty, so no client could connect; list at least one user id",
            ));
        }
        if config.max_connections == 0 || config.max_queued_frames == 0 {
            return Err(ChannelError::arg(
                "server limits",
                "max_connections and max_queued_frames must be at least 1",
            ));
        }
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
        remove_stale_socket(&path, &addr)?;

        let listener = socket_with(
            AddressFamily::UNIX,
            SocketType::STREAM,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            None,
        )
        .map_err(|e| ChannelError::io("cannot create a Unix socket", e))?;
        // Linux creates the socket file with the socket inode's mode less the
        // umask: narrowing it first closes the window before the chmod below.
        let _ = rustix::fs::fchmod(&listener, Mode::from_raw_mode(0o600));
        match bind(&listener, &addr) {
            Ok(()) => {}
            Err(Errno::ADDRINUSE) => return Err(ChannelError::Busy { path }),
            Err(e) => {
                return Err(ChannelError::io(
                    format!("cannot bind the channel socket {}", path.display()),
                    e,
                ));
            }
        }
        // From here on the socket file is ours: remove it on failure.
        let cleanup = |e: ChannelError| {
            let _ = rustix::fs::unlink(&path);
            e
        };
        rustix::fs::chmod(&path, Mode::from_raw_mode(0o600))
            .map_err(|e| ChannelError::io(format!("cannot set the mode of {}", path.display()), e))
            .map_err(cleanup)?;
        let st = rustix::fs::lstat(&path)
            .map_err(|e| ChannelError::io(format!("cannot inspect {}", path.display()), e))
            .map_err(cleanup)?;
        listen(&listener, LISTEN_BACKLOG)
            .map_err(|e| ChannelError::io(format!("cannot listen on {}", path.display()), e))
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
            max_queued: config.max_queued_frames,
            pid: own_pid(),
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            wake,
            threads: Mutex::new(Vec::new()),
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
        })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.shared.path
    }

    /// Publishes an entry: `meta` (at most [`MAX_META_BYTES`] of JSON) and
    /// up to [`MAX_FDS`] file descriptors, which the server now owns.
    ///
    /// Fails with [`ChannelError::AlreadyExists`] if the name is published;
    /// a name that was unpublished may be published again at once, even
    /// while leases on the old entry remain.
    pub fn publish(&self, name: &str, meta: Value, fds: Vec<OwnedFd>) -> Result<(), ChannelError> {
        validate_entry_name(name)?;
        check_fds(fds.len())?;
        let meta_bytes = json_size(&meta, "meta")?;
        self.insert(name, meta, meta_bytes, Body::Plain { fds, generation: 0 })?;
        Ok(())
    }

    /// Adds a published entry under `name`, unless the server shut down or
    /// the name is taken, and returns its id.
    fn insert(
        &self,
        name: &str,
        meta: Value,
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
                meta,
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
    /// [`Update`](super::Update) with the entry's next generation (from 1),
    /// which it returns. Never blocks on clients.
    pub fn update(&self, name: &str, notice: Value) -> Result<u64, ChannelError> {
        json_size(&notice, "notice")?;
        let mut st = lock(&self.shared.state);
        let st = &mut *st;
        if st.closed {
            return Err(ChannelError::ShutDown);
        }
        let id = *st
            .names
            .get(name)
            .ok_or_else(|| ChannelError::NotFound { name: name.into() })?;
        let Some(entry) = st.entries.get_mut(&id) else {
            return Err(ChannelError::NotFound { name: name.into() });
        };
        let Body::Plain { generation, .. } = &mut entry.body else {
            return Err(ChannelError::arg(
                "entry",
                format!("{name:?} is a ring; publish its frames with RingProducer::publish"),
            ));
        };
        *generation += 1;
        let generation = *generation;
        let holders: Vec<(u64, &Arc<Conn>)> = entry
            .leases
            .iter()
            .filter_map(|lease| Some((*lease, st.conns.get(&st.leases.get(lease)?.conn)?)))
            .collect();
        for ((lease, conn), notice) in holders.iter().zip(copies(notice, holders.len())) {
            conn.push(
                Message::Update {
                    lease: *lease,
                    name: name.into(),
                    generation,
                    notice,
                },
                Vec::new(),
                self.shared.max_queued,
            );
        }
        Ok(generation)
    }

    /// Unpublishes an entry or ring: no new attaches; every lease holder
    /// gets an `unpublished` notice; the entry and its descriptors are
    /// dropped when its last lease is released (at once if there is none).
    pub fn unpublish(&self, name: &str) -> Result<(), ChannelError> {
        let mut st = lock(&self.shared.state);
        if st.closed {
            return Err(ChannelError::ShutDown);
        }
        let id = *st
            .names
            .get(name)
            .ok_or_else(|| ChannelError::NotFound { name: name.into() })?;
        st.unpublish(id, self.shared.max_queued);
        drop(st);
        self.shared.changed.notify_all();
        Ok(())
    }

    /// Blocks until no lease on an entry or ring called `name` remains,
    /// published or not, or `timeout` passes ([`ChannelError::Timeout`];
    /// `None` waits for ever). Returns at once if there is none.
    pub fn wait_released(&self, name: &str, timeout: Option<Duration>) -> Result<(), ChannelError> {
        let deadline = timeout.map(|t| Instant::now() + t);
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
    /// and receive every slot's metadata and descriptors once; afterwards
    /// only small [`RingFrame`](super::RingFrame) notices travel. Dropping
    /// the [`RingProducer`] unpublishes the ring.
    pub fn create_ring(
        &self,
        name: &str,
        meta: Value,
        slots: Vec<(Value, Vec<OwnedFd>)>,
    ) -> Result<RingProducer, ChannelError> {
        validate_entry_name(name)?;
        let meta_bytes = json_size(&meta, "meta")?;
        if slots.is_empty() || slots.len() > MAX_RING_SLOTS {
            return Err(ChannelError::arg(
                "slots",
                format!(
                    "a ring has 1 to {MAX_RING_SLOTS} slots, not {}",
                    slots.len()
                ),
            ));
        }
        if slots.len() >= self.shared.max_queued {
            return Err(ChannelError::arg(
                "slots",
                format!(
                    "a subscriber is sent one frame per slot at once, and {} slots do not fit \
                     in ServerConfig::max_queued_frames ({}); raise it or use fewer slots",
                    slots.len(),
                    self.shared.max_queued
                ),
            ));
        }
        for (meta, fds) in &slots {
            json_size(meta, "slot meta")?;
            check_fds(fds.len())?;
        }
        let count = slots.len();
        let slots = slots
            .into_iter()
            .map(|(meta, fds)| Slot {
                meta,
                fds,
                state: SlotState::Free,
                seq: 0,
                pending: BTreeSet::new(),
            })
            .collect();
        let id = self.insert(
            name,
            meta,
            meta_bytes,
            Body::Ring(Ring {
                slots,
                next: 0,
                seq: 0,
            }),
        )?;
        Ok(RingProducer {
            shared: Arc::clone(&self.shared),
            entry: id,
            name: name.into(),
            slots: count,
        })
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

/// Removes a socket file that nothing listens on; refuses anything else.
fn remove_stale_socket(path: &Path, addr: &SocketAddrUnix) -> Result<(), ChannelError> {
    let st = match rustix::fs::lstat(path) {
        Ok(st) => st,
        Err(Errno::NOENT) => return Ok(()),
        Err(e) => {
            return Err(ChannelError::io(
                format!("cannot inspect {}", path.display()),
                e,
            ));
        }
    };
    if FileType::from_raw_mode(st.st_mode) != FileType::Socket {
        return Err(ChannelError::arg(
            "socket path",
            format!(
                "{} exists and is not a socket; refusing to replace it: remove it or choose \
                 another path",
                path.display()
            ),
        ));
    }
    let probe = socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC,
        None,
    )
    .map_err(|e| ChannelError::io("cannot create a Unix socket", e))?;
    match connect(&probe, addr) {
        // A listener whose backlog is full is alive too.
        Ok(()) | Err(Errno::AGAIN) => Err(ChannelError::Busy {
            path: path.to_owned(),
        }),
        Err(Errno::CONNREFUSED) => {
            tracing::debug!(path = %path.display(), "removing a stale channel socket");
            match rustix::fs::unlink(path) {
                Ok(()) | Err(Errno::NOENT) => Ok(()),
                Err(e) => Err(ChannelError::io(
                    format!("cannot remove the stale socket {}", path.display()),
                    e,
                )),
            }
        }
        Err(Errno::NOENT) => Ok(()),
        Err(e) => Err(ChannelError::io(
            format!(
                "cannot tell whether a publisher is serving {}",
                path.display()
            ),
            e,
        )),
    }
}

fn accept_loop(shared: &Arc<Shared>, listener: &OwnedFd) {
    loop {
        let mut fds = [
            PollFd::new(listener, PollFlags::IN),
            PollFd::new(&shared.wake, PollFlags::IN),
        ];
        match poll(&mut fds, None) {
            Ok(_) | Err(Errno::INTR) => {}
            Err(e) => {
                tracing::warn!(error = %e, "poll on the listening socket failed");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        if lock(&shared.state).closed {
            return;
        }
        match accept_with(listener, SocketFlags::CLOEXEC) {
            Ok(fd) => admit(shared, UnixStream::from(fd)),
            Err(Errno::AGAIN | Errno::INTR | Errno::CONNABORTED) => {}
            Err(e) => {
                // Out of descriptors or memory: back off instead of spinning.
                tracing::warn!(error = %e, "accepting a channel connection failed");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// Checks a new connection's credentials and starts serving it.
fn admit(shared: &Arc<Shared>, stream: UnixStream) {
    let cred = match peer_credentials(&stream) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "dropping a connection whose credentials are unreadable");
            return;
        }
    };
    if !shared.allowed_uids.contains(&cred.uid) {
        tracing::warn!(
            uid = cred.uid,
            pid = cred.pid,
            allowed = ?shared.allowed_uids,
            path = %shared.path.display(),
            "refused a channel connection from a user that is not allowed"
        );
        let refusal = Message::Error {
            id: None,
            code: "refused".into(),
            message: refused_text(Side::Server, cred.uid, &shared.allowed_uids),
            details: json!({ "uid": cred.uid, "allowed": shared.allowed_uids }),
        };
        let _ = send_message(
            &stream,
            &refusal,
            &[],
            Some(Instant::now() + REFUSE_SEND_TIMEOUT),
        );
        let _ = shutdown(&stream, Shutdown::Both);
        return;
    }
    let conn = {
        let mut st = lock(&shared.state);
        if st.closed {
            return;
        }
        if st.conns.len() >= shared.max_connections {
            drop(st);
            tracing::warn!(
                pid = cred.pid,
                max = shared.max_connections,
                "turned away a client: too many connections"
            );
            let busy = error_frame(
                None,
                "busy",
                format!(
                    "the server already serves {} connections, its limit; close unused clients \
                     or raise ServerConfig::max_connections",
                    shared.max_connections
                ),
            );
            let _ = send_message(
                &stream,
                &busy,
                &[],
                Some(Instant::now() + REFUSE_SEND_TIMEOUT),
            );
            return;
        }
        let id = st.new_id();
        let conn = Arc::new(Conn {
            id,
            stream,
            cred,
            out: Mutex::new(Outbox {
                queue: VecDeque::new(),
                state: OutState::Open,
                sending: false,
            }),
            out_ready: Condvar::new(),
        });
        st.conns.insert(id, Arc::clone(&conn));
        conn
    };
    tracing::debug!(pid = cred.pid, uid = cred.uid, "channel client connected");
    let id = conn.id;
    let thread_shared = Arc::clone(shared);
    match std::thread::Builder::new()
        .name(format!("cuda-ipc-conn-{id}"))
        .spawn(move || serve(&thread_shared, &conn))
    {
        Ok(handle) => {
            let mut threads = lock(&shared.threads);
            // Finished threads need no join; forget them.
            threads.retain(|t| !t.is_finished());
            threads.push(handle);
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot start a connection thread; dropping the client");
            shared.disconnect(id);
        }
    }
}

/// A connection's reader thread: runs the session, then cleans up.
fn serve(shared: &Arc<Shared>, conn: &Arc<Conn>) {
    let writer_conn = Arc::clone(conn);
    let send_timeout = shared.send_timeout;
    let writer = match std::thread::Builder::new()
        .name(format!("cuda-ipc-send-{}", conn.id))
        .spawn(move || writer_conn.write_loop(send_timeout))
    {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(error = %e, "cannot start a writer thread; dropping the client");
            shared.disconnect(conn.id);
            conn.abort();
            return;
        }
    };
    let last = session(shared, conn).err();
    // Leases end before the final frame goes out, so that a producer waiting
    // in wait_released is not held up by a client that will not read.
    shared.disconnect(conn.id);
    conn.finish(last);
    let _ = writer.join();
    let _ = shutdown(&conn.stream, Shutdown::Both);
    tracing::debug!(pid = conn.cred.pid, "channel client disconnected");
}

/// Serves one connection until it ends. `Err` carries the error frame to
/// send before closing.
fn session(shared: &Shared, conn: &Conn) -> Result<(), Message> {
    let deadline = Instant::now() + shared.handshake_timeout;
    match recv_message(&conn.stream, Some(deadline)) {
        Ok((Message::Hello { protocol, .. }, fds)) if fds.is_empty() => {
            if protocol != PROTOCOL_VERSION {
                return Err(error_frame(
                    None,
                    "unsupported_protocol",
                    format!(
                        "the client speaks protocol {protocol}, this server speaks \
                         {PROTOCOL_VERSION}; use the same cuda-ipc version on both sides"
                    ),
                ));
            }
            conn.push(
                Message::Welcome {
                    protocol: PROTOCOL_VERSION,
                    pid: shared.pid,
                },
                Vec::new(),
                shared.max_queued,
            );
        }
        Ok((message, fds)) => {
            return Err(fatal(
                conn,
                &ChannelError::protocol(if fds.is_empty() {
                    format!(
                        "expected a \"hello\" message first, got {:?}",
                        message.type_name()
                    )
                } else {
                    "clients must not send file descriptors".into()
                }),
            ));
        }
        Err(e) => return end_of_session(conn, &e),
    }
    loop {
        conn.wait_for_room(RESPONSE_WINDOW);
        match recv_message(&conn.stream, None) {
            Ok((message, fds)) => {
                if !fds.is_empty() {
                    return Err(fatal(
                        conn,
                        &ChannelError::protocol(format!(
                            "a {:?} message came with {} file descriptors; clients must not \
                             send file descriptors",
                            message.type_name(),
                            fds.len()
                        )),
                    ));
                }
                shared.handle(conn, message)?;
            }
            Err(e) => return end_of_session(conn, &e),
        }
    }
}

/// Classifies a receive error: a quiet end, or an error frame to send.
fn end_of_session(conn: &Conn, e: &ChannelError) -> Result<(), Message> {
    match e {
        ChannelError::PeerGone => Ok(()),
        ChannelError::Io { .. } => {
            tracing::warn!(pid = conn.cred.pid, error = %e, "channel connection failed");
            Ok(())
        }
        ChannelError::Timeout { after, .. } => Err(fatal(
            conn,
            &ChannelError::protocol(format!(
                "no \"hello\" message within {after:?} of connecting"
            )),
        )),
        e => Err(fatal(conn, e)),
    }
}

/// Logs a client's protocol error and builds the error frame for it.
fn fatal(conn: &Conn, e: &ChannelError) -> Message {
    tracing::warn!(
        pid = conn.cred.pid,
        uid = conn.cred.uid,
        error = %e,
        "closing a channel connection that broke the protocol"
    );
    let code = match e {
        ChannelError::Wire(_) => "malformed_frame",
        _ => "protocol",
    };
    error_frame(None, code, e.to_string())
}

impl Shared {
    /// Ends a connection's leases and forgets it.
    fn disconnect(&self, conn: u64) {
        let mut st = lock(&self.state);
        st.conns.remove(&conn);
        let leases: Vec<u64> = st
            .leases
            .iter()
            .filter(|(_, l)| l.conn == conn)
            .map(|(id, _)| *id)
            .collect();
        for lease in leases {
            st.end_lease(lease);
        }
        drop(st);
        self.changed.notify_all();
    }

    /// Answers one request. `Err` ends the connection with that frame.
    fn handle(&self, conn: &Conn, message: Message) -> Result<(), Message> {
        let reply = |m: Message| {
            conn.push(m, Vec::new(), self.max_queued);
        };
        match message {
            Message::Ping { id } => reply(Message::Pong { id }),
            Message::List { id, after } => reply(self.listing(id, after.as_deref())),
            Message::Attach { id, name } => self.attach(conn, id, &name),
            Message::AttachRing { id, name } => self.attach_ring(conn, id, &name),
            Message::Release { id, lease } => {
                let mut st = lock(&self.state);
                if st.leases.get(&lease).is_some_and(|l| l.conn == conn.id) {
                    st.end_lease(lease);
                    drop(st);
                    self.changed.notify_all();
                    reply(Message::Released { id });
                } else {
                    drop(st);
                    reply(error_frame(
                        Some(id),
                        "invalid_lease",
                        format!("this connection holds no lease {lease}"),
                    ));
                }
            }
            Message::Ack { lease, slot, seq } => self.ack(conn, lease, slot, seq)?,
            Message::Hello { .. } => {
                return Err(fatal(
                    conn,
                    &ChannelError::protocol("a second \"hello\" on the same connection"),
                ));
            }
            other => {
                return Err(fatal(
                    conn,
                    &ChannelError::protocol(format!(
                        "{:?} is a server message; a client must not send it",
                        other.type_name()
                    )),
                ));
            }
        }
        Ok(())
    }

    fn listing(&self, id: u64, after: Option<&str>) -> Message {
        use std::ops::Bound;
        let st = lock(&self.state);
        let lower = after.map_or(Bound::Unbounded, Bound::Excluded);
        let mut entries = Vec::new();
        let mut size = 0usize;
        let mut next = None;
        for (name, eid) in st.names.range::<str, _>((lower, Bound::Unbounded)) {
            let Some(e) = st.entries.get(eid) else {
                continue;
            };
            // JSON escaping at most sextuples a name.
            let cost = e.meta_bytes + 6 * name.len() + 64;
            if !entries.is_empty() && size + cost > LISTING_PAGE_BYTES {
                next = entries.last().map(|l: &ListedEntry| l.name.clone());
                break;
            }
            size += cost;
            entries.push(ListedEntry {
                name: name.clone(),
                kind: e.kind(),
                meta: e.meta.clone(),
            });
        }
        Message::Listing { id, entries, next }
    }

    fn attach(&self, conn: &Conn, id: u64, name: &str) {
        let mut st = lock(&self.state);
        let st = &mut *st;
        let Some(&eid) = st.names.get(name) else {
            reply_not_found(conn, id, name, self.max_queued);
            return;
        };
        let Some(entry) = st.entries.get_mut(&eid) else {
            reply_not_found(conn, id, name, self.max_queued);
            return;
        };
        let Body::Plain { fds, .. } = &entry.body else {
            conn.push(
                error_frame(
                    Some(id),
                    "wrong_kind",
                    format!("{name:?} is a ring; subscribe to it with attach_ring"),
                ),
                Vec::new(),
                self.max_queued,
            );
            return;
        };
        let copies = match dup_all(fds) {
            Ok(c) => c,
            Err(e) => {
                conn.push(
                    error_frame(Some(id), "io", e.to_string()),
                    Vec::new(),
                    self.max_queued,
                );
                return;
            }
        };
        let lease = {
            st.last_id += 1;
            st.last_id
        };
        entry.leases.insert(lease);
        let meta = entry.meta.clone();
        st.leases.insert(
            lease,
            Lease {
                entry: eid,
                conn: conn.id,
                pid: conn.cred.pid,
                uid: conn.cred.uid,
            },
        );
        // Sent or queued under the state lock, so that no update for this lease can
        // overtake the answer.
        conn.push(
            Message::Attached {
                id,
                lease,
                meta,
                fds: copies.len() as u16,
            },
            copies,
            self.max_queued,
        );
    }

    fn attach_ring(&self, conn: &Conn, id: u64, name: &str) {
        let mut st = lock(&self.state);
        let st = &mut *st;
        let Some(&eid) = st.names.get(name) else {
            reply_not_found(conn, id, name, self.max_queued);
            return;
        };
        let Some(entry) = st.entries.get_mut(&eid) else {
            reply_not_found(conn, id, name, self.max_queued);
            return;
        };
        let Body::Ring(ring) = &entry.body else {
            conn.push(
                error_frame(
                    Some(id),
                    "wrong_kind",
                    format!("{name:?} is a plain entry; attach to it with attach"),
                ),
                Vec::new(),
                self.max_queued,
            );
            return;
        };
        let mut slots = Vec::with_capacity(ring.slots.len());
        for slot in &ring.slots {
            match dup_all(&slot.fds) {
                Ok(c) => slots.push((slot.meta.clone(), c)),
                Err(e) => {
                    conn.push(
                        error_frame(Some(id), "io", e.to_string()),
                        Vec::new(),
                        self.max_queued,
                    );
                    return;
                }
            }
        }
        let lease = {
            st.last_id += 1;
            st.last_id
        };
        entry.leases.insert(lease);
        st.leases.insert(
            lease,
            Lease {
                entry: eid,
                conn: conn.id,
                pid: conn.cred.pid,
                uid: conn.cred.uid,
            },
        );
        conn.push(
            Message::RingAttached {
                id,
                lease,
                slots: slots.len() as u32,
                meta: entry.meta.clone(),
            },
            Vec::new(),
            self.max_queued,
        );
        for (i, (meta, fds)) in slots.into_iter().enumerate() {
            conn.push(
                Message::RingSlot {
                    id,
                    lease,
                    slot: i as u32,
                    meta,
                    fds: fds.len() as u16,
                },
                fds,
                self.max_queued,
            );
        }
    }

    fn ack(&self, conn: &Conn, lease: u64, slot: u32, seq: u64) -> Result<(), Message> {
        let mut guard = lock(&self.state);
        let st = &mut *guard;
        // An ack racing with the client's own release of the lease is harmless.
        let Some(l) = st.leases.get(&lease).filter(|l| l.conn == conn.id) else {
            tracing::debug!(
                lease,
                "ignoring an ack for a lease this connection does not hold"
            );
            return Ok(());
        };
        let Some(Body::Ring(ring)) = st.entries.get_mut(&l.entry).map(|e| &mut e.body) else {
            return Err(fatal(
                conn,
                &ChannelError::protocol(format!("lease {lease} is not a ring lease")),
            ));
        };
        let count = ring.slots.len();
        let Some(s) = ring.slots.get_mut(slot as usize) else {
            return Err(fatal(
                conn,
                &ChannelError::protocol(format!(
                    "ack for slot {slot}, but the ring has {count} slots"
                )),
            ));
        };
        if s.seq == seq && s.pending.remove(&lease) {
            if s.pending.is_empty() && s.state == SlotState::InFlight {
                s.state = SlotState::Free;
            }
            drop(guard);
            self.changed.notify_all();
        }
        Ok(())
    }
}

fn reply_not_found(conn: &Conn, id: u64, name: &str, max_queued: usize) {
    conn.push(
        error_frame(
            Some(id),
            "not_found",
            format!("no entry named {name:?} is published"),
        ),
        Vec::new(),
        max_queued,
    );
}

fn dup_all(fds: &[OwnedFd]) -> Result<Vec<OwnedFd>, ChannelError> {
    fds.iter()
        .map(|fd| {
            fd.try_clone()
                .map_err(|e| ChannelError::io("cannot duplicate an entry's file descriptor", e))
        })
        .collect()
}

// ---------------------------------------------------------------------------
// Rings

/// The producer's handle on a ring (see [`Server::create_ring`]).
///
/// The cycle: [`acquire`](Self::acquire) a slot (blocks while it is in use),
/// fill what the slot's descriptors refer to, then
/// [`publish`](Self::publish) it with a notice; every subscriber gets a
/// [`RingFrame`](super::RingFrame) and acks it when done. Slots are handed
/// out in order `0, 1, …, n-1, 0, …`. Dropping the handle unpublishes the
/// ring.
pub struct RingProducer {
    shared: Arc<Shared>,
    entry: u64,
    name: String,
    slots: usize,
}

impl std::fmt::Debug for RingProducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingProducer")
            .field("name", &self.name)
            .field("slots", &self.slots)
            .finish_non_exhaustive()
    }
}

impl RingProducer {
    /// The ring's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The number of slots.
    pub fn slot_count(&self) -> usize {
        self.slots
    }

    /// Runs `f` on the ring, if it is still published.
    fn with_ring<T>(
        &self,
        st: &mut State,
        f: impl FnOnce(&mut Ring, &BTreeSet<u64>) -> T,
    ) -> Result<T, ChannelError> {
        if st.closed {
            return Err(ChannelError::ShutDown);
        }
        match st.entries.get_mut(&self.entry) {
            Some(Entry {
                published: true,
                body: Body::Ring(ring),
                leases,
                ..
            }) => Ok(f(ring, leases)),
            _ => Err(ChannelError::NotFound {
                name: self.name.clone(),
            }),
        }
    }

    /// Waits until the next slot in order is free (every subscriber that was
    /// sent its last frame acked it or went away), marks it acquired and
    /// returns its index. `None` waits for ever; a timeout gives
    /// [`ChannelError::Timeout`].
    pub fn acquire(&self, timeout: Option<Duration>) -> Result<usize, ChannelError> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut st = lock(&self.shared.state);
        loop {
            let got = self.with_ring(&mut st, |ring, _| {
                let i = ring.next;
                let slot = &mut ring.slots[i];
                if slot.state == SlotState::Free {
                    slot.state = SlotState::Acquired;
                    ring.next = (i + 1) % ring.slots.len();
                    Ok(i)
                } else {
                    Err(i)
                }
            })?;
            let waiting_for = match got {
                Ok(i) => return Ok(i),
                Err(i) => i,
            };
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
                            what: format!(
                                "slot {waiting_for} of ring {:?} to be acknowledged by every \
                                 subscriber",
                                self.name
                            ),
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

    /// Publishes an acquired slot: sends a frame with the next sequence
    /// number (from 1), which it returns, and `notice` to every current
    /// subscriber. The slot is free again once they all ack it (at once if
    /// there are none). Never blocks on subscribers.
    pub fn publish(&self, slot: usize, notice: Value) -> Result<u64, ChannelError> {
        json_size(&notice, "notice")?;
        let max_queued = self.shared.max_queued;
        let mut guard = lock(&self.shared.state);
        let st = &mut *guard;
        let (conns, leases) = (&st.conns, &st.leases);
        let closed = st.closed;
        if closed {
            return Err(ChannelError::ShutDown);
        }
        let Some(Entry {
            published: true,
            body: Body::Ring(ring),
            leases: subscribers,
            ..
        }) = st.entries.get_mut(&self.entry)
        else {
            return Err(ChannelError::NotFound {
                name: self.name.clone(),
            });
        };
        let count = ring.slots.len();
        let Some(s) = ring
            .slots
            .get_mut(slot)
            .filter(|s| s.state == SlotState::Acquired)
        else {
            return Err(ChannelError::arg(
                "slot",
                format!(
                    "slot {slot} of ring {:?} (of {count}) is not acquired; publish only a slot \
                     that acquire() returned, once",
                    self.name
                ),
            ));
        };
        ring.seq += 1;
        let seq = ring.seq;
        s.seq = seq;
        s.pending.clear();
        let targets: Vec<(u64, &Arc<Conn>)> = subscribers
            .iter()
            .filter_map(|lease| Some((*lease, conns.get(&leases.get(lease)?.conn)?)))
            .collect();
        for ((lease, conn), notice) in targets.iter().zip(copies(notice, targets.len())) {
            let sent = conn.push(
                Message::RingFrame {
                    lease: *lease,
                    slot: slot as u32,
                    seq,
                    notice,
                },
                Vec::new(),
                max_queued,
            );
            if sent {
                s.pending.insert(*lease);
            }
        }
        s.state = if s.pending.is_empty() {
            SlotState::Free
        } else {
            SlotState::InFlight
        };
        Ok(seq)
    }

    /// Gives back an acquired slot without publishing it; [`acquire`](Self::acquire)
    /// hands it out again when its turn in the cycle comes.
    pub fn cancel(&self, slot: usize) -> Result<(), ChannelError> {
        let mut st = lock(&self.shared.state);
        let done = self.with_ring(&mut st, |ring, _| match ring.slots.get_mut(slot) {
            Some(s) if s.state == SlotState::Acquired => {
                s.state = SlotState::Free;
                true
            }
            _ => false,
        })?;
        drop(st);
        if !done {
            return Err(ChannelError::arg(
                "slot",
                format!("slot {slot} of ring {:?} is not acquired", self.name),
            ));
        }
        self.shared.changed.notify_all();
        Ok(())
    }

    /// The current subscribers, in lease order.
    pub fn subscribers(&self) -> Vec<LeaseInfo> {
        let st = lock(&self.shared.state);
        let Some(e) = st.entries.get(&self.entry) else {
            return Vec::new();
        };
        e.leases
            .iter()
            .filter_map(|id| st.lease_info(*id, st.leases.get(id)?))
            .collect()
    }
}

impl Drop for RingProducer {
    fn drop(&mut self) {
        let mut st = lock(&self.shared.state);
        st.unpublish(self.entry, self.shared.max_queued);
        drop(st);
        self.shared.changed.notify_all();
    }
}
