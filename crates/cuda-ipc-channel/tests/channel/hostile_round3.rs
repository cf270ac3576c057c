//! Hostile peers, round 3: a client that does the worst to every object it
//! was given, another user's ring subscriber that holds the ring up, and
//! another user's flood of acks. Each reproduces an attack that froze or
//! slowed the server before, and checks the bound that holds now.
//!
//! The tests of another user need root (to run a child as uid 65534), as
//! CI runs; elsewhere they say they were skipped.

use std::os::unix::process::CommandExt;

use cuda_ipc_channel::{NOTICE_RING_BYTES, NoticePath};
use cuda_ipc_shm::{Area, Side as ShmSide};

use super::*;

const OTHER_UID: u32 = 65534;

/// Runs `f` on another thread; fails the test if it has not returned
/// within `limit` (a call that blocked would hang the test otherwise).
fn within<T: Send + 'static>(
    what: &str,
    limit: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("{what} did not return within {limit:?}: it blocked"))
}

/// The worst a client can do to what the server gave it: it clears
/// `O_NONBLOCK` on the memfd and its end of the wake-up pair (with an
/// eventfd, the flag was the server's too), shrinks that end's receive
/// buffer so that the server's wake-ups fill it, never reads it nor its
/// socket, claims to sleep on its notice ring for ever so that every
/// notice wakes it, floods the server's end with wake-ups, and asks for
/// pings through its ring (whose answers come back through the ring, with
/// a wake-up each). Before, the server's next wake-up write blocked under
/// its state lock and every client froze, `Server::shutdown` too. Now every
/// update returns, other clients are served, and the server shuts down in
/// time.
#[test]
fn a_client_that_abuses_every_descriptor_it_was_given_freezes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "freeze");
    let server = Arc::new(server_with(&path, NoticePath::Shm));
    server
        .publish("e", json!({}), vec![memfd_with(b"e")])
        .unwrap();
    let bystander = quick_client(&path);

    let (s, fds) = shm_notices::raw_client_asking(&path, true);
    for fd in &fds {
        let flags = rustix::fs::fcntl_getfl(fd).unwrap();
        rustix::fs::fcntl_setfl(fd, flags - rustix::fs::OFlags::NONBLOCK).unwrap();
    }
    rustix::net::sockopt::set_socket_recv_buffer_size(&fds[1], 1).unwrap();
    send_message(
        &s,
        &Message::Attach {
            id: 1,
            name: "e".into(),
        },
        &[],
        None,
    )
    .unwrap();
    // The notice ring is ring 0; its sleeping flag the 25th word.
    let claim_sleep = |memfd: &OwnedFd| {
        rustix::io::pwrite(memfd, &1u64.to_le_bytes(), 24 * 8).unwrap();
    };
    claim_sleep(&fds[0]);
    let area = Area::open(&fds[0], NOTICE_RING_BYTES).unwrap();
    let (mut tx, _rx) = area
        .split(ShmSide::Opener, fds[1].try_clone().unwrap())
        .unwrap();
    for id in 0..200 {
        // After the hello and the attach on the socket.
        let mut record = 2u64.to_le_bytes().to_vec();
        record.extend(encode(&Message::Ping { id: 100 + id }, 0));
        if !tx.send(&record).unwrap() {
            break;
        }
    }
    let flood_end = fds[1].try_clone().unwrap();
    let flooding = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let flooder = {
        let flooding = Arc::clone(&flooding);
        std::thread::spawn(move || {
            while flooding.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = rustix::net::send(&flood_end, &[1; 64], rustix::net::SendFlags::DONTWAIT);
                std::thread::yield_now();
            }
        })
    };

    let updater = Arc::clone(&server);
    within("5,000 updates", Duration::from_secs(30), move || {
        for i in 0..5_000 {
            claim_sleep(&fds[0]);
            updater.update("e", json!(i)).unwrap();
        }
        fds
    });
    // Others are served meanwhile: requests, a new connection, an attach.
    let c = within(
        "a bystander's requests",
        Duration::from_secs(10),
        move || {
            bystander.ping().unwrap();
            let a = bystander.attach("e").unwrap();
            bystander.release(a.lease).unwrap();
            let fresh = quick_client(&path);
            fresh.ping().unwrap();
            fresh
        },
    );
    within("Server::shutdown", Duration::from_secs(2), move || {
        server.shutdown();
    });
    flooding.store(false, std::sync::atomic::Ordering::Relaxed);
    flooder.join().unwrap();
    drop((c, s));
}

/// Connections of the other user, for the child roles below.
fn other_user_command(test: &str, tmp: &tempfile::TempDir, role: &str, path: &Path) -> ChildProc {
    // The other user must be able to run this executable and reach the socket.
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let exe = tmp.path().join(format!("{role}-child"));
    std::fs::copy(std::env::current_exe().unwrap(), &exe).unwrap();
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut cmd = test_command(&exe, test);
    cmd.env(CHILD_ENV, role)
        .env(PATH_ENV, path)
        .env(NAME_ENV, "r")
        .current_dir(tmp.path())
        .uid(OTHER_UID)
        .gid(OTHER_UID);
    ChildProc::start(cmd).unwrap()
}

/// Whether the other-user tests can run here; says why not if not.
fn can_run_another_user(test: &str) -> bool {
    if rustix::process::geteuid().is_root() {
        return true;
    }
    eprintln!("SKIPPED {test}: running a child as uid {OTHER_UID} needs root (CI runs as root)");
    false
}

/// Frames that a subscriber acking each one at once receives in `span`.
fn frames_in(path: &Path, span: Duration) -> u64 {
    let client = quick_client(path);
    let r = client.attach_ring("r").unwrap();
    let end = Instant::now() + span;
    let mut n = 0;
    while Instant::now() < end {
        match client.next_frame(r.lease, Duration::from_millis(100)) {
            Ok(f) => {
                client.ack(r.lease, f.slot, f.seq).unwrap();
                n += 1;
            }
            Err(e) if e.kind() == ErrorKind::Timeout => {}
            // Skipped for being late itself on a loaded machine: go on.
            Err(e) if e.kind() == ErrorKind::Peer => {}
            Err(e) => panic!("{e}"),
        }
    }
    n
}

/// A ring whose producer publishes a frame every millisecond, with the
/// default settings (no ack deadline, the default stall budget), served
/// to this user and uid 65534; stops with the returned flag.
fn paced_ring(
    server: &Arc<Server>,
) -> (
    Arc<std::sync::atomic::AtomicBool>,
    std::thread::JoinHandle<()>,
) {
    let ring = server
        .create_ring("r", json!(null), ring_slots(16))
        .unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = Arc::clone(&stop);
    let t = std::thread::spawn(move || {
        while !flag.load(std::sync::atomic::Ordering::Relaxed) {
            if let Ok(slot) = ring.acquire(Some(Duration::from_millis(100))) {
                let _ = ring.publish(slot, json!(null));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    });
    (stop, t)
}

/// Another user's subscriber that holds the ring up: it reads its frames
/// and acks one in 25 (each ack reset the count of skips that led to an
/// eviction), and subscribes again whenever it is dropped. Before, with
/// no ack deadline the ring stopped for every subscriber; with one, one
/// ack per stall kept it down to a few frames a second. Now its user's
/// stall budget runs out and the producer stops waiting for it: the
/// others keep most of their frames.
#[test]
fn another_users_laggard_cannot_hold_a_ring_up() {
    let test = "hostile_round3::another_users_laggard_cannot_hold_a_ring_up";
    if run_child_role() || !can_run_another_user(test) {
        return;
    }
    let _serial = spawn_lock();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp_socket(&tmp, "laggard");
    let own = rustix::process::geteuid().as_raw();
    let server = Arc::new(
        Server::bind(ServerConfig::new(&path).with_allowed_uids([own, OTHER_UID])).unwrap(),
    );
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
    let (stop, producer) = paced_ring(&server);
    let span = Duration::from_millis(1500);
    let unloaded = frames_in(&path, span);
    let mut laggard = other_user_command(test, &tmp, "ring-laggard", &path);
    laggard.line("CHILD-READY", Duration::from_secs(20));
    // Its first stall is within its burst: measured after it.
    std::thread::sleep(Duration::from_secs(1));
    let during = frames_in(&path, span);
    let resubscribed = {
        laggard.close_stdin();
        laggard.after("CHILD-DONE subscriptions=", Duration::from_secs(20))
    };
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    producer.join().unwrap();
    eprintln!(
        "ring frames in {span:?}: {during} with another user's laggard, {unloaded} without; \
         it subscribed {resubscribed} times"
    );
    assert!(
        during * 2 >= unloaded,
        "{during} frames with the laggard against {unloaded} without"
    );
}

/// The server for the ack-flood test, alone in its process so that its
/// processor time can be read: allows uid 65534, serves one entry and a
/// 16-slot ring.
fn flood_server(path: &Path) {
    let own = rustix::process::geteuid().as_raw();
    let server = Server::bind(ServerConfig::new(path).with_allowed_uids([own, OTHER_UID])).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)).unwrap();
    server
        .publish("e", json!({}), vec![memfd_with(b"e")])
        .unwrap();
    let _ring = server
        .create_ring("r", json!(null), ring_slots(16))
        .unwrap();
    println!("CHILD-READY");
    wait_for_stdin_close();
}

/// The processor time of every thread of process `pid` so far.
fn cpu_of(pid: u32) -> Duration {
    let ns: u64 = std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, |tasks| {
        tasks
            .filter_map(Result::ok)
            .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
            .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
            .sum()
    });
    Duration::from_nanos(ns)
}

/// The median of 30 attach + release round trips of a client of ours.
fn attach_median(client: &Client) -> Duration {
    let mut t: Vec<Duration> = (0..30)
        .map(|_| {
            let began = Instant::now();
            let a = client.attach("e").unwrap();
            client.release(a.lease).unwrap();
            began.elapsed()
        })
        .collect();
    t.sort();
    t[t.len() / 2]
}

/// Another user's 32 connections, each subscribed to the ring and sending
/// acks as fast as the socket takes them. Before, such a flood took the
/// server's whole machine and a legitimate attach 25 to 100 times as long.
/// Now each reader measures the processor time the flood costs it and
/// charges it to the flooding user, whose readers sleep once its quarter
/// of a core is spent: the server's processor time and our attach stay
/// near their unloaded values.
#[test]
fn another_users_ack_flood_costs_the_server_only_its_share() {
    let test = "hostile_round3::another_users_ack_flood_costs_the_server_only_its_share";
    if run_child_role() || !can_run_another_user(test) {
        return;
    }
    let _serial = spawn_lock();
    let tmp = tempfile::tempdir().unwrap();
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = tmp_socket(&tmp, "flood");
    let mut server = spawn_child(test, "flood-server", &path, "r");
    server.line("CHILD-READY", Duration::from_secs(20));
    let pid = server.pid();
    let client = quick_client(&path);
    attach_median(&client);
    let unloaded = attach_median(&client);
    let mut flood = other_user_command(test, &tmp, "ack-flood", &path);
    let admitted = flood.after("CHILD-READY admitted=", Duration::from_secs(20));
    assert_eq!(admitted, "32", "the flooding connections admitted");
    // Past the flood's first burst.
    std::thread::sleep(Duration::from_millis(300));
    let (t0, c0) = (Instant::now(), cpu_of(pid));
    std::thread::sleep(Duration::from_secs(1));
    let cores = cpu_of(pid).saturating_sub(c0).as_secs_f64() / t0.elapsed().as_secs_f64();
    let during = attach_median(&client);
    flood.close_stdin();
    flood.finish(Duration::from_secs(20));
    server.finish(Duration::from_secs(10));
    eprintln!(
        "server during the flood: {:.0} % of a core; attach + release {during:?} against \
         {unloaded:?} unloaded",
        cores * 100.0
    );
    // A quarter of a core for the flood, with room for the measurement's
    // own requests and a loaded machine.
    assert!(
        cores < 0.6,
        "the server used {:.0} % of a core",
        cores * 100.0
    );
    assert!(
        during < unloaded * 5 + Duration::from_millis(1),
        "attach + release took {during:?} during the flood against {unloaded:?}"
    );
}

/// The child roles of these tests; whether `role` is one.
pub(crate) fn child_role(role: &str, path: &Path) -> bool {
    match role {
        "flood-server" => flood_server(path),
        "ring-laggard" => ring_laggard(path),
        "ack-flood" => ack_flood(path),
        _ => return false,
    }
    true
}

/// Subscribes to ring "r", takes every frame, acks one in 25, subscribes
/// again when dropped, until stdin closes.
fn ring_laggard(path: &Path) {
    let server_uid = rustix::fs::stat(path).unwrap().st_uid;
    let client = Client::connect(
        path,
        ClientConfig::default().with_allowed_server_uids([server_uid]),
    )
    .unwrap();
    let (done_tx, done) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        wait_for_stdin_close();
        let _ = done_tx.send(());
    });
    let mut subscriptions = 0;
    let mut ready = false;
    while done.try_recv().is_err() {
        let Ok(r) = client.attach_ring("r") else {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        subscriptions += 1;
        if !ready {
            println!("CHILD-READY");
            ready = true;
        }
        let mut n = 0u64;
        loop {
            match client.next_frame(r.lease, Duration::from_millis(50)) {
                Ok(f) => {
                    n += 1;
                    if n.is_multiple_of(25) {
                        let _ = client.ack(r.lease, f.slot, f.seq);
                    }
                }
                Err(e) if e.kind() == ErrorKind::Timeout => {
                    if done.try_recv().is_ok() {
                        println!("CHILD-DONE subscriptions={subscriptions}");
                        return;
                    }
                }
                // Skipped or evicted: subscribe again.
                Err(_) => {
                    let _ = client.release(r.lease);
                    break;
                }
            }
        }
    }
    println!("CHILD-DONE subscriptions={subscriptions}");
}

/// Opens 32 raw connections, subscribes each to ring "r" and sends acks
/// on them as fast as the sockets take them, reading nothing, until stdin
/// closes.
fn ack_flood(path: &Path) {
    let mut conns = Vec::new();
    for _ in 0..32 {
        let s = raw_connect(path, true);
        send_message(
            &s,
            &Message::AttachRing {
                id: 1,
                name: "r".into(),
            },
            &[],
            None,
        )
        .unwrap();
        conns.push(s);
    }
    println!("CHILD-READY admitted={}", conns.len());
    let batch: Vec<u8> = (0..64u64)
        .flat_map(|i| {
            encode(
                &Message::Ack {
                    lease: 1_000 + i,
                    slot: 0,
                    seq: i,
                },
                0,
            )
        })
        .collect();
    for mut s in conns {
        let batch = batch.clone();
        // Blocking writes: a throttled reader leaves the socket full and
        // the writer waits. The threads end with the process.
        std::thread::spawn(move || {
            use std::io::Write as _;
            while s.write_all(&batch).is_ok() {}
        });
    }
    wait_for_stdin_close();
}
