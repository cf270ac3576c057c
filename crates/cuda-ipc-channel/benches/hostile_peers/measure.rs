//! The measurement (the bench without arguments): spawning the server and
//! the attackers, what the server holds (`/proc`, its heap file), the
//! legitimate client's latencies and frames, and the table with the
//! bounds each attack must keep.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cuda_ipc_channel::{Client, ClientConfig};

use super::server::heap_file;
use super::{ATTACKS, OTHER_UID, PER_PROCESS, PROCESSES, SCRATCH};

pub(crate) fn spawn(
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

pub(crate) fn line(out: &mut BufReader<std::process::ChildStdout>) -> String {
    let mut l = String::new();
    out.read_line(&mut l).expect("read a child's line");
    l
}

/// The KiB the server's allocations hold (glibc's `mallinfo2`: in use in
/// every arena, and in blocks of their own), as it last wrote them next
/// to its socket `path`.
pub(crate) fn heap_kib(path: &Path) -> u64 {
    std::fs::read_to_string(heap_file(path))
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .map_or(0, |b| b / 1024)
}

pub(crate) fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// The processor time of process `pid` so far, ns (`/proc/PID/stat`'s
/// user and system time, which keep the time of threads that exited).
pub(crate) fn cpu_ns(pid: u32) -> u64 {
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
pub(crate) fn legit_with_cpu(path: &Path, pid: u32) -> (Legit, f64) {
    let (t0, c0) = (Instant::now(), cpu_ns(pid));
    let l = legit(path);
    let cpu = cpu_ns(pid).saturating_sub(c0) as f64 / 1e9 / t0.elapsed().as_secs_f64();
    (l, cpu)
}

pub(crate) fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count)
}

pub(crate) fn threads(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, Iterator::count)
}

/// The most the memory the server's allocations hold may stay above what
/// it was right before an attack, after it. The resident memory is shown
/// but not bounded: glibc keeps arenas for the threads each attack's
/// connections ran on, and gives back only their free pages at the top,
/// so that a burst of threads leaves resident memory that the next burst
/// reuses (it steps up on the first attacks that use many arenas at once,
/// and stays flat after), which is not memory the server holds.
pub(crate) const HEAP_SLACK_KIB: u64 = 1024;

/// The lowest median, in microseconds, of `batches` batches of `per_batch`
/// round trips of `op` on a new client, each batch after a pause of
/// `pause`, so that bursts of other work on the machine (which this
/// measures nothing about) are left out.
pub(crate) fn best_median(
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
pub(crate) fn attach_latency(path: &Path) -> Result<f64, String> {
    best_median(path, 8, 50, Duration::from_millis(120), |c| {
        c.release(c.attach("e")?.lease)
    })
}

/// attach_ring of the 64-slot ring + release, in microseconds: the lowest
/// median of 16 batches of 10, spread over a second.
pub(crate) fn ring_latency(path: &Path) -> Result<f64, String> {
    best_median(path, 16, 10, Duration::from_millis(60), |c| {
        c.release(c.attach_ring("r")?.lease)
    })
}

/// The frames a subscriber that acks each one receives in half a second.
pub(crate) fn ring_frames(path: &Path) -> Result<u64, String> {
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
pub(crate) struct Legit {
    attach: Result<f64, String>,
    ring: Result<f64, String>,
    frames: Result<u64, String>,
}

pub(crate) fn legit(path: &Path) -> Legit {
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
pub(crate) fn out_of_bounds(
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
pub(crate) fn versus(during: &Result<f64, String>, unloaded: &Result<f64, String>) -> String {
    match (during, unloaded) {
        (Ok(d), Ok(u)) => format!("{d:.0} vs {u:.0} us ({:.2}x)", d / u),
        (Err(e), _) => format!("failed: {e}"),
        (_, Err(e)) => format!("unloaded failed: {e}"),
    }
}

/// What the server holds: resident memory (KiB), descriptors, threads.
#[derive(Clone, Copy)]
pub(crate) struct Usage {
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
pub(crate) fn one_attack(
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

pub(crate) fn measure() {
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
