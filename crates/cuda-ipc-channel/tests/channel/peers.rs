//! Peers: credentials, malformed wire messages, garbage, clients that do not read.

use super::*;

#[test]
fn the_welcome_says_whether_another_process_serves_after_the_server() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "restarts");
    for (restarts, notices) in [
        (false, cuda_ipc_channel::NoticePath::Shm),
        (true, cuda_ipc_channel::NoticePath::Shm),
        (true, cuda_ipc_channel::NoticePath::Socket),
    ] {
        let server = Server::bind(ServerConfig::new(&path).with_restarts(restarts)).unwrap();
        let client = client_with(&path, notices);
        assert_eq!(client.server_restarts(), restarts, "{notices:?}");
        drop(client);
        drop(server);
    }
}

#[test]
fn connecting_within_a_time_gives_up_then_and_keeps_the_requests_timeout() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "silent");
    // A listener that never answers: the connection waits in its backlog.
    let silent = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let config = ClientConfig::default().with_timeout(Duration::from_secs(30));
    let started = Instant::now();
    let e = Client::connect_within(&path, config.clone(), Duration::from_millis(100)).unwrap_err();
    assert!(matches!(e, ChannelError::Timeout { .. }), "{e}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    drop(silent);
    std::fs::remove_file(&path).unwrap();
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    let client = Client::connect_within(&path, config, Duration::from_secs(5)).unwrap();
    assert!(format!("{client:?}").contains("timeout: 30s"), "{client:?}");
    client.ping().unwrap();
    drop(server);
}

#[test]
fn peer_checks_refuse_other_users() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "peer");
    let me = rustix::process::geteuid().as_raw();
    let other = me.wrapping_add(4242);

    let server = Server::bind(ServerConfig::new(&path).with_allowed_uids([other])).unwrap();
    let e = Client::connect(&path, ClientConfig::default()).unwrap_err();
    match &e {
        ChannelError::Refused { by, uid, allowed } => {
            assert_eq!(*by, Side::Server);
            assert_eq!(*uid, me);
            assert_eq!(allowed, &vec![other]);
        }
        e => panic!("expected a refusal, got {e}"),
    }
    assert_eq!(e.kind(), ErrorKind::Peer);
    assert!(e.to_string().contains(&format!("uid {me}")), "{e}");
    assert_eq!(server.connection_count(), 0);
    drop(server);

    // The client checks the server too.
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    let e = Client::connect(
        &path,
        ClientConfig::default().with_allowed_server_uids([other]),
    )
    .unwrap_err();
    assert!(
        matches!(&e, ChannelError::Refused { by: Side::Client, uid, .. } if *uid == me),
        "{e}"
    );
    quick_client(&path).ping().unwrap();
    drop(server);
}

/// Something to send over a raw connection.
type Sender<'a> = Box<dyn Fn(&UnixStream) + 'a>;

/// One malformed input and what the server must answer to it.
struct Case<'a> {
    /// The case, for failure messages.
    what: &'static str,
    /// Whether to shake hands before sending.
    handshake: bool,
    /// What to send.
    send: Sender<'a>,
    /// The error code expected in the answer; empty: a normal answer.
    code: &'static str,
    /// Text the error message must contain.
    text: &'static str,
}

#[test]
#[allow(clippy::too_many_lines)] // a table of cases
fn malformed_frames_get_an_error_and_a_close_and_the_server_carries_on() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "fuzz");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    server
        .publish("good", json!({"len": 4}), vec![memfd_with(b"good")])
        .unwrap();
    let steady = quick_client(&path);
    let steady_lease = steady.attach("good").unwrap();
    let fd = memfd_with(b"x");

    let ping = Message::Ping { id: 1 }.encode();
    let with_header = |f: &dyn Fn(&mut [u8; HEADER_LEN])| {
        let mut h = support::wire::header(ping.len() as u32, 0);
        f(&mut h);
        let mut frame = h.to_vec();
        frame.extend_from_slice(&ping);
        frame
    };
    let bytes = |b: Vec<u8>| -> Sender<'_> {
        Box::new(move |s: &UnixStream| send_bytes(s, &b, &[], None).unwrap())
    };
    let cases: Vec<Case<'_>> = vec![
        Case {
            what: "bad magic",
            handshake: false,
            send: bytes(with_header(&|h| h[..4].copy_from_slice(b"GET "))),
            code: "malformed_frame",
            text: "bad magic",
        },
        Case {
            what: "bad version",
            handshake: true,
            send: bytes(with_header(&|h| h[4] = 2)),
            code: "malformed_frame",
            text: "protocol version 2",
        },
        Case {
            what: "bad kind",
            handshake: true,
            send: bytes(with_header(&|h| h[6] = 7)),
            code: "malformed_frame",
            text: "payload kind 7",
        },
        Case {
            what: "reserved",
            handshake: true,
            send: bytes(with_header(&|h| h[14] = 1)),
            code: "malformed_frame",
            text: "reserved",
        },
        Case {
            what: "oversize",
            handshake: true,
            send: bytes(with_header(&|h| {
                h[8..12].copy_from_slice(&(MAX_PAYLOAD * 2).to_le_bytes());
            })),
            code: "malformed_frame",
            text: "exceeds the limit",
        },
        Case {
            what: "too many fds",
            handshake: true,
            send: bytes(with_header(&|h| h[12] = 40)),
            code: "malformed_frame",
            text: "40 file descriptors",
        },
        Case {
            what: "short header",
            handshake: true,
            send: Box::new(|s: &UnixStream| {
                send_bytes(s, &MAGIC, &[], None).unwrap();
                s.shutdown(std::net::Shutdown::Write).unwrap();
            }),
            code: "malformed_frame",
            text: "wire header truncated",
        },
        Case {
            what: "short payload",
            handshake: true,
            send: Box::new(|s: &UnixStream| {
                send_bytes(s, &json_frame(&ping, 0)[..HEADER_LEN + 3], &[], None).unwrap();
                s.shutdown(std::net::Shutdown::Write).unwrap();
            }),
            code: "malformed_frame",
            text: "payload truncated",
        },
        Case {
            what: "not utf-8",
            handshake: true,
            send: bytes(json_frame(b"{\"type\":\xc0}", 0)),
            code: "malformed_frame",
            text: "UTF-8",
        },
        Case {
            what: "not json",
            handshake: true,
            send: bytes(json_frame(b"{type: ping}", 0)),
            code: "malformed_frame",
            text: "not valid JSON",
        },
        Case {
            what: "not an object",
            handshake: true,
            send: bytes(json_frame(b"42", 0)),
            code: "malformed_frame",
            text: "not a message",
        },
        Case {
            what: "unknown type",
            handshake: true,
            send: bytes(json_frame(br#"{"type":"shutdown"}"#, 0)),
            code: "malformed_frame",
            text: "unknown message type \"shutdown\"",
        },
        Case {
            what: "missing field",
            handshake: true,
            send: bytes(json_frame(br#"{"type":"attach","id":3}"#, 0)),
            code: "malformed_frame",
            text: "missing field `name`",
        },
        Case {
            what: "extra field",
            handshake: true,
            send: bytes(json_frame(br#"{"type":"ping","id":3,"admin":true}"#, 0)),
            code: "malformed_frame",
            text: "unknown field `admin`",
        },
        Case {
            what: "announced fd missing",
            handshake: true,
            send: bytes(json_frame(&ping, 1)),
            code: "malformed_frame",
            text: "announced 1 file descriptors but 0",
        },
        Case {
            what: "unannounced fd",
            handshake: true,
            send: Box::new(|s: &UnixStream| {
                send_bytes(s, &json_frame(&ping, 0), &[fd.as_fd()], None).unwrap();
            }),
            code: "malformed_frame",
            text: "announced 0 file descriptors but 1",
        },
        Case {
            what: "fd with a ping",
            handshake: true,
            send: Box::new(|s: &UnixStream| {
                send_bytes(s, &json_frame(&ping, 1), &[fd.as_fd()], None).unwrap();
            }),
            code: "protocol",
            text: "file descriptors",
        },
        Case {
            what: "fd flood",
            handshake: true,
            send: Box::new(|s: &UnixStream| {
                let many: Vec<BorrowedFd<'_>> = (0..40).map(|_| fd.as_fd()).collect();
                send_bytes(s, &json_frame(&ping, 16), &many, None).unwrap();
            }),
            code: "malformed_frame",
            text: "discarded",
        },
        Case {
            what: "server message",
            handshake: true,
            send: bytes(json_frame(&Message::Pong { id: 1 }.encode(), 0)),
            code: "protocol",
            text: "server message",
        },
        Case {
            what: "no hello",
            handshake: false,
            send: bytes(json_frame(&ping, 0)),
            code: "protocol",
            text: "expected a \"hello\" message first",
        },
        Case {
            what: "second hello",
            handshake: true,
            send: bytes(json_frame(
                &Message::Hello {
                    protocol: 1,
                    pid: 1,
                    shm_notices: false,
                    shm_requests: false,
                }
                .encode(),
                0,
            )),
            code: "protocol",
            text: "second \"hello\"",
        },
        Case {
            what: "old protocol",
            handshake: false,
            send: bytes(json_frame(
                &Message::Hello {
                    protocol: 9,
                    pid: 1,
                    shm_notices: false,
                    shm_requests: false,
                }
                .encode(),
                0,
            )),
            code: "unsupported_protocol",
            text: "protocol 9",
        },
        Case {
            what: "well-formed attach",
            handshake: true,
            send: bytes(json_frame(
                &Message::Attach {
                    id: 1,
                    name: "good".into(),
                }
                .encode(),
                0,
            )),
            code: "",
            text: "",
        },
    ];

    for Case {
        what,
        handshake,
        send,
        code,
        text,
    } in &cases
    {
        let s = raw_connect(&path, *handshake);
        send(&s);
        let deadline = Some(Instant::now() + Duration::from_secs(5));
        if code.is_empty() {
            // A well-formed request: answered, connection kept.
            let (m, fds) = recv_message(&s, deadline).unwrap();
            assert!(matches!(m, Message::Attached { .. }), "{what}: {m:?}");
            assert_eq!(fds.len(), 1);
            send_bytes(&s, &json_frame(&ping, 0), &[], None).unwrap();
            assert_eq!(
                recv_message(&s, deadline).unwrap().0,
                Message::Pong { id: 1 }
            );
            continue;
        }
        match recv_message(&s, deadline) {
            Ok((
                Message::Error {
                    id: None,
                    code: c,
                    message,
                    ..
                },
                fds,
            )) => {
                assert_eq!(&c, code, "{what}: {message}");
                assert!(message.contains(text), "{what}: {message:?} lacks {text:?}");
                assert!(fds.is_empty());
            }
            other => panic!("{what}: expected an error frame, got {other:?}"),
        }
        // Then the server closes the connection.
        match recv_message(&s, deadline) {
            Err(ChannelError::PeerGone) => {}
            other => panic!("{what}: expected the connection closed, got {other:?}"),
        }
        // Everyone else is still served.
        steady.ping().unwrap();
    }

    // A peer that connects and says nothing is dropped after the handshake timeout.
    let impatient = tmp_socket(&tmp, "impatient");
    let server2 = Server::bind(
        ServerConfig::new(&impatient).with_handshake_timeout(Duration::from_millis(100)),
    )
    .unwrap();
    let s = raw_connect(&impatient, false);
    let (m, _) = recv_message(&s, Some(Instant::now() + Duration::from_secs(5))).unwrap();
    assert!(
        matches!(&m, Message::Error { code, message, .. } if code == "protocol" && message.contains("no \"hello\"")),
        "{m:?}"
    );
    drop(server2);

    // Garbage connections left no leases behind; the steady client is fine.
    assert_eq!(server.lease_count("good"), 1);
    let a = quick_client(&path).attach("good").unwrap();
    assert_eq!(read_fd(&a.fds[0], 4), b"good");
    steady.release(steady_lease.lease).unwrap();
}

#[test]
fn a_client_that_does_not_read_is_disconnected() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "slow");
    let server = Server::bind(
        ServerConfig::new(&path)
            .with_max_queued_frames(8)
            .with_send_timeout(Duration::from_millis(200)),
    )
    .unwrap();
    server.publish("e", json!(null), vec![]).unwrap();
    let lazy = quick_client(&path);
    let _lease = lazy.attach("e").unwrap();
    let reader = quick_client(&path);
    let blob = json!("b".repeat(128 * 1024));
    // The lazy client never reads: its socket buffer fills, its queue
    // overflows or its sends time out, and it is cut off. The producer
    // never blocks: blocking on each stalled send would take 200 x 200 ms =
    // 40 s; the bound leaves room for a loaded machine.
    let started = Instant::now();
    for _ in 0..200 {
        server.update("e", blob.clone()).unwrap();
    }
    assert!(started.elapsed() < Duration::from_secs(20));
    server
        .wait_released("e", Some(Duration::from_secs(5)))
        .unwrap();
    reader.ping().unwrap();
    // The lazy client gets what was sent, then learns the connection ended.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match lazy.next_update(Duration::from_secs(5)) {
            Ok(_) => assert!(Instant::now() < deadline),
            Err(ChannelError::PeerGone) => break,
            Err(e) => panic!("expected PeerGone, got {e}"),
        }
    }
    assert!(!lazy.is_alive());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Whatever bytes a client sends, the server answers or closes the
    /// connection within the deadline, and keeps serving everyone else.
    #[test]
    fn the_server_survives_garbage(
        handshake in any::<bool>(),
        bytes in prop::collection::vec(any::<u8>(), 0..200),
        valid_header in any::<bool>(),
    ) {
        // A server of its own per case: its socket and directory go with it
        // (a server in a static would never be dropped and leave both behind).
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp_socket(&tmp, "garbage");
        let server = Server::bind(ServerConfig::new(&path)).unwrap();
        server
            .publish("e", json!({"len": 4}), vec![memfd_with(b"abcd")])
            .unwrap();
        let steady = quick_client(&path);
        let s = raw_connect(&path, handshake);
        let sent = if valid_header {
            json_frame(&bytes, 0)
        } else {
            bytes.clone()
        };
        send_bytes(&s, &sent, &[], None).unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        let deadline = Some(Instant::now() + Duration::from_secs(10));
        // Read until the server closes: every frame must be well formed.
        loop {
            match recv_message(&s, deadline) {
                Ok(_) => {}
                Err(ChannelError::PeerGone) => break,
                Err(e) => prop_assert!(false, "unexpected {e}"),
            }
        }
        prop_assert!(steady.ping().is_ok());
        prop_assert_eq!(server.lease_count("e"), 0);
    }
}
