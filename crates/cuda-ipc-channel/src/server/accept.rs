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

/// Why a new connection from `cred` cannot be served now, if it cannot:
/// the server's, the user's or the process's connection limit.
fn turned_away(shared: &Shared, st: &State, cred: Ucred) -> Option<String> {
    let (uid_conns, pid_conns) = st.conns.values().fold((0, 0), |(u, p), c| {
        (
            u + usize::from(c.cred.uid == cred.uid),
            // Peers in PID namespaces we cannot see all read as pid 0: the
            // per-process limit cannot tell them apart, the per-user one can.
            p + usize::from(cred.pid_visible() && c.cred.pid == cred.pid),
        )
    });
    if st.conns.len() >= shared.max_connections {
        Some(format!(
            "the server already serves {} connections, its limit; close unused clients \
             or raise ServerConfig::max_connections",
            shared.max_connections
        ))
    } else if uid_conns >= shared.max_per_uid {
        Some(format!(
            "user {} already has {uid_conns} connections to this server, its limit; close \
             unused clients or raise ServerConfig::max_connections_per_uid",
            cred.uid
        ))
    } else if pid_conns >= shared.max_per_pid {
        Some(format!(
            "process {} already has {pid_conns} connections to this server, its limit; share \
             one Client between threads or raise ServerConfig::max_connections_per_pid",
            cred.pid
        ))
    } else {
        None
    }
}

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
        let full = turned_away(shared, &st, cred);
        if let Some(why) = full {
            drop(st);
            tracing::warn!(
                pid = cred.pid,
                uid = cred.uid,
                "turned away a client: {why}"
            );
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
