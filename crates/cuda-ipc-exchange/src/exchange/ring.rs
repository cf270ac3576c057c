//! Rings: a fixed set of slots cycled between one producer and its
//! subscribers, with back-pressure, a lease per subscription and an event
//! per frame (or, for a [`RingSync::FencesOnly`] ring, a fence signal only).

use std::sync::Arc;
use std::time::Duration;

use bytemuck::Pod;
use serde_json::Value;

use crate::channel::{self, LeaseInfo};
use crate::error::{Error, Result};
use crate::event::IpcEvent;
use crate::fence::Fence;
use crate::handle::IpcEventHandle;
use crate::memory::DeviceMemory;
use crate::memory::buffer::MappedBuffer;
use crate::share::SharedBuffer;

use super::lease::LeaseGuard;
use super::sync::Waiter;
use super::wire::{self, FrameBody};

/// How a ring's frames are made ready for its readers
/// ([`Publisher::ring_with`](super::Publisher::ring_with)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum RingSync {
    /// Each frame records the ring's interprocess event and, when the
    /// publisher has fences, signals its slot's fence: every reader's
    /// [`SyncMode`](super::SyncMode) is served. The default.
    #[default]
    EventsAndFences,
    /// Each frame signals its slot's fence only: one driver call less per
    /// frame for the producer (the event record). Readers wait on the
    /// fence ([`SyncMode::Auto`](super::SyncMode::Auto), `Fence` or
    /// `HostFence`); one that asks for events is refused when it attaches.
    /// Needs a publisher with fences ([`PublisherConfig::with_fences`](super::PublisherConfig::with_fences)).
    FencesOnly,
}

/// The producer's side of a ring of buffers with back-pressure.
///
/// Layers: it wraps the channel's [`ServerRing`](channel::ServerRing)
/// (slots as descriptors, frames as JSON notices) and adds the CUDA side:
/// each slot's buffer, the event recorded per frame and the fence.
pub struct RingPublisher {
    pub(super) producer: channel::ServerRing,
    pub(super) buffers: Vec<SharedBuffer>,
    /// The event recorded per frame and its handle; `None` for a
    /// [`RingSync::FencesOnly`] ring.
    pub(super) event: Option<(IpcEvent, IpcEventHandle)>,
    /// One word per slot, signalled with the frame counter.
    pub(super) fence: Option<Fence>,
    /// Frames published so far (the fence's sequence numbers).
    pub(super) frames: std::sync::atomic::AtomicU64,
    /// The event a caller's stream records for [`publish_after`](Self::publish_after).
    pub(super) join: super::join::JoinEvent,
}

impl RingPublisher {
    /// Waits (up to `timeout`) until the next slot is free, and returns its
    /// index and buffer to fill.
    pub fn acquire(&self, timeout: Option<Duration>) -> Result<(u32, &SharedBuffer)> {
        let slot = self.producer.acquire(timeout)?;
        let buffer = self.buffer(index(slot)?)?;
        Ok((index(slot)?, buffer))
    }

    fn buffer(&self, slot: usize) -> Result<&SharedBuffer> {
        self.buffers.get(slot).ok_or_else(|| {
            Error::arg(
                "slot",
                format!("slot {slot} of a ring of {} slots", self.buffers.len()),
            )
        })
    }

    /// Publishes a filled slot: records the ring's event after the work
    /// queued on the slot's stream and sends the frame. Returns its sequence number.
    pub fn publish(&self, slot: u32) -> Result<u64> {
        self.publish_with(slot, serde_json::Map::new())
    }

    /// As [`RingPublisher::publish`], with extra fields for the subscriber
    /// in the frame's notice (a timestamp, a frame number; small).
    pub fn publish_with(&self, slot: u32, extra: serde_json::Map<String, Value>) -> Result<u64> {
        self.publish_as(slot, extra, None)
    }

    /// As [`RingPublisher::publish_with`], ordered also after the work
    /// queued so far on `after` (a caller's stream, whose kernels filled
    /// the slot): the slot's stream waits for it on the device (one event
    /// recorded there and waited for); nothing waits on the host.
    pub fn publish_after(
        &self,
        slot: u32,
        extra: serde_json::Map<String, Value>,
        after: &cudarc::driver::CudaStream,
    ) -> Result<u64> {
        self.publish_as(slot, extra, Some(after))
    }

    fn publish_as(
        &self,
        slot: u32,
        mut extra: serde_json::Map<String, Value>,
        after: Option<&cudarc::driver::CudaStream>,
    ) -> Result<u64> {
        let buffer = self.buffer(index(slot)?)?;
        if let Some(after) = after {
            self.join.order(buffer.stream(), after)?;
        }
        if let Some((event, _)) = &self.event {
            event.record(buffer.stream())?;
        }
        let fence_seq = match &self.fence {
            Some(f) => {
                let seq = self
                    .frames
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                    + 1;
                f.signal(buffer.stream(), slot, seq)?;
                Some(seq)
            }
            None => None,
        };
        // These fields are ours: a producer's field of that name can't replace them.
        extra.remove("event");
        extra.remove("fence_seq");
        let notice = wire::to_value(&FrameBody {
            event: self.event.as_ref().map(|(_, h)| *h),
            fence_seq,
            extra,
        })?;
        Ok(self.producer.publish(index(slot)?, notice)?)
    }

    /// The number of slots (a slot's index is a `u32` below it).
    pub fn slot_count(&self) -> usize {
        self.buffers.len()
    }

    /// The current subscribers.
    pub fn subscribers(&self) -> Vec<LeaseInfo> {
        self.producer.subscribers()
    }

    /// Sets how long a subscriber may keep a frame before acking it, and
    /// what [`acquire`](Self::acquire) does with one that keeps it longer:
    /// cut it off or skip it (see
    /// [`ServerRing::set_ack_deadline`](channel::ServerRing::set_ack_deadline)).
    /// `None` (the default) waits for every subscriber for ever.
    pub fn set_ack_deadline(
        &self,
        deadline: Option<Duration>,
        policy: channel::LatePolicy,
    ) -> Result<()> {
        Ok(self.producer.set_ack_deadline(deadline, policy)?)
    }

    /// Ends the subscription `lease` now; the subscriber is told `reason`
    /// (see [`ServerRing::evict`](channel::ServerRing::evict)).
    pub fn evict(&self, lease: u64, reason: &str) -> Result<()> {
        Ok(self.producer.evict(lease, reason)?)
    }
}

/// A subscription to a ring: every slot mapped. Every slot's buffer, and
/// every view made from one, holds the subscription's lease.
///
/// Layers: made from the channel's
/// [`RingAttachment`](channel::RingAttachment) (the lease and each slot's
/// descriptors) by [`Subscriber::attach_ring`](super::Subscriber::attach_ring), which maps every slot.
#[derive(Debug)]
pub struct RingSubscriber<T> {
    pub(super) lease: u64,
    pub(super) guard: Arc<LeaseGuard>,
    pub(super) slots: Vec<MappedBuffer<T>>,
    /// How each slot waits (event or fence).
    pub(super) waiters: Vec<Waiter>,
}

impl<T: Pod> RingSubscriber<T> {
    /// The number of slots (a slot's index is a `u32` below it).
    pub fn slot_count(&self) -> usize {
        self.slots.len()
    }

    /// Whether [`Subscriber::next_frame`](super::Subscriber::next_frame) spins for the next frame before
    /// it sleeps: for a reader that waits on the fence from the host.
    pub fn spins(&self) -> bool {
        self.waiters.first().is_some_and(Waiter::is_host_only)
    }

    /// Whether frames are waited for with the publisher's fence (rather
    /// than its event).
    pub fn uses_fences(&self) -> bool {
        self.waiters.first().is_some_and(Waiter::is_fence)
    }
}

/// One received frame of a ring: the slot's mapped buffer, ready to read,
/// made from the channel's [`FrameNotice`](channel::FrameNotice) (which
/// only says which slot was filled).
///
/// The frame owns what it reads: its buffer is a view of the slot, which
/// holds the mapping and the subscription's lease like every view, so a
/// frame may be kept apart from its [`RingSubscriber`] (in another
/// thread, in an object of its own) and is valid however long it lives.
/// The producer reuses the slot once it is acknowledged
/// ([`Subscriber::ack`](super::Subscriber::ack), with the subscription it came from).
#[derive(Debug)]
#[must_use = "acknowledge the frame with Subscriber::ack so the producer can reuse the slot"]
#[non_exhaustive]
pub struct RingFrame<T> {
    /// The slot's index.
    pub slot: u32,
    /// The frame's sequence number (from 1).
    pub seq: u64,
    /// A view of the slot's buffer.
    pub buffer: MappedBuffer<T>,
    /// The producer's notice (its extra fields and the event).
    pub notice: Value,
    /// The subscription it came from.
    pub(super) lease: u64,
}

impl<T: Pod> RingSubscriber<T> {
    /// Ends the subscription (see [`Subscriber::release_ring`](super::Subscriber::release_ring)).
    pub(super) fn release(self) -> Result<()> {
        let RingSubscriber { guard, slots, .. } = self;
        drop(slots);
        guard.check_no_views(1)?;
        guard.end()
    }
}

/// A slot index converted between the public API's `u32` and the integer
/// the channel or a `Vec` uses; rings are far smaller than either bound, so
/// a failure means a corrupt index, reported as such.
pub(super) fn index<I: TryFrom<S>, S: Copy + std::fmt::Display>(slot: S) -> Result<I> {
    I::try_from(slot).map_err(|_| Error::arg("slot", format!("slot index {slot} is out of range")))
}

#[cfg(test)]
mod tests {
    use super::RingFrame;

    /// A frame borrows nothing: it can be kept in an object of its own
    /// (a Python frame) or sent to another thread, with no lifetime to
    /// extend by hand.
    #[test]
    fn a_frame_owns_what_it_reads() {
        fn owned<F: Send + Sync + 'static>() {}
        owned::<RingFrame<u8>>();
        owned::<RingFrame<f32>>();
    }
}
