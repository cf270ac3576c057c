//! A subscriber that connects again when its publisher's process ends and
//! another serves the same socket (the weight service under its keeper),
//! and takes back what it held.
//!
//! **Who reconnects.** A subscriber whose publisher said, as it welcomed
//! it, that another process serves its socket after it
//! ([`Reconnect::IfPublisherRestarts`](super::Reconnect), the default), or
//! one configured with [`Reconnect::Always`](super::Reconnect). A plain
//! publisher says no: its subscribers get `PeerGone` at once when it dies,
//! and nothing waits. An explicit [`Subscriber::reconnect`] always tries.
//!
//! **When.** At the next call that needs the connection: an attach, a wait
//! for an update (also one already waiting when the connection ends), a
//! release, a call, `reconnect`. Never in a `Drop`. One thread connects;
//! the others find the new connection. Bounded by the subscriber's timeout
//! (see `link.rs`).
//!
//! **What is taken back**, on the new connection, once the publisher
//! answers the ready call (it serves what it kept):
//! - the calls kept by [`Subscriber::call_and_keep`] are made again first
//!   (a service reader's `aside`, so that a writer in place finds it aside
//!   before it finds its lease);
//! - each cached chunk's lease, by the chunk's hidden entry (the same
//!   [`ChunkId`](crate::arena::ChunkId): the arena's id is kept); the file
//!   descriptors that come with it are closed, never imported again: the
//!   mapping held is that memory, at the same address;
//! - each set attached by name, when the publisher serves under that name
//!   the same version (the same arena, chunks and places, the same
//!   entries): its lease is taken back, and its waiter becomes the new
//!   process's event or fence (the old process's cannot be waited on).
//!   When it serves another version, the one held stays mapped without a
//!   lease (a warning says so, and a wait for its update returns at once);
//!   when it serves none, a wait says `Unpublished`; when it refuses the
//!   set for now (a write in place, a torn set), the lease is tried again
//!   at each later call.
//!
//! Then the publisher is told (once, and again when the sets still
//! refused are taken back or settled) that this subscriber took back what
//! it could ([`RECONNECTED_METHOD`](super::RECONNECTED_METHOD)), naming the
//! sets it still maps without a lease: the weight service waits for such a
//! reader of its process before in writes in place until then.
//!
//! What the old connection had told and not been asked for (notices
//! queued, events and fences opened, entry tables read) is forgotten: it
//! was the old process's. Rings, streams and single buffers are not taken
//! back: their calls fail with `PeerGone`, as before.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde_json::Value;

use crate::arena::ChunkId;
use crate::channel::{self, ChannelError, Client};
use crate::error::{Error, Result};
use crate::handle::IpcEventHandle;
use crate::set::{EntryTables, SetRecord};

use super::chunk_cache::ChunkKey;
use super::lease::{LeaseGuard, LeaseId, Standing};
use super::link::Connection;
use super::lock;
use super::reconnected::{KeptCall, Reconnected};
use super::set_attach::read_record;
use super::set_book::{chunk_entry_name, is_set_meta};
use super::subscriber::Subscriber;
use super::sync;
use super::wire::{EntryMeta, FenceMeta};

/// What the publisher serves now under a set's name, against the version
/// held.
#[derive(Debug)]
pub(super) enum TakeBack {
    /// The version held: the lease on the new connection, and what to
    /// wait on there.
    Same {
        lease: u64,
        event: Option<IpcEventHandle>,
        fence: Option<FenceMeta>,
        fds: Vec<OwnedFd>,
    },
    /// Not taken back: what became of it.
    Not(Standing),
}

/// Whether `now` is the version `held` of a set: the same arena, chunks
/// (id, place and size) and entries (in any order). The chunks of a kept
/// arena are never carved again, so the same places are the same memory.
pub(super) fn same_version(held: &SetRecord, now: &SetRecord) -> bool {
    fn entries(r: &SetRecord) -> Vec<&crate::set::SetEntry> {
        let mut e: Vec<&crate::set::SetEntry> = r.entries.iter().collect();
        e.sort_unstable_by(|a, b| a.name.cmp(&b.name));
        e
    }
    let places = |r: &SetRecord| {
        let mut p: Vec<(u64, u64, u64, u64)> = r
            .chunks
            .iter()
            .map(|c| {
                let d = &c.descriptor;
                (c.id, d.offset, d.byte_len, d.alloc_size)
            })
            .collect();
        p.sort_unstable();
        p
    };
    held.arena == now.arena
        && held.entries.len() == now.entries.len()
        && places(held) == places(now)
        && entries(held) == entries(now)
}

/// What a failed attach of a set's name on the new connection says of the
/// set.
pub(super) fn standing_of(e: ChannelError) -> Standing {
    match e {
        ChannelError::NotFound { .. } => Standing::Gone,
        ChannelError::Remote { code, message } => Standing::Missing(Some((code, message))),
        other => Standing::Missing(Some(("not_taken_back".into(), other.to_string()))),
    }
}

/// Attaches the set `name` on `client` and compares what it serves with
/// `held` (reading the record with `tables`). A lease not kept is released.
pub(super) fn take_back(
    client: &Client,
    name: &str,
    held: &SetRecord,
    tables: &EntryTables,
) -> TakeBack {
    let a = match client.attach(name) {
        Ok(a) => a,
        Err(e) => return TakeBack::Not(standing_of(e)),
    };
    let channel::Attachment {
        lease,
        mut meta,
        fds,
        ..
    } = a;
    let read = (|| -> Result<Option<(SetRecord, Option<FenceMeta>)>> {
        if !is_set_meta(&meta) {
            return Ok(None);
        }
        let fence = sync::take_set_fence(&mut meta)?;
        let now = read_record(client, &meta, Some(tables))?;
        Ok(same_version(held, &now).then_some((now, fence)))
    })();
    let found = match read {
        Ok(Some((now, fence))) => {
            return TakeBack::Same {
                lease,
                event: now.event,
                fence,
                fds,
            };
        }
        Ok(None) => Standing::Replaced,
        Err(e) => Standing::Missing(Some(("not_taken_back".into(), e.to_string()))),
    };
    let _ = client.release_nowait(lease);
    TakeBack::Not(found)
}

/// Attaches chunk `id`'s hidden entry on `client` and keeps the lease if
/// the publisher's chunk is `bytes` long (the cached mapping's size); the
/// descriptors that come with it are closed unused.
pub(super) fn take_back_chunk(client: &Client, id: ChunkId, bytes: u64) -> Option<u64> {
    let a = client.attach(&chunk_entry_name(id)).ok()?;
    let fits = EntryMeta::decode(&a.meta).is_ok_and(|d| d.alloc_size == bytes);
    drop(a.fds);
    if fits {
        return Some(a.lease);
    }
    tracing::warn!(
        chunk = %id,
        "the publisher's chunk under this id is not the size of the one mapped here: kept \
         mapped without a lease"
    );
    let _ = client.release_nowait(a.lease);
    None
}

impl Subscriber {
    /// The connection to work on: made again first when it ended and this
    /// subscriber reconnects, and the leases left to take back tried.
    pub(super) fn ready(&self) -> Result<Connection> {
        let conn = self.link.now();
        if !self.link.reconnects() {
            return Ok(conn);
        }
        if !conn.client.is_alive() {
            self.reconnect_from(conn.epoch)?;
            return Ok(self.link.now());
        }
        if self.retake_due.load(Ordering::Acquire) {
            let _one = lock(&self.link.reconnecting);
            let conn = self.link.now();
            self.retake_sets(&conn, &mut Reconnected::default());
            return Ok(conn);
        }
        Ok(conn)
    }

    /// Runs `op` on the connection [`ready`](Self::ready) gives; when
    /// `again` (an operation that can be made twice) and the connection
    /// ended during it, again on a new one, as long as each new connection
    /// ends during it too (the serving process restarted more than once)
    /// and the subscriber's timeout has not passed since the first end.
    pub(super) fn on_link<T>(
        &self,
        again: bool,
        op: impl Fn(&Connection) -> Result<T>,
    ) -> Result<T> {
        let mut conn = self.ready()?;
        let mut first_end: Option<std::time::Instant> = None;
        loop {
            match op(&conn) {
                Err(Error::Channel(ChannelError::PeerGone))
                    if again
                        && self.link.reconnects()
                        && first_end.is_none_or(|t| t.elapsed() < self.timeout) =>
                {
                    first_end.get_or_insert_with(std::time::Instant::now);
                    self.reconnect_from(conn.epoch)?;
                    conn = self.link.now();
                }
                r => return r,
            }
        }
    }

    /// Before an explicit release: a reconnecting subscriber whose
    /// connection ended connects again (a release never fails for it: the
    /// lease ended with its connection).
    pub(super) fn before_release(&self) {
        if let Err(e) = self.ready() {
            tracing::debug!(error = %e, "could not connect again before a release");
        }
    }

    /// Registers `guard`, a set's lease taken by name on the connection of
    /// epoch `epoch`, for reconnects to take back.
    pub(super) fn hold_for_reconnects(&self, guard: &Arc<LeaseGuard>, epoch: u64) {
        let mut held = lock(&self.held);
        held.retain(|w| w.strong_count() > 0);
        held.push(Arc::downgrade(guard));
        if epoch != self.link.epoch() {
            // Its connection ended as it was taken: the next call takes it back.
            self.retake_due.store(true, Ordering::Release);
        }
    }

    /// Notes a call to make again on new connections.
    pub(super) fn keep_call(&self, method: &str, key: &str, body: &Value, timeout: Duration) {
        let mut kept = lock(&self.kept_calls);
        kept.retain(|c| !c.is(method, key));
        kept.push(KeptCall {
            method: method.to_owned(),
            key: key.to_owned(),
            body: body.clone(),
            timeout,
        });
    }

    /// The work of [`Subscriber::reconnect`].
    pub(super) fn do_reconnect(&self) -> Result<Reconnected> {
        let conn = self.link.now();
        if !conn.client.is_alive() {
            return self.reconnect_from(conn.epoch);
        }
        let _one = lock(&self.link.reconnecting);
        let conn = self.link.now();
        let mut report = Reconnected::default();
        self.retake_chunks(&conn, &mut report);
        self.retake_sets(&conn, &mut report);
        Ok(report)
    }

    /// Connects again, unless another thread did since the connection of
    /// epoch `epoch` ended, and takes back what it can.
    fn reconnect_from(&self, epoch: u64) -> Result<Reconnected> {
        let _one = lock(&self.link.reconnecting);
        let mut report = Reconnected::default();
        let now = self.link.now();
        let conn = if now.epoch != epoch && now.client.is_alive() {
            now
        } else {
            let conn = self.link.connect_again(self.timeout)?;
            tracing::info!(
                path = %self.link.path().display(),
                epoch = conn.epoch,
                server_pid = conn.client.server_pid(),
                "connected again to the publisher"
            );
            self.forget_old_connection();
            report.connected = true;
            self.reconnected_due.store(true, Ordering::Release);
            self.make_kept_calls(&conn);
            conn
        };
        self.retake_chunks(&conn, &mut report);
        self.retake_sets(&conn, &mut report);
        Ok(report)
    }

    /// Forgets what the old connection's process had said: its queued
    /// notices, its events and fences (the holders keep theirs), the entry
    /// tables and plain mappings it named.
    fn forget_old_connection(&self) {
        lock(&self.pending).clear();
        lock(&self.events).clear();
        lock(&self.fences).clear();
        lock(&self.cache).clear();
        self.tables.clear();
    }

    /// Makes the kept calls on `conn`; one the publisher refuses is not
    /// kept any more.
    fn make_kept_calls(&self, conn: &Connection) {
        let calls = lock(&self.kept_calls).clone();
        for c in calls {
            match conn.client.call_within(&c.method, &c.body, c.timeout) {
                Ok(_) => {}
                Err(e @ ChannelError::Remote { .. }) => {
                    tracing::warn!(method = %c.method, key = %c.key, error = %e, "a call kept for new connections was refused on the new one; it is not made again");
                    self.forget_kept_call(&c.method, &c.key);
                }
                Err(e) => {
                    tracing::warn!(method = %c.method, key = %c.key, error = %e, "a call kept for new connections failed on the new one");
                }
            }
        }
    }

    /// Takes back, on `conn`, the leases of the cached chunks taken on an
    /// ended connection.
    fn retake_chunks(&self, conn: &Connection, report: &mut Reconnected) {
        let wanted: Vec<(ChunkKey, u64)> = lock(&self.chunks)
            .entries()
            .filter(|(_, c, _)| c.lease.epoch != conn.epoch)
            .map(|(k, _, bytes)| (*k, bytes))
            .collect();
        for (key, bytes) in wanted {
            let Some(lease) = take_back_chunk(&conn.client, key.0, bytes) else {
                report.chunks_unleased += 1;
                continue;
            };
            let kept = match lock(&self.chunks).peek_mut(&key) {
                Some(c) if c.lease.epoch != conn.epoch => {
                    c.lease = LeaseId {
                        id: lease,
                        epoch: conn.epoch,
                    };
                    true
                }
                _ => false,
            };
            if kept {
                report.chunks += 1;
            } else {
                let _ = conn.client.release_nowait(lease);
            }
        }
    }

    /// Takes back, on `conn`, the leases of the sets held that are not on
    /// it and not settled (replaced, gone).
    fn retake_sets(&self, conn: &Connection, report: &mut Reconnected) {
        let guards: Vec<Arc<LeaseGuard>> = {
            let mut held = lock(&self.held);
            held.retain(|w| w.strong_count() > 0);
            held.iter().filter_map(std::sync::Weak::upgrade).collect()
        };
        let mut due = false;
        let mut pending = Vec::new();
        for g in guards {
            if g.released() || !matches!(g.standing(conn.epoch), Standing::Missing(_)) {
                continue;
            }
            let Some(record) = g.record() else { continue };
            let name = g.name().to_owned();
            let found = match take_back(&conn.client, &name, record, &self.tables) {
                TakeBack::Same {
                    lease,
                    event,
                    fence,
                    mut fds,
                } => match self.waiter(event, fence, &mut fds, "a set taken back") {
                    Ok(waiter) => {
                        let id = LeaseId {
                            id: lease,
                            epoch: conn.epoch,
                        };
                        if !g.taken_back(id, waiter) {
                            // Released meanwhile.
                            let _ = conn.client.release_nowait(lease);
                        }
                        report.retaken.push(name);
                        continue;
                    }
                    Err(e) => {
                        let _ = conn.client.release_nowait(lease);
                        Standing::Missing(Some(("not_taken_back".into(), e.to_string())))
                    }
                },
                TakeBack::Not(found) => found,
            };
            match &found {
                Standing::Replaced => {
                    tracing::warn!(
                        set = %name,
                        "the publisher restarted and serves a newer version of this set than \
                         the one this subscriber holds: the old one stays mapped, without a \
                         lease; attach the set again for the current version"
                    );
                    report.old_versions.push(name);
                }
                Standing::Missing(why) => {
                    let why = why
                        .as_ref()
                        .map_or_else(String::new, |(code, message)| format!("{code}: {message}"));
                    if why.starts_with("writing_in_place") {
                        tracing::warn!(
                            set = %name,
                            "the publisher restarted and a writer writes this set in place \
                             while this subscriber maps it: its bytes change under it until \
                             the write commits ({why})"
                        );
                    } else {
                        tracing::warn!(set = %name, "cannot take the set's lease back yet: {why}");
                    }
                    pending.push(name.clone());
                    report.not_retaken.push((name, why));
                    due = true;
                }
                Standing::Gone | Standing::Held => {
                    report
                        .not_retaken
                        .push((name, "no longer published".to_owned()));
                }
            }
            g.found(found);
        }
        self.retake_due.store(due, Ordering::Release);
        self.tell_reconnected(conn, &pending);
    }

    /// After the leases of a new connection were taken back (as far as
    /// they could be): tells the publisher, once, and again each time
    /// `pending` (the sets still mapped and not taken back) shrinks to
    /// nothing ([`RECONNECTED_METHOD`](super::RECONNECTED_METHOD)).
    fn tell_reconnected(&self, conn: &Connection, pending: &[String]) {
        if !self.reconnected_due.load(Ordering::Acquire) {
            return;
        }
        let body = serde_json::json!({ "pending": pending });
        match conn
            .client
            .call_within(super::RECONNECTED_METHOD, &body, self.timeout)
        {
            Ok(_) if !pending.is_empty() => {}
            Ok(_) | Err(ChannelError::Remote { .. }) => {
                // Done, or a publisher without the method.
                self.reconnected_due.store(false, Ordering::Release);
            }
            Err(e) => {
                tracing::debug!(error = %e, "could not say that this subscriber connected again");
            }
        }
    }
}

#[cfg(test)]
#[path = "reconnect_tests.rs"]
mod tests;
