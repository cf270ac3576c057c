//! The listening socket: bound here, or taken over from a process before
//! (a keeper's or systemd's file-descriptor store) and checked.

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use rustix::fs::Mode;
use rustix::io::Errno;
use rustix::net::{
    AddressFamily, SocketAddrAny, SocketAddrUnix, SocketFlags, SocketType, bind, socket_with,
};

use super::accept::remove_stale_socket;
use crate::ChannelError;

/// A new socket bound at `path` with mode 0600 (not yet listening).
pub(super) fn bind_new(path: &Path, addr: &SocketAddrUnix) -> Result<OwnedFd, ChannelError> {
    remove_stale_socket(path, addr)?;
    let listener = socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )
    .map_err(|e| ChannelError::io("cannot create a Unix socket", e))?;
    // Linux creates the socket file with the socket inode's mode less the
    // umask: narrowing it first closes the window before the chmod below.
    rustix::fs::fchmod(&listener, Mode::from_raw_mode(0o600))
        .map_err(|e| ChannelError::io("cannot set the mode of the channel socket", e))?;
    match bind(&listener, addr) {
        Ok(()) => Ok(listener),
        Err(Errno::ADDRINUSE) => Err(ChannelError::Busy {
            path: path.to_path_buf(),
        }),
        Err(e) => Err(ChannelError::io(
            format!("cannot bind the channel socket {}", path.display()),
            e,
        )),
    }
}

/// A duplicate of `kept`, checked to be a listening Unix stream socket
/// bound at `path`, made non-blocking.
pub(super) fn adopt(
    kept: &OwnedFd,
    path: &Path,
    addr: &SocketAddrUnix,
) -> Result<OwnedFd, ChannelError> {
    let bad = |why: String| {
        ChannelError::arg(
            "listening socket",
            format!("the socket given for {}: {why}", path.display()),
        )
    };
    let fd = kept
        .try_clone()
        .map_err(|e| ChannelError::io("cannot duplicate the listening socket", e))?;
    let kind =
        rustix::net::sockopt::socket_type(&fd).map_err(|e| bad(format!("not a socket ({e})")))?;
    let listening = rustix::net::sockopt::socket_acceptconn(&fd)
        .map_err(|e| bad(format!("not a socket ({e})")))?;
    if kind != SocketType::STREAM || !listening {
        return Err(bad("not a listening stream socket".into()));
    }
    let bound = rustix::net::getsockname(&fd).map_err(|e| bad(e.to_string()))?;
    if SocketAddrUnix::try_from(bound.clone()).ok().as_ref() != Some(addr) {
        return Err(bad(format!("it is bound elsewhere ({})", describe(&bound))));
    }
    let flags = rustix::fs::fcntl_getfl(fd.as_fd()).map_err(|e| bad(e.to_string()))?;
    rustix::fs::fcntl_setfl(fd.as_fd(), flags | rustix::fs::OFlags::NONBLOCK)
        .map_err(|e| bad(e.to_string()))?;
    Ok(fd)
}

fn describe(addr: &SocketAddrAny) -> String {
    match SocketAddrUnix::try_from(addr.clone()) {
        Ok(u) => u
            .path()
            .map_or_else(|| format!("{u:?}"), |p| p.to_string_lossy().into_owned()),
        Err(_) => format!("{:?}", addr.address_family()),
    }
}
