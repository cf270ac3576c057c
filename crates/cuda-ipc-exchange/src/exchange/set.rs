//! Publishing from an arena, and sets (documented in the parent module).

use std::sync::Arc;
use std::time::Duration;

use crate::arena::{Arena, DeviceArena, DeviceArenaBuffer, DeviceChunks, RestoredChunk, SetMember};
use crate::channel::ChannelError;
use crate::descriptor::{Dtype, Mechanism};
use crate::error::{Error, Result};
use crate::phases::Phases;
use crate::set::ArenaId;

use super::lock;
use super::publisher::Publisher;
use super::set_order::{SetHold, SetOrder};
use super::sharing::Sharing;
use super::sync::SetFence;
use super::wire::{self, UpdateBody};

impl Publisher {
    /// The work of [`Publisher::arena`].
    pub(super) fn do_arena(&self) -> Result<&DeviceArena> {
        if let Some(a) = self.arena.arena.get() {
            return Ok(a);
        }
        let (chunks, options) = self.arena_backing()?;
        let arena = Arena::new(chunks, options.clone())?;
        self.keep_arena(arena)
    }

    pub(super) fn do_restore_arena(
        &self,
        id: ArenaId,
        chunks: Vec<crate::arena::KeptChunk>,
    ) -> Result<Vec<Vec<DeviceArenaBuffer>>> {
        if self.arena.arena.get().is_some() {
            return Err(Error::arg(
                "publisher",
                "its arena is already made; restore it before any allocation or publication",
            ));
        }
        let (backing, options) = self.arena_backing()?;
        let chunks = chunks
            .into_iter()
            .map(|c| {
                Ok(RestoredChunk::new(
                    c.index,
                    backing.adopt(c.fd, c.len)?,
                    c.ranges,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let (arena, buffers) = Arena::restore(backing, options.clone(), id, chunks)?;
        self.keep_arena(arena)?;
        Ok(buffers)
    }

    fn keep_arena(&self, arena: DeviceArena) -> Result<&DeviceArena> {
        let _ = self.arena.arena.set(arena);
        self.arena
            .arena
            .get()
            .ok_or_else(|| Error::arg("publisher", "its arena could not be kept"))
    }

    /// What makes this publisher's chunks, and the arena's options.
    fn arena_backing(&self) -> Result<(DeviceChunks, &crate::arena::ArenaOptions)> {
        let Sharing::Arena { mechanism, options } = &self.arena.sharing else {
            return Err(Error::arg(
                "publisher",
                "it is configured isolated (no arena); publish SharedBuffers with \
                 Publisher::publish, or configure Sharing::Arena",
            ));
        };
        // Readers that map read-only need vmm chunks: `auto` picks vmm then.
        let chunks = match (mechanism, self.read_only_readers) {
            (None, true) => DeviceChunks::new(&self.device, Some(Mechanism::Vmm)).map_err(|e| {
                Error::Unsupported {
                    what: "read-only readers",
                    why: format!(
                        "they need an arena of vmm chunks, and this device cannot make them \
                         ({e}); bind without read_only_readers"
                    ),
                }
            })?,
            _ => DeviceChunks::new(&self.device, *mechanism)?,
        };
        Ok((chunks, options))
    }

    /// The work of [`Publisher::publish_buffer`].
    pub(super) fn do_publish_buffer(
        &self,
        name: &str,
        buffer: &DeviceArenaBuffer,
        dtype: Dtype,
        shape: &[u64],
    ) -> Result<()> {
        self.publish_set(
            name,
            &[SetMember {
                name,
                dtype,
                shape,
                buffer,
                offset: 0,
            }],
        )
    }

    /// [`publish_set`](Self::publish_set) with the record's `read_only`
    /// given (the policy's exception, see
    /// [`publish_set_with`](Self::publish_set_with)) and the stream to
    /// order after besides the members' own, if any.
    pub(super) fn publish_set_as(
        &self,
        name: &str,
        members: &[SetMember<'_>],
        read_only: bool,
        after: Option<&cudarc::driver::CudaStream>,
    ) -> Result<()> {
        let mut phases = Phases::start("core.publish_set");
        let arena = self.arena()?;
        let (mut record, layout) =
            arena.describe_set_with(name, members.iter().copied(), &self.arena.layouts)?;
        record.event = Some(self.event_handle);
        record.read_only = read_only;
        phases.mark("record");
        let hold = SetHold::new(DeviceArenaBuffer::lease_each(
            members.iter().map(|m| m.buffer),
        ));
        phases.mark("leases");
        let stream = self.record_after(hold.order(), after)?;
        phases.mark("event");
        let fence = self.set_fence(&stream)?;
        phases.mark("fence");
        let r = lock(&self.arena.book).publish_layout(
            &self.server,
            arena,
            name,
            &record,
            &layout,
            hold,
            fence,
        );
        phases.mark("publish");
        r
    }

    /// Takes a fence slot for a new set and signals it after the work queued
    /// on `stream`; `None` when this publisher has no fences (or no free
    /// slot: the set then goes with its event only).
    pub(super) fn set_fence(
        &self,
        stream: &Arc<cudarc::driver::CudaStream>,
    ) -> Result<Option<SetFence>> {
        let Some(fences) = &self.fences else {
            return Ok(None);
        };
        let fences = lock(fences);
        let Some(slot) = fences.take_held() else {
            tracing::warn!("more entries than fence slots: this set goes with its event only");
            return Ok(None);
        };
        fences.signal(stream, slot.slot())?;
        let (meta, fd) = fences.export(slot.slot(), 0)?;
        Ok(Some(SetFence { meta, fd, slot }))
    }

    /// Records the publisher's event after the work queued on the streams
    /// of a set's chunks, each ordered first after its chunks' uses on
    /// other streams, and on `after` (all joined into the first stream,
    /// which it returns). Its cost grows with the set's distinct streams
    /// (one per device for an arena) and chunks (an atomic load each), not
    /// with its buffers.
    pub(super) fn record_after(
        &self,
        order: &SetOrder<DeviceChunks>,
        after: Option<&cudarc::driver::CudaStream>,
    ) -> Result<Arc<cudarc::driver::CudaStream>> {
        let Some((first, others)) = order.ordered_streams().split_first() else {
            return Err(Error::arg("set", "it has no buffer, so nothing to record"));
        };
        for other in others {
            first.join(other).map_err(|e| {
                Error::arg("stream", format!("cannot order the set's streams: {e}"))
            })?;
        }
        if let Some(after) = after {
            self.join.order(first, after)?;
        }
        self.event.record(first)?;
        Ok(Arc::clone(first))
    }

    pub(super) fn update_set_as(
        &self,
        name: &str,
        after: Option<&cudarc::driver::CudaStream>,
    ) -> Result<u64> {
        let mut phases = Phases::start("core.update_set");
        let (order, slot) = lock(&self.arena.book)
            .update_of(name)
            .ok_or_else(|| Error::from(ChannelError::NotFound { name: name.into() }))?;
        phases.mark("book");
        let stream = self.record_after(&order, after)?;
        phases.mark("event");
        let fence_seq = match (&self.fences, slot) {
            (Some(f), Some(slot)) => Some(lock(f).signal(&stream, slot)?),
            _ => None,
        };
        phases.mark("fence");
        let version = self
            .server
            .update(name, wire::to_value(&UpdateBody { fence_seq })?)?;
        phases.mark("notice");
        Ok(version)
    }

    /// Whether `name` was published from the arena (a set or an arena buffer).
    pub(super) fn is_arena_entry(&self, name: &str) -> bool {
        lock(&self.arena.book).contains(name)
    }

    /// The work of [`Publisher::unpublish_set`].
    pub(super) fn do_unpublish_set(&self, name: &str, timeout: Option<Duration>) -> Result<()> {
        lock(&self.arena.book).unpublish(&self.server, name)?;
        if let Some(t) = timeout {
            self.server.wait_released(name, Some(t))?;
            self.reap();
        }
        Ok(())
    }
}
