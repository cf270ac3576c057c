//! The child processes: this test executable re-run in a role (survivor,
//! victim, producer, consumer) against a socket.

use super::*;

// ---------------------------------------------------------------------------
// Child processes

/// This test executable re-run for `test` in `role`, against the socket
/// at `path`, with the role's argument `arg`.
pub(crate) fn spawn_child(test: &str, role: &str, path: &Path, arg: &str) -> ChildProc {
    let mut cmd = test_command(&std::env::current_exe().unwrap(), test);
    cmd.env(CHILD_ENV, role)
        .env(PATH_ENV, path)
        .env(ARG_ENV, arg);
    ChildProc::start(cmd).expect("cannot re-run the test executable")
}

/// Exits this (child) process when stdin reaches end of file: the parent
/// closed it or died. Victims that are never killed end this way too.
pub(crate) fn exit_when_stdin_closes() {
    std::thread::spawn(|| {
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
        std::process::exit(0);
    });
}

/// Blocks until stdin is closed or the child's lifetime is over.
pub(crate) fn wait_for_stdin_close() {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
        let _ = tx.send(());
    });
    let _ = rx.recv_timeout(CHILD_LIFETIME);
}

pub(crate) fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

pub(crate) fn connect(path: &Path) -> Client {
    Client::connect(path, ClientConfig::default().with_timeout(ANSWER)).unwrap()
}

/// If this process is a child, runs its role and returns true.
pub(crate) fn run_child_role() -> bool {
    let Ok(role) = std::env::var(CHILD_ENV) else {
        return false;
    };
    let path = PathBuf::from(std::env::var_os(PATH_ENV).unwrap());
    let arg = std::env::var(ARG_ENV).unwrap_or_default();
    match role.as_str() {
        "survivor" => survivor(&path),
        "half-frame" => half_frame(&path, &arg),
        "churn" => churn(&path),
        "ring-noack" => ring_victim(&path, false),
        "ring-ack" => ring_victim(&path, true),
        "hold" => hold(&path, &arg),
        "producer" => producer(&path),
        "consumer" => consumer(&path),
        other => panic!("unknown child role {other}"),
    }
    true
}

/// Holds a lease on `base` and a ring subscription for the whole test:
/// checks and acks every ring frame ("ACK <seq>;"), and answers every
/// update of `base` with a ping and an attach/release cycle of `extra`
/// ("ROUND <n>;"). Any error is a failure: a survivor must never see one.
pub(crate) fn survivor(path: &Path) {
    let client = Arc::new(connect(path));
    let base = client.attach("base").unwrap();
    assert_eq!(read_fd(&base.fds[0], LEN), pattern(LEN, 1));
    let ring = client.attach_ring("ring").unwrap();
    assert_eq!(ring.slots.len(), RING_SLOTS);
    say(&format!(
        "CHILD-READY base={} ring={}",
        base.lease, ring.lease
    ));
    let stop = Arc::new(AtomicBool::new(false));
    let frames = {
        let (client, stop) = (Arc::clone(&client), Arc::clone(&stop));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                match client.next_frame(ring.lease, Duration::from_millis(100)) {
                    Ok(f) => {
                        let stamp = stamp_of(&ring.slots[f.slot as usize].1[0]);
                        assert_eq!(Some(stamp), f.notice["stamp"].as_u64(), "{f:?}");
                        client.ack(ring.lease, f.slot, f.seq).unwrap();
                        say(&format!("ACK {};", f.seq));
                    }
                    Err(ChannelError::Timeout { .. }) => {}
                    Err(e) => panic!("survivor: next_frame failed: {e}"),
                }
            }
        })
    };
    let updates = {
        let (client, stop) = (Arc::clone(&client), Arc::clone(&stop));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                match client.next_update(Duration::from_millis(100)) {
                    Ok(u) => {
                        let Notice::Updated { data, .. } = u.notice else {
                            panic!("survivor: unexpected notice {u:?}");
                        };
                        client.ping().unwrap();
                        let a = client.attach("extra").unwrap();
                        assert_eq!(read_fd(&a.fds[0], LEN), pattern(LEN, 2));
                        client.release(a.lease).unwrap();
                        say(&format!("ROUND {};", data["round"]));
                    }
                    Err(ChannelError::Timeout { .. }) => {}
                    Err(e) => panic!("survivor: next_update failed: {e}"),
                }
            }
        })
    };
    wait_for_stdin_close();
    stop.store(true, Ordering::Relaxed);
    frames.join().unwrap();
    updates.join().unwrap();
    client.release(base.lease).unwrap();
}

/// Writes the first part of a frame and stops there, to be killed: `arg`
/// is `<0: a hello | 1: an attach after the handshake>,<split>`.
pub(crate) fn half_frame(path: &Path, arg: &str) {
    exit_when_stdin_closes();
    let (after_handshake, split) = arg.split_once(',').unwrap();
    let after_handshake = after_handshake == "1";
    let split: usize = split.parse().unwrap();
    let mut s = UnixStream::connect(path).unwrap();
    let hello = Message::Hello {
        protocol: PROTOCOL_VERSION,
        pid: std::process::id(),
        shm_notices: false,
        shm_requests: false,
    };
    let frame = if after_handshake {
        send_message(&s, &hello, &[], None).unwrap();
        let (m, _) = recv_message(&s, Some(Instant::now() + ANSWER)).unwrap();
        assert!(matches!(m, Message::Welcome { .. }), "{m:?}");
        encode(
            &Message::Attach {
                id: 1,
                name: "v0".into(),
            },
            0,
        )
    } else {
        encode(&hello, 0)
    };
    let cut = 1 + split % (frame.len() - 1);
    s.write_all(&frame[..cut]).unwrap();
    say(&format!("CHILD-READY cut={cut}/{}", frame.len()));
    wait_for_stdin_close();
}

/// Attach/check/release cycles over the victim entries, with a ring
/// subscription now and then, as fast as it can, until killed.
pub(crate) fn churn(path: &Path) {
    exit_when_stdin_closes();
    let client = connect(path);
    say("CHILD-READY");
    for i in 0u64.. {
        let name = victim_entry(i);
        let a = client.attach(&name).unwrap();
        assert_eq!(read_fd(&a.fds[0], LEN), pattern(LEN, entry_seed(&name)));
        client.release(a.lease).unwrap();
        if i % 3 == 0 {
            let r = client.attach_ring("ring").unwrap();
            client.release(r.lease).unwrap();
        }
    }
}

/// Subscribes to the ring and reads frames, acking them or not, until killed.
pub(crate) fn ring_victim(path: &Path, ack: bool) {
    exit_when_stdin_closes();
    let client = connect(path);
    let ring = client.attach_ring("ring").unwrap();
    say(&format!("CHILD-READY ring={}", ring.lease));
    loop {
        match client.next_frame(ring.lease, Duration::from_millis(100)) {
            Ok(f) => {
                say(&format!("FRAME {};", f.seq));
                if ack {
                    client.ack(ring.lease, f.slot, f.seq).unwrap();
                }
            }
            Err(ChannelError::Timeout { .. }) => {}
            Err(e) => panic!("ring victim: {e}"),
        }
    }
}

/// Attaches to the entries named in `arg` (comma-separated; `ring` is the
/// ring) and holds the leases until killed.
pub(crate) fn hold(path: &Path, arg: &str) {
    exit_when_stdin_closes();
    let client = connect(path);
    let mut held = Vec::new();
    for name in arg.split(',') {
        if name == "ring" {
            held.push(client.attach_ring(name).unwrap().lease);
        } else {
            let a = client.attach(name).unwrap();
            assert_eq!(read_fd(&a.fds[0], LEN), pattern(LEN, entry_seed(name)));
            held.push(a.lease);
        }
    }
    say(&format!("CHILD-READY leases={held:?}"));
    wait_for_stdin_close();
}

/// A producer that never rests: an entry `p` it updates and a ring `pr` it
/// fills, as fast as the subscribers allow, until killed.
pub(crate) fn producer(path: &Path) {
    exit_when_stdin_closes();
    let server = Server::bind(ServerConfig::new(path)).unwrap();
    server
        .publish(
            "p",
            json!({"len": LEN, "seed": 9}),
            vec![memfd_with(&pattern(LEN, 9))],
        )
        .unwrap();
    let slots = (0..2)
        .map(|i| {
            (
                json!({ "slot": i }),
                vec![memfd_with(&pattern(LEN, 40 + i))],
            )
        })
        .collect();
    let ring = server.create_ring("pr", json!(null), slots).unwrap();
    say("CHILD-READY");
    for n in 0u64.. {
        if let Ok(slot) = ring.acquire(Some(Duration::from_millis(20))) {
            ring.publish(slot, json!({ "n": n })).unwrap();
        }
        server.update("p", json!({ "n": n })).unwrap();
        std::thread::sleep(Duration::from_micros(500));
    }
}

/// Attaches to `p` and follows its updates until the producer is gone:
/// prints "GONE" on `PeerGone`, anything else is a failure.
pub(crate) fn consumer(path: &Path) {
    exit_when_stdin_closes();
    let client = connect(path);
    let a = client.attach("p").unwrap();
    assert_eq!(read_fd(&a.fds[0], LEN), pattern(LEN, 9));
    say("CHILD-READY");
    loop {
        match client.next_update(ANSWER) {
            Ok(_) => {}
            Err(ChannelError::PeerGone) => {
                // The memory outlives its producer.
                assert_eq!(read_fd(&a.fds[0], LEN), pattern(LEN, 9));
                say("GONE");
                wait_for_stdin_close();
                return;
            }
            Err(e) => panic!("consumer: expected PeerGone, got {e}"),
        }
    }
}
