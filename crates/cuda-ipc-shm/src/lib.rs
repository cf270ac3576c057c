//! Single-producer single-consumer byte rings in shared memory, for two
//! processes that do not trust each other.
//!
//! An [`Area`] is one sealed memfd that both processes map, holding two
//! rings, one per direction. The process that creates it (the *creator*,
//! for cuda-ipc the channel server) sends the memfd and two eventfds to
//! the other (the *opener*) over a Unix socket; each side then
//! [`split`](Area::split)s the area into its [`Sender`] and its
//! [`Receiver`].
//!
//! # Layout
//! ```text
//! ring 0 (creator -> opener), then ring 1 (opener -> creator), each:
//!   offset  size  field
//!        0     8  magic     b"CIPC-SHM"
//!        8     8  version   1
//!       16     8  capacity  bytes of the data area (a power of two)
//!       64     8  head      bytes ever written (the producer's)
//!      128     8  tail      bytes ever read (the consumer's)
//!      192     8  sleeping  1 while the consumer sleeps (the consumer's)
//!      256  cap.  data      records, wrapping around
//! record: an 8-byte little-endian length (bytes), then the bytes, padded
//! to a multiple of 8 with zeros.
//! ```
//! Each counter sits on its own cache line. Every word is read and written
//! as an atomic (see `map.rs`), so a peer that writes concurrently causes
//! no undefined behaviour.
//!
//! # Hostile peers
//! The peer can write anything anywhere in the area at any time. Each side
//! keeps its own copy of what it owns (the producer its head, the consumer
//! its tail, both the capacity, checked once when mapping) and never reads
//! it back from shared memory. A reader loads the peer's counter once per
//! record, checks `head - tail <= capacity` and the record's length
//! against what was written, and copies the record into a private buffer
//! before anyone decodes it (no double fetch). Any inconsistency is
//! [`ShmError::Corrupt`]: the caller ends the connection. A peer can thus
//! corrupt only the rings of its own connection. The creator seals the
//! memfd against shrinking and growing before it hands it out, and the
//! opener checks the seals, so neither can make the other's accesses fault
//! (`SIGBUS`).
//!
//! # Wake-ups
//! A consumer that finds its ring empty [`wait`](Receiver::wait)s: it
//! spins for a while, then sets its *sleeping* flag, checks the ring again
//! and sleeps in `poll(2)` on its wake-up socket and, optionally, another
//! descriptor (the connection's socket, so that a peer that dies wakes it
//! at once). A producer sends a wake-up byte only when the flag is set,
//! so the hot path makes no system call. The store of the flag and the load of the head
//! (and, on the producer's side, the store of the head and the load of the
//! flag) are separated by sequentially consistent fences, so a wake-up is
//! never lost.
//!
//! A producer that follows this causes a waiting consumer at most one
//! wake-up with nothing to take per wait (one it sent for a record the
//! consumer took without sleeping). A peer that sends wake-ups without
//! records, to keep the other side's thread running, is ignored after
//! [`EMPTY_WAKES_TOLERATED`] such wake-ups in one wait: the wait then naps
//! ([`IGNORED_NAP_MIN`] doubling to [`IGNORED_NAP_MAX`]) and looks at the
//! ring after each nap. So does every wait once the peer closed its end.
//!
//! # Errors
//! Every fallible function returns [`ShmError`].
#![deny(unsafe_code)]

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use rustix::fs::{MemfdFlags, SealFlags};

mod map;
mod ring;

use map::Mapping;
pub use ring::{EMPTY_WAKES_TOLERATED, IGNORED_NAP_MAX, IGNORED_NAP_MIN, Ready, Receiver, Sender};

/// The default data capacity of each ring: 64 KiB.
pub const DEFAULT_CAPACITY: usize = 64 * 1024;

/// The smallest capacity an area may have (4 KiB).
pub const MIN_CAPACITY: usize = 4 * 1024;

/// The largest capacity an area may have (16 MiB).
pub const MAX_CAPACITY: usize = 16 * 1024 * 1024;

/// The layout version this build writes and accepts.
pub const LAYOUT_VERSION: u64 = 1;

/// The magic word that starts each ring header.
const MAGIC: u64 = u64::from_le_bytes(*b"CIPC-SHM");

/// The size of a ring header in bytes.
const HEADER_BYTES: usize = 256;

/// Word offsets of a ring header's fields.
const W_MAGIC: usize = 0;
const W_VERSION: usize = 1;
const W_CAPACITY: usize = 2;
pub(crate) const W_HEAD: usize = 8;
pub(crate) const W_TAIL: usize = 16;
pub(crate) const W_SLEEPING: usize = 24;

/// The seals an area carries: its size is fixed and no seal can be removed.
const SEALS: SealFlags = SealFlags::SHRINK
    .union(SealFlags::GROW)
    .union(SealFlags::SEAL);

/// What went wrong with an area.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShmError {
    /// A system call failed.
    #[error("{context}: {source}")]
    Io {
        /// What we were doing.
        context: &'static str,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// An argument is out of its domain (a capacity, a record too long).
    #[error("invalid {what}: {reason}")]
    InvalidArgument {
        /// The argument.
        what: &'static str,
        /// What is wrong and what is accepted.
        reason: String,
    },
    /// The memfd handed to [`Area::open`] is not a valid area: wrong size,
    /// missing seals, a bad header.
    #[error("not a valid shared-memory area: {reason}")]
    BadArea {
        /// What is wrong.
        reason: String,
    },
    /// The peer broke the ring's invariants (it is hostile or has a bug);
    /// end the connection.
    #[error("the peer corrupted the shared-memory ring: {reason}")]
    Corrupt {
        /// What was inconsistent.
        reason: String,
    },
}

impl ShmError {
    fn io(context: &'static str, source: impl Into<std::io::Error>) -> ShmError {
        ShmError::Io {
            context,
            source: source.into(),
        }
    }
}

/// Which end of an area this process is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Side {
    /// The process that created the area: it sends on ring 0, receives on ring 1.
    Creator,
    /// The process that opened a received area: it sends on ring 1,
    /// receives on ring 0.
    Opener,
}

/// A shared-memory area: two rings in one sealed memfd, mapped.
pub struct Area {
    map: Arc<Mapping>,
    capacity: usize,
}

impl std::fmt::Debug for Area {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Area")
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

/// The size in bytes of an area whose rings have `capacity` bytes each.
pub fn area_len(capacity: usize) -> usize {
    2 * (HEADER_BYTES + capacity)
}

fn check_capacity(capacity: usize) -> Result<(), ShmError> {
    if !capacity.is_power_of_two() || !(MIN_CAPACITY..=MAX_CAPACITY).contains(&capacity) {
        return Err(ShmError::InvalidArgument {
            what: "capacity",
            reason: format!(
                "{capacity} bytes; a ring's capacity is a power of two from {MIN_CAPACITY} to \
                 {MAX_CAPACITY} bytes"
            ),
        });
    }
    Ok(())
}

impl Area {
    /// Creates an area with rings of `capacity` bytes (a power of two from
    /// [`MIN_CAPACITY`] to [`MAX_CAPACITY`]) in a new memfd, sealed against
    /// shrinking, growing and further seals, and returns it with the memfd
    /// to send to the opener.
    ///
    /// # References
    /// [memfd_create(2)](https://man7.org/linux/man-pages/man2/memfd_create.2.html),
    /// [fcntl(2)](https://man7.org/linux/man-pages/man2/fcntl.2.html) (`F_ADD_SEALS`).
    #[doc(alias = "memfd_create")]
    #[doc(alias = "F_ADD_SEALS")]
    pub fn create(capacity: usize) -> Result<(Area, OwnedFd), ShmError> {
        check_capacity(capacity)?;
        let fd = rustix::fs::memfd_create(
            "cuda-ipc-notices",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )
        .map_err(|e| ShmError::io("cannot create a memfd", e))?;
        let len = area_len(capacity);
        rustix::fs::ftruncate(&fd, len as u64)
            .map_err(|e| ShmError::io("cannot size the memfd", e))?;
        rustix::fs::fcntl_add_seals(&fd, SEALS)
            .map_err(|e| ShmError::io("cannot seal the memfd", e))?;
        let map =
            Mapping::map(fd.as_fd(), len).map_err(|e| ShmError::io("cannot map the memfd", e))?;
        let area = Area {
            map: Arc::new(map),
            capacity,
        };
        for ring in 0..2 {
            let w = area.header(ring);
            // The rest of a new memfd reads as zeros.
            w[W_MAGIC].store(MAGIC, std::sync::atomic::Ordering::Relaxed);
            w[W_VERSION].store(LAYOUT_VERSION, std::sync::atomic::Ordering::Relaxed);
            w[W_CAPACITY].store(capacity as u64, std::sync::atomic::Ordering::Release);
        }
        Ok((area, fd))
    }

    /// Opens an area that a creator made with rings of `capacity` bytes:
    /// checks the memfd's size and seals (so that it cannot shrink under
    /// us) and the headers, then maps it.
    pub fn open(memfd: impl AsFd, capacity: usize) -> Result<Area, ShmError> {
        check_capacity(capacity)?;
        let fd = memfd.as_fd();
        let len = area_len(capacity);
        let bad = |reason: String| ShmError::BadArea { reason };
        let seals =
            rustix::fs::fcntl_get_seals(fd).map_err(|e| bad(format!("no seals to read ({e})")))?;
        if !seals.contains(SealFlags::SHRINK | SealFlags::GROW) {
            return Err(bad(format!(
                "the memfd is not sealed against shrinking and growing (seals {seals:?})"
            )));
        }
        let st = rustix::fs::fstat(fd).map_err(|e| ShmError::io("cannot stat the memfd", e))?;
        if st.st_size != len as i64 {
            return Err(bad(format!(
                "the memfd has {} bytes, expected {len} for rings of {capacity} bytes",
                st.st_size
            )));
        }
        let map = Mapping::map(fd, len).map_err(|e| ShmError::io("cannot map the memfd", e))?;
        let area = Area {
            map: Arc::new(map),
            capacity,
        };
        for ring in 0..2 {
            let w = area.header(ring);
            let load = |i: usize| w[i].load(std::sync::atomic::Ordering::Acquire);
            let (magic, version, cap) = (load(W_MAGIC), load(W_VERSION), load(W_CAPACITY));
            if magic != MAGIC || version != LAYOUT_VERSION || cap != capacity as u64 {
                return Err(bad(format!(
                    "ring {ring} has magic {magic:#x}, version {version}, capacity {cap}; \
                     expected {MAGIC:#x}, {LAYOUT_VERSION}, {capacity}"
                )));
            }
        }
        Ok(area)
    }

    /// The data capacity of each ring in bytes.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The longest record a ring takes, in bytes.
    pub fn max_record(&self) -> usize {
        self.capacity - 8
    }

    /// The header words of ring `ring` (0 or 1).
    fn header(&self, ring: usize) -> &[std::sync::atomic::AtomicU64] {
        let start = ring * (HEADER_BYTES + self.capacity) / 8;
        &self.map.words()[start..start + HEADER_BYTES / 8]
    }

    /// Splits the area into this side's ends: the [`Sender`] sends a
    /// wake-up byte on `wake` when the peer sleeps; the [`Receiver`] sleeps
    /// on `wake` for the peer's. `wake` is this side's end of a
    /// [`wake_pair`] (the creator keeps one end and sends the other to
    /// the opener); it is checked to be a Unix stream socket
    /// ([`ShmError::BadArea`] otherwise).
    ///
    /// # References
    /// [unix(7)](https://man7.org/linux/man-pages/man7/unix.7.html).
    pub fn split(self, side: Side, wake: OwnedFd) -> Result<(Sender, Receiver), ShmError> {
        check_wake_end(wake.as_fd())?;
        let (send_ring, recv_ring) = match side {
            Side::Creator => (0, 1),
            Side::Opener => (1, 0),
        };
        let wake = Arc::new(wake);
        Ok((
            Sender::new(
                Arc::clone(&self.map),
                send_ring,
                self.capacity,
                Arc::clone(&wake),
            ),
            Receiver::new(self.map, recv_ring, self.capacity, wake),
        ))
    }
}

/// A new wake-up socket pair for an area: `(ours, theirs)`, a connected
/// pair of Unix stream sockets, close-on-exec. Keep `ours` for
/// [`Area::split`] and send `theirs` to the peer, then close it here:
/// each side must hold only its own end.
///
/// # References
/// [socketpair(2)](https://man7.org/linux/man-pages/man2/socketpair.2.html).
#[doc(alias = "socketpair")]
pub fn wake_pair() -> Result<(OwnedFd, OwnedFd), ShmError> {
    rustix::net::socketpair(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::STREAM,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )
    .map_err(|e| ShmError::io("cannot create a wake-up socket pair", e))
}

/// Checks that `fd` is a Unix stream socket (what [`wake_pair`] makes).
fn check_wake_end(fd: BorrowedFd<'_>) -> Result<(), ShmError> {
    let bad = |what: String| ShmError::BadArea {
        reason: format!("the wake-up descriptor is {what}, not a Unix stream socket"),
    };
    let st =
        rustix::fs::fstat(fd).map_err(|e| ShmError::io("cannot stat the wake-up socket", e))?;
    let kind = rustix::fs::FileType::from_raw_mode(st.st_mode);
    if kind != rustix::fs::FileType::Socket {
        return Err(bad(format!("a {kind:?}")));
    }
    match rustix::net::sockopt::socket_type(fd) {
        Ok(rustix::net::SocketType::STREAM) => Ok(()),
        Ok(rustix::net::SocketType::DGRAM) => Err(bad("a datagram socket".into())),
        Ok(other) => Err(bad(format!("a socket of type {}", other.as_raw()))),
        Err(e) => Err(ShmError::io("cannot read the wake-up socket's type", e)),
    }
}

#[cfg(test)]
mod tests;
