//! File-descriptor leak check of the exchange channel.
//!
//! This binary holds a single test, so that no other test opens or closes
//! descriptors while it counts the entries of `/proc/self/fd`.

use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use cuda_ipc_channel::frame::{Header, Message, encode_header};
use cuda_ipc_channel::socket::{recv_frame, send_bytes, send_frame};
use cuda_ipc_channel::{ChannelError, Client, ClientConfig, Server, ServerConfig};
use rustix::fs::{MemfdFlags, memfd_create};
use serde_json::json;

/// Requests sent by the flooding client.
const FLOOD: u64 = 1000;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Waits (up to 5 s) for the count to come back to `expected`: server
/// threads close a finished connection's socket shortly after the client
/// sees its answer.
fn settle_to(expected: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let n = open_fds();
        if n == expected || Instant::now() >= deadline {
            return n;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn memfd_with(bytes: &[u8]) -> OwnedFd {
    let fd = memfd_create("cuda-ipc-fd-test", MemfdFlags::CLOEXEC).unwrap();
    assert_eq!(rustix::io::write(&fd, bytes).unwrap(), bytes.len());
    fd
}

fn read_fd(fd: impl AsFd, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    assert_eq!(rustix::io::pread(fd, &mut buf, 0).unwrap(), len);
    buf
}

fn frame(message: &Message, fds: u16) -> Vec<u8> {
    let payload = message.encode();
    let mut f = encode_header(&Header::json(payload.len() as u32, fds)).to_vec();
    f.extend_from_slice(&payload);
    f
}

fn sendmsg_many(stream: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags, sendmsg};
    let mut space = vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(64))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    assert!(control.push(SendAncillaryMessage::ScmRights(fds)));
    sendmsg(
        stream,
        &[IoSlice::new(bytes)],
        &mut control,
        SendFlags::NOSIGNAL,
    )
    .unwrap();
}

/// Frames that are refused close the descriptors that came with them.
/// (After a refused frame the stream is out of step: a fresh pair each.)
fn refused_frames_close_their_fds() {
    let fd = memfd_with(b"x");
    let ping = Message::Ping { id: 1 };
    let base = open_fds();
    for _ in 0..20 {
        // Announced none, two came.
        let (a, b) = UnixStream::pair().unwrap();
        send_bytes(&a, &frame(&ping, 0), &[fd.as_fd(), fd.as_fd()], None).unwrap();
        assert!(recv_frame(&b, None).is_err());
        // A ping with a descriptor.
        let (a, b) = UnixStream::pair().unwrap();
        send_bytes(&a, &frame(&ping, 1), &[fd.as_fd()], None).unwrap();
        assert!(recv_frame(&b, None).is_err());
        // More than fit: MSG_CTRUNC.
        let (a, b) = UnixStream::pair().unwrap();
        let many: Vec<BorrowedFd<'_>> = (0..30).map(|_| fd.as_fd()).collect();
        sendmsg_many(&a, &frame(&ping, 16), &many);
        assert!(recv_frame(&b, None).is_err());
        // A good frame with descriptors, dropped by the receiver.
        let (a, b) = UnixStream::pair().unwrap();
        let attached = Message::Attached {
            id: 1,
            lease: 1,
            meta: json!(null),
            fds: 3,
        };
        send_frame(&a, &attached, &[fd.as_fd(), fd.as_fd(), fd.as_fd()], None).unwrap();
        let (_, fds) = recv_frame(&b, None).unwrap();
        assert_eq!(fds.len(), 3);
    }
    assert_eq!(open_fds(), base, "refused frames leaked descriptors");
}

/// A client that floods requests without reading the answers is
/// slowed down: the server never holds more than a small window of
/// duplicated descriptors for it.
fn flood_is_throttled(server: &Server, path: &std::path::Path, steady: usize) {
    let raw = UnixStream::connect(path).unwrap();
    let hello = Message::Hello {
        protocol: 1,
        pid: std::process::id(),
    };
    send_frame(&raw, &hello, &[], None).unwrap();
    assert!(matches!(
        recv_frame(&raw, None).unwrap().0,
        Message::Welcome { .. }
    ));
    let flooder = {
        let raw = raw.try_clone().unwrap();
        std::thread::spawn(move || {
            for id in 0..FLOOD {
                let attach = Message::Attach {
                    id,
                    name: "e".into(),
                };
                let deadline = Instant::now() + Duration::from_secs(10);
                send_frame(&raw, &attach, &[], Some(deadline)).unwrap();
            }
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    let during = open_fds();
    // Two descriptors per answer; the window is 64 answers.
    assert!(
        during <= steady + 1 + 2 * 70,
        "the server held {} descriptors for a client that does not read",
        during - steady
    );
    for id in 0..FLOOD {
        let deadline = Instant::now() + Duration::from_secs(10);
        let (m, fds) = recv_frame(&raw, Some(deadline)).unwrap();
        assert!(
            matches!(m, Message::Attached { id: got, .. } if got == id),
            "{m:?}"
        );
        assert_eq!(fds.len(), 2);
    }
    flooder.join().unwrap();
    assert_eq!(server.lease_count("e"), FLOOD as usize);
    drop(raw);
    server
        .wait_released("e", Some(Duration::from_secs(5)))
        .unwrap();
    assert_eq!(settle_to(steady), steady, "the flood leaked");
}

#[test]
fn no_descriptor_leaks() {
    let before = open_fds();

    refused_frames_close_their_fds();
    {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("fds.sock");
        let server = Server::bind(ServerConfig::new(&path)).unwrap();
        server
            .publish(
                "e",
                json!({"len": 4}),
                vec![memfd_with(b"abcd"), memfd_with(b"efgh")],
            )
            .unwrap();
        let ring = server
            .create_ring(
                "r",
                json!(null),
                (0..3)
                    .map(|i| (json!(i), vec![memfd_with(&[i as u8; 4])]))
                    .collect(),
            )
            .unwrap();
        let client = Client::connect(&path, ClientConfig::default()).unwrap();

        // Warm up once, then the count must hold steady across many cycles.
        let a = client.attach("e").unwrap();
        client.release(a.lease).unwrap();
        drop(a);
        let steady = open_fds();

        for _ in 0..300 {
            let a = client.attach("e").unwrap();
            assert_eq!(read_fd(&a.fds[1], 4), b"efgh");
            client.release(a.lease).unwrap();
        }
        for _ in 0..30 {
            let sub = client.attach_ring("r").unwrap();
            let slot = ring.acquire(Some(Duration::from_secs(5))).unwrap();
            let seq = ring.publish(slot, json!("frame")).unwrap();
            let f = client
                .next_frame(sub.lease, Duration::from_secs(5))
                .unwrap();
            assert_eq!((f.slot, f.seq), (slot, seq));
            assert_eq!(read_fd(&sub.slots[f.slot].1[0], 4), [slot as u8; 4]);
            client.ack(sub.lease, f.slot, f.seq).unwrap();
            client.release(sub.lease).unwrap();
        }
        // Errors answered by the server leak nothing either.
        for _ in 0..20 {
            assert!(matches!(
                client.attach("missing"),
                Err(ChannelError::NotFound { .. })
            ));
            assert!(client.attach("r").is_err());
        }
        assert_eq!(settle_to(steady), steady, "attach/release cycles leaked");

        // Clients that come and go, some dropping their leases with the
        // connection, some releasing them.
        for i in 0..40 {
            let c = Client::connect(&path, ClientConfig::default()).unwrap();
            let a = c.attach("e").unwrap();
            if i % 2 == 0 {
                c.release(a.lease).unwrap();
            }
        }
        server
            .wait_released("e", Some(Duration::from_secs(5)))
            .unwrap();
        assert_eq!(settle_to(steady), steady, "connections leaked");

        flood_is_throttled(&server, &path, steady);

        // Unpublished entries close their descriptors with the last lease.
        let a = client.attach("e").unwrap();
        server.unpublish("e").unwrap();
        client.release(a.lease).unwrap();
        drop(a);
        assert_eq!(
            settle_to(steady - 2),
            steady - 2,
            "unpublished entry kept its fds"
        );
        drop(ring);
        assert_eq!(
            settle_to(steady - 5),
            steady - 5,
            "dropped ring kept its fds"
        );
        drop(client);
        drop(server);
    }

    // With the server gone (its threads joined), everything is closed.
    assert_eq!(settle_to(before), before, "descriptors leaked overall");
}
