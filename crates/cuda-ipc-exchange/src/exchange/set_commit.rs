//! Versions of a set: a set published read-write for one writer while its
//! readers map read-only, and a new version put in place of a set's
//! current one, its readers told with an update (the weight service's
//! writer sessions, [`crate::service`]).

use crate::arena::{DeviceArenaBuffer, SetMember};
use crate::channel::{ChannelError, Replaced};
use crate::error::{Error, Result};

use super::lock;
use super::publisher::Publisher;
use super::set_order::SetHold;
use super::wire::{self, UpdateBody};

impl Publisher {
    /// The work of [`Publisher::replace_set`].
    pub(super) fn do_replace_set(&self, name: &str, members: &[SetMember<'_>]) -> Result<Replaced> {
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
