//! JSON lines between a parent process and the child it started (the
//! bench's consumers, and the CLI's demo and probes): the parent writes to
//! the child's standard input and reads its standard output, with a
//! deadline on every read and a bound on every line, so a dead, stuck or
//! babbling child is an error, not a hang.

use std::io::{BufRead, BufReader, Read, Write};
use std::sync::mpsc;
use std::time::Duration;

use cuda_ipc::{Error, channel::ChannelError};
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
    pub fn new(input: impl Read + Send + 'static, what: &'static str) -> Self {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut input = BufReader::new(input);
            loop {
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

    /// The next JSON line, within `timeout`.
    pub fn next(&self, timeout: Duration) -> Result<Value, Error> {
        match self.rx.recv_timeout(timeout) {
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
