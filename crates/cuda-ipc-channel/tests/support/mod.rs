//! What the GPU-less integration tests share: child processes that re-run
//! the test executable in a role and talk over stdin/stdout, and memfds
//! with known contents.
// Each test executable uses a part of this module.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rustix::fs::{MemfdFlags, memfd_create};

pub mod wire;

/// A command that runs the test executable `exe` for `test` alone, with
/// piped stdin and stdout (stderr shows in the parent's output). Set the
/// role's environment on it, then [`ChildProc::start`] it.
pub fn test_command(exe: &Path, test: &str) -> Command {
    let mut cmd = Command::new(exe);
    cmd.args([test, "--exact", "--nocapture", "--test-threads=1"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    cmd
}

/// A child process (see [`test_command`]); killed on drop.
pub struct ChildProc {
    child: Child,
    stdin: Option<ChildStdin>,
    /// Lines of stdout, with the moment each arrived.
    lines: mpsc::Receiver<(String, Instant)>,
    /// Lines received but not yet asked for.
    seen: Vec<(String, Instant)>,
}

impl ChildProc {
    /// Starts `cmd` and reads its stdout on a thread.
    pub fn start(mut cmd: Command) -> std::io::Result<ChildProc> {
        let mut child = cmd.spawn()?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send((line, Instant::now())).is_err() {
                    break;
                }
            }
        });
        let stdin = child.stdin.take();
        Ok(ChildProc {
            child,
            stdin,
            lines,
            seen: Vec::new(),
        })
    }

    /// Waits for a line containing `marker` (libtest may print the test
    /// name before it on the same line; lines that arrived earlier count
    /// too) and returns it with the moment it arrived, or `None` after
    /// `timeout`.
    pub fn try_line(&mut self, marker: &str, timeout: Duration) -> Option<(String, Instant)> {
        if let Some(i) = self.seen.iter().position(|(l, _)| l.contains(marker)) {
            return Some(self.seen.remove(i));
        }
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok((line, at)) if line.contains(marker) => return Some((line, at)),
                Ok(other) => self.seen.push(other),
                Err(_) => return None,
            }
        }
    }

    /// As [`ChildProc::try_line`], failing the test after `timeout`.
    pub fn line(&mut self, marker: &str, timeout: Duration) -> (String, Instant) {
        self.try_line(marker, timeout).unwrap_or_else(|| {
            let status = self.child.try_wait().ok().flatten();
            panic!(
                "child {} did not print {marker:?} within {timeout:?} (exit status: {status:?})",
                self.child.id()
            )
        })
    }

    /// The text after `marker` on the first line that contains it, trimmed.
    pub fn after(&mut self, marker: &str, timeout: Duration) -> String {
        let (line, _) = self.line(marker, timeout);
        let at = line.find(marker).expect("the line contains the marker");
        line[at + marker.len()..].trim().to_owned()
    }

    /// Closes the child's stdin: the signal to finish.
    pub fn close_stdin(&mut self) {
        self.stdin = None;
    }

    /// Waits up to `timeout` for the child to exit successfully.
    pub fn wait_success(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(
                    status.success(),
                    "child {} failed: {status}",
                    self.child.id()
                );
                return;
            }
            assert!(
                Instant::now() < deadline,
                "child {} did not exit within {timeout:?}",
                self.child.id()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Closes stdin and waits for a clean exit.
    pub fn finish(&mut self, timeout: Duration) {
        self.close_stdin();
        self.wait_success(timeout);
    }

    /// SIGKILL, and reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.kill();
        }
    }
}

/// `len` bytes that differ with `seed` and along the buffer.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// A memfd holding `bytes`.
pub fn memfd_with(bytes: &[u8]) -> OwnedFd {
    let fd = memfd_create("cuda-ipc-test", MemfdFlags::CLOEXEC).unwrap();
    let mut written = 0;
    while written < bytes.len() {
        written += rustix::io::pwrite(&fd, &bytes[written..], written as u64).unwrap();
    }
    fd
}

/// Publishes the entry `"e"` (metadata `{"len": 4}`) with two 4-byte memfds,
/// `abcd` and `efgh`: what the descriptor tests attach.
pub fn publish_two_fds(server: &cuda_ipc_channel::Server) {
    server
        .publish(
            "e",
            serde_json::json!({"len": 4}),
            vec![memfd_with(b"abcd"), memfd_with(b"efgh")],
        )
        .unwrap();
}

/// Up to `len` bytes from the start of `fd` (fewer if the file is shorter).
pub fn read_fd(fd: impl AsFd, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    let mut got = 0;
    while got < len {
        let n = rustix::io::pread(&fd, &mut buf[got..], got as u64).unwrap();
        if n == 0 {
            break;
        }
        got += n;
    }
    buf.truncate(got);
    buf
}
