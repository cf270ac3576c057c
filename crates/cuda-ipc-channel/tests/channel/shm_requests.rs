//! Requests through shared memory: pings, attaches and releases take the
//! client's ring when the server grants it, their answers come back
//! through the server's unless they carry descriptors, a request is served
//! only after the socket messages sent before it, and a client that puts
//! anything else in its ring is cut off alone.

use cuda_ipc_channel::NoticePath;
use cuda_ipc_channel::wire::decode_header;
use cuda_ipc_shm::{Area, Receiver, Sender, Side as ShmSide};

use super::shm_notices::raw_client_asking;
use super::*;

/// A server on `path` with an entry without descriptors and one with a memfd.
fn server_with_two(path: &Path, notices: NoticePath) -> Server {
    let server = server_with(path, notices);
    server
        .publish("plain", json!({"kind": "plain"}), vec![])
        .unwrap();
    let fd = memfd_with(b"descriptor");
    server
        .publish("with-fd", json!({"kind": "with-fd"}), vec![fd])
        .unwrap();
    server
}

/// Ping, attach and release an entry without descriptors, then attach and
/// release one with a memfd: returns the descriptors the second attach
/// brought.
fn five_requests(client: &Client) -> usize {
    client.ping().unwrap();
    let a = client.attach("plain").unwrap();
    assert_eq!(a.meta, json!({"kind": "plain"}));
    assert!(a.fds.is_empty());
    client.release(a.lease).unwrap();
    let b = client.attach("with-fd").unwrap();
    assert_eq!(b.meta, json!({"kind": "with-fd"}));
    let fds = b.fds.len();
    client.release(b.lease).unwrap();
    fds
}

#[test]
fn requests_and_their_answers_take_the_rings_when_granted() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "requests");
    let _server = server_with_two(&path, NoticePath::Shm);

    let client = client_with(&path, NoticePath::Shm);
    assert_eq!(five_requests(&client), 1);
    let stats = client.notice_stats();
    assert_eq!(stats.shm_requests, 5, "{stats:?}");
    // Every answer but the one with a descriptor.
    assert_eq!(stats.shm_replies, 4, "{stats:?}");

    // Either side saying socket keeps every request on the socket.
    let on_socket = client_with(&path, NoticePath::Socket);
    assert_eq!(five_requests(&on_socket), 1);
    let stats = on_socket.notice_stats();
    assert_eq!((stats.shm_requests, stats.shm_replies), (0, 0), "{stats:?}");
    let tmp2 = tempfile::tempdir().unwrap();
    let path2 = tmp_socket(&tmp2, "socket-server");
    let _socket_server = server_with_two(&path2, NoticePath::Socket);
    let asks = client_with(&path2, NoticePath::Shm);
    assert_eq!(five_requests(&asks), 1);
    let stats = asks.notice_stats();
    assert_eq!((stats.shm_requests, stats.shm_replies), (0, 0), "{stats:?}");
}

/// Requests from many threads at once, through the ring and (once it is
/// full) the socket, each answered to its own caller.
#[test]
fn concurrent_requests_through_the_ring_get_their_own_answers() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "concurrent");
    let server = server_with(&path, NoticePath::Shm);
    for i in 0..8 {
        server
            .publish(&format!("e{i}"), json!({ "i": i }), vec![])
            .unwrap();
    }
    let client = Arc::new(client_with(&path, NoticePath::Shm));
    let threads: Vec<_> = (0..8)
        .map(|i| {
            let client = Arc::clone(&client);
            std::thread::spawn(move || {
                for _ in 0..200 {
                    let a = client.attach(&format!("e{i}")).unwrap();
                    assert_eq!(a.meta, json!({ "i": i }));
                    client.ping().unwrap();
                    client.release(a.lease).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let stats = client.notice_stats();
    assert!(stats.shm_requests > 0, "{stats:?}");
    assert!(server.leases().is_empty());
}

/// A raw client granted requests, with its ends of the rings.
struct RawClient {
    s: UnixStream,
    tx: Sender,
    rx: Receiver,
    buf: Vec<u8>,
    /// Keeps the memfd and the wake-up end open.
    _fds: Vec<OwnedFd>,
}

impl RawClient {
    /// Connects, asking for requests through the rings if `requests`.
    fn connect(path: &Path, requests: bool) -> RawClient {
        let (s, fds) = raw_client_asking(path, requests);
        let area = Area::open(&fds[0], cuda_ipc_channel::NOTICE_RING_BYTES).unwrap();
        let (tx, rx) = area
            .split(ShmSide::Opener, fds[1].try_clone().unwrap())
            .unwrap();
        RawClient {
            s,
            tx,
            rx,
            buf: Vec::new(),
            _fds: fds,
        }
    }

    /// Puts `message` in the ring as sent after `after` socket messages.
    fn ring(&mut self, after: u64, message: &Message) {
        let mut record = after.to_le_bytes().to_vec();
        record.extend_from_slice(&encode(message, 0));
        assert!(self.tx.send(&record).unwrap());
    }

    /// The next message from the server, through the ring or the socket,
    /// within `within` (`None` if none came).
    fn next(&mut self, within: Duration) -> Option<Message> {
        let deadline = Instant::now() + within;
        loop {
            if self.rx.recv(&mut self.buf).unwrap() {
                let wire = &self.buf[8..];
                decode_header(wire).unwrap();
                return Some(Message::decode(&wire[HEADER_LEN..]).unwrap());
            }
            match recv_message(&self.s, Some(Instant::now() + Duration::from_millis(5))) {
                Ok((m, _)) => return Some(m),
                Err(ChannelError::Timeout { .. }) if Instant::now() < deadline => {}
                Err(ChannelError::Timeout { .. }) => return None,
                Err(e) => panic!("the server cut us off: {e}"),
            }
        }
    }
}

#[test]
fn a_request_through_the_ring_waits_for_the_socket_messages_sent_before_it() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "order");
    let server = server_with(&path, NoticePath::Shm);
    server.publish("e", json!({}), vec![]).unwrap();
    let mut c = RawClient::connect(&path, true);

    // The ring's ping says one socket message came before it: held.
    c.ring(1, &Message::Ping { id: 2 });
    assert_eq!(c.next(Duration::from_millis(300)), None);
    send_message(&c.s, &Message::Ping { id: 1 }, &[], None).unwrap();
    assert_eq!(
        c.next(Duration::from_secs(5)),
        Some(Message::Pong { id: 1 })
    );
    assert_eq!(
        c.next(Duration::from_secs(5)),
        Some(Message::Pong { id: 2 })
    );

    // A count already reached: served at once, attaches and releases too.
    c.ring(
        1,
        &Message::Attach {
            id: 3,
            name: "e".into(),
        },
    );
    let Some(Message::Attached { id: 3, lease, .. }) = c.next(Duration::from_secs(5)) else {
        panic!("expected the attach's answer");
    };
    c.ring(1, &Message::Release { id: 4, lease });
    assert_eq!(
        c.next(Duration::from_secs(5)),
        Some(Message::Released { id: 4 })
    );
    // A refusal answers through the ring as well.
    c.ring(
        1,
        &Message::Attach {
            id: 5,
            name: "missing".into(),
        },
    );
    assert!(
        matches!(
            c.next(Duration::from_secs(5)),
            Some(Message::Error { id: Some(5), ref code, .. }) if code == "not_found"
        ),
        "expected not_found"
    );
    assert!(server.leases().is_empty());
}

#[test]
fn anything_but_an_ack_or_a_granted_request_in_the_ring_cuts_the_client_off() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "not-requests");
    let server = server_with(&path, NoticePath::Shm);
    server.publish("e", json!({}), vec![]).unwrap();
    let good = client_with(&path, NoticePath::Shm);
    good.attach("e").unwrap();
    let not_requests = [
        Message::List { id: 1, after: None },
        Message::AttachRing {
            id: 1,
            name: "e".into(),
        },
        Message::Pong { id: 1 },
        Message::Hello {
            protocol: 1,
            pid: 1,
            shm_notices: true,
            shm_requests: true,
        },
    ];
    for m in &not_requests {
        let mut c = RawClient::connect(&path, true);
        c.ring(0, m);
        assert!(
            matches!(
                c.next(Duration::from_secs(5)),
                Some(Message::Error { ref message, .. }) if message.contains("carries acks, pings")
            ),
            "{m:?}"
        );
    }
    // A client that was not granted requests may send none through it.
    let mut c = RawClient::connect(&path, false);
    c.ring(0, &Message::Ping { id: 1 });
    assert!(
        matches!(
            c.next(Duration::from_secs(5)),
            Some(Message::Error { ref message, .. }) if message.contains("carries only acks")
        ),
        "expected an error before the cut"
    );
    // The good client never noticed.
    good.ping().unwrap();
    let v = server.update("e", json!("still there")).unwrap();
    match good.next_update(Duration::from_secs(5)).unwrap().notice {
        Notice::Updated { version, .. } => assert_eq!(version, v),
        other => panic!("{other:?}"),
    }
}
