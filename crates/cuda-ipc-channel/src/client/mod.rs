//! The consumer's end: connect to a [`Server`](super::Server), list its
//! entries, attach to them (receiving metadata and file descriptors), follow
//! updates and ring frames.
//!
//! # Waiting
//! Every call that waits has a deadline: [`ClientConfig::timeout`] for
//! requests, the `timeout` argument for [`Client::next_update`] and
//! [`Client::next_frame`]. When the server process dies, the kernel closes
//! its end of the socket, and every call (including one already waiting)
//! returns [`ChannelError::PeerGone`] at once.
//! With shared-memory notices (see [`notices`](crate::notices)) a waiting
//! thread spins on the notice ring and the socket, then sleeps in `poll(2)`
//! on the ring's wake-up socket and the connection together, so this still
//! holds.
//!
//! # Threads
//! A `Client` is `Send` and `Sync`. Several threads may wait on it at once:
//! whichever is reading the socket hands each message to the thread it
//! concerns, and frames the server pushes on its own (updates, ring frames,
//! unpublished notices) are queued until asked for, never lost. The queues
//! grow while nobody asks: call [`Client::next_update`] if you hold leases
//! on entries the producer updates.
//!
//! # File descriptors
//! The descriptors in an [`Attachment`] or [`RingAttachment`] are this
//! process's own (received with `MSG_CMSG_CLOEXEC`); they stay open after
//! the lease is released, until you drop them. Releasing a lease tells the
//! producer you are done; keep it until you no longer use what the
//! descriptors refer to.

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::limits::validate_entry_name;
use super::notices::NoticePath;
use super::socket::{RecvLimits, Ucred, peer_closed, peer_credentials, recv_message, send_message};
use super::wire::{ListedEntry, Message, PROTOCOL_VERSION};
use super::{ChannelError, Side, lock, own_pid, own_uid};

/// The most listing pages [`Client::list`] follows (a page is at most
/// about 512 KiB).
const MAX_LISTING_PAGES: usize = 256;

/// The most entries [`Client::list`] collects.
const MAX_LISTED_ENTRIES: usize = 1 << 16;

mod call;
mod connect;
mod demux;
mod pushed;
mod ring;
mod shm;
mod types;
mod waiting;

use connect::connect_socket;
use demux::{State, unexpected};
pub use pushed::PushedEntry;
use shm::ClientShm;
pub use types::{
    Attachment, ClientConfig, DEFAULT_SPIN, FrameNotice, Notice, NoticeStats, RingAttachment,
    Update,
};

/// A connection to a channel server: the consumer's end.
///
/// ```no_run
/// use cuda_ipc_channel::{Client, ClientConfig};
/// # fn main() -> Result<(), cuda_ipc_channel::ChannelError> {
/// let path = cuda_ipc_channel::default_socket_path("demo")?;
/// let client = Client::connect(&path, ClientConfig::default())?;
/// let weights = client.attach("weights")?;
/// // ... map weights.fds, read weights.meta ...
/// client.release(weights.lease)?;
/// # Ok(()) }
/// ```
pub struct Client {
    stream: UnixStream,
    server: Ucred,
    timeout: Duration,
    /// How answers and updates are waited for: `RecvLimits::CLIENT` with
    /// the configured spin (ring frames are waited for without).
    limits: RecvLimits,
    /// Serialises writers, so that messages never interleave; counts the
    /// socket messages sent since the hello (a request through the ring
    /// carries the count, see [`notices`](crate::notices)).
    write: Mutex<u64>,
    state: Mutex<State>,
    /// Signalled when a message was filed, the reader stepped down, or the
    /// connection died.
    filed: Condvar,
    /// The shared-memory rings, when the server granted them (see
    /// [`notices`](crate::notices)).
    shm: Option<ClientShm>,
    /// Whether the server said another process serves after it.
    restarts: bool,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("server", &self.server)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl Client {
    /// Connects to the server at `path`, checks its credentials against
    /// [`ClientConfig::allowed_server_uids`], and shakes hands.
    ///
    /// Errors: [`ChannelError::Refused`] if either side refuses the other,
    /// [`ChannelError::Io`] if nothing serves the path (the message says
    /// whether the socket is missing or stale), [`ChannelError::Timeout`]
    /// if the server does not answer within [`ClientConfig::timeout`].
    ///
    /// A server built before shared-memory notices existed refuses a hello
    /// that asks for them; the client then connects again without asking
    /// (see [`notices`](crate::notices)).
    ///
    /// # References
    /// [connect(2)](https://man7.org/linux/man-pages/man2/connect.2.html),
    /// [unix(7)](https://man7.org/linux/man-pages/man7/unix.7.html) (`SO_PEERCRED`).
    pub fn connect(path: impl AsRef<Path>, config: ClientConfig) -> Result<Client, ChannelError> {
        let within = config.timeout;
        Client::connect_within(path, config, within)
    }

    /// [`connect`](Self::connect), giving up on the connection and the
    /// handshake after `within` rather than [`ClientConfig::timeout`],
    /// which stays the requests' timeout (a client that tries again and
    /// again until its own deadline, as a reconnecting subscriber does).
    ///
    /// # Errors
    /// As [`connect`](Self::connect).
    pub fn connect_within(
        path: impl AsRef<Path>,
        config: ClientConfig,
        within: Duration,
    ) -> Result<Client, ChannelError> {
        let path = path.as_ref();
        let deadline = crate::deadline_in(within);
        let asked = config.notices == NoticePath::Shm;
        match Client::connect_once(path, config.clone(), deadline) {
            Err(ChannelError::Remote { code, message })
                if asked && code == "malformed_frame" && message.contains("shm_notices") =>
            {
                tracing::info!(
                    path = %path.display(),
                    "the server does not know shared-memory notices; connecting again with \
                     notices on the socket"
                );
                Client::connect_once(path, config.with_notices(NoticePath::Socket), deadline)
            }
            other => other,
        }
    }

    fn connect_once(
        path: &Path,
        config: ClientConfig,
        deadline: Instant,
    ) -> Result<Client, ChannelError> {
        let started = Instant::now();
        let stream = connect_socket(path, deadline)?;
        let server = peer_credentials(&stream)?;
        if !config.allowed_server_uids.contains(&server.uid) {
            return Err(ChannelError::Refused {
                by: Side::Client,
                uid: server.uid,
                allowed: config.allowed_server_uids,
            });
        }
        let hello = send_message(
            &stream,
            &Message::Hello {
                protocol: PROTOCOL_VERSION,
                pid: own_pid(),
                shm_notices: config.notices == NoticePath::Shm,
                shm_requests: config.notices == NoticePath::Shm,
            },
            &[],
            Some(deadline),
        );
        // Even if the hello could not be sent, the server may have said why.
        let (shm, restarts) = match recv_message(&stream, Some(deadline), RecvLimits::CLIENT) {
            Ok((
                Message::Welcome {
                    protocol,
                    shm_notices,
                    shm_requests,
                    restarts,
                    ..
                },
                fds,
            )) => {
                hello?;
                if protocol != PROTOCOL_VERSION {
                    return Err(ChannelError::protocol(format!(
                        "the server speaks protocol {protocol}, this client \
                         {PROTOCOL_VERSION}; use the same cuda-ipc version on both sides"
                    )));
                }
                let shm = ClientShm::granted(
                    config.notices == NoticePath::Shm,
                    shm_notices,
                    shm_requests,
                    fds,
                )?;
                (shm, restarts)
            }
            Ok((
                Message::Error {
                    code,
                    message,
                    details,
                    ..
                },
                _,
            )) => {
                if code == "refused" {
                    return Err(refused_by_server(&details));
                }
                return Err(ChannelError::Remote { code, message });
            }
            Ok((other, _)) => {
                return Err(ChannelError::protocol(format!(
                    "expected a \"welcome\" message from the server, got {:?}",
                    other.type_name()
                )));
            }
            Err(ChannelError::Timeout { .. }) => {
                hello?;
                return Err(ChannelError::Timeout {
                    what: format!("the server at {} to answer the handshake", path.display()),
                    after: started.elapsed(),
                });
            }
            Err(e) => {
                hello?;
                return Err(e);
            }
        };
        Ok(Client {
            stream,
            server,
            timeout: config.timeout,
            limits: RecvLimits {
                spin: config.spin,
                ..RecvLimits::CLIENT
            },
            write: Mutex::new(0),
            state: Mutex::new(State::default()),
            filed: Condvar::new(),
            shm,
            restarts,
        })
    }

    /// The server's process id (`SO_PEERCRED`, in our pid namespace), or 0
    /// when the server runs in a PID namespace that ours cannot see (see
    /// [`Ucred::pid_visible`]).
    pub fn server_pid(&self) -> u32 {
        self.server.pid
    }

    /// Whether the server said, when it welcomed this client, that another
    /// process serves its socket after it ends, with what it published
    /// ([`ServerConfig::restarts`](crate::ServerConfig::restarts): a
    /// keeper holds them). A client may then connect again after
    /// [`ChannelError::PeerGone`] instead of giving up.
    pub fn server_restarts(&self) -> bool {
        self.restarts
    }

    /// The server's credentials (`SO_PEERCRED`).
    pub fn server_credentials(&self) -> Ucred {
        self.server
    }

    /// How this client's notices and acks travel (agreed in the handshake,
    /// see [`notices`](crate::notices)) and how many took each path.
    pub fn notice_stats(&self) -> NoticeStats {
        let mut stats = lock(&self.state).stats;
        stats.path = if self.shm.is_some() {
            NoticePath::Shm
        } else {
            NoticePath::Socket
        };
        stats
    }

    /// Whether the connection is still up, without waiting and without
    /// consuming anything: false once the server has closed its end (it
    /// exited or was killed) or the connection failed.
    pub fn is_alive(&self) -> bool {
        if lock(&self.state).dead.is_some() {
            return false;
        }
        !peer_closed(self.stream.as_fd())
    }

    /// Checks the server answers, and returns the round-trip time.
    pub fn ping(&self) -> Result<Duration, ChannelError> {
        let started = Instant::now();
        let p = self.request(|id| Message::Ping { id }, None)?;
        match self.response(&p, "the answer to a ping")? {
            (Message::Pong { .. }, _) => Ok(started.elapsed()),
            (other, _) => Err(unexpected(other, "pong", "")),
        }
    }

    /// Every published entry and ring, in name order.
    pub fn list(&self) -> Result<Vec<ListedEntry>, ChannelError> {
        let mut all = Vec::new();
        let mut after: Option<String> = None;
        for _ in 0..MAX_LISTING_PAGES {
            let p = self.request(
                |id| Message::List {
                    id,
                    after: after.clone(),
                },
                None,
            )?;
            match self.response(&p, "the listing")? {
                (Message::Listing { entries, next, .. }, _) => {
                    all.extend(entries);
                    if all.len() > MAX_LISTED_ENTRIES {
                        return Err(ChannelError::protocol(format!(
                            "the server lists more than {MAX_LISTED_ENTRIES} entries, more than \
                             a client collects; attach by name instead"
                        )));
                    }
                    match next {
                        None => return Ok(all),
                        Some(n) if after.as_ref().is_some_and(|a| &n <= a) => {
                            return Err(ChannelError::protocol(format!(
                                "the listing went backwards (from {after:?} to {n:?})"
                            )));
                        }
                        Some(n) => after = Some(n),
                    }
                }
                (other, _) => return Err(unexpected(other, "listing", "")),
            }
        }
        Err(ChannelError::protocol(format!(
            "the listing did not end within {MAX_LISTING_PAGES} pages"
        )))
    }

    /// Attaches to a plain entry: takes a lease and receives the entry's
    /// metadata and descriptors.
    ///
    /// Errors: [`ChannelError::NotFound`] if no entry of that name is
    /// published; [`ChannelError::Remote`] with code `"wrong_kind"` for a
    /// ring (use [`attach_ring`](Self::attach_ring)).
    pub fn attach(&self, name: &str) -> Result<Attachment, ChannelError> {
        validate_entry_name(name)?;
        let p = self.request_attach(name)?;
        match self.response(&p, &format!("the answer to attaching {name:?}"))? {
            (Message::Attached { lease, meta, .. }, fds) => Ok(Attachment {
                lease,
                name: name.into(),
                // The only reference after decoding: no copy.
                meta: Arc::unwrap_or_clone(meta).into_value(),
                fds,
            }),
            (other, _) => Err(unexpected(other, "attached", name)),
        }
    }

    /// The metadata of the entries `names`, in order: each attached and its
    /// lease released at once, without waiting for the server's answer to
    /// the release, with up to [`Client::METADATA_IN_FLIGHT`] attaches in
    /// flight (one round trip for a few entries instead of two each). For
    /// entries that are only metadata (a large record's parts); descriptors
    /// that come with one are closed.
    ///
    /// # Errors
    /// As [`attach`](Self::attach), for the first entry refused (the
    /// attaches already in flight are answered and released first, so no
    /// lease is kept); the connection's errors.
    pub fn metadata_of(&self, names: &[&str]) -> Result<Vec<Value>, ChannelError> {
        for name in names {
            validate_entry_name(name)?;
        }
        let mut out = Vec::with_capacity(names.len());
        let mut in_flight = std::collections::VecDeque::new();
        let mut next = names.iter();
        let mut refused = None;
        loop {
            // No new attach after a refusal: those in flight are answered
            // (the server answers in order) and their leases released.
            while refused.is_none()
                && in_flight.len() < Self::METADATA_IN_FLIGHT
                && let Some(&name) = next.next()
            {
                in_flight.push_back((name, self.request_attach(name)?));
            }
            let Some((name, p)) = in_flight.pop_front() else {
                break;
            };
            match self.response(&p, &format!("the answer to attaching {name:?}"))? {
                (Message::Attached { lease, meta, .. }, _fds) => {
                    self.release_nowait(lease)?;
                    out.push(Arc::unwrap_or_clone(meta).into_value());
                }
                (other, _) => {
                    refused.get_or_insert_with(|| unexpected(other, "attached", name));
                }
            }
        }
        match refused {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    /// The most attaches [`metadata_of`](Self::metadata_of) keeps in flight
    /// (at most 4 MiB of answers queued for this client on the server).
    pub const METADATA_IN_FLIGHT: usize = 16;

    /// Releases a lease (on an entry or a ring). The producer may reuse
    /// what the lease covered once every holder has released it.
    pub fn release(&self, lease: u64) -> Result<(), ChannelError> {
        {
            let mut st = lock(&self.state);
            // A subscription the producer ended is released already.
            if st.rings.get(&lease).is_some_and(|q| q.evicted.is_some()) {
                st.rings.remove(&lease);
                return Ok(());
            }
        }
        let p = self.request(|id| Message::Release { id, lease }, None)?;
        let answer = self.response(&p, &format!("the answer to releasing lease {lease}"))?;
        lock(&self.state).forget(lease);
        match answer {
            (Message::Released { .. }, _) => Ok(()),
            (Message::Error { code, message, .. }, _) if code == "invalid_lease" => {
                Err(ChannelError::arg("lease", message))
            }
            (other, _) => Err(unexpected(other, "released", "")),
        }
    }

    /// Releases a lease without waiting for the server's answer (which is
    /// dropped when it comes): for a release from a drop or a background
    /// thread, which must not wait on a peer. The send itself is bounded by
    /// the request timeout. A connection that is gone has ended the lease
    /// already: [`ChannelError::PeerGone`].
    pub fn release_nowait(&self, lease: u64) -> Result<(), ChannelError> {
        let id = {
            let mut st = lock(&self.state);
            if let Some(d) = &st.dead {
                return Err(d.error());
            }
            st.rings.remove(&lease);
            st.held.remove(&lease);
            st.next_id()
        };
        // Nobody waits for `id`, so its answer is dropped when it comes.
        self.send(&Message::Release { id, lease })
    }

    /// The next update or unpublished notice for a leased entry, waiting up
    /// to `timeout` for one (`Duration::ZERO` polls: it returns a notice
    /// that has arrived, or [`ChannelError::Timeout`] at once). Notices
    /// queued before the server went away are returned before
    /// [`ChannelError::PeerGone`].
    pub fn next_update(&self, timeout: Duration) -> Result<Update, ChannelError> {
        self.wait_for(
            crate::deadline_in(timeout),
            "an update from the producer",
            self.limits,
            |st| st.updates.pop_front(),
        )
    }
}

/// The error for the server's refusal, from its details (`uid`, `allowed`).
fn refused_by_server(details: &Value) -> ChannelError {
    ChannelError::Refused {
        by: Side::Server,
        uid: details
            .get("uid")
            .and_then(Value::as_u64)
            .map_or_else(own_uid, |u| u as u32),
        allowed: details
            .get("allowed")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_u64)
                    .map(|u| u as u32)
                    .collect()
            })
            .unwrap_or_default(),
    }
}
