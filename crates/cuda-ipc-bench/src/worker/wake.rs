//! The wake-up floor's reader (`wake_setup`, `wake_wait`): the consumer's
//! end of the shared-memory ring the producer writes notices into.

use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use cuda_ipc::Error;
use cuda_ipc_shm::{Area, Ready, Side};
use serde_json::{Value, json};

use super::{State, WAIT, int, text};
use crate::proto::{failure, mono_ns};

/// The reader's end of the wake-up floor's area.
pub(crate) struct Wake {
    receiver: cuda_ipc_shm::Receiver,
    /// Unused (the reader never writes back through the area), kept so
    /// that its end stays whole.
    _sender: cuda_ipc_shm::Sender,
    record: Vec<u8>,
}

/// An error of the wake-up floor (both ends): `what` failed with `e`.
pub(crate) fn shm_failure(what: &str, e: impl std::fmt::Display) -> Error {
    failure(format!("the wake-up floor: {what}"), e)
}

impl Wake {
    /// Opens the area in `memfd` (rings of `capacity` bytes) as its opener,
    /// with `wake` its end of the wake-up pair.
    pub(crate) fn open(memfd: &OwnedFd, wake: OwnedFd, capacity: usize) -> Result<Wake, Error> {
        let area = Area::open(memfd, capacity).map_err(|e| shm_failure("the area", e))?;
        let (sender, receiver) = area
            .split(Side::Opener, wake)
            .map_err(|e| shm_failure("the area", e))?;
        Ok(Wake {
            receiver,
            _sender: sender,
            record: Vec::with_capacity(16),
        })
    }

    /// Waits for the next notice (spinning up to `spin` first, then
    /// asleep), notes the time it
    /// returned and reads the notice: that time (CLOCK_MONOTONIC, ns) and
    /// how many times it slept.
    pub(crate) fn wait(&mut self, spin: Duration) -> Result<(u64, u64), Error> {
        let sleeps = self.receiver.sleeps();
        let ready = self
            .receiver
            .wait(spin, Some(Instant::now() + WAIT), None)
            .map_err(|e| shm_failure("waiting", e))?;
        let t_wake = mono_ns();
        if ready != Ready::Ring {
            return Err(shm_failure(
                "waiting",
                format!("no notice came within {} s ({ready:?})", WAIT.as_secs()),
            ));
        }
        self.record.clear();
        let got = self
            .receiver
            .recv(&mut self.record)
            .map_err(|e| shm_failure("reading the notice", e))?;
        if !got || self.record.len() != 8 {
            return Err(shm_failure(
                "reading the notice",
                format!("expected one 8-byte record, read {:?}", self.record),
            ));
        }
        Ok((t_wake, self.receiver.sleeps() - sleeps))
    }
}

impl State {
    /// `wake_setup {name, capacity}`: takes the area and this end of its
    /// wake-up pair from the floor's channel and opens the area.
    pub(super) fn wake_setup(&mut self, r: &Value) -> Result<Value, Error> {
        let f = self.floor()?;
        let name = text(r, "name")?;
        let capacity = int(r, "capacity")? as usize;
        let a = f.client.attach(name)?;
        let lease = a.lease;
        let opened = <[_; 2]>::try_from(a.fds)
            .map_err(|fds| {
                shm_failure(
                    "the entry",
                    format!("{} file descriptors came with it, not 2", fds.len()),
                )
            })
            .and_then(|[memfd, wake]| Wake::open(&memfd, wake, capacity));
        f.client.release(lease)?;
        self.wake = Some(opened?);
        Ok(json!({ "ok": true }))
    }

    /// `wake_wait {spin_us}`: [`Wake::wait`], answered
    /// `{t_wake, slept}`.
    pub(super) fn wake_wait(&mut self, r: &Value) -> Result<Value, Error> {
        let spin = Duration::from_micros(int(r, "spin_us")?);
        let wake = self
            .wake
            .as_mut()
            .ok_or_else(|| failure("wake_wait", "wake_setup was not sent"))?;
        let (t_wake, slept) = wake.wait(spin)?;
        Ok(json!({ "t_wake": t_wake, "slept": slept }))
    }
}
