//! The examples without a GPU: an error is one line on standard
//! error (the `Display` message, never Rust's `Debug` form) and a nonzero
//! exit code that says what kind of error it was (2 bad input, 3 no driver).
//!
//! `cargo test` builds the examples next to the test binaries
//! (`target/<profile>/examples/`); where they are missing the test says so.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

/// The example `name`, built by `cargo test` for this profile.
fn example(name: &str) -> Option<PathBuf> {
    let deps = std::env::current_exe().ok()?.parent()?.to_path_buf();
    let path = deps.parent()?.join("examples").join(name);
    if path.is_file() {
        Some(path)
    } else {
        eprintln!("skipped: {} is not built", path.display());
        None
    }
}

/// Runs `exe` with `args`, `stdin` as its input and the driver disabled.
fn run(exe: &PathBuf, args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(exe)
        .args(args)
        .env("CUDA_IPC_DISABLE_DRIVER", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the example");
    // The example may exit before reading: a broken pipe is not our error.
    let _ = child.stdin.take().unwrap().write_all(stdin.as_bytes());
    child.wait_with_output().expect("wait for the example")
}

/// One line on standard error, starting `who: error:`, naming `why`, no
/// `Debug` output, and exit code `exit`.
fn assert_one_line(o: &Output, who: &str, exit: i32, why: &str) {
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(exit), "{e}");
    assert_eq!(e.lines().count(), 1, "{e}");
    assert!(e.starts_with(&format!("{who}: error: ")), "{e}");
    assert!(e.contains(why), "expected {why:?} in {e}");
    assert!(
        !e.contains(" { ") && !e.contains("Error("),
        "Debug output: {e}"
    );
}

const DESCRIPTOR: &str = r#"{"cuda_ipc":1,"mechanism":"legacy","handle":"HANDLE","alloc_size":4096,"offset":0,"len":64,"dtype":"DTYPE","device_uuid":"GPU-00000000-0000-0000-0000-000000000000","pid":1}"#;

fn descriptor(dtype: &str) -> String {
    DESCRIPTOR
        .replace("HANDLE", &"ab".repeat(64))
        .replace("DTYPE", dtype)
        + "\n"
}

#[test]
fn torch_producer_errors_are_one_line_with_an_exit_code() {
    let Some(exe) = example("torch_producer") else {
        return;
    };
    let who = "torch_producer";
    let o = run(&exe, &[], "");
    assert_one_line(&o, who, 3, "libcuda.so.1) could not be loaded");
    let o = run(&exe, &["--size", "5"], "");
    assert_one_line(&o, who, 2, "--size must be a positive multiple of 4096");
    let o = run(&exe, &["--mechanism", "pigeon"], "");
    assert_one_line(&o, who, 2, "is not one of legacy, vmm, pool, fabric");
    let o = run(&exe, &["--device", "-1"], "");
    assert_one_line(&o, who, 2, "--device \"-1\" is not a device ordinal");
    let o = run(&exe, &["--frobnicate"], "");
    assert_one_line(&o, who, 2, "unknown argument \"--frobnicate\"; usage:");
}

#[test]
fn torch_consumer_errors_are_one_line_with_an_exit_code() {
    let Some(exe) = example("torch_consumer") else {
        return;
    };
    let who = "torch_consumer";
    let o = run(&exe, &[], &descriptor("u32"));
    assert_one_line(&o, who, 3, "libcuda.so.1) could not be loaded");
    let o = run(&exe, &[], &descriptor("f32"));
    assert_one_line(
        &o,
        who,
        2,
        "transforms 32-bit integers; the tensor holds f32",
    );
    let o = run(&exe, &[], "not json\n");
    assert_one_line(&o, who, 2, "expected");
    let o = run(&exe, &[], r#"{"cuda_ipc":1}"#);
    assert_one_line(&o, who, 2, "mechanism");
}

/// The numbered examples (`01-share-buffer` ...) without a driver: one line
/// naming the example and the missing driver, exit 3, at once.
#[test]
fn numbered_examples_say_why_without_a_driver() {
    for name in [
        "01-share-buffer",
        "02-channel",
        "03-weight-set",
        "04-ring",
        "05-service",
        "06-push",
    ] {
        let Some(exe) = example(name) else {
            continue;
        };
        let started = std::time::Instant::now();
        let o = run(&exe, &[], "");
        assert_one_line(&o, name, 3, "CUDA_IPC_DISABLE_DRIVER is set");
        assert!(
            started.elapsed() < std::time::Duration::from_secs(2),
            "{name} took {:?} to say it has no driver",
            started.elapsed()
        );
    }
}
