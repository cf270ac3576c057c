//! Writes in place: a new version written into the current version's own
//! memory, with no second copy, while its readers step aside.
//!
//! A double-buffered write (the default) needs the set's size twice; a
//! model larger than half the device cannot be updated that way. In place:
//!
//! 1. The writer asks `open_write` with `in_place`. The service refuses new
//!    attaches of the set (code `writing_in_place`) and waits, up to the
//!    request's `wait_ms`, until every connection that holds a lease on
//!    the set's current version has **stepped aside**: it put its
//!    mappings to sleep (unmapped, addresses kept) and said so with the
//!    `aside` method ([`step_aside`]). A connection that releases its
//!    lease or closes no longer counts. The writer's own connection does
//!    not count.
//! 2. If one has not stepped aside in time, nothing was written: the write
//!    is refused (`readers_not_aside`, naming their pids and uids) and the
//!    set is as it was. No reader can be made to see a half-written
//!    version: the service cannot unmap another process's mappings, so it
//!    writes only once every reader has unmapped its own.
//! 3. Otherwise the writer is given the current version's buffers, mapped
//!    read-write under a hidden entry, and writes them.
//! 4. The commit makes the same memory the next version and allows
//!    attaches again. Readers come back with `back` ([`come_back`]),
//!    which waits for the write's end and then wakes their mappings at the
//!    same addresses: their tensors and CUDA graphs stay valid, with the
//!    new bytes.
//! 5. An abort, or the writer's end before its commit, leaves the set
//!    **torn**: its bytes are partly the next version's. Attaches are
//!    refused (`torn`) and `back` answers `torn`, until a write (in place
//!    or double-buffered) commits a whole version; `drop` works as ever. A
//!    restart of the serving process in the middle keeps the set torn.
//!
//! A reader that stepped aside must not wake before `back` answers: the
//! service has no way to stop a process from mapping what it imported.
//! The library's [`come_back`] keeps that order; a reader that breaks it
//! reads bytes being written, in its own process (its mapping is
//! read-only: it changes nothing for anyone else).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use crate::Access;
use crate::arena::SetMember;
use crate::channel::{CallError, ChannelError};
use crate::error::{Error, Result};
use crate::exchange::Subscriber;

use super::admin::{
    AsideAnswer, AsideRequest, BackAnswer, BackRequest, DEFAULT_ASIDE_WAIT_MS, MAX_ASIDE_WAIT_MS,
    MAX_BACK_WAIT_MS, OpenWriteAnswer, OpenWriteRequest, Request, decode, encode,
};
use super::catalog::{self, CatalogError, Holder, WriterId};
use super::layout::layout_hash;
use super::writer::call_within;
use super::{Inner, locked, refused, write};

/// How often waits look again at what the channel changes without telling
/// (leases released, connections closed).
const POLL: Duration = Duration::from_millis(20);

/// Which connections stepped aside from which set, and from which version.
#[derive(Default)]
pub(super) struct Aside {
    by_set: HashMap<String, BTreeMap<u64, u64>>,
    /// The pid and uid of each connection that stepped aside.
    who: HashMap<u64, (u32, u32)>,
}

impl Aside {
    fn holds(&self, set: &str, connection: u64) -> bool {
        self.by_set
            .get(set)
            .is_some_and(|c| c.contains_key(&connection))
    }

    /// The version `connection` stepped aside from `set` at.
    fn version(&self, set: &str, connection: u64) -> Option<u64> {
        self.by_set.get(set)?.get(&connection).copied()
    }

    /// Whether a connection of process `pid` of `uid` stepped aside from
    /// `set`.
    fn process_holds(&self, set: &str, pid: u32, uid: u32) -> bool {
        self.by_set
            .get(set)
            .is_some_and(|c| c.keys().any(|conn| self.who.get(conn) == Some(&(pid, uid))))
    }

    /// The sets each process stepped aside from, by pid and uid.
    fn by_process(&self) -> HashMap<(u32, u32), Vec<String>> {
        let mut out: HashMap<(u32, u32), Vec<String>> = HashMap::new();
        for (set, conns) in &self.by_set {
            for conn in conns.keys() {
                if let Some(who) = self.who.get(conn) {
                    out.entry(*who).or_default().push(set.clone());
                }
            }
        }
        out
    }

    /// Forgets `connection` everywhere (it closed).
    pub(super) fn forget_connection(&mut self, connection: u64) {
        self.who.remove(&connection);
        for c in self.by_set.values_mut() {
            c.remove(&connection);
        }
        self.by_set.retain(|_, c| !c.is_empty());
    }

    /// Forgets every connection of `set` (its write ended, or it went).
    pub(super) fn forget_set(&mut self, set: &str) {
        self.by_set.remove(set);
    }
}

impl Inner {
    /// Writes what `aside` holds now into the readers' book (before the
    /// reader whose mark changed hears of it).
    pub(super) fn aside_changed(&self, aside: &Aside) {
        let by_process = aside.by_process();
        locked(&self.readers).set_aside(&by_process);
    }

    /// The readers of the serving process before a restart that may map
    /// `set` and have neither connected again (taking their lease back or
    /// stepping aside) nor exited (`service/readers.rs`).
    fn orphans_not_aside(&self, aside: &Aside, set: &str) -> Vec<Holder> {
        // The book is locked under the channel's state lock (its lease
        // watch): nothing here calls the channel while holding it.
        locked(&self.readers).orphans_of(set, |pid, uid| aside.process_holds(set, pid, uid))
    }

    /// The holders of leases on `set`'s current version (not a retired
    /// one) whose connection is neither `except` nor aside.
    fn readers_not_aside(&self, aside: &Aside, set: &str, except: u64) -> Vec<Holder> {
        let retired: HashSet<u64> = self.retired_entries();
        let mut holders: Vec<Holder> = self
            .publisher
            .leases()
            .into_iter()
            .filter(|l| {
                l.name == set
                    && !retired.contains(&l.entry)
                    && l.connection != except
                    && !aside.holds(set, l.connection)
            })
            .map(|l| Holder {
                pid: l.pid,
                uid: l.uid,
            })
            .collect();
        holders.sort_by_key(|h| (h.pid, h.uid));
        holders.dedup();
        holders
    }

    /// Refuses new attaches of a torn set, saying why.
    pub(super) fn refuse_torn(&self, set: &str) {
        self.publisher.server().refuse_attaches(
            set,
            "torn",
            &format!(
                "an in-place write of set {set:?} was cut short, so its bytes are partly written; \
                 it is served again once a write (in place or not) commits a whole version, or \
                 drop it"
            ),
        );
    }

    /// An in-place write of `set` ended: committed (attaches allowed
    /// again) or not (the set is torn). Readers waiting in `back` hear.
    pub(super) fn in_place_ended(&self, set: &str, committed: bool) {
        if committed {
            self.publisher.server().allow_attaches(set);
        } else {
            locked(&self.catalog).mark_torn(set);
            self.refuse_torn(set);
        }
        // The readers' marks stay until each comes back (`back` takes its
        // own): one whose `back` comes after the commit must still find
        // the version it stepped aside from, and one that never comes back
        // is still asleep, aside for the next write too.
        self.aside_cv.notify_all();
    }

    pub(super) fn open_write_in_place(
        &self,
        caller: WriterId,
        r: &OpenWriteRequest,
    ) -> std::result::Result<OpenWriteAnswer, CallError> {
        if r.layout.is_some() {
            return Err(super::bad_request(
                "an in-place write is of an existing set, in its layout: give no layout".into(),
            ));
        }
        let wait_ms = r.wait_ms.unwrap_or(DEFAULT_ASIDE_WAIT_MS);
        if wait_ms > MAX_ASIDE_WAIT_MS {
            return Err(super::bad_request(format!(
                "wait_ms {wait_ms} is more than {MAX_ASIDE_WAIT_MS}"
            )));
        }
        self.sweep_retired();
        let sizes = locked(&self.held)
            .get(&r.set)
            .map(|h| (h.tensors.len(), h.tensors.iter().map(|t| t.bytes).sum()));
        let Some(sizes) = sizes else {
            return Err(refused(&locked(&self.catalog).no_layout(&r.set)));
        };
        let entry = write::staging_name()?;
        let (version, torn_before) = {
            let mut catalog = locked(&self.catalog);
            let version = catalog
                .open_write_in_place(caller, &r.set, entry.clone(), sizes)
                .map_err(|e| refused(&e))?
                .version;
            (version, catalog.is_torn(&r.set))
        };
        self.publisher.server().refuse_attaches(
            &r.set,
            "writing_in_place",
            &format!(
                "set {:?} is being written in place (version {version}) by pid {} (uid {}); \
                 attach again after its commit",
                r.set, caller.pid, caller.uid
            ),
        );
        // From here until the commit a restart finds the set torn.
        self.persist();
        if let Err(e) = self.wait_for_aside(caller, &r.set, Duration::from_millis(wait_ms)) {
            let _ = locked(&self.catalog).abort_write(caller.connection, &r.set);
            if torn_before {
                self.refuse_torn(&r.set);
            } else {
                self.publisher.server().allow_attaches(&r.set);
            }
            self.persist();
            return Err(e);
        }
        let hash = self.publish_in_place(&r.set, &entry).inspect_err(|_| {
            let _ = locked(&self.catalog).abort_write(caller.connection, &r.set);
            self.in_place_ended(&r.set, false);
        })?;
        // The writer may have gone while it waited.
        let still = locked(&self.catalog)
            .writing(&r.set)
            .is_some_and(|w| w.writer.connection == caller.connection && w.staging == entry);
        if !still {
            self.discard_staging(&r.set, &entry);
            return Err(CallError::new(
                "not_writing",
                "the writer's connection closed while readers stepped aside",
            ));
        }
        tracing::info!(set = %r.set, pid = caller.pid, version, "write in place opened");
        Ok(OpenWriteAnswer {
            set: r.set.clone(),
            version,
            staging: entry,
            tensors: sizes.0,
            payload_bytes: sizes.1,
            bytes: 0,
            layout_hash: hash,
            creates: false,
            in_place: true,
        })
    }

    /// Waits until every reader of `set` but `caller` stepped aside.
    fn wait_for_aside(
        &self,
        caller: WriterId,
        set: &str,
        wait: Duration,
    ) -> std::result::Result<(), CallError> {
        let deadline = Instant::now() + wait;
        let mut aside = locked(&self.aside);
        loop {
            let waiting = self.readers_not_aside(&aside, set, caller.connection);
            let orphans = self.orphans_not_aside(&aside, set);
            if waiting.is_empty() && orphans.is_empty() {
                return Ok(());
            }
            let now = Instant::now();
            let ours = locked(&self.catalog)
                .writing(set)
                .is_some_and(|w| w.writer.connection == caller.connection);
            if !ours {
                return Err(CallError::new(
                    "not_writing",
                    "the write session ended while readers stepped aside",
                ));
            }
            if now >= deadline {
                return Err(not_aside_error(set, &waiting, &orphans, wait));
            }
            aside = self
                .aside_cv
                .wait_timeout(aside, POLL.min(deadline - now))
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }

    /// Publishes the current buffers of `set` read-write under `entry`, as
    /// the write's staging version; returns its layout hash.
    fn publish_in_place(&self, set: &str, entry: &str) -> std::result::Result<String, CallError> {
        let failed = |what: &str, e: &Error| CallError::new("write_failed", format!("{what}: {e}"));
        let mut held = locked(&self.held);
        let Some(h) = held.get_mut(set) else {
            return Err(refused(&CatalogError::NotFound { name: set.into() }));
        };
        let buffers = h.buffers();
        let members: Vec<SetMember<'_>> = h
            .tensors
            .iter()
            .zip(&h.places)
            .map(|(t, &(b, o))| SetMember::new(&t.name, t.dtype, &t.shape, &buffers[b]).at(o))
            .collect();
        // Described once per version in memory: every in-place version
        // has the same tensors at the same places, so the same hash.
        let hash = if let Some(hash) = &h.in_place_hash {
            hash.clone()
        } else {
            let arena = self.publisher.arena().map_err(|e| failed("no arena", &e))?;
            let record = arena
                .describe_set(entry, members.iter().copied())
                .and_then(|r| r.validate().map(|()| r))
                .map_err(|e| failed("the in-place version's record", &e))?;
            layout_hash(&record.entries)
        };
        self.publisher
            .publish_set_with(entry, &members, Access::ReadWrite)
            .map_err(|e| failed("cannot publish the version for writing", &e))?;
        let tensors = h.tensors.clone();
        drop(members);
        h.in_place_hash = Some(hash.clone());
        drop(held);
        locked(&self.staging).insert(
            set.to_owned(),
            write::Staging::in_place(entry.to_owned(), tensors, hash.clone()),
        );
        Ok(hash)
    }

    pub(super) fn aside(
        &self,
        caller: WriterId,
        r: &AsideRequest,
    ) -> std::result::Result<AsideAnswer, CallError> {
        let (version, writing_in_place) = {
            // A double-buffered commit tells the readers of the old version
            // (and serves the new record) before the catalog counts the new
            // version, all under the staging lock. A reader quick enough to
            // attach the new version and step aside in between would be
            // marked at the version before, and its `back` with `next`
            // would answer at once, before the next write: so the mark is
            // taken once any commit in progress is counted.
            let _commits = locked(&self.staging);
            let catalog = locked(&self.catalog);
            let Some(info) = catalog.get(&r.set) else {
                return Err(refused(&CatalogError::NotFound {
                    name: r.set.clone(),
                }));
            };
            let in_place = catalog.writing(&r.set).is_some_and(|w| w.in_place);
            (info.version, in_place)
        };
        let mut aside = locked(&self.aside);
        aside
            .by_set
            .entry(r.set.clone())
            .or_default()
            .insert(caller.connection, version);
        aside
            .who
            .insert(caller.connection, (caller.pid, caller.uid));
        self.aside_changed(&aside);
        drop(aside);
        self.aside_cv.notify_all();
        Ok(AsideAnswer {
            set: r.set.clone(),
            version,
            writing_in_place,
        })
    }

    pub(super) fn back(
        &self,
        caller: WriterId,
        r: &BackRequest,
    ) -> std::result::Result<BackAnswer, CallError> {
        let wait = Duration::from_millis(
            r.timeout_ms
                .unwrap_or(MAX_BACK_WAIT_MS)
                .min(MAX_BACK_WAIT_MS),
        );
        let deadline = Instant::now() + wait;
        let mut aside = locked(&self.aside);
        let from = match aside.version(&r.set, caller.connection) {
            Some(v) => Some(v),
            None => locked(&self.catalog).get(&r.set).map(|i| i.version),
        };
        loop {
            let (waits, stopping) = {
                let catalog = locked(&self.catalog);
                let in_place = catalog.writing(&r.set).is_some_and(|w| w.in_place);
                // With `next`: until a version after `from` (or a torn
                // set, or none).
                let same = from.is_some() && catalog.get(&r.set).map(|i| i.version) == from;
                let next = r.next && same && !catalog.is_torn(&r.set);
                (in_place || next, catalog.is_stopping())
            };
            let now = Instant::now();
            if !waits || stopping {
                break;
            }
            if now >= deadline {
                let what = if r.next {
                    "no version after the one this connection stepped aside from was committed"
                } else {
                    "it is still being written in place"
                };
                return Err(CallError::new(
                    "timeout",
                    format!(
                        "set {:?}: {what} within {:.1} s; stay aside and call back again",
                        r.set,
                        wait.as_secs_f64()
                    ),
                ));
            }
            aside = self
                .aside_cv
                .wait_timeout(aside, POLL.min(deadline - now))
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
        if let Some(c) = aside.by_set.get_mut(&r.set) {
            c.remove(&caller.connection);
        }
        self.aside_changed(&aside);
        drop(aside);
        let catalog = locked(&self.catalog);
        if catalog.is_torn(&r.set) {
            return Err(CallError::new(
                "torn",
                format!(
                    "the in-place write of set {:?} was cut short: its bytes are partly written; \
                     do not use them until a write commits (attach again then)",
                    r.set
                ),
            ));
        }
        let info = catalog.get(&r.set).ok_or_else(|| {
            refused(&CatalogError::NotFound {
                name: r.set.clone(),
            })
        })?;
        Ok(BackAnswer {
            set: r.set.clone(),
            version: info.version,
        })
    }
}

/// The refusal of a write in place whose readers did not step aside:
/// `waiting` connected now, `orphans` readers of the process before a
/// restart that have not connected again.
fn not_aside_error(set: &str, waiting: &[Holder], orphans: &[Holder], wait: Duration) -> CallError {
    let mut who = Vec::new();
    if !waiting.is_empty() {
        who.push(format!(
            "{} did not step aside (a reader sleeps its mappings, then calls aside)",
            catalog::holders_text(waiting)
        ));
    }
    if !orphans.is_empty() {
        who.push(format!(
            "{}, which mapped it before the service restarted, did not connect again (a \
             reader connects again at its next call, or with reconnect())",
            catalog::holders_text(orphans)
        ));
    }
    CallError::new(
        "readers_not_aside",
        format!(
            "set {set:?} was not written in place: {} within {:.1} s; nothing was written. Ask \
             them to, wait longer, or write double-buffered",
            who.join("; and "),
            wait.as_secs_f64()
        ),
    )
    .with_details(serde_json::json!({
        "readers": waiting.iter().map(|h| serde_json::json!({"pid": h.pid, "uid": h.uid})).collect::<Vec<_>>(),
        "not_reconnected": orphans.iter().map(|h| serde_json::json!({"pid": h.pid, "uid": h.uid})).collect::<Vec<_>>(),
    }))
}

/// How long the client's `aside` call may take.
const ASIDE_CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Steps `subscriber` aside from the service's set `set` for a write in
/// place: its mappings must sleep already
/// ([`Subscriber::sleep`], or [`Subscriber::sleep_unchecked`] to keep
/// tensors and CUDA graphs over them), and stay asleep until
/// [`come_back`] returns.
///
/// # Errors
/// [`Error::InvalidArgument`] when the subscriber is not asleep (nothing
/// is sent); the service's refusals (`not_found`).
pub fn step_aside(subscriber: &Subscriber, set: &str) -> Result<AsideAnswer> {
    if !subscriber.asleep() {
        return Err(Error::arg(
            "step aside",
            "the subscriber's mappings are awake: sleep them first (Subscriber::sleep), so that \
             the writer writes nothing a kernel of this process reads",
        ));
    }
    let request = AsideRequest {
        set: set.to_owned(),
    };
    // Kept for new connections until `come_back`: a reader that connects
    // again to a restarted service is aside there too before its lease is
    // back, so no write in place waits for it (or writes under it).
    let answer = subscriber.call_and_keep(
        AsideRequest::METHOD,
        set,
        &encode(&request),
        Some(ASIDE_CALL_TIMEOUT),
    )?;
    decode(AsideRequest::METHOD, &answer).map_err(|e| Error::arg("service answer", e))
}

/// Waits up to `timeout` for the in-place write of `set` to end, then
/// wakes `subscriber`'s mappings at the addresses they had: the set's
/// tensors hold the committed version's bytes. Returns the version.
///
/// # Errors
/// The service's `timeout` (still being written: the mappings stay
/// asleep; call again), `torn` (the write was cut short: the mappings stay
/// asleep; attach the set again once a write commits), `not_found`; the
/// wake's errors.
pub fn come_back(subscriber: &Subscriber, set: &str, timeout: Duration) -> Result<BackAnswer> {
    come_back_with(subscriber, set, false, timeout)
}

/// [`come_back`], waiting (up to `timeout`) for the next version: a write
/// committed after this subscriber stepped aside, whether or not its
/// writer has started yet. What a reader that steps aside ahead of an
/// update it expects (an RL engine between steps) calls.
///
/// # Errors
/// As [`come_back`].
pub fn come_back_next(subscriber: &Subscriber, set: &str, timeout: Duration) -> Result<BackAnswer> {
    come_back_with(subscriber, set, true, timeout)
}

fn come_back_with(
    subscriber: &Subscriber,
    set: &str,
    next: bool,
    timeout: Duration,
) -> Result<BackAnswer> {
    let ms = u64::try_from(timeout.as_millis())
        .unwrap_or(u64::MAX)
        .min(MAX_BACK_WAIT_MS);
    let request = BackRequest {
        set: set.to_owned(),
        timeout_ms: Some(ms),
        next,
    };
    let wait = Duration::from_millis(ms) + ASIDE_CALL_TIMEOUT;
    let back = match call_within(subscriber, &request, wait) {
        // The serving process ended while this reader waited: a reader of
        // a service under its keeper connects again (aside there too) and
        // waits on the new process, once.
        Err(Error::Channel(ChannelError::PeerGone)) if subscriber.reconnects() => {
            call_within(subscriber, &request, wait)?
        }
        r => r?,
    };
    subscriber.forget_kept_call(AsideRequest::METHOD, set);
    subscriber.wake()?;
    if subscriber.reconnects() {
        // A lease refused while the write ran (a reconnect in the middle
        // of it) is taken back now, not at the next call.
        if let Err(e) = subscriber.reconnect() {
            tracing::debug!(set, error = %e, "taking leases back after come_back failed");
        }
    }
    Ok(back)
}
