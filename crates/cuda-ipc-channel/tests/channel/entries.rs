//! Binding, publishing, attaching, listing, updates, unpublishing, shutdown.

use super::*;

#[test]
fn handles_can_be_shared_between_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Server>();
    send_sync::<Client>();
    send_sync::<cuda_ipc_channel::ServerRing>();
    send_sync::<ChannelError>();
}

#[test]
fn socket_file_is_0600_and_removed_on_drop() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "mode");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    let meta = std::fs::symlink_metadata(&path).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    assert_eq!(server.path(), path);
    drop(server);
    assert!(!path.exists());
}

#[test]
fn bind_refuses_a_live_server_and_replaces_a_stale_socket() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "busy");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    let e = Server::bind(ServerConfig::new(&path)).unwrap_err();
    assert!(
        matches!(&e, ChannelError::Busy { path: p } if p == &path),
        "{e}"
    );
    assert!(e.to_string().contains("another publisher is serving"));
    // The live server still works.
    quick_client(&path).ping().unwrap();
    drop(server);

    // A socket file that nobody listens on is stale and replaced.
    let stale = tmp_socket(&tmp, "stale");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    assert!(stale.exists());
    let e = Client::connect(&stale, ClientConfig::default()).unwrap_err();
    assert!(e.to_string().contains("nothing is listening"), "{e}");
    let server = Server::bind(ServerConfig::new(&stale)).unwrap();
    quick_client(&stale).ping().unwrap();
    drop(server);

    // Anything else at the path is left alone.
    let file = tmp_socket(&tmp, "file");
    std::fs::write(&file, b"precious").unwrap();
    let e = Server::bind(ServerConfig::new(&file)).unwrap_err();
    assert!(e.to_string().contains("is not a socket"), "{e}");
    assert_eq!(std::fs::read(&file).unwrap(), b"precious");

    // Paths too long for a socket address are refused clearly.
    let long = tmp.path().join("x".repeat(120));
    let e = Server::bind(ServerConfig::new(long)).unwrap_err();
    assert!(e.to_string().contains("bytes long"), "{e}");

    // So is an empty allow-list.
    let e = Server::bind(ServerConfig::new(tmp_socket(&tmp, "nobody")).with_allowed_uids([]))
        .unwrap_err();
    assert!(e.to_string().contains("allowed_uids"), "{e}");

    // A missing socket says so.
    let e = Client::connect(tmp_socket(&tmp, "missing"), ClientConfig::default()).unwrap_err();
    assert!(e.to_string().contains("does not exist"), "{e}");
}

#[test]
fn attach_passes_memfd_contents() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "memfd");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    let a = pattern(1 << 16, 3);
    let b = pattern(100, 4);
    server
        .publish(
            "tensor",
            json!({"len": a.len(), "dtype": "u8"}),
            vec![memfd_with(&a), memfd_with(&b)],
        )
        .unwrap();

    let client = quick_client(&path);
    assert_eq!(client.server_pid(), std::process::id());
    let att = client.attach("tensor").unwrap();
    assert_eq!(att.name, "tensor");
    assert_eq!(att.meta, json!({"len": 65536, "dtype": "u8"}));
    assert_eq!(att.fds.len(), 2);
    assert_eq!(read_fd(&att.fds[0], a.len()), a);
    assert_eq!(read_fd(&att.fds[1], b.len()), b);

    // The same bytes through a shared mapping.
    let len = a.len();
    // SAFETY: we map a memfd we own for reading, with the length it has,
    // read it while the mapping lives, and unmap it once.
    unsafe {
        let ptr = rustix::mm::mmap(
            std::ptr::null_mut(),
            len,
            rustix::mm::ProtFlags::READ,
            rustix::mm::MapFlags::SHARED,
            &att.fds[0],
            0,
        )
        .unwrap();
        let mapped = std::slice::from_raw_parts(ptr.cast::<u8>(), len);
        assert_eq!(mapped, &a[..]);
        rustix::mm::munmap(ptr, len).unwrap();
    }

    // Writes by the consumer are seen by the producer's memfd (shared file).
    rustix::io::pwrite(&att.fds[1], b"ZZ", 0).unwrap();
    let again = client.attach("tensor").unwrap();
    assert_eq!(&read_fd(&again.fds[1], 2), b"ZZ");

    let leases = server.leases();
    assert_eq!(leases.len(), 2);
    assert!(
        leases.iter().all(|l| l.name == "tensor"
            && l.kind == EntryKind::Entry
            && l.pid == std::process::id())
    );
    assert_eq!(server.lease_count("tensor"), 2);
    client.release(att.lease).unwrap();
    client.release(again.lease).unwrap();
    assert_eq!(server.lease_count("tensor"), 0);

    // A lease can be released once, by its holder.
    let e = client.release(att.lease).unwrap_err();
    assert!(matches!(e, ChannelError::InvalidArgument { .. }), "{e}");
}

#[test]
fn listing_attach_errors_and_names() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "list");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    let client = quick_client(&path);
    assert!(client.list().unwrap().is_empty());

    server.publish("b", json!({"n": 2}), vec![]).unwrap();
    server.publish("a", json!({"n": 1}), vec![]).unwrap();
    let _ring = server
        .create_ring("r", json!("ring"), vec![(json!(0), vec![])])
        .unwrap();
    let listed = client.list().unwrap();
    let names: Vec<_> = listed.iter().map(|e| (e.name.as_str(), e.kind)).collect();
    assert_eq!(
        names,
        [
            ("a", EntryKind::Entry),
            ("b", EntryKind::Entry),
            ("r", EntryKind::Ring)
        ]
    );
    assert_eq!(listed[0].meta, json!({"n": 1}));

    let e = server.publish("a", json!(null), vec![]).unwrap_err();
    assert!(matches!(e, ChannelError::AlreadyExists { .. }), "{e}");
    let e = client.attach("nope").unwrap_err();
    assert!(
        matches!(&e, ChannelError::NotFound { name } if name == "nope"),
        "{e}"
    );
    let e = client.attach("r").unwrap_err();
    assert!(
        matches!(&e, ChannelError::Remote { code, .. } if code == "wrong_kind"),
        "{e}"
    );
    let e = client.attach_ring("a").unwrap_err();
    assert!(
        matches!(&e, ChannelError::Remote { code, .. } if code == "wrong_kind"),
        "{e}"
    );
    assert!(matches!(
        server.publish("", json!(null), vec![]),
        Err(ChannelError::InvalidName { .. })
    ));
    assert!(matches!(
        server.publish("a\nb", json!(null), vec![]),
        Err(ChannelError::InvalidName { .. })
    ));
    let too_many: Vec<OwnedFd> = (0..17).map(|_| memfd_with(b"")).collect();
    assert!(matches!(
        server.publish("many", json!(null), too_many),
        Err(ChannelError::InvalidArgument { .. })
    ));
    let huge = json!("x".repeat(300 * 1024));
    assert!(matches!(
        server.publish("huge", huge.clone(), vec![]),
        Err(ChannelError::InvalidArgument { .. })
    ));
    assert!(matches!(
        server.update("a", huge),
        Err(ChannelError::InvalidArgument { .. })
    ));
    // The client checks names before asking.
    assert!(matches!(
        client.attach(""),
        Err(ChannelError::InvalidName { .. })
    ));
    // The connection survived every error above.
    client.ping().unwrap();
}

#[test]
fn long_listings_come_in_pages() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "pages");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    // 40 entries of ~64 KiB of metadata each: more than one frame holds.
    let blob = "m".repeat(64 * 1024);
    for i in 0..40 {
        server
            .publish(&format!("e{i:02}"), json!({"i": i, "blob": blob}), vec![])
            .unwrap();
    }
    let listed = quick_client(&path).list().unwrap();
    assert_eq!(listed.len(), 40);
    for (i, e) in listed.iter().enumerate() {
        assert_eq!(e.name, format!("e{i:02}"));
        assert_eq!(e.meta["i"], json!(i));
    }
}

#[test]
fn unpublish_and_wait_released() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "unpub");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    server
        .publish("x", json!({"len": 4}), vec![memfd_with(b"abcd")])
        .unwrap();
    // Nothing to wait for yet.
    server.wait_released("x", None).unwrap();
    server
        .wait_released("never-published", Some(Duration::ZERO))
        .unwrap();

    let client = quick_client(&path);
    let a = client.attach("x").unwrap();
    let e = server
        .wait_released("x", Some(Duration::from_millis(100)))
        .unwrap_err();
    assert!(matches!(e, ChannelError::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("1 lease"), "{e}");

    server.unpublish("x").unwrap();
    assert!(matches!(
        server.unpublish("x"),
        Err(ChannelError::NotFound { .. })
    ));
    // No new attaches; the name is free for a new entry at once.
    assert!(matches!(
        client.attach("x"),
        Err(ChannelError::NotFound { .. })
    ));
    assert!(client.list().unwrap().is_empty());
    server
        .publish("x", json!({"len": 4}), vec![memfd_with(b"efgh")])
        .unwrap();
    let b = client.attach("x").unwrap();
    assert_eq!(read_fd(&b.fds[0], 4), b"efgh");
    // The holder of the old entry is told, and its memory is intact.
    let u = client.next_update(Duration::from_secs(5)).unwrap();
    assert_eq!(u.lease, a.lease);
    assert_eq!(u.name, "x");
    assert_eq!(u.notice, Notice::Unpublished);
    assert_eq!(read_fd(&a.fds[0], 4), b"abcd");
    assert_eq!(server.lease_count("x"), 2);

    // Releasing from another thread wakes a waiter without a timeout.
    let server = Arc::new(server);
    let waiter = {
        let server = Arc::clone(&server);
        std::thread::spawn(move || {
            let started = Instant::now();
            server.wait_released("x", None).unwrap();
            started.elapsed()
        })
    };
    std::thread::sleep(Duration::from_millis(50));
    client.release(a.lease).unwrap();
    assert_eq!(server.lease_count("x"), 1);
    client.release(b.lease).unwrap();
    let blocked_for = waiter.join().unwrap();
    assert!(blocked_for < Duration::from_secs(5));
    server
        .wait_released("x", Some(Duration::from_millis(10)))
        .unwrap();
}

/// Frames larger than the socket's buffer: the server starts them from the
/// calling thread and its writer thread finishes them. They must arrive
/// whole, with their descriptors, and in order with the frames after them.
#[test]
fn frames_larger_than_the_socket_buffer_arrive_whole_and_in_order() {
    // Just under the 256 KiB limit of meta and update data; a Unix
    // socket's buffer holds about 200 KiB by default.
    const BLOB: usize = 250 * 1024;
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "large");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    let blob = |c: char| c.to_string().repeat(BLOB);
    let a = pattern(4096, 7);
    let b = pattern(8192, 9);
    server
        .publish(
            "big",
            json!({ "blob": blob('m') }),
            vec![memfd_with(&a), memfd_with(&b)],
        )
        .unwrap();

    // A client that has read nothing yet gets a 250 KiB answer.
    let client = quick_client(&path);
    let att = client.attach("big").unwrap();
    assert_eq!(att.meta["blob"].as_str().map(str::len), Some(BLOB));
    assert_eq!(att.meta, json!({ "blob": blob('m') }));
    assert_eq!(att.fds.len(), 2);
    assert_eq!(read_fd(&att.fds[0], a.len()), a);
    assert_eq!(read_fd(&att.fds[1], b.len()), b);

    // Large notices while the client does not read: the first one fills
    // the socket part-way, the rest queue behind it.
    let letters: Vec<char> = ('a'..='p').collect();
    for (i, c) in letters.iter().enumerate() {
        assert_eq!(server.update("big", json!(blob(*c))).unwrap(), i as u64 + 1);
    }
    std::thread::sleep(Duration::from_millis(50));
    for (i, c) in letters.iter().enumerate() {
        let u = client.next_update(Duration::from_secs(10)).unwrap();
        assert_eq!(u.lease, att.lease);
        assert_eq!(
            u.notice,
            Notice::Updated {
                version: i as u64 + 1,
                data: json!(blob(*c))
            },
            "update {i}"
        );
    }
    // The connection is still in step.
    client.ping().unwrap();
    client.release(att.lease).unwrap();
    assert_eq!(server.lease_count("big"), 0);
}

#[test]
fn updates_reach_every_holder_in_order() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "updates");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    server.publish("frame", json!(null), vec![]).unwrap();
    server.publish("other", json!(null), vec![]).unwrap();
    // No holders yet: the version still counts.
    assert_eq!(server.update("frame", json!("early")).unwrap(), 1);

    let clients: Vec<Client> = (0..3).map(|_| quick_client(&path)).collect();
    let leases: Vec<u64> = clients
        .iter()
        .map(|c| c.attach("frame").unwrap().lease)
        .collect();
    let other = clients[0].attach("other").unwrap();
    for i in 0..100u64 {
        assert_eq!(server.update("frame", json!({"i": i})).unwrap(), i + 2);
    }
    server.update("other", json!("o")).unwrap();
    assert!(matches!(
        server.update("missing", json!(1)),
        Err(ChannelError::NotFound { .. })
    ));

    // Pushed frames that arrive while a request waits are kept.
    clients[0].ping().unwrap();
    for (c, lease) in clients.iter().zip(&leases) {
        for i in 0..100u64 {
            let u = c.next_update(Duration::from_secs(5)).unwrap();
            assert_eq!(u.lease, *lease);
            assert_eq!(u.name, "frame");
            assert_eq!(
                u.notice,
                Notice::Updated {
                    version: i + 2,
                    data: json!({"i": i})
                }
            );
        }
    }
    let u = clients[0].next_update(Duration::from_secs(5)).unwrap();
    assert_eq!(u.lease, other.lease);

    // A zero timeout polls: it takes what has arrived, and does not wait.
    for i in 0..3 {
        server.update("frame", json!(i)).unwrap();
    }
    clients[2].ping().unwrap(); // the updates are now in the socket or queue
    std::thread::sleep(Duration::from_millis(20));
    for _ in 0..3 {
        clients[1].next_update(Duration::ZERO).unwrap();
    }
    let polled = Instant::now();
    assert!(matches!(
        clients[1].next_update(Duration::ZERO),
        Err(ChannelError::Timeout { .. })
    ));
    assert!(polled.elapsed() < Duration::from_millis(100));
    let e = clients[1]
        .next_update(Duration::from_millis(20))
        .unwrap_err();
    assert!(matches!(e, ChannelError::Timeout { .. }), "{e}");
}

#[test]
fn one_client_serves_several_threads() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "threads");
    let server = Arc::new(Server::bind(ServerConfig::new(&path)).unwrap());
    server.publish("e", json!(null), vec![]).unwrap();
    server
        .publish("w", json!(null), vec![memfd_with(b"1234")])
        .unwrap();
    let client = Arc::new(quick_client(&path));
    let lease = client.attach("e").unwrap().lease;

    // One thread waits for updates while others make requests.
    let waiter = {
        let client = Arc::clone(&client);
        std::thread::spawn(move || {
            (0..20)
                .map(|_| client.next_update(Duration::from_secs(10)).unwrap())
                .collect::<Vec<_>>()
        })
    };
    let workers: Vec<_> = (0..4)
        .map(|_| {
            let client = Arc::clone(&client);
            std::thread::spawn(move || {
                for _ in 0..25 {
                    client.ping().unwrap();
                    let a = client.attach("w").unwrap();
                    assert_eq!(read_fd(&a.fds[0], 4), b"1234");
                    client.release(a.lease).unwrap();
                }
            })
        })
        .collect();
    for i in 0..20 {
        server.update("e", json!(i)).unwrap();
        std::thread::sleep(Duration::from_millis(2));
    }
    for w in workers {
        w.join().unwrap();
    }
    let updates = waiter.join().unwrap();
    for (i, u) in updates.iter().enumerate() {
        assert_eq!(u.lease, lease);
        assert_eq!(
            u.notice,
            Notice::Updated {
                version: i as u64 + 1,
                data: json!(i)
            }
        );
    }
    assert_eq!(server.lease_count("e"), 1);
    assert_eq!(server.lease_count("w"), 0);
}

#[test]
fn shutdown_disconnects_clients_and_wakes_waiters() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "shutdown");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    server
        .publish("e", json!(null), vec![memfd_with(b"data")])
        .unwrap();
    let ring = Arc::new(server.create_ring("r", json!(null), ring_slots(1)).unwrap());
    let client = quick_client(&path);
    let a = client.attach("e").unwrap();
    let sub = client.attach_ring("r").unwrap();
    let slot = ring.acquire(Some(Duration::from_secs(1))).unwrap();
    ring.publish(slot, json!(1)).unwrap();
    let blocked = {
        let ring = Arc::clone(&ring);
        std::thread::spawn(move || ring.acquire(Some(Duration::from_secs(20))))
    };
    std::thread::sleep(Duration::from_millis(50));

    let started = Instant::now();
    server.shutdown();
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(!path.exists());
    let r = blocked.join().unwrap();
    assert!(matches!(r, Err(ChannelError::ShutDown)), "{r:?}");
    assert!(started.elapsed() < Duration::from_secs(2));
    // The client gets the frame already sent, then learns the server is gone.
    assert_eq!(
        client
            .next_frame(sub.lease, Duration::from_secs(5))
            .unwrap()
            .seq,
        1
    );
    assert!(matches!(
        client.next_frame(sub.lease, Duration::from_secs(5)),
        Err(ChannelError::PeerGone)
    ));
    assert!(!client.is_alive());
    assert!(matches!(client.ping(), Err(ChannelError::PeerGone)));
    // Its descriptors remain valid.
    assert_eq!(read_fd(&a.fds[0], 4), b"data");
    assert!(matches!(
        server.publish("f", json!(null), vec![]),
        Err(ChannelError::ShutDown)
    ));
    assert!(matches!(
        server.update("e", json!(null)),
        Err(ChannelError::ShutDown)
    ));
    assert!(matches!(server.unpublish("e"), Err(ChannelError::ShutDown)));
    assert!(server.leases().is_empty());
    server.wait_released("e", None).unwrap();
    server.shutdown();
    drop(server);
}

/// "Wait for ever" written as `Duration::MAX` is a wait, not an overflow
/// panic: in the client's config, its waits, and the server's.
#[test]
fn the_longest_timeouts_wait_instead_of_panicking() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "forever");
    let server = Server::bind(
        ServerConfig::new(&path)
            .with_send_timeout(Duration::MAX)
            .with_idle_timeout(Duration::MAX),
    )
    .unwrap();
    server
        .publish("x", json!({"len": 4}), vec![memfd_with(b"abcd")])
        .unwrap();
    let client =
        Client::connect(&path, ClientConfig::default().with_timeout(Duration::MAX)).unwrap();
    let a = client.attach("x").unwrap();
    assert_eq!(read_fd(&a.fds[0], 4), b"abcd");
    server.update("x", json!({"v": 1})).unwrap();
    let u = client.next_update(Duration::MAX).unwrap();
    assert_eq!(u.lease, a.lease);
    client.release(a.lease).unwrap();
    server.wait_released("x", Some(Duration::MAX)).unwrap();
    assert_eq!(server.lease_count("x"), 0);
}

/// Metadata a producer encoded before publishing (to know its length)
/// reaches consumers as it was, and is held to the same limit as a value.
#[test]
fn metadata_encoded_before_publish_is_sent_as_it_is_and_within_the_limit() {
    use cuda_ipc_channel::wire::Meta;
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "encoded");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    let value = json!({ "table": "QUJD".repeat(1000), "n": 3, "é": ["x\"y", null] });
    let meta = Meta::encoded(value.clone());
    assert_eq!(meta.text_len(), value.to_string().len());
    server.publish("pre", meta, Vec::new()).unwrap();
    let client = quick_client(&path);
    let att = client.attach("pre").unwrap();
    assert_eq!(att.meta, value);

    let over = Meta::encoded(json!({ "blob": "m".repeat(cuda_ipc_channel::MAX_META_BYTES) }));
    let err = server.publish("over", over, Vec::new()).unwrap_err();
    assert!(err.to_string().contains("more than the limit"), "{err}");
    assert!(client.attach("over").is_err(), "nothing was published");
}

/// Waits up to 5 s for `server` to hold no lease.
fn no_lease_left(server: &Server) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !server.leases().is_empty() {
        assert!(Instant::now() < deadline, "{:?}", server.leases());
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The metadata of many entries read at once (a large record's parts):
/// in order, with more entries than attaches in flight, every lease
/// released; an entry missing in the middle is an error naming it that
/// leaves no lease held, and the client goes on working; a bad name is
/// refused before anything is sent.
#[test]
fn metadata_of_many_entries_in_one_read() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "metas");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    let n = 2 * Client::METADATA_IN_FLIGHT + 3;
    let names: Vec<String> = (0..n).map(|i| format!("part/{i}")).collect();
    for (i, name) in names.iter().enumerate() {
        let meta = json!({ "i": i, "text": "x".repeat(i * 1000) });
        server.publish(name, meta, Vec::new()).unwrap();
    }
    let client = quick_client(&path);
    let mut refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let metas = client.metadata_of(&refs).unwrap();
    assert_eq!(metas.len(), n);
    for (i, m) in metas.iter().enumerate() {
        assert_eq!(m["i"], i);
        assert_eq!(m["text"].as_str().unwrap().len(), i * 1000);
    }
    assert!(client.metadata_of(&[]).unwrap().is_empty());
    no_lease_left(&server);

    refs.insert(n / 2, "part/missing");
    let e = client.metadata_of(&refs).unwrap_err();
    assert!(
        matches!(&e, ChannelError::NotFound { name } if name == "part/missing"),
        "{e}"
    );
    no_lease_left(&server);
    assert_eq!(client.metadata_of(&refs[..2]).unwrap().len(), 2);

    let e = client.metadata_of(&["part/0", ""]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    no_lease_left(&server);
}
