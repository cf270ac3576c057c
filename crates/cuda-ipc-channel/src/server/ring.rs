//! The producer's side of a ring.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::spin::Backoff;
use crate::wire::Message;
use crate::{ChannelError, lock};

use super::conn::Conn;
use super::state::{Body, Entry, LatePolicy, Ring, SlotState, State};

/// Pause instructions between two looks at the ack count while
/// `acquire` spins (well under a microsecond).
const SPIN_PAUSES: u32 = 16;

/// Whether subscribers are late on the slot `acquire` waits for.
enum Late {
    /// They are: these leases, under this policy, past this deadline.
    Now(Vec<u64>, LatePolicy, Duration),
    /// They will be at this instant if they do not ack.
    At(Instant),
    /// No deadline applies.
    Never,
}
use super::{LeaseInfo, Shared, copies, json_size};

/// The producer's handle on a ring (see [`Server::create_ring`](crate::Server::create_ring)).
///
/// The cycle: [`acquire`](Self::acquire) a slot (blocks while it is in use),
/// fill what the slot's descriptors refer to, then
/// [`publish`](Self::publish) it with a notice; every subscriber gets a
/// [`FrameNotice`](crate::FrameNotice) and acks it when done. Slots are handed
/// out in order `0, 1, …, n-1, 0, …`. Dropping the handle unpublishes the
/// ring.
///
/// Layers: this is the channel's side of a ring, descriptors and JSON
/// notices only (no CUDA). The core's `cuda_ipc::exchange::RingPublisher`
/// wraps one, adding the slots' buffers, the ring's event and its fence.
pub struct ServerRing {
    pub(super) shared: Arc<Shared>,
    pub(super) entry: u64,
    pub(super) name: String,
    pub(super) slot_count: usize,
    /// When [`acquire`](Self::acquire) spins before it sleeps.
    pub(super) backoff: Mutex<Backoff>,
}

impl std::fmt::Debug for ServerRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerRing")
            .field("name", &self.name)
            .field("slot_count", &self.slot_count)
            .finish_non_exhaustive()
    }
}

impl ServerRing {
    /// The ring's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The number of slots (as [`Vec::len`]; a slot's index is a `u32`
    /// below it).
    pub fn slot_count(&self) -> usize {
        self.slot_count
    }

    /// Runs `f` on the ring, if it is still published.
    fn with_ring<T>(
        &self,
        st: &mut State,
        f: impl FnOnce(&mut Ring, &BTreeSet<u64>) -> T,
    ) -> Result<T, ChannelError> {
        if st.closed {
            return Err(ChannelError::ShutDown);
        }
        match st.entries.get_mut(&self.entry) {
            Some(Entry {
                published: true,
                body: Body::Ring(ring),
                leases,
                ..
            }) => Ok(f(ring, leases)),
            _ => Err(ChannelError::NotFound {
                name: self.name.clone(),
            }),
        }
    }

    /// Waits until the next slot in order is free (every subscriber that was
    /// sent its last frame acked it or went away), marks it acquired and
    /// returns its index. `None` waits for ever; a timeout gives
    /// [`ChannelError::Timeout`].
    ///
    /// With an ack deadline ([`set_ack_deadline`](Self::set_ack_deadline)),
    /// a subscriber that holds the slot past it is skipped or evicted, so
    /// that one stuck subscriber cannot stop the ring.
    ///
    /// A slot still held is first waited for by spinning, for up to
    /// [`ServerConfig::spin`](crate::ServerConfig::spin) (backing off when
    /// such spins catch nothing), then by sleeping: an ack that comes
    /// within the spin costs the producer no wake-up.
    pub fn acquire(&self, timeout: Option<Duration>) -> Result<u32, ChannelError> {
        let deadline = timeout.map(crate::deadline_in);
        let max_queued = self.shared.max_queued;
        let mut spun = false;
        let mut st = lock(&self.shared.state);
        loop {
            let got = self.with_ring(&mut st, |ring, _| {
                let i = ring.next;
                let slot = &mut ring.slots[i];
                if slot.state == SlotState::Free {
                    slot.state = SlotState::Acquired;
                    ring.next = (i + 1) % ring.slots.len();
                    return Ok(i);
                }
                // The subscribers late on this slot, if its deadline passed;
                // else when it will.
                let late = match ring.ack_deadline {
                    Some((limit, policy)) if slot.state == SlotState::InFlight => {
                        let due = slot.sent_at + limit;
                        if Instant::now() >= due {
                            // The slot is free whatever happens to them.
                            slot.state = SlotState::Free;
                            let late = std::mem::take(&mut slot.pending);
                            Late::Now(late.into_iter().collect(), policy, limit)
                        } else {
                            Late::At(due)
                        }
                    }
                    _ => Late::Never,
                };
                Err((i, late))
            })?;
            let (waiting_for, late) = match got {
                Ok(i) => return Ok(i as u32),
                Err(x) => x,
            };
            let mut wake = deadline;
            match late {
                Late::Now(leases, policy, limit) => {
                    for lease in leases {
                        let reason = format!(
                            "this subscriber did not ack frame(s) of ring {:?} within the \
                             producer's ack deadline of {limit:?}",
                            self.name
                        );
                        tracing::info!(lease, ring = %self.name, ?policy, "{reason}");
                        st.late_subscriber(lease, policy == LatePolicy::Evict, &reason, max_queued);
                    }
                    continue;
                }
                Late::At(due) => wake = Some(wake.map_or(due, |d| d.min(due))),
                Late::Never => {}
            }
            if !spun {
                spun = true;
                let budget = lock(&self.backoff).next(self.shared.spin);
                if !budget.is_zero() {
                    let seen = self.shared.acks.load(Ordering::Acquire);
                    drop(st);
                    let began = Instant::now();
                    let end = wake.map_or(began + budget, |w| w.min(began + budget));
                    let caught = loop {
                        if self.shared.acks.load(Ordering::Acquire) != seen {
                            break true;
                        }
                        if Instant::now() >= end {
                            break false;
                        }
                        for _ in 0..SPIN_PAUSES {
                            std::hint::spin_loop();
                        }
                    };
                    // A spin cut short by a deadline caught nothing.
                    let waited = if caught { began.elapsed() } else { budget };
                    lock(&self.backoff).record(budget, waited);
                    // Looks again whatever ended the spin.
                    st = lock(&self.shared.state);
                    continue;
                }
            }
            st = match wake {
                None => self
                    .shared
                    .changed
                    .wait(st)
                    .unwrap_or_else(std::sync::PoisonError::into_inner),
                Some(w) => {
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return Err(ChannelError::Timeout {
                            what: format!(
                                "slot {waiting_for} of ring {:?} to be acknowledged by every \
                                 subscriber",
                                self.name
                            ),
                            after: timeout.unwrap_or_default(),
                        });
                    }
                    let left = w.saturating_duration_since(Instant::now());
                    self.shared
                        .changed
                        .wait_timeout(st, left)
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .0
                }
            };
        }
    }

    /// Sets how long a subscriber may keep a frame before acking it, and
    /// what [`acquire`](Self::acquire) does with a subscriber that keeps it
    /// longer: [`LatePolicy::Evict`] ends its subscription,
    /// [`LatePolicy::Skip`] withdraws its frames and carries on (a
    /// subscriber skipped twice without an ack between is evicted). Either
    /// way the subscriber is told why. `None` (the default) waits for
    /// every subscriber for ever.
    pub fn set_ack_deadline(
        &self,
        deadline: Option<Duration>,
        policy: LatePolicy,
    ) -> Result<(), ChannelError> {
        let mut st = lock(&self.shared.state);
        self.with_ring(&mut st, |ring, _| {
            ring.ack_deadline = deadline.map(|d| (d, policy));
        })?;
        drop(st);
        // An acquire waiting now re-reads the deadline.
        self.shared.changed.notify_all();
        Ok(())
    }

    /// Ends the subscription `lease` now: its frames are withdrawn, the
    /// slots it held are free, and the subscriber is told `reason` (its
    /// `next_frame` returns [`ChannelError::Evicted`]).
    pub fn evict(&self, lease: u64, reason: &str) -> Result<(), ChannelError> {
        let max_queued = self.shared.max_queued;
        let mut st = lock(&self.shared.state);
        let subscribed = self.with_ring(&mut st, |_, leases| leases.contains(&lease))?;
        if !subscribed {
            return Err(ChannelError::arg(
                "lease",
                format!(
                    "lease {lease} is not a subscription of ring {:?} (see subscribers())",
                    self.name
                ),
            ));
        }
        let reason = format!(
            "the producer of ring {:?} evicted this subscriber: {reason}",
            self.name
        );
        st.late_subscriber(lease, true, &reason, max_queued);
        drop(st);
        self.shared.changed.notify_all();
        Ok(())
    }

    /// Publishes an acquired slot: sends a frame with the next sequence
    /// number (from 1), which it returns, and `notice` to every current
    /// subscriber. The slot is free again once they all ack it (at once if
    /// there are none). Never blocks on subscribers.
    pub fn publish(&self, slot: u32, notice: Value) -> Result<u64, ChannelError> {
        json_size(&notice, "notice")?;
        let max_queued = self.shared.max_queued;
        let mut guard = lock(&self.shared.state);
        let st = &mut *guard;
        let (conns, leases) = (&st.conns, &st.leases);
        let closed = st.closed;
        if closed {
            return Err(ChannelError::ShutDown);
        }
        let Some(Entry {
            published: true,
            body: Body::Ring(ring),
            leases: subscribers,
            ..
        }) = st.entries.get_mut(&self.entry)
        else {
            return Err(ChannelError::NotFound {
                name: self.name.clone(),
            });
        };
        let count = ring.slots.len();
        let Some(s) = ring
            .slots
            .get_mut(slot as usize)
            .filter(|s| s.state == SlotState::Acquired)
        else {
            return Err(ChannelError::arg(
                "slot",
                format!(
                    "slot {slot} of ring {:?} (of {count}) is not acquired; publish only a slot \
                     that acquire() returned, once",
                    self.name
                ),
            ));
        };
        ring.seq += 1;
        let seq = ring.seq;
        s.seq = seq;
        s.sent_at = Instant::now();
        s.pending.clear();
        let targets: Vec<(u64, &Arc<Conn>)> = subscribers
            .iter()
            .filter_map(|lease| Some((*lease, conns.get(&leases.get(lease)?.conn)?)))
            .collect();
        for ((lease, conn), notice) in targets.iter().zip(copies(notice, targets.len())) {
            let sent = conn.push(
                Message::RingFrame {
                    lease: *lease,
                    slot,
                    seq,
                    notice,
                },
                Vec::new(),
                max_queued,
            );
            if sent {
                s.pending.insert(*lease);
            }
        }
        s.state = if s.pending.is_empty() {
            SlotState::Free
        } else {
            SlotState::InFlight
        };
        Ok(seq)
    }

    /// Gives back an acquired slot without publishing it; [`acquire`](Self::acquire)
    /// hands it out again when its turn in the cycle comes.
    pub fn cancel(&self, slot: u32) -> Result<(), ChannelError> {
        let mut st = lock(&self.shared.state);
        let done = self.with_ring(&mut st, |ring, _| match ring.slots.get_mut(slot as usize) {
            Some(s) if s.state == SlotState::Acquired => {
                s.state = SlotState::Free;
                true
            }
            _ => false,
        })?;
        drop(st);
        if !done {
            return Err(ChannelError::arg(
                "slot",
                format!("slot {slot} of ring {:?} is not acquired", self.name),
            ));
        }
        self.shared.changed.notify_all();
        Ok(())
    }

    /// The current subscribers, in lease order.
    pub fn subscribers(&self) -> Vec<LeaseInfo> {
        let st = lock(&self.shared.state);
        let Some(e) = st.entries.get(&self.entry) else {
            return Vec::new();
        };
        e.leases
            .iter()
            .filter_map(|id| st.lease_info(*id, st.leases.get(id)?))
            .collect()
    }
}

impl Drop for ServerRing {
    fn drop(&mut self) {
        let mut st = lock(&self.shared.state);
        st.unpublish(self.entry, self.shared.max_queued);
        drop(st);
        self.shared.changed.notify_all();
    }
}
