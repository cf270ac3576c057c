//! Weights that outlive the serving process, on a real device: the test
//! process is the keeper ([`Keeper`], no CUDA work of its own), a child is
//! the serving process, and it is SIGKILLed at random points of writer
//! sessions (while the staging version is written, between the commit and
//! its answer, after the answer), of readers' attaches and of loads of a
//! checkpoint, again and again. A client that connects right after each kill must be answered
//! by the next process, not refused. Every time, the next serving process must serve the last
//! committed version (a commit whose answer was lost may have landed or
//! not; never a torn version), checked by content in a fresh reader; and
//! when the keeper stops, device memory and descriptors are back where
//! they started.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cuda_ipc::Device;
use cuda_ipc::Dtype;
use cuda_ipc::channel::{Client, ClientConfig};
use cuda_ipc::exchange::{Subscriber, SubscriberConfig};
use cuda_ipc::keep::{Keeper, KeeperEvent, KeeperExit, Store};
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::service::admin::{self, LsAnswer, TensorSpec};
use cuda_ipc::service::{Service, ServiceConfig, Writer};
use serde_json::{Value, json};

use super::common::{Parent, Peer, free_memory, role};
use crate::{assert_ok, test_name};

pub(super) const SOCKET_ENV: &str = "CUDA_IPC_TEST_SURVIVE_SOCKET";
const SEED_ENV: &str = "CUDA_IPC_TEST_SURVIVE_SEED";
const ROUNDS_ENV: &str = "CUDA_IPC_KILL_ROUNDS";
/// The set a reader child reads, when not [`SET`].
const SET_ENV: &str = "CUDA_IPC_TEST_SURVIVE_SET";
const SET: &str = "kept";
/// The set the load rounds load, from a checkpoint of [`layout`]'s
/// tensors holding seed [`LOAD_SEED`]'s pattern.
const LOADED: &str = "loaded";
const LOAD_SEED: u32 = 77;

fn socket() -> PathBuf {
    PathBuf::from(std::env::var(SOCKET_ENV).unwrap())
}

fn seed() -> u32 {
    std::env::var(SEED_ENV).unwrap().parse().unwrap()
}

fn layout() -> Vec<TensorSpec> {
    vec![
        TensorSpec::new("embed.weight", Dtype::U32, vec![4096, 256]),
        TensorSpec::new("norm.weight", Dtype::U32, vec![256]),
        TensorSpec::new("lm_head.weight", Dtype::U32, vec![1000, 256]),
    ]
}

fn pattern(seed: u32, i: usize) -> Pattern {
    Pattern::ramp(seed * 10_000_000 + i as u32 * 1_000_000, 1)
}

/// The serving process: takes back what the keeper holds, serves, and
/// waits to be killed (or stopped: SIGTERM's default action).
pub(super) fn served() {
    // Gone with the test if it fails (the keeper is its thread).
    rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL)).unwrap();
    let device = Device::open(0).unwrap();
    let store = Store::from_env().unwrap();
    let (_service, _restored) =
        Service::start_kept(&device, socket().as_path(), ServiceConfig::default(), store).unwrap();
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// A writer: opens a write (a new set for seed 1), fills it with its
/// seed's pattern, says so, and commits when told.
fn writer() {
    let parent = Parent::new();
    let device = Device::open(0).unwrap();
    let sub =
        Subscriber::connect(&device, socket().as_path(), SubscriberConfig::default()).unwrap();
    let seed = seed();
    let w = match Writer::open(&sub, SET, (seed == 1).then(layout)) {
        Ok(w) => w,
        Err(e) => return parent.send(&json!({"bad": e.to_string()})),
    };
    for i in 0..w.staging().len() {
        let view = w.staging().view::<u32>(i).unwrap();
        kernels::fill_u32(&view, pattern(seed, i), Speed::Full).unwrap();
    }
    device.synchronize().unwrap();
    parent.send(&json!({"bad": null}));
    if parent.recv() != Some(json!("commit")) {
        return;
    }
    match w.commit() {
        Ok(a) => parent.send(&json!({"bad": null, "version": a.version})),
        Err(e) => parent.send(&json!({"bad": e.to_string()})),
    }
    let _ = parent.recv();
}

/// A reader: attaches the set and says which version's content it holds
/// (every tensor, every element), or what is wrong.
fn reader() {
    let parent = Parent::new();
    let device = Device::open(0).unwrap();
    let sub =
        Subscriber::connect(&device, socket().as_path(), SubscriberConfig::default()).unwrap();
    let name = std::env::var(SET_ENV).unwrap_or_else(|_| SET.to_owned());
    let set = sub.attach_set(&name).unwrap();
    let seed = seed();
    let mut bad = Value::Null;
    let specs = layout();
    for i in 0..set.len() {
        let view = set.view::<u32>(i).unwrap();
        // The pattern of the layout's tensor of this name (a loaded set's
        // entries come in the checkpoint's order).
        let name = &set.entries()[i].name;
        let Some(k) = specs.iter().position(|t| &t.name == name) else {
            bad = json!(format!("{name} is not a tensor of the layout"));
            break;
        };
        if let Some(at) = kernels::check_u32(&view, pattern(seed, k)).unwrap() {
            bad = json!(format!(
                "{} is not version {seed} at element {at}",
                set.entries()[i].name
            ));
            break;
        }
    }
    parent.send(&json!({"bad": bad, "read_only": set.read_only(), "bytes": set.entries().iter().map(|e| e.len).sum::<u64>()}));
}

/// Writes the load rounds' checkpoint: [`layout`]'s tensors, each holding
/// seed [`LOAD_SEED`]'s pattern.
fn write_load_checkpoint(path: &Path) {
    let data: Vec<Vec<u8>> = layout()
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let n: u64 = t.shape.iter().product();
            let p = pattern(LOAD_SEED, i);
            (0..n).flat_map(|j| p.at(j).to_le_bytes()).collect()
        })
        .collect();
    let specs = layout();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = specs
        .iter()
        .zip(&data)
        .map(|(t, bytes)| {
            let shape = t.shape.iter().map(|&d| d as usize).collect();
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::U32, shape, bytes)
                .unwrap();
            (t.name.clone(), view)
        })
        .collect();
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

/// A small xorshift, seeded by the clock (the seed is printed).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

pub(super) fn ls(socket: &Path) -> Result<LsAnswer, String> {
    let client =
        Client::connect(socket, ClientConfig::default()).map_err(|e| format!("connect: {e}"))?;
    let answer = client
        .call_within("ls", &json!({}), Duration::from_secs(10))
        .map_err(|e| format!("call: {e}"))?;
    admin::decode("ls", &answer).map_err(|e| format!("answer: {e}"))
}

/// Waits until process `pid` is dead (gone, or a zombie its parent has not
/// reaped yet).
pub(super) fn wait_gone(pid: u32) {
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(10) {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Ok(stat)
                if !stat
                    .rsplit_once(')')
                    .is_some_and(|(_, r)| r.trim_start().starts_with('Z')) =>
            {
                std::thread::sleep(Duration::from_millis(1));
            }
            _ => return,
        }
    }
    panic!("process {pid} still runs 10 s after SIGKILL");
}

pub(super) fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Waits for the serving process that follows `old` to say it serves.
pub(super) fn next_ready(events: &mpsc::Receiver<KeeperEvent>, old: u32) -> (u32, Duration) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut started = None;
    while Instant::now() < deadline {
        match events.recv_timeout(Duration::from_millis(100)) {
            Ok(KeeperEvent::Started { pid, .. }) if pid != old => started = Some(pid),
            Ok(KeeperEvent::Ready { pid, after }) if Some(pid) == started => return (pid, after),
            Ok(KeeperEvent::Exited {
                restart: false,
                status,
                ..
            }) => {
                panic!("the keeper gave up on the serving process ({status})")
            }
            _ => {}
        }
    }
    panic!("no serving process after {old} within 60 s");
}

/// The test process as the keeper of a serving child (role `served`, for
/// the test `test`), on a socket in a temporary folder.
pub(super) struct Kept {
    _dir: tempfile::TempDir,
    /// The service's socket.
    pub(super) socket: PathBuf,
    /// The serving process now, at the start.
    pub(super) serving: u32,
    /// What the keeper says.
    pub(super) events: mpsc::Receiver<KeeperEvent>,
    /// Stops the keeper.
    pub(super) stop: Stopper,
    /// Set: the keeper kills the serving process and starts the build
    /// again, as `kill -HUP KEEPER` does for an upgrade.
    pub(super) upgrade: Arc<AtomicBool>,
}

/// Stops a [`Kept`]'s keeper and checks it closed what it kept.
pub(super) struct Stopper {
    flag: Arc<AtomicBool>,
    keeping: std::thread::JoinHandle<(KeeperExit, usize)>,
}

impl Stopper {
    pub(super) fn stop(self) {
        self.flag.store(true, Ordering::SeqCst);
        let (exit, kept_after) = self.keeping.join().unwrap();
        assert!(matches!(exit, KeeperExit::Stopped(_)), "{exit:?}");
        assert_eq!(kept_after, 0, "the keeper closed what it kept");
    }
}

impl Kept {
    /// Starts the keeper (with a standby or not) and waits for its first
    /// serving process.
    pub(super) fn start(test: &str, standby: bool) -> Kept {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("svc.sock");
        let mut keeper = Keeper::bind(&dir.path().join("keeper.sock"))
            .unwrap()
            .with_standby(standby);
        let stop = Arc::new(AtomicBool::new(false));
        let upgrade = Arc::new(AtomicBool::new(false));
        let (tx, events) = mpsc::channel();
        let keeping = {
            let (stop, upgrade, socket, test) = (
                stop.clone(),
                upgrade.clone(),
                socket.clone(),
                test.to_owned(),
            );
            std::thread::spawn(move || {
                let exe = std::env::current_exe().unwrap();
                let mut make = || {
                    let mut c = Command::new(&exe);
                    c.args([
                        test.as_str(),
                        "--exact",
                        "--ignored",
                        "--nocapture",
                        "--test-threads=1",
                    ])
                    .env(super::common::ROLE_ENV, "served")
                    .env(SOCKET_ENV, &socket)
                    .stdout(std::process::Stdio::null());
                    c
                };
                let exit = keeper.supervise(&mut make, &stop, &upgrade, &mut |e| {
                    let _ = tx.send(e);
                });
                (exit.unwrap(), keeper.names().len())
            })
        };
        let (serving, _) = next_ready(&events, 0);
        Kept {
            _dir: dir,
            socket,
            serving,
            events,
            stop: Stopper {
                flag: stop,
                keeping,
            },
            upgrade,
        }
    }
}

/// The test's side of the rounds.
struct Run {
    test: String,
    socket: PathBuf,
    /// The serving process now.
    serving: u32,
    events: mpsc::Receiver<KeeperEvent>,
    rng: Rng,
    /// The seed of the version served (0: none yet; version n holds seed n).
    committed: u32,
    /// The load rounds' checkpoint.
    checkpoint: PathBuf,
    /// Load rounds whose set the next process served (the others were
    /// cut short by the kill).
    loads_kept: u32,
}

impl Run {
    fn spawn(&self, role: &str, seed: u32) -> Peer {
        Peer::spawn_with(&self.test, role, |c| {
            c.env(SOCKET_ENV, &self.socket)
                .env(SEED_ENV, seed.to_string());
        })
    }

    /// A load of the checkpoint as the set [`LOADED`], the serving process
    /// killed at a random point of it, or (one time in three) once it was
    /// answered; whether the load was answered.
    fn load_killed(&mut self) -> bool {
        let (socket, path) = (self.socket.clone(), self.checkpoint.clone());
        let call = std::thread::spawn(move || {
            let c = Client::connect(&socket, ClientConfig::default()).map_err(|e| e.to_string())?;
            let body = json!({"set": LOADED, "path": path.display().to_string()});
            c.call_within("load", &body, Duration::from_secs(60))
                .map_err(|e| e.to_string())
        });
        if self.rng.below(3) == 0 {
            let answered = call.join().unwrap();
            assert!(answered.is_ok(), "a load: {answered:?}");
            self.kill();
            return true;
        }
        std::thread::sleep(Duration::from_micros(self.rng.below(20_000)));
        self.kill();
        call.join().unwrap().is_ok()
    }

    /// After a load round: a load answered was kept; a set loaded holds
    /// every byte of the checkpoint (a fresh reader checks), and is dropped
    /// for the next load.
    fn check_loaded(&mut self, round: u32, sets: &[admin::SetRow], answered: bool) {
        let Some(row) = sets.iter().find(|s| s.name == LOADED) else {
            assert!(
                !answered,
                "round {round}: a load answered before the kill was lost"
            );
            return;
        };
        self.loads_kept += 1;
        let got = Peer::spawn_with(&self.test, "reader", |c| {
            c.env(SOCKET_ENV, &self.socket)
                .env(SEED_ENV, LOAD_SEED.to_string())
                .env(SET_ENV, LOADED);
        })
        .recv();
        assert_ok!(
            &got,
            "round {round}: the loaded set, version {}",
            row.version
        );
        let c = Client::connect(&self.socket, ClientConfig::default()).unwrap();
        c.call_within(
            "drop",
            &json!({"set": LOADED, "force": true}),
            Duration::from_secs(30),
        )
        .unwrap();
    }

    fn kill(&self) {
        rustix::process::kill_process(
            rustix::process::Pid::from_raw(self.serving as i32).unwrap(),
            rustix::process::Signal::KILL,
        )
        .unwrap();
    }

    /// One round: a writer or a reader, the serving process killed at a
    /// random point, the next one checked. Returns the kind of round and
    /// how long the next process took to serve after its start.
    fn round(&mut self, round: u32) -> (usize, Duration) {
        let next = self.committed + 1;
        let kind = self.rng.below(5) as usize;
        let mut answered = None;
        let mut asked_commit = false;
        let mut load_answered = None;
        if kind == 4 {
            load_answered = Some(self.load_killed());
        } else if kind <= 2 {
            // During a write (0), between a commit and its answer (1), after it (2).
            let mut w = self.spawn("writer", next);
            let filled = w.recv();
            assert_ok!(&filled, "round {round}: the writer of seed {next}");
            if kind >= 1 {
                w.send(&json!("commit"));
                asked_commit = true;
                if kind == 2 {
                    let done = w.recv();
                    assert_ok!(&done, "round {round}: the commit of seed {next}");
                    answered = Some(done["version"].as_u64().unwrap());
                } else {
                    std::thread::sleep(Duration::from_micros(self.rng.below(3000)));
                }
            }
            self.kill();
            drop(w);
        } else {
            // During a reader's attach.
            let r = (self.committed > 0).then(|| self.spawn("reader", self.committed));
            std::thread::sleep(Duration::from_millis(self.rng.below(400)));
            self.kill();
            drop(r);
        }
        // A client that connects while no process serves waits for the
        // next one (the keeper holds the listening socket): never refused.
        wait_gone(self.serving);
        if let Err(e) = ls(&self.socket) {
            panic!("round {round}: a client that connected while no process served: {e}");
        }
        let (pid, after) = next_ready(&self.events, self.serving);
        self.serving = pid;
        let sets = ls(&self.socket)
            .expect("the restarted service answers ls")
            .sets;
        let version = sets.iter().find(|s| s.name == SET).map_or(0, |s| s.version);
        if let Some(v) = answered {
            assert_eq!(
                version, v,
                "round {round}: a commit answered with version {v} was lost"
            );
        }
        let version = u32::try_from(version).unwrap();
        if asked_commit && answered.is_none() {
            assert!(
                version == self.committed || version == next,
                "round {round}: version {version}, neither the last committed ({}) nor the one \
                 whose answer was lost",
                self.committed
            );
        } else {
            let want = if answered.is_some() {
                next
            } else {
                self.committed
            };
            assert_eq!(version, want, "round {round}");
        }
        self.committed = version;
        if let Some(answered) = load_answered {
            self.check_loaded(round, &sets, answered);
        }
        if version > 0 {
            let got = self.spawn("reader", version).recv();
            assert_ok!(&got, "round {round}: a fresh reader of version {version}");
            assert_eq!(got["read_only"], true);
        }
        (kind, after)
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn the_service_serves_the_last_committed_version_after_every_kill() {
    let test = test_name!("the_service_serves_the_last_committed_version_after_every_kill");
    kill_rounds(&test, 200, false);
}

/// The same with a standby serving process started ahead, which takes
/// over when the serving one is killed (half the rounds).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_standby_takes_over_with_the_last_committed_version_after_every_kill() {
    let test = test_name!("a_standby_takes_over_with_the_last_committed_version_after_every_kill");
    kill_rounds(&test, 100, true);
}

/// Runs `rounds` kill rounds (`CUDA_IPC_KILL_ROUNDS` instead, if set)
/// under a keeper, with a standby or not (see the module docs).
fn kill_rounds(test: &str, rounds: u32, standby: bool) {
    match role().as_deref() {
        Some("served") => return served(),
        Some("writer") => return writer(),
        Some("reader") => return reader(),
        _ => {}
    }
    let test = test.to_string();
    let rounds: u32 = std::env::var(ROUNDS_ENV)
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(rounds);
    let seed0 = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    println!("kill rounds: {rounds}, standby: {standby}, random seed {seed0}");
    let device = Device::open(0).unwrap();
    let free_before = free_memory(&device);
    let fds_before = open_fds();
    let kept = Kept::start(&test, standby);
    let (socket, serving, events) = (kept.socket.clone(), kept.serving, kept.events);
    let mut run = Run {
        test: test.clone(),
        socket: socket.clone(),
        serving,
        events,
        rng: Rng(seed0),
        committed: 0,
        checkpoint: kept.socket.with_file_name("load.safetensors"),
        loads_kept: 0,
    };
    write_load_checkpoint(&run.checkpoint);
    let mut takeovers = Vec::new();
    let mut kinds = [0u32; 5];
    for round in 0..rounds {
        let (kind, after) = run.round(round);
        kinds[kind] += 1;
        takeovers.push(after);
    }
    let (committed, loads_kept) = (run.committed, run.loads_kept);
    kept.stop.stop();
    takeovers.sort();
    let p = |q: f64| takeovers[((takeovers.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e3;
    println!(
        "survived {rounds} kills (writes {}, commits before their answer {}, after {}, attaches {}, \
         loads {}, of which {loads_kept} finished first); last version {committed}; serving again \
         after its start: p50 {:.1} ms, max {:.1} ms",
        kinds[0],
        kinds[1],
        kinds[2],
        kinds[3],
        kinds[4],
        p(0.5),
        p(1.0)
    );
    let started = Instant::now();
    let mut free_after = free_memory(&device);
    while free_after < free_before && started.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(100));
        free_after = free_memory(&device);
    }
    assert!(
        free_after >= free_before,
        "device memory: {free_before} free before, {free_after} after"
    );
    assert_eq!(open_fds(), fds_before, "descriptors of the test process");
    let _ = device.memory_info();
}
