//! What the server knows: entries, rings and their slots, leases, connections.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::fd::OwnedFd;
use std::sync::Arc;

use serde_json::Value;

use crate::wire::{EntryKind, Message};

use super::LeaseInfo;
use super::conn::Conn;

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
    pub(super) meta: Value,
    pub(super) fds: Vec<OwnedFd>,
    pub(super) state: SlotState,
    /// The sequence number of the slot's latest frame.
    pub(super) seq: u64,
    /// The leases that were sent the latest message and have not acked it.
    pub(super) pending: BTreeSet<u64>,
}

pub(super) struct Ring {
    pub(super) slots: Vec<Slot>,
    /// The slot `acquire` hands out next.
    pub(super) next: usize,
    /// The last sequence number used.
    pub(super) seq: u64,
}

pub(super) enum Body {
    Plain { fds: Vec<OwnedFd>, generation: u64 },
    Ring(Ring),
}

pub(super) struct Entry {
    pub(super) name: String,
    /// Shared with every attach's answer: a set's record can be hundreds of
    /// kilobytes, and copying it under the state lock for each attach cost
    /// 0.25 ms at 1,000 tensors.
    pub(super) meta: Arc<Value>,
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
}

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
}

impl State {
    /// How many leases connection `conn` holds.
    pub(super) fn leases_of(&self, conn: u64) -> usize {
        self.by_conn.get(&conn).map_or(0, BTreeSet::len)
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
        }
        self.by_conn.entry(conn.id).or_default().insert(lease);
        self.leases.insert(
            lease,
            Lease {
                entry,
                conn: conn.id,
                pid: conn.cred.pid,
                uid: conn.cred.uid,
            },
        );
        lease
    }

    /// Ends a lease; drops its entry if that was the last lease on an
    /// unpublished entry. The caller notifies waiters.
    pub(super) fn end_lease(&mut self, lease: u64) -> Option<Lease> {
        let l = self.leases.remove(&lease)?;
        if let Some(held) = self.by_conn.get_mut(&l.conn) {
            held.remove(&lease);
        }
        let mut drop_entry = false;
        if let Some(e) = self.entries.get_mut(&l.entry) {
            e.leases.remove(&lease);
            if let Body::Ring(ring) = &mut e.body {
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
            name: e.name.clone(),
            kind: e.kind(),
            pid: l.pid,
            uid: l.uid,
        })
    }
}
