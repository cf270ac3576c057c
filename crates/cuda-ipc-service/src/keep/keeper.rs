//! The keeper: a small process that holds the serving process's
//! descriptors (its chunks, its catalog image, its listening socket) and
//! runs it again when it dies. It speaks systemd's file-descriptor store
//! protocol (see [`store`](super::store)), so the service does the same
//! under systemd and under a keeper.
//!
//! It is the one process whose death loses the weights, so it is kept
//! small: no CUDA (it never loads the driver), no parsing of clients'
//! input (only `KEY=VALUE` notifications, and only from the serving
//! process it started, checked by the kernel's `SCM_CREDENTIALS`: same uid,
//! same pid), no threads.
#![allow(unsafe_code)] // `pre_exec`, which places the descriptors for the child; justified there

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::time::Duration;

use rustix::fs::Mode;
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SocketAddrUnix, SocketFlags, SocketType, bind, recvmsg, socket_with,
};

use super::store::{LISTEN_FDNAMES, LISTEN_FDS, LISTEN_PID, NOTIFY_SOCKET};

/// The most descriptors a keeper holds (systemd's `FileDescriptorStoreMax`
/// is the same idea).
pub const MAX_KEPT: usize = 4096;

/// How many times in a row the serving process may die before it says it
/// serves, before the keeper gives up.
pub const MAX_FAILED_STARTS: u32 = 5;

/// The longest notification a keeper reads.
const MAX_NOTIFICATION: usize = 4096;

/// What happened, for the caller's log.
#[derive(Debug)]
#[non_exhaustive]
pub enum KeeperEvent {
    /// A serving process began: started with this many descriptors, or a
    /// standby that was handed them.
    Started {
        /// Its pid.
        pid: u32,
        /// Descriptors handed to it.
        fds: usize,
    },
    /// A standby serving process was started ahead, to take over.
    Standby {
        /// Its pid.
        pid: u32,
    },
    /// It said it serves (`READY=1`), this long after it started (or, for
    /// a standby, after it was handed the descriptors).
    Ready {
        /// Its pid.
        pid: u32,
        /// From its start.
        after: Duration,
    },
    /// It died or exited.
    Exited {
        /// Its pid.
        pid: u32,
        /// How.
        status: ExitStatus,
        /// Whether the keeper runs it again.
        restart: bool,
    },
    /// A notification refused: from another process, malformed, or over
    /// the limit; its descriptors were closed.
    Refused {
        /// Why.
        why: String,
    },
}

/// How [`Keeper::supervise`] ended.
#[derive(Debug)]
#[non_exhaustive]
pub enum KeeperExit {
    /// The serving process stopped on purpose (a clean stop, or the
    /// keeper's own stop): the kept descriptors were closed.
    Stopped(ExitStatus),
    /// It died [`MAX_FAILED_STARTS`] times in a row before serving, or
    /// refused its arguments: not run again.
    GaveUp(ExitStatus),
}

/// Holds the serving process's descriptors and runs it (see the module
/// docs).
#[derive(Debug)]
pub struct Keeper {
    pub(super) socket: OwnedFd,
    path: PathBuf,
    pub(super) kept: Vec<(String, OwnedFd)>,
    uid: u32,
    /// Whether a standby serving process is kept started ahead.
    pub(super) standby: bool,
}

/// Whether `name` is one a store accepts: 1 to 255 printable ASCII
/// characters, no `:` (the separator of `$LISTEN_FDNAMES`).
fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 255 && name.bytes().all(|b| b.is_ascii_graphic() && b != b':')
}

impl Keeper {
    /// A keeper whose notification socket is `path` (mode 0600; a stale
    /// socket file there is replaced).
    ///
    /// # Errors
    /// The socket's.
    pub fn bind(path: &Path) -> io::Result<Keeper> {
        let socket = socket_with(
            AddressFamily::UNIX,
            SocketType::DGRAM,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            None,
        )?;
        rustix::fs::fchmod(&socket, Mode::from_raw_mode(0o600))?;
        rustix::net::sockopt::set_socket_passcred(&socket, true)?;
        match std::fs::symlink_metadata(path) {
            Ok(m) if std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()) => {
                std::fs::remove_file(path)?;
            }
            _ => {}
        }
        bind(&socket, &SocketAddrUnix::new(path)?)?;
        Ok(Keeper {
            socket,
            path: path.to_path_buf(),
            kept: Vec::new(),
            uid: rustix::process::geteuid().as_raw(),
            standby: false,
        })
    }

    /// Keeps a standby serving process started ahead (with its CUDA
    /// context made, which is most of a start: about 0.2 s on an H100),
    /// waiting for the descriptors: when the one serving dies, the standby
    /// takes over at once. Costs a second process's context on the device
    /// while it waits.
    #[must_use]
    pub fn with_standby(mut self, on: bool) -> Keeper {
        self.standby = on;
        self
    }

    /// The kept descriptors as [`Keeper::spawn`] takes them.
    pub(super) fn kept_list(&self) -> Vec<(&str, &OwnedFd)> {
        self.kept.iter().map(|(n, fd)| (n.as_str(), fd)).collect()
    }

    /// The notification socket's path (`$NOTIFY_SOCKET` of the child).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The names of what it keeps, in the order it got them.
    pub fn names(&self) -> Vec<&str> {
        self.kept.iter().map(|(n, _)| n.as_str()).collect()
    }

    /// Starts `command` with `$NOTIFY_SOCKET` and `fds` as 3, 4, ...
    /// named in `$LISTEN_FDNAMES`.
    pub(super) fn spawn(
        &self,
        command: &mut Command,
        fds: &[(&str, &OwnedFd)],
    ) -> io::Result<Child> {
        let names: Vec<&str> = fds.iter().map(|(n, _)| *n).collect();
        command
            .env(NOTIFY_SOCKET, &self.path)
            .env(LISTEN_FDS, names.len().to_string())
            .env(LISTEN_FDNAMES, names.join(":"))
            .env_remove(LISTEN_PID);
        let sources: Vec<RawFd> = fds.iter().map(|(_, fd)| fd.as_raw_fd()).collect();
        let mut scratch: Vec<RawFd> = vec![-1; sources.len()];
        let above = sources
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
            .max(2 + sources.len() as RawFd)
            + 1;
        // SAFETY: the closure runs in the child between fork and exec and
        // calls only fcntl and dup2 (async-signal-safe), on descriptors the
        // keeper owns, writing into memory allocated before the fork: first
        // out of the way (above every source and target, close-on-exec),
        // then onto 3, 4, ... (dup2 clears close-on-exec there).
        unsafe {
            command.pre_exec(move || {
                for (i, &fd) in sources.iter().enumerate() {
                    let moved = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, above);
                    if moved < 0 {
                        return Err(io::Error::last_os_error());
                    }
                    scratch[i] = moved;
                }
                for (i, &fd) in scratch.iter().enumerate() {
                    if libc::dup2(fd, 3 + i as RawFd) < 0 {
                        return Err(io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        command.spawn()
    }

    /// Reads one notification if one waits: `None` when none does.
    pub(super) fn receive(
        &mut self,
        child: u32,
        events: &mut dyn FnMut(KeeperEvent),
    ) -> io::Result<Option<Notification>> {
        let mut buf = [0u8; MAX_NOTIFICATION];
        let mut space =
            [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(253), ScmCredentials(1))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let got = match recvmsg(
            &self.socket,
            &mut [io::IoSliceMut::new(&mut buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT,
        ) {
            Ok(r) => r,
            Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let mut fds: Vec<OwnedFd> = Vec::new();
        let mut sender = None;
        for m in control.drain() {
            match m {
                RecvAncillaryMessage::ScmRights(r) => fds.extend(r),
                RecvAncillaryMessage::ScmCredentials(c) => sender = Some(c),
                _ => {}
            }
        }
        let mut refuse = |why: String| {
            events(KeeperEvent::Refused { why });
            Ok(Some(Notification::default()))
        };
        match sender {
            Some(c)
                if c.uid.as_raw() == self.uid && c.pid.as_raw_nonzero().get() as u32 == child => {}
            Some(c) => {
                return refuse(format!(
                    "a notification from pid {} uid {}, not the serving process (pid {child}, uid {})",
                    c.pid.as_raw_nonzero(),
                    c.uid.as_raw(),
                    self.uid
                ));
            }
            None => return refuse("a notification without credentials".into()),
        }
        if got
            .flags
            .intersects(ReturnFlags::TRUNC | ReturnFlags::CTRUNC)
        {
            return refuse("a notification cut short (too long, or too many descriptors)".into());
        }
        let Ok(text) = std::str::from_utf8(&buf[..got.bytes]) else {
            return refuse("a notification that is not UTF-8".into());
        };
        let n = Notification::parse(text);
        if n.store || n.remove {
            let Some(name) = n.name.as_deref().filter(|n| valid_name(n)) else {
                return refuse(format!(
                    "FDSTORE or FDSTOREREMOVE without a valid FDNAME: {text:?}"
                ));
            };
            if n.remove {
                self.kept.retain(|(k, _)| k != name);
            }
            if n.store {
                if self.kept.len() + fds.len() > MAX_KEPT {
                    return refuse(format!(
                        "{name}: the keeper holds {} descriptors already, {MAX_KEPT} at most",
                        self.kept.len()
                    ));
                }
                self.kept
                    .extend(fds.into_iter().map(|fd| (name.to_string(), fd)));
            }
        }
        Ok(Some(n))
    }
}

/// What a notification says (the keys a keeper acts on: one flag each).
#[derive(Debug, Default)]
#[allow(clippy::struct_excessive_bools)]
pub(super) struct Notification {
    store: bool,
    remove: bool,
    name: Option<String>,
    pub(super) ready: bool,
    pub(super) stopping: bool,
}

impl Notification {
    fn parse(text: &str) -> Notification {
        let mut n = Notification::default();
        for line in text.lines() {
            match line.split_once('=') {
                Some(("FDSTORE", "1")) => n.store = true,
                Some(("FDSTOREREMOVE", "1")) => n.remove = true,
                Some(("FDNAME", name)) => n.name = Some(name.to_string()),
                Some(("READY", "1")) => n.ready = true,
                Some(("STOPPING", "1")) => n.stopping = true,
                _ => {}
            }
        }
        n
    }
}

/// How a child's exit reads in a log line.
pub fn exit_text(status: &ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit {c}"),
        (None, Some(s)) => format!("signal {s}"),
        _ => status.to_string(),
    }
}

impl AsFd for Keeper {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.socket.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notifications_are_read_key_by_key_and_unknown_keys_ignored() {
        let n = Notification::parse("FDSTORE=1\nFDNAME=chunk.3\nSTATUS=x\nREADY=1\n");
        assert!(n.store && n.ready && !n.remove && !n.stopping);
        assert_eq!(n.name.as_deref(), Some("chunk.3"));
        let n = Notification::parse("FDSTOREREMOVE=1\nFDNAME=catalog.2\nSTOPPING=1");
        assert!(n.remove && n.stopping && !n.store);
        let n = Notification::parse("FDSTORE=0\nREADY=yes\n=\n\n");
        assert!(!n.store && !n.ready && n.name.is_none());
    }

    #[test]
    fn names_are_printable_ascii_without_colons() {
        for good in ["chunk.0", "catalog.12", "socket", &"x".repeat(255)] {
            assert!(valid_name(good), "{good}");
        }
        for bad in ["", "a:b", "a b", "é", "a\nb", &"x".repeat(256)] {
            assert!(!valid_name(bad), "{bad:?}");
        }
    }

    /// Sends `text` with `fds` to the keeper at `path`, as a serving
    /// process does.
    fn notify(path: &Path, text: &str, fds: &[std::os::fd::BorrowedFd<'_>]) {
        let sock = socket_with(
            AddressFamily::UNIX,
            SocketType::DGRAM,
            SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
        let mut control = rustix::net::SendAncillaryBuffer::new(&mut space);
        assert!(control.push(rustix::net::SendAncillaryMessage::ScmRights(fds)));
        rustix::net::sendmsg_addr(
            &sock,
            &SocketAddrUnix::new(path).unwrap(),
            &[io::IoSlice::new(text.as_bytes())],
            &mut control,
            rustix::net::SendFlags::empty(),
        )
        .unwrap();
    }

    #[test]
    fn descriptors_are_kept_only_from_the_serving_process() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k.sock");
        let mut keeper = Keeper::bind(&path).unwrap();
        let memfd = rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        let me = std::process::id();
        let mut refused = Vec::new();
        // From another process than the one it serves: refused, closed.
        notify(&path, "FDSTORE=1\nFDNAME=chunk.0\n", &[memfd.as_fd()]);
        let n = keeper
            .receive(me + 1, &mut |e| refused.push(format!("{e:?}")))
            .unwrap();
        assert!(n.is_some() && keeper.names().is_empty(), "{refused:?}");
        assert!(
            refused[0].contains("not the serving process"),
            "{refused:?}"
        );
        // From it: kept; a bad name is refused; a removal lets go.
        notify(&path, "FDSTORE=1\nFDNAME=chunk.0\n", &[memfd.as_fd()]);
        notify(&path, "FDSTORE=1\nFDNAME=a:b\n", &[memfd.as_fd()]);
        let mut events = |e: KeeperEvent| refused.push(format!("{e:?}"));
        while keeper.receive(me, &mut events).unwrap().is_some() {}
        assert_eq!(keeper.names(), ["chunk.0"]);
        assert!(refused[1].contains("without a valid FDNAME"), "{refused:?}");
        notify(&path, "FDSTOREREMOVE=1\nFDNAME=chunk.0\n", &[]);
        while keeper.receive(me, &mut |_| {}).unwrap().is_some() {}
        assert!(keeper.names().is_empty());
    }

    #[test]
    fn a_keeper_binds_a_private_socket_and_replaces_a_stale_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k.sock");
        let first = Keeper::bind(&path).unwrap();
        drop(first);
        let keeper = Keeper::bind(&path).unwrap();
        assert!(keeper.names().is_empty());
        let mode = std::fs::metadata(&path).unwrap();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o077,
            0
        );
    }
}
