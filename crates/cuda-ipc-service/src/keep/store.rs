//! The service's side of a file-descriptor store: systemd's
//! (`FileDescriptorStoreMax=`) or the [`Keeper`](super::Keeper)'s, which
//! speaks the same protocol ([sd_notify(3)]): `FDSTORE=1` with descriptors
//! attached and `FDNAME=` to keep them, `FDSTOREREMOVE=1` to let go, each
//! a datagram to `$NOTIFY_SOCKET`; on the next start the store hands them
//! back as descriptors 3, 4, ... with `$LISTEN_FDS` and `$LISTEN_FDNAMES`
//! ([sd_listen_fds(3)]).
//!
//! Written here on rustix rather than with the `sd-notify` crate, which
//! cannot reach a socket in the abstract namespace (`@...`, as some
//! service managers give) and takes descriptors back only when
//! `$LISTEN_PID` names the process, which a supervisor that is not PID 1
//! cannot set between `fork` and `exec` without unsafe environment writes.
//!
//! [sd_notify(3)]: https://www.freedesktop.org/software/systemd/man/sd_notify.html
//! [sd_listen_fds(3)]: https://www.freedesktop.org/software/systemd/man/sd_listen_fds.html
#![allow(unsafe_code)] // taking descriptors 3.. once, justified there

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicBool, Ordering};

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::net::{
    AddressFamily, SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketAddrUnix,
    SocketFlags, SocketType, sendmsg_addr, socket_with,
};

/// The environment variables of the protocol.
pub const NOTIFY_SOCKET: &str = "NOTIFY_SOCKET";
/// How many descriptors the store handed over.
pub const LISTEN_FDS: &str = "LISTEN_FDS";
/// Their names, `:`-separated.
pub const LISTEN_FDNAMES: &str = "LISTEN_FDNAMES";
/// The process they are for (absent: this one).
pub const LISTEN_PID: &str = "LISTEN_PID";
/// The first descriptor handed over.
const LISTEN_FDS_START: RawFd = 3;

/// The most descriptors one start takes over.
const MAX_LISTEN_FDS: usize = 1 << 16;

/// The largest catalog image read back from the store.
pub(crate) const MAX_IMAGE_BYTES: u64 = 256 << 20;

/// The descriptors 3.. are taken at most once per process.
static TAKEN: AtomicBool = AtomicBool::new(false);

/// Where the service keeps its descriptors, and what it got back at start.
#[derive(Debug, Default)]
pub struct Store {
    /// `$NOTIFY_SOCKET`, if a store listens.
    socket: Option<SocketAddrUnix>,
    /// Descriptors handed over at start, by name, until taken.
    received: Vec<(String, OwnedFd)>,
    /// Names this process knows to be in the store.
    stored: BTreeSet<String>,
}

impl Store {
    /// No store: nothing is kept, nothing comes back.
    pub fn none() -> Store {
        Store::default()
    }

    /// The store of this process's environment: `$NOTIFY_SOCKET` (absent:
    /// none), and the descriptors handed over with `$LISTEN_FDS` and
    /// `$LISTEN_FDNAMES` when `$LISTEN_PID` is absent or this process.
    /// Takes descriptors 3.. at the first call only; a later one finds
    /// none.
    ///
    /// # Errors
    /// A malformed variable, naming it.
    pub fn from_env() -> io::Result<Store> {
        let socket = match std::env::var_os(NOTIFY_SOCKET) {
            None => None,
            Some(s) if s.is_empty() => None,
            Some(s) => Some(notify_address(&s)?),
        };
        let mut received = Vec::new();
        if !TAKEN.swap(true, Ordering::SeqCst) {
            let count = listen_count()?;
            let names = std::env::var(LISTEN_FDNAMES).unwrap_or_default();
            let names: Vec<&str> = if count == 0 {
                Vec::new()
            } else {
                names.split(':').collect()
            };
            if names.len() != count {
                return Err(bad_env(
                    LISTEN_FDNAMES,
                    format!("{} names for {count} descriptors", names.len()),
                ));
            }
            for (i, name) in names.into_iter().enumerate() {
                let raw = LISTEN_FDS_START + i as RawFd;
                // SAFETY: the protocol hands descriptors 3..3+count to this
                // process, open and owned by no one else here; `TAKEN` makes
                // this the only place that takes them, once.
                let fd = unsafe { OwnedFd::from_raw_fd(raw) };
                rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::CLOEXEC)
                    .map_err(|e| io::Error::new(e.kind(), format!("descriptor {raw}: {e}")))?;
                received.push((name.to_string(), fd));
            }
        }
        // A standby: it waits here, its device open, for the keeper to hand
        // it the descriptors when the process serving now dies.
        if let [(name, pair)] = received.as_slice()
            && name == super::handover::HANDOVER_NAME
        {
            received = super::handover::receive(pair)?;
        }
        let stored = received.iter().map(|(n, _)| n.clone()).collect();
        Ok(Store {
            socket,
            received,
            stored,
        })
    }

    /// Whether descriptors handed to this store outlive this process.
    pub fn is_kept(&self) -> bool {
        self.socket.is_some()
    }

    /// The names of the descriptors handed over at start and not yet taken.
    pub fn received_names(&self) -> impl Iterator<Item = &str> {
        self.received.iter().map(|(n, _)| n.as_str())
    }

    /// Takes the listening socket handed over at start, if one was.
    pub(crate) fn take_socket(&mut self) -> Option<OwnedFd> {
        let at = self
            .received
            .iter()
            .position(|(n, _)| n == super::image::SOCKET_NAME)?;
        Some(self.received.remove(at).1)
    }

    /// Takes the descriptors handed over at start.
    pub(crate) fn take_received(&mut self) -> Vec<(String, OwnedFd)> {
        std::mem::take(&mut self.received)
    }

    /// Whether `name` is in the store, as far as this process knows.
    pub(crate) fn holds(&self, name: &str) -> bool {
        self.stored.contains(name)
    }

    /// The names in the store, as far as this process knows.
    pub(crate) fn names(&self) -> impl Iterator<Item = &str> {
        self.stored.iter().map(String::as_str)
    }

    /// Keeps `fd` in the store under `name`.
    pub(crate) fn put(&mut self, name: &str, fd: BorrowedFd<'_>) -> io::Result<()> {
        self.send(&format!("FDSTORE=1\nFDNAME={name}\n"), &[fd])?;
        self.stored.insert(name.to_string());
        Ok(())
    }

    /// Lets the store close what it keeps under `name`.
    pub(crate) fn remove(&mut self, name: &str) -> io::Result<()> {
        self.send(&format!("FDSTOREREMOVE=1\nFDNAME={name}\n"), &[])?;
        self.stored.remove(name);
        Ok(())
    }

    /// Tells the store (and a service manager) that the service serves.
    pub fn ready(&self) -> io::Result<()> {
        self.send(&format!("READY=1\nMAINPID={}\n", std::process::id()), &[])
    }

    /// Tells the store that the service is stopping on purpose.
    pub fn stopping(&self) -> io::Result<()> {
        self.send("STOPPING=1\n", &[])
    }

    fn send(&self, text: &str, fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        let Some(addr) = &self.socket else {
            return Ok(());
        };
        let sock = socket_with(
            AddressFamily::UNIX,
            SocketType::DGRAM,
            SocketFlags::CLOEXEC,
            None,
        )?;
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
            return Err(io::Error::other(
                "too many descriptors for one notification",
            ));
        }
        let sent = sendmsg_addr(
            &sock,
            addr,
            &[io::IoSlice::new(text.as_bytes())],
            &mut control,
            SendFlags::NOSIGNAL,
        )?;
        if sent != text.len() {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "a notification was cut short",
            ));
        }
        Ok(())
    }
}

fn bad_env(var: &str, why: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, format!("${var}: {why}"))
}

/// `$NOTIFY_SOCKET` as an address: a path, or `@name` in the abstract
/// namespace.
fn notify_address(s: &OsString) -> io::Result<SocketAddrUnix> {
    let bytes = s.as_bytes();
    let addr = match bytes.strip_prefix(b"@") {
        Some(name) => SocketAddrUnix::new_abstract_name(name),
        None => SocketAddrUnix::new(bytes),
    };
    addr.map_err(|e| bad_env(NOTIFY_SOCKET, format!("{}: {e}", s.to_string_lossy())))
}

/// How many descriptors were handed over to this process.
fn listen_count() -> io::Result<usize> {
    if let Ok(pid) = std::env::var(LISTEN_PID) {
        let pid: u32 = pid
            .parse()
            .map_err(|_| bad_env(LISTEN_PID, format!("{pid:?} is not a process id")))?;
        if pid != std::process::id() {
            return Ok(0);
        }
    }
    let Ok(count) = std::env::var(LISTEN_FDS) else {
        return Ok(0);
    };
    match count.parse::<usize>() {
        Ok(n) if n <= MAX_LISTEN_FDS => Ok(n),
        _ => Err(bad_env(
            LISTEN_FDS,
            format!("{count:?} is not a count of at most {MAX_LISTEN_FDS}"),
        )),
    }
}

/// A sealed memfd holding `bytes`: no one can change it after this.
pub(crate) fn sealed(name: &str, bytes: &[u8]) -> io::Result<OwnedFd> {
    let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
    let mut done = 0;
    while done < bytes.len() {
        done += rustix::io::write(&fd, &bytes[done..])?;
    }
    rustix::fs::fcntl_add_seals(
        &fd,
        SealFlags::SHRINK | SealFlags::GROW | SealFlags::WRITE | SealFlags::SEAL,
    )?;
    Ok(fd)
}

/// The bytes of a sealed memfd written by [`sealed`]: refused if it is not
/// sealed against writes (someone could still change it) or is larger than
/// [`MAX_IMAGE_BYTES`].
pub(crate) fn read_sealed(fd: impl AsFd) -> io::Result<Vec<u8>> {
    let fd = fd.as_fd();
    let seals = rustix::fs::fcntl_get_seals(fd)?;
    if !seals.contains(SealFlags::WRITE | SealFlags::SHRINK | SealFlags::GROW) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "it is not sealed against writes",
        ));
    }
    read_up_to(fd, MAX_IMAGE_BYTES, "an image")
}

/// The bytes of the file `fd` (read with `pread` from its start): refused
/// if it is larger than `max` bytes, which `what` may have.
pub(crate) fn read_up_to(fd: BorrowedFd<'_>, max: u64, what: &str) -> io::Result<Vec<u8>> {
    let len = rustix::fs::fstat(fd)?.st_size as u64;
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{len} bytes is more than the {max} {what} may have"),
        ));
    }
    let mut out = vec![0; len as usize];
    let mut done = 0;
    while done < out.len() {
        match rustix::io::pread(fd, &mut out[done..], done as u64)? {
            0 => break,
            n => done += n,
        }
    }
    out.truncate(done);
    Ok(out)
}
