//! The server's reader spin ([`ServerConfig::spin`]) costs CPU only right
//! after a client's message: an idle connection's reader thread uses none,
//! and one whose requests come far apart backs off. Measured as the CPU
//! time of the connection's reader thread (`cuda-ipc-conn-<id>`) from
//! `/proc/self/task/<tid>/stat`; this file is its own test binary, and its
//! one test, so that no other test's connection starts meanwhile.

use std::path::Path;
use std::time::{Duration, Instant};

use cuda_ipc_channel::{Client, ClientConfig, NoticePath, Server, ServerConfig};
use serde_json::json;

/// The longest spin the server takes from its environment: the worst case.
const SPIN: Duration = Duration::from_millis(10);

/// `/proc` counts CPU time in ticks of 1/100 s (`USER_HZ`, fixed at 100
/// for user space on Linux).
const TICK: Duration = Duration::from_millis(10);

/// The connection reader threads of this process, by thread id.
fn readers() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|task| {
            let dir = task.ok()?.path();
            let comm = std::fs::read_to_string(dir.join("comm")).ok()?;
            comm.starts_with("cuda-ipc-conn-")
                .then(|| dir.file_name()?.to_str().map(str::to_owned))
                .flatten()
        })
        .collect()
}

/// The CPU time (user and system) thread `tid` of this process used.
fn cpu_of(tid: &str) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).unwrap();
    // After the command name (in parentheses): fields 3 onwards; utime
    // and stime are fields 14 and 15.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    TICK * ticks as u32
}

/// A server and a connected client, and the thread id of the
/// connection's reader.
fn pair(dir: &Path, name: &str, path: NoticePath, spin: Duration) -> (Server, Client, String) {
    // The last pair's reader may still be finishing; a listing of
    // /proc/self/task can miss a thread that exits meanwhile.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !readers().is_empty() {
        assert!(Instant::now() < deadline, "a connection reader stays");
        std::thread::sleep(Duration::from_millis(5));
    }
    let before = readers();
    let sock = dir.join(name);
    let server = Server::bind(ServerConfig::new(&sock).with_notices(path).with_spin(spin)).unwrap();
    server.publish("e", json!({}), vec![]).unwrap();
    let client = Client::connect(&sock, ClientConfig::default().with_notices(path)).unwrap();
    assert_eq!(client.notice_stats().path, path);
    // A new thread bears its parent's name until it names itself: the
    // reader's writer thread may briefly look like a reader.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut new: Vec<String> = readers()
            .into_iter()
            .filter(|t| !before.contains(t))
            .collect();
        if new.len() == 1 {
            return (server, client, new.remove(0));
        }
        assert!(
            Instant::now() < deadline,
            "expected one new connection reader thread, found {new:?}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn the_reader_spins_only_after_messages_that_come_close_together_or_not_at_all() {
    let tmp = tempfile::tempdir().unwrap();
    for path in [NoticePath::Shm, NoticePath::Socket] {
        // Idle: after some traffic, the reader spins once, then sleeps.
        let (server, client, reader) = pair(tmp.path(), &format!("idle-{path:?}"), path, SPIN);
        let a = client.attach("e").unwrap();
        for _ in 0..100 {
            client.ping().unwrap();
        }
        // The last spin ends within 10 ms of the last ping.
        std::thread::sleep(SPIN * 2);
        let before = cpu_of(&reader);
        std::thread::sleep(Duration::from_secs(1));
        let idle = cpu_of(&reader).saturating_sub(before);
        assert!(
            idle <= 2 * TICK,
            "{path:?}: an idle connection's reader used {idle:?} of CPU in a second"
        );
        client.release(a.lease).unwrap();
        drop(client);
        drop(server);

        // Requests 20 ms apart, longer than the spin: every spin misses,
        // so the reader soon stops spinning (at most one wait in 64).
        let (server, client, reader) = pair(tmp.path(), &format!("paced-{path:?}"), path, SPIN);
        let before = cpu_of(&reader);
        let started = Instant::now();
        for _ in 0..50 {
            std::thread::sleep(Duration::from_millis(20));
            client.ping().unwrap();
        }
        let used = cpu_of(&reader).saturating_sub(before);
        let took = started.elapsed();
        // Without backing off: 50 spins of 10 ms, 500 ms.
        assert!(
            used <= Duration::from_millis(250),
            "{path:?}: the reader used {used:?} of CPU in {took:?} for 50 pings 20 ms apart"
        );
        drop(client);
        drop(server);
    }
    // One test, so that no other test's connection threads are counted.
    a_server_that_does_not_spin_answers_as_before(tmp.path());
    a_producer_spins_for_acks_within_its_budget(tmp.path());
    a_client_that_dies_during_a_spin_is_noticed_at_once(tmp.path());
}

/// A spinning reader notices a client that goes away as a sleeping one
/// does: at once, not when its spin ends.
fn a_client_that_dies_during_a_spin_is_noticed_at_once(tmp: &Path) {
    let long = Duration::from_secs(2);
    for path in [NoticePath::Shm, NoticePath::Socket] {
        let (server, client, _) = pair(tmp, &format!("dies-{path:?}"), path, long);
        client.attach("e").unwrap();
        client.ping().unwrap();
        // The reader spins now, for up to two seconds.
        let t = Instant::now();
        drop(client);
        server
            .wait_released("e", Some(Duration::from_secs(10)))
            .unwrap();
        assert!(
            t.elapsed() < long / 4,
            "{path:?}: the lease ended {:?} after the client went away",
            t.elapsed()
        );
    }
}

/// The CPU time this thread has used.
fn thread_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// `ServerRing::acquire` spins for an ack before it sleeps: it keeps its
/// deadline, and a subscriber that acks long after costs the producer
/// little CPU (the spin backs off).
fn a_producer_spins_for_acks_within_its_budget(tmp: &Path) {
    for path in [NoticePath::Shm, NoticePath::Socket] {
        let (server, client, _) = pair(tmp, &format!("acquire-{path:?}"), path, SPIN);
        let ring = server
            .create_ring("r", json!({}), vec![(json!({}), vec![])])
            .unwrap();
        let sub = client.attach_ring("r").unwrap();
        // A slot held by a subscriber that does not ack: the timeout holds
        // though it is shorter than the spin.
        let slot = ring.acquire(None).unwrap();
        ring.publish(slot, json!(0)).unwrap();
        let f = client
            .next_frame(sub.lease, Duration::from_secs(5))
            .unwrap();
        let t = Instant::now();
        let e = ring.acquire(Some(Duration::from_millis(2))).unwrap_err();
        assert!(e.to_string().contains("acknowledged"), "{e}");
        assert!(t.elapsed() < SPIN, "{path:?}: took {:?}", t.elapsed());
        client.ack(sub.lease, f.slot, f.seq).unwrap();

        // A subscriber that acks 20 ms after each frame: every spin misses.
        let subscriber = std::thread::spawn(move || {
            for _ in 0..50 {
                let f = client
                    .next_frame(sub.lease, Duration::from_secs(5))
                    .unwrap();
                std::thread::sleep(Duration::from_millis(20));
                client.ack(sub.lease, f.slot, f.seq).unwrap();
            }
        });
        let before = thread_cpu();
        for i in 0..50 {
            let slot = ring.acquire(Some(Duration::from_secs(5))).unwrap();
            ring.publish(slot, json!(i)).unwrap();
        }
        ring.acquire(Some(Duration::from_secs(5))).unwrap();
        let used = thread_cpu().saturating_sub(before);
        subscriber.join().unwrap();
        // Without backing off: 50 spins of 10 ms, 500 ms.
        assert!(
            used <= Duration::from_millis(250),
            "{path:?}: the producer used {used:?} of CPU for 50 frames acked 20 ms late"
        );
    }
}

fn a_server_that_does_not_spin_answers_as_before(tmp: &Path) {
    for path in [NoticePath::Shm, NoticePath::Socket] {
        let (server, client, _) = pair(tmp, &format!("nospin-{path:?}"), path, Duration::ZERO);
        let ring = server
            .create_ring("r", json!({}), vec![(json!({}), vec![])])
            .unwrap();
        let sub = client.attach_ring("r").unwrap();
        for i in 0..200u64 {
            client.ping().unwrap();
            let a = client.attach("e").unwrap();
            let slot = ring.acquire(Some(Duration::from_secs(5))).unwrap();
            ring.publish(slot, json!(i)).unwrap();
            let f = client
                .next_frame(sub.lease, Duration::from_secs(5))
                .unwrap();
            client.ack(sub.lease, f.slot, f.seq).unwrap();
            client.release(a.lease).unwrap();
        }
        // The last ack freed the slot.
        ring.acquire(Some(Duration::from_secs(5))).unwrap();
    }
}
