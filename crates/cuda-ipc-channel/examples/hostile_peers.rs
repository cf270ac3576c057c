//! Measures what hostile clients cost a channel server: for each attack,
//! 256 hostile connections (4 processes of 64), the server's resident
//! memory and open descriptors above its baseline during the attack and
//! after the attackers leave, and a legitimate client's attach latency
//! (attach + release; the lowest median of 8 batches of 50) during the
//! attack against unloaded, measured right before it.
//!
//! ```text
//! cargo run --release -p cuda-ipc-channel --example hostile_peers
//! ```
//!
//! The server runs in a child process with the default configuration. Run
//! as root, the attackers run as another user (uid 65534, which the server
//! also allows), the way a hostile peer on a shared machine would; else as
//! this user. Prints a Markdown table.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cuda_ipc_channel::wire::{HEADER_LEN, Message, PROTOCOL_VERSION};
use cuda_ipc_channel::{Client, ClientConfig, Server, ServerConfig};
use serde_json::json;

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
];

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
    let server = Server::bind(config).expect("bind");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)).expect("chmod");
    server
        .publish("e", json!({"len": 4}), vec![memfd(b"abcd"), memfd(b"efgh")])
        .expect("publish");
    println!("READY");
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
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
fn read_message(s: &mut UnixStream) -> Option<Message> {
    let mut h = [0u8; HEADER_LEN];
    s.read_exact(&mut h).ok()?;
    let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]) as usize;
    let mut payload = vec![0u8; len];
    s.read_exact(&mut payload).ok()?;
    Message::decode(&payload).ok()
}

/// One attacker process: opens its connections, attacks, reports, and
/// holds everything until stdin closes.
fn attack(kind: &str, path: &Path) {
    let hello = frame(&Message::Hello {
        protocol: PROTOCOL_VERSION,
        pid: std::process::id(),
    });
    let mut conns = Vec::new();
    for _ in 0..PER_PROCESS {
        let Ok(mut s) = UnixStream::connect(path) else {
            continue;
        };
        s.set_write_timeout(Some(Duration::from_millis(200))).ok();
        s.set_read_timeout(Some(Duration::from_secs(2))).ok();
        if kind == "half-written" {
            let _ = s.write_all(&hello[..10]);
            conns.push(s);
            continue;
        }
        if s.write_all(&hello).is_err() {
            continue;
        }
        if let Some(Message::Welcome { .. }) = read_message(&mut s) {
            conns.push(s);
        }
    }
    let admitted = conns.len();
    let threads: Vec<_> = conns
        .into_iter()
        .map(|mut s| {
            let kind = kind.to_owned();
            std::thread::spawn(move || {
                match kind.as_str() {
                    "no-read" => {
                        for id in 0..400 {
                            let m = frame(&Message::Attach {
                                id,
                                name: "e".into(),
                            });
                            if s.write_all(&m).is_err() {
                                break;
                            }
                        }
                    }
                    "not-found" => {
                        for id in 0..2000u64 {
                            let m = frame(&Message::Attach {
                                id,
                                name: format!("{id:0>256}"),
                            });
                            if s.write_all(&m).is_err() {
                                break;
                            }
                        }
                    }
                    "big-request" => {
                        let mut m = header(1 << 20).to_vec();
                        m.resize(HEADER_LEN + (1 << 20), b' ');
                        let _ = s.write_all(&m);
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
                                if read_message(&mut s).is_none() {
                                    break;
                                }
                            }
                        }
                    }
                    _ => {}
                }
                s
            })
        })
        .collect();
    let conns: Vec<UnixStream> = threads.into_iter().filter_map(|t| t.join().ok()).collect();
    println!("ATTACKING {admitted}");
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    drop(conns);
}

fn spawn(
    exe: &Path,
    args: &[&str],
    as_other: bool,
) -> (Child, BufReader<std::process::ChildStdout>) {
    let mut cmd = Command::new(exe);
    cmd.args(args).stdin(Stdio::piped()).stdout(Stdio::piped());
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

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count)
}

/// Attach + release of a legitimate client, in microseconds: the lowest
/// median of 8 batches of 50, spread over a second, so that bursts of
/// other work on the machine (which this measures nothing about) are left
/// out.
fn attach_latency(path: &Path) -> Result<f64, String> {
    let client = Client::connect(path, ClientConfig::default()).map_err(|e| e.to_string())?;
    let mut best = f64::INFINITY;
    for _ in 0..8 {
        std::thread::sleep(Duration::from_millis(120));
        let mut times = Vec::new();
        for _ in 0..50 {
            let t = Instant::now();
            let a = client.attach("e").map_err(|e| e.to_string())?;
            client.release(a.lease).map_err(|e| e.to_string())?;
            times.push(t.elapsed().as_secs_f64() * 1e6);
        }
        times.sort_by(f64::total_cmp);
        best = best.min(times[times.len() / 2]);
    }
    Ok(best)
}

fn measure() {
    let root = rustix::process::geteuid().is_root();
    let dir = tempfile::Builder::new()
        .prefix("cuda-ipc-hostile")
        .tempdir()
        .expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    // A copy of this program that the other user can run.
    let exe: PathBuf = dir.path().join("hostile_peers");
    std::fs::copy(std::env::current_exe().expect("exe"), &exe).expect("copy");
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let path = dir.path().join("hostile.sock");
    let path_s = path.to_str().expect("utf-8 path");

    let (mut server, mut server_out) = spawn(&exe, &["--serve", path_s], false);
    assert_eq!(line(&mut server_out).trim(), "READY");
    let pid = server.id();
    let unloaded = attach_latency(&path).expect("unloaded attach");
    std::thread::sleep(Duration::from_millis(200));
    let (rss0, fds0) = (rss_kib(pid), fds(pid));
    println!(
        "attackers run as {}; server baseline {:.1} MiB RSS, {fds0} fds; unloaded attach + release {unloaded:.0} us",
        if root { "uid 65534" } else { "this user" },
        rss0 as f64 / 1024.0
    );
    println!();
    println!(
        "| attack ({} connections each) | admitted | server RSS above baseline | server fds above baseline | fds after the attackers left | legit attach + release, median | vs unloaded |",
        PROCESSES * PER_PROCESS
    );
    println!("|---|---|---|---|---|---|---|");
    for (kind, what) in ATTACKS {
        // Unloaded again right before, so that both figures see the same
        // machine.
        let unloaded = attach_latency(&path).expect("unloaded attach");
        let mut attackers: Vec<_> = (0..PROCESSES)
            .map(|_| spawn(&exe, &["--attack", kind, path_s], root))
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
        let during = attach_latency(&path);
        let (rss, fds_during) = (rss_kib(pid), fds(pid));
        for (mut child, _) in attackers.drain(..) {
            drop(child.stdin.take());
            let _ = child.wait();
        }
        // Let the server notice and close what the attackers left.
        let mut after = fds(pid);
        let settle = Instant::now() + Duration::from_secs(5);
        while after > fds0 && Instant::now() < settle {
            std::thread::sleep(Duration::from_millis(50));
            after = fds(pid);
        }
        let (latency, ratio) = match &during {
            Ok(us) => (
                format!("{us:.0} us (unloaded {unloaded:.0} us)"),
                format!("{:.2}x", us / unloaded),
            ),
            Err(e) => (format!("failed: {e}"), "-".into()),
        };
        println!(
            "| {kind}: {what} | {admitted} | {:+.1} MiB | {:+} | {:+} | {latency} | {ratio} |",
            (rss as f64 - rss0 as f64) / 1024.0,
            fds_during as i64 - fds0 as i64,
            after as i64 - fds0 as i64,
        );
    }
    drop(server.stdin.take());
    let _ = server.wait();
}
