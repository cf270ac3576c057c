//! Processes: killed consumers and producers, many consumers at once.

use super::*;

#[test]
fn killed_consumer_releases_its_leases() {
    if run_child_role() {
        return;
    }
    let _serial = spawn_lock();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "killed-consumer");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    let bytes = pattern(4096, 5);
    server
        .publish(
            "buf",
            json!({"len": 4096, "seed": 5}),
            vec![memfd_with(&bytes)],
        )
        .unwrap();

    let mut child = spawn_child(
        "processes::killed_consumer_releases_its_leases",
        "hold",
        &path,
        "buf",
    );
    child.line("CHILD-READY", Duration::from_secs(20));
    let leases = server.leases();
    assert_eq!(leases.len(), 1);
    assert_eq!(leases[0].pid, child.pid());

    let killed = Instant::now();
    child.kill();
    server
        .wait_released("buf", Some(Duration::from_secs(1)))
        .unwrap();
    let took = killed.elapsed();
    assert!(took < Duration::from_secs(1), "took {took:?}");
    assert!(server.leases().is_empty());
}

#[test]
fn killed_ring_subscriber_frees_its_slots() {
    if run_child_role() {
        return;
    }
    let _serial = spawn_lock();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "killed-sub");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    let ring = server.create_ring("r", json!(null), ring_slots(2)).unwrap();
    let mut child = spawn_child(
        "processes::killed_ring_subscriber_frees_its_slots",
        "ring-hold",
        &path,
        "r",
    );
    child.line("CHILD-READY", Duration::from_secs(20));
    assert_eq!(ring.subscribers().len(), 1);
    for i in 0..2 {
        let slot = ring.acquire(Some(Duration::from_secs(1))).unwrap();
        ring.publish(slot, json!(i)).unwrap();
    }
    assert!(matches!(
        ring.acquire(Some(Duration::from_millis(100))),
        Err(ChannelError::Timeout { .. })
    ));
    let killed = Instant::now();
    child.kill();
    assert_eq!(ring.acquire(Some(Duration::from_secs(1))).unwrap(), 0);
    assert!(killed.elapsed() < Duration::from_secs(1));
    assert!(ring.subscribers().is_empty());
}

#[test]
fn killed_producer_is_noticed_at_once() {
    if run_child_role() {
        return;
    }
    let _serial = spawn_lock();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "killed-producer");
    let mut child = spawn_child(
        "processes::killed_producer_is_noticed_at_once",
        "producer",
        &path,
        "p",
    );
    child.line("CHILD-READY", Duration::from_secs(20));

    let client = Arc::new(quick_client(&path));
    assert_eq!(client.server_pid(), child.pid());
    let a = client.attach("p").unwrap();
    assert_eq!(read_fd(&a.fds[0], 8192), pattern(8192, 9));
    assert!(client.is_alive());

    // A thread already waiting for an update must be woken too.
    let waiter = {
        let client = Arc::clone(&client);
        std::thread::spawn(move || {
            let started = Instant::now();
            let r = client.next_update(Duration::from_secs(20));
            (r, started)
        })
    };
    std::thread::sleep(Duration::from_millis(50));
    let killed = Instant::now();
    child.kill();
    while client.is_alive() {
        assert!(
            killed.elapsed() < Duration::from_secs(1),
            "is_alive still true after 1 s"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let (r, _) = waiter.join().unwrap();
    assert!(matches!(r, Err(ChannelError::PeerGone)), "{r:?}");
    assert!(matches!(client.ping(), Err(ChannelError::PeerGone)));
    assert!(matches!(client.attach("p"), Err(ChannelError::PeerGone)));
    assert!(matches!(client.list(), Err(ChannelError::PeerGone)));
    assert!(matches!(
        client.next_update(Duration::from_secs(10)),
        Err(ChannelError::PeerGone)
    ));
    assert!(killed.elapsed() < Duration::from_secs(1));
    // The memory the producer shared outlives it in the consumer.
    assert_eq!(read_fd(&a.fds[0], 8192), pattern(8192, 9));
}

#[test]
fn fifty_consumers_at_once() {
    if run_child_role() {
        return;
    }
    let _serial = spawn_lock();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "fifty");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    let len = 1 << 16;
    let bytes = pattern(len, 77);
    server
        .publish(
            "shared",
            json!({"len": len, "seed": 77}),
            vec![memfd_with(&bytes)],
        )
        .unwrap();

    let mut children: Vec<ChildProc> = (0..FIFTY_PROCESSES)
        .map(|_| {
            spawn_child(
                "processes::fifty_consumers_at_once",
                "verify",
                &path,
                "shared",
            )
        })
        .collect();
    let attached = Arc::new(Barrier::new(FIFTY_THREADS + 1));
    let release = Arc::new(Barrier::new(FIFTY_THREADS + 1));
    let threads: Vec<_> = (0..FIFTY_THREADS)
        .map(|_| {
            let (path, bytes) = (path.clone(), bytes.clone());
            let (attached, release) = (Arc::clone(&attached), Arc::clone(&release));
            std::thread::spawn(move || {
                let client = quick_client(&path);
                let a = client.attach("shared").unwrap();
                assert_eq!(read_fd(&a.fds[0], bytes.len()), bytes);
                attached.wait();
                release.wait();
                client.release(a.lease).unwrap();
            })
        })
        .collect();
    attached.wait();
    for c in &mut children {
        c.line("CHILD-READY", Duration::from_secs(30));
    }
    // All fifty hold a lease at the same time.
    assert_eq!(
        server.lease_count("shared"),
        FIFTY_PROCESSES + FIFTY_THREADS
    );
    let pids: std::collections::HashSet<u32> = server.leases().iter().map(|l| l.pid).collect();
    assert_eq!(pids.len(), FIFTY_PROCESSES + 1);

    release.wait();
    for c in &mut children {
        c.close_stdin();
    }
    for t in threads {
        t.join().unwrap();
    }
    for c in &mut children {
        c.wait_success(Duration::from_secs(20));
    }
    server
        .wait_released("shared", Some(Duration::from_secs(5)))
        .unwrap();
}
