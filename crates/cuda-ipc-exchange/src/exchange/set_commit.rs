//! Versions of a set: a set published read-write for one writer while its
//! readers map read-only, and a new version put in place of a set's
//! current one, its readers told with an update (the weight service's
//! writer sessions, [`crate::service`]).

use crate::arena::{DeviceArenaBuffer, SetMember};
use crate::channel::{ChannelError, Replaced};
use crate::error::{Error, Result};
use crate::mechanism::Access;

use super::lock;
use super::publisher::Publisher;
use super::set_order::SetHold;
use super::wire::{self, UpdateBody};

impl Publisher {
    /// Publishes `members` as set `name` (as
    /// [`publish_set`](Self::publish_set)) with `access` for its readers:
    /// [`Access::ReadWrite`] on a publisher with
    /// [read-only readers](super::PublisherConfig::with_read_only_readers)
    /// is the policy's one exception, for a writer's staging version under
    /// a name only the writer is told; every other set keeps the policy.
    /// [`Access::ReadOnly`] puts `read_only` in the record whatever the
    /// policy (vmm chunks only).
    pub fn publish_set_with(
        &self,
        name: &str,
        members: &[SetMember<'_>],
        access: Access,
    ) -> Result<()> {
        self.publish_set_as(name, members, access == Access::ReadOnly, None)
    }

    /// Puts `members` in place of the published set `name` as its next
    /// version, with the publisher's policy: new attaches of `name` get
    /// the new record at once; every reader of the old one gets an update
    /// notice on its lease (its event recorded, its fence signalled, as
    /// [`update_set`](Self::update_set) does; nothing changed in the memory
    /// it maps) and keeps its mappings until it releases them, when the
    /// old version's ranges may go back to the arena. Readers move to the
    /// new version by attaching `name` again. The work queued on the
    /// members' streams is ordered before the new record's event and
    /// fence; work of another process (a writer) must be finished before
    /// this call.
    ///
    /// # Errors
    /// [`ChannelError::NotFound`] when `name` is not a published set; the
    /// record's and the driver's errors. On an error `name` keeps its
    /// old version.
    pub fn replace_set(&self, name: &str, members: &[SetMember<'_>]) -> Result<Replaced> {
        let arena = self.arena()?;
        let (old_order, old_slot) = lock(&self.arena.book)
            .update_of(name)
            .ok_or_else(|| Error::from(ChannelError::NotFound { name: name.into() }))?;
        let (mut record, layout) =
            arena.describe_set_with(name, members.iter().copied(), &self.arena.layouts)?;
        record.event = Some(self.event_handle);
        record.read_only = self.read_only_readers;
        // The entries were checked as the set was described.
        record.validate_head()?;
        let hold = SetHold::new(DeviceArenaBuffer::lease_each(
            members.iter().map(|m| m.buffer),
        ));
        // The old version's readers wait on its event and fence: signal
        // them once more, so that their wait for this update returns.
        let old_stream = self.record_after(&old_order, None)?;
        let fence_seq = match (&self.fences, old_slot) {
            (Some(f), Some(slot)) => Some(lock(f).signal(&old_stream, slot)?),
            _ => None,
        };
        let stream = self.record_after(hold.order(), None)?;
        let fence = self.set_fence(&stream)?;
        let notice = wire::to_value(&UpdateBody { fence_seq })?;
        lock(&self.arena.book).replace_layout(
            &self.server,
            arena,
            name,
            (&record, &layout),
            hold,
            fence,
            notice,
        )
    }
}
