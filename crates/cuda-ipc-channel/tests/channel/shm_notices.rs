//! Notices and acks through shared memory: the path is taken and
//! reported, either side can refuse it, order holds across both paths, a
//! client that scribbles over its rings is cut off alone, and a peer that
//! dies wakes a sleeper at once.

use cuda_ipc_channel::{NOTICE_RING_BYTES, NoticePath};
use cuda_ipc_shm::{Area, Side as ShmSide};

use super::*;

/// Where the client-to-server (ack) ring starts in a connection's memfd.
const ACK_RING: u64 = 256 + NOTICE_RING_BYTES as u64;
/// Offsets within a ring's header.
const HEAD: u64 = 64;
const TAIL: u64 = 128;

fn next_version(client: &Client) -> u64 {
    match client.next_update(Duration::from_secs(10)).unwrap().notice {
        Notice::Updated { version, .. } => version,
        other => panic!("expected an update, got {other:?}"),
    }
}

#[test]
fn notices_and_acks_go_through_shared_memory() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "shm-path");
    let server = server_with(&path, NoticePath::Shm);
    server.publish("e", json!({}), vec![]).unwrap();
    let ring = server.create_ring("r", json!({}), ring_slots(1)).unwrap();
    let client = client_with(&path, NoticePath::Shm);
    let a = client.attach("e").unwrap();
    let sub = client.attach_ring("r").unwrap();
    for v in 1..=50 {
        assert_eq!(server.update("e", json!({"v": v})).unwrap(), v);
        assert_eq!(next_version(&client), v);
    }
    for seq in 1..=20 {
        let slot = ring.acquire(Some(Duration::from_secs(5))).unwrap();
        ring.publish(slot, json!({"seq": seq})).unwrap();
        let f = client
            .next_frame(sub.lease, Duration::from_secs(5))
            .unwrap();
        assert_eq!((f.seq, &f.notice), (seq, &json!({"seq": seq})));
        client.ack(sub.lease, f.slot, f.seq).unwrap();
    }
    // The last ack came through the ring: the slot is free again.
    ring.acquire(Some(Duration::from_secs(5))).unwrap();
    let stats = client.notice_stats();
    assert_eq!(stats.path, NoticePath::Shm);
    // Every notice once, by one path or the other. A notice takes the
    // socket (in order) when the server's writer thread has not yet
    // finished with the message before it, which a loaded machine can
    // stretch to many notices (seen in CI: 15 of 70); on an idle one all
    // 70 take the ring. The ring must have carried some of them.
    assert_eq!(stats.shm_notices + stats.socket_notices, 70, "{stats:?}");
    assert!(stats.shm_notices > 0, "no notice took the ring: {stats:?}");
    assert_eq!((stats.shm_acks, stats.socket_acks), (20, 0));
    client.release(a.lease).unwrap();
}

#[test]
fn either_side_saying_socket_keeps_the_socket() {
    let tmp = tempfile::tempdir().unwrap();
    for (server_path, client_path) in [
        (NoticePath::Shm, NoticePath::Socket),
        (NoticePath::Socket, NoticePath::Shm),
    ] {
        let path = tmp_socket(&tmp, "fallback");
        let server = server_with(&path, server_path);
        server.publish("e", json!({}), vec![]).unwrap();
        let ring = server.create_ring("r", json!({}), ring_slots(1)).unwrap();
        let client = client_with(&path, client_path);
        client.attach("e").unwrap();
        let sub = client.attach_ring("r").unwrap();
        server.update("e", json!(1)).unwrap();
        assert_eq!(next_version(&client), 1);
        let slot = ring.acquire(Some(Duration::from_secs(5))).unwrap();
        ring.publish(slot, json!(null)).unwrap();
        let f = client
            .next_frame(sub.lease, Duration::from_secs(5))
            .unwrap();
        client.ack(sub.lease, f.slot, f.seq).unwrap();
        ring.acquire(Some(Duration::from_secs(5))).unwrap();
        let stats = client.notice_stats();
        assert_eq!(stats.path, NoticePath::Socket);
        assert_eq!((stats.shm_notices, stats.socket_notices), (0, 2));
        assert_eq!((stats.shm_acks, stats.socket_acks), (0, 1));
        drop((ring, server));
    }
}

/// Notices too long for the ring, and notices sent while the ring is full
/// (the client does not read), go on the socket; the client still gets
/// every version, in order.
#[test]
fn order_holds_when_notices_take_both_paths() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "both-paths");
    let server = server_with(&path, NoticePath::Shm);
    server.publish("e", json!({}), vec![]).unwrap();
    let client = client_with(&path, NoticePath::Shm);
    client.attach("e").unwrap();
    let big = "x".repeat(NOTICE_RING_BYTES + 1000);
    let mut sent = 0;
    for i in 0..3000u64 {
        let notice = if i % 500 == 7 { json!(big) } else { json!(i) };
        sent = server.update("e", notice).unwrap();
    }
    for v in 1..=sent {
        assert_eq!(next_version(&client), v);
    }
    let stats = client.notice_stats();
    assert!(stats.shm_notices > 100, "{stats:?}");
    assert!(stats.socket_notices > 6, "{stats:?}");
    assert_eq!(stats.shm_notices + stats.socket_notices, sent);
}

/// A subscriber that joins while frames stream gets the ring's slots (on
/// the socket) before any frame (through the ring), so it drops none and
/// the producer never waits for an ack that cannot come.
#[test]
fn frames_never_overtake_the_subscription_they_belong_to() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "join-mid-stream");
    let server = server_with(&path, NoticePath::Shm);
    let ring = Arc::new(server.create_ring("r", json!({}), ring_slots(2)).unwrap());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let producer = {
        let (ring, stop) = (Arc::clone(&ring), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                // A frame the subscriber dropped would never be acked.
                let slot = ring.acquire(Some(Duration::from_secs(10))).unwrap();
                ring.publish(slot, json!(i)).unwrap();
                i += 1;
            }
        })
    };
    for _ in 0..20 {
        let client = client_with(&path, NoticePath::Shm);
        let sub = client.attach_ring("r").unwrap();
        let mut last = 0;
        for _ in 0..20 {
            let f = client
                .next_frame(sub.lease, Duration::from_secs(10))
                .unwrap();
            assert!(f.seq > last, "frame {} after {last}", f.seq);
            last = f.seq;
            client.ack(sub.lease, f.slot, f.seq).unwrap();
        }
        client.release(sub.lease).unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    producer.join().unwrap();
}

/// A raw client that asks for the rings: its socket and the descriptors
/// of the welcome (the memfd, its end of the wake-up socket pair).
fn raw_shm_client(path: &Path) -> (UnixStream, Vec<OwnedFd>) {
    raw_client_asking(path, false)
}

/// [`raw_shm_client`], asking for requests through the rings too if
/// `requests` (and checking the server grants exactly that).
pub(super) fn raw_client_asking(path: &Path, requests: bool) -> (UnixStream, Vec<OwnedFd>) {
    let s = UnixStream::connect(path).unwrap();
    let hello = Message::Hello {
        protocol: 1,
        pid: std::process::id(),
        shm_notices: true,
        shm_requests: requests,
    };
    send_message(&s, &hello, &[], None).unwrap();
    let (m, fds) = recv_message(&s, Some(Instant::now() + Duration::from_secs(5))).unwrap();
    assert!(
        matches!(
            m,
            Message::Welcome { shm_notices: Some(n), shm_requests, .. }
                if n as usize == NOTICE_RING_BYTES && shm_requests == requests
        ),
        "{m:?}"
    );
    assert_eq!(fds.len(), 2);
    (s, fds)
}

/// Waits until the server closes `s` (an error message first is fine).
fn closed_by_server(s: &UnixStream) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match recv_message(s, Some(deadline)) {
            // An error message first, or a notice sent before the cut.
            Ok(_) => {}
            Err(ChannelError::Timeout { .. }) => return false,
            Err(_) => return true,
        }
    }
}

fn wake_server(fds: &[OwnedFd]) {
    rustix::net::send(&fds[1], &[1], rustix::net::SendFlags::DONTWAIT).unwrap();
}

/// A good client that holds a lease on "e" and checks it still gets updates.
struct Bystander(Client);

impl Bystander {
    fn new(path: &Path) -> Bystander {
        let c = client_with(path, NoticePath::Shm);
        c.attach("e").unwrap();
        Bystander(c)
    }

    fn still_fine(&self, server: &Server) {
        let v = server.update("e", json!("still there?")).unwrap();
        loop {
            if next_version(&self.0) == v {
                break;
            }
        }
        self.0.ping().unwrap();
    }
}

#[test]
fn a_client_that_scribbles_over_its_rings_is_cut_off_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "scribbler");
    let server = server_with(&path, NoticePath::Shm);
    server.publish("e", json!({}), vec![]).unwrap();
    let good = Bystander::new(&path);

    // An impossible head on the ack ring.
    let (s, fds) = raw_shm_client(&path);
    rustix::io::pwrite(&fds[0], &u64::MAX.to_le_bytes(), ACK_RING + HEAD).unwrap();
    wake_server(&fds);
    assert!(closed_by_server(&s));
    good.still_fine(&server);

    // Well-framed records that are not acks: garbage, then a ping.
    for record in [b"garbage!".to_vec(), {
        let mut r = 0u64.to_le_bytes().to_vec();
        r.extend(encode(&Message::Ping { id: 1 }, 0));
        r
    }] {
        let (s, fds) = raw_shm_client(&path);
        let area = Area::open(&fds[0], NOTICE_RING_BYTES).unwrap();
        let (mut tx, _rx) = area
            .split(ShmSide::Opener, fds[1].try_clone().unwrap())
            .unwrap();
        assert!(tx.send(&record).unwrap());
        wake_server(&fds);
        assert!(closed_by_server(&s));
        good.still_fine(&server);
    }

    // An impossible tail on the notice ring: found at the next update.
    let (s, fds) = raw_shm_client(&path);
    let attach = Message::Attach {
        id: 1,
        name: "e".into(),
    };
    send_message(&s, &attach, &[], None).unwrap();
    let (m, _) = recv_message(&s, Some(Instant::now() + Duration::from_secs(5))).unwrap();
    assert!(matches!(m, Message::Attached { .. }), "{m:?}");
    rustix::io::pwrite(&fds[0], &12_345u64.to_le_bytes(), TAIL).unwrap();
    server.update("e", json!("to the scribbler")).unwrap();
    assert!(closed_by_server(&s));
    good.still_fine(&server);
    // The scribbler's lease ends with its connection.
    let deadline = Instant::now() + Duration::from_secs(5);
    while server.leases().len() > 1 {
        assert!(Instant::now() < deadline, "{:?}", server.leases());
        std::thread::sleep(Duration::from_millis(5));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Random bytes anywhere in a client's rings never hurt the server:
    /// it goes on serving others (it may or may not cut the scribbler off,
    /// depending on what the bytes hit).
    #[test]
    fn random_scribbles_never_hurt_the_server(
        writes in prop::collection::vec(
            (0u64..2 * (256 + NOTICE_RING_BYTES as u64), prop::collection::vec(any::<u8>(), 1..32)),
            1..12,
        ),
        requests: bool,
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp_socket(&tmp, "random-scribbles");
        let server = server_with(&path, NoticePath::Shm);
        server.publish("e", json!({}), vec![]).unwrap();
        let good = Bystander::new(&path);
        let (s, fds) = raw_client_asking(&path, requests);
        send_message(&s, &Message::Attach { id: 1, name: "e".into() }, &[], None).unwrap();
        let len = 2 * (256 + NOTICE_RING_BYTES as u64);
        for (at, bytes) in writes {
            let n = bytes.len().min((len - at) as usize);
            rustix::io::pwrite(&fds[0], &bytes[..n], at).unwrap();
        }
        wake_server(&fds);
        server.update("e", json!("after the scribbles")).unwrap();
        good.still_fine(&server);
        drop(s);
    }
}

/// A client sleeping on its notice ring wakes at once when the server
/// process dies (it polls the socket with its wake-up end).
#[test]
fn a_killed_server_wakes_a_client_sleeping_on_the_ring() {
    if run_child_role() {
        return;
    }
    let _serial = spawn_lock();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "killed-shm-producer");
    let mut cmd = test_command(
        &std::env::current_exe().unwrap(),
        "shm_notices::a_killed_server_wakes_a_client_sleeping_on_the_ring",
    );
    cmd.env(CHILD_ENV, "producer")
        .env(PATH_ENV, &path)
        .env(NAME_ENV, "p");
    let mut child = ChildProc::start(cmd).unwrap();
    child.line("CHILD-READY", Duration::from_secs(20));
    let client = Arc::new(client_with(&path, NoticePath::Shm));
    assert_eq!(client.notice_stats().path, NoticePath::Shm);
    client.attach("p").unwrap();
    let waiter = {
        let client = Arc::clone(&client);
        std::thread::spawn(move || client.next_update(Duration::from_secs(20)))
    };
    // Long past the spin: the waiter sleeps in poll.
    std::thread::sleep(Duration::from_millis(100));
    let killed = Instant::now();
    child.kill();
    let r = waiter.join().unwrap();
    assert!(matches!(r, Err(ChannelError::PeerGone)), "{r:?}");
    assert!(
        killed.elapsed() < Duration::from_secs(1),
        "{:?}",
        killed.elapsed()
    );
}

/// A killed client is noticed by the server at once: its lease ends.
#[test]
fn a_killed_shm_client_ends_its_lease_at_once() {
    if run_child_role() {
        return;
    }
    let _serial = spawn_lock();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "killed-shm-consumer");
    let server = server_with(&path, NoticePath::Shm);
    let bytes = pattern(4096, 3);
    server
        .publish(
            "h",
            json!({"len": 4096, "seed": 3}),
            vec![memfd_with(&bytes)],
        )
        .unwrap();
    let mut cmd = test_command(
        &std::env::current_exe().unwrap(),
        "shm_notices::a_killed_shm_client_ends_its_lease_at_once",
    );
    cmd.env(CHILD_ENV, "hold")
        .env(PATH_ENV, &path)
        .env(NAME_ENV, "h");
    let mut child = ChildProc::start(cmd).unwrap();
    child.line("CHILD-READY", Duration::from_secs(20));
    assert_eq!(server.leases().len(), 1);
    let killed = Instant::now();
    child.kill();
    server
        .wait_released("h", Some(Duration::from_secs(5)))
        .unwrap();
    assert!(
        killed.elapsed() < Duration::from_secs(1),
        "{:?}",
        killed.elapsed()
    );
}

/// A server built before shared-memory notices refuses a hello with the
/// new field (its decoding is strict); the client connects again without
/// it and gets its notices on the socket.
#[test]
fn a_server_that_predates_shm_notices_gets_a_plain_hello() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "old-server");
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let old_server = std::thread::spawn(move || {
        let mut hellos = Vec::new();
        for _ in 0..2 {
            let (s, _) = listener.accept().unwrap();
            let (hello, _) =
                recv_message(&s, Some(Instant::now() + Duration::from_secs(5))).unwrap();
            let Message::Hello { shm_notices, .. } = hello else {
                panic!("{hello:?}");
            };
            hellos.push(shm_notices);
            let answer = if shm_notices {
                // What a server of protocol 1 without the field answers.
                Message::Error {
                    id: None,
                    code: "malformed_frame".into(),
                    message: "malformed message on the wire: malformed \"hello\" message: \
                              unknown field `shm_notices`, expected `protocol` or `pid`"
                        .into(),
                    details: Value::Null,
                }
            } else {
                Message::Welcome {
                    protocol: 1,
                    pid: std::process::id(),
                    shm_notices: None,
                    shm_requests: false,
                    restarts: false,
                }
            };
            send_message(&s, &answer, &[], None).unwrap();
            if !shm_notices {
                return (hellos, s);
            }
        }
        panic!("the client did not come back without the field");
    });
    let client = client_with(&path, NoticePath::Shm);
    let (hellos, _s) = old_server.join().unwrap();
    assert_eq!(hellos, [true, false]);
    assert_eq!(client.notice_stats().path, NoticePath::Socket);
}
