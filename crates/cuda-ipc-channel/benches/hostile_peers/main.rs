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

use std::path::{Path, PathBuf};

/// Prints a line to stdout; exits quietly when stdout is gone (`| head`),
/// removing the measurement's directory first (the server and attackers
/// exit when their stdin closes with us).
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if writeln!(std::io::stdout(), $($arg)*).is_err() {
            if let Some(dir) = $crate::SCRATCH.lock().ok().and_then(|mut d| d.take()) {
                let _ = std::fs::remove_dir_all(dir);
            }
            std::process::exit(0);
        }
    }};
}

/// The measurement's directory, removed on a quiet early exit.
static SCRATCH: std::sync::Mutex<Option<PathBuf>> = std::sync::Mutex::new(None);

// After the macro, so that the modules can use it.
mod attacks;
mod measure;
mod server;

use attacks::attack;
use measure::measure;
use server::serve;

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
