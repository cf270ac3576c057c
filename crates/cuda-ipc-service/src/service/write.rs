//! WriterId sessions in the service (issue 26 item 3): `open_write`,
//! `commit`, `abort`, and the writer's connection closing.
//!
//! A session's staging version is a second copy of the set: one arena
//! buffer per tensor, published read-write (the read-only policy's one
//! exception, [`Publisher::publish_set_with`]) under an unguessable,
//! unlisted hidden entry that only the writer is told. Its contents start
//! undefined: the writer writes every byte (no copy of the current version
//! is made, so the service spends no GPU time; a writer that changes only
//! some tensors copies the others itself). **Memory cost**: while a session
//! is open the set takes twice its size, plus any replaced version that
//! readers still hold; quotas count all of them.
//!
//! A commit checks the layout hash, then puts the staging buffers in place
//! of the set's current version ([`Publisher::replace_set`]: new attaches
//! get the new version, readers of the old one get an update notice and
//! keep mapping it until they release it), or publishes a new set; the
//! staging entry is then unpublished (the writer's mapping of it lives on
//! until it releases it: writing through it after the commit is a bug of
//! the writer's). The writer must have finished its work on the staging
//! version before it commits (the client synchronises first): the service
//! runs no kernel and waits on no writer's stream.
//!
//! [`Publisher::publish_set_with`]: crate::exchange::Publisher::publish_set_with
//! [`Publisher::replace_set`]: crate::exchange::Publisher::replace_set

use std::io::Read;

use crate::Access;
use crate::arena::{DeviceArenaBuffer, SetMember};
use crate::channel::{CallError, LeaseInfo, UNLISTED_ENTRY_PREFIX};

use super::admin::{
    AbortAnswer, AbortRequest, CommitAnswer, CommitRequest, OpenWriteAnswer, OpenWriteRequest,
};
use super::catalog::{self, Holder, Staged, WriterId};
use super::layout::{self, Tensor};
use super::{Held, Inner, locked, refused};

/// A session's staging version.
pub(super) struct Staging {
    /// The hidden entry it is published under.
    entry: String,
    tensors: Vec<Tensor>,
    /// Its own buffers (none in place: the set's current ones).
    buffers: Vec<DeviceArenaBuffer>,
    hash: String,
    in_place: bool,
}

impl Staging {
    /// An in-place write's: the current version's buffers, published
    /// read-write under `entry`.
    pub(super) fn in_place(entry: String, tensors: Vec<Tensor>, hash: String) -> Staging {
        Staging {
            entry,
            tensors,
            buffers: Vec::new(),
            hash,
            in_place: true,
        }
    }
}

/// An unguessable name for a staging version: 128 random bits.
pub(super) fn staging_name() -> Result<String, CallError> {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|e| CallError::new("write_failed", format!("cannot read /dev/urandom: {e}")))?;
    let hex = bytes.iter().fold(String::with_capacity(32), |mut h, b| {
        use std::fmt::Write as _;
        let _ = write!(h, "{b:02x}");
        h
    });
    Ok(format!("{UNLISTED_ENTRY_PREFIX}stage/{hex}"))
}

fn write_failed(what: &str, e: &cuda_ipc_core::Error) -> CallError {
    CallError::new("write_failed", format!("{what}: {e}"))
}

fn members<'a>(tensors: &'a [Tensor], buffers: &'a [DeviceArenaBuffer]) -> Vec<SetMember<'a>> {
    tensors
        .iter()
        .zip(buffers)
        .map(|(t, b)| SetMember::new(&t.name, t.dtype, &t.shape, b))
        .collect()
}

impl Inner {
    pub(super) fn open_write(
        &self,
        caller: WriterId,
        r: &OpenWriteRequest,
    ) -> Result<OpenWriteAnswer, CallError> {
        if r.in_place {
            return self.open_write_in_place(caller, r);
        }
        self.sweep_retired();
        let tensors = if let Some(specs) = &r.layout {
            layout::check(specs).map_err(super::bad_request)?
        } else {
            let held = locked(&self.held).get(&r.set).map(|h| h.tensors.clone());
            let Some(tensors) = held else {
                return Err(refused(&locked(&self.catalog).no_layout(&r.set)));
            };
            tensors
        };
        let creates = r.layout.is_some();
        if creates {
            let held = self.holders(&r.set);
            if !held.is_empty() && locked(&self.catalog).get(&r.set).is_none() {
                return Err(CallError::new(
                    "leased",
                    format!(
                        "a dropped set {:?} is still held by {}; the name is free once they \
                         release it (or exit); or choose another name",
                        r.set,
                        catalog::holders_text(&held)
                    ),
                ));
            }
        }
        let staged = Staged {
            bytes: layout::device_bytes(&tensors),
            payload_bytes: tensors.iter().map(|t| t.bytes).sum(),
            tensors: tensors.len(),
        };
        let entry = staging_name()?;
        let version = locked(&self.catalog)
            .open_write(caller, &r.set, entry.clone(), staged, creates)
            .map_err(|e| refused(&e))?
            .version;
        let made = self.make_staging(&entry, &tensors);
        let (buffers, hash) = match made {
            Ok(m) => m,
            Err(e) => {
                let _ = locked(&self.catalog).abort_write(caller.connection, &r.set);
                self.publisher.reap();
                return Err(e);
            }
        };
        locked(&self.staging).insert(
            r.set.clone(),
            Staging {
                entry: entry.clone(),
                tensors,
                buffers,
                hash: hash.clone(),
                in_place: false,
            },
        );
        // The writer may have gone while the staging version was made.
        let still = locked(&self.catalog)
            .writing(&r.set)
            .is_some_and(|w| w.writer.connection == caller.connection && w.staging == entry);
        if !still {
            self.discard_staging(&r.set, &entry);
            return Err(CallError::new(
                "not_writing",
                "the writer's connection closed while its staging version was made",
            ));
        }
        tracing::info!(set = %r.set, pid = caller.pid, uid = caller.uid, version, bytes = staged.bytes, "write opened");
        Ok(OpenWriteAnswer {
            set: r.set.clone(),
            version,
            staging: entry,
            tensors: staged.tensors,
            payload_bytes: staged.payload_bytes,
            bytes: staged.bytes,
            layout_hash: hash,
            creates,
            in_place: false,
        })
    }

    /// Allocates the staging buffers and publishes them read-write under
    /// `entry`; returns them and the layout hash.
    fn make_staging(
        &self,
        entry: &str,
        tensors: &[Tensor],
    ) -> Result<(Vec<DeviceArenaBuffer>, String), CallError> {
        let buffers = tensors
            .iter()
            .map(|t| self.publisher.alloc(t.bytes))
            .collect::<cuda_ipc_core::Result<Vec<_>>>()
            .map_err(|e| write_failed("cannot allocate the staging version", &e))?;
        let members = members(tensors, &buffers);
        let arena = self
            .publisher
            .arena()
            .map_err(|e| write_failed("no arena", &e))?;
        let record = arena
            .describe_set(entry, members.iter().copied())
            .and_then(|r| r.validate().map(|()| r))
            .map_err(|e| write_failed("the staging version's record", &e))?;
        let hash = layout::layout_hash(&record.entries);
        self.publisher
            .publish_set_with(entry, &members, Access::ReadWrite)
            .map_err(|e| write_failed("cannot publish the staging version", &e))?;
        Ok((buffers, hash))
    }

    pub(super) fn commit(
        &self,
        caller: WriterId,
        r: &CommitRequest,
    ) -> Result<CommitAnswer, CallError> {
        let mut staging = locked(&self.staging);
        {
            let catalog = locked(&self.catalog);
            catalog
                .check_writer(&r.set, caller.connection)
                .map_err(|e| refused(&e))?;
        }
        let Some(stage) = staging.get(&r.set) else {
            return Err(CallError::new(
                "not_writing",
                format!("set {:?} has no staging version", r.set),
            ));
        };
        if stage.hash != r.layout_hash {
            return Err(CallError::new(
                "layout_mismatch",
                format!(
                    "the commit names layout {} but the staging version of {:?} has {}; attach \
                     the staging entry the open_write answer named, or abort",
                    r.layout_hash, r.set, stage.hash
                ),
            ));
        }
        if stage.in_place {
            let entry = stage.entry.clone();
            drop(staging);
            return self.commit_in_place(caller, &r.set, &entry);
        }
        let creates = !locked(&self.held).contains_key(&r.set);
        let members = members(&stage.tensors, &stage.buffers);
        let told = if creates {
            self.publisher.publish_set(&r.set, &members).map(|()| None)
        } else {
            self.publisher.replace_set(&r.set, &members).map(Some)
        }
        .map_err(|e| write_failed("cannot make the staging version current", &e))?;
        drop(members);
        let done = locked(&self.catalog)
            .commit_write(caller.connection, &r.set)
            .map_err(|e| refused(&e))?;
        let stage = staging.remove(&r.set).expect("checked above");
        drop(staging);
        if let Err(e) = self.publisher.unpublish_set(&stage.entry, None) {
            tracing::warn!(set = %r.set, error = %e, "cannot hide a committed staging entry");
        }
        locked(&self.held).insert(r.set.clone(), Held::written(stage.tensors, stage.buffers));
        // Kept before the writer hears of its commit: a crash after the
        // answer serves this version.
        self.persist();
        if let (Some(told), Some(old)) = (told, &done.retired) {
            locked(&self.retired).push(Kept::replaced(&r.set, old.version, told.old_entry));
        }
        // A torn set is whole again.
        self.publisher.server().allow_attaches(&r.set);
        self.aside_cv.notify_all();
        self.sweep_retired();
        tracing::info!(set = %r.set, pid = caller.pid, version = done.info.version, "committed");
        Ok(CommitAnswer {
            set: r.set.clone(),
            version: done.info.version,
            retired_version: done.retired.map(|o| o.version),
            readers_told: told.map_or(0, |t| t.told),
        })
    }

    /// Commits an in-place write: the same memory is the next version;
    /// its readers, all stepped aside, hear through `back`.
    fn commit_in_place(
        &self,
        caller: WriterId,
        set: &str,
        entry: &str,
    ) -> Result<CommitAnswer, CallError> {
        let done = locked(&self.catalog)
            .commit_write(caller.connection, set)
            .map_err(|e| refused(&e))?;
        locked(&self.staging).remove(set);
        if let Err(e) = self.publisher.unpublish_set(entry, None) {
            tracing::warn!(set, error = %e, "cannot hide a committed in-place entry");
        }
        // Kept before anyone hears of the commit.
        self.persist();
        let retired = self.retired_entries();
        let told = self
            .publisher
            .leases()
            .iter()
            .filter(|l| l.name == set && !retired.contains(&l.entry))
            .count();
        // Every reader stepped aside and hears through `back`: no update
        // notice (one would wait, stale, in its queue for the next update).
        self.in_place_ended(set, true);
        tracing::info!(
            set,
            pid = caller.pid,
            version = done.info.version,
            "committed in place"
        );
        Ok(CommitAnswer {
            set: set.to_owned(),
            version: done.info.version,
            retired_version: None,
            readers_told: told,
        })
    }

    pub(super) fn abort(
        &self,
        caller: WriterId,
        r: &AbortRequest,
    ) -> Result<AbortAnswer, CallError> {
        let session = locked(&self.catalog)
            .abort_write(caller.connection, &r.set)
            .map_err(|e| refused(&e))?;
        self.discard_staging(&r.set, &session.staging);
        if session.in_place {
            self.in_place_ended(&r.set, false);
            self.persist();
        }
        tracing::info!(set = %r.set, pid = caller.pid, version = session.version, "write aborted");
        Ok(AbortAnswer {
            set: r.set.clone(),
            version: session.version,
        })
    }

    /// A connection closed: its write sessions end as aborts; a reader's
    /// leaving may free retired versions.
    pub(super) fn connection_closed(&self, connection: u64) {
        let gone = locked(&self.catalog).writer_gone(connection);
        for s in &gone {
            tracing::info!(set = %s.set, pid = s.writer.pid, version = s.version, in_place = s.in_place, "writer gone: its write is discarded");
            self.discard_staging(&s.set, &s.staging);
            if s.in_place {
                self.in_place_ended(&s.set, false);
            }
        }
        if gone.iter().any(|s| s.in_place) {
            self.persist();
        }
        {
            let mut aside = locked(&self.aside);
            aside.forget_connection(connection);
            self.aside_changed(&aside);
        }
        self.aside_cv.notify_all();
        self.sweep_retired();
    }

    /// Hides and frees the staging version `entry` of `set` (its ranges go
    /// back once the writer's mapping is released).
    pub(super) fn discard_staging(&self, set: &str, entry: &str) {
        let stage = {
            let mut staging = locked(&self.staging);
            match staging.get(set) {
                Some(s) if s.entry == entry => staging.remove(set),
                _ => None,
            }
        };
        if self.publisher.unpublish_set(entry, None).is_err() {
            tracing::debug!(set, "the staging entry was not published");
        }
        drop(stage);
        self.publisher.reap();
        if let Err(e) = self.publisher.trim() {
            tracing::debug!(error = %e, "trim after a discarded write");
        }
    }

    /// The channel entries of the replaced versions readers still hold.
    pub(super) fn retired_entries(&self) -> std::collections::HashSet<u64> {
        locked(&self.retired)
            .iter()
            .filter_map(|k| k.entry)
            .collect()
    }

    /// Charges each retired version to the readers that hold it now, and
    /// forgets those whose last reader let go.
    pub(super) fn sweep_retired(&self) {
        let leases = self.publisher.leases();
        let mut freed = Vec::new();
        let mut kept = Vec::new();
        {
            let mut retired = locked(&self.retired);
            for k in retired.drain(..) {
                let holders: Vec<Holder> = leases
                    .iter()
                    .filter(|l| k.holds(l))
                    .map(|l| Holder {
                        pid: l.pid,
                        uid: l.uid,
                    })
                    .collect();
                if holders.is_empty() {
                    freed.push(k);
                } else {
                    kept.push((k, holders));
                }
            }
            retired.extend(kept.iter().map(|(k, _)| k.clone()));
        }
        let mut catalog = locked(&self.catalog);
        for (k, holders) in &kept {
            catalog.set_retired_holders(&k.set, k.version, holders);
        }
        for k in &freed {
            catalog.release_retired(&k.set, k.version);
        }
        drop(catalog);
        if freed.is_empty() {
            return;
        }
        self.publisher.reap();
        if let Err(e) = self.publisher.trim() {
            tracing::debug!(error = %e, "trim after retired versions");
        }
    }
}

/// A version no longer current that readers keep, as the service tracks
/// it: a replaced version by its channel entry (freed when that entry's
/// last lease ends), a dropped set by its name (its buffers are freed when
/// no lease on the name is left: the publisher's rule for unpublished
/// sets).
#[derive(Clone, Debug)]
pub(super) struct Kept {
    set: String,
    version: u64,
    /// The replaced version's entry; `None` for a dropped set.
    entry: Option<u64>,
}

impl Kept {
    pub(super) fn replaced(set: &str, version: u64, entry: u64) -> Kept {
        Kept {
            set: set.into(),
            version,
            entry: Some(entry),
        }
    }

    pub(super) fn dropped(set: &str, version: u64) -> Kept {
        Kept {
            set: set.into(),
            version,
            entry: None,
        }
    }

    /// Whether `lease` keeps this version's memory.
    fn holds(&self, lease: &LeaseInfo) -> bool {
        match self.entry {
            Some(id) => lease.entry == id,
            None => lease.name == self.set,
        }
    }
}
