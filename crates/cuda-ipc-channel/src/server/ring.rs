//! The producer's side of a ring.

use std::collections::{BTreeSet, HashMap};
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
pub(super) enum Late {
    /// They are: these leases, each with why, under this policy.
    Now(Vec<(u64, String)>, LatePolicy),
    /// One will be at this instant if it does not ack.
    At(Instant),
    /// No deadline or budget applies.
    Never,
}
use super::session::fatal;
use super::state::Lease;
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

    /// Runs `f` on the ring, its subscriptions and every lease, if it is
    /// still published.
    fn with_ring<T>(
        &self,
        st: &mut State,
        f: impl FnOnce(&mut Ring, &BTreeSet<u64>, &HashMap<u64, Lease>) -> T,
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
            }) => Ok(f(ring, leases, &st.leases)),
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
    /// A subscriber that holds the slot past the ring's ack deadline
    /// ([`set_ack_deadline`](Self::set_ack_deadline)), or whose user has
    /// spent its [`StallBudget`](crate::StallBudget) while other users'
    /// subscribers wait ([`set_stall_budget`](Self::set_stall_budget)), is
    /// skipped or evicted, so that a stuck or hostile subscriber cannot
    /// stop the ring for the others.
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
            let name = &self.name;
            let got = self.with_ring(&mut st, |ring, _, all| {
                let i = ring.next;
                if ring.slots[i].state == SlotState::Free {
                    let slot = &mut ring.slots[i];
                    slot.state = SlotState::Acquired;
                    slot.waited_since = None;
                    ring.next = (i + 1) % ring.slots.len();
                    return Ok(i);
                }
                Err((i, late_on_slot(ring, i, all, name)))
            })?;
            let (waiting_for, late) = match got {
                Ok(i) => return Ok(i as u32),
                Err(x) => x,
            };
            let mut wake = deadline;
            match late {
                Late::Now(leases, policy) => {
                    for (lease, reason) in leases {
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
    /// what [`acquire`](Self::acquire) does with a late subscriber (one past
    /// this deadline, or whose user spent its
    /// [`StallBudget`](crate::StallBudget)): [`LatePolicy::Evict`] ends its
    /// subscription, [`LatePolicy::Skip`] (the default) withdraws its
    /// frames and carries on (a subscriber skipped twice without an ack
    /// between is evicted). Either way the subscriber is told why. `None`
    /// (the default) sets no deadline per frame: the stall budget alone
    /// limits a subscriber, and only while other users subscribe.
    pub fn set_ack_deadline(
        &self,
        deadline: Option<Duration>,
        policy: LatePolicy,
    ) -> Result<(), ChannelError> {
        self.set(|ring| {
            ring.ack_deadline = deadline;
            ring.late_policy = policy;
        })
    }

    /// Sets how long one user's subscribers may hold up the producer while
    /// other users' subscribers wait (see [`StallBudget`](crate::StallBudget);
    /// [`StallBudget::DEFAULT`](crate::StallBudget::DEFAULT) unless set).
    /// `None` lets a subscriber hold the ring for as long as the ack
    /// deadline allows (for ever without one): only for rings whose
    /// subscribers are all trusted. Accounts so far are kept.
    pub fn set_stall_budget(&self, budget: Option<crate::StallBudget>) -> Result<(), ChannelError> {
        self.set(|ring| ring.stall_budget = budget)
    }

    /// Changes the ring's settings with `f`, and has a waiting
    /// [`acquire`](Self::acquire) read them again.
    fn set(&self, f: impl FnOnce(&mut Ring)) -> Result<(), ChannelError> {
        let mut st = lock(&self.shared.state);
        self.with_ring(&mut st, |ring, _, _| f(ring))?;
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
        let subscribed = self.with_ring(&mut st, |_, leases, _| leases.contains(&lease))?;
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
        // A user in stall debt gets no frames until its budget is back
        // (it was told it lagged when it was skipped): its subscribers
        // cost the producer nothing meanwhile, however many there are.
        let now = Instant::now();
        let shared_ring = ring.users.len() > 1;
        let in_debt: BTreeSet<u32> = ring
            .users
            .keys()
            .copied()
            .filter(|uid| ring.in_stall_debt(*uid, now, shared_ring))
            .collect();
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
        s.waited_since = None;
        s.pending.clear();
        let targets: Vec<(u64, &Arc<Conn>)> = subscribers
            .iter()
            .filter_map(|lease| {
                let l = leases.get(lease)?;
                (!in_debt.contains(&l.uid)).then_some((*lease, conns.get(&l.conn)?))
            })
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
        let done = self.with_ring(&mut st, |ring, _, _| {
            match ring.slots.get_mut(slot as usize) {
                Some(s) if s.state == SlotState::Acquired => {
                    s.state = SlotState::Free;
                    true
                }
                _ => false,
            }
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

impl Shared {
    /// Applies a subscriber's ack of frame `seq` in `slot`: once every
    /// subscriber sent it acked it, the slot is free for the producer; if
    /// the producer was waiting for it, the wait is charged to the
    /// subscriber's user (see [`StallBudget`](crate::StallBudget)). An
    /// ack of a lease this connection does not hold (released meanwhile)
    /// is ignored; one of a plain entry or a slot the ring does not have
    /// ends the connection.
    pub(super) fn ack(&self, conn: &Conn, lease: u64, slot: u32, seq: u64) -> Result<(), Message> {
        let mut guard = lock(&self.state);
        let st = &mut *guard;
        // An ack racing with the client's own release of the lease is harmless.
        let Some(l) = st.leases.get(&lease).filter(|l| l.conn == conn.id) else {
            tracing::debug!(
                lease,
                "ignoring an ack for a lease this connection does not hold"
            );
            return Ok(());
        };
        let uid = l.uid;
        let Some(Entry {
            body: Body::Ring(ring),
            ..
        }) = st.entries.get_mut(&l.entry)
        else {
            return Err(fatal(
                conn,
                &ChannelError::protocol(format!("lease {lease} is not a ring lease")),
            ));
        };
        let count = ring.slots.len();
        let Some(s) = ring.slots.get_mut(slot as usize) else {
            return Err(fatal(
                conn,
                &ChannelError::protocol(format!(
                    "ack for slot {slot}, but the ring has {count} slots"
                )),
            ));
        };
        if s.seq == seq && s.pending.remove(&lease) {
            // The producer waited for this ack: the stall is the user's.
            let waited = s.waited_since;
            if s.pending.is_empty() && s.state == SlotState::InFlight {
                s.state = SlotState::Free;
                s.waited_since = None;
            }
            if let Some(began) = waited {
                let shared = ring.others_subscribe(uid);
                ring.charge_stall(uid, began, Instant::now(), shared);
            }
            if let Some(l) = st.leases.get_mut(&lease) {
                l.skips = 0;
            }
            drop(guard);
            // A producer spinning in `acquire` sees this without a wake-up.
            self.acks.fetch_add(1, std::sync::atomic::Ordering::Release);
            self.changed.notify_all();
        }
        Ok(())
    }
}

/// The subscribers late on slot `i` of `ring` (in flight or acquired), or
/// when the first of them will be: each pending subscriber is late once
/// the ring's ack deadline has passed since the frame went out, or once
/// its user's stall budget is spent (while another user subscribes). The
/// late ones are taken off the slot (which is free once none is left)
/// and their users charged for the stall; the producer starts waiting for
/// the slot now if it was not already.
pub(super) fn late_on_slot(
    ring: &mut Ring,
    i: usize,
    all: &HashMap<u64, Lease>,
    name: &str,
) -> Late {
    let now = Instant::now();
    let slot = &mut ring.slots[i];
    if slot.state != SlotState::InFlight {
        return Late::Never;
    }
    let began = *slot.waited_since.get_or_insert(now);
    let (sent_at, deadline, policy) = (slot.sent_at, ring.ack_deadline, ring.late_policy);
    let mut late = Vec::new();
    let mut due: Option<Instant> = None;
    let pending: Vec<(u64, u32)> = slot
        .pending
        .iter()
        .filter_map(|l| Some((*l, all.get(l)?.uid)))
        .collect();
    for (lease, uid) in pending {
        let shared = ring.others_subscribe(uid);
        let by_deadline = deadline.map(|d| (sent_at + d, d));
        let by_budget = ring
            .stall_left(uid, began, now, shared)
            .map(|left| now + left);
        if let Some((at, limit)) = by_deadline
            && at <= now
        {
            late.push((
                lease,
                uid,
                shared,
                format!(
                    "this subscriber did not ack frame(s) of ring {name:?} within the \
                     producer's ack deadline of {limit:?}"
                ),
            ));
        } else if by_budget.is_some_and(|at| at <= now) {
            let b = ring.stall_budget.unwrap_or_default();
            late.push((
                lease,
                uid,
                shared,
                format!(
                    "the subscribers of user {uid} held up the producer of ring {name:?} longer \
                     than their share ({:.0} % of the time, at most {:?} at once) while other \
                     users' subscribers waited",
                    b.share * 100.0,
                    b.burst
                ),
            ));
        } else {
            for at in [by_deadline.map(|(at, _)| at), by_budget]
                .into_iter()
                .flatten()
            {
                due = Some(due.map_or(at, |d| d.min(at)));
            }
        }
    }
    if late.is_empty() {
        return due.map_or(Late::Never, Late::At);
    }
    let slot = &mut ring.slots[i];
    for (lease, ..) in &late {
        slot.pending.remove(lease);
    }
    if slot.pending.is_empty() {
        slot.state = SlotState::Free;
        slot.waited_since = None;
    }
    for (_, uid, shared, _) in &late {
        ring.charge_stall(*uid, began, now, *shared);
    }
    Late::Now(
        late.into_iter()
            .map(|(lease, _, _, reason)| (lease, reason))
            .collect(),
        policy,
    )
}
