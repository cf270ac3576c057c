//! Rings: back-pressure, acknowledgements, order under load.

use super::*;

#[test]
fn ring_back_pressure_and_acks() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "ring");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    let ring = Arc::new(
        server
            .create_ring("frames", json!({"w": 64}), ring_slots(3))
            .unwrap(),
    );
    assert_eq!(ring.slot_count(), 3);
    assert_eq!(ring.name(), "frames");

    let c1 = quick_client(&path);
    let c2 = quick_client(&path);
    let s1 = c1.attach_ring("frames").unwrap();
    let s2 = c2.attach_ring("frames").unwrap();
    assert_eq!(s1.meta, json!({"w": 64}));
    assert_eq!(s1.slots.len(), 3);
    for (i, (meta, fds)) in s1.slots.iter().enumerate() {
        assert_eq!(meta, &json!({"slot": i}));
        assert_eq!(read_fd(&fds[0], 16), vec![i as u8; 16]);
    }
    assert_eq!(ring.subscribers().len(), 2);

    // Fill every slot.
    for i in 0..3 {
        assert_eq!(ring.acquire(Some(Duration::from_secs(1))).unwrap(), i);
        assert_eq!(ring.publish(i, json!({"i": i})).unwrap(), u64::from(i) + 1);
    }
    let e = ring.acquire(Some(Duration::from_millis(100))).unwrap_err();
    assert!(matches!(e, ChannelError::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("slot 0"), "{e}");

    // A producer thread blocks until both subscribers ack slot 0.
    let blocked = {
        let ring = Arc::clone(&ring);
        std::thread::spawn(move || ring.acquire(Some(Duration::from_secs(10))))
    };
    for (c, s) in [(&c1, &s1), (&c2, &s2)] {
        let f = c.next_frame(s.lease, Duration::from_secs(5)).unwrap();
        assert_eq!((f.lease, f.slot, f.seq), (s.lease, 0, 1));
        assert_eq!(f.notice, json!({"i": 0}));
    }
    c1.ack(s1.lease, 0, 1).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        !blocked.is_finished(),
        "one ack of two must not free the slot"
    );
    let acked = Instant::now();
    c2.ack(s2.lease, 0, 1).unwrap();
    assert_eq!(blocked.join().unwrap().unwrap(), 0);
    assert!(acked.elapsed() < Duration::from_secs(1));

    // Stale and duplicate acks are ignored; bad ones are refused locally.
    c1.ack(s1.lease, 0, 1).unwrap();
    c1.ack(s1.lease, 1, 99).unwrap();
    assert!(matches!(
        c1.ack(s1.lease, 3, 1),
        Err(ChannelError::InvalidArgument { .. })
    ));
    assert!(matches!(
        c1.ack(12345, 0, 1),
        Err(ChannelError::InvalidArgument { .. })
    ));
    assert!(matches!(
        c1.next_frame(12345, Duration::from_millis(1)),
        Err(ChannelError::InvalidArgument { .. })
    ));
    // Publishing a slot that was not acquired is refused.
    assert!(matches!(
        ring.publish(1, json!(null)),
        Err(ChannelError::InvalidArgument { .. })
    ));
    ring.cancel(0).unwrap();
    assert!(ring.cancel(0).is_err());

    // A subscriber that releases its lease frees its pending slots.
    c1.release(s1.lease).unwrap();
    for (slot, seq) in [(1, 2), (2, 3)] {
        let f = c2.next_frame(s2.lease, Duration::from_secs(5)).unwrap();
        assert_eq!((f.slot, f.seq), (slot, seq));
        c2.ack(s2.lease, f.slot, f.seq).unwrap();
    }
    assert_eq!(ring.acquire(Some(Duration::from_secs(1))).unwrap(), 1);
    assert_eq!(ring.acquire(Some(Duration::from_secs(1))).unwrap(), 2);
    assert_eq!(ring.subscribers().len(), 1);

    // Dropping the producer unpublishes the ring: after the frames already
    // sent, the subscriber learns it.
    ring.publish(1, json!("last")).unwrap();
    drop(ring);
    let f = c2.next_frame(s2.lease, Duration::from_secs(5)).unwrap();
    assert_eq!(f.notice, json!("last"));
    let e = c2.next_frame(s2.lease, Duration::from_secs(5)).unwrap_err();
    assert!(
        matches!(&e, ChannelError::Unpublished { name, lease } if name == "frames" && *lease == s2.lease),
        "{e}"
    );
    assert_eq!(server.lease_count("frames"), 1);
    c2.release(s2.lease).unwrap();
    assert_eq!(server.lease_count("frames"), 0);
    assert!(c2.list().unwrap().is_empty());
}

#[test]
fn ring_frames_arrive_in_order_under_load() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "ringload");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    let ring = server.create_ring("r", json!(null), ring_slots(3)).unwrap();
    let client = quick_client(&path);
    let sub = client.attach_ring("r").unwrap();
    let consumer = std::thread::spawn(move || {
        for seq in 1..=RING_FRAMES {
            let f = client
                .next_frame(sub.lease, Duration::from_secs(10))
                .unwrap();
            assert_eq!(f.seq, seq);
            assert_eq!(u64::from(f.slot), (seq - 1) % 3);
            assert_eq!(f.notice, json!(seq));
            client.ack(sub.lease, f.slot, f.seq).unwrap();
        }
    });
    for seq in 1..=RING_FRAMES {
        let slot = ring.acquire(Some(Duration::from_secs(10))).unwrap();
        assert_eq!(ring.publish(slot, json!(seq)).unwrap(), seq);
    }
    consumer.join().unwrap();
}

#[test]
fn ring_without_subscribers_never_blocks() {
    let tmp = tempfile::tempdir().unwrap();
    let server = Server::bind(ServerConfig::new(tmp_socket(&tmp, "lonely"))).unwrap();
    let ring = server.create_ring("r", json!(null), ring_slots(2)).unwrap();
    for i in 0..10 {
        let slot = ring.acquire(Some(Duration::ZERO)).unwrap();
        assert_eq!(slot, i % 2);
        ring.publish(slot, json!(i)).unwrap();
    }
    assert!(matches!(
        server.create_ring("empty", json!(null), vec![]),
        Err(ChannelError::InvalidArgument { .. })
    ));
    server.unpublish("r").unwrap();
    assert!(matches!(
        ring.acquire(Some(Duration::ZERO)),
        Err(ChannelError::NotFound { .. })
    ));
}

/// A subscription's `ring_attached` answer comes before its slot messages
/// even when it has to queue behind earlier answers: a client that sends
/// many requests before reading leaves the server's writer with a queue,
/// and the slot messages (made by the writer) must not jump ahead of the
/// answer that announces them.
#[test]
fn ring_attached_comes_before_its_slots_behind_a_queue() {
    const LISTS: u64 = 24;
    const ROUNDS: u64 = 10;
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "order");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    let _ring = server
        .create_ring("frames", json!(null), ring_slots(4))
        .unwrap();
    // Entries whose listing is about 40 KB a page.
    let filler = "x".repeat(300);
    for i in 0..120 {
        server
            .publish(
                &format!("entry-{i:03}"),
                json!({ "filler": filler }),
                Vec::new(),
            )
            .unwrap();
    }
    let s = raw_connect(&path, true);
    let deadline = || Some(Instant::now() + Duration::from_secs(10));
    for round in 0..ROUNDS {
        // Every request first, then every answer.
        let base = round * 100;
        for id in base..base + LISTS {
            send_message(&s, &Message::List { id, after: None }, &[], deadline()).unwrap();
        }
        let ring_id = base + LISTS;
        let ring = Message::AttachRing {
            id: ring_id,
            name: "frames".into(),
        };
        send_message(&s, &ring, &[], deadline()).unwrap();
        let (mut listings, mut lease, mut slots) = (0, None, 0);
        while listings < LISTS || slots < 4 {
            match recv_message(&s, deadline()).unwrap() {
                (Message::Listing { .. }, _) => {
                    listings += 1;
                    // A slow reader: the writer is still sending when the
                    // subscription is answered.
                    std::thread::sleep(Duration::from_millis(1));
                }
                (Message::RingAttached { id, lease: l, .. }, _) => {
                    assert_eq!(id, ring_id);
                    assert_eq!(lease, None, "two ring_attached answers");
                    lease = Some(l);
                }
                (Message::RingSlot { id, slot, .. }, fds) => {
                    assert_eq!(id, ring_id);
                    assert!(
                        lease.is_some(),
                        "round {round}: slot {slot} came before its ring_attached"
                    );
                    assert_eq!(slot, slots, "slots out of order");
                    assert_eq!(fds.len(), 1);
                    slots += 1;
                }
                (other, _) => panic!("round {round}: unexpected {other:?}"),
            }
        }
        let release = Message::Release {
            id: base + 99,
            lease: lease.unwrap(),
        };
        send_message(&s, &release, &[], deadline()).unwrap();
        let (m, _) = recv_message(&s, deadline()).unwrap();
        assert!(matches!(m, Message::Released { .. }), "{m:?}");
    }
}

/// The calling thread's voluntary context switches so far (each a sleep).
fn own_sleeps() -> i64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes a whole `rusage` into the pointer we own;
    // zeroed is a valid `rusage` whatever it does.
    #[allow(unsafe_code)]
    let usage = unsafe {
        libc::getrusage(libc::RUSAGE_THREAD, usage.as_mut_ptr());
        usage.assume_init()
    };
    usage.ru_nvcsw
}

/// Takes `frames` frames of ring `name` on a new client (spin 5 ms),
/// spinning or sleeping at once between them, while this thread publishes
/// one every 50 µs; returns the reader thread's sleeps and the frames'
/// notices in order.
fn read_paced(
    path: &Path,
    ring: &cuda_ipc_channel::ServerRing,
    frames: u64,
    spinning: bool,
) -> (i64, Vec<Value>) {
    let client = Client::connect(
        path,
        ClientConfig::default().with_spin(Duration::from_millis(5)),
    )
    .unwrap();
    let sub = client.attach_ring(ring.name()).unwrap();
    let reader = std::thread::spawn(move || {
        let before = own_sleeps();
        let mut seen = Vec::new();
        for _ in 0..frames {
            let wait = Duration::from_secs(10);
            let f = if spinning {
                client.next_frame_spinning(sub.lease, wait)
            } else {
                client.next_frame(sub.lease, wait)
            }
            .unwrap();
            client.ack(sub.lease, f.slot, f.seq).unwrap();
            seen.push(f.notice);
        }
        (own_sleeps() - before, seen)
    });
    for i in 0..frames {
        let slot = ring.acquire(Some(Duration::from_secs(10))).unwrap();
        ring.publish(slot, json!({ "i": i })).unwrap();
        let t = Instant::now();
        while t.elapsed() < Duration::from_micros(50) {
            std::hint::spin_loop();
        }
    }
    reader.join().unwrap()
}

/// A reader that spins for frames (`next_frame_spinning`, for consumers
/// that wait on the producer's work from the host) takes a stream of
/// frames 50 µs apart without sleeping between them, every frame in
/// order; one that sleeps at once (`next_frame`) sleeps for most of them.
#[test]
fn a_spinning_ring_reader_takes_a_stream_without_sleeping() {
    const FRAMES: u64 = 300;
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "spin");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    let ring = server
        .create_ring("frames", json!({}), ring_slots(8))
        .unwrap();
    let expected: Vec<Value> = (0..FRAMES).map(|i| json!({ "i": i })).collect();
    let (spun, seen) = read_paced(&path, &ring, FRAMES, true);
    assert_eq!(seen, expected, "the spinning reader's frames");
    let (slept, seen) = read_paced(&path, &ring, FRAMES, false);
    assert_eq!(seen, expected, "the sleeping reader's frames");
    assert!(
        spun < FRAMES as i64 / 3 && spun < slept,
        "{FRAMES} frames: the spinning reader slept {spun} times, the one sleeping at once {slept}"
    );
}
