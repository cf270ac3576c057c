//! A second user on the same machine, without a GPU: what keeps another
//! user's process away from shared memory, and what does not.
//!
//! The tests run a consumer child as uid/gid 65534 (`nobody`) through
//! `CommandExt::uid`/`gid`, which needs root (CI runs as root). As another
//! user they skip, printing why. Nothing system-wide is created: sockets
//! and files live in temporary directories, opened to other users (0755)
//! only where a test says so.
//!
//! - (a) The server's peer check (`SO_PEERCRED` against
//!   `ServerConfig::allowed_uids`, by default only our own uid) refuses the
//!   other user even when the socket file itself lets everyone connect,
//!   and nothing is leased; the other user's client refuses our server too.
//! - (b) A server that lists uid 65534 admits it: it receives the
//!   memfd-backed entry and reads the right bytes through the descriptor.
//! - (c) The socket file (mode 0600) and the private socket directory
//!   (mode 0700, as `default_socket_dir` makes it) each keep the other user
//!   from connecting at all: `connect` fails with `EACCES`.
//! - (d) By contrast, a descriptor printed to a place others can read is a
//!   bearer token: the other user parses a legacy descriptor and holds the
//!   64-byte handle, which is all the CUDA driver asks for. An fd-based
//!   descriptor's number, printed the same way, gives them nothing.

use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

#[path = "../../cuda-ipc-channel/tests/support/mod.rs"]
mod support;
use support::{ChildProc, memfd_with, pattern, read_fd, test_command};

use cuda_ipc::channel::{
    ChannelError, Client, ClientConfig, EntryKind, Server, ServerConfig, ensure_private_dir,
};
use cuda_ipc::descriptor::{Descriptor, Source};
use cuda_ipc::device::DeviceUuid;
use cuda_ipc::handle::IpcMemHandle;
use serde_json::json;

/// The other user: `nobody` on most Linux systems.
const OTHER: u32 = 65534;
const CHILD_ENV: &str = "CUDA_IPC_SECOND_USER_CHILD";
const PATH_ENV: &str = "CUDA_IPC_SECOND_USER_PATH";
const LEN: usize = 8192;
const TIMEOUT: Duration = Duration::from_secs(20);

/// Tests copy files and spawn children: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The contents of the shared memfds.
fn data(len: usize) -> Vec<u8> {
    pattern(len, 0x5a)
}

/// Says that and why a test did not run, on stderr itself: libtest
/// captures `println!`, and a skip must not look like a pass.
fn skip(test: &str, why: &str) {
    let _ = writeln!(std::io::stderr().lock(), "SKIPPED {test}: {why}");
}

/// Whether this test can run a child as another user; if not, says why.
fn can_switch_users(test: &str) -> bool {
    let euid = rustix::process::geteuid().as_raw();
    if euid != 0 {
        skip(
            test,
            &format!(
                "running as uid {euid}; switching a child to uid {OTHER} needs root (CI runs \
                 as root)"
            ),
        );
        return false;
    }
    true
}

/// A temporary directory that other users may enter and list (0755).
fn open_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

/// This executable, or a copy of it in `dir` if another user could not
/// reach it where it is.
fn executable_for_others(dir: &Path) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let reachable = exe
        .ancestors()
        .skip(1)
        .all(|d| std::fs::metadata(d).is_ok_and(|m| m.mode() & 0o001 != 0))
        && std::fs::metadata(&exe).is_ok_and(|m| m.mode() & 0o005 == 0o005);
    if reachable {
        return exe;
    }
    let copy = dir.join("second-user-child");
    std::fs::copy(&exe, &copy).unwrap();
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755)).unwrap();
    copy
}

/// Starts this test executable for `test` in `role` against `path`, as
/// uid/gid 65534, or says why it cannot (`Err`: skip).
fn spawn_other(dir: &Path, test: &str, role: &str, path: &Path) -> Result<ChildProc, String> {
    let mut cmd = test_command(&executable_for_others(dir), test);
    cmd.env(CHILD_ENV, role)
        .env(PATH_ENV, path)
        .current_dir(dir)
        .uid(OTHER)
        .gid(OTHER);
    ChildProc::start(cmd).map_err(|e| format!("cannot start a child as uid {OTHER}: {e}"))
}

/// How a connection attempt ended, in one line the parent can check.
fn outcome(r: &Result<Client, ChannelError>) -> String {
    match r {
        Ok(_) => "connected".into(),
        Err(ChannelError::Refused { by, uid, .. }) => format!("refused by={by} uid={uid}"),
        Err(ChannelError::Io { source, .. }) => {
            format!("io errno={}", source.raw_os_error().unwrap_or(-1))
        }
        Err(e) => format!("other {e}"),
    }
}

fn trust_root() -> ClientConfig {
    ClientConfig::default().with_allowed_server_uids([0])
}

/// If this process is a child, runs its role and returns true.
fn run_child_role() -> bool {
    let Ok(role) = std::env::var(CHILD_ENV) else {
        return false;
    };
    let path = PathBuf::from(std::env::var_os(PATH_ENV).unwrap());
    let me = rustix::process::geteuid().as_raw();
    let group = rustix::process::getegid().as_raw();
    println!("CHILD-UID {me} {group}");
    match role.as_str() {
        // Connect, trusting a server run by root.
        "connect" => println!("RESULT {}", outcome(&Client::connect(&path, trust_root()))),
        // Connect with the default configuration: trust only our own uid.
        "connect-default" => {
            let r = Client::connect(&path, ClientConfig::default());
            println!("RESULT {}", outcome(&r));
        }
        // Attach, read the bytes through the descriptor, hold the lease
        // until stdin closes.
        "attach" => {
            let client = Client::connect(&path, trust_root()).unwrap();
            let a = client.attach("weights").unwrap();
            let len = usize::try_from(a.meta["len"].as_u64().unwrap()).unwrap();
            let ok = read_fd(&a.fds[0], len) == data(len);
            println!("RESULT lease={} read={len} match={ok}", a.lease);
            let mut sink = Vec::new();
            let _ = std::io::stdin().read_to_end(&mut sink);
            client.release(a.lease).unwrap();
        }
        // Read a descriptor from a file someone left readable.
        "read-descriptor" => {
            let text = std::fs::read_to_string(&path).unwrap();
            let d = Descriptor::from_json(&text).unwrap();
            match d.source {
                Source::Legacy { handle } => println!("RESULT handle={handle}"),
                Source::Vmm { fd } => {
                    // The number names a descriptor in the exporter; the
                    // kernel does not let another user reach it.
                    let proc_fd = format!("/proc/{}/fd/{fd}", d.pid);
                    match std::fs::File::open(&proc_fd) {
                        Ok(_) => println!("RESULT fd-opened {proc_fd}"),
                        Err(e) => {
                            let errno = e.raw_os_error().unwrap_or(-1);
                            println!("RESULT fd-denied errno={errno}");
                        }
                    }
                }
                other => println!("RESULT unexpected {other:?}"),
            }
        }
        other => panic!("unknown child role {other}"),
    }
    true
}

/// Makes `path` connectable by everyone, so that only the peer check stands
/// between another user and the server.
fn open_socket_to_all(path: &Path) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)).unwrap();
}

// ---------------------------------------------------------------------------
// (a) The default peer check

#[test]
fn the_default_peer_check_refuses_another_user() {
    const TEST: &str = "the_default_peer_check_refuses_another_user";
    if run_child_role() || !can_switch_users(TEST) {
        return;
    }
    let _serial = serial();
    let dir = open_dir();
    let path = dir.path().join("refuse.sock");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    server
        .publish(
            "weights",
            json!({ "len": LEN }),
            vec![memfd_with(&data(LEN))],
        )
        .unwrap();
    open_socket_to_all(&path);

    let mut child = match spawn_other(dir.path(), TEST, "connect", &path) {
        Ok(c) => c,
        Err(why) => return skip(TEST, &why),
    };
    assert_eq!(
        child.after("CHILD-UID", TIMEOUT),
        format!("{OTHER} {OTHER}")
    );
    assert_eq!(
        child.after("RESULT", TIMEOUT),
        format!("refused by=server uid={OTHER}")
    );
    child.finish(TIMEOUT);
    assert!(server.leases().is_empty(), "{:?}", server.leases());
    assert_eq!(server.connection_count(), 0);
    assert_eq!(server.lease_count("weights"), 0);

    // The other user's client, left at its default, trusts only servers
    // of its own uid: it refuses ours first.
    let mut child = spawn_other(dir.path(), TEST, "connect-default", &path).unwrap();
    assert_eq!(child.after("RESULT", TIMEOUT), "refused by=client uid=0");
    child.finish(TIMEOUT);
    assert!(server.leases().is_empty());

    // Our own clients are served as before.
    let own = Client::connect(&path, ClientConfig::default()).unwrap();
    let a = own.attach("weights").unwrap();
    assert_eq!(read_fd(&a.fds[0], LEN), data(LEN));
}

// ---------------------------------------------------------------------------
// (b) A server that admits the other user

#[test]
fn an_allowed_user_receives_the_memory_through_the_fd() {
    const TEST: &str = "an_allowed_user_receives_the_memory_through_the_fd";
    if run_child_role() || !can_switch_users(TEST) {
        return;
    }
    let _serial = serial();
    let dir = open_dir();
    let path = dir.path().join("admit.sock");
    let server = Server::bind(ServerConfig::new(&path).with_allowed_uids([0, OTHER])).unwrap();
    server
        .publish(
            "weights",
            json!({ "len": LEN }),
            vec![memfd_with(&data(LEN))],
        )
        .unwrap();
    // The socket stays 0600; giving it to the other user lets exactly that
    // user (and root) connect.
    rustix::fs::chown(
        &path,
        Some(rustix::fs::Uid::from_raw(OTHER)),
        Some(rustix::fs::Gid::from_raw(OTHER)),
    )
    .unwrap();
    assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);

    let mut child = match spawn_other(dir.path(), TEST, "attach", &path) {
        Ok(c) => c,
        Err(why) => return skip(TEST, &why),
    };
    assert_eq!(
        child.after("CHILD-UID", TIMEOUT),
        format!("{OTHER} {OTHER}")
    );
    let result = child.after("RESULT", TIMEOUT);
    assert!(
        result.ends_with(&format!("read={LEN} match=true")),
        "{result}"
    );
    let leases = server.leases();
    assert_eq!(leases.len(), 1, "{leases:?}");
    assert_eq!(leases[0].uid, OTHER);
    assert_eq!(leases[0].name, "weights");
    assert_eq!(leases[0].kind, EntryKind::Entry);
    assert_eq!(leases[0].pid, child.pid());
    assert_eq!(
        result,
        format!("lease={} read={LEN} match=true", leases[0].lease)
    );
    child.finish(TIMEOUT);
    server
        .wait_released("weights", Some(Duration::from_secs(5)))
        .unwrap();
}

// ---------------------------------------------------------------------------
// (c) File permissions: the first gate

#[test]
fn the_socket_file_and_its_directory_keep_another_user_out() {
    const TEST: &str = "the_socket_file_and_its_directory_keep_another_user_out";
    if run_child_role() || !can_switch_users(TEST) {
        return;
    }
    let _serial = serial();
    let eacces = rustix::io::Errno::ACCESS.raw_os_error();

    // A 0600 socket in a directory everyone may enter: the file's mode
    // refuses the connection (even a server that would admit the user).
    let dir = open_dir();
    let path = dir.path().join("private.sock");
    let server = Server::bind(ServerConfig::new(&path).with_allowed_uids([0, OTHER])).unwrap();
    assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
    let mut child = match spawn_other(dir.path(), TEST, "connect", &path) {
        Ok(c) => c,
        Err(why) => return skip(TEST, &why),
    };
    assert_eq!(child.after("RESULT", TIMEOUT), format!("io errno={eacces}"));
    child.finish(TIMEOUT);
    assert_eq!(server.connection_count(), 0);
    drop(server);

    // A private directory, as default_socket_dir makes it (0700, ours):
    // even a socket file open to all cannot be reached through it.
    let private = dir.path().join("cuda-ipc");
    ensure_private_dir(&private).unwrap();
    assert_eq!(std::fs::metadata(&private).unwrap().mode() & 0o777, 0o700);
    let path = private.join("in-private-dir.sock");
    let server = Server::bind(ServerConfig::new(&path).with_allowed_uids([0, OTHER])).unwrap();
    open_socket_to_all(&path);
    let mut child = spawn_other(dir.path(), TEST, "connect", &path).unwrap();
    assert_eq!(child.after("RESULT", TIMEOUT), format!("io errno={eacces}"));
    child.finish(TIMEOUT);
    assert_eq!(server.connection_count(), 0);

    // The same socket, reached by a user the directory lets in, works:
    // the refusals above came from the permissions, not a broken server.
    Client::connect(&path, ClientConfig::default())
        .unwrap()
        .ping()
        .unwrap();
}

// ---------------------------------------------------------------------------
// (d) Bearer tokens

#[test]
fn a_printed_descriptor_is_a_bearer_token() {
    const TEST: &str = "a_printed_descriptor_is_a_bearer_token";
    if run_child_role() || !can_switch_users(TEST) {
        return;
    }
    let _serial = serial();
    let dir = open_dir();
    let handle = IpcMemHandle::from(std::array::from_fn(|i| (i as u8) ^ 0xa5));
    let legacy = Descriptor::new(
        Source::Legacy { handle },
        2 << 20,
        DeviceUuid([7; 16]),
        std::process::id(),
    )
    .with_range(0, 4096);
    // `cuda-ipc export > /tmp/x.json` with the usual umask: 0644.
    let file = dir.path().join("legacy.json");
    std::fs::write(&file, legacy.to_json()).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mut child = match spawn_other(dir.path(), TEST, "read-descriptor", &file) {
        Ok(c) => c,
        Err(why) => return skip(TEST, &why),
    };
    // The other user now holds the 64 bytes; the driver asks for nothing
    // more (cuIpcOpenMemHandle checks no user or process).
    assert_eq!(child.after("RESULT", TIMEOUT), format!("handle={handle}"));
    child.finish(TIMEOUT);

    // The same for a VMM export: its "fd" is a number in our descriptor
    // table, and the kernel keeps other users out of that table.
    let memfd = memfd_with(&data(4096));
    let mut vmm = legacy.clone();
    vmm.source = Source::Vmm {
        fd: rustix::fd::AsRawFd::as_raw_fd(&memfd),
    };
    let file = dir.path().join("vmm.json");
    std::fs::write(&file, vmm.to_json()).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mut child = spawn_other(dir.path(), TEST, "read-descriptor", &file).unwrap();
    let eacces = rustix::io::Errno::ACCESS.raw_os_error();
    assert_eq!(
        child.after("RESULT", TIMEOUT),
        format!("fd-denied errno={eacces}")
    );
    child.finish(TIMEOUT);
    drop(memfd);
}
