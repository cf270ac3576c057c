//! JSON lines between a parent process and the child it started (the
//! bench's consumers, and the CLI's demo and probes): the parent writes to
//! the child's standard input and reads its standard output, with a
//! deadline on every read and a bound on every line, so a dead, stuck or
//! babbling child is an error, not a hang.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::{OnceLock, mpsc};
use std::time::{Duration, Instant};

use cuda_ipc::{Error, channel::ChannelError};
use rustix::event::{PollFd, PollFlags, Timespec, poll};
use serde_json::Value;

/// The longest line [`LineReader`] accepts from another process.
const MAX_MESSAGE: usize = 64 << 20;

/// Why [`read_line`] returned no line.
#[derive(Debug)]
pub enum LineError {
    /// The line is longer than the limit.
    TooLong,
    /// The line is not UTF-8.
    NotUtf8,
    /// Reading failed.
    Io(std::io::Error),
}

impl From<LineError> for std::io::Error {
    fn from(e: LineError) -> Self {
        match e {
            LineError::TooLong => {
                std::io::Error::new(std::io::ErrorKind::InvalidData, "a line is too long")
            }
            LineError::NotUtf8 => {
                std::io::Error::new(std::io::ErrorKind::InvalidData, "a line is not UTF-8")
            }
            LineError::Io(e) => e,
        }
    }
}

/// Reads one line (without its newline) of at most `max` bytes, holding no
/// more than `max + 1` bytes whatever the input; `None` at the end of input.
pub fn read_line(input: &mut impl BufRead, max: usize) -> Result<Option<String>, LineError> {
    let mut buf = Vec::new();
    let limit = max as u64 + 1;
    // read_until retries interrupted reads itself.
    let n = input
        .by_ref()
        .take(limit)
        .read_until(b'\n', &mut buf)
        .map_err(LineError::Io)?;
    if n == 0 {
        return Ok(None);
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
    }
    if buf.len() > max {
        return Err(LineError::TooLong);
    }
    String::from_utf8(buf)
        .map(Some)
        .map_err(|_| LineError::NotUtf8)
}

/// Reads JSON lines from a stream on a background thread.
pub struct LineReader {
    rx: mpsc::Receiver<std::io::Result<String>>,
    what: &'static str,
}

impl LineReader {
    /// Starts reading `input`; `what` names the other side in errors.
    pub fn new(input: impl Read + AsFd + Send + 'static, what: &'static str) -> Self {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut input = BufReader::new(input);
            loop {
                if input.buffer().is_empty() {
                    poll_readable(input.get_ref().as_fd(), awake_spin());
                }
                let line = match read_line(&mut input, MAX_MESSAGE) {
                    Ok(Some(line)) => Ok(line),
                    Ok(None) => break,
                    Err(e) => Err(e.into()),
                };
                let stop = line.is_err();
                if tx.send(line).is_err() || stop {
                    break;
                }
            }
        });
        LineReader { rx, what }
    }

    /// The next JSON line, within `timeout`. With [`awake_spin`] set, the
    /// calling thread polls for it that long before it sleeps (as does the
    /// thread that reads the lines).
    pub fn next(&self, timeout: Duration) -> Result<Value, Error> {
        self.next_polling(timeout, awake_spin())
    }

    /// [`next`](Self::next), polling for the line for up to `spin` first.
    fn next_polling(&self, timeout: Duration, spin: Duration) -> Result<Value, Error> {
        let started = Instant::now();
        let got = loop {
            if started.elapsed() >= spin {
                let left = timeout.saturating_sub(started.elapsed());
                break self.rx.recv_timeout(left);
            }
            match self.rx.try_recv() {
                Ok(line) => break Ok(line),
                Err(mpsc::TryRecvError::Empty) => std::hint::spin_loop(),
                Err(mpsc::TryRecvError::Disconnected) => {
                    break Err(mpsc::RecvTimeoutError::Disconnected);
                }
            }
        };
        match got {
            Ok(Ok(line)) => serde_json::from_str(&line).map_err(|e| Error::InvalidArgument {
                what: "message",
                reason: format!(
                    "the {} sent a line that is not JSON ({e}): {line:?}",
                    self.what
                ),
            }),
            Ok(Err(e)) => Err(Error::Io {
                context: format!("reading from the {}", self.what),
                source: e,
            }),
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(ChannelError::PeerGone.into()),
            Err(mpsc::RecvTimeoutError::Timeout) => Err(Error::Io {
                context: format!("waiting for the {}", self.what),
                source: std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no answer within {timeout:?}"),
                ),
            }),
        }
    }
}

/// Polls `fd` for up to `spin` (none when zero) until it is readable: the
/// blocking read that follows then finds its bytes without sleeping.
pub fn poll_readable(fd: BorrowedFd<'_>, spin: Duration) {
    if spin.is_zero() {
        return;
    }
    let started = Instant::now();
    let now = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    while started.elapsed() < spin {
        let mut fds = [PollFd::new(&fd, PollFlags::IN)];
        if poll(&mut fds, Some(&now)).is_ok_and(|n| n > 0) {
            return;
        }
        std::hint::spin_loop();
    }
}

/// The variable that keeps the bench's processes awake between messages:
/// microseconds that a process waiting for the other's next line polls
/// for it before it sleeps (unset or 0, the default: it sleeps at once).
/// The bench's consumers, its Python script and the bench itself read it.
pub const AWAKE_VAR: &str = "CUDA_IPC_BENCH_AWAKE_US";

/// The longest poll [`AWAKE_VAR`] may ask for, µs.
pub const MAX_AWAKE_US: u64 = 50_000;

/// How long a process of the bench polls for the other's next line before
/// it sleeps ([`AWAKE_VAR`]; zero unless set, or set to a bad value, which
/// the bench refuses before it starts: [`parse_awake`]).
pub fn awake_spin() -> Duration {
    static SPIN: OnceLock<Duration> = OnceLock::new();
    *SPIN.get_or_init(|| {
        parse_awake(std::env::var_os(AWAKE_VAR).as_deref()).unwrap_or(Duration::ZERO)
    })
}

/// Parses [`AWAKE_VAR`]'s value: unset or empty is zero, otherwise a whole
/// number of microseconds up to [`MAX_AWAKE_US`].
#[allow(clippy::unnecessary_debug_formatting)] // quoted, with escapes: the value as given
pub fn parse_awake(value: Option<&std::ffi::OsStr>) -> Result<Duration, String> {
    let Some(value) = value else {
        return Ok(Duration::ZERO);
    };
    let text = value.to_str().map_or("?", str::trim);
    if text.is_empty() {
        return Ok(Duration::ZERO);
    }
    match text.parse::<u64>() {
        Ok(us) if us <= MAX_AWAKE_US => Ok(Duration::from_micros(us)),
        _ => Err(format!(
            "{AWAKE_VAR}={value:?} is not a whole number of microseconds from 0 to \
             {MAX_AWAKE_US}; unset it, or give how long the bench's processes poll for each \
             other's next message before they sleep"
        )),
    }
}

/// Writes one JSON line and flushes.
pub fn send(out: &mut impl Write, value: &Value) -> Result<(), Error> {
    writeln!(out, "{value}")
        .and_then(|()| out.flush())
        .map_err(|e| Error::Io {
            context: "writing to the other process".into(),
            source: e,
        })
}

/// A field of a message, or an error naming it.
pub fn field<'a>(v: &'a Value, key: &str) -> Result<&'a Value, Error> {
    v.get(key).ok_or_else(|| Error::InvalidArgument {
        what: "message",
        reason: format!("missing {key:?} in {v}"),
    })
}

#[cfg(test)]
mod tests {
    use std::ffi::OsStr;
    use std::io::Write as _;

    use super::*;

    #[test]
    fn the_awake_poll_is_whole_microseconds_up_to_the_limit() {
        assert_eq!(parse_awake(None), Ok(Duration::ZERO));
        assert_eq!(parse_awake(Some(OsStr::new(""))), Ok(Duration::ZERO));
        assert_eq!(
            parse_awake(Some(OsStr::new(" 250 "))),
            Ok(Duration::from_micros(250))
        );
        assert_eq!(
            parse_awake(Some(OsStr::new("50000"))),
            Ok(Duration::from_millis(50))
        );
        for bad in ["50001", "-1", "1.5", "20ms", "0x10"] {
            let e = parse_awake(Some(OsStr::new(bad))).unwrap_err();
            assert!(e.contains(&format!("{AWAKE_VAR}={bad:?}")), "{e}");
            assert!(e.contains("from 0 to 50000"), "{e}");
        }
    }

    #[test]
    fn a_poll_ends_when_bytes_come_or_its_time_is_up() {
        let (r, w) = rustix::pipe::pipe().unwrap();
        // Nothing to read: it returns once its time is up.
        let t = Instant::now();
        poll_readable(r.as_fd(), Duration::from_millis(20));
        assert!(t.elapsed() >= Duration::from_millis(20));
        // A zero spin does not poll at all.
        let t = Instant::now();
        poll_readable(r.as_fd(), Duration::ZERO);
        assert!(t.elapsed() < Duration::from_secs(1));
        // Bytes waiting: it returns long before a spin of a minute.
        rustix::io::write(&w, b"x\n").unwrap();
        let t = Instant::now();
        poll_readable(r.as_fd(), Duration::from_secs(60));
        assert!(t.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn a_polling_reader_gets_lines_and_sees_the_writer_go() {
        let (r, w) = rustix::pipe::pipe().unwrap();
        let reader = LineReader::new(std::fs::File::from(r), "test peer");
        let mut w = std::fs::File::from(w);
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(5));
            writeln!(w, "{{\"n\": 1}}").unwrap();
            std::thread::sleep(Duration::from_millis(5));
            writeln!(w, "{{\"n\": 2}}").unwrap();
        });
        let spin = Duration::from_millis(200);
        let timeout = Duration::from_secs(30);
        assert_eq!(reader.next_polling(timeout, spin).unwrap()["n"], 1);
        assert_eq!(reader.next_polling(timeout, spin).unwrap()["n"], 2);
        writer.join().unwrap();
        // The writer is gone: polling or not, that is the peer gone.
        let e = reader.next_polling(timeout, spin).unwrap_err();
        assert!(matches!(e, Error::Channel(ChannelError::PeerGone)), "{e}");
    }
}
