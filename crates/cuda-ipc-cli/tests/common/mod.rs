//! What the command-line tests share: running the program (with the driver
//! disabled, so that the no-driver path is the same on GPU hosts) and
//! checking its one-sentence errors and exit codes.
#![allow(dead_code)] // each test binary uses its own part

use std::io::Write;
use std::process::{Command, Output, Stdio};

/// The program with `args`, the driver disabled.
pub fn command(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_cuda-ipc"));
    c.args(args).env("CUDA_IPC_DISABLE_DRIVER", "1");
    c
}

/// Runs the program with `args` and no standard input.
pub fn cuda_ipc(args: &[&str]) -> Output {
    command(args)
        .stdin(Stdio::null())
        .output()
        .expect("run cuda-ipc")
}

/// Runs cuda-ipc with `input` on its standard input (written from a thread,
/// so that a command that stops reading early does not block the test);
/// also returns how many bytes of the input it took before it exited.
pub fn cuda_ipc_with_input(args: &[&str], input: Vec<u8>) -> (Output, usize) {
    let mut child = command(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run cuda-ipc");
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || {
        let mut written = 0;
        for chunk in input.chunks(64 << 10) {
            if stdin.write_all(chunk).is_err() {
                break;
            }
            written += chunk.len();
        }
        written
    });
    let out = child.wait_with_output().expect("wait for cuda-ipc");
    (out, writer.join().unwrap())
}

/// The exit code (the program exited, it was not killed).
pub fn code(o: &Output) -> i32 {
    o.status.code().expect("exited, not killed")
}

/// Standard error as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn assert_no_panic(o: &Output) {
    let e = stderr(o);
    assert!(!e.contains("panicked"), "cuda-ipc panicked: {e}");
    assert_ne!(code(o), 101, "cuda-ipc panicked: {e}");
    // No Rust `Debug` output: `Error: DriverNotFound { reason: .. }` and the like.
    assert!(!e.contains(" { "), "Debug output: {e}");
}

/// Asserts one short error sentence on standard error, naming `why`, and the exit code.
pub fn assert_error(args: &[&str], o: &Output, exit: i32, why: &str) {
    assert_no_panic(o);
    let e = stderr(o);
    assert_eq!(code(o), exit, "{args:?}: {e}");
    assert!(e.contains(why), "{args:?}: expected {why:?} in {e}");
    // One style for every error, the parser's included.
    assert!(
        e.starts_with("cuda-ipc: error: "),
        "{args:?}: the error does not start with `cuda-ipc: error: `: {e}"
    );
    assert!(e.len() < 1200, "{args:?}: {} bytes of error: {e}", e.len());
}

/// A well-formed legacy handle (128 hex digits) that names no memory.
pub const HANDLE: &str = "abababababababababababababababababababababababababababababababababababababababababababababababababababababababababababababababab";

/// A valid descriptor (legacy, 16 bytes of u32) as one JSON line.
pub fn descriptor(len: u64) -> String {
    r#"{"cuda_ipc":1,"mechanism":"legacy","handle":"HANDLE","alloc_size":4096,"offset":0,"len":LEN,"dtype":"u32","device_uuid":"GPU-00000000-0000-0000-0000-000000000000","pid":1}"#
        .replace("HANDLE", HANDLE)
        .replace("LEN", &len.to_string())
}
