//! Binding and accepting: the stale socket check, the accept loop, admission.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, poll};
use rustix::fs::FileType;
use rustix::io::Errno;
use rustix::net::{
    AddressFamily, Shutdown, SocketAddrUnix, SocketFlags, SocketType, accept_with, connect,
    shutdown, socket_with,
};
use serde_json::json;

use crate::socket::{Ucred, peer_credentials, send_message};
use crate::wire::Message;
use crate::{ChannelError, Side, lock, refused_text};

use super::conn::{Conn, ConnLimits, Outbox};
use super::session::serve;
use super::state::State;
use super::{REFUSE_SEND_TIMEOUT, Shared, error_frame};

/// Removes a socket file that nothing listens on; refuses anything else.
pub(super) fn remove_stale_socket(path: &Path, addr: &SocketAddrUnix) -> Result<(), ChannelError> {
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

pub(super) fn accept_loop(shared: &Arc<Shared>, listener: &OwnedFd) {
    loop {
        let accepting = shared.accepting.load(std::sync::atomic::Ordering::SeqCst);
        let mut fds = [
            PollFd::new(
                listener,
                if accepting {
                    PollFlags::IN
                } else {
                    PollFlags::empty()
                },
            ),
            PollFd::new(&shared.wake, PollFlags::IN),
        ];
        // Wake once a second to let go of lingering connections whose
        // descriptors have been read.
        let second = rustix::event::Timespec {
            tv_sec: 1,
            tv_nsec: 0,
        };
        match poll(&mut fds, Some(&second)) {
            Ok(_) | Err(Errno::INTR) => {}
            Err(e) => {
                tracing::warn!(error = %e, "poll on the listening socket failed");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        if fds[1].revents().contains(PollFlags::IN) {
            // Told to start accepting (or to stop): read the count back,
            // or every poll would return at once.
            let mut count = [0u8; 8];
            let _ = rustix::io::read(&shared.wake, &mut count);
        }
        {
            let mut st = lock(&shared.state);
            if st.closed {
                return;
            }
            st.reap_lingering();
        }
        if !accepting {
            continue;
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

/// Why a new connection from `cred` cannot be served now, if it cannot:
/// the server's, the user's or the process's connection limit, counting
/// the connections that linger with descriptors unread (see
/// `State::lingering`). Before refusing at the global or the per-user
/// limit, the oldest idle connection (no lease, nothing in transit) of the
/// user with the most connections, or of this user at its own limit, is
/// closed to make room: idle connections cannot starve anyone. Connections
/// of other users than the server's leave
/// [`ServerConfig::reserved_connections`](super::ServerConfig::reserved_connections)
/// free for the server's own user.
fn turned_away(shared: &Shared, st: &mut State, cred: Ucred) -> Option<String> {
    st.reap_lingering();
    let own = crate::own_uid();
    loop {
        let (mut total, mut others, mut uid_conns, mut pid_conns, mut lingering) = (0, 0, 0, 0, 0);
        for c in st.counted_conns() {
            total += 1;
            others += usize::from(c.cred.uid != own);
            uid_conns += usize::from(c.cred.uid == cred.uid);
            // Peers in PID namespaces we cannot see all read as pid 0: the
            // per-process limit cannot tell them apart, the per-user one can.
            pid_conns += usize::from(cred.pid_visible() && c.cred.pid == cred.pid);
            lingering += usize::from(c.cred.uid == cred.uid && !st.conns.contains_key(&c.id));
        }
        let why = if pid_conns >= shared.max_per_pid {
            // A process at its own limit makes no room at others' expense.
            return Some(format!(
                "process {} already has {pid_conns} connections to this server, its limit{}; \
                 share one Client between threads or raise \
                 ServerConfig::max_connections_per_pid",
                cred.pid,
                lingering_note(lingering)
            ));
        } else if uid_conns >= shared.max_per_uid {
            Some((
                Some(cred.uid),
                format!(
                    "user {} already has {uid_conns} connections to this server, its limit{}; \
                     close unused clients or raise ServerConfig::max_connections_per_uid",
                    cred.uid,
                    lingering_note(lingering)
                ),
            ))
        } else if total >= shared.max_connections {
            Some((
                None,
                format!(
                    "the server already serves {total} connections, its limit; close unused \
                     clients or raise ServerConfig::max_connections"
                ),
            ))
        } else if cred.uid != own && others + shared.reserved >= shared.max_connections {
            Some((
                None,
                format!(
                    "the server's other users hold {others} connections; the last {} of its \
                     {} are kept for the server's own user (ServerConfig::reserved_connections)",
                    shared.reserved, shared.max_connections
                ),
            ))
        } else {
            None
        };
        let (victim_uid, why) = why?;
        let victim_uid = victim_uid.or_else(|| biggest_other_user(st, cred.uid, own));
        let Some(uid) = victim_uid else {
            return Some(why);
        };
        if !evict_oldest_idle(shared, st, uid) {
            return Some(why);
        }
    }
}

/// ", N of them ended with descriptors unread", or nothing.
fn lingering_note(n: usize) -> String {
    if n == 0 {
        String::new()
    } else {
        format!(
            " ({n} of them ended but their process has not read the descriptors sent to them; \
             they count until it does or closes them)"
        )
    }
}

/// The user (other than `uid`) with more connections than `uid`, the most
/// of all: where an idle connection is taken from when the server is full.
/// The server's own user is never taken from for another user.
fn biggest_other_user(st: &State, uid: u32, own: u32) -> Option<u32> {
    let mut counts = std::collections::HashMap::<u32, usize>::new();
    for c in st.conns.values() {
        *counts.entry(c.cred.uid).or_default() += 1;
    }
    let mine = counts.get(&uid).copied().unwrap_or(0);
    counts
        .into_iter()
        .filter(|&(u, n)| u != uid && n > mine && !(u == own && uid != own))
        .max_by_key(|&(u, n)| (n, std::cmp::Reverse(u)))
        .map(|(u, _)| u)
}

/// Closes the oldest idle connection of `uid` (holding no lease, nothing
/// in transit, silent for at least a second) with an `evicted` error;
/// whether there was one.
fn evict_oldest_idle(shared: &Shared, st: &mut State, uid: u32) -> bool {
    let now = Instant::now();
    let victim = st
        .conns
        .values()
        .filter(|c| c.cred.uid == uid && st.leases_of(c.id) == 0)
        .map(|c| (*lock(&c.active), c))
        .filter(|(at, c)| now.duration_since(*at) >= EVICTABLE_AFTER && c.quiet())
        .min_by_key(|(at, _)| *at)
        .map(|(at, c)| (at, Arc::clone(c)));
    let Some((at, conn)) = victim else {
        return false;
    };
    st.conns.remove(&conn.id);
    st.by_conn.remove(&conn.id);
    if shared.evict_log.take(now).is_some() {
        tracing::info!(
            pid = conn.cred.pid,
            uid,
            "closing the oldest idle connection of a user at a connection limit"
        );
    }
    conn.finish(Some(error_frame(
        None,
        "evicted",
        format!(
            "closing this connection: it held no lease and was idle for {:?} while the \
             server was at a connection limit and another client needed the room; reconnect \
             when needed",
            now.duration_since(at)
        ),
    )));
    // The reader sees end of file and ends the session.
    let _ = shutdown(&conn.stream, Shutdown::Read);
    true
}

/// How long a connection must have been silent to be closed to make room.
const EVICTABLE_AFTER: Duration = Duration::from_secs(1);

/// Checks a new connection's credentials and starts serving it.
pub(super) fn admit(shared: &Arc<Shared>, stream: UnixStream) {
    let cred = match peer_credentials(&stream) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "dropping a connection whose credentials are unreadable");
            return;
        }
    };
    if !shared.allowed_uids.contains(&cred.uid) {
        if let Some(suppressed) = shared.refusal_log.take(Instant::now()) {
            tracing::warn!(
                uid = cred.uid,
                pid = cred.pid,
                allowed = ?shared.allowed_uids,
                path = %shared.path.display(),
                suppressed,
                "refused a channel connection from a user that is not allowed \
                 ({suppressed} more refusals in the last second not logged)"
            );
        }
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
        let full = turned_away(shared, &mut st, cred);
        if let Some(why) = full {
            drop(st);
            if let Some(suppressed) = shared.busy_log.take(Instant::now()) {
                tracing::warn!(
                    pid = cred.pid,
                    uid = cred.uid,
                    suppressed,
                    "turned away a client: {why} ({suppressed} more turned away in the last \
                     second not logged)"
                );
            }
            let busy = error_frame(None, "busy", why);
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
            limits: ConnLimits {
                max_queued: shared.max_queued,
                max_queued_bytes: shared.max_queued_bytes,
                max_unread_fds: shared.max_unread_fds,
                send_timeout: shared.send_timeout,
            },
            out: Mutex::new(Outbox::new()),
            out_ready: Condvar::new(),
            active: Mutex::new(Instant::now()),
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

/// At most one log line a second for a kind of event, with the count of
/// those not logged: a flood of refused connections must not flood the log.
pub(super) struct LogLimit(Mutex<(Option<Instant>, u64)>);

impl LogLimit {
    pub(super) const fn new() -> LogLimit {
        LogLimit(Mutex::new((None, 0)))
    }

    /// `Some(events not logged since the last line)` when this event may be
    /// logged, `None` when it is only counted.
    pub(super) fn take(&self, now: Instant) -> Option<u64> {
        let mut g = lock(&self.0);
        let (last, skipped) = &mut *g;
        match last {
            Some(t) if now.saturating_duration_since(*t) < Duration::from_secs(1) => {
                *skipped += 1;
                None
            }
            _ => {
                *last = Some(now);
                Some(std::mem::take(skipped))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_logs_one_line_a_second_with_the_count() {
        let limit = LogLimit::new();
        let t0 = Instant::now();
        assert_eq!(limit.take(t0), Some(0));
        let logged = (1..10_000u64)
            .filter_map(|i| limit.take(t0 + Duration::from_micros(100 * i)))
            .count();
        assert_eq!(
            logged, 0,
            "10,000 refusals in a second logged more than one line"
        );
        assert_eq!(limit.take(t0 + Duration::from_secs(1)), Some(9_999));
        assert_eq!(limit.take(t0 + Duration::from_millis(1500)), None);
        assert_eq!(limit.take(t0 + Duration::from_secs(3)), Some(1));
    }
}
