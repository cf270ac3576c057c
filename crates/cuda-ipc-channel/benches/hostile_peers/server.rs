//! The server under attack, run as a child (`--serve PATH`): one entry
//! with two descriptors, a 64-slot ring fed about every millisecond, a call
//! handler that refuses every call as a weight service would, and the
//! bytes its allocations hold written next to its socket every 100 ms.

use std::io::Read;
use std::os::fd::OwnedFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use cuda_ipc_channel::{CallError, CallHandler, Server, ServerConfig};
use serde_json::json;

use super::{OTHER_UID, RING_SLOTS};

/// The server: publishes one entry with two descriptors and serves until
/// stdin closes.
pub(crate) fn serve(path: &Path) {
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

pub(crate) fn memfd(bytes: &[u8]) -> OwnedFd {
    let fd =
        rustix::fs::memfd_create("hostile-peers", rustix::fs::MemfdFlags::CLOEXEC).expect("memfd");
    rustix::io::write(&fd, bytes).expect("write");
    fd
}

/// Where the server at socket `path` writes the bytes its allocations
/// hold.
pub(crate) fn heap_file(path: &Path) -> PathBuf {
    path.with_extension("heap")
}
