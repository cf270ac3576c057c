//! JSON lines between a parent process and the child it started: the
//! parent writes to the child's standard input and reads its standard
//! output, with a deadline on every read so a dead or stuck child is an
//! error, not a hang.

use std::io::{BufRead, BufReader, Read, Write};
use std::sync::mpsc;
use std::time::Duration;

use cuda_ipc::{Error, channel::ChannelError};
use serde_json::Value;

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
            for line in BufReader::new(input).lines() {
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
