//! Hostile peers: each way a client or a server could pin the other's
//! memory, descriptors or time, and the bound that stops it.

use std::os::unix::net::UnixListener;

use super::*;

/// An Attached answer for one 2-descriptor entry, as the wire carries it.
fn attached_len() -> usize {
    HEADER_LEN
        + Message::Attached {
            id: 100,
            lease: 100,
            meta: std::sync::Arc::new(json!({"len": 4}).into()),
            fds: 2,
        }
        .encode()
        .len()
}

/// A client that sends attaches and reads nothing gets only a few
/// descriptors in flight: the rest wait for it to read, so it cannot push
/// its user past the kernel's limit on descriptors in flight, nor make the
/// server hold hundreds of duplicates.
#[test]
fn a_client_that_never_reads_pins_few_descriptors() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "pin");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    publish_two_fds(&server);
    let raw = raw_connect(&path, true);
    let flood = {
        let raw = raw.try_clone().unwrap();
        std::thread::spawn(move || {
            for id in 0..400 {
                let attach = Message::Attach {
                    id,
                    name: "e".into(),
                };
                // The server stops reading; the sends then fail on the
                // deadline, which is fine.
                let deadline = Instant::now() + Duration::from_secs(2);
                if send_message(&raw, &attach, &[], Some(deadline)).is_err() {
                    break;
                }
            }
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    let unread = rustix::io::ioctl_fionread(&raw).unwrap() as usize;
    let replies = unread.div_ceil(attached_len());
    assert!(
        2 * replies <= ServerConfig::new(&path).max_unread_fds + 2,
        "{replies} answers with 2 descriptors each wait unread for a client that does not read"
    );
    // Everyone else is served meanwhile.
    let steady = quick_client(&path);
    let a = steady.attach("e").unwrap();
    assert_eq!(read_fd(&a.fds[0], 4), b"abcd");
    drop(raw);
    flood.join().unwrap();
}

/// A request larger than the request limit is refused before its payload
/// is read; a name that is not valid is answered with an error whose echo
/// is truncated, never with a reply the size of the request.
#[test]
fn requests_are_capped_and_names_checked() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "cap");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    let deadline = || Some(Instant::now() + Duration::from_secs(5));

    // 1 MiB of name: the header alone gets it refused.
    let s = raw_connect(&path, true);
    let huge = Message::Attach {
        id: 1,
        name: "n".repeat(MAX_PAYLOAD as usize - 100),
    };
    let _ = send_message(&s, &huge, &[], deadline());
    match recv_message(&s, deadline()) {
        Ok((
            Message::Error {
                id: None, message, ..
            },
            _,
        )) => {
            assert!(message.contains("exceeds the limit of 4096"), "{message}");
        }
        other => panic!("expected a connection error, got {other:?}"),
    }

    // Names that are not valid: answered, the echo bounded.
    let s = raw_connect(&path, true);
    for (id, name) in [
        (2, "x".repeat(3000)),
        (3, "bad\nname".to_owned()),
        (4, String::new()),
    ] {
        send_message(&s, &Message::Attach { id, name }, &[], deadline()).unwrap();
        match recv_message(&s, deadline()).unwrap().0 {
            Message::Error {
                id: Some(got),
                code,
                message,
                ..
            } => {
                assert_eq!((got, code.as_str()), (id, "invalid_name"));
                assert!(message.len() < 400, "an echo of {} bytes", message.len());
            }
            other => panic!("{other:?}"),
        }
    }
    let not_found = Message::AttachRing {
        id: 5,
        name: "y".repeat(256),
    };
    send_message(&s, &not_found, &[], deadline()).unwrap();
    match recv_message(&s, deadline()).unwrap().0 {
        Message::Error { code, message, .. } => {
            assert_eq!(code, "not_found");
            assert!(message.len() < 200, "an echo of {} bytes", message.len());
        }
        other => panic!("{other:?}"),
    }
    drop(server);
}

/// A reply too long for the wire is an error answering the request, not
/// a silent close. (A name of 270,000 quotes, 540 KB of request to a server
/// that takes requests up to the wire's limit, once came back as a
/// not-found echo of over 1 MiB, and the connection was cut.)
#[test]
fn an_over_long_answer_is_an_error_frame() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "long");
    let _server =
        Server::bind(ServerConfig::new(&path).with_max_request_bytes(MAX_PAYLOAD)).unwrap();
    let s = raw_connect(&path, true);
    let deadline = || Some(Instant::now() + Duration::from_secs(5));
    let attach = Message::Attach {
        id: 7,
        name: "\"".repeat(270_000),
    };
    send_message(&s, &attach, &[], deadline()).unwrap();
    match recv_message(&s, deadline()) {
        Ok((Message::Error { id: Some(7), .. }, _)) => {}
        other => panic!("expected an error answering request 7, got {other:?}"),
    }
    send_message(&s, &Message::Ping { id: 8 }, &[], deadline()).unwrap();
    assert_eq!(
        recv_message(&s, deadline()).unwrap().0,
        Message::Pong { id: 8 }
    );
}

/// A fake server: accepts one client, answers its hello, then runs `then`.
fn fake_server(
    path: &Path,
    then: impl FnOnce(UnixStream) + Send + 'static,
) -> std::thread::JoinHandle<()> {
    let listener = UnixListener::bind(path).unwrap();
    std::thread::spawn(move || {
        let (s, _) = listener.accept().unwrap();
        let deadline = Some(Instant::now() + Duration::from_secs(5));
        let (hello, _) = recv_message(&s, deadline).unwrap();
        assert!(matches!(hello, Message::Hello { .. }), "{hello:?}");
        let welcome = Message::Welcome {
            protocol: 1,
            pid: std::process::id(),
            shm_notices: None,
            shm_requests: false,
            restarts: false,
        };
        send_message(&s, &welcome, &[], deadline).unwrap();
        then(s);
    })
}

/// Runs `f` on another thread and fails if it takes longer than `limit`.
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("still blocked after {limit:?}"))
}

/// A server that trickles a message one byte at a time cannot hold a call
/// past its deadline.
#[test]
fn a_trickling_server_cannot_hold_a_call_past_its_deadline() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "trickle");
    let server = fake_server(&path, |s| {
        let update = encode(
            &Message::Update {
                lease: 1,
                name: "e".into(),
                version: 1,
                notice: json!(null),
            },
            0,
        );
        for b in update.iter().cycle().take(60) {
            if send_bytes(&s, &[*b], &[], None).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    let client = Client::connect(
        &path,
        ClientConfig::default().with_timeout(Duration::from_millis(500)),
    )
    .unwrap();
    let started = Instant::now();
    let r = within(Duration::from_secs(3), move || client.ping());
    assert!(r.is_err(), "{r:?}");
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "ping with a 500 ms timeout took {:?}",
        started.elapsed()
    );
    server.join().unwrap();
}

/// A server that never answers but keeps sending notices cannot hold a
/// call past its deadline either.
#[test]
fn a_chattering_server_cannot_hold_a_call_past_its_deadline() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "chatter");
    let _server = fake_server(&path, |s| {
        // Notices back to back, for as long as the client listens.
        for version in 1.. {
            let update = Message::Update {
                lease: 1,
                name: "e".into(),
                version,
                notice: json!(null),
            };
            if send_message(&s, &update, &[], None).is_err() {
                return;
            }
        }
    });
    let client = Client::connect(
        &path,
        ClientConfig::default().with_timeout(Duration::from_millis(300)),
    )
    .unwrap();
    let started = Instant::now();
    let r = within(Duration::from_secs(3), move || client.ping());
    assert!(matches!(r, Err(ChannelError::Timeout { .. })), "{r:?}");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
}

/// Notices about leases the client does not hold are dropped, not queued.
#[test]
fn notices_for_leases_not_held_are_dropped() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "notices");
    let server = fake_server(&path, |s| {
        for version in 1..=2000 {
            let update = Message::Update {
                lease: 999,
                name: "not-yours".into(),
                version,
                notice: json!({"pad": "p".repeat(100)}),
            };
            send_message(&s, &update, &[], None).unwrap();
        }
        let unpublished = Message::Unpublished {
            lease: 998,
            name: "not-yours".into(),
        };
        send_message(&s, &unpublished, &[], None).unwrap();
        let deadline = Some(Instant::now() + Duration::from_secs(5));
        let (ping, _) = recv_message(&s, deadline).unwrap();
        let Message::Ping { id } = ping else {
            panic!("{ping:?}")
        };
        send_message(&s, &Message::Pong { id }, &[], None).unwrap();
        // Hold the connection until the client is done.
        let _ = recv_message(&s, deadline);
    });
    let client = Client::connect(&path, ClientConfig::default()).unwrap();
    client.ping().unwrap();
    let r = client.next_update(Duration::ZERO);
    assert!(matches!(r, Err(ChannelError::Timeout { .. })), "{r:?}");
    drop(client);
    server.join().unwrap();
}

/// Idle connections are capped per process and closed after the idle
/// timeout, so that they cannot lock everyone else out.
#[test]
fn idle_connections_are_capped_and_closed() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "idle");
    let _server = Server::bind(
        ServerConfig::new(&path)
            .with_max_connections_per_pid(4)
            .with_idle_timeout(Duration::from_millis(300)),
    )
    .unwrap();
    let idle: Vec<UnixStream> = (0..4).map(|_| raw_connect(&path, true)).collect();
    // A fifth connection of this process is turned away, saying why.
    let e = Client::connect(&path, ClientConfig::default()).unwrap_err();
    assert!(e.to_string().contains("already has 4 connections"), "{e}");
    // The idle ones are closed, with an error saying so.
    let deadline = Some(Instant::now() + Duration::from_secs(5));
    for s in &idle {
        match recv_message(s, deadline) {
            Ok((Message::Error { code, .. }, _)) => assert_eq!(code, "idle"),
            other => panic!("{other:?}"),
        }
    }
    // With them gone, this process may connect again.
    let client = Client::connect(&path, ClientConfig::default()).unwrap();
    client.ping().unwrap();
}

/// A connection holds at most the configured number of leases.
#[test]
fn leases_per_connection_are_capped() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "leases");
    let server = Server::bind(ServerConfig::new(&path).with_max_leases_per_connection(50)).unwrap();
    server
        .publish("e", json!(null), vec![memfd_with(b"x")])
        .unwrap();
    let client = quick_client(&path);
    let held: Vec<_> = (0..50).map(|_| client.attach("e").unwrap()).collect();
    match client.attach("e") {
        Err(ChannelError::Remote { code, .. }) => assert_eq!(code, "too_many_leases"),
        other => panic!("{other:?}"),
    }
    // Another connection is not affected.
    quick_client(&path).attach("e").unwrap();
    client.release(held[0].lease).unwrap();
    client.attach("e").unwrap();
    drop(client);
    server
        .wait_released("e", Some(Duration::from_secs(5)))
        .unwrap();
}

/// Calls from raw peers (a service's admin methods travel as calls): a
/// call that brings descriptors and one whose body is not JSON (a NaN)
/// end their connection before the handler sees them; a peer that floods
/// calls with long answers and reads none is paced (the server takes no
/// more of its requests than a window of answers), and gets every answer,
/// in order, once it reads. Other clients are served throughout.
#[test]
fn hostile_calls_end_or_pace_only_their_own_connection() {
    use cuda_ipc_channel::CallHandler;

    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "calls");
    let seen = Arc::new(Mutex::new(0usize));
    let counter = Arc::clone(&seen);
    let mut config = ServerConfig::new(&path);
    config.call_handler = Some(CallHandler::new(move |_, method, body| {
        *counter.lock().unwrap() += 1;
        Ok(if method == "big" {
            json!("b".repeat(60_000))
        } else {
            body.clone()
        })
    }));
    let _server = Server::bind(config).unwrap();
    let ended = |raw: &UnixStream, what: &str| {
        // An error naming the fault may come first; then the end.
        let deadline = Some(Instant::now() + Duration::from_secs(5));
        let mut said = String::new();
        loop {
            match recv_message(raw, deadline) {
                Ok((Message::Error { code, message, .. }, _)) => {
                    said = format!("{code}: {message}");
                }
                Ok((other, _)) => panic!("{what}: answered {other:?}"),
                Err(ChannelError::PeerGone) => return said,
                Err(e) => panic!("{what}: the connection did not end: {e}"),
            }
        }
    };

    let raw = raw_connect(&path, true);
    let call = Message::Call {
        id: 1,
        method: "echo".into(),
        body: json!({"set": "m"}),
    };
    let fd = memfd_with(b"abcd");
    send_message(&raw, &call, &[fd.as_fd()], None).unwrap();
    let said = ended(&raw, "a call with a descriptor");
    assert!(said.contains("file descriptors"), "{said}");

    let raw = raw_connect(&path, true);
    let not_json = br#"{"type":"call","id":2,"method":"echo","body":{"streams":NaN}}"#;
    send_bytes(&raw, &json_frame(not_json, 0), &[], None).unwrap();
    ended(&raw, "a call that is not JSON");
    assert_eq!(*seen.lock().unwrap(), 0, "the handler saw a hostile call");

    // Calls of 60 KB answers, sent without reading any: the server stops
    // reading the peer's requests once a window of answers waits (so the
    // peer's sends block), and answers every request it took once the peer
    // reads.
    let raw = raw_connect(&path, true);
    let mut sent = 0;
    for id in 0..2000 {
        let call = Message::Call {
            id,
            method: "big".into(),
            body: json!({}),
        };
        let deadline = Some(Instant::now() + Duration::from_millis(300));
        if send_message(&raw, &call, &[], deadline).is_err() {
            break;
        }
        sent += 1;
    }
    std::thread::sleep(Duration::from_millis(300));
    let taken = *seen.lock().unwrap();
    eprintln!("sent {sent}, handler saw {taken}");
    assert!(
        sent < 2000,
        "the server read every request of a peer that reads nothing"
    );
    let steady = quick_client(&path);
    assert_eq!(steady.call("echo", &json!([1])).unwrap(), json!([1]));
    let mut answers = 0;
    let deadline = Some(Instant::now() + Duration::from_secs(20));
    while answers < sent {
        match recv_message(&raw, deadline) {
            Ok((Message::Reply { id, .. }, _)) => {
                assert_eq!(id, answers, "answers out of order");
                answers += 1;
            }
            other => panic!("after {answers} of {sent} answers: {other:?}"),
        }
    }
    assert_eq!(steady.call("echo", &json!([2])).unwrap(), json!([2]));
}
