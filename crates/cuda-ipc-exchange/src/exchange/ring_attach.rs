//! A subscriber's side of a ring: subscribing, taking frames, acking.

use std::time::Duration;

use bytemuck::Pod;

use crate::error::{Error, Result};
use crate::memory::DeviceMemory;

use super::Subscriber;
use super::lease::{LeaseGuard, LeaseId};
use super::link::Connection;
use super::ring::{RingFrame, RingSubscriber, index};
use super::sync::Waiter;
use super::wire::FrameBody;

impl Subscriber {
    /// The work of [`Subscriber::attach_ring`].
    pub(super) fn do_attach_ring<T: Pod>(
        &self,
        conn: &Connection,
        name: &str,
    ) -> Result<RingSubscriber<T>> {
        let a = conn.client.attach_ring(name)?;
        let mut slots = Vec::with_capacity(a.slots.len());
        let mut waiters = Vec::with_capacity(a.slots.len());
        let what = format!("a slot of ring {name:?}");
        for (meta, fds) in a.slots {
            match self.open_descriptor::<T>(&conn.client, &meta, fds, &what) {
                Ok((_, buffer, waiter)) => {
                    slots.push(buffer);
                    waiters.push(waiter);
                }
                Err(e) => {
                    let _ = conn.client.release(a.lease);
                    return Err(e);
                }
            }
        }
        let mappings = slots.iter().map(|b| b.mapping_arc().clone()).collect();
        let guard = LeaseGuard::new(
            &self.link,
            &self.pending,
            LeaseId {
                id: a.lease,
                epoch: conn.epoch,
            },
            name.to_owned(),
            mappings,
        );
        let slots = slots.into_iter().map(|b| b.hold(guard.clone())).collect();
        Ok(RingSubscriber {
            lease: a.lease,
            guard,
            slots,
            waiters,
        })
    }

    /// The work of [`Subscriber::next_frame`].
    pub(super) fn do_next_frame<T: Pod>(
        &self,
        ring: &RingSubscriber<T>,
        timeout: Duration,
    ) -> Result<RingFrame<T>> {
        // A reader that waits on the fence from the host queues nothing on
        // the device per frame: its spin costs no context switch, and saves
        // the producer waking it for every frame. Others sleep at once (a
        // device wait queued as soon as a notice comes, before the
        // producer's kernel is done, makes a shared GPU switch contexts).
        // Under MPS, where no switch is at stake, spinning every reader
        // measured no gain on the H200.
        // A ring subscription ends with its connection: not taken back.
        let conn = self.link.now();
        ring.guard.current_on(&conn)?;
        let f = if ring.spins() {
            conn.client.next_frame_spinning(ring.lease, timeout)?
        } else {
            conn.client.next_frame(ring.lease, timeout)?
        };
        let buffer = ring.slots.get(index::<usize, _>(f.slot)?).ok_or_else(|| {
            Error::arg(
                "ring frame",
                format!("slot {} of {}", f.slot, ring.slots.len()),
            )
        })?;
        let notice = FrameBody::decode(&f.notice)?;
        match (&ring.waiters[index::<usize, _>(f.slot)?], notice.fence_seq) {
            (waiter @ Waiter::Fence { .. }, Some(seq)) => {
                self.wait_fence(&conn.client, waiter, buffer.stream(), seq)?;
            }
            (Waiter::Fence { .. }, None) => {
                return Err(Error::arg(
                    "ring frame",
                    "the frame's notice has no fence sequence number, but this subscriber waits on fences",
                ));
            }
            (Waiter::Event(_), _) => {
                let handle = notice.event.ok_or_else(|| {
                    Error::arg(
                        "ring frame",
                        "the frame's notice has no event (a fences-only ring), but this \
                         subscriber waits on events",
                    )
                })?;
                self.event(handle)?.wait_on(buffer.stream())?;
            }
        }
        Ok(RingFrame {
            slot: index(f.slot)?,
            seq: f.seq,
            buffer: buffer.clone(),
            notice: f.notice,
            lease: ring.lease,
        })
    }

    /// The work of [`Subscriber::ack`].
    #[allow(clippy::needless_pass_by_value)] // taking the frame ends its use
    pub(super) fn do_ack<T: Pod>(
        &self,
        ring: &RingSubscriber<T>,
        frame: RingFrame<T>,
    ) -> Result<()> {
        if frame.lease != ring.lease {
            return Err(Error::arg(
                "ring frame",
                format!(
                    "the frame came from the ring subscription of lease {}, not from this one \
                     (lease {}); acknowledge it with the subscription it came from",
                    frame.lease, ring.lease
                ),
            ));
        }
        frame.buffer.synchronize()?;
        frame
            .buffer
            .mapping_arc()
            .used_streams()
            .synchronize_all()?;
        let conn = self.link.now();
        ring.guard.current_on(&conn)?;
        Ok(conn.client.ack(ring.lease, index(frame.slot)?, frame.seq)?)
    }
}
