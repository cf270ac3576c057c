//! The socket layer over socket pairs: descriptors, deadlines, truncation.

use std::io::Write;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::fs::{MemfdFlags, memfd_create};
use serde_json::json;

use super::*;
use crate::ChannelErrorKind as ErrorKind;
use crate::wire::{Header, Message, encode_header};

fn memfd_with(bytes: &[u8]) -> OwnedFd {
    let fd = memfd_create("cuda-ipc-socket-test", MemfdFlags::CLOEXEC).unwrap();
    assert_eq!(rustix::io::write(&fd, bytes).unwrap(), bytes.len());
    fd
}

fn read_fd(fd: impl AsFd, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    assert_eq!(rustix::io::pread(fd, &mut buf, 0).unwrap(), len);
    buf
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}
#[test]
fn frames_carry_fds_over_a_socket_pair() {
    let (a, b) = UnixStream::pair().unwrap();
    let bytes = pattern(4096, 1);
    let fd = memfd_with(&bytes);
    let m = Message::Attached {
        id: 1,
        lease: 2,
        meta: Arc::new(json!({"len": 4096}).into()),
        fds: 2,
    };
    send_message(&a, &m, &[fd.as_fd(), fd.as_fd()], None).unwrap();
    drop(fd);
    let (got, fds) = recv_message(
        &b,
        Some(Instant::now() + Duration::from_secs(5)),
        RecvLimits::ANY,
    )
    .unwrap();
    assert_eq!(got, m);
    assert_eq!(fds.len(), 2);
    assert_eq!(read_fd(&fds[1], 4096), bytes);
    // Received descriptors are close-on-exec.
    let flags = rustix::io::fcntl_getfd(&fds[0]).unwrap();
    assert!(flags.contains(rustix::io::FdFlags::CLOEXEC));

    // Many frames in a row stay in step, each with its own descriptors.
    for i in 0..50u64 {
        let fd = memfd_with(&[i as u8; 8]);
        let m = Message::RingSlot {
            id: i,
            lease: 1,
            slot: i as u32,
            meta: json!(i),
            fds: 1,
        };
        send_message(&a, &m, &[fd.as_fd()], None).unwrap();
        send_message(&a, &Message::Pong { id: i }, &[], None).unwrap();
    }
    for i in 0..50u64 {
        let (m, fds) = recv_message(&b, None, RecvLimits::ANY).unwrap();
        assert!(matches!(m, Message::RingSlot { id, .. } if id == i));
        assert_eq!(read_fd(&fds[0], 8), vec![i as u8; 8]);
        let (m, fds) = recv_message(&b, None, RecvLimits::ANY).unwrap();
        assert_eq!(m, Message::Pong { id: i });
        assert!(fds.is_empty());
    }
}

#[test]
fn send_frame_checks_the_fd_count() {
    let (a, _b) = UnixStream::pair().unwrap();
    let fd = memfd_with(b"x");
    let e = send_message(&a, &Message::Ping { id: 1 }, &[fd.as_fd()], None).unwrap_err();
    assert!(matches!(e, ChannelError::InvalidArgument { .. }), "{e}");
}

#[test]
fn recv_frame_times_out_and_stays_in_step() {
    let (a, b) = UnixStream::pair().unwrap();
    let started = Instant::now();
    let e = recv_message(
        &b,
        Some(Instant::now() + Duration::from_millis(50)),
        RecvLimits::ANY,
    )
    .unwrap_err();
    assert!(matches!(e, ChannelError::Timeout { .. }), "{e}");
    assert_eq!(e.kind(), ErrorKind::Timeout);
    assert!(started.elapsed() < Duration::from_secs(2));
    send_message(&a, &Message::Ping { id: 3 }, &[], None).unwrap();
    assert_eq!(
        recv_message(&b, None, RecvLimits::ANY).unwrap().0,
        Message::Ping { id: 3 }
    );
}

#[test]
fn recv_frame_reports_eof_and_truncation() {
    // End of file between frames: the peer is gone.
    let (a, b) = UnixStream::pair().unwrap();
    drop(a);
    assert!(matches!(
        recv_message(&b, None, RecvLimits::ANY),
        Err(ChannelError::PeerGone)
    ));

    // End of file inside a header or payload: truncated.
    let (mut a, b) = UnixStream::pair().unwrap();
    a.write_all(&encode_header(&Header::json(10, 0))[..5])
        .unwrap();
    drop(a);
    assert!(matches!(
        recv_message(&b, None, RecvLimits::ANY),
        Err(ChannelError::Wire(WireError::Truncated {
            what: "wire header",
            expected: 16,
            got: 5
        }))
    ));

    let (mut a, b) = UnixStream::pair().unwrap();
    a.write_all(&encode_header(&Header::json(10, 0))).unwrap();
    a.write_all(b"{\"ty").unwrap();
    drop(a);
    assert!(matches!(
        recv_message(&b, None, RecvLimits::ANY),
        Err(ChannelError::Wire(WireError::Truncated {
            what: "payload",
            expected: 10,
            got: 4
        }))
    ));
}

/// Sends `bytes` with `fds` attached using `sendmsg` directly (no limit on
/// the number of descriptors).
fn sendmsg_raw(stream: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags, sendmsg};
    let mut space = vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(64))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    assert!(control.push(SendAncillaryMessage::ScmRights(fds)));
    let n = sendmsg(
        stream,
        &[std::io::IoSlice::new(bytes)],
        &mut control,
        SendFlags::NOSIGNAL,
    )
    .unwrap();
    assert_eq!(n, bytes.len());
}

#[test]
fn recv_frame_rejects_fd_mismatches() {
    let payload = Message::Ping { id: 1 }.encode();
    let frame = |fds: u16| {
        let mut f = encode_header(&Header::json(payload.len() as u32, fds)).to_vec();
        f.extend_from_slice(&payload);
        f
    };
    let fd = memfd_with(b"x");

    // Announced one, none came.
    let (a, b) = UnixStream::pair().unwrap();
    send_bytes(&a, &frame(1), &[], None).unwrap();
    assert!(matches!(
        recv_message(&b, None, RecvLimits::ANY),
        Err(ChannelError::Wire(WireError::FdCountMismatch {
            expected: 1,
            received: 0
        }))
    ));

    // Announced none, one came (and is closed again).
    let (a, b) = UnixStream::pair().unwrap();
    send_bytes(&a, &frame(0), &[fd.as_fd()], None).unwrap();
    assert!(matches!(
        recv_message(&b, None, RecvLimits::ANY),
        Err(ChannelError::Wire(WireError::FdCountMismatch {
            expected: 0,
            received: 1
        }))
    ));

    // The header and the frame agree, but a ping carries no descriptors.
    let (a, b) = UnixStream::pair().unwrap();
    send_bytes(&a, &frame(1), &[fd.as_fd()], None).unwrap();
    let e = recv_message(&b, None, RecvLimits::ANY).unwrap_err();
    assert!(matches!(e, ChannelError::Protocol { .. }), "{e}");

    // More descriptors than the receive buffer holds: MSG_CTRUNC.
    let (a, b) = UnixStream::pair().unwrap();
    let many: Vec<BorrowedFd<'_>> = (0..20).map(|_| fd.as_fd()).collect();
    sendmsg_raw(&a, &frame(16), &many);
    let e = recv_message(&b, None, RecvLimits::ANY).unwrap_err();
    assert!(
        matches!(e, ChannelError::Wire(WireError::FdsTruncated { max: 16 })),
        "{e}"
    );
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
}

/// A spinning wait: what arrives during the spin is read (descriptors
/// too), a spin longer than the deadline still ends at the deadline, and a
/// peer that goes away during the spin is seen at once.
#[test]
fn a_spinning_wait_reads_what_comes_and_keeps_its_deadline() {
    let spin = RecvLimits {
        spin: Duration::from_secs(2),
        ..RecvLimits::CLIENT
    };
    let (a, b) = UnixStream::pair().unwrap();
    let m = Message::Attached {
        id: 7,
        lease: 8,
        meta: Arc::new(json!({"len": 3}).into()),
        fds: 1,
    };
    let sender = {
        let m = m.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            let fd = memfd_with(b"abc");
            send_message(&a, &m, &[fd.as_fd()], None).unwrap();
            a
        })
    };
    let started = Instant::now();
    let (got, fds) = recv_message(&b, Some(started + Duration::from_secs(10)), spin).unwrap();
    assert_eq!(got, m);
    assert_eq!(read_fd(&fds[0], 3), b"abc");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    let a = sender.join().unwrap();

    // Nothing comes: the deadline (50 ms) ends the spin (2 s).
    let started = Instant::now();
    let e = recv_message(&b, Some(started + Duration::from_millis(50)), spin).unwrap_err();
    assert!(matches!(e, ChannelError::Timeout { .. }), "{e}");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(50) && waited < Duration::from_secs(1),
        "{waited:?}"
    );

    // The peer goes during the spin: PeerGone, without waiting the spin out.
    let closer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        drop(a);
    });
    let started = Instant::now();
    let e = recv_message(&b, Some(started + Duration::from_secs(10)), spin).unwrap_err();
    assert!(matches!(e, ChannelError::PeerGone), "{e}");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    closer.join().unwrap();
}
