//! One connection's session: the handshake and the request handlers.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cuda_ipc_shm::{Ready, Receiver};

use rustix::net::{Shutdown, shutdown};

use crate::notices::{
    NOTICE_RING_BYTES, NoticePath, decode_ack_record, is_ring_request, server_rings, shm_error,
};
use crate::socket::recv_message;
use crate::spin::{Backoff, spin_until_readable};
use crate::wire::{ListedEntry, Message, PROTOCOL_VERSION};
use crate::{ChannelError, lock};

use super::conn::{Conn, SlotFeed};
use super::state::{Body, State};
use super::{LISTING_PAGE_BYTES, RESPONSE_WINDOW, Shared, error_frame};
use crate::limits::{MAX_ENTRY_NAME_LEN, validate_entry_name};

/// A connection's reader thread: runs the session, then cleans up.
pub(super) fn serve(shared: &Arc<Shared>, conn: &Arc<Conn>) {
    // The handshake before the writer thread starts: the welcome goes out
    // from this thread (`Conn::push` sends at once when nothing is queued),
    // so the client's connect does not wait for a thread to be made.
    let shook = handshake(shared, conn);
    let writer_conn = Arc::clone(conn);
    // What the writer spends on another user's client is charged too.
    let writer_meter = shared.cpu_meter(conn.cred.uid);
    let writer = match std::thread::Builder::new()
        .name(format!("cuda-ipc-send-{}", conn.id))
        .spawn(move || writer_conn.write_loop(writer_meter))
    {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(error = %e, "cannot start a writer thread; dropping the client");
            shared.disconnect(conn.id);
            conn.abort();
            return;
        }
    };
    let last = match shook {
        Ok(rings) => session(shared, conn, rings).err(),
        Err(end) => end.err(),
    };
    // Leases end before the final message goes out, so that a producer waiting
    // in wait_released is not held up by a client that will not read.
    shared.disconnect(conn.id);
    conn.finish(last);
    let _ = writer.join();
    let _ = shutdown(&conn.stream, Shutdown::Both);
    tracing::debug!(pid = conn.cred.pid, "channel client disconnected");
}

/// Answers the hello, with the shared-memory rings if the client asked
/// for them (and we grant them), and returns the ring acks come through,
/// and whether requests may come through it too (`shm_requests`, granted
/// with the rings whenever asked).
fn welcome(
    shared: &Shared,
    conn: &Conn,
    shm_notices: bool,
    shm_requests: bool,
) -> Option<(Receiver, bool)> {
    let rings = (shm_notices && shared.notices == NoticePath::Shm)
        .then(|| {
            server_rings()
                .inspect_err(|e| {
                    tracing::warn!(
                        pid = conn.cred.pid,
                        error = %e,
                        "cannot set up shared-memory notices; this client gets them on \
                         the socket"
                    );
                })
                .ok()
        })
        .flatten();
    let (fds, ends) = match rings {
        Some((fds, tx, rx)) => (fds, Some((tx, rx))),
        None => (Vec::new(), None),
    };
    conn.push(
        Message::Welcome {
            protocol: PROTOCOL_VERSION,
            pid: shared.pid,
            shm_notices: ends.as_ref().map(|_| NOTICE_RING_BYTES as u32),
            shm_requests: shm_requests && ends.is_some(),
            restarts: shared.restarts,
        },
        fds,
        shared.max_queued,
    );
    ends.map(|(tx, rx)| {
        conn.set_notice_ring(tx, shm_requests);
        (rx, shm_requests)
    })
}

/// A request taken from the ring that waits for the socket messages the
/// client sent before it: their count, and the request.
type Held = Option<(u64, Message)>;

/// Reads the hello and answers it: the ring acks (and requests, if
/// granted) come through, if any; `Err` with how the session ends.
fn handshake(
    shared: &Shared,
    conn: &Conn,
) -> Result<Option<(Receiver, bool)>, Result<(), Message>> {
    let deadline = crate::deadline_in(shared.handshake_timeout);
    match recv_message(&conn.stream, Some(deadline), shared.recv_limits) {
        Ok((
            Message::Hello {
                protocol,
                shm_notices,
                shm_requests,
                ..
            },
            fds,
        )) if fds.is_empty() => {
            if protocol != PROTOCOL_VERSION {
                return Err(Err(error_frame(
                    None,
                    "unsupported_protocol",
                    format!(
                        "the client speaks protocol {protocol}, this server speaks \
                         {PROTOCOL_VERSION}; use the same cuda-ipc version on both sides"
                    ),
                )));
            }
            Ok(welcome(shared, conn, shm_notices, shm_requests))
        }
        Ok((message, fds)) => Err(Err(fatal(
            conn,
            &ChannelError::protocol(if fds.is_empty() {
                format!(
                    "expected a \"hello\" message first, got {:?}",
                    message.type_name()
                )
            } else {
                "clients must not send file descriptors".into()
            }),
        ))),
        Err(e) => Err(end_of_session(conn, &e)),
    }
}

/// Serves one connection after its handshake until it ends: `rings`, the
/// ring the client acks through, when it asked for one, and whether
/// requests may come through it too. `Err` carries the error message to
/// send before closing.
pub(super) fn session(
    shared: &Shared,
    conn: &Conn,
    rings: Option<(Receiver, bool)>,
) -> Result<(), Message> {
    let (mut acks, requests) = match rings {
        Some((rx, granted)) => (Some(rx), granted),
        None => (None, false),
    };
    // Socket messages read since the hello, for the order of requests.
    let mut socket_in = 0u64;
    let mut held: Held = None;
    let mut record = Vec::new();
    let mut backoff = Backoff::default();
    // Another user's client pays for the processor time its messages
    // take, the spins that wait for them included.
    let mut meter = shared.cpu_meter(conn.cred.uid);
    loop {
        if let Some(m) = meter.as_mut() {
            m.charge_and_wait(|| conn.open());
        }
        conn.wait_for_room(RESPONSE_WINDOW);
        // A connection that holds nothing may stay silent only so long.
        let idle = lock(&shared.state).leases_of(conn.id) == 0;
        let deadline = idle.then(|| crate::deadline_in(shared.idle_timeout));
        if let Some(rx) = acks.as_mut() {
            // Acks first: an ack sent before a release is applied before it.
            let ring = Ring {
                requests,
                socket_in,
            };
            if take_ring(shared, conn, rx, &mut record, ring, &mut held)? {
                *lock(&conn.active) = Instant::now();
                // A request was served: the window above, then the next.
                if held.is_none() {
                    continue;
                }
            }
        }
        // A held request waits for the socket: read it at once.
        if held.is_none() {
            spin(shared, conn, acks.as_mut(), &mut backoff, deadline);
            if let Some(rx) = acks.as_mut() {
                match rx.wait(Duration::ZERO, deadline, Some(conn.stream.as_fd())) {
                    Ok(Ready::Ring) => continue,
                    // The socket has a message (or hung up), or the idle
                    // deadline passed: the receive below tells which.
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(pid = conn.cred.pid, error = %e, "channel connection failed");
                        return Ok(());
                    }
                }
            }
        }
        match recv_message(&conn.stream, deadline, shared.recv_limits) {
            Ok((message, fds)) => {
                socket_in += 1;
                *lock(&conn.active) = Instant::now();
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
            Err(ChannelError::Timeout { .. }) if idle => {
                tracing::debug!(pid = conn.cred.pid, "closing an idle channel connection");
                return Err(error_frame(
                    None,
                    "idle",
                    format!(
                        "closing this connection: it held no lease and sent nothing for {:?} \
                         (ServerConfig::idle_timeout); reconnect when needed",
                        shared.idle_timeout
                    ),
                ));
            }
            Err(e) => return end_of_session(conn, &e),
        }
    }
}

/// Every wait for the client's next message follows one (the hello, a
/// request, acks): it first polls without sleeping for up to
/// `shared.spin`, so that a message following closely is taken without a
/// wake-up. A silent client costs at most one spin; one whose messages do
/// not come within the spin soon costs one in 64 waits ([`Backoff`]); and
/// no more readers spin at once than [`Spinners`](crate::spin::Spinners) allows (the others
/// sleep at once), so clients cannot make the server spin on more cores
/// than that; other users' connections, no more than half as many
/// ([`Spinners`](crate::spin::Spinners)). Returns when something came or
/// the spin is over; the wait proper follows.
fn spin(
    shared: &Shared,
    conn: &Conn,
    acks: Option<&mut Receiver>,
    backoff: &mut Backoff,
    deadline: Option<Instant>,
) {
    let budget = backoff.next(shared.spin);
    if budget.is_zero() {
        return;
    }
    let Some(_slot) = shared.spinners.try_enter(conn.cred.uid != shared.uid) else {
        return;
    };
    let began = Instant::now();
    let end = deadline.map_or(began + budget, |d| d.min(began + budget));
    let caught = match acks {
        Some(rx) => matches!(
            rx.wait(budget, Some(end), Some(conn.stream.as_fd())),
            Ok(Ready::Ring | Ready::Other)
        ),
        None => spin_until_readable(conn.stream.as_fd(), end),
    };
    // A spin cut short by the idle deadline caught nothing.
    backoff.record(budget, if caught { began.elapsed() } else { budget });
}

/// What the reader knows of the client's order when it reads the ring.
#[derive(Clone, Copy)]
struct Ring {
    /// Whether the client was granted requests through it.
    requests: bool,
    /// Socket messages read since the hello.
    socket_in: u64,
}

/// Takes what the client put in the ring: acks, applied as they come (at
/// most a ring's worth, so that a client writing as fast as we read
/// cannot hold the reader), and, when it was granted them, one request
/// per call (so that the window on answers is checked between requests),
/// served only once the socket messages the client sent before it were
/// read (else it is `held` for later). Whether anything was taken.
/// Anything but a well-formed ack or such a request ends the connection.
fn take_ring(
    shared: &Shared,
    conn: &Conn,
    rx: &mut Receiver,
    record: &mut Vec<u8>,
    ring: Ring,
    held: &mut Held,
) -> Result<bool, Message> {
    if let Some((after, _)) = held {
        if *after > ring.socket_in {
            return Ok(false);
        }
        if let Some((_, request)) = held.take() {
            shared.handle(conn, request)?;
        }
        return Ok(true);
    }
    let mut any = false;
    for _ in 0..NOTICE_RING_BYTES / 8 {
        match rx.recv(record) {
            Ok(true) => any = true,
            Ok(false) => break,
            Err(e) => return Err(fatal(conn, &shm_error(e))),
        }
        match decode_ack_record(record, shared.recv_limits.max_payload) {
            Ok((_, Message::Ack { lease, slot, seq })) => shared.ack(conn, lease, slot, seq)?,
            Ok((after, request)) if ring.requests && is_ring_request(&request) => {
                if after > ring.socket_in {
                    *held = Some((after, request));
                } else {
                    shared.handle(conn, request)?;
                }
                return Ok(true);
            }
            Ok((_, other)) => {
                let carries = if ring.requests {
                    "acks, pings, attaches and releases"
                } else {
                    "only acks"
                };
                return Err(fatal(
                    conn,
                    &ChannelError::protocol(format!(
                        "a {:?} message came through the shared-memory ring, which carries \
                         {carries}",
                        other.type_name()
                    )),
                ));
            }
            Err(e) => return Err(fatal(conn, &e)),
        }
    }
    Ok(any)
}

/// Classifies a receive error: a quiet end, or an error message to send.
pub(super) fn end_of_session(conn: &Conn, e: &ChannelError) -> Result<(), Message> {
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

/// Logs a client's protocol error and builds the error message for it.
pub(super) fn fatal(conn: &Conn, e: &ChannelError) -> Message {
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
    pub(super) fn disconnect(&self, conn: u64) {
        let mut st = lock(&self.state);
        if let Some(c) = st.conns.remove(&conn)
            && c.unread_fds() > 0
        {
            // Its peer still has descriptors of ours to read: they count
            // against our user's limit until it does, so the connection
            // keeps counting too (see `State::lingering`).
            tracing::debug!(
                pid = c.cred.pid,
                uid = c.cred.uid,
                "a connection ended with descriptors unread; it counts until they are read"
            );
            st.lingering.push(c);
        }
        let leases = st.by_conn.remove(&conn).unwrap_or_default();
        for lease in leases {
            st.end_lease(lease);
        }
        st.compact();
        drop(st);
        self.changed.notify_all();
        self.connection_closed(conn);
    }

    /// Answers one request. `Err` ends the connection with that message.
    pub(super) fn handle(&self, conn: &Conn, message: Message) -> Result<(), Message> {
        let reply = |m: Message| {
            conn.push(m, Vec::new(), self.max_queued);
        };
        match message {
            Message::Ping { id } => reply(Message::Pong { id }),
            Message::Attach { id, name } | Message::AttachRing { id, name }
                if validate_entry_name(&name).is_err() =>
            {
                reply(invalid_name(id, &name));
            }
            Message::List {
                id,
                after: Some(after),
            } if after.len() > MAX_ENTRY_NAME_LEN => reply(invalid_name(id, &after)),
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
            Message::Call { id, method, body } => self.call(conn, id, &method, &body),
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

    pub(super) fn listing(&self, id: u64, after: Option<&str>) -> Message {
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
            if name.starts_with(crate::UNLISTED_ENTRY_PREFIX) {
                continue;
            }
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
                meta: serde_json::Value::clone(&e.meta),
            });
        }
        Message::Listing { id, entries, next }
    }

    /// The id of the entry `name` that `conn` may take a new lease on;
    /// `None` after answering request `id` with the refusal (the
    /// connection's lease limit, or no such entry).
    fn leasable(&self, st: &State, conn: &Conn, id: u64, name: &str) -> Option<u64> {
        if st.leases_of(conn.id) >= self.max_leases {
            conn.push(
                error_frame(
                    Some(id),
                    "too_many_leases",
                    format!(
                        "this connection already holds {} leases, the server's limit; release \
                         leases you no longer use (ServerConfig::max_leases_per_connection)",
                        self.max_leases
                    ),
                ),
                Vec::new(),
                self.max_queued,
            );
            return None;
        }
        if let Some((code, message)) = st.refused.get(name) {
            conn.push(
                error_frame(Some(id), code, message.clone()),
                Vec::new(),
                self.max_queued,
            );
            return None;
        }
        let eid = st.names.get(name).copied();
        if eid.is_none() {
            reply_not_found(conn, id, name, self.max_queued);
        }
        eid
    }

    pub(super) fn attach(&self, conn: &Conn, id: u64, name: &str) {
        let mut st = lock(&self.state);
        let st = &mut *st;
        let Some(eid) = self.leasable(st, conn, id, name) else {
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
        let meta = Arc::clone(&entry.meta);
        let lease = st.grant_lease(eid, conn);
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

    pub(super) fn attach_ring(&self, conn: &Conn, id: u64, name: &str) {
        let mut st = lock(&self.state);
        let st = &mut *st;
        let Some(eid) = self.leasable(st, conn, id, name) else {
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
        let sources = Arc::clone(&ring.sources);
        let meta = Arc::clone(&entry.meta);
        let lease = st.grant_lease(eid, conn);
        conn.push(
            Message::RingAttached {
                id,
                lease,
                slots: sources.len() as u32,
                meta,
            },
            Vec::new(),
            self.max_queued,
        );
        // The slot messages are made by the writer as the client takes
        // them (see `SlotFeed`): nothing is duplicated up front.
        conn.feed(SlotFeed {
            id,
            lease,
            sources,
            next: 0,
        });
    }
}

/// A name as an error message shows it: at most 64 characters, then how
/// long it really was, so that an answer never grows with the request.
pub(super) fn shown(name: &str) -> String {
    const SHOWN: usize = 64;
    match name.char_indices().nth(SHOWN) {
        None => format!("{name:?}"),
        Some((cut, _)) => format!("{:?}... ({} bytes)", &name[..cut], name.len()),
    }
}

/// The answer to a request that names no valid entry.
pub(super) fn invalid_name(id: u64, name: &str) -> Message {
    let why = match validate_entry_name(name) {
        Err(ChannelError::InvalidName { reason, .. }) => reason,
        _ => format!("a name has at most {MAX_ENTRY_NAME_LEN} bytes"),
    };
    error_frame(
        Some(id),
        "invalid_name",
        format!("invalid name {}: {why}", shown(name)),
    )
}

pub(super) fn reply_not_found(conn: &Conn, id: u64, name: &str, max_queued: usize) {
    conn.push(
        error_frame(
            Some(id),
            "not_found",
            format!("no entry named {} is published", shown(name)),
        ),
        Vec::new(),
        max_queued,
    );
}

pub(super) fn dup_all(fds: &[OwnedFd]) -> Result<Vec<OwnedFd>, ChannelError> {
    fds.iter()
        .map(|fd| {
            fd.try_clone()
                .map_err(|e| ChannelError::io("cannot duplicate an entry's file descriptor", e))
        })
        .collect()
}
