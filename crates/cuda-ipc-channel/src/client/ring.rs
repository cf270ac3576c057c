//! A ring subscription: subscribing ([`Client::attach_ring`]), taking its
//! frames ([`Client::next_frame`]) and acking them ([`Client::ack`]).

use std::sync::Arc;
use std::time::Duration;

use crate::limits::{MAX_RING_SLOTS, validate_entry_name};
use crate::socket::RecvLimits;
use crate::wire::Message;
use crate::{ChannelError, lock};

use super::demux::unexpected;
use super::{Client, FrameNotice, RingAttachment};

impl Client {
    /// Subscribes to a ring: takes a lease and receives every slot's
    /// metadata and descriptors. Frames published from now on arrive with
    /// [`next_frame`](Self::next_frame).
    pub fn attach_ring(&self, name: &str) -> Result<RingAttachment, ChannelError> {
        validate_entry_name(name)?;
        let p = self.request(
            |id| Message::AttachRing {
                id,
                name: name.into(),
            },
            Some(name),
        )?;
        let what = format!("the answer to subscribing to ring {name:?}");
        let (lease, count, meta) = match self.response(&p, &what)? {
            (
                Message::RingAttached {
                    lease, slots, meta, ..
                },
                _,
            ) => (lease, slots as usize, meta),
            (other, _) => return Err(unexpected(other, "ring_attached", name)),
        };
        let slots = (|| {
            if count == 0 || count > MAX_RING_SLOTS {
                return Err(ChannelError::protocol(format!(
                    "the server announced a ring of {count} slots; a ring has 1 to \
                     {MAX_RING_SLOTS}"
                )));
            }
            let mut slots = Vec::with_capacity(count);
            for i in 0..count {
                match self.response(&p, &what)? {
                    (
                        Message::RingSlot {
                            lease: l,
                            slot,
                            meta,
                            ..
                        },
                        fds,
                    ) if l == lease && slot as usize == i => {
                        slots.push((meta, fds));
                    }
                    (error @ Message::Error { .. }, _) => {
                        return Err(unexpected(error, "ring_slot", name));
                    }
                    (other, _) => {
                        return Err(ChannelError::protocol(format!(
                            "expected slot {i} of ring {name:?}, got a {:?} message",
                            other.type_name()
                        )));
                    }
                }
            }
            Ok(slots)
        })();
        match slots {
            Ok(slots) => Ok(RingAttachment {
                lease,
                name: name.into(),
                meta: Arc::unwrap_or_clone(meta).into_value(),
                slots,
            }),
            Err(e) => {
                self.release_quietly(vec![lease]);
                Err(e)
            }
        }
    }

    /// The next frame of the ring subscribed with `lease`, waiting up to
    /// `timeout` for one (`Duration::ZERO` polls). After the producer unpublished the ring and every
    /// earlier message was taken: [`ChannelError::Unpublished`]. When the
    /// producer gave up on this subscriber's acks: [`ChannelError::Lagged`]
    /// once (frames go on with the next one) or [`ChannelError::Evicted`]
    /// (the subscription is over).
    pub fn next_frame(&self, lease: u64, timeout: Duration) -> Result<FrameNotice, ChannelError> {
        // Frames come in streams, and a consumer that spins takes each one
        // as its notice arrives, often before the producer's kernel has
        // finished, and queues a device wait that makes the shared GPU
        // switch contexts. In the one H200 bench run with a spin, the 1 MiB
        // ring made 15,382 frames/s (31,542-79,451 in two runs without) and
        // paced frames took 0.29 ms (0.04-0.10), so ring waits sleep at once.
        self.next_frame_with(lease, timeout, RecvLimits::CLIENT)
    }

    /// As [`next_frame`](Self::next_frame), polling for the configured
    /// spin ([`ClientConfig::spin`](crate::ClientConfig::spin)) before it
    /// sleeps: for a consumer that queues no device work when a frame comes
    /// (it waits for the producer's work from the host), whose spin then
    /// costs no switch of the GPU's context, and saves the producer the
    /// wake-up of this thread that a sleeping consumer needs every frame.
    pub fn next_frame_spinning(
        &self,
        lease: u64,
        timeout: Duration,
    ) -> Result<FrameNotice, ChannelError> {
        self.next_frame_with(lease, timeout, self.limits)
    }

    fn next_frame_with(
        &self,
        lease: u64,
        timeout: Duration,
        limits: RecvLimits,
    ) -> Result<FrameNotice, ChannelError> {
        let not_ring = || {
            ChannelError::arg(
                "lease",
                format!(
                    "lease {lease} is not a ring subscription of this client (attach_ring \
                     returns one)"
                ),
            )
        };
        if !lock(&self.state).rings.contains_key(&lease) {
            return Err(not_ring());
        }
        self.wait_for(crate::deadline_in(timeout), "a ring frame", limits, |st| {
            let Some(q) = st.rings.get_mut(&lease) else {
                return Some(Err(not_ring()));
            };
            if let Some((stale_through, reason)) = q.lagged.take() {
                Some(Err(ChannelError::Lagged {
                    name: q.name.clone(),
                    lease,
                    stale_through,
                    reason,
                }))
            } else if let Some(f) = q.frames.pop_front() {
                Some(Ok(f))
            } else if let Some(reason) = &q.evicted {
                Some(Err(ChannelError::Evicted {
                    name: q.name.clone(),
                    lease,
                    reason: reason.clone(),
                }))
            } else if q.ended {
                Some(Err(ChannelError::Unpublished {
                    name: q.name.clone(),
                    lease,
                }))
            } else {
                None
            }
        })?
    }

    /// Acknowledges a ring frame: this subscriber is done with `slot` as of
    /// frame `seq`, and the producer may reuse it. Does not wait for an
    /// answer.
    pub fn ack(&self, lease: u64, slot: u32, seq: u64) -> Result<(), ChannelError> {
        {
            let st = lock(&self.state);
            if let Some(d) = &st.dead {
                return Err(d.error());
            }
            match st.rings.get(&lease) {
                None => {
                    return Err(ChannelError::arg(
                        "lease",
                        format!("lease {lease} is not a ring subscription of this client"),
                    ));
                }
                Some(q) if slot >= q.slot_count => {
                    return Err(ChannelError::arg(
                        "slot",
                        format!(
                            "ring {:?} has {} slots, there is no slot {slot}",
                            q.name, q.slot_count
                        ),
                    ));
                }
                Some(_) => {}
            }
        }
        let ack = Message::Ack { lease, slot, seq };
        if let Some(shm) = &self.shm {
            match shm.ack(&ack) {
                Ok(true) => {
                    lock(&self.state).stats.shm_acks += 1;
                    return Ok(());
                }
                // The ring is full: the socket (acks need no order).
                Ok(false) => {}
                Err(e) => {
                    let mut st = lock(&self.state);
                    if st.dead.is_none() {
                        st.dead = Some(super::demux::Dead::from_error(ChannelError::protocol(
                            e.to_string(),
                        )));
                    }
                    drop(st);
                    self.filed.notify_all();
                    return Err(e);
                }
            }
        }
        self.send(&ack)?;
        lock(&self.state).stats.socket_acks += 1;
        Ok(())
    }
}
