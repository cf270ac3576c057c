//! `cuda-ipc bench` arguments, without a GPU: everything that can be checked
//! without one is an error with exit code 2 before the driver is loaded
//! (`CUDA_IPC_DISABLE_DRIVER` would otherwise make it exit 3).

use std::process::{Command, Output, Stdio};

fn bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cuda-ipc"))
        .arg("bench")
        .args(args)
        .env("CUDA_IPC_DISABLE_DRIVER", "1")
        .stdin(Stdio::null())
        .output()
        .expect("run cuda-ipc")
}

/// Exit code 2, no panic, and `expected` in the one error line.
fn usage_error(args: &[&str], expected: &str) {
    let o = bench(args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    assert!(
        err.contains(expected),
        "{args:?}: expected {expected:?} in {err}"
    );
    assert!(
        !err.contains("no driver") && !err.contains("libcuda"),
        "{err}"
    );
}

#[test]
fn output_paths_are_checked_before_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing/run.json");
    usage_error(
        &["--quick", "--json-out", missing.to_str().unwrap()],
        "does not exist; create it first",
    );
    usage_error(&["--plot", dir.path().to_str().unwrap()], "is a folder");
    let same = dir.path().join("x");
    let same = same.to_str().unwrap();
    usage_error(&["--json-out", same, "--plot", same], "both name");
    // A good path gets past the checks to the driver: exit 3, not 2, and
    // nothing written.
    let good = dir.path().join("run.json");
    let o = bench(&["--quick", "--json-out", good.to_str().unwrap()]);
    assert_eq!(
        o.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(!good.exists());
}

#[test]
fn a_missing_torch_script_is_an_error_up_front() {
    usage_error(
        &["--torch-script", "/nonexistent/torch_share.py"],
        "--torch-script /nonexistent/torch_share.py is not a file",
    );
}

#[test]
fn reps_zero_is_an_error() {
    usage_error(&["--reps", "0"], "at least 1 sample");
    usage_error(&["--reps", "-1"], "not a whole number");
}

#[test]
fn duplicates_name_the_duplicate() {
    usage_error(
        &["--mechanisms", "vmm,pool,vmm"],
        "--mechanisms names vmm twice",
    );
    usage_error(
        &["--sizes", "2MiB,2097152"],
        "--sizes names 2MiB (2097152 bytes) twice",
    );
    usage_error(&["--only", "ring,ring"], "--only names ring twice");
}

#[test]
fn mechanisms_are_case_insensitive() {
    // Accepted, so the run gets as far as the (disabled) driver.
    let o = bench(&["--mechanisms", "VMM,Legacy", "--sizes", "2MIB"]);
    assert_eq!(
        o.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    usage_error(&["--mechanisms", "FABRIC"], "\"FABRIC\" is not a mechanism");
}

#[test]
fn device_ordinals_say_what_is_wrong() {
    usage_error(&["--device", "-1"], "\"-1\" is not a device ordinal");
    usage_error(&["--devices", "a,b"], "\"a\" is not a device ordinal");
}

#[test]
fn consumer_namespaces_are_checked_before_the_driver() {
    usage_error(
        &["--consumer-namespaces", "pid,net"],
        "\"net\" is not a namespace a consumer can be given; choose from pid, ipc, mount, user, shm",
    );
    usage_error(
        &["--consumer-namespaces", "pid,ipc,Pid"],
        "--consumer-namespaces names pid twice",
    );
    // No unshare to run the consumers with: exit 3, saying so, before the
    // driver (which would say CUDA_IPC_DISABLE_DRIVER).
    let o = Command::new(env!("CARGO_BIN_EXE_cuda-ipc"))
        .args(["bench", "--quick", "--consumer-namespaces", "pid,ipc"])
        .env("CUDA_IPC_DISABLE_DRIVER", "1")
        .env("PATH", "/nonexistent")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(
        err.contains("util-linux `unshare` is not installed") && !err.contains("libcuda"),
        "{err}"
    );
}
