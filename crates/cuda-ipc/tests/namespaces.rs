//! Descriptors across PID namespaces, without a GPU: what `pidfd_getfd`
//! (the fallback that fetches a vmm or pool export's descriptor from the
//! exporter) says when the exporter's pid is not visible.
//!
//! The child is this test executable re-run through util-linux
//! `unshare --pid --fork --mount-proc`; where that is not allowed the test
//! prints why and passes without running.

use std::process::{Command, Stdio};

use cuda_ipc::container::namespaces;
use cuda_ipc::share::fetch_fd;

/// Whether this process runs in a PID namespace other than the machine's
/// initial one (`None`: unknown).
fn in_nested_pid_namespace() -> Option<bool> {
    namespaces()
        .into_iter()
        .find(|n| n.kind == "pid")
        .and_then(|n| n.differs)
}

const ROLE_ENV: &str = "CUDA_IPC_NS_FETCH_PID";

#[test]
fn an_exporter_outside_our_pid_namespace_is_not_visible_rather_than_exited() {
    if let Ok(pid) = std::env::var(ROLE_ENV) {
        // The child, in a PID namespace of its own: the parent is alive but
        // has no pid here.
        let pid: u32 = pid.parse().unwrap();
        assert_eq!(in_nested_pid_namespace(), Some(true));
        let e = fetch_fd(pid, 0).unwrap_err().to_string();
        assert!(
            e.contains("not visible from this PID namespace (a container?)")
                && e.contains("cuda-ipc serve")
                && !e.contains("has exited"),
            "{e}"
        );
        println!("CHILD-OK");
        return;
    }
    let flags = ["--pid", "--fork", "--mount-proc", "--kill-child"];
    let refused = Command::new("unshare")
        .args(flags)
        .arg("true")
        .stdin(Stdio::null())
        .output()
        .map_or(true, |o| !o.status.success());
    if refused {
        println!("skipped: `unshare --pid --fork --mount-proc` is not allowed here");
        return;
    }
    let me = std::process::id();
    // A pid that small would exist in the child's namespace too.
    if me < 16 {
        println!("skipped: this process's pid {me} may exist in the new namespace");
        return;
    }
    let out = Command::new("unshare")
        .args(flags)
        .arg("--")
        .arg(std::env::current_exe().unwrap())
        .args([
            "an_exporter_outside_our_pid_namespace_is_not_visible_rather_than_exited",
            "--exact",
            "--nocapture",
        ])
        .env(ROLE_ENV, me.to_string())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("CHILD-OK"),
        "child: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn an_exporter_that_exited_in_our_own_namespace_has_exited() {
    if std::env::var(ROLE_ENV).is_ok() {
        return;
    }
    if in_nested_pid_namespace() != Some(false) {
        println!("skipped: this test runs in a PID namespace of its own");
        return;
    }
    let mut child = Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    let e = fetch_fd(pid, 0).unwrap_err().to_string();
    assert!(e.contains("has exited"), "{e}");
}
