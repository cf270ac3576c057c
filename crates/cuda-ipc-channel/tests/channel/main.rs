//! Tests of the exchange channel through its public API and raw sockets,
//! without a GPU, one module per topic.
//!
//! Multi-process tests re-run this executable in a child role: the child
//! runs the same test function with `CUDA_IPC_CHANNEL_CHILD=<role>` set, and
//! the function acts as the child when it sees the variable. Nothing here
//! forks. Children talk to the parent through their stdout (a `CHILD-READY`
//! line) and stop when their stdin closes or they are killed; a guard
//! kills them if a test fails. Every wait has a deadline.

use std::io::Read;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

#[path = "../support/mod.rs"]
mod support;

mod entries;
mod errors_and_paths;
mod hostile;
mod hostile_round2;
mod hostile_round3;
mod peers;
mod processes;
mod push;
mod rings;
mod shm_notices;
mod shm_requests;

use support::wire::{
    MAGIC, encode, json_frame, raw_connect, recv_message, send_bytes, send_message,
};
use support::{ChildProc, memfd_with, pattern, publish_two_fds, read_fd, test_command};

use cuda_ipc_channel::ChannelErrorKind as ErrorKind;
use cuda_ipc_channel::wire::{HEADER_LEN, MAX_PAYLOAD, Message};
use cuda_ipc_channel::{
    ChannelError, Client, ClientConfig, EntryKind, Notice, Server, ServerConfig, Side,
    default_socket_dir, default_socket_path, ensure_private_dir, peer_credentials,
    validate_socket_name,
};
use proptest::prelude::*;
use serde_json::{Value, json};

// ---------------------------------------------------------------------------
// Helpers

const CHILD_ENV: &str = "CUDA_IPC_CHANNEL_CHILD";
const PATH_ENV: &str = "CUDA_IPC_CHANNEL_PATH";
const NAME_ENV: &str = "CUDA_IPC_CHANNEL_NAME";

/// Frames sent through a ring in the load test.
const RING_FRAMES: u64 = 300;

/// The fifty consumers: child processes and threads.
const FIFTY_PROCESSES: usize = 25;
const FIFTY_THREADS: usize = 25;

/// How long a child may live at most, in case its parent forgets it.
const CHILD_LIFETIME: Duration = Duration::from_secs(30);

/// Serialises the tests that spawn children, so that their timing checks
/// do not compete with each other for the CI machine's two cores.
static SPAWN_LOCK: Mutex<()> = Mutex::new(());

fn spawn_lock() -> std::sync::MutexGuard<'static, ()> {
    SPAWN_LOCK
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn tmp_socket(dir: &tempfile::TempDir, name: &str) -> PathBuf {
    dir.path().join(format!("{name}.sock"))
}

fn quick_client(path: &Path) -> Client {
    Client::connect(path, ClientConfig::default()).unwrap()
}

/// A server on `path` whose notices take `notices`.
fn server_with(path: &Path, notices: cuda_ipc_channel::NoticePath) -> Server {
    Server::bind(ServerConfig::new(path).with_notices(notices)).unwrap()
}

/// A client of `path` asking for `notices`.
fn client_with(path: &Path, notices: cuda_ipc_channel::NoticePath) -> Client {
    Client::connect(path, ClientConfig::default().with_notices(notices)).unwrap()
}

/// This test executable re-run for `test` (its path within this binary,
/// `module::name`) in `role`, against the socket at `path` and the entry
/// `name`.
fn spawn_child(test: &str, role: &str, path: &Path, name: &str) -> ChildProc {
    let mut cmd = test_command(&std::env::current_exe().unwrap(), test);
    cmd.env(CHILD_ENV, role)
        .env(PATH_ENV, path)
        .env(NAME_ENV, name);
    ChildProc::start(cmd).expect("cannot re-run the test executable")
}

/// If this process is a child, runs its role and returns true.
fn run_child_role() -> bool {
    let Ok(role) = std::env::var(CHILD_ENV) else {
        return false;
    };
    let path = PathBuf::from(std::env::var_os(PATH_ENV).unwrap());
    let name = std::env::var(NAME_ENV).unwrap();
    match role.as_str() {
        // Attach, check the bytes, report, and hold the lease until stdin closes.
        "hold" | "verify" => {
            let client = quick_client(&path);
            let a = client.attach(&name).unwrap();
            let len = a.meta["len"].as_u64().unwrap() as usize;
            let seed = a.meta["seed"].as_u64().unwrap() as u8;
            assert_eq!(read_fd(&a.fds[0], len), pattern(len, seed));
            println!("CHILD-READY lease={}", a.lease);
            wait_for_stdin_close();
            if role == "verify" {
                client.release(a.lease).unwrap();
            }
        }
        // Subscribe to a ring, never ack, hold until stdin closes.
        "ring-hold" => {
            let client = quick_client(&path);
            let r = client.attach_ring(&name).unwrap();
            println!("CHILD-READY lease={}", r.lease);
            wait_for_stdin_close();
        }
        // Serve an entry until killed (or stdin closes).
        "producer" => {
            let server = Server::bind(ServerConfig::new(&path)).unwrap();
            let bytes = pattern(8192, 9);
            server
                .publish(
                    &name,
                    json!({"len": 8192, "seed": 9}),
                    vec![memfd_with(&bytes)],
                )
                .unwrap();
            println!("CHILD-READY");
            wait_for_stdin_close();
        }
        other => assert!(
            hostile_round2::child_role(other, &path, &name)
                || hostile_round3::child_role(other, &path),
            "unknown child role {other}"
        ),
    }
    true
}

/// Blocks until stdin reaches end of file (the parent closed it or died),
/// or the child's lifetime is over.
fn wait_for_stdin_close() {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
        let _ = tx.send(());
    });
    let _ = rx.recv_timeout(CHILD_LIFETIME);
}

fn ring_slots(n: usize) -> Vec<(Value, Vec<OwnedFd>)> {
    (0..n)
        .map(|i| (json!({"slot": i}), vec![memfd_with(&[i as u8; 16])]))
        .collect()
}
