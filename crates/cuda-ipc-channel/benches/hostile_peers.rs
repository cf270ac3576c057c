//! Measures what hostile clients cost a channel server: for each attack,
//! 256 hostile connections (4 processes of 64), the server's resident
//! memory and open descriptors above its baseline during the attack and
//! after the attackers leave, a legitimate client's attach latency
//! (attach + release; the lowest median of 8 batches of 50) and ring
//! subscription latency (attach_ring of a 64-slot ring + release; the
//! lowest median of 16 batches of 10) during the attack against unloaded,
//! measured right before it, and the frames a legitimate ring subscriber
//! that acks every frame receives in half a second.
//!
//! The server publishes a 64-slot ring whose producer publishes a frame
//! about every millisecond, with the ring's defaults: no ack deadline,
//! the default stall budget (another user's subscribers that hold the
//! producer up past their share are skipped, then evicted).
//!
//! ```text
//! cargo bench -p cuda-ipc-channel --bench hostile_peers
//! ```
//!
//! The server runs in a child process with the default configuration, and
//! gives the free memory its allocator keeps back to the system twice a
//! second (`malloc_trim`) and keeps no stacks of exited threads (glibc's
//! `stack_cache_size` tunable at 0). Its resident memory is shown; what
//! is bounded is the memory its allocations hold (glibc's `mallinfo2`,
//! which the server writes next to its socket every 100 ms), since glibc
//! keeps arenas of the threads that served each attack's connections
//! and gives back only part of them. Run
//! as root, the attackers run as another user (uid 65534, which the server
//! also allows), the way a hostile peer on a shared machine would; else as
//! this user (then the per-user budgets, which bound what one user costs
//! the others, do not apply: the ring attacks stall the legitimate
//! subscriber). Prints a Markdown table, then a line per attack that broke
//! a bound: a legitimate attach + release or ring subscription over twice
//! its unloaded time, the server's threads or descriptors not back to
//! their baseline after the attack, or its allocations holding more than
//! 1 MiB above what they held before it. `HOSTILE_ONLY=calls` (a list of
//! attack names, comma-separated) runs only those.
//!
//! The server answers calls as a weight service refuses them: each call's
//! body quoted back in a `not_found` error.
//!
//! The `shm-` attacks ask for the shared-memory rings that legitimate
//! clients use for notices, acks and requests (a memfd both sides map, one
//! end each of a wake-up socket pair) and abuse them: scribbling over
//! them, waking the server with nothing to read, filling the request ring,
//! doing the worst to every descriptor they were given. The
//! table also gives the server's processor time during the legitimate
//! measurements (all its threads, from `/proc/PID/task/*/schedstat`), as a
//! share of one core, against the same unloaded.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cuda_ipc_channel::wire::{HEADER_LEN, Message, PROTOCOL_VERSION};
use cuda_ipc_channel::{
    CallError, CallHandler, Client, ClientConfig, NOTICE_RING_BYTES, Server, ServerConfig,
};
use serde_json::json;

/// Prints a line to stdout; exits quietly when stdout is gone (`| head`),
/// removing the measurement's directory first (the server and attackers
/// exit when their stdin closes with us).
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if writeln!(std::io::stdout(), $($arg)*).is_err() {
            if let Some(dir) = SCRATCH.lock().ok().and_then(|mut d| d.take()) {
                let _ = std::fs::remove_dir_all(dir);
            }
            std::process::exit(0);
        }
    }};
}

/// The measurement's directory, removed on a quiet early exit.
static SCRATCH: std::sync::Mutex<Option<PathBuf>> = std::sync::Mutex::new(None);

/// The slots of the server's ring.
const RING_SLOTS: usize = 64;

const OTHER_UID: u32 = 65534;
const PROCESSES: usize = 4;
const PER_PROCESS: usize = 64;

/// The attacks, by name, with what each connection does.
const ATTACKS: &[(&str, &str)] = &[
    ("no-read", "sends 400 attaches and reads nothing"),
    (
        "not-found",
        "sends 2,000 attaches of missing 256-byte names, reads nothing",
    ),
    ("big-request", "announces a 1 MiB request and sends it"),
    ("idle", "says hello, then nothing"),
    ("half-written", "sends 10 bytes of a header, then nothing"),
    (
        "leases",
        "takes leases up to its limit (reading every answer)",
    ),
    (
        "cut-off",
        "leaves 17 attaches unread, is cut off, keeps its socket; reconnects once cut off",
    ),
    (
        "ring-no-read",
        "subscribes to the 64-slot ring and reads nothing",
    ),
    (
        "ring-no-ack",
        "subscribes to the ring, reads every frame, acks none",
    ),
    ("trickle", "sends a request one byte a second"),
    (
        "calls",
        "sends 2,000 calls naming missing 256-byte sets (a service's refusal each), reads nothing",
    ),
    (
        "shm-scribble",
        "takes the shared-memory rings, then every millisecond writes 64 random bytes over them \
         and wakes the server",
    ),
    (
        "shm-wake-flood",
        "takes the shared-memory rings and wakes the server through its eventfd every \
         millisecond, writing nothing",
    ),
    (
        "shm-requests",
        "takes the rings with requests through them, fills its ring with attaches, reads nothing",
    ),
    (
        "shm-freeze",
        "takes the rings, clears O_NONBLOCK on every descriptor, shrinks its wake-up buffer, \
         subscribes to the ring, claims to sleep for ever, pings through its ring, floods the \
         server's wake-up end, reads nothing",
    ),
    (
        "ring-laggard",
        "subscribes to the ring, reads every frame, acks one in 25, subscribes again when dropped",
    ),
    (
        "ack-flood",
        "subscribes to the ring, then sends acks as fast as the socket takes them, reads nothing",
    ),
];

/// Whether an attack takes the shared-memory rings (the others say
/// hello without them).
fn takes_rings(kind: &str) -> bool {
    kind.starts_with("shm-")
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("--serve") => serve(Path::new(&args[2])),
        Some("--attack") => attack(&args[2], Path::new(&args[3])),
        _ => measure(),
    }
}

/// The server: publishes one entry with two descriptors and serves until
/// stdin closes.
fn serve(path: &Path) {
    let mut config = ServerConfig::new(path);
    config.allowed_uids.push(OTHER_UID);
    config.call_handler = Some(CallHandler::new(|_, method, body| {
        Err(CallError::new(
            "not_found",
            format!("{method}: the service holds no set {body}"),
        ))
    }));
    let server = Server::bind(config).expect("bind");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)).expect("chmod");
    server
        .publish("e", json!({"len": 4}), vec![memfd(b"abcd"), memfd(b"efgh")])
        .expect("publish");
    let slots = (0..RING_SLOTS)
        .map(|i| (json!({ "slot": i }), vec![memfd(&[i as u8; 16])]))
        .collect();
    let ring = server.create_ring("r", json!(null), slots).expect("ring");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let producer = {
        let stop = std::sync::Arc::clone(&stop);
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok(slot) = ring.acquire(Some(Duration::from_millis(100))) {
                    let _ = ring.publish(slot, json!(null));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    // What the allocator keeps of freed memory for reuse (glibc keeps an
    // arena per thread, and each attack's 256 connections run on threads
    // of their own) is given back to the system twice a second, so that
    // the resident memory is near what the server holds; and the bytes
    // the server's allocations hold (whatever arenas keep besides) go to
    // a file next to the socket every 100 ms, which is where a leak shows.
    let heap_file = heap_file(path);
    std::thread::spawn(move || {
        for tick in 0u64.. {
            std::thread::sleep(Duration::from_millis(100));
            if tick % 5 == 4 {
                // SAFETY: malloc_trim only returns free memory of glibc's
                // arenas to the system; it is safe to call from any thread.
                unsafe {
                    libc::malloc_trim(0);
                }
            }
            // SAFETY: mallinfo2 only reads the allocator's statistics; it
            // is safe to call from any thread.
            let info = unsafe { libc::mallinfo2() };
            let tmp = heap_file.with_extension("heap.tmp");
            let held = info.uordblks + info.hblkhd;
            if std::fs::write(&tmp, held.to_string()).is_ok() {
                let _ = std::fs::rename(&tmp, &heap_file);
            }
        }
    });
    out!("READY");
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = producer.join();
}

fn memfd(bytes: &[u8]) -> OwnedFd {
    let fd =
        rustix::fs::memfd_create("hostile-peers", rustix::fs::MemfdFlags::CLOEXEC).expect("memfd");
    rustix::io::write(&fd, bytes).expect("write");
    fd
}

fn header(len: u32) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..4].copy_from_slice(b"CIPC");
    h[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    h[6..8].copy_from_slice(&1u16.to_le_bytes());
    h[8..12].copy_from_slice(&len.to_le_bytes());
    h
}

fn frame(m: &Message) -> Vec<u8> {
    let payload = m.encode();
    let mut f = header(payload.len() as u32).to_vec();
    f.extend_from_slice(&payload);
    f
}

/// Reads one whole wire message (and drops any descriptors with it).
fn read_message(s: &UnixStream) -> Option<Message> {
    read_message_with_fds(s).map(|(m, _)| m)
}

/// One attacker process: opens its connections, attacks, reports, and
/// holds everything until stdin closes.
fn attack(kind: &str, path: &Path) {
    let hello = frame(&Message::Hello {
        protocol: PROTOCOL_VERSION,
        pid: std::process::id(),
        shm_notices: takes_rings(kind),
        shm_requests: takes_rings(kind),
    });
    if takes_rings(kind) {
        return ring_attack(kind, path, &hello);
    }
    if kind == "ring-laggard" {
        return laggards(path);
    }
    let mut conns = Vec::new();
    for _ in 0..PER_PROCESS {
        let Ok(mut s) = UnixStream::connect(path) else {
            continue;
        };
        s.set_write_timeout(Some(Duration::from_millis(200))).ok();
        s.set_read_timeout(Some(Duration::from_secs(2))).ok();
        if kind == "half-written" || kind == "trickle" {
            let _ = s.write_all(&hello[..10]);
            conns.push(s);
            continue;
        }
        if s.write_all(&hello).is_err() {
            continue;
        }
        if let Some(Message::Welcome { .. }) = read_message(&s) {
            conns.push(s);
        }
    }
    let admitted = conns.len();
    let threads: Vec<_> = conns
        .into_iter()
        .map(|s| {
            let kind = kind.to_owned();
            let hello = hello.clone();
            std::thread::spawn(move || assault(&kind, s, &hello))
        })
        .collect();
    let mut conns: Vec<UnixStream> = threads.into_iter().filter_map(|t| t.join().ok()).collect();
    let mut admitted = admitted;
    if kind == "cut-off" {
        admitted += reconnect(path, &hello, &mut conns);
    }
    out!("ATTACKING {admitted}");
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    drop(conns);
}

/// One attacker process of a `shm-` attack: its connections with the
/// rings the server granted, abused as `kind` says until stdin closes.
fn ring_attack(kind: &str, path: &Path, hello: &[u8]) {
    let mut conns: Vec<(UnixStream, Vec<OwnedFd>)> = Vec::new();
    for _ in 0..PER_PROCESS {
        let Ok(mut s) = UnixStream::connect(path) else {
            continue;
        };
        s.set_write_timeout(Some(Duration::from_millis(200))).ok();
        s.set_read_timeout(Some(Duration::from_secs(2))).ok();
        if s.write_all(hello).is_err() {
            continue;
        }
        // The memfd and our end of the wake-up pair.
        if let Some((Message::Welcome { .. }, fds)) = read_message_with_fds(&s)
            && fds.len() == 2
        {
            conns.push((s, fds));
        }
    }
    out!("ATTACKING {}", conns.len());
    // Held until the end: the request rings' ends keep their mappings.
    let mut rings = Vec::new();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut abuser = None;
    if kind == "shm-freeze" {
        for (s, fds) in &conns {
            rings.extend(freeze(s, fds));
        }
    }
    if kind == "shm-requests" {
        for (_, fds) in &conns {
            let Some((mut tx, rx)) = cuda_ipc_shm::Area::open(&fds[0], NOTICE_RING_BYTES)
                .ok()
                .zip(fds[1].try_clone().ok())
                .and_then(|(area, wake)| area.split(cuda_ipc_shm::Side::Opener, wake).ok())
            else {
                continue;
            };
            for id in 0..2000u64 {
                let mut record = 0u64.to_le_bytes().to_vec();
                record.extend(frame(&Message::Attach {
                    id,
                    name: "e".into(),
                }));
                if !matches!(tx.send(&record), Ok(true)) {
                    break;
                }
            }
            rings.push((tx, rx));
        }
    } else {
        let scribble = kind == "shm-scribble";
        let freezing = kind == "shm-freeze";
        let fds: Vec<(OwnedFd, OwnedFd)> = conns
            .iter()
            .filter_map(|(_, f)| Some((f[0].try_clone().ok()?, f[1].try_clone().ok()?)))
            .collect();
        let stop = std::sync::Arc::clone(&stop);
        abuser = Some(std::thread::spawn(move || {
            let mut x = u64::from(std::process::id()) | 1;
            let len = fds
                .first()
                .and_then(|(m, _)| rustix::fs::fstat(m).ok())
                .map_or(0, |st| st.st_size as u64);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for (memfd, wake) in &fds {
                    if scribble && len > 64 {
                        // xorshift64: a different 64 bytes each time.
                        let bytes: Vec<u8> = (0..8)
                            .flat_map(|_| {
                                x ^= x << 13;
                                x ^= x >> 7;
                                x ^= x << 17;
                                x.to_le_bytes()
                            })
                            .collect();
                        let _ = rustix::io::pwrite(memfd, &bytes, x % (len - 64));
                    }
                    if freezing {
                        // Asleep for ever on the notice ring (ring 0's
                        // sleeping flag, its 25th word), so that every
                        // notice sends a wake-up.
                        let _ = rustix::io::pwrite(memfd, &1u64.to_le_bytes(), 24 * 8);
                    }
                    let _ = rustix::net::send(
                        wake,
                        &[1; 64],
                        rustix::net::SendFlags::DONTWAIT | rustix::net::SendFlags::NOSIGNAL,
                    );
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }));
    }
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    if let Some(t) = abuser {
        let _ = t.join();
    }
    drop(rings);
    drop(conns);
}

/// For the `shm-freeze` attack, on one connection granted the rings
/// (`fds`: the memfd, our wake-up end): blocking mode on every
/// descriptor, the smallest receive buffer on the wake-up end, a ring
/// subscription (its frames come through our ring, each with a wake-up
/// while we claim to sleep), and pings through our ring; the ring's ends,
/// to hold until the end.
fn freeze(
    s: &UnixStream,
    fds: &[OwnedFd],
) -> Option<(cuda_ipc_shm::Sender, cuda_ipc_shm::Receiver)> {
    for fd in fds {
        let flags = rustix::fs::fcntl_getfl(fd).ok()?;
        let _ = rustix::fs::fcntl_setfl(fd, flags - rustix::fs::OFlags::NONBLOCK);
    }
    let _ = rustix::net::sockopt::set_socket_recv_buffer_size(&fds[1], 1);
    let _ = (&*s).write_all(&frame(&Message::AttachRing {
        id: 1,
        name: "r".into(),
    }));
    let area = cuda_ipc_shm::Area::open(&fds[0], NOTICE_RING_BYTES).ok()?;
    let (mut tx, rx) = area
        .split(cuda_ipc_shm::Side::Opener, fds[1].try_clone().ok()?)
        .ok()?;
    for id in 0..500 {
        // After the hello and the subscription on the socket.
        let mut record = 2u64.to_le_bytes().to_vec();
        record.extend(frame(&Message::Ping { id }));
        if !matches!(tx.send(&record), Ok(true)) {
            break;
        }
    }
    Some((tx, rx))
}

/// One attacker process of the `ring-laggard` attack: a client per
/// connection, each subscribed to the ring, taking every frame and acking
/// one in 25, subscribing again when skipped or evicted, until stdin
/// closes.
fn laggards(path: &Path) {
    let server_uid = rustix::fs::stat(path).map_or(0, |st| st.st_uid);
    let config = ClientConfig::default().with_allowed_server_uids([server_uid]);
    let clients: Vec<Client> = (0..PER_PROCESS)
        .filter_map(|_| Client::connect(path, config.clone()).ok())
        .collect();
    out!("ATTACKING {}", clients.len());
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let threads: Vec<_> = clients
        .into_iter()
        .map(|client| {
            let stop = std::sync::Arc::clone(&stop);
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let Ok(r) = client.attach_ring("r") else {
                        std::thread::sleep(Duration::from_millis(10));
                        continue;
                    };
                    let mut n = 0u64;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        match client.next_frame(r.lease, Duration::from_millis(50)) {
                            Ok(f) => {
                                n += 1;
                                if n.is_multiple_of(25) {
                                    let _ = client.ack(r.lease, f.slot, f.seq);
                                }
                            }
                            Err(e) if e.kind() == cuda_ipc_channel::ChannelErrorKind::Timeout => {}
                            Err(_) => break,
                        }
                    }
                    let _ = client.release(r.lease);
                }
            })
        })
        .collect();
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for t in threads {
        let _ = t.join();
    }
}

/// Reads one whole wire message with the descriptors that came with it.
fn read_message_with_fds(s: &UnixStream) -> Option<(Message, Vec<OwnedFd>)> {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, recvmsg};
    let mut head = [0u8; HEADER_LEN];
    let mut fds = Vec::new();
    let mut got = 0;
    while got < HEADER_LEN {
        let mut space = vec![
            std::mem::MaybeUninit::<u8>::uninit();
            rustix::cmsg_space!(ScmRights(cuda_ipc_channel::MAX_FDS))
        ];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let n = recvmsg(
            s,
            &mut [std::io::IoSliceMut::new(&mut head[got..])],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        )
        .ok()?
        .bytes;
        for m in control.drain() {
            if let RecvAncillaryMessage::ScmRights(r) = m {
                fds.extend(r);
            }
        }
        if n == 0 {
            return None;
        }
        got += n;
    }
    let len = u32::from_le_bytes([head[8], head[9], head[10], head[11]]) as usize;
    let mut payload = vec![0u8; len];
    (&*s).read_exact(&mut payload).ok()?;
    Some((Message::decode(&payload).ok()?, fds))
}

/// Sends `n` messages made by `message` (ids 0 to n - 1) until one cannot
/// be written, reading nothing.
fn send_all(s: &mut UnixStream, n: u64, message: impl Fn(u64) -> Message) {
    for id in 0..n {
        if s.write_all(&frame(&message(id))).is_err() {
            break;
        }
    }
}

/// What one attacking connection does.
fn assault(kind: &str, mut s: UnixStream, hello: &[u8]) -> UnixStream {
    match kind {
        "no-read" => send_all(&mut s, 400, |id| Message::Attach {
            id,
            name: "e".into(),
        }),
        "not-found" => send_all(&mut s, 2000, |id| Message::Attach {
            id,
            name: format!("{id:0>256}"),
        }),
        "big-request" => {
            let mut m = header(1 << 20).to_vec();
            m.resize(HEADER_LEN + (1 << 20), b' ');
            let _ = s.write_all(&m);
        }
        "calls" => send_all(&mut s, 2000, |id| Message::Call {
            id,
            method: "drop".into(),
            body: json!({ "set": format!("{id:0>256}") }),
        }),
        "cut-off" => send_all(&mut s, 17, |id| Message::Attach {
            id,
            name: "e".into(),
        }),
        "ring-no-read" => {
            let m = frame(&Message::AttachRing {
                id: 1,
                name: "r".into(),
            });
            let _ = s.write_all(&m);
        }
        "ring-no-ack" => {
            let m = frame(&Message::AttachRing {
                id: 1,
                name: "r".into(),
            });
            if s.write_all(&m).is_ok() {
                // Reads every frame (and the slots) for as long
                // as the connection lasts; acks nothing.
                let reader = s.try_clone().expect("clone");
                reader.set_read_timeout(None).ok();
                std::thread::spawn(move || while read_message(&reader).is_some() {});
            }
        }
        "ack-flood" => {
            let m = frame(&Message::AttachRing {
                id: 1,
                name: "r".into(),
            });
            let acks: Vec<u8> = (0..64)
                .flat_map(|i| {
                    frame(&Message::Ack {
                        lease: 1_000 + i,
                        slot: 0,
                        seq: i,
                    })
                })
                .collect();
            if s.write_all(&m).is_ok() {
                let mut w = s.try_clone().expect("clone");
                w.set_write_timeout(None).ok();
                std::thread::spawn(move || while w.write_all(&acks).is_ok() {});
            }
        }
        "trickle" => {
            let mut t = s.try_clone().expect("clone");
            let rest = hello[10..].to_vec();
            std::thread::spawn(move || {
                for b in rest.into_iter().cycle() {
                    if t.write_all(&[b]).is_err() {
                        return;
                    }
                    std::thread::sleep(Duration::from_secs(1));
                }
            });
        }
        "leases" => {
            for chunk in 0..(4096 / 64) as u64 {
                let batch: Vec<u8> = (0..64)
                    .flat_map(|i| {
                        frame(&Message::Attach {
                            id: chunk * 64 + i,
                            name: "e".into(),
                        })
                    })
                    .collect();
                if s.write_all(&batch).is_err() {
                    break;
                }
                for _ in 0..64 {
                    if read_message(&s).is_none() {
                        break;
                    }
                }
            }
        }
        _ => {}
    }
    s
}

/// For the cut-off attack: waits to be cut off (the server's send
/// timeout), keeps the sockets with their unread descriptors, and connects
/// again; how many of the new connections were admitted.
fn reconnect(path: &Path, hello: &[u8], conns: &mut Vec<UnixStream>) -> usize {
    let deadline = Instant::now() + Duration::from_secs(8);
    for s in conns.iter() {
        while !cut_off(s) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let mut admitted = 0;
    for _ in 0..PER_PROCESS {
        let Ok(mut s) = UnixStream::connect(path) else {
            continue;
        };
        s.set_read_timeout(Some(Duration::from_secs(2))).ok();
        if s.write_all(hello).is_ok()
            && let Some(Message::Welcome { .. }) = read_message(&s)
        {
            admitted += 1;
            conns.push(s);
        }
    }
    admitted
}

/// Whether the server has shut its side of `s`.
fn cut_off(s: &UnixStream) -> bool {
    let mut pfd = [rustix::event::PollFd::new(
        s,
        rustix::event::PollFlags::RDHUP,
    )];
    let zero = rustix::event::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    rustix::event::poll(&mut pfd, Some(&zero)).unwrap_or(0) > 0
}

fn spawn(
    exe: &Path,
    args: &[&str],
    as_other: bool,
) -> (Child, BufReader<std::process::ChildStdout>) {
    let mut cmd = Command::new(exe);
    cmd.args(args).stdin(Stdio::piped()).stdout(Stdio::piped());
    if args.first() == Some(&"--serve") {
        // The server keeps no stacks of exited threads for reuse (glibc
        // caches up to 40 MiB of them): its resident memory after an
        // attack is what it holds.
        cmd.env("GLIBC_TUNABLES", "glibc.pthread.stack_cache_size=0");
    }
    if as_other {
        cmd.uid(OTHER_UID).gid(OTHER_UID);
    }
    let mut child = cmd.spawn().expect("spawn");
    let out = BufReader::new(child.stdout.take().expect("stdout"));
    (child, out)
}

fn line(out: &mut BufReader<std::process::ChildStdout>) -> String {
    let mut l = String::new();
    out.read_line(&mut l).expect("read a child's line");
    l
}

/// Where the server at socket `path` writes the bytes its allocations
/// hold.
fn heap_file(path: &Path) -> PathBuf {
    path.with_extension("heap")
}

/// The KiB the server's allocations hold (glibc's `mallinfo2`: in use in
/// every arena, and in blocks of their own), as it last wrote them next
/// to its socket `path`.
fn heap_kib(path: &Path) -> u64 {
    std::fs::read_to_string(heap_file(path))
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .map_or(0, |b| b / 1024)
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// The processor time of process `pid` so far, ns (`/proc/PID/stat`'s
/// user and system time, which keep the time of threads that exited).
fn cpu_ns(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The fields after the command's closing parenthesis, from the
    // state (field 3): utime and stime are fields 14 and 15.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    let field = |n: usize| {
        fields
            .get(n - 3)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let ticks = field(14) + field(15);
    // The kernel's clock ticks are 100 a second on every Linux we run.
    ticks * 10_000_000
}

/// [`legit`], and the server's processor time meanwhile as a share of one
/// core.
fn legit_with_cpu(path: &Path, pid: u32) -> (Legit, f64) {
    let (t0, c0) = (Instant::now(), cpu_ns(pid));
    let l = legit(path);
    let cpu = cpu_ns(pid).saturating_sub(c0) as f64 / 1e9 / t0.elapsed().as_secs_f64();
    (l, cpu)
}

fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count)
}

fn threads(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, Iterator::count)
}

/// The most the memory the server's allocations hold may stay above what
/// it was right before an attack, after it. The resident memory is shown
/// but not bounded: glibc keeps arenas for the threads each attack's
/// connections ran on, and gives back only their free pages at the top,
/// so that a burst of threads leaves resident memory that the next burst
/// reuses (it steps up on the first attacks that use many arenas at once,
/// and stays flat after), which is not memory the server holds.
const HEAP_SLACK_KIB: u64 = 1024;

/// The lowest median, in microseconds, of `batches` batches of `per_batch`
/// round trips of `op` on a new client, each batch after a pause of
/// `pause`, so that bursts of other work on the machine (which this
/// measures nothing about) are left out.
fn best_median(
    path: &Path,
    batches: usize,
    per_batch: usize,
    pause: Duration,
    op: impl Fn(&Client) -> Result<(), cuda_ipc_channel::ChannelError>,
) -> Result<f64, String> {
    let client = Client::connect(path, ClientConfig::default()).map_err(|e| e.to_string())?;
    let mut best = f64::INFINITY;
    for _ in 0..batches {
        std::thread::sleep(pause);
        let mut times = Vec::new();
        for _ in 0..per_batch {
            let t = Instant::now();
            op(&client).map_err(|e| e.to_string())?;
            times.push(t.elapsed().as_secs_f64() * 1e6);
        }
        times.sort_by(f64::total_cmp);
        best = best.min(times[times.len() / 2]);
    }
    Ok(best)
}

/// Attach + release of a legitimate client, in microseconds: the lowest
/// median of 8 batches of 50, spread over a second.
fn attach_latency(path: &Path) -> Result<f64, String> {
    best_median(path, 8, 50, Duration::from_millis(120), |c| {
        c.release(c.attach("e")?.lease)
    })
}

/// attach_ring of the 64-slot ring + release, in microseconds: the lowest
/// median of 16 batches of 10, spread over a second.
fn ring_latency(path: &Path) -> Result<f64, String> {
    best_median(path, 16, 10, Duration::from_millis(60), |c| {
        c.release(c.attach_ring("r")?.lease)
    })
}

/// The frames a subscriber that acks each one receives in half a second.
fn ring_frames(path: &Path) -> Result<u64, String> {
    let client = Client::connect(path, ClientConfig::default()).map_err(|e| e.to_string())?;
    let r = client.attach_ring("r").map_err(|e| e.to_string())?;
    let end = Instant::now() + Duration::from_millis(500);
    let mut n = 0;
    while Instant::now() < end {
        match client.next_frame(r.lease, Duration::from_millis(100)) {
            Ok(f) => {
                client
                    .ack(r.lease, f.slot, f.seq)
                    .map_err(|e| e.to_string())?;
                n += 1;
            }
            Err(e) if e.kind() == cuda_ipc_channel::ChannelErrorKind::Timeout => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    let _ = client.release(r.lease);
    Ok(n)
}

/// The three legitimate measurements.
struct Legit {
    attach: Result<f64, String>,
    ring: Result<f64, String>,
    frames: Result<u64, String>,
}

fn legit(path: &Path) -> Legit {
    Legit {
        attach: attach_latency(path),
        ring: ring_latency(path),
        frames: ring_frames(path),
    }
}

/// What broke a bound in attack `kind`: a legitimate latency during it
/// over twice its unloaded value, or the server's descriptors or threads
/// not back to their baseline after it, or its memory not back to what it
/// was right before it (within [`HEAP_SLACK_KIB`]); each `(after,
/// baseline)`.
fn out_of_bounds(
    kind: &str,
    (during, unloaded): (&Legit, &Legit),
    (fds_after, fds0): (usize, usize),
    (threads_after, threads0): (usize, usize),
    (heap_after, heap0): (u64, u64),
) -> Vec<String> {
    let mut broken = Vec::new();
    for (what, during, unloaded) in [
        ("attach + release", &during.attach, &unloaded.attach),
        ("ring subscription", &during.ring, &unloaded.ring),
    ] {
        match (during, unloaded) {
            (Ok(d), Ok(u)) if *d <= 2.0 * u => {}
            _ => broken.push(format!("{kind}: {what} {}", versus(during, unloaded))),
        }
    }
    if fds_after > fds0 || threads_after > threads0 {
        broken.push(format!(
            "{kind}: {:+} descriptors and {:+} threads after the attack",
            fds_after as i64 - fds0 as i64,
            threads_after as i64 - threads0 as i64
        ));
    }
    if heap_after > heap0 + HEAP_SLACK_KIB {
        broken.push(format!(
            "{kind}: the server's allocations hold {:+.1} MiB more after the attack",
            (heap_after as f64 - heap0 as f64) / 1024.0
        ));
    }
    broken
}

/// "during vs unloaded (ratio)" for one latency.
fn versus(during: &Result<f64, String>, unloaded: &Result<f64, String>) -> String {
    match (during, unloaded) {
        (Ok(d), Ok(u)) => format!("{d:.0} vs {u:.0} us ({:.2}x)", d / u),
        (Err(e), _) => format!("failed: {e}"),
        (_, Err(e)) => format!("unloaded failed: {e}"),
    }
}

/// What the server holds: resident memory (KiB), descriptors, threads.
#[derive(Clone, Copy)]
struct Usage {
    rss_kib: u64,
    heap_kib: u64,
    fds: usize,
    threads: usize,
}

impl Usage {
    fn of(pid: u32, path: &Path) -> Usage {
        Usage {
            rss_kib: rss_kib(pid),
            heap_kib: heap_kib(path),
            fds: fds(pid),
            threads: threads(pid),
        }
    }
}

/// Runs one attack on the server `pid` at `path` (attackers as uid 65534
/// if `root`), prints its row, and returns what broke a bound.
fn one_attack(
    exe: &Path,
    path: &Path,
    pid: u32,
    (kind, what): (&str, &str),
    root: bool,
    base: Usage,
) -> Vec<String> {
    let path_s = path.to_str().expect("utf-8 path");
    // Unloaded again right before, so that both figures see the same
    // machine.
    let (unloaded, cpu_unloaded) = legit_with_cpu(path, pid);
    // What the server holds right before: where its memory must come back to.
    let before = Usage::of(pid, path);
    let mut attackers: Vec<_> = (0..PROCESSES)
        .map(|_| spawn(exe, &["--attack", kind, path_s], root))
        .collect();
    let admitted: usize = attackers
        .iter_mut()
        .map(|(_, out)| {
            line(out)
                .trim()
                .strip_prefix("ATTACKING ")
                .and_then(|n| n.parse::<usize>().ok())
                .unwrap_or(0)
        })
        .sum();
    std::thread::sleep(Duration::from_millis(500));
    let (during, cpu_during) = legit_with_cpu(path, pid);
    let loaded = Usage::of(pid, path);
    for (mut child, _) in attackers.drain(..) {
        drop(child.stdin.take());
        let _ = child.wait();
    }
    // Let the server notice and close what the attackers left.
    let mut after = Usage::of(pid, path);
    let settle = Instant::now() + Duration::from_secs(10);
    while (after.fds > base.fds || after.threads > base.threads) && Instant::now() < settle {
        std::thread::sleep(Duration::from_millis(50));
        after = Usage::of(pid, path);
    }
    // The server writes what its allocations hold every 100 ms: a fresh
    // figure, after it has closed what it closes.
    std::thread::sleep(Duration::from_millis(300));
    after = Usage::of(pid, path);
    let frames = match (&during.frames, &unloaded.frames) {
        (Ok(d), Ok(u)) => format!("{d} vs {u}"),
        (Err(e), _) | (_, Err(e)) => format!("failed: {e}"),
    };
    let mib = |kib: u64| (kib as f64 - base.rss_kib as f64) / 1024.0;
    let heap_mib = |kib: u64| (kib as f64 - base.heap_kib as f64) / 1024.0;
    let above = |n: usize, base: usize| n as i64 - base as i64;
    out!(
        "| {kind}: {what} | {admitted} | {:+.1} / {:+.1} / {:+.1} MiB | {:+.1} / {:+.1} / {:+.1} MiB \
         | {:+} / {:+} | {:+} / {:+} | {} | {} | {frames} | {:.0} % vs {:.0} % |",
        heap_mib(before.heap_kib),
        heap_mib(loaded.heap_kib),
        heap_mib(after.heap_kib),
        mib(before.rss_kib),
        mib(loaded.rss_kib),
        mib(after.rss_kib),
        above(loaded.fds, base.fds),
        above(after.fds, base.fds),
        above(loaded.threads, base.threads),
        above(after.threads, base.threads),
        versus(&during.attach, &unloaded.attach),
        versus(&during.ring, &unloaded.ring),
        cpu_during * 100.0,
        cpu_unloaded * 100.0,
    );
    out_of_bounds(
        kind,
        (&during, &unloaded),
        (after.fds, base.fds),
        (after.threads, base.threads),
        (after.heap_kib, before.heap_kib),
    )
}

fn measure() {
    let root = rustix::process::geteuid().is_root();
    let dir = tempfile::Builder::new()
        .prefix("cuda-ipc-hostile")
        .tempdir()
        .expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    if let Ok(mut d) = SCRATCH.lock() {
        *d = Some(dir.path().to_owned());
    }
    // A copy of this program that the other user can run.
    let exe: PathBuf = dir.path().join("hostile_peers");
    std::fs::copy(std::env::current_exe().expect("exe"), &exe).expect("copy");
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let path = dir.path().join("hostile.sock");
    let path_s = path.to_str().expect("utf-8 path");
    let (mut server, mut server_out) = spawn(&exe, &["--serve", path_s], false);
    assert_eq!(line(&mut server_out).trim(), "READY");
    let pid = server.id();
    let warm = legit(&path);
    std::thread::sleep(Duration::from_millis(200));
    let base = Usage::of(pid, &path);
    let (rss0, fds0, threads0) = (base.rss_kib, base.fds, base.threads);
    out!(
        "attackers run as {}; server baseline {:.1} MiB RSS, {:.1} MiB heap in use, {fds0} fds; \
         unloaded attach + release {}, ring subscription {}, ring frames in 0.5 s {}; {threads0} \
         threads",
        if root { "uid 65534" } else { "this user" },
        rss0 as f64 / 1024.0,
        base.heap_kib as f64 / 1024.0,
        warm.attach
            .as_ref()
            .map_or_else(Clone::clone, |u| format!("{u:.0} us")),
        warm.ring
            .as_ref()
            .map_or_else(Clone::clone, |u| format!("{u:.0} us")),
        warm.frames
            .as_ref()
            .map_or_else(Clone::clone, u64::to_string),
    );
    out!();
    out!(
        "| attack ({} connections each) | admitted | server heap in use above baseline, before / during / after \
         | server RSS above baseline, before / during / after | \
         server fds above baseline, during / after | server threads above baseline, during / \
         after | legit attach + release, median | legit ring subscription, median | legit ring \
         frames in 0.5 s, during vs unloaded | server CPU, during vs unloaded |",
        PROCESSES * PER_PROCESS
    );
    out!("|---|---|---|---|---|---|---|---|---|---|");
    let mut broken = Vec::new();
    let only = std::env::var("HOSTILE_ONLY").ok();
    for (kind, what) in ATTACKS {
        if only
            .as_deref()
            .is_none_or(|o| o.split(',').any(|k| k == *kind))
        {
            broken.extend(one_attack(&exe, &path, pid, (kind, what), root, base));
        }
    }
    out!();
    if broken.is_empty() {
        out!(
            "every attack within the bounds: legitimate latencies at most 2x unloaded; threads and \
             descriptors back to the baseline after each, the memory its allocations hold to \
             within {} MiB of what it was before it",
            HEAP_SLACK_KIB / 1024
        );
    }
    for b in &broken {
        out!("OUT OF BOUNDS {b}");
    }
    drop(server.stdin.take());
    let _ = server.wait();
}
