//! The producer's side of the conversation with a consumer process: start
//! `cuda-ipc __bench-worker`, send it one JSON line per request, read its
//! answers with a deadline. A consumer that answers `{"error": ...}` or dies
//! is an error naming the consumer.

use std::io::Write;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use cuda_ipc::Error;
use cuda_ipc::channel::ChannelError;
use serde_json::{Value, json};

use crate::lines::LineReader;
use crate::namespaces::ConsumerNamespaces;

/// The phases of the last run of the library's `call` in this process
/// (`cuda_ipc::phases`), as `{phase: µs}` for an answer.
pub fn phases_json(call: &str) -> serde_json::Value {
    serde_json::Value::Object(
        cuda_ipc::phases::last(call)
            .into_iter()
            .map(|(phase, us)| (phase.to_owned(), serde_json::json!(us)))
            .collect(),
    )
}

/// Nanoseconds of CLOCK_MONOTONIC, comparable between processes of one machine.
pub fn mono_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// An error with a sentence of context (the run-time failure class: exit 4).
pub fn failure(context: impl Into<String>, why: impl std::fmt::Display) -> Error {
    Error::Io {
        context: context.into(),
        source: std::io::Error::other(why.to_string()),
    }
}

/// Writes `value` and a newline in one `write` (so the reader wakes once)
/// and flushes.
pub fn send_line(out: &mut impl Write, value: &Value) -> Result<(), Error> {
    let mut line = value.to_string();
    line.push('\n');
    out.write_all(line.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| Error::Io {
            context: "writing to the other process".into(),
            source: e,
        })
}

/// How long a consumer may take to start (CUDA start-up included).
pub const START_TIMEOUT: Duration = Duration::from_secs(120);
/// How long one request may take (an 8 GiB attach included).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

/// A consumer process.
pub struct Worker {
    child: Child,
    stdin: Option<ChildStdin>,
    reader: LineReader,
    /// Its name in errors, for example "consumer 3".
    pub label: String,
    /// How long its CUDA start-up took, ms.
    pub startup_ms: f64,
    /// How long it gets to exit after `bye` before it is killed.
    pub grace: Duration,
}

impl Worker {
    /// Starts a consumer on device `device`, in `namespaces`, without
    /// waiting for it.
    pub fn spawn(
        device: usize,
        namespaces: &ConsumerNamespaces,
        label: &str,
    ) -> Result<Worker, Error> {
        let exe = std::env::current_exe().map_err(|e| Error::Io {
            context: "finding our own executable to start a consumer".into(),
            source: e,
        })?;
        let mut command = namespaces.command(exe);
        command.args(["__bench-worker", "--device", &device.to_string()]);
        Worker::spawn_command(command, label)
    }

    /// Starts `command` as a consumer (tests use stand-ins).
    pub fn spawn_command(mut command: Command, label: &str) -> Result<Worker, Error> {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| Error::Io {
                context: format!("starting {label} (cuda-ipc __bench-worker)"),
                source: e,
            })?;
        let stdin = child.stdin.take();
        let reader = LineReader::new(
            child.stdout.take().expect("stdout is piped"),
            "consumer process",
        );
        Ok(Worker {
            child,
            stdin,
            reader,
            label: label.to_string(),
            startup_ms: f64::NAN,
            grace: Duration::from_secs(10),
        })
    }

    /// Waits for the consumer's "ready" (it opened the device).
    pub fn wait_ready(&mut self) -> Result<(), Error> {
        let v = self.recv(START_TIMEOUT)?;
        if v["ready"] != json!(true) {
            return Err(failure(
                format!("{} did not start", self.label),
                format!("it said {v}"),
            ));
        }
        self.startup_ms = v["startup_ms"].as_f64().unwrap_or(f64::NAN);
        Ok(())
    }

    /// Starts a consumer (in `namespaces`) and waits until it is ready.
    pub fn start(
        device: usize,
        namespaces: &ConsumerNamespaces,
        label: &str,
    ) -> Result<Worker, Error> {
        let mut w = Worker::spawn(device, namespaces, label)?;
        w.wait_ready()?;
        Ok(w)
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Sends one request without waiting for the answer.
    pub fn send(&mut self, request: &Value) -> Result<(), Error> {
        let Some(stdin) = self.stdin.as_mut() else {
            return Err(failure(&self.label, "its input is closed"));
        };
        let sent = send_line(stdin, request);
        sent.map_err(|e| self.died(e))
    }

    /// The next answer, within `timeout`. An `{"error": ...}` answer is an error.
    pub fn recv(&mut self, timeout: Duration) -> Result<Value, Error> {
        let read = self.reader.next(timeout);
        let v = read.map_err(|e| self.died(e))?;
        if let Some(e) = v.get("error") {
            return Err(failure(
                format!("{} reported", self.label),
                e.as_str().map_or_else(|| e.to_string(), str::to_string),
            ));
        }
        Ok(v)
    }

    /// Sends a request and waits for its answer.
    pub fn request(&mut self, request: &Value, timeout: Duration) -> Result<Value, Error> {
        self.send(request)?;
        self.recv(timeout)
    }

    /// Turns a failed read or write into an error that says whether the
    /// process exited, and how.
    fn died(&mut self, e: Error) -> Error {
        let gone = matches!(&e, Error::Channel(ChannelError::PeerGone))
            || matches!(&e, Error::Io { source, .. } if source.kind() == std::io::ErrorKind::BrokenPipe);
        if !gone {
            return failure(&self.label, e);
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => {
                    return failure(
                        &self.label,
                        format!("the process exited ({status}); its standard error is above"),
                    );
                }
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                _ => return failure(&self.label, "the process closed its output"),
            }
        }
    }

    /// Asks the consumer to exit and waits for it (killing it after
    /// [`Worker::grace`]).
    pub fn close(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if let Some(mut stdin) = self.stdin.take() {
            let _ = send_line(&mut stdin, &json!({ "op": "bye" }));
        }
        let deadline = Instant::now() + self.grace;
        loop {
            match self.child.try_wait() {
                Ok(Some(_)) | Err(_) => return,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Ok(None) => {
                    // Our own child, by its handle.
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return;
                }
            }
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Reads field `key` of a consumer's answer as `u64`.
pub fn get_u64(v: &Value, key: &str) -> Result<u64, Error> {
    v.get(key)
        .and_then(Value::as_u64)
        .ok_or_else(|| failure("a consumer's answer", format!("no integer {key:?} in {v}")))
}

/// Reads field `key` of a consumer's answer as `f64`.
pub fn get_f64(v: &Value, key: &str) -> Result<f64, Error> {
    v.get(key)
        .and_then(Value::as_f64)
        .ok_or_else(|| failure("a consumer's answer", format!("no number {key:?} in {v}")))
}

/// Reads field `key` of a consumer's answer as a list of numbers.
pub fn get_f64s(v: &Value, key: &str) -> Result<Vec<f64>, Error> {
    v.get(key)
        .and_then(Value::as_array)
        .and_then(|a| a.iter().map(Value::as_f64).collect::<Option<Vec<f64>>>())
        .ok_or_else(|| failure("a consumer's answer", format!("no list of numbers {key:?}")))
}

/// How long a sample's teardown waits for what its drops retired.
const SETTLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Waits (up to [`SETTLE_TIMEOUT`]) until the frees and closes that drops
/// handed to the library's reaper have run, as part of a sample's
/// teardown. A drop no longer frees at once (it retires the free until the
/// GPU is done); left running, the reaper's `cuMemFree` of one sample's
/// buffer lands in the next sample's clock, inside the driver's export or
/// import. Timed per buffer, this cost belongs to the teardown, where it
/// was when drops freed at once.
///
/// A step that does not finish in time is left to the reaper, which logs
/// it (after 10 s); the sample still counts.
pub(crate) fn settle_retired() {
    let _ = cuda_ipc::reaper::settle(SETTLE_TIMEOUT);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_is_monotonic_nanoseconds() {
        let a = mono_ns();
        std::thread::sleep(Duration::from_millis(2));
        let b = mono_ns();
        assert!(b - a >= 2_000_000, "{a} {b}");
        assert!(b - a < 2_000_000_000);
    }

    #[test]
    fn one_line_per_message() {
        let mut out = Vec::new();
        send_line(&mut out, &json!({"op": "attach", "name": "a b"})).unwrap();
        send_line(&mut out, &json!({"op": "bye"})).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(
            serde_json::from_str::<Value>(lines[0]).unwrap()["name"],
            "a b"
        );
    }

    /// A stand-in consumer written in Python, or `None` without python3.
    fn fake(script: &str) -> Option<Worker> {
        if Command::new("python3").arg("--version").output().is_err() {
            eprintln!("skipped: no python3 here");
            return None;
        }
        let mut c = Command::new("python3");
        c.args(["-u", "-c", script]);
        Some(Worker::spawn_command(c, "consumer 1").unwrap())
    }

    const ECHO: &str = r#"
import json, sys
print(json.dumps({"ready": True, "startup_ms": 12.5}))
for line in sys.stdin:
    r = json.loads(line)
    if r["op"] == "bye":
        break
    if r["op"] == "fail":
        print(json.dumps({"error": "attach: no entry named \"x\""}))
    elif r["op"] == "die":
        sys.exit(3)
    else:
        print(json.dumps({"echo": r["op"]}))
"#;

    #[test]
    fn requests_answers_and_errors() {
        let Some(mut w) = fake(ECHO) else { return };
        w.wait_ready().unwrap();
        assert!((w.startup_ms - 12.5).abs() < 1e-12);
        assert!(w.alive());
        let a = w
            .request(&json!({"op": "ping"}), Duration::from_secs(10))
            .unwrap();
        assert_eq!(a["echo"], "ping");
        let e = w
            .request(&json!({"op": "fail"}), Duration::from_secs(10))
            .unwrap_err()
            .to_string();
        assert_eq!(e, "consumer 1 reported: attach: no entry named \"x\"");
        w.close();
    }

    #[test]
    fn a_dead_consumer_says_how_it_ended() {
        let Some(mut w) = fake(ECHO) else { return };
        w.wait_ready().unwrap();
        let e = w
            .request(&json!({"op": "die"}), Duration::from_secs(10))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("consumer 1: the process exited"), "{e}");
        assert!(e.contains('3'), "{e}");
        assert!(!w.alive());
        // writing to it now fails clearly too
        let e = w
            .request(&json!({"op": "ping"}), Duration::from_secs(10))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("consumer 1"), "{e}");
    }

    #[test]
    fn a_consumer_that_cannot_start() {
        let Some(mut w) =
            fake("import json; print(json.dumps({'error': 'opening the device: no driver'}))")
        else {
            return;
        };
        let e = w.wait_ready().unwrap_err().to_string();
        assert!(e.contains("opening the device: no driver"), "{e}");
        let Some(mut w) = fake("print('not json')") else {
            return;
        };
        let e = w.wait_ready().unwrap_err().to_string();
        assert!(e.contains("not JSON"), "{e}");
    }

    #[test]
    fn a_silent_consumer_times_out() {
        let Some(mut w) = fake("import time; time.sleep(30)") else {
            return;
        };
        let e = w.recv(Duration::from_millis(200)).unwrap_err().to_string();
        assert!(e.contains("no answer within"), "{e}");
        w.grace = Duration::from_millis(100);
        let t = Instant::now();
        drop(w); // killed after the bye is ignored
        assert!(t.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn a_consumer_in_new_namespaces_talks_over_its_pipes_and_is_killed_with_its_wrapper() {
        let list = [
            crate::namespaces::Namespace::Pid,
            crate::namespaces::Namespace::Ipc,
            crate::namespaces::Namespace::Shm,
        ];
        let ns = ConsumerNamespaces::new(&list).unwrap();
        if let Err(e) = ns.check_allowed() {
            println!("skipped: {e}");
            return;
        }
        if Command::new("python3").arg("--version").output().is_err() {
            println!("skipped: no python3 here");
            return;
        }
        let mut c = ns.command("python3");
        c.args(["-u", "-c", ECHO]);
        let mut w = Worker::spawn_command(c, "consumer 1").unwrap();
        w.wait_ready().unwrap();
        let a = w
            .request(&json!({"op": "ping"}), Duration::from_secs(10))
            .unwrap();
        assert_eq!(a["echo"], "ping");
        w.close();
        // A consumer that ignores `bye` is killed with its wrapper
        // (unshare's --kill-child), not left behind.
        let marker = format!("cuda-ipc-bench-stuck-{}-{}", std::process::id(), mono_ns());
        let script = format!("import time; print('{{}}'); time.sleep(30)  # {marker}");
        let mut c = ns.command("python3");
        c.args(["-u", "-c", &script]);
        let mut w = Worker::spawn_command(c, "consumer 2").unwrap();
        assert_eq!(w.recv(Duration::from_secs(10)).unwrap(), json!({}));
        let running = || {
            std::fs::read_dir("/proc").unwrap().flatten().any(|e| {
                std::fs::read(e.path().join("cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&marker))
            })
        };
        assert!(running(), "the consumer is not running");
        w.grace = Duration::from_millis(100);
        let t = Instant::now();
        drop(w);
        assert!(t.elapsed() < Duration::from_secs(5));
        let gone = Instant::now() + Duration::from_secs(5);
        while running() {
            assert!(Instant::now() < gone, "the consumer outlived its wrapper");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    #[test]
    fn answer_fields() {
        let v = json!({"t": 5, "ms": 1.5, "xs": [1, 2.5]});
        assert_eq!(get_u64(&v, "t").unwrap(), 5);
        assert!((get_f64(&v, "ms").unwrap() - 1.5).abs() < 1e-12);
        assert_eq!(get_f64s(&v, "xs").unwrap(), vec![1.0, 2.5]);
        let e = get_u64(&v, "missing").unwrap_err().to_string();
        assert!(e.contains("\"missing\""), "{e}");
        assert!(get_f64s(&json!({"xs": ["a"]}), "xs").is_err());
    }
}
