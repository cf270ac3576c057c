//! Sending and receiving messages with file descriptors over a Unix stream
//! socket, with a deadline on every wait, and peer credentials.
//!
//! # How descriptors travel
//! [`send_message`] passes the descriptors as one `SCM_RIGHTS` control
//! message with the first `sendmsg` that transfers bytes of the message; the
//! kernel ties them to those bytes. [`recv_message`] reads exactly one message
//! (the header, then exactly the payload length) with `recvmsg`, so it never
//! consumes bytes of the next message and never sees that message's descriptors
//! early. Every descriptor that arrives is an [`OwnedFd`] from the moment it
//! is received (with `MSG_CMSG_CLOEXEC`, so it does not leak into children):
//! on any error the ones received so far are closed when the function
//! returns.
//!
//! # Waiting
//! The sockets may be blocking or not: every send and receive uses
//! `MSG_DONTWAIT` and waits with `poll(2)` up to the deadline. A receive
//! times out only while it waits for the *first* byte of a message, and then
//! returns [`ChannelError::Timeout`] with the stream still in step. Once a
//! message has begun, the rest must follow within [`STALL_TIMEOUT`] of its
//! first byte (however far the deadline for its start was: a server's idle
//! deadline is minutes), or by the deadline itself with
//! `RecvLimits::strict_deadline`; a peer that stops in the middle of a
//! message is a protocol error, and the connection is unusable after it. Sends use `MSG_NOSIGNAL`: a closed peer is
//! [`ChannelError::PeerGone`], never `SIGPIPE`.
//!
//! # References
//! [sendmsg(2)](https://man7.org/linux/man-pages/man2/sendmsg.2.html),
//! [recvmsg(2)](https://man7.org/linux/man-pages/man2/recvmsg.2.html),
//! [unix(7)](https://man7.org/linux/man-pages/man7/unix.7.html) (`SCM_RIGHTS`,
//! `SO_PEERCRED`), [poll(2)](https://man7.org/linux/man-pages/man2/poll.2.html).

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::io::Errno;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, recvmsg, send, sendmsg,
};

use super::ChannelError;
use super::wire::{
    HEADER_LEN, MAX_FDS, MAX_PAYLOAD, Message, WireError, decode_header, encode_message,
};

/// How long a peer may take to finish a message it has begun (beyond the
/// caller's deadline) before the connection is declared broken.
pub(crate) const STALL_TIMEOUT: Duration = Duration::from_secs(5);

/// The credentials of the process at the other end of a Unix socket, as the
/// kernel recorded them when the connection was made (`SO_PEERCRED`).
///
/// The kernel translates each field into the namespaces of the process that
/// reads them:
/// - `pid` is the peer's process id in our PID namespace, or 0 when the peer
///   runs in a PID namespace that ours cannot see into (another container, or
///   `unshare --pid`). 0 is not an error: the connection itself tells whether
///   the peer is alive (it closes when the peer exits); see [`Ucred::pid_visible`].
/// - `uid` and `gid` are the peer's effective ids mapped into our user
///   namespace. A peer in a user namespace whose ids map onto ours (such as
///   `unshare --user --map-root-user`, or a container's `uid_map`) shows its
///   id *outside* its namespace, the one the allowlists match. An id with no
///   mapping into our namespace reads as the overflow id
///   (`/proc/sys/kernel/overflowuid`, normally 65534, "nobody"), so allowing
///   65534 allows every peer whose user we cannot see.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Ucred {
    /// The peer's process id in our PID namespace; 0 when the peer's PID
    /// namespace is not visible from ours.
    pub pid: u32,
    /// The peer's effective user id, in our user namespace.
    pub uid: u32,
    /// The peer's effective group id, in our user namespace.
    pub gid: u32,
}

impl Ucred {
    /// Whether the peer's process id means something here: false when the
    /// kernel reported 0, which it does for a peer in a PID namespace that
    /// ours cannot see (a process in another container).
    #[must_use]
    pub fn pid_visible(&self) -> bool {
        self.pid != 0
    }
}

/// The credentials of the peer of a connected Unix socket.
///
/// A peer in another PID namespace gets `pid` 0 (see [`Ucred`]); that is
/// not an error.
///
/// # References
/// [unix(7)](https://man7.org/linux/man-pages/man7/unix.7.html), `SO_PEERCRED`;
/// [`pid_namespaces(7)`](https://man7.org/linux/man-pages/man7/pid_namespaces.7.html),
/// [`user_namespaces(7)`](https://man7.org/linux/man-pages/man7/user_namespaces.7.html).
#[doc(alias = "SO_PEERCRED")]
pub fn peer_credentials(stream: impl AsFd) -> Result<Ucred, ChannelError> {
    use std::os::fd::AsRawFd;
    // Read with libc rather than rustix: rustix's `UCred` holds the pid as a
    // non-zero `Pid`, and the kernel reports 0 for a peer in a PID namespace
    // we cannot see.
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED writes at most `len` bytes (one `struct ucred`)
    // through the value pointer, which points to a live, writable `ucred`,
    // and updates `len`, which points to a live `socklen_t`; the descriptor
    // is borrowed for the duration of the call.
    let r = unsafe {
        libc::getsockopt(
            stream.as_fd().as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &raw mut len,
        )
    };
    if r < 0 {
        return Err(ChannelError::io(
            "cannot read the peer's credentials (SO_PEERCRED)",
            std::io::Error::last_os_error(),
        ));
    }
    if len as usize != std::mem::size_of::<libc::ucred>() {
        return Err(ChannelError::protocol(format!(
            "SO_PEERCRED returned {len} bytes, not the {} of a struct ucred;              this kernel is not supported",
            std::mem::size_of::<libc::ucred>()
        )));
    }
    Ok(Ucred {
        pid: u32::try_from(cred.pid).unwrap_or(0),
        uid: cred.uid,
        gid: cred.gid,
    })
}

/// Sends one message with `fds` attached.
///
/// The number of descriptors must match what the message announces
/// ([`Message::fd_count`]) and be at most [`MAX_FDS`]. The descriptors stay
/// owned by the caller; the receiver gets its own duplicates.
///
/// Returns [`ChannelError::Timeout`] if nothing could be sent before the
/// deadline (the stream is still usable), [`ChannelError::PeerGone`] if the
/// peer closed the connection, and a protocol error if the peer stopped
/// reading in the middle of the message (the stream is then unusable).
#[doc(alias = "sendmsg")]
#[doc(alias = "SCM_RIGHTS")]
pub(crate) fn send_message(
    stream: impl AsFd,
    message: &Message,
    fds: &[BorrowedFd<'_>],
    deadline: Option<Instant>,
) -> Result<(), ChannelError> {
    let bytes = encode_checked(message, fds)?;
    send_bytes(stream, &bytes, fds, deadline)
}

/// The wire bytes of `message`, after checking that `fds` is what it announces.
pub(crate) fn encode_checked(
    message: &Message,
    fds: &[BorrowedFd<'_>],
) -> Result<Vec<u8>, ChannelError> {
    if message.fd_count() != fds.len() {
        return Err(ChannelError::arg(
            "file descriptors",
            format!(
                "a {:?} message announces {} file descriptors but {} were given",
                message.type_name(),
                message.fd_count(),
                fds.len()
            ),
        ));
    }
    Ok(encode_message(message, fds.len())?)
}

/// One attempt to send `bytes` with `fds` attached to the first of them
/// without waiting: how many bytes went (0 when the socket's buffer is full).
pub(crate) fn try_send_bytes(
    stream: impl AsFd,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> Result<usize, ChannelError> {
    Ok(send_first(stream.as_fd(), bytes, fds)?.unwrap_or(0))
}

/// How much of what we sent on a Unix stream socket the peer has not
/// received yet (`SIOCOUTQ`; for a Unix socket, the kernel's accounting of
/// the buffers queued to the peer, so 0 exactly when the peer has read
/// everything, descriptors included).
#[doc(alias = "SIOCOUTQ")]
pub(crate) fn unread_by_peer(stream: impl AsFd) -> Result<usize, ChannelError> {
    use std::os::fd::AsRawFd;
    let mut queued: libc::c_int = 0;
    // SAFETY: SIOCOUTQ (TIOCOUTQ, the same request number) writes one `int`
    // through its argument, which points to a live, writable `c_int`; the
    // descriptor is borrowed for the duration of the call.
    let r = unsafe { libc::ioctl(stream.as_fd().as_raw_fd(), libc::TIOCOUTQ, &raw mut queued) };
    if r < 0 {
        return Err(ChannelError::io(
            "cannot read how much the peer has not received (SIOCOUTQ)",
            std::io::Error::last_os_error(),
        ));
    }
    Ok(usize::try_from(queued).unwrap_or(0))
}

/// One `sendmsg` of `bytes` with `fds` attached, retried on EINTR: how many
/// bytes went, or `None` if the socket's buffer is full.
fn send_first(
    fd: BorrowedFd<'_>,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> Result<Option<usize>, ChannelError> {
    if fds.len() > MAX_FDS {
        return Err(WireError::TooManyFds {
            count: fds.len(),
            max: MAX_FDS,
        }
        .into());
    }
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    loop {
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
            // Cannot happen: the buffer is sized for MAX_FDS, checked above.
            return Err(WireError::TooManyFds {
                count: fds.len(),
                max: MAX_FDS,
            }
            .into());
        }
        let flags = SendFlags::NOSIGNAL | SendFlags::DONTWAIT;
        match sendmsg(fd, &[IoSlice::new(bytes)], &mut control, flags) {
            Ok(n) => return Ok(Some(n)),
            Err(Errno::AGAIN) => return Ok(None),
            Err(Errno::INTR) => {}
            Err(e) => return Err(send_error(e)),
        }
    }
}

/// Sends raw bytes with `fds` attached to the first of them: the building
/// block of [`send_message`].
///
/// Errors as [`send_message`].
pub(crate) fn send_bytes(
    stream: impl AsFd,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
    deadline: Option<Instant>,
) -> Result<(), ChannelError> {
    let fd = stream.as_fd();
    let started = Instant::now();
    let flags = SendFlags::NOSIGNAL | SendFlags::DONTWAIT;
    let mut sent = 0usize;

    // The first transfer carries the descriptors.
    while sent == 0 && !bytes.is_empty() {
        match send_first(fd, bytes, fds)? {
            Some(n) => sent = n,
            None => {
                wait(fd, PollFlags::OUT, deadline).map_err(|()| ChannelError::Timeout {
                    what: "the peer to accept data (its receive buffer is full)".into(),
                    after: started.elapsed(),
                })?;
            }
        }
    }

    // The rest, without descriptors.
    let stall = later(deadline, Instant::now() + STALL_TIMEOUT);
    while sent < bytes.len() {
        match send(fd, &bytes[sent..], flags) {
            Ok(n) => sent += n,
            Err(Errno::AGAIN) => wait(fd, PollFlags::OUT, Some(stall)).map_err(|()| {
                ChannelError::protocol(format!(
                    "the peer stopped reading in the middle of a message ({sent} of {} bytes sent \
                     in {:?}); the connection can no longer be used",
                    bytes.len(),
                    started.elapsed()
                ))
            })?,
            Err(Errno::INTR) => {}
            Err(e) => return Err(send_error(e)),
        }
    }
    Ok(())
}

fn send_error(e: Errno) -> ChannelError {
    match e {
        Errno::PIPE | Errno::CONNRESET | Errno::NOTCONN => ChannelError::PeerGone,
        e => ChannelError::io("cannot send on the channel socket", e),
    }
}

/// Receives one wire message: the message and the descriptors that came with it.
///
/// Waits for the message to begin until `deadline` (`None`: for ever) and
/// returns [`ChannelError::Timeout`] if it does not; see the
/// [module documentation](self) for messages that stop half-way. End of file
/// before a message begins is [`ChannelError::PeerGone`]; inside a message it is
/// [`WireError::Truncated`]. A descriptor count that differs from the
/// header's, or more descriptors than [`MAX_FDS`] (`MSG_CTRUNC`), is an
/// error, and the descriptors that did arrive are closed.
#[doc(alias = "recvmsg")]
#[doc(alias = "SCM_RIGHTS")]
pub(crate) fn recv_message(
    stream: impl AsFd,
    deadline: Option<Instant>,
    limits: RecvLimits,
) -> Result<(Message, Vec<OwnedFd>), ChannelError> {
    let fd = stream.as_fd();
    let started = Instant::now();
    let mut fds = Vec::new();

    let mut header = [0u8; HEADER_LEN];
    let mut stall = None;
    // Whether descriptors were lost because this process had no room.
    let mut lost = false;
    let strict = if limits.strict_deadline {
        deadline
    } else {
        None
    };
    let spin_until = (!limits.spin.is_zero()).then(|| {
        let end = started + limits.spin;
        deadline.map_or(end, |d| d.min(end))
    });
    read_exact(
        fd,
        &mut header,
        &mut fds,
        Part::Header,
        (deadline, strict, spin_until),
        started,
        &mut stall,
        &mut lost,
    )?;
    let h = decode_header(&header)?;
    if h.len > limits.max_payload {
        return Err(WireError::PayloadTooLarge {
            len: u64::from(h.len),
            max: limits.max_payload,
        }
        .into());
    }
    let mut payload = vec![0u8; h.len as usize];
    read_exact(
        fd,
        &mut payload,
        &mut fds,
        Part::Payload,
        (deadline, strict, None),
        started,
        &mut stall,
        &mut lost,
    )?;
    let message = Message::decode(&payload)?;
    if lost && message.fd_count() == usize::from(h.fds) {
        // The stream is still in step: the caller sees the shortfall
        // (`fds.len() < message.fd_count()`) and reports it.
        tracing::warn!(
            kind = message.type_name(),
            expected = h.fds,
            received = fds.len(),
            "this process is out of file descriptors (EMFILE): the kernel dropped descriptors \
             it was sent"
        );
        return Ok((message, fds));
    }
    if fds.len() != usize::from(h.fds) {
        return Err(WireError::FdCountMismatch {
            expected: usize::from(h.fds),
            received: fds.len(),
        }
        .into());
    }
    if message.fd_count() != fds.len() {
        return Err(ChannelError::protocol(format!(
            "a {:?} message announces {} file descriptors but its wire message carried {}",
            message.type_name(),
            message.fd_count(),
            fds.len()
        )));
    }
    Ok((message, fds))
}

/// What one end accepts from the other.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RecvLimits {
    /// The longest payload accepted (at most [`MAX_PAYLOAD`]).
    pub(crate) max_payload: u32,
    /// Whether a message begun before the deadline must also end by it
    /// (else it gets [`STALL_TIMEOUT`] from its first byte, whatever the
    /// deadline). The connection
    /// is unusable after such a timeout.
    pub(crate) strict_deadline: bool,
    /// How long a wait for a new message polls the socket before it sleeps
    /// (`ClientConfig::spin`); never past the deadline.
    pub(crate) spin: Duration,
}

impl RecvLimits {
    /// Everything the wire format allows, with the stall timeout.
    #[cfg(test)]
    pub(crate) const ANY: RecvLimits = RecvLimits {
        max_payload: MAX_PAYLOAD,
        strict_deadline: false,
        spin: Duration::ZERO,
    };

    /// What a client accepts from its server: any size, and the caller's
    /// deadline holds even in the middle of a message.
    pub(crate) const CLIENT: RecvLimits = RecvLimits {
        max_payload: MAX_PAYLOAD,
        strict_deadline: true,
        spin: Duration::ZERO,
    };
}

/// Pause instructions between two polls of a spinning wait (about a
/// microsecond), so that it does not make a system call back to back.
const SPIN_PAUSES: u32 = 16;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Part {
    Header,
    Payload,
}

/// Fills `buf` from the socket, collecting descriptors into `fds`.
#[allow(clippy::too_many_arguments)]
fn read_exact(
    fd: BorrowedFd<'_>,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
    part: Part,
    (deadline, strict, spin_until): (Option<Instant>, Option<Instant>, Option<Instant>),
    started: Instant,
    stall: &mut Option<Instant>,
    lost: &mut bool,
) -> Result<(), ChannelError> {
    let mut got = 0usize;
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    while got < buf.len() {
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let result = recvmsg(
            fd,
            &mut [IoSliceMut::new(&mut buf[got..])],
            &mut control,
            RecvFlags::DONTWAIT | RecvFlags::CMSG_CLOEXEC,
        );
        // Take ownership of every descriptor that arrived, whatever else
        // happened, so that none is leaked.
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = message {
                fds.extend(received);
            }
        }
        match result {
            Ok(msg) => {
                if msg.flags.contains(ReturnFlags::CTRUNC) {
                    truncated(fd, lost)?;
                }
                if fds.len() > MAX_FDS {
                    return Err(WireError::TooManyFds {
                        count: fds.len(),
                        max: MAX_FDS,
                    }
                    .into());
                }
                if msg.bytes == 0 {
                    return Err(if part == Part::Header && got == 0 {
                        ChannelError::PeerGone
                    } else {
                        WireError::Truncated {
                            what: match part {
                                Part::Header => "wire header",
                                Part::Payload => "payload",
                            },
                            expected: buf.len(),
                            got,
                        }
                        .into()
                    });
                }
                if stall.is_none() {
                    *stall = Some(match strict {
                        // A message begun just before the deadline still gets
                        // a moment to arrive whole.
                        Some(d) => d.max(Instant::now() + STRICT_GRACE),
                        None => Instant::now() + STALL_TIMEOUT,
                    });
                }
                got += msg.bytes;
            }
            Err(Errno::AGAIN) => {
                let frame_begun = stall.is_some();
                // Before the first byte, poll without sleeping for a while:
                // a message that comes soon costs no wake-up.
                if !frame_begun && spin_until.is_some_and(|s| Instant::now() < s) {
                    for _ in 0..SPIN_PAUSES {
                        std::hint::spin_loop();
                    }
                    continue;
                }
                let until = if frame_begun { *stall } else { deadline };
                wait(fd, PollFlags::IN, until).map_err(|()| {
                    if frame_begun {
                        ChannelError::protocol(format!(
                            "the peer stopped in the middle of a message ({got} of {} {} bytes \
                             received after {:?}); the connection can no longer be used",
                            buf.len(),
                            if part == Part::Header {
                                "header"
                            } else {
                                "payload"
                            },
                            started.elapsed()
                        ))
                    } else {
                        ChannelError::Timeout {
                            what: "a message from the peer".into(),
                            after: started.elapsed(),
                        }
                    }
                })?;
            }
            Err(Errno::INTR) => {}
            Err(Errno::CONNRESET | Errno::PIPE | Errno::NOTCONN) if got == 0 && stall.is_none() => {
                return Err(ChannelError::PeerGone);
            }
            Err(Errno::CONNRESET | Errno::PIPE | Errno::NOTCONN) => {
                return Err(WireError::Truncated {
                    what: if part == Part::Header {
                        "wire header"
                    } else {
                        "payload"
                    },
                    expected: buf.len(),
                    got,
                }
                .into());
            }
            Err(e) => return Err(ChannelError::io("cannot receive on the channel socket", e)),
        }
    }
    Ok(())
}

/// Why the kernel truncated the descriptors of a message: more than
/// [`MAX_FDS`] (an error), or this process is at its open-file limit and
/// could not take them (`lost`; the message is still read whole).
fn truncated(fd: BorrowedFd<'_>, lost: &mut bool) -> Result<(), ChannelError> {
    match rustix::io::fcntl_dupfd_cloexec(fd, 0) {
        Err(Errno::MFILE | Errno::NFILE) => {
            *lost = true;
            Ok(())
        }
        _ => Err(WireError::FdsTruncated { max: MAX_FDS }.into()),
    }
}

/// How long a message begun right at a strict deadline may take to end.
const STRICT_GRACE: Duration = Duration::from_millis(50);

/// The later of an optional deadline and an instant.
fn later(deadline: Option<Instant>, other: Instant) -> Instant {
    deadline.map_or(other, |d| d.max(other))
}

/// Waits until `fd` is ready for `events` (or has an error or hang-up, which
/// the next call reports), or the deadline passes (`Err(())`).
pub(crate) fn wait(
    fd: BorrowedFd<'_>,
    events: PollFlags,
    deadline: Option<Instant>,
) -> Result<(), ()> {
    loop {
        let timeout = match deadline {
            None => None,
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(());
                }
                Some(Timespec::try_from(left).unwrap_or(Timespec {
                    tv_sec: i64::MAX,
                    tv_nsec: 0,
                }))
            }
        };
        let mut pfd = [PollFd::new(&fd, events)];
        match poll(&mut pfd, timeout.as_ref()) {
            Ok(0) | Err(Errno::INTR) => {}
            // Readiness, an error or a hang-up: the next call tells which.
            Ok(_) | Err(_) => return Ok(()),
        }
    }
}

/// Whether the peer of `stream` has closed its end or the socket has an
/// error, without waiting and without consuming data.
pub(crate) fn peer_closed(stream: BorrowedFd<'_>) -> bool {
    let mut pfd = [PollFd::new(&stream, PollFlags::IN | PollFlags::RDHUP)];
    let zero = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    match poll(&mut pfd, Some(&zero)) {
        Ok(0) | Err(Errno::INTR) => false,
        Ok(_) => pfd[0]
            .revents()
            .intersects(PollFlags::HUP | PollFlags::RDHUP | PollFlags::ERR | PollFlags::NVAL),
        Err(_) => true,
    }
}

#[cfg(test)]
mod tests;
