//! Compares the two notice paths on the CPU alone: the socket and the
//! shared-memory ring (see `cuda_ipc_channel::notices`). Server and
//! client run in this one process, on two threads, as two processes would
//! (every message crosses the kernel or the shared mapping the same way).
//!
//! - *update*: one-way latency of `Server::update` to `Client::next_update`
//!   for a client already waiting (it spins for `ClientConfig::spin`, 50 µs
//!   by default, before it sleeps); the producer sends the next update
//!   20 µs after the client took the last one.
//! - *frame round trip*: a one-slot ring; `ServerRing::publish`, the
//!   client's `next_frame` and `ack`, until `acquire` returns the slot
//!   again. The subscriber's ring waits sleep at once (no spin); the
//!   server's reader and the producer's `acquire` spin for
//!   `ServerConfig::spin` (50 µs) first, so a trip has one to three
//!   wake-ups (see the `handoff_latency` example, which counts them).
//!
//! Run with `cargo run --release -p cuda-ipc-channel --example
//! notice_latency [iterations per batch]`. The numbers depend on the machine and its
//! load (a shared two-core machine is noisy); compare the two paths within
//! one run.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cuda_ipc_channel::{
    ChannelError, Client, ClientConfig, Notice, NoticePath, Server, ServerConfig,
};
use serde_json::json;

fn percentile(sorted: &[u64], p: f64) -> f64 {
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i] as f64 / 1000.0
}

/// One row: the p50 of each batch, and p50 / p90 / p99 of the batch with
/// the lowest p50 (the one least disturbed by other load).
fn report(what: &str, path: NoticePath, batches: Vec<Vec<u64>>) {
    let mut best: Option<Vec<u64>> = None;
    let mut medians = Vec::new();
    for mut ns in batches {
        ns.sort_unstable();
        medians.push(format!("{:.1}", percentile(&ns, 0.5)));
        if best
            .as_ref()
            .is_none_or(|b| percentile(&ns, 0.5) < percentile(b, 0.5))
        {
            best = Some(ns);
        }
    }
    let ns = best.unwrap_or_default();
    if ns.is_empty() {
        return;
    }
    println!(
        "{what:<18} {path:<7} best batch: p50 {:>7.2} µs  p90 {:>7.2} µs  p99 {:>8.2} µs; \
         batch p50s (µs): {}",
        percentile(&ns, 0.5),
        percentile(&ns, 0.9),
        percentile(&ns, 0.99),
        medians.join(" "),
        path = format!("{path:?}"),
    );
}

fn updates(path: NoticePath, n: usize, dir: &std::path::Path) -> Result<Vec<u64>, ChannelError> {
    let sock = dir.join(format!("u-{path:?}.sock"));
    let server = Server::bind(ServerConfig::new(&sock).with_notices(path))?;
    server.publish("e", json!({}), vec![])?;
    let client = Client::connect(&sock, ClientConfig::default().with_notices(path))?;
    assert_eq!(client.notice_stats().path, path);
    client.attach("e")?;
    let base = Instant::now();
    // The moment the client took the last update (ns since base).
    let taken = Arc::new(AtomicU64::new(0));
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
        // Wait until the client took the previous one, then 20 µs.
        if i > 0 {
            while taken.load(Ordering::Acquire) == 0 {
                std::hint::spin_loop();
            }
        }
        let since = Instant::now();
        while since.elapsed() < Duration::from_micros(20) {
            std::hint::spin_loop();
        }
        taken.store(0, Ordering::Release);
        server.update("e", json!(base.elapsed().as_nanos() as u64))?;
    }
    reader.join().expect("the reader thread panicked")
}

fn frames(path: NoticePath, n: usize, dir: &std::path::Path) -> Result<Vec<u64>, ChannelError> {
    let sock = dir.join(format!("f-{path:?}.sock"));
    let server = Server::bind(ServerConfig::new(&sock).with_notices(path))?;
    let ring = server.create_ring("r", json!({}), vec![(json!({}), vec![])])?;
    let client = Client::connect(&sock, ClientConfig::default().with_notices(path))?;
    let sub = client.attach_ring("r")?;
    let subscriber = std::thread::spawn(move || -> Result<(), ChannelError> {
        for _ in 0..n {
            let f = client.next_frame(sub.lease, Duration::from_secs(10))?;
            client.ack(sub.lease, f.slot, f.seq)?;
        }
        Ok(())
    });
    let mut rtt = Vec::with_capacity(n);
    let mut slot = ring.acquire(None)?;
    for i in 0..n {
        let t0 = Instant::now();
        ring.publish(slot, json!(i))?;
        slot = ring.acquire(Some(Duration::from_secs(10)))?;
        rtt.push(t0.elapsed().as_nanos() as u64);
    }
    subscriber.join().expect("the subscriber thread panicked")?;
    Ok(rtt)
}

/// Batches per row; the row reports the least disturbed one.
const BATCHES: usize = 6;

fn main() -> Result<(), ChannelError> {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(5_000);
    let dir = tempfile::tempdir().map_err(|e| ChannelError::Io {
        context: "cannot make a temporary directory".into(),
        source: e,
    })?;
    println!("{BATCHES} batches of {n} per row, the paths taking turns; CPU only, one process");
    let paths = [NoticePath::Socket, NoticePath::Shm];
    let mut up = [Vec::new(), Vec::new()];
    let mut fr = [Vec::new(), Vec::new()];
    for _ in 0..BATCHES {
        for (i, path) in paths.into_iter().enumerate() {
            up[i].push(updates(path, n, dir.path())?);
            fr[i].push(frames(path, n, dir.path())?);
        }
    }
    let [up_socket, up_shm] = up;
    let [fr_socket, fr_shm] = fr;
    report("update one-way", NoticePath::Socket, up_socket);
    report("update one-way", NoticePath::Shm, up_shm);
    report("frame round trip", NoticePath::Socket, fr_socket);
    report("frame round trip", NoticePath::Shm, fr_shm);
    Ok(())
}
