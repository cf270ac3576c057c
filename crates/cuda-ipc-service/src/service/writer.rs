//! The writer's side of a write session: open it on a [`Subscriber`]
//! connected to the service, write into the staging version mapped
//! read-write, then commit (or abort).
//!
//! ```no_run
//! use cuda_ipc_exchange::exchange::{Subscriber, SubscriberConfig};
//! use cuda_ipc_service::service::Writer;
//! use cuda_ipc_core::Device;
//!
//! let device = Device::open(0)?;
//! let subscriber = Subscriber::connect(&device, "service", SubscriberConfig::default())?;
//! let writer = Writer::open(&subscriber, "model", None)?; // a new version of "model"
//! let weight = writer.staging().get::<u16>("lm_head.weight")?;
//! // ... write every byte of every tensor (the staging version starts undefined) ...
//! # drop(weight);
//! let committed = writer.commit()?; // readers are told; new attaches get it
//! println!("version {}", committed.version);
//! # Ok::<(), cuda_ipc_core::Error>(())
//! ```
//!
//! The session's lock is the subscriber's connection: closing it (or the
//! process exiting or being killed) aborts the write, and readers stay on
//! the last committed version.

use std::time::Duration;

use crate::Access;
use crate::error::{Error, Result};
use crate::exchange::{SetAttachment, Subscriber};

use super::admin::{
    AbortAnswer, AbortRequest, CommitAnswer, CommitRequest, OpenWriteAnswer, OpenWriteRequest,
    Request, TensorSpec, decode, encode,
};
use super::layout::layout_hash;

/// How long a writer's calls wait: an `open_write` allocates the staging
/// version (device memory, possibly new chunks), longer than a plain
/// request's timeout.
const WRITE_CALL_TIMEOUT: Duration = Duration::from_secs(120);

/// Calls a service method on `subscriber`'s connection.
pub(super) fn call<R: Request>(subscriber: &Subscriber, request: &R) -> Result<R::Answer> {
    call_within(subscriber, request, WRITE_CALL_TIMEOUT)
}

/// [`call`], waiting up to `timeout` for the answer.
pub(super) fn call_within<R: Request>(
    subscriber: &Subscriber,
    request: &R,
    timeout: Duration,
) -> Result<R::Answer> {
    let answer = subscriber.call(R::METHOD, &encode(request), Some(timeout))?;
    decode(R::METHOD, &answer).map_err(|e| Error::arg("service answer", e))
}

/// An open write session (see the module docs). Commit or abort it;
/// dropping it does neither (a `Drop` does not wait on the service): the
/// session then lasts until the subscriber's connection closes.
#[derive(Debug)]
pub struct Writer<'s> {
    subscriber: &'s Subscriber,
    opened: OpenWriteAnswer,
    staging: Option<SetAttachment>,
}

impl<'s> Writer<'s> {
    /// Opens a write session on `set` of the service `subscriber` is
    /// connected to and attaches its staging version read-write: with
    /// `layout` `None`, a new version of an existing set (its layout);
    /// with a layout, a new set.
    ///
    /// # Errors
    /// The service's refusals as
    /// [`ChannelError::Remote`](crate::channel::ChannelError::Remote)
    /// (`writing`, naming the writer that holds the set; `not_found`,
    /// `not_owner`, `over_quota`, `exists`, `bad_request`, ...); the
    /// attach's errors (the session is then aborted).
    pub fn open(
        subscriber: &'s Subscriber,
        set: &str,
        layout: Option<Vec<TensorSpec>>,
    ) -> Result<Writer<'s>> {
        let request = match layout {
            Some(layout) => OpenWriteRequest::new_set(set, layout),
            None => OpenWriteRequest::existing(set),
        };
        Self::open_with(subscriber, &request, WRITE_CALL_TIMEOUT)
    }

    /// Opens a write of the existing set `set` **in place**: no second
    /// copy; the staging version is the current version's own memory,
    /// mapped read-write. The service first has every reader of the set
    /// step aside (each sleeps and says so: [`step_aside`](super::step_aside)),
    /// waiting up to `wait`, and refuses new attaches until the commit.
    /// The commit makes the same memory the next version; readers wake at
    /// the same addresses ([`come_back`](super::come_back)). An abort, or
    /// this process's end before the commit, leaves the set **torn** (its
    /// bytes partly written; attaches refused, code `torn`) until a write
    /// commits: write in place only what you can write again.
    ///
    /// # Errors
    /// `readers_not_aside` (naming the readers that did not step aside
    /// within `wait`; nothing was written, the set is as it was), and
    /// [`open`](Self::open)'s.
    pub fn open_in_place(
        subscriber: &'s Subscriber,
        set: &str,
        wait: Duration,
    ) -> Result<Writer<'s>> {
        let wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
        let request = OpenWriteRequest::in_place(set, Some(wait_ms));
        Self::open_with(subscriber, &request, WRITE_CALL_TIMEOUT + wait)
    }

    fn open_with(
        subscriber: &'s Subscriber,
        request: &OpenWriteRequest,
        timeout: Duration,
    ) -> Result<Writer<'s>> {
        let set = request.set.as_str();
        let opened = call_within(subscriber, request, timeout)?;
        let staging = match subscriber.attach_set_with(&opened.staging, Access::ReadWrite) {
            Ok(s) => s,
            Err(e) => {
                let _ = call(subscriber, &AbortRequest::new(set));
                return Err(e);
            }
        };
        if staging.read_only() {
            let _ = call(subscriber, &AbortRequest::new(set));
            return Err(Error::arg(
                "staging version",
                "the service published it read-only; is it an older service?",
            ));
        }
        Ok(Writer {
            subscriber,
            opened,
            staging: Some(staging),
        })
    }

    /// The staging version, mapped read-write: write every byte of every
    /// tensor ([`SetAttachment::get`], [`SetAttachment::view`]).
    ///
    /// # Panics
    /// Never: the attachment is taken only by `commit` and `abort`, which
    /// consume the writer.
    pub fn staging(&self) -> &SetAttachment {
        self.staging
            .as_ref()
            .expect("the staging version is attached until commit or abort")
    }

    /// What the service answered when the session opened (the version a
    /// commit makes, the staging entry, its size).
    pub fn opened(&self) -> &OpenWriteAnswer {
        &self.opened
    }

    /// Lets go of the staging mapping (its views must be gone; if some
    /// live, the mapping stays until they drop, and must not be written).
    fn release(&mut self) {
        if let Some(s) = self.staging.take()
            && let Err(e) = self.subscriber.release_set(s)
        {
            tracing::warn!(error = %e, "the staging version stays mapped until its views drop");
        }
    }

    /// Waits for the work queued on the device's stream (where the
    /// staging views write), lets go of the staging mapping, and commits:
    /// the service checks the layout hash and makes the staging version
    /// current; readers get an update notice and move to it by attaching
    /// the set again. Work the writer queued on other streams must be
    /// finished before this call.
    ///
    /// # Errors
    /// The device's synchronisation errors (nothing is committed); the
    /// service's refusals (`layout_mismatch`, `not_writing` when the
    /// session ended, `write_failed`).
    pub fn commit(mut self) -> Result<CommitAnswer> {
        self.subscriber_device_sync()?;
        let hash = layout_hash(self.staging().entries());
        self.release();
        call(
            self.subscriber,
            &CommitRequest::new(self.opened.set.clone(), hash),
        )
    }

    /// Discards the staging version; readers stay on the current one.
    ///
    /// # Errors
    /// The service's refusals (`not_writing` when the session ended).
    pub fn abort(mut self) -> Result<AbortAnswer> {
        self.release();
        call(self.subscriber, &AbortRequest::new(self.opened.set.clone()))
    }

    fn subscriber_device_sync(&self) -> Result<()> {
        self.subscriber.device().synchronize()
    }
}
