//! File-descriptor leak check of the exchange channel.
//!
//! This binary holds a single test, so that no other test opens or closes
//! descriptors while it counts the entries of `/proc/self/fd`.

use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

mod support;
use support::wire::{encode, raw_connect, recv_message, send_bytes, send_message};
use support::{memfd_with, publish_two_fds, read_fd};

use cuda_ipc_channel::wire::Message;
use cuda_ipc_channel::{ChannelError, Client, ClientConfig, Server, ServerConfig};
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

/// Sends `bytes` with `fds` on a fresh connection to the server and reads
/// until the server closes it: the server refuses such a message.
fn refused(path: &Path, bytes: &[u8], fds: &[BorrowedFd<'_>]) {
    let s = raw_connect(path, true);
    send_bytes(&s, bytes, fds, None).unwrap();
    let deadline = Some(Instant::now() + Duration::from_secs(5));
    while recv_message(&s, deadline).is_ok() {}
}

/// Wire messages that the server refuses close the descriptors that came
/// with them.
fn refused_messages_close_their_fds(path: &Path, steady: usize) {
    let fd = memfd_with(b"x");
    let ping = Message::Ping { id: 1 };
    for _ in 0..20 {
        // Announced none, two came.
        refused(path, &encode(&ping, 0), &[fd.as_fd(), fd.as_fd()]);
        // A ping with a descriptor.
        refused(path, &encode(&ping, 1), &[fd.as_fd()]);
        // More than fit: MSG_CTRUNC.
        let many: Vec<BorrowedFd<'_>> = (0..30).map(|_| fd.as_fd()).collect();
        refused(path, &encode(&ping, 16), &many);
    }
    drop(fd);
    assert_eq!(
        settle_to(steady),
        steady,
        "refused messages leaked descriptors"
    );
}

/// A client that floods requests without reading the answers is
/// slowed down: the server never holds more than a small window of
/// duplicated descriptors for it.
fn flood_is_throttled(server: &Server, path: &std::path::Path, steady: usize) {
    let raw = UnixStream::connect(path).unwrap();
    let hello = Message::Hello {
        protocol: 1,
        pid: std::process::id(),
        shm_notices: false,
        shm_requests: false,
    };
    send_message(&raw, &hello, &[], None).unwrap();
    assert!(matches!(
        recv_message(&raw, None).unwrap().0,
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
                send_message(&raw, &attach, &[], Some(deadline)).unwrap();
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
        let (m, fds) = recv_message(&raw, Some(deadline)).unwrap();
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

    {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("fds.sock");
        let server = Server::bind(ServerConfig::new(&path)).unwrap();
        publish_two_fds(&server);
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
            assert_eq!(
                read_fd(&sub.slots[f.slot as usize].1[0], 4),
                [slot as u8; 4]
            );
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

        refused_messages_close_their_fds(&path, steady);
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
