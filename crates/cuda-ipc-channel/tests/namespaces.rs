//! The channel between processes in different Linux namespaces, without a
//! GPU: memfds stand in for GPU memory.
//!
//! The parent runs one end; the other end is this test executable re-run
//! through util-linux `unshare` in a new PID, user, mount or network
//! namespace (`CUDA_IPC_NS_ROLE` says which end it plays). Creating most
//! namespaces needs root (or unprivileged user namespaces); where `unshare`
//! is refused, each test prints why and passes without running.
//!
//! What the tests check: the peer's pid reads as 0 across a PID namespace
//! boundary and the channel works anyway; uids are matched as the kernel
//! maps them; a socket bind-mounted at another path and a socket reached
//! from another network namespace work; the bytes go both ways through the
//! passed descriptors.

use std::io::Read;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, mpsc};
use std::time::Duration;

mod support;
use support::{ChildProc, memfd_with, pattern, read_fd};

use cuda_ipc_channel::{Client, ClientConfig, Server, ServerConfig};
use serde_json::json;

const ROLE_ENV: &str = "CUDA_IPC_NS_ROLE";
const PATH_ENV: &str = "CUDA_IPC_NS_PATH";
const LEN: usize = 64 * 1024;
const WAIT: Duration = Duration::from_secs(10);

/// Serialises the tests: each starts a child and waits for it.
static LOCK: Mutex<()> = Mutex::new(());

fn lock() -> std::sync::MutexGuard<'static, ()> {
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Why `unshare FLAGS true` cannot run here, if it cannot.
fn unshare_refused(flags: &[&str]) -> Option<String> {
    let out = Command::new("unshare")
        .args(flags)
        .arg("true")
        .stdin(Stdio::null())
        .output();
    match out {
        Err(e) => Some(format!("util-linux unshare cannot be run: {e}")),
        Ok(o) if !o.status.success() => Some(format!(
            "`unshare {}` is not allowed here: {}",
            flags.join(" "),
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Ok(_) => None,
    }
}

/// Runs `test` of this executable in `role` through `unshare FLAGS`, with
/// `wrap` (a shell snippet run first inside the namespaces, whose `"$@"` is
/// the test command) if given.
fn spawn_in(flags: &[&str], wrap: Option<&str>, test: &str, role: &str, path: &Path) -> ChildProc {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new("unshare");
    cmd.args(flags);
    if flags.contains(&"--fork") {
        // The test process dies with unshare if the parent kills it.
        cmd.arg("--kill-child");
    }
    cmd.arg("--");
    if let Some(script) = wrap {
        cmd.args(["sh", "-c", script, "sh"]);
    }
    cmd.arg(exe)
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE_ENV, role)
        .env(PATH_ENV, path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    ChildProc::start(cmd).expect("cannot start unshare")
}

/// Blocks until stdin reaches end of file, or for at most 30 s.
fn wait_for_stdin_close() {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
        let _ = tx.send(());
    });
    let _ = rx.recv_timeout(Duration::from_secs(30));
}

/// The consumer's side, run inside the namespaces: attach `e`, check the
/// producer's bytes, write our own back through the same descriptor, and
/// report what the kernel says about the server.
fn consumer(path: &Path) {
    let client = Client::connect(path, ClientConfig::default()).unwrap();
    let cred = client.server_credentials();
    let a = client.attach("e").unwrap();
    assert_eq!(
        read_fd(&a.fds[0], LEN),
        pattern(LEN, 7),
        "the producer's bytes"
    );
    rustix::io::pwrite(&a.fds[0], &pattern(LEN, 99), 0).unwrap();
    println!(
        "NS-READY server_pid={} server_uid={} own_uid={}",
        cred.pid,
        cred.uid,
        rustix::process::geteuid().as_raw()
    );
    wait_for_stdin_close();
    client.release(a.lease).unwrap();
}

/// The producer's side, run inside the namespaces: publish `e`, wait for
/// the consumer's bytes, and report the holder's pid as the kernel gives it.
fn producer(path: &Path) {
    let server = Server::bind(ServerConfig::new(path)).unwrap();
    let fd = memfd_with(&pattern(LEN, 7));
    let mine = rustix::io::dup(&fd).unwrap();
    server.publish("e", json!({"len": LEN}), vec![fd]).unwrap();
    println!("NS-SERVING");
    let deadline = std::time::Instant::now() + WAIT;
    while read_fd(mine.as_fd(), LEN) != pattern(LEN, 99) {
        assert!(
            std::time::Instant::now() < deadline,
            "the consumer never wrote"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let leases = server.leases();
    println!("NS-READY holder_pid={}", leases[0].pid);
    wait_for_stdin_close();
}

/// If this process is a child, plays its role and returns true.
fn run_role() -> bool {
    let Ok(role) = std::env::var(ROLE_ENV) else {
        return false;
    };
    let path = PathBuf::from(std::env::var_os(PATH_ENV).unwrap());
    match role.as_str() {
        "consumer" => consumer(&path),
        "producer" => producer(&path),
        other => panic!("unknown role {other}"),
    }
    true
}

/// The value of `key=` in `line`.
fn field(line: &str, key: &str) -> u32 {
    let at = line.find(&format!("{key}=")).unwrap() + key.len() + 1;
    line[at..]
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// A server here, a consumer through `unshare FLAGS` (after `wrap`, which
/// may move the socket; the consumer connects to `child_path`). Checks the
/// bytes both ways and returns the consumer's report line.
fn serve_to(
    test: &str,
    flags: &[&str],
    wrap: Option<&str>,
    path: &Path,
    child_path: &Path,
) -> Option<String> {
    if let Some(why) = unshare_refused(flags) {
        println!("skipped: {why}");
        return None;
    }
    let server = Server::bind(ServerConfig::new(path)).unwrap();
    let fd = memfd_with(&pattern(LEN, 7));
    let mine = rustix::io::dup(&fd).unwrap();
    server.publish("e", json!({"len": LEN}), vec![fd]).unwrap();
    let mut child = spawn_in(flags, wrap, test, "consumer", child_path);
    let (line, _) = child.line("NS-READY", WAIT);
    assert_eq!(
        read_fd(mine.as_fd(), LEN),
        pattern(LEN, 99),
        "the consumer's bytes"
    );
    let leases = server.leases();
    assert_eq!(leases.len(), 1, "{leases:?}");
    assert_eq!(leases[0].uid, 0, "the holder's uid as this server sees it");
    child.finish(WAIT);
    server.wait_released("e", Some(WAIT)).unwrap();
    Some(line)
}

fn running_as_root() -> bool {
    rustix::process::geteuid().is_root()
}

#[test]
fn consumer_in_a_new_pid_namespace() {
    if run_role() {
        return;
    }
    let _g = lock();
    if !running_as_root() {
        println!("skipped: creating a PID namespace here needs root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pid.sock");
    let test = "consumer_in_a_new_pid_namespace";
    let flags = ["--pid", "--fork", "--mount-proc"];
    let Some(line) = serve_to(test, &flags, None, &path, &path) else {
        return;
    };
    // The server runs in the parent PID namespace, which the consumer
    // cannot see: the kernel reports pid 0, and that is not an error.
    assert_eq!(field(&line, "server_pid"), 0, "{line}");
    assert_eq!(field(&line, "server_uid"), 0, "{line}");
}

#[test]
fn producer_in_a_new_pid_namespace() {
    if run_role() {
        return;
    }
    let _g = lock();
    if !running_as_root() {
        println!("skipped: creating a PID namespace here needs root");
        return;
    }
    let flags = ["--pid", "--fork", "--mount-proc"];
    if let Some(why) = unshare_refused(&flags) {
        println!("skipped: {why}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pid.sock");
    let mut producer = spawn_in(
        &flags,
        None,
        "producer_in_a_new_pid_namespace",
        "producer",
        &path,
    );
    producer.line("NS-SERVING", WAIT);
    let client = Client::connect(&path, ClientConfig::default()).unwrap();
    // We see into the producer's (descendant) namespace.
    assert_ne!(client.server_pid(), 0);
    let a = client.attach("e").unwrap();
    assert_eq!(read_fd(&a.fds[0], LEN), pattern(LEN, 7));
    rustix::io::pwrite(&a.fds[0], &pattern(LEN, 99), 0).unwrap();
    // The producer cannot see us: our lease's pid reads as 0 there.
    let line = producer.after("NS-READY", WAIT);
    assert_eq!(field(&line, "holder_pid"), 0, "{line}");
    client.release(a.lease).unwrap();
    producer.finish(WAIT);
}

#[test]
fn consumer_in_a_new_user_namespace_mapped_to_root() {
    if run_role() {
        return;
    }
    let _g = lock();
    if !running_as_root() {
        println!("skipped: the mapped uid must be the server's (root) for the default allowlist");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("user.sock");
    let test = "consumer_in_a_new_user_namespace_mapped_to_root";
    let flags = ["--user", "--map-root-user", "--pid", "--fork"];
    let Some(line) = serve_to(test, &flags, None, &path, &path) else {
        return;
    };
    // Inside, the consumer is root of its own user namespace, mapped onto
    // our uid 0: both sides see uid 0, and the allowlists match it.
    assert_eq!(field(&line, "server_uid"), 0, "{line}");
    assert_eq!(field(&line, "own_uid"), 0, "{line}");
    assert_eq!(field(&line, "server_pid"), 0, "{line}");
}

#[test]
fn consumer_in_an_unmapped_user_namespace_sees_the_overflow_uid() {
    if run_role() {
        return;
    }
    let _g = lock();
    if !running_as_root() {
        println!("skipped: needs root to own the socket");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("unmapped.sock");
    let test = "consumer_in_an_unmapped_user_namespace_sees_the_overflow_uid";
    let Some(line) = serve_to(test, &["--user"], None, &path, &path) else {
        return;
    };
    // No uid maps into the new namespace: the server's uid and our own read
    // as the overflow uid there (the documented allowlist rule).
    let overflow: u32 = std::fs::read_to_string("/proc/sys/kernel/overflowuid")
        .map_or(65534, |s| s.trim().parse().unwrap_or(65534));
    assert_eq!(field(&line, "server_uid"), overflow, "{line}");
    assert_eq!(field(&line, "own_uid"), overflow, "{line}");
}

#[test]
fn consumer_in_a_new_mount_namespace_with_the_socket_elsewhere() {
    if run_role() {
        return;
    }
    let _g = lock();
    if !running_as_root() {
        println!("skipped: bind mounts need root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let path = dir.path().join("mnt.sock");
    // Inside: the socket's directory mounted over another (empty) one, as a
    // container sees a volume; the consumer uses the mounted path only.
    let script = format!(
        "mount --bind '{}' '{}' && exec \"$@\"",
        dir.path().display(),
        elsewhere.path().display()
    );
    let child_path = elsewhere.path().join("mnt.sock");
    let test = "consumer_in_a_new_mount_namespace_with_the_socket_elsewhere";
    let flags = ["--mount", "--pid", "--fork"];
    if serve_to(test, &flags, Some(&script), &path, &child_path).is_none() {
        return;
    }
    assert!(
        !child_path.exists(),
        "the bind mount leaked out of the consumer's mount namespace"
    );
}

#[test]
fn consumer_in_a_new_network_namespace() {
    if run_role() {
        return;
    }
    let _g = lock();
    if !running_as_root() {
        println!("skipped: creating a network namespace here needs root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("net.sock");
    let test = "consumer_in_a_new_network_namespace";
    // A path socket lives in the file system, not the network namespace.
    let flags = ["--net", "--ipc", "--uts"];
    serve_to(test, &flags, None, &path, &path);
}
