//! Who may take this process's file descriptors with `pidfd_getfd` where
//! Yama restricts ptrace (`kernel.yama.ptrace_scope` 1, Ubuntu's default):
//! the one process named with `share::allow_fd_fetching_by` (as the
//! command line's `info` and `demo` name their probe and consumer
//! children), no other process of the same user, and nobody once the grant
//! is dropped. No GPU is used: it runs with the GPU tests because the GPU
//! host has Yama and root, which it needs to run everything as uid 65534
//! (root's `CAP_SYS_PTRACE` would pass every check).

use std::os::fd::AsRawFd;

use cuda_ipc::share;
use serde_json::{Value, json};

use super::common::{Parent, Peer, role};
use crate::test_name;

/// A process that takes descriptor `fd` of process `pid` when asked.
fn fetcher() {
    let parent = Parent::new();
    parent.send(&json!({ "ready": true }));
    while let Some(req) = parent.recv() {
        let pid = req["pid"].as_u64().unwrap() as u32;
        let fd = req["fd"].as_i64().unwrap() as i32;
        let r = share::fetch_fd(pid, fd);
        parent.send(&json!({ "fetched": r.is_ok(), "error": r.err().map(|e| e.to_string()) }));
    }
}

/// As uid 65534: holds a memfd, starts two fetchers and asks each, before,
/// during and after naming the first.
fn granter() {
    let parent = Parent::new();
    let exe = std::env::current_exe().unwrap();
    let test = test_name!("only_the_named_process_may_take_our_descriptors");
    let memfd = rustix::fs::memfd_create("fd-fetching", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    let spawn = || {
        let p = Peer::spawn_exe_with(&exe, &test, "fetcher", |c| {
            c.current_dir("/tmp");
        });
        assert_eq!(p.recv()["ready"], true);
        p
    };
    let (mut named, mut other) = (spawn(), spawn());
    let ask = |p: &mut Peer| -> Value {
        p.send(&json!({ "pid": std::process::id(), "fd": memfd.as_raw_fd() }));
        p.recv()
    };
    let before = ask(&mut named);
    let grant = share::allow_fd_fetching_by(named.pid()).unwrap();
    let granted = ask(&mut named);
    let not_named = ask(&mut other);
    drop(grant);
    let after = ask(&mut named);
    parent.send(&json!({
        "before": before, "granted": granted, "not_named": not_named, "after": after,
    }));
    assert!(named.finish() && other.finish());
}

#[test]
#[ignore = "needs Yama's ptrace_scope 1 and root, as on the GPU host"]
fn only_the_named_process_may_take_our_descriptors() {
    match role().as_deref() {
        Some("granter") => return granter(),
        Some("fetcher") => return fetcher(),
        _ => {}
    }
    let scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope").ok();
    if scope.as_deref().map(str::trim) != Some("1") {
        println!(
            "SKIPPED: kernel.yama.ptrace_scope is {scope:?}, not 1: every process of a user may take its descriptors"
        );
        return;
    }
    if !rustix::process::geteuid().is_root() {
        println!(
            "SKIPPED: needs root to run the processes as another user (without CAP_SYS_PTRACE)"
        );
        return;
    }
    let dir = tempfile::Builder::new()
        .prefix("cuda-ipc-fd-fetching")
        .tempdir_in("/tmp")
        .unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    // The executable must be reachable by the other user.
    let exe = dir.path().join("gpu-tests");
    std::fs::copy(std::env::current_exe().unwrap(), &exe).unwrap();
    let test = test_name!("only_the_named_process_may_take_our_descriptors");
    let p = Peer::spawn_exe_with(&exe, &test, "granter", |c| {
        std::os::unix::process::CommandExt::uid(c, 65534);
        std::os::unix::process::CommandExt::gid(c, 65534);
        c.current_dir("/tmp");
    });
    let r = p.recv();
    println!("{r}");
    assert_eq!(r["before"]["fetched"], false, "taken before any grant: {r}");
    assert_eq!(
        r["granted"]["fetched"], true,
        "the named process was refused: {r}"
    );
    assert_eq!(
        r["not_named"]["fetched"], false,
        "a process not named took it: {r}"
    );
    assert_eq!(
        r["after"]["fetched"], false,
        "taken after the grant was dropped: {r}"
    );
    assert!(p.finish(), "the granter failed");
}
