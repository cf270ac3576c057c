//! Ordering a hand-off after a caller's stream on the device: the work
//! queued so far on that stream comes before the event (or fence) a
//! publish, an update or a ring frame records, and nothing waits on the
//! host ([`Publisher::update_after`](super::Publisher::update_after),
//! [`Publisher::update_set_after`](super::Publisher::update_set_after),
//! [`RingPublisher::publish_after`](super::RingPublisher::publish_after)).

use std::sync::Mutex;

use cudarc::driver::{CudaEvent, CudaStream, DriverError};

use super::lock;
use crate::error::{Error, Result};

/// One event, made at its first use, recorded on a caller's stream and
/// waited for by ours: two driver calls. Locked from the record to the
/// wait, so that two threads' joins do not mix.
#[derive(Default)]
pub(super) struct JoinEvent(Mutex<Option<CudaEvent>>);

impl std::fmt::Debug for JoinEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JoinEvent").finish_non_exhaustive()
    }
}

impl JoinEvent {
    /// Makes `stream` wait for the work queued so far on `after`. A
    /// stream of another context (another device) gets an event of its
    /// own from cudarc's join.
    pub(super) fn order(&self, stream: &CudaStream, after: &CudaStream) -> Result<()> {
        let failed = |e: DriverError| {
            Error::arg(
                "stream",
                format!("cannot order the hand-off after the stream given: {e}"),
            )
        };
        if after.context().cu_ctx() != stream.context().cu_ctx() {
            return stream.join(after).map_err(failed);
        }
        let mut event = lock(&self.0);
        let event = match &mut *event {
            Some(e) => e,
            empty => empty.insert(stream.context().new_event(None).map_err(failed)?),
        };
        event.record(after).map_err(failed)?;
        stream.wait(event).map_err(failed)
    }
}
