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

#[path = "../support/mod.rs"]
mod support;

mod children;
mod harness;
use support::{ChildProc, memfd_with, pattern, read_fd, test_command};

use support::wire::{encode, recv_message, send_message};

use cuda_ipc_channel::wire::{Message, PROTOCOL_VERSION};
use cuda_ipc_channel::{
    ChannelError, Client, ClientConfig, LeaseInfo, Notice, Server, ServerConfig, ServerRing,
};
use serde_json::json;

use children::*;
use harness::*;

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
    let baseline = stable_fds();

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
    let baseline = stable_fds();
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
