//! The channel's share of a hand-off on the CPU alone, with the server's
//! reader spin off and on ([`ServerConfig::spin`]), on both notice paths.
//! Server and client run in this one process, on separate threads, as two
//! processes would (every message crosses the kernel or the shared
//! mapping the same way).
//!
//! Rows (each sample is one operation, timed by the client):
//! - *ping*: `Client::ping`, back to back.
//! - *attach (lone)*: `Client::attach` of a plain entry with one memfd,
//!   100 µs after the last request (longer than the default spin, so the
//!   server's reader is asleep when it comes).
//! - *release (follows)*: `Client::release` of that lease, sent as soon as
//!   the attach's answer came (the server's reader may still be spinning).
//! - *update one-way*: `Server::update` to `Client::next_update`, the next
//!   update 20 µs after the client took the last one.
//! - *frame round trip*: a one-slot ring, `publish`, the client's
//!   `next_frame` and `ack`, until `acquire` returns the slot again.
//! - *ring flat out*: a ring of 64 slots, frames published as fast as
//!   slots come back, each notice shaped as a GPU ring's (an event handle
//!   in hex, a fence number, a time stamp), the client taking and acking
//!   each; a sample is the time from one publish to the next, so its mean
//!   is one over the frames per second the channel alone carries.
//! - *fresh hand-off*: the bench's fresh hand-off without the GPU:
//!   `Server::publish` of a new entry (one memfd), its name written into
//!   a pipe that a consumer thread sleeps on, and that thread's
//!   `Client::attach` answered; from before the publish to the answer.
//!   The next one comes 100 µs after the consumer said it released.
//! - *attach after 1 ms / 5 ms asleep* and *fresh hand-off after 1 ms
//!   asleep*: as above, but every thread sleeps between operations (the
//!   gap is a `sleep`, not a busy wait), as the bench's processes do
//!   between samples, with a tenth of the samples. On a virtual machine
//!   an idle virtual CPU may halt; waking one costs what these rows add
//!   to the ones above.
//! - *connect after 1 ms asleep*: `Client::connect` on a new connection
//!   (the handshake, the rings), every thread having slept 1 ms; *connect
//!   and first attach*: from before the connect to the answer of an attach
//!   sent right after it, as a fresh subscriber's first attach goes.
//!
//! Each row also gives the process's CPU time per operation (both sides,
//! `CLOCK_PROCESS_CPUTIME_ID`), the price of the spins, and its threads'
//! sleeps per operation (voluntary context switches, `getrusage`): each
//! is a thread wake-up on the path, or a spin that gave up.
//!
//! Run with `cargo bench -p cuda-ipc-channel --bench handoff_latency --
//! [iterations per batch] [batches] [rows] [configurations]`,
//! `rows` a piece of the names of the rows to measure and `configurations`
//! of the configurations' (all by default). The
//! configurations take turns batch by batch; compare them within one run.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cuda_ipc_channel::{
    ChannelError, Client, ClientConfig, Notice, NoticePath, Server, ServerConfig,
};
use rustix::time::{ClockId, clock_gettime};
use serde_json::json;

/// One configuration: the notice path and the server's spin.
#[derive(Clone, Copy)]
struct Setup {
    path: NoticePath,
    spin: Duration,
}

impl Setup {
    fn name(self) -> String {
        format!("{:?}, server spin {} µs", self.path, self.spin.as_micros())
    }

    fn server(self, sock: &std::path::Path) -> Result<Server, ChannelError> {
        Server::bind(
            ServerConfig::new(sock)
                .with_notices(self.path)
                .with_spin(self.spin),
        )
    }

    fn client(self, sock: &std::path::Path) -> Result<Client, ChannelError> {
        Client::connect(sock, ClientConfig::default().with_notices(self.path))
    }
}

/// The samples of one batch (ns), the process CPU time it took (ns) and
/// the times a thread of the process went to sleep meanwhile.
struct Batch {
    ns: Vec<u64>,
    cpu: u64,
    sleeps: u64,
}

/// The process's CPU time (ns) and its threads' voluntary context
/// switches (each a sleep, so each a wake-up to come), those of threads
/// that ended included.
fn cpu_now() -> (u64, u64) {
    let t = clock_gettime(ClockId::ProcessCPUTime);
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes a whole `rusage` into the pointer we own;
    // zeroed is a valid `rusage` whatever it does.
    #[allow(unsafe_code)]
    let usage = unsafe {
        libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr());
        usage.assume_init()
    };
    (
        t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64,
        usage.ru_nvcsw as u64,
    )
}

/// A batch's samples, with what the process used since `start`, less
/// `paused` ns of CPU (the program's own busy waits).
fn batch(ns: Vec<u64>, start: (u64, u64), paused: u64, share: u64) -> Batch {
    let (cpu, sleeps) = cpu_now();
    Batch {
        ns,
        cpu: (cpu - start.0).saturating_sub(paused) / share,
        sleeps: (sleeps - start.1) / share,
    }
}

fn pause(d: Duration) {
    let since = Instant::now();
    while since.elapsed() < d {
        std::hint::spin_loop();
    }
}

/// What a thread does between two operations: a busy wait (its CPU stays
/// awake) or a sleep (every thread of the pair may go idle).
#[derive(Clone, Copy)]
enum Gap {
    Spin(Duration),
    Sleep(Duration),
}

impl Gap {
    fn wait(self) {
        match self {
            Gap::Spin(d) => pause(d),
            Gap::Sleep(d) => std::thread::sleep(d),
        }
    }

    /// The CPU time (ns) the wait itself burns.
    fn burnt(self) -> u64 {
        match self {
            Gap::Spin(d) => d.as_nanos() as u64,
            Gap::Sleep(_) => 0,
        }
    }
}

/// The gap before the lone attach and the fresh hand-off of the rows
/// above the asleep ones.
const SHORT_GAP: Gap = Gap::Spin(Duration::from_micros(100));

fn memfd() -> std::os::fd::OwnedFd {
    let fd =
        rustix::fs::memfd_create("handoff", rustix::fs::MemfdFlags::CLOEXEC).expect("memfd_create");
    rustix::fs::ftruncate(&fd, 4096).expect("ftruncate");
    fd
}

/// Ping, then attach and release: three rows from one connection.
fn requests(setup: Setup, n: usize, sock: &std::path::Path) -> Result<[Batch; 3], ChannelError> {
    let server = setup.server(sock)?;
    server.publish("e", json!({"bytes": 4096}), vec![memfd()])?;
    let client = setup.client(sock)?;
    let mut ping = Vec::with_capacity(n);
    let start = cpu_now();
    for _ in 0..n {
        let t = Instant::now();
        client.ping()?;
        ping.push(t.elapsed().as_nanos() as u64);
    }
    let ping = batch(ping, start, 0, 1);
    let [attach, release] = attaches(&client, n, SHORT_GAP)?;
    Ok([ping, attach, release])
}

/// `n` attaches of the entry `e`, each `gap` after the last
/// release, and their releases, sent as soon as the answer came.
fn attaches(client: &Client, n: usize, gap: Gap) -> Result<[Batch; 2], ChannelError> {
    let (mut attach, mut release) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let start = cpu_now();
    for _ in 0..n {
        gap.wait();
        let t = Instant::now();
        let a = client.attach("e")?;
        let t1 = Instant::now();
        client.release(a.lease)?;
        let t2 = Instant::now();
        attach.push((t1 - t).as_nanos() as u64);
        release.push((t2 - t1).as_nanos() as u64);
    }
    // Half the pair's CPU and sleeps to each, less the busy waits.
    Ok(two_rows(attach, release, start, n as u64 * gap.burnt(), 2))
}

/// Two rows timed over the same operations, each given the process's CPU
/// and sleeps since `start` (less `burnt` ns of busy waits) over `share`.
fn two_rows(
    first: Vec<u64>,
    second: Vec<u64>,
    start: (u64, u64),
    burnt: u64,
    share: u64,
) -> [Batch; 2] {
    let first = batch(first, start, burnt, share);
    let second = Batch {
        ns: second,
        cpu: first.cpu,
        sleeps: first.sleeps,
    };
    [first, second]
}

/// Lone attaches after the client slept `gap`, on a fresh connection.
fn asleep(setup: Setup, n: usize, sock: &std::path::Path, gap: Gap) -> Result<Batch, ChannelError> {
    let server = setup.server(sock)?;
    server.publish("e", json!({"bytes": 4096}), vec![memfd()])?;
    let client = setup.client(sock)?;
    let [attach, _] = attaches(&client, n, gap)?;
    Ok(attach)
}

/// New connections, each after every thread slept `gap` (the server's
/// accept thread and its connection threads idle): `[connect, connect and
/// first attach]`, the second from before the connect to the answer of an
/// attach sent right after it, as a fresh subscriber's first attach goes.
fn connects(
    setup: Setup,
    n: usize,
    sock: &std::path::Path,
    gap: Gap,
) -> Result<[Batch; 2], ChannelError> {
    let server = setup.server(sock)?;
    server.publish("e", json!({"bytes": 4096}), vec![memfd()])?;
    let (mut connect, mut first) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let start = cpu_now();
    for _ in 0..n {
        gap.wait();
        let t = Instant::now();
        let client = setup.client(sock)?;
        let t1 = Instant::now();
        let a = client.attach("e")?;
        let t2 = Instant::now();
        client.release(a.lease)?;
        connect.push((t1 - t).as_nanos() as u64);
        first.push((t2 - t).as_nanos() as u64);
    }
    Ok(two_rows(connect, first, start, n as u64 * gap.burnt(), 1))
}

fn updates(setup: Setup, n: usize, sock: &std::path::Path) -> Result<Batch, ChannelError> {
    let server = setup.server(sock)?;
    server.publish("e", json!({}), vec![])?;
    let client = setup.client(sock)?;
    client.attach("e")?;
    let base = Instant::now();
    let taken = Arc::new(AtomicU64::new(0));
    let start = cpu_now();
    let reader = {
        let taken = Arc::clone(&taken);
        std::thread::spawn(move || -> Result<Vec<u64>, ChannelError> {
            let mut lat = Vec::with_capacity(n);
            for _ in 0..n {
                let u = client.next_update(Duration::from_secs(10))?;
                let now = base.elapsed().as_nanos() as u64;
                if let Notice::Updated { data, .. } = u.notice {
                    lat.push(now.saturating_sub(data.as_u64().unwrap_or(now)));
                }
                taken.store(now, Ordering::Release);
            }
            Ok(lat)
        })
    };
    for i in 0..n {
        if i > 0 {
            while taken.load(Ordering::Acquire) == 0 {
                std::hint::spin_loop();
            }
        }
        pause(Duration::from_micros(20));
        taken.store(0, Ordering::Release);
        server.update("e", json!(base.elapsed().as_nanos() as u64))?;
    }
    let ns = reader.join().expect("the reader thread panicked")?;
    // The producer's waits are busy loops of this program's own: its CPU
    // is counted (at least the 20 µs pauses).
    Ok(batch(ns, start, 0, 1))
}

/// A ring of `slots` slots on a server of `setup`, and a thread of a
/// client subscribed to it that takes and acks `n` frames.
type RingRun = (
    Server,
    cuda_ipc_channel::ServerRing,
    std::thread::JoinHandle<Result<(), ChannelError>>,
);

fn ring_with_reader(
    setup: Setup,
    sock: &std::path::Path,
    slots: usize,
    n: usize,
) -> Result<RingRun, ChannelError> {
    let server = setup.server(sock)?;
    let slots = (0..slots).map(|_| (json!({}), vec![])).collect();
    let ring = server.create_ring("r", json!({}), slots)?;
    let client = setup.client(sock)?;
    let sub = client.attach_ring("r")?;
    let reader = std::thread::spawn(move || -> Result<(), ChannelError> {
        for _ in 0..n {
            let f = client.next_frame(sub.lease, Duration::from_secs(10))?;
            client.ack(sub.lease, f.slot, f.seq)?;
        }
        Ok(())
    });
    Ok((server, ring, reader))
}

fn frames(setup: Setup, n: usize, sock: &std::path::Path) -> Result<Batch, ChannelError> {
    let (_server, ring, subscriber) = ring_with_reader(setup, sock, 1, n)?;
    let start = cpu_now();
    let mut ns = Vec::with_capacity(n);
    let mut slot = ring.acquire(None)?;
    for i in 0..n {
        let t0 = Instant::now();
        ring.publish(slot, json!(i))?;
        slot = ring.acquire(Some(Duration::from_secs(10)))?;
        ns.push(t0.elapsed().as_nanos() as u64);
    }
    subscriber.join().expect("the subscriber thread panicked")?;
    Ok(batch(ns, start, 0, 1))
}

/// Slots of the ring flat out, as the bench's ring of 4 KiB frames.
const FLAT_OUT_SLOTS: usize = 64;

fn flat_out(setup: Setup, n: usize, sock: &std::path::Path) -> Result<Batch, ChannelError> {
    let (_server, ring, subscriber) = ring_with_reader(setup, sock, FLAT_OUT_SLOTS, n)?;
    let start = cpu_now();
    // An event handle is 64 bytes, sent in hex.
    let event = "ab".repeat(64);
    let base = Instant::now();
    let mut ns = Vec::with_capacity(n);
    let mut last = Instant::now();
    for i in 0..n {
        let slot = ring.acquire(Some(Duration::from_secs(10)))?;
        let t = base.elapsed().as_nanos() as u64;
        ring.publish(
            slot,
            json!({ "event": event, "fence_seq": i + 1, "t": t, "p": 0 }),
        )?;
        let now = Instant::now();
        ns.push((now - last).as_nanos() as u64);
        last = now;
    }
    subscriber.join().expect("the subscriber thread panicked")?;
    Ok(batch(ns, start, 0, 1))
}

fn io(context: &str) -> impl FnOnce(rustix::io::Errno) -> ChannelError + '_ {
    move |e| ChannelError::Io {
        context: context.into(),
        source: e.into(),
    }
}

/// Reads exactly 8 bytes (a blocking read: the thread sleeps).
fn read_word(fd: &std::os::fd::OwnedFd) -> Result<u64, ChannelError> {
    let mut b = [0u8; 8];
    let mut got = 0;
    while got < 8 {
        let n = rustix::io::read(fd, &mut b[got..]).map_err(io("cannot read the pipe"))?;
        if n == 0 {
            return Err(ChannelError::PeerGone);
        }
        got += n;
    }
    Ok(u64::from_ne_bytes(b))
}

fn write_word(fd: &std::os::fd::OwnedFd, v: u64) -> Result<(), ChannelError> {
    let n = rustix::io::write(fd, &v.to_ne_bytes()).map_err(io("cannot write the pipe"))?;
    assert_eq!(n, 8, "a pipe write of 8 bytes is whole");
    Ok(())
}

/// Publish, the name through a pipe to a sleeping consumer thread, its
/// attach answered (see the module's documentation).
fn fresh(setup: Setup, n: usize, sock: &std::path::Path, gap: Gap) -> Result<Batch, ChannelError> {
    let server = setup.server(sock)?;
    let client = setup.client(sock)?;
    // The consumer has attached before, as the bench's has.
    server.publish("warm", json!({}), vec![memfd()])?;
    let a = client.attach("warm")?;
    client.release(a.lease)?;
    let (tell_rx, tell_tx) = rustix::pipe::pipe().map_err(io("cannot make a pipe"))?;
    let (done_rx, done_tx) = rustix::pipe::pipe().map_err(io("cannot make a pipe"))?;
    let base = Instant::now();
    let start = cpu_now();
    let consumer = std::thread::spawn(move || -> Result<Vec<u64>, ChannelError> {
        let mut ns = Vec::with_capacity(n);
        for i in 0..n {
            let t0 = read_word(&tell_rx)?;
            let a = client.attach(&format!("f{i}"))?;
            ns.push((base.elapsed().as_nanos() as u64).saturating_sub(t0));
            client.release(a.lease)?;
            write_word(&done_tx, 1)?;
        }
        Ok(ns)
    });
    for i in 0..n {
        let fd = memfd();
        let name = format!("f{i}");
        gap.wait();
        let t0 = base.elapsed().as_nanos() as u64;
        server.publish(&name, json!({"bytes": 4096}), vec![fd])?;
        write_word(&tell_tx, t0)?;
        read_word(&done_rx)?;
        server.unpublish(&name)?;
    }
    let ns = consumer.join().expect("the consumer thread panicked")?;
    // Less the busy waits.
    Ok(batch(ns, start, n as u64 * gap.burnt(), 1))
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i] as f64 / 1000.0
}

/// A row: p50 and p90 over all batches together, the spread of the batch
/// p50s, and CPU µs per operation.
fn report(what: &str, setup: Setup, batches: &mut [Batch]) {
    let mut all = Vec::new();
    let mut p50s = Vec::new();
    let (mut cpu, mut sleeps, mut ops) = (0u64, 0u64, 0u64);
    for b in batches.iter_mut() {
        b.ns.sort_unstable();
        p50s.push(percentile(&b.ns, 0.5));
        all.extend_from_slice(&b.ns);
        cpu += b.cpu;
        sleeps += b.sleeps;
        ops += b.ns.len() as u64;
    }
    all.sort_unstable();
    p50s.sort_by(f64::total_cmp);
    let mean = all.iter().sum::<u64>() as f64 / all.len().max(1) as f64 / 1000.0;
    println!(
        "| {what} | {} | {:.1} | {:.1} | {mean:.1} | {:.1}-{:.1} | {:.1} | {:.2} |",
        setup.name(),
        percentile(&all, 0.5),
        percentile(&all, 0.9),
        p50s[0],
        p50s[p50s.len() - 1],
        cpu as f64 / ops.max(1) as f64 / 1000.0,
        sleeps as f64 / ops.max(1) as f64,
    );
}

fn main() -> Result<(), ChannelError> {
    // `cargo bench` passes `--bench`.
    let mut args = std::env::args().skip(1).filter(|a| a != "--bench");
    let n: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(2_000);
    let batches: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(5);
    let only = args.next();
    let only_setup = args.next();
    let dir = tempfile::tempdir().map_err(|e| ChannelError::Io {
        context: "cannot make a temporary directory".into(),
        source: e,
    })?;
    let spin = cuda_ipc_channel::DEFAULT_SERVER_SPIN;
    let setup = |path, spin| Setup { path, spin };
    let setups: Vec<Setup> = [
        setup(NoticePath::Socket, Duration::ZERO),
        setup(NoticePath::Socket, spin),
        setup(NoticePath::Shm, Duration::ZERO),
        setup(NoticePath::Shm, spin),
    ]
    .into_iter()
    // Configurations whose name holds the fourth argument, if given.
    .filter(|s| only_setup.as_deref().is_none_or(|o| s.name().contains(o)))
    .collect();
    if setups.is_empty() {
        eprintln!("no configuration's name holds {only_setup:?}");
        std::process::exit(2);
    }
    println!(
        "{batches} batches of {n} per row, the {} configurations taking turns; CPU only, one \
         process; p50/p90/mean over all batches, then the range of the batch p50s (µs)\n",
        setups.len()
    );
    println!(
        "| operation | configuration | p50 µs | p90 µs | mean µs | batch p50s µs | CPU µs/op | sleeps/op |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let names = [
        "ping",
        "attach (lone)",
        "release (follows)",
        "update one-way",
        "frame round trip",
        "ring flat out",
        "fresh hand-off",
        "attach after 1 ms asleep",
        "attach after 5 ms asleep",
        "fresh hand-off after 1 ms asleep",
        "connect after 1 ms asleep",
        "connect and first attach after 1 ms asleep",
    ];
    // Rows whose name holds the third argument, if given (all by default).
    let wanted = |r: usize| only.as_deref().is_none_or(|o| names[r].contains(o));
    // [setup][row][batch]
    let mut rows: Vec<[Vec<Batch>; 12]> = setups.iter().map(|_| Default::default()).collect();
    let few = (n / 10).max(1);
    let ms = Duration::from_millis;
    for b in 0..batches {
        for (i, setup) in setups.iter().enumerate() {
            let sock = |tag: &str| dir.path().join(format!("{tag}{b}-{i}.sock"));
            if (0..3).any(wanted) {
                let [ping, attach, release] = requests(*setup, n, &sock("s"))?;
                rows[i][0].push(ping);
                rows[i][1].push(attach);
                rows[i][2].push(release);
            }
            if wanted(3) {
                rows[i][3].push(updates(*setup, n, &sock("u"))?);
            }
            if wanted(4) {
                rows[i][4].push(frames(*setup, n, &sock("f"))?);
            }
            if wanted(5) {
                rows[i][5].push(flat_out(*setup, n, &sock("r"))?);
            }
            if wanted(6) {
                rows[i][6].push(fresh(*setup, n, &sock("h"), SHORT_GAP)?);
            }
            if wanted(7) {
                rows[i][7].push(asleep(*setup, few, &sock("a"), Gap::Sleep(ms(1)))?);
            }
            if wanted(8) {
                rows[i][8].push(asleep(*setup, few, &sock("b"), Gap::Sleep(ms(5)))?);
            }
            if wanted(9) {
                rows[i][9].push(fresh(*setup, few, &sock("g"), Gap::Sleep(ms(1)))?);
            }
            if wanted(10) || wanted(11) {
                let [connect, first] = connects(*setup, few, &sock("c"), Gap::Sleep(ms(1)))?;
                rows[i][10].push(connect);
                rows[i][11].push(first);
            }
        }
    }
    for (r, name) in names.iter().enumerate() {
        if !wanted(r) {
            continue;
        }
        for (i, setup) in setups.iter().enumerate() {
            report(name, *setup, &mut rows[i][r]);
        }
    }
    Ok(())
}
