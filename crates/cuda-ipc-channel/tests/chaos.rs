//! Chaos harness of the exchange channel, without a GPU: processes killed
//! with `SIGKILL` at random points, hundreds of times.
//!
//! - `consumers_killed_at_random_points`: this process is the producer (a
//!   [`Server`] with memfd-backed entries and a ring). Three *survivor*
//!   consumer processes hold leases and a ring subscription throughout; in
//!   each round a *victim* consumer process is killed half-way through a
//!   frame, in the middle of attach/release cycles, between a ring frame
//!   and its ack, while acking a burst of frames, or while holding leases.
//!   After every kill: the victim's leases end within a second
//!   (`wait_released` returns), [`Server::leases`] is back to exactly the
//!   survivors' leases, every ring slot can be acquired again, the
//!   survivors still answer (ping, attach, release, ring frames whose
//!   bytes they check through the slot's memfd), and this process has
//!   exactly as many open file descriptors as before the round.
//! - `producers_killed_at_random_points`: the producer is a child process
//!   that publishes an entry, updates it and runs a ring non-stop; it is
//!   killed at a random point while three clients here (waiting for
//!   updates, ring frames, pings) and a consumer process use it. Every one
//!   of them reports [`ChannelError::PeerGone`] within a second, the memory
//!   it received stays readable, and no descriptor is left open here.
//!
//! Child processes re-run this executable (`CUDA_IPC_CHAOS_CHILD=<role>`);
//! nothing forks. Every wait has a deadline, so a hang is a failure, not a
//! stuck CI job. The random choices (scenario, timing, split points) come
//! from a seeded generator: the seed is printed, and
//! `CUDA_IPC_CHAOS_SEED=<seed>` replays the same sequence of choices.
//! `CUDA_IPC_CHAOS_SCALE=<n>` multiplies the number of rounds (a soak).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

mod support;
use support::{ChildProc, memfd_with, pattern, read_fd, test_command};

use support::wire::{encode, recv_message, send_message};

use cuda_ipc_channel::wire::{Message, PROTOCOL_VERSION};
use cuda_ipc_channel::{
    ChannelError, Client, ClientConfig, LeaseInfo, Notice, RingProducer, Server, ServerConfig,
};
use serde_json::json;

// ---------------------------------------------------------------------------
// Parameters

/// Rounds in which a consumer is killed (at scale 1).
const CONSUMER_ROUNDS: usize = 400;
/// Rounds in which the producer is killed (at scale 1).
const PRODUCER_ROUNDS: usize = 100;
/// Survivor consumer processes that live through every round.
const SURVIVORS: usize = 3;
/// Entries only victims attach to.
const VICTIM_ENTRIES: usize = 4;
/// Slots of the producer's ring.
const RING_SLOTS: usize = 4;
/// Bytes of every memfd.
const LEN: usize = 4096;
/// How quickly a killed peer must be noticed.
const NOTICE: Duration = Duration::from_secs(1);
/// How long a healthy peer may take to answer (generous: CI is 2 cores).
const ANSWER: Duration = Duration::from_secs(10);
/// How long a child may live at most, in case its parent forgets it.
const CHILD_LIFETIME: Duration = Duration::from_secs(120);

const CHILD_ENV: &str = "CUDA_IPC_CHAOS_CHILD";
const PATH_ENV: &str = "CUDA_IPC_CHAOS_PATH";
const ARG_ENV: &str = "CUDA_IPC_CHAOS_ARG";

/// The two tests count this process's descriptors: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

// ---------------------------------------------------------------------------
// Randomness, reproducible from a printed seed

/// SplitMix64: small, fast, and enough to pick scenarios and delays.
struct Rng(u64);

impl Rng {
    fn from_env(test: &str) -> Rng {
        let seed = if let Ok(s) = std::env::var("CUDA_IPC_CHAOS_SEED") {
            s.parse()
                .unwrap_or_else(|_| panic!("CUDA_IPC_CHAOS_SEED={s:?} is not a u64"))
        } else {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            (now.as_nanos() as u64) ^ u64::from(std::process::id()).rotate_left(32)
        };
        println!("{test}: chaos seed {seed} (replay with CUDA_IPC_CHAOS_SEED={seed})");
        Rng(seed)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n`.
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn millis(&mut self, max: u64) -> Duration {
        Duration::from_micros(self.below(max * 1000 + 1))
    }
}

fn scale() -> usize {
    std::env::var("CUDA_IPC_CHAOS_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1)
}

// ---------------------------------------------------------------------------
// Memory and descriptors

/// The stamp a ring frame's notice announces, written at offset 0 of its slot.
fn stamp_of(fd: impl AsFd) -> u64 {
    let bytes = read_fd(fd, 8);
    u64::from_le_bytes(
        bytes
            .try_into()
            .unwrap_or_else(|b: Vec<u8>| panic!("a ring slot of {} bytes has no stamp", b.len())),
    )
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Waits (up to 5 s) for the count of open descriptors to come back to
/// `expected`: a server thread closes a dead client's socket, and a reader
/// thread a dead child's pipe, a moment after the death is noticed.
fn settle_fds(expected: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let n = open_fds();
        if n == expected || Instant::now() >= deadline {
            return n;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn entry_seed(name: &str) -> u8 {
    match name {
        "base" => 1,
        "extra" => 2,
        v => 10 + v.trim_start_matches('v').parse::<u8>().unwrap(),
    }
}

fn victim_entry(i: u64) -> String {
    format!("v{}", i % VICTIM_ENTRIES as u64)
}

// ---------------------------------------------------------------------------
// Child processes

/// This test executable re-run for `test` in `role`, against the socket
/// at `path`, with the role's argument `arg`.
fn spawn_child(test: &str, role: &str, path: &Path, arg: &str) -> ChildProc {
    let mut cmd = test_command(&std::env::current_exe().unwrap(), test);
    cmd.env(CHILD_ENV, role)
        .env(PATH_ENV, path)
        .env(ARG_ENV, arg);
    ChildProc::start(cmd).expect("cannot re-run the test executable")
}

/// Exits this (child) process when stdin reaches end of file: the parent
/// closed it or died. Victims that are never killed end this way too.
fn exit_when_stdin_closes() {
    std::thread::spawn(|| {
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
        std::process::exit(0);
    });
}

/// Blocks until stdin is closed or the child's lifetime is over.
fn wait_for_stdin_close() {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
        let _ = tx.send(());
    });
    let _ = rx.recv_timeout(CHILD_LIFETIME);
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn connect(path: &Path) -> Client {
    Client::connect(path, ClientConfig::default().with_timeout(ANSWER)).unwrap()
}

/// If this process is a child, runs its role and returns true.
fn run_child_role() -> bool {
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
fn survivor(path: &Path) {
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
fn half_frame(path: &Path, arg: &str) {
    exit_when_stdin_closes();
    let (after_handshake, split) = arg.split_once(',').unwrap();
    let after_handshake = after_handshake == "1";
    let split: usize = split.parse().unwrap();
    let mut s = UnixStream::connect(path).unwrap();
    let hello = Message::Hello {
        protocol: PROTOCOL_VERSION,
        pid: std::process::id(),
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
fn churn(path: &Path) {
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
fn ring_victim(path: &Path, ack: bool) {
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
fn hold(path: &Path, arg: &str) {
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
fn producer(path: &Path) {
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
fn consumer(path: &Path) {
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

// ---------------------------------------------------------------------------
// Consumers killed

/// What a victim does when it is killed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Scenario {
    /// Half-way through a hello, or through a request after the handshake.
    MidFrame,
    /// In attach/release cycles, at a random moment.
    MidAttach,
    /// Sent a ring frame, not acked.
    MidRing,
    /// Acking a burst of ring frames, at a random moment.
    RingBurst,
    /// Holding leases on entries and the ring.
    HoldingLeases,
}

const SCENARIOS: [Scenario; 5] = [
    Scenario::MidFrame,
    Scenario::MidAttach,
    Scenario::MidRing,
    Scenario::RingBurst,
    Scenario::HoldingLeases,
];

/// The producer's side: the server, its ring, and a writable duplicate of
/// every slot's memfd.
struct Producer {
    server: Server,
    ring: RingProducer,
    slot_fds: Vec<OwnedFd>,
    stamp: u64,
}

impl Producer {
    fn start(path: &Path) -> Producer {
        let server = Server::bind(ServerConfig::new(path)).unwrap();
        for name in ["base", "extra"]
            .into_iter()
            .map(String::from)
            .chain((0..VICTIM_ENTRIES as u64).map(victim_entry))
        {
            let seed = entry_seed(&name);
            server
                .publish(
                    &name,
                    json!({ "len": LEN, "seed": seed }),
                    vec![memfd_with(&pattern(LEN, seed))],
                )
                .unwrap();
        }
        let mut slots = Vec::new();
        let mut slot_fds = Vec::new();
        for i in 0..RING_SLOTS {
            let fd = memfd_with(&[0u8; LEN]);
            slot_fds.push(fd.try_clone().unwrap());
            slots.push((json!({ "slot": i }), vec![fd]));
        }
        let ring = server.create_ring("ring", json!(null), slots).unwrap();
        Producer {
            server,
            ring,
            slot_fds,
            stamp: 0,
        }
    }

    /// Acquires a slot, writes a fresh stamp into it and publishes it.
    /// Returns the frame's sequence number.
    fn publish_frame(&mut self) -> u64 {
        let slot = self
            .ring
            .acquire(Some(ANSWER))
            .expect("a ring slot stayed in use");
        self.stamp += 1;
        rustix::io::pwrite(&self.slot_fds[slot as usize], &self.stamp.to_le_bytes(), 0).unwrap();
        self.ring
            .publish(slot, json!({ "stamp": self.stamp }))
            .unwrap()
    }

    /// Checks that every slot is free: acquires them all (in ring order),
    /// publishes the first and gives the others back. Returns the
    /// published frame's sequence number.
    fn check_ring(&mut self) -> u64 {
        let mut acquired = Vec::new();
        for _ in 0..RING_SLOTS {
            match self.ring.acquire(Some(NOTICE)) {
                Ok(slot) => acquired.push(slot),
                Err(e) => panic!("a ring slot is still held after the round ({acquired:?}): {e}"),
            }
        }
        let first = acquired.remove(0);
        for slot in acquired {
            self.ring.cancel(slot).unwrap();
        }
        self.stamp += 1;
        rustix::io::pwrite(&self.slot_fds[first as usize], &self.stamp.to_le_bytes(), 0).unwrap();
        self.ring
            .publish(first, json!({ "stamp": self.stamp }))
            .unwrap()
    }
}

/// Waits until `leases()` equals `expected`; panics after `within`.
fn leases_return_to(server: &Server, expected: &[LeaseInfo], within: Duration, what: &str) {
    let started = Instant::now();
    loop {
        let now = server.leases();
        if now == expected {
            return;
        }
        assert!(
            started.elapsed() < within,
            "{what}: the leases did not return to the survivors' within {within:?}: \
             expected {expected:?}, have {now:?}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
#[allow(clippy::too_many_lines)] // one round of each scenario, in order
fn consumers_killed_at_random_points() {
    const TEST: &str = "consumers_killed_at_random_points";
    if run_child_role() {
        return;
    }
    let _serial = serial();
    let started = Instant::now();
    let mut rng = Rng::from_env(TEST);
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("chaos.sock");
    let fds_before_server = open_fds();
    let mut p = Producer::start(&path);

    let mut survivors: Vec<ChildProc> = (0..SURVIVORS)
        .map(|_| spawn_child(TEST, "survivor", &path, ""))
        .collect();
    for s in &mut survivors {
        s.line("CHILD-READY", Duration::from_secs(30));
    }
    let expected = p.server.leases();
    assert_eq!(expected.len(), 2 * SURVIVORS, "{expected:?}");
    let baseline = settle_fds(open_fds());

    let rounds = CONSUMER_ROUNDS * scale();
    let mut counts: HashMap<Scenario, usize> = HashMap::new();
    let mut slowest_release = Duration::ZERO;
    for round in 0..rounds {
        let scenario = SCENARIOS[rng.below(SCENARIOS.len() as u64) as usize];
        *counts.entry(scenario).or_default() += 1;
        let what = format!("round {round} ({scenario:?})");
        let mut victim_entries: Vec<String> = Vec::new();
        let mut victim = match scenario {
            Scenario::MidFrame => {
                let arg = format!("{},{}", rng.below(2), rng.next() % 1000);
                let mut v = spawn_child(TEST, "half-frame", &path, &arg);
                v.line("CHILD-READY", ANSWER);
                std::thread::sleep(rng.millis(2));
                v
            }
            Scenario::MidAttach => {
                let mut v = spawn_child(TEST, "churn", &path, "");
                v.line("CHILD-READY", ANSWER);
                victim_entries = (0..VICTIM_ENTRIES as u64).map(victim_entry).collect();
                std::thread::sleep(rng.millis(15));
                v
            }
            Scenario::MidRing => {
                let mut v = spawn_child(TEST, "ring-noack", &path, "");
                v.line("CHILD-READY", ANSWER);
                let seq = p.publish_frame();
                // The victim has the frame and will never ack it.
                v.line(&format!("FRAME {seq};"), ANSWER);
                v
            }
            Scenario::RingBurst => {
                let mut v = spawn_child(TEST, "ring-ack", &path, "");
                v.line("CHILD-READY", ANSWER);
                for _ in 0..=rng.below(3) {
                    p.publish_frame();
                }
                std::thread::sleep(rng.millis(3));
                v
            }
            Scenario::HoldingLeases => {
                let mut names: Vec<String> = (0..=rng.below(VICTIM_ENTRIES as u64))
                    .map(|_| victim_entry(rng.next()))
                    .collect();
                if rng.below(2) == 0 {
                    names.push("ring".into());
                }
                let mut v = spawn_child(TEST, "hold", &path, &names.join(","));
                v.line("CHILD-READY", ANSWER);
                let now = p.server.leases();
                let theirs: Vec<&LeaseInfo> = now.iter().filter(|l| l.pid == v.pid()).collect();
                assert_eq!(theirs.len(), names.len(), "{what}: {now:?}");
                assert_eq!(now.len(), expected.len() + names.len(), "{what}: {now:?}");
                victim_entries = names.into_iter().filter(|n| n != "ring").collect();
                v
            }
        };

        // The kill, and what must follow within a second.
        let killed = Instant::now();
        victim.kill();
        for name in &victim_entries {
            p.server
                .wait_released(name, Some(NOTICE))
                .unwrap_or_else(|e| panic!("{what}: {name}: {e}"));
        }
        leases_return_to(&p.server, &expected, NOTICE, &what);
        slowest_release = slowest_release.max(killed.elapsed());
        let deadline = Instant::now() + NOTICE;
        while p.server.connection_count() != SURVIVORS {
            assert!(
                Instant::now() < deadline,
                "{what}: {} connections, expected the {SURVIVORS} survivors'",
                p.server.connection_count()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(victim);

        // The survivors keep working, and no slot is left in use.
        let seq = p.check_ring();
        p.server.update("base", json!({ "round": round })).unwrap();
        for s in &mut survivors {
            s.line(&format!("ACK {seq};"), ANSWER);
            s.line(&format!("ROUND {round};"), ANSWER);
        }
        leases_return_to(&p.server, &expected, NOTICE, &what);

        // Not one descriptor more or less than before the round.
        let fds = settle_fds(baseline);
        assert_eq!(fds, baseline, "{what}: open descriptors");
    }

    for s in &mut survivors {
        s.finish(ANSWER);
    }
    p.server
        .wait_released("base", Some(ANSWER))
        .expect("the survivors released base");
    drop(p);
    assert_eq!(
        settle_fds(fds_before_server),
        fds_before_server,
        "descriptors left open after the server shut down"
    );
    let mut counts: Vec<_> = counts.into_iter().collect();
    counts.sort_by_key(|(s, _)| format!("{s:?}"));
    println!(
        "{TEST}: {rounds} consumers killed ({counts:?}); slowest lease release {slowest_release:?}; \
         {:?} in all",
        started.elapsed()
    );
}

// ---------------------------------------------------------------------------
// Producers killed

/// How a client thread here ended, and when.
type Ended = (&'static str, Result<(), String>, Instant);

/// Runs `body` in a thread that reports how it ended on `tx`; `body`
/// sends on its `ready` once it is connected and attached.
fn watch(
    tx: &mpsc::Sender<Ended>,
    ready: &mpsc::Sender<()>,
    name: &'static str,
    body: impl FnOnce(mpsc::Sender<()>) -> Result<(), ChannelError> + Send + 'static,
) {
    let (tx, ready) = (tx.clone(), ready.clone());
    std::thread::spawn(move || {
        let r = body(ready);
        let at = Instant::now();
        let _ = tx.send((name, r.map_err(|e| format!("{e:?}")), at));
    });
}

/// Loops `step` until it fails, and returns that failure.
fn until_error(mut step: impl FnMut() -> Result<(), ChannelError>) -> Result<(), ChannelError> {
    let until = Instant::now() + CHILD_LIFETIME;
    while Instant::now() < until {
        step()?;
    }
    Ok(())
}

#[test]
#[allow(clippy::too_many_lines)] // the round, with its checks, in order
fn producers_killed_at_random_points() {
    const TEST: &str = "producers_killed_at_random_points";
    if run_child_role() {
        return;
    }
    let _serial = serial();
    let started = Instant::now();
    let mut rng = Rng::from_env(TEST);
    let tmp = tempfile::tempdir().unwrap();
    // The same path every round: each new producer replaces the socket
    // file its killed predecessor left behind.
    let path = tmp.path().join("producer.sock");
    let baseline = settle_fds(open_fds());
    let rounds = PRODUCER_ROUNDS * scale();
    let mut slowest = Duration::ZERO;
    let mut early_kills = 0;
    for round in 0..rounds {
        let what = format!("round {round}");
        let mut producer = spawn_child(TEST, "producer", &path, "");
        producer.line("CHILD-READY", Duration::from_secs(30));
        // Mostly a kill in full flow; sometimes while the clients connect.
        let early = rng.below(4) == 0;
        let (tx, ended) = mpsc::channel::<Ended>();
        let (ready_tx, ready) = mpsc::channel::<()>();
        let mut consumer = None;
        let held: Arc<Mutex<Option<OwnedFd>>> = Arc::default();
        if !early {
            let mut c = spawn_child(TEST, "consumer", &path, "");
            c.line("CHILD-READY", ANSWER);
            consumer = Some(c);
        }
        {
            let (path, held) = (path.clone(), Arc::clone(&held));
            watch(&tx, &ready_tx, "updates", move |ready| {
                let client = Client::connect(&path, ClientConfig::default())?;
                let a = client.attach("p")?;
                assert_eq!(read_fd(&a.fds[0], LEN), pattern(LEN, 9));
                *held.lock().unwrap() = a.fds.into_iter().next();
                let _ = ready.send(());
                until_error(|| client.next_update(ANSWER).map(drop))
            });
        }
        {
            let path = path.clone();
            watch(&tx, &ready_tx, "ring", move |ready| {
                let client = Client::connect(&path, ClientConfig::default())?;
                let r = client.attach_ring("pr")?;
                let _ = ready.send(());
                until_error(|| {
                    let f = client.next_frame(r.lease, ANSWER)?;
                    client.ack(r.lease, f.slot, f.seq)
                })
            });
        }
        {
            let path = path.clone();
            watch(&tx, &ready_tx, "ping", move |ready| {
                let client = Client::connect(&path, ClientConfig::default())?;
                client.ping()?;
                let _ = ready.send(());
                until_error(|| client.ping().map(drop))
            });
        }
        drop((tx, ready_tx));
        if early {
            early_kills += 1;
            std::thread::sleep(rng.millis(3));
        } else {
            // Once the clients are in their loops, a random moment.
            for _ in 0..3 {
                ready
                    .recv_timeout(ANSWER)
                    .unwrap_or_else(|_| panic!("{what}: a client could not attach"));
            }
            std::thread::sleep(rng.millis(20));
        }

        let killed = Instant::now();
        producer.kill();

        // Every client here ends within a second, with PeerGone (or, when
        // the kill came first, with a refused connection: nothing listens).
        for _ in 0..3 {
            let (name, result, at) = ended
                .recv_timeout(NOTICE * 3)
                .unwrap_or_else(|_| panic!("{what}: a client still waits 3 s after the kill"));
            let took = at.saturating_duration_since(killed);
            assert!(
                took < NOTICE,
                "{what}: {name} noticed the kill after {took:?}"
            );
            slowest = slowest.max(took);
            match result {
                Err(e) if e == "PeerGone" => {}
                Err(e) if early && e.contains("Io") => {}
                other => panic!("{what}: {name} ended with {other:?}, expected PeerGone"),
            }
        }
        if let Some(mut c) = consumer {
            let (_, at) = c.try_line("GONE", NOTICE).unwrap_or_else(|| {
                panic!("{what}: the consumer process did not report PeerGone within {NOTICE:?}")
            });
            let took = at.saturating_duration_since(killed);
            assert!(took < NOTICE, "{what}: the consumer process took {took:?}");
            slowest = slowest.max(took);
            c.finish(ANSWER);
        }
        // What the producer shared outlives it.
        if let Some(fd) = held.lock().unwrap().take() {
            assert_eq!(read_fd(&fd, LEN), pattern(LEN, 9), "{what}");
        }
        drop(producer);
        let fds = settle_fds(baseline);
        assert_eq!(fds, baseline, "{what}: open descriptors");
    }
    println!(
        "{TEST}: {rounds} producers killed ({early_kills} while clients connected); slowest \
         notice {slowest:?}; {:?} in all",
        started.elapsed()
    );
}

/// The harness itself: the generator is deterministic for a seed.
#[test]
fn the_seed_decides_every_choice() {
    let draw = |seed| {
        let mut r = Rng(seed);
        (0..8).map(|_| r.below(1000)).collect::<Vec<_>>()
    };
    assert_eq!(draw(7), draw(7));
    assert_ne!(draw(7), draw(8));
}
