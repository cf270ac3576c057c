//! Multi-process scaffolding for the GPU tests.
//!
//! A test that needs a second process re-runs this test executable with the
//! test's exact name and `CUDA_IPC_TEST_ROLE=<role>` in the environment
//! (never `fork()` after `cuInit`). The test function asks [`role`] first
//! and, in a child, plays that role. Parent and child talk in JSON lines:
//! the child writes `@@ <json>` to standard output (the harness writes its
//! own lines there too, which the parent skips) and reads plain JSON lines
//! from standard input. Every read has a deadline.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::Value;

pub const ROLE_ENV: &str = "CUDA_IPC_TEST_ROLE";
const PREFIX: &str = "@@ ";

/// The deadline for one message from the other process (CUDA start-up included).
pub const TIMEOUT: Duration = Duration::from_secs(60);

/// The role this process plays, if it is a child.
pub fn role() -> Option<String> {
    std::env::var(ROLE_ENV).ok()
}

/// Runs `child` in a child started as `name` ([`Peer::spawn`]), else
/// `test` (the test itself, in the parent); a child of another role is a
/// mistake of the test.
pub fn child_or(name: &str, child: impl FnOnce(), test: impl FnOnce()) {
    match role() {
        Some(r) if r == name => child(),
        Some(other) => panic!("unknown role {other}"),
        None => test(),
    }
}

/// A child process running `test` in `role`.
pub struct Peer {
    child: Child,
    stdin: Option<ChildStdin>,
    rx: mpsc::Receiver<String>,
}

impl Peer {
    /// Starts this executable running test `test` as `role`.
    pub fn spawn(test: &str, role: &str) -> Peer {
        Self::spawn_with(test, role, |_| {})
    }

    /// As [`Peer::spawn`], letting the caller adjust the command (user, environment).
    pub fn spawn_with(test: &str, role: &str, adjust: impl FnOnce(&mut Command)) -> Peer {
        let exe = std::env::current_exe().expect("own executable");
        Self::spawn_exe_with(&exe, test, role, adjust)
    }

    /// As [`Peer::spawn_with`], running a copy of this executable at `exe`.
    pub fn spawn_exe_with(
        exe: &std::path::Path,
        test: &str,
        role: &str,
        adjust: impl FnOnce(&mut Command),
    ) -> Peer {
        let mut cmd = Command::new(exe);
        cmd.args([
            test,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE_ENV, role)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
        adjust(&mut cmd);
        let mut child = cmd.spawn().expect("spawn child test process");
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // The harness may have written "test name ... " on the same
                // line before our message, so look for the prefix anywhere.
                if let Some(at) = line.find(PREFIX)
                    && tx.send(line[at + PREFIX.len()..].to_string()).is_err()
                {
                    break;
                }
            }
        });
        Peer {
            stdin: child.stdin.take(),
            child,
            rx,
        }
    }

    /// Sends one message to the child.
    pub fn send(&mut self, v: &Value) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        writeln!(stdin, "{v}").expect("write to child");
        stdin.flush().expect("flush to child");
    }

    /// The child's next message; panics (failing the test) on timeout or exit.
    pub fn recv(&self) -> Value {
        self.recv_within(TIMEOUT)
    }

    /// The child's next message within `timeout`.
    pub fn recv_within(&self, timeout: Duration) -> Value {
        let line = self.rx.recv_timeout(timeout).unwrap_or_else(|e| {
            panic!("no message from the child process within {timeout:?}: {e}")
        });
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad message {line:?}: {e}"))
    }

    /// The child's next message within `timeout`, or `None` when the child
    /// exited (or closed its standard output) first or the time passed.
    pub fn try_recv_within(&self, timeout: Duration) -> Option<Value> {
        let line = self.rx.recv_timeout(timeout).ok()?;
        Some(serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad message {line:?}: {e}")))
    }

    /// The child's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the child has exited, and its exit status if so.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Closes the child's stdin and waits for it; returns whether it succeeded.
    pub fn finish(mut self) -> bool {
        drop(self.stdin.take());
        self.child.wait().expect("wait for child").success()
    }

    /// Kills the child.
    pub fn kill(self) {
        drop(self);
    }
}

impl Drop for Peer {
    /// A child still running when its test ends (the test failed) is killed,
    /// so that it cannot outlive the test or hold the device.
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The parent's side of the conversation, seen from the child.
pub struct Parent {
    rx: mpsc::Receiver<String>,
}

impl Parent {
    /// Starts reading the parent's messages.
    pub fn new() -> Parent {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Parent { rx }
    }

    /// Sends one message to the parent.
    #[allow(clippy::unused_self)] // the parent's side is this process's stdout
    pub fn send(&self, v: &Value) {
        let mut out = std::io::stdout().lock();
        writeln!(out, "\n{PREFIX}{v}").expect("write to parent");
        out.flush().expect("flush to parent");
    }

    /// The parent's next message (`None` when the parent closed our stdin).
    pub fn recv(&self) -> Option<Value> {
        let line = self.rx.recv_timeout(TIMEOUT).ok()?;
        Some(serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad message {line:?}: {e}")))
    }
}

/// Free device memory of device 0, in bytes, once every release this
/// process retired has run (drops never wait: the reaper unmaps and frees).
pub fn free_memory(device: &cuda_ipc::Device) -> u64 {
    assert!(cuda_ipc::reaper::settle(TIMEOUT), "releases still retiring");
    device.memory_info().expect("cuMemGetInfo").0
}

/// Open file descriptors of this process, once every release this process
/// retired has run.
pub fn open_fds() -> usize {
    assert!(cuda_ipc::reaper::settle(TIMEOUT), "releases still retiring");
    std::fs::read_dir("/proc/self/fd").map_or(0, Iterator::count)
}

/// Holds `stream` up for 300 ms (a host function that sleeps), then fills
/// `buffer` with the byte `byte` there: writes of another library, still
/// queued when the call after this returns.
pub fn queued_fill(
    stream: &cudarc::driver::CudaStream,
    buffer: &impl cuda_ipc::DeviceMemory,
    byte: u8,
) {
    unsafe extern "C" fn hold(_: *mut std::ffi::c_void) {
        std::thread::sleep(Duration::from_millis(300));
    }
    // SAFETY: a live stream of this process; the host function touches no
    // CUDA API; the buffer outlives the fill (the test holds it until the
    // consumer has checked it, after the stream's work).
    unsafe {
        cudarc::driver::result::stream::launch_host_function(
            stream.cu_stream(),
            hold,
            std::ptr::null_mut(),
        )
        .unwrap();
        cudarc::driver::result::memset_d8_async(
            buffer.device_address(),
            byte,
            buffer.byte_len(),
            stream.cu_stream(),
        )
        .unwrap();
    }
}

/// Whether `stream` has finished its work (`cuStreamQuery`).
pub fn stream_done(stream: &cudarc::driver::CudaStream) -> bool {
    // SAFETY: a live stream of this process.
    let r = unsafe { cudarc::driver::sys::cuStreamQuery(stream.cu_stream()) };
    assert!(
        matches!(
            r,
            cudarc::driver::sys::CUresult::CUDA_SUCCESS
                | cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY
        ),
        "cuStreamQuery: {r:?}"
    );
    r == cudarc::driver::sys::CUresult::CUDA_SUCCESS
}
