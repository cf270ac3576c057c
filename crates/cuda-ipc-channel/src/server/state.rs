//! What the server knows: entries, rings and their slots, leases, connections.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::wire::{EntryKind, Message, Meta};

use super::LeaseInfo;
use super::conn::{Conn, SlotSource};
use super::stall::{Bucket, StallBudget};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SlotState {
    /// The producer may acquire it.
    Free,
    /// The producer acquired it and has not published it yet.
    Acquired,
    /// Published; waiting for the subscribers in `pending`.
    InFlight,
}

pub(super) struct Slot {
    pub(super) state: SlotState,
    /// When the slot's latest frame was published.
    pub(super) sent_at: Instant,
    /// The sequence number of the slot's latest frame.
    pub(super) seq: u64,
    /// The leases that were sent the latest message and have not acked it.
    pub(super) pending: BTreeSet<u64>,
    /// Since when the producer has been waiting for this slot, if it is
    /// (what a late ack is charged from; see [`StallBudget`]).
    pub(super) waited_since: Option<Instant>,
}

/// What the producer does with a subscriber that has not acked a frame
/// within the ring's ack deadline (see
/// [`ServerRing::set_ack_deadline`](super::ServerRing::set_ack_deadline))
/// or whose user spent its [`StallBudget`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LatePolicy {
    /// End its subscription; it is told why
    /// ([`ChannelError::Evicted`](crate::ChannelError::Evicted)).
    Evict,
    /// Withdraw the frames it holds and carry on without it; it is told
    /// ([`ChannelError::Lagged`](crate::ChannelError::Lagged)) and resumes with
    /// the next frame published. A subscriber that is skipped twice
    /// without acking any frame in between is evicted.
    Skip,
}

pub(super) struct Ring {
    /// The slots' metadata and descriptors, sent to each new subscriber.
    pub(super) sources: Arc<[SlotSource]>,
    pub(super) slots: Vec<Slot>,
    /// How long a subscriber may take to ack a frame; `None`: no limit
    /// per frame.
    pub(super) ack_deadline: Option<Duration>,
    /// What happens to a late subscriber.
    pub(super) late_policy: LatePolicy,
    /// How long one user's subscribers may hold up the producer while
    /// other users subscribe; `None`: no limit.
    pub(super) stall_budget: Option<StallBudget>,
    /// Each user's stall account (see [`StallBudget`]).
    pub(super) stalls: HashMap<u32, Bucket>,
    /// How many subscriptions each user holds (kept as leases come and
    /// go, so that whether others subscribe costs no scan).
    pub(super) users: BTreeMap<u32, usize>,
    /// The slot `acquire` hands out next.
    pub(super) next: usize,
    /// The last sequence number used.
    pub(super) seq: u64,
}

pub(super) enum Body {
    Plain {
        fds: Vec<OwnedFd>,
        /// The entry's version: how many updates it has had.
        version: u64,
    },
    Ring(Ring),
}

pub(super) struct Entry {
    pub(super) name: String,
    /// Shared with every attach's answer, with its JSON text made at
    /// publish: a set's record can be hundreds of kilobytes, and copying it
    /// under the state lock for each attach cost 0.25 ms at 1,000 tensors,
    /// encoding it again for each attach a fifth of the answer's time.
    pub(super) meta: Arc<Meta>,
    /// The size of `meta`'s JSON.
    pub(super) meta_bytes: usize,
    /// False once unpublished: no new leases; dropped with its last lease.
    pub(super) published: bool,
    pub(super) leases: BTreeSet<u64>,
    pub(super) body: Body,
}

impl Entry {
    pub(super) fn kind(&self) -> EntryKind {
        match self.body {
            Body::Plain { .. } => EntryKind::Entry,
            Body::Ring(_) => EntryKind::Ring,
        }
    }
}

pub(super) struct Lease {
    pub(super) entry: u64,
    pub(super) conn: u64,
    pub(super) pid: u32,
    pub(super) uid: u32,
    /// Times this ring subscription was skipped for a late ack since its
    /// last ack.
    pub(super) skips: u32,
    /// The stream lease it was pushed through ([`Server::push`](super::Server::push)), if any.
    pub(super) via: Option<u64>,
}

/// A lease granted or ended, as [`CallHandler::on_lease`](super::CallHandler::on_lease) hears of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LeaseEvent<'a> {
    /// True for a new lease, false for one that ended (released, its
    /// connection closed, or evicted).
    pub granted: bool,
    /// The name of the entry or ring it is on.
    pub name: &'a str,
    /// The lease's id.
    pub lease: u64,
    /// The holder's connection.
    pub connection: u64,
    /// The holder's pid (0 where it is not visible, see [`Ucred`](crate::Ucred)).
    pub pid: u32,
    /// The holder's uid.
    pub uid: u32,
}

/// What a handler runs when a lease is granted or ends.
pub type LeaseFn = dyn for<'a> Fn(&LeaseEvent<'a>) + Send + Sync;

#[derive(Default)]
pub(super) struct State {
    pub(super) closed: bool,
    /// Ids for entries, leases and connections, never reused.
    pub(super) last_id: u64,
    /// Published names and their entries.
    pub(super) names: BTreeMap<String, u64>,
    /// Every live entry, published or waiting for its last lease.
    pub(super) entries: HashMap<u64, Entry>,
    pub(super) leases: HashMap<u64, Lease>,
    /// Each connection's leases, so that ending a connection touches only
    /// its own.
    pub(super) by_conn: HashMap<u64, BTreeSet<u64>>,
    pub(super) conns: HashMap<u64, Arc<Conn>>,
    /// Connections that ended while descriptors we sent were still in
    /// their peer's receive queue: the kernel charges those to our user
    /// until the peer reads them or closes its socket, so the connection
    /// keeps counting against the connection limits (and its socket stays
    /// open, to ask `SIOCOUTQ`) until then.
    pub(super) lingering: Vec<Arc<Conn>>,
    /// Names whose new leases are refused, with the refusal's code and
    /// message ([`Server::refuse_attaches`](super::Server::refuse_attaches)).
    pub(super) refused: HashMap<String, (String, String)>,
    /// The call handler's [`on_lease`](super::CallHandler::on_lease).
    pub(super) lease_watch: Option<Arc<LeaseFn>>,
}

impl Ring {
    /// A ring of one free slot per source, with the defaults: no ack
    /// deadline, late subscribers skipped, [`StallBudget::DEFAULT`].
    pub(super) fn new(sources: Arc<[SlotSource]>) -> Ring {
        let slots = (0..sources.len())
            .map(|_| Slot {
                state: SlotState::Free,
                sent_at: Instant::now(),
                seq: 0,
                pending: BTreeSet::new(),
                waited_since: None,
            })
            .collect();
        Ring {
            sources,
            slots,
            ack_deadline: None,
            late_policy: LatePolicy::Skip,
            stall_budget: Some(StallBudget::DEFAULT),
            stalls: HashMap::new(),
            users: BTreeMap::new(),
            next: 0,
            seq: 0,
        }
    }

    /// Whether a user other than `uid` subscribes.
    pub(super) fn others_subscribe(&self, uid: u32) -> bool {
        self.users.keys().any(|u| *u != uid)
    }

    /// Charges user `uid` for holding up the producer from `began` to
    /// `now` (one of its subscribers acked, or was found late), if the
    /// ring has a stall budget and `shared` (subscribers of other users
    /// were held up too).
    pub(super) fn charge_stall(&mut self, uid: u32, began: Instant, now: Instant, shared: bool) {
        let Some(b) = self.stall_budget.filter(|_| shared) else {
            return;
        };
        self.stalls
            .entry(uid)
            .or_insert_with(|| Bucket::full(b.burst, now))
            .charge(b.share, b.burst, now, now.saturating_duration_since(began));
    }

    /// Whether user `uid` owes stall time at `now` (see [`StallBudget`]),
    /// on a ring that other users subscribe to (`shared`).
    pub(super) fn in_stall_debt(&self, uid: u32, now: Instant, shared: bool) -> bool {
        let Some(b) = self.stall_budget.filter(|_| shared) else {
            return false;
        };
        self.stalls
            .get(&uid)
            .is_some_and(|a| a.balance(b.share, b.burst, now) < 0.0)
    }

    /// How long from `now` user `uid` may still hold up the producer that
    /// has waited since `began` (zero: it is late now), or `None` if its
    /// stalls are not limited (no budget, or no other user subscribes).
    pub(super) fn stall_left(
        &self,
        uid: u32,
        began: Instant,
        now: Instant,
        shared: bool,
    ) -> Option<Duration> {
        let b = self.stall_budget.filter(|_| shared)?;
        let balance = self
            .stalls
            .get(&uid)
            .map_or(b.burst.as_secs_f64(), |a| a.balance(b.share, b.burst, now));
        let left = balance - now.saturating_duration_since(began).as_secs_f64();
        Some(Duration::from_secs_f64(left.clamp(0.0, 3600.0)))
    }
}

/// A table holding at least this many slots is given back to the
/// allocator once it is three quarters empty (see [`State::compact`]).
const COMPACT_ABOVE: usize = 256;

/// Shrinks `map` to twice its length once it is three quarters empty.
fn compact_map<K: Eq + std::hash::Hash, V>(map: &mut HashMap<K, V>) {
    if map.capacity() > COMPACT_ABOVE && map.len() < map.capacity() / 4 {
        map.shrink_to(2 * map.len());
    }
}

impl State {
    /// Gives back what the tables of leases, connections and entries
    /// grew to when a peer filled them: a hash table never shrinks on its
    /// own, so many connections taking their leases up to the limit would
    /// otherwise leave the server that much bigger after they left.
    pub(super) fn compact(&mut self) {
        compact_map(&mut self.leases);
        compact_map(&mut self.by_conn);
        compact_map(&mut self.conns);
        compact_map(&mut self.entries);
    }

    /// How many leases connection `conn` holds.
    pub(super) fn leases_of(&self, conn: u64) -> usize {
        self.by_conn.get(&conn).map_or(0, BTreeSet::len)
    }

    /// The id of the entry published as `name`: refused once the server
    /// is shut down, and for a name nothing is published under.
    pub(super) fn published_id(&self, name: &str) -> Result<u64, crate::ChannelError> {
        if self.closed {
            return Err(crate::ChannelError::ShutDown);
        }
        self.names
            .get(name)
            .copied()
            .ok_or_else(|| crate::ChannelError::NotFound { name: name.into() })
    }

    pub(super) fn new_id(&mut self) -> u64 {
        self.last_id += 1;
        self.last_id
    }

    /// A new lease of `conn` on entry `entry` (which must exist), recorded
    /// in the entry, the connection's index and the lease table.
    pub(super) fn grant_lease(&mut self, entry: u64, conn: &Conn) -> u64 {
        let lease = self.new_id();
        if let Some(e) = self.entries.get_mut(&entry) {
            e.leases.insert(lease);
            if let Body::Ring(ring) = &mut e.body {
                *ring.users.entry(conn.cred.uid).or_default() += 1;
            }
        }
        self.by_conn.entry(conn.id).or_default().insert(lease);
        let l = Lease {
            entry,
            conn: conn.id,
            pid: conn.cred.pid,
            uid: conn.cred.uid,
            skips: 0,
            via: None,
        };
        self.tell_lease(true, lease, &l);
        self.leases.insert(lease, l);
        lease
    }

    /// Tells the call handler's lease watch of a lease granted or ended.
    fn tell_lease(&self, granted: bool, lease: u64, l: &Lease) {
        let (Some(watch), Some(e)) = (&self.lease_watch, self.entries.get(&l.entry)) else {
            return;
        };
        let event = LeaseEvent {
            granted,
            name: &e.name,
            lease,
            connection: l.conn,
            pid: l.pid,
            uid: l.uid,
        };
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| watch(&event))).is_err() {
            tracing::error!(lease, "a call handler's lease watch panicked");
        }
    }

    /// Drops the lingering connections whose peers have received (or
    /// discarded, by closing) every descriptor we sent them.
    pub(super) fn reap_lingering(&mut self) {
        self.lingering.retain(|c| c.unread_fds() > 0);
    }

    /// Every connection that counts against the connection limits: those
    /// served and those lingering.
    pub(super) fn counted_conns(&self) -> impl Iterator<Item = &Arc<Conn>> {
        self.conns.values().chain(self.lingering.iter())
    }

    /// A ring subscriber did not ack in time, or the producer evicts it:
    /// withdraws its frames (freeing the slots only it held) and tells it
    /// why; with `evict` (or a second skip without an ack between) ends its
    /// lease. Returns whether the lease ended. The caller notifies waiters.
    pub(super) fn late_subscriber(
        &mut self,
        lease: u64,
        evict: bool,
        reason: &str,
        max_queued: usize,
    ) -> bool {
        let Some(l) = self.leases.get_mut(&lease) else {
            return false;
        };
        l.skips += 1;
        let evict = evict || l.skips > 1;
        let (entry, conn) = (l.entry, l.conn);
        let Some(Entry {
            body: Body::Ring(ring),
            ..
        }) = self.entries.get_mut(&entry)
        else {
            return false;
        };
        for slot in &mut ring.slots {
            if slot.pending.remove(&lease)
                && slot.pending.is_empty()
                && slot.state == SlotState::InFlight
            {
                slot.state = SlotState::Free;
            }
        }
        let stale_through = ring.seq;
        let reason = if evict && !reason.contains("evict") {
            format!("{reason}; the subscription is ended (evicted)")
        } else {
            reason.to_owned()
        };
        if let Some(c) = self.conns.get(&conn) {
            c.push(
                Message::RingLate {
                    lease,
                    stale_through,
                    evicted: evict,
                    reason,
                },
                Vec::new(),
                max_queued,
            );
        }
        if evict {
            self.end_lease(lease);
        }
        evict
    }

    /// Ends a lease; drops its entry if that was the last lease on an
    /// unpublished entry. The caller notifies waiters.
    pub(super) fn end_lease(&mut self, lease: u64) -> Option<Lease> {
        let l = self.leases.remove(&lease)?;
        self.tell_lease(false, lease, &l);
        if let Some(held) = self.by_conn.get_mut(&l.conn) {
            held.remove(&lease);
        }
        let mut drop_entry = false;
        if let Some(e) = self.entries.get_mut(&l.entry) {
            e.leases.remove(&lease);
            if let Body::Ring(ring) = &mut e.body {
                if let Some(n) = ring.users.get_mut(&l.uid) {
                    *n -= 1;
                    if *n == 0 {
                        ring.users.remove(&l.uid);
                    }
                }
                for slot in &mut ring.slots {
                    if slot.pending.remove(&lease)
                        && slot.pending.is_empty()
                        && slot.state == SlotState::InFlight
                    {
                        slot.state = SlotState::Free;
                    }
                }
            }
            drop_entry = !e.published && e.leases.is_empty();
        }
        if drop_entry {
            self.entries.remove(&l.entry);
        }
        Some(l)
    }

    /// Unpublishes an entry: tells its lease holders, and drops it if no
    /// lease remains. The caller notifies waiters.
    pub(super) fn unpublish(&mut self, id: u64, max_queued: usize) {
        let Some(e) = self.entries.get_mut(&id) else {
            return;
        };
        if !e.published {
            return;
        }
        e.published = false;
        if self.names.get(&e.name) == Some(&id) {
            self.names.remove(&e.name);
        }
        for lease in &e.leases {
            if let Some(conn) = self.leases.get(lease).and_then(|l| self.conns.get(&l.conn)) {
                conn.push(
                    Message::Unpublished {
                        lease: *lease,
                        name: e.name.clone(),
                    },
                    Vec::new(),
                    max_queued,
                );
            }
        }
        if e.leases.is_empty() {
            self.entries.remove(&id);
        }
    }

    /// The number of leases on entries called `name`, published or not.
    pub(super) fn lease_count(&self, name: &str) -> usize {
        self.entries
            .values()
            .filter(|e| e.name == name)
            .map(|e| e.leases.len())
            .sum()
    }

    pub(super) fn lease_info(&self, lease: u64, l: &Lease) -> Option<LeaseInfo> {
        let e = self.entries.get(&l.entry)?;
        Some(LeaseInfo {
            lease,
            entry: l.entry,
            name: e.name.clone(),
            kind: e.kind(),
            pid: l.pid,
            uid: l.uid,
            connection: l.conn,
        })
    }
}
