//! Write sessions in the catalog (see "Writing" in the parent module): one
//! writer per set, its staging version reserved against the owner's quota,
//! commits that retire the version they replace, aborts; and the retired
//! versions readers keep (see "Holding").

use std::time::{SystemTime, UNIX_EPOCH};

use super::{Catalog, CatalogError, Holder, SetInfo};

/// The most write sessions one connection may hold at once (each is a
/// staging version in device memory, counted against a quota that may be
/// unlimited).
pub const MAX_WRITES_PER_CONNECTION: usize = 16;

/// The most write sessions one uid may hold at once, over all its
/// connections.
pub const MAX_WRITES_PER_UID: usize = 64;

/// Who writes: the caller's credentials and its connection (the lock).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WriterId {
    /// The writer's process id.
    pub pid: u32,
    /// The writer's user id.
    pub uid: u32,
    /// Its connection to the service: the session ends with it.
    pub connection: u64,
}

impl WriterId {
    /// The writer as a holder (pid, uid).
    pub fn holder(&self) -> Holder {
        Holder {
            pid: self.pid,
            uid: self.uid,
        }
    }
}

/// The size of a staging version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Staged {
    /// Device bytes (its arena buffers, tensors aligned in them).
    pub bytes: u64,
    /// Bytes of tensors.
    pub payload_bytes: u64,
    /// How many tensors.
    pub tensors: usize,
}

/// A write session: a writer filling the staging version of a set.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct WriteSession {
    /// The set.
    pub set: String,
    /// Who writes.
    pub writer: WriterId,
    /// The uid its bytes count against: the set's owner (for a new set,
    /// the writer).
    pub owner_uid: u32,
    /// The staging version's size.
    pub staged: Staged,
    /// Its bytes, as the quota counts them.
    pub bytes: u64,
    /// The version it becomes if committed.
    pub version: u64,
    /// The hidden entry the writer attaches it under.
    pub staging: String,
    /// Whether the set is new (no committed version when it opened).
    pub creates: bool,
    /// Whether the writer writes the current version's memory in place
    /// (no staging copy: [`Catalog::open_write_in_place`]).
    pub in_place: bool,
}

impl WriteSession {
    /// The refusal of anyone else who wants the set while this session is
    /// open.
    pub(super) fn refusal(&self) -> CatalogError {
        CatalogError::Writing {
            name: self.set.clone(),
            pid: self.writer.pid,
            uid: self.writer.uid,
        }
    }
}

/// A version that is no longer current (a commit replaced it, or a forced
/// drop dropped it) but whose memory readers keep: counted against them
/// until its last reader lets go (see "Holding" in the parent module).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetiredVersion {
    /// The set.
    pub set: String,
    /// Its version.
    pub version: u64,
    /// The set's owner (charged only while no holder is known).
    pub owner_uid: u32,
    /// Its device bytes.
    pub bytes: u64,
    /// Whether a forced drop dropped it (else a commit replaced it).
    pub dropped: bool,
    /// The uids whose readers keep it, sorted: each is charged its bytes.
    pub holders: Vec<u32>,
}

impl RetiredVersion {
    /// The uids its bytes count against: its holders, or its owner while
    /// none is known.
    pub fn charged(&self) -> impl Iterator<Item = u32> + '_ {
        let owner = self.holders.is_empty().then_some(self.owner_uid);
        self.holders.iter().copied().chain(owner)
    }

    /// Whether its bytes count against `uid`.
    pub fn charged_to(&self, uid: u32) -> bool {
        self.charged().any(|u| u == uid)
    }
}

/// What a commit did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Committed {
    /// The set as it is now.
    pub info: SetInfo,
    /// The version it replaced, now retired (none for a new set).
    pub retired: Option<RetiredVersion>,
    /// The session that ended.
    pub session: WriteSession,
}

impl Catalog {
    /// Opens a write session on set `name` for `writer`: a new version
    /// of an existing set (`creates` false: the layout is the set's) or a
    /// new set (`creates` true), whose staging version, of size `staged`,
    /// is published under the hidden entry `staging`.
    ///
    /// # Errors
    /// In this order: [`CatalogError::Stopping`]; [`CatalogError::Writing`]
    /// (naming the writer that holds the set; also for the same
    /// connection); [`CatalogError::Loading`]; [`CatalogError::TooManyWrites`]
    /// (the caller's connection or uid at its limit); for an existing set
    /// [`CatalogError::NotWriter`] (only its owner's uid and the service's
    /// may write it) or [`CatalogError::Exists`] when `creates`; for a
    /// missing one [`CatalogError::NotFound`] unless `creates`; then
    /// [`CatalogError::OverQuota`], counting the staging bytes against the
    /// owner.
    pub fn open_write(
        &mut self,
        writer: WriterId,
        name: &str,
        staging: String,
        staged: Staged,
        creates: bool,
    ) -> Result<&WriteSession, CatalogError> {
        if self.stopping {
            return Err(CatalogError::Stopping);
        }
        if let Some(w) = self.writing.get(name) {
            return Err(w.refusal());
        }
        if let Some(&(uid, _)) = self.loading.get(name) {
            return Err(CatalogError::Loading {
                name: name.into(),
                uid,
            });
        }
        self.check_write_caps(writer)?;
        let owner_uid = match (self.sets.get(name), creates) {
            (Some(s), false) => {
                if writer.uid != s.owner_uid && writer.uid != self.service_uid {
                    return Err(CatalogError::NotWriter {
                        name: name.into(),
                        owner: s.owner_uid,
                        service: self.service_uid,
                        caller: writer.uid,
                    });
                }
                s.owner_uid
            }
            (Some(s), true) => {
                return Err(CatalogError::Exists {
                    name: name.into(),
                    owner: s.owner_uid,
                    version: s.version,
                });
            }
            (None, false) => return Err(CatalogError::NotFound { name: name.into() }),
            (None, true) => writer.uid,
        };
        self.check_quota(owner_uid, staged.bytes)?;
        let version = self.versions.get(name).copied().unwrap_or(0) + 1;
        let session = WriteSession {
            set: name.into(),
            writer,
            owner_uid,
            staged,
            bytes: staged.bytes,
            version,
            staging,
            creates,
            in_place: false,
        };
        Ok(self.writing.entry(name.into()).or_insert(session))
    }

    /// Opens a write session on the existing set `name` for `writer` in
    /// place: the writer writes the current version's memory itself (its
    /// readers step aside first; the service sees to that), so nothing is
    /// reserved, and the commit makes the same memory the next version. An
    /// abort, or the writer's end, leaves the set torn
    /// ([`is_torn`](Self::is_torn)) until a write commits.
    ///
    /// # Errors
    /// As [`open_write`](Self::open_write) of an existing set, whose quota
    /// check asks for no bytes (`tensors`: how many, and their bytes).
    pub fn open_write_in_place(
        &mut self,
        writer: WriterId,
        name: &str,
        staging: String,
        tensors: (usize, u64),
    ) -> Result<&WriteSession, CatalogError> {
        let staged = Staged {
            bytes: 0,
            payload_bytes: tensors.1,
            tensors: tensors.0,
        };
        self.open_write(writer, name, staging, staged, false)?;
        let Some(s) = self.writing.get_mut(name) else {
            unreachable!("open_write inserted the session");
        };
        s.in_place = true;
        Ok(s)
    }

    /// Marks set `name` torn: an in-place write of it was cut short, so its
    /// bytes are partly the next version's. Cleared by a commit or a drop.
    pub fn mark_torn(&mut self, name: &str) {
        if self.sets.contains_key(name) {
            self.torn.insert(name.into());
        }
    }

    /// Whether set `name` is torn ([`mark_torn`](Self::mark_torn)).
    pub fn is_torn(&self, name: &str) -> bool {
        self.torn.contains(name)
    }

    /// Refuses a new session to a connection or a uid at its limit
    /// ([`MAX_WRITES_PER_CONNECTION`], [`MAX_WRITES_PER_UID`]).
    fn check_write_caps(&self, writer: WriterId) -> Result<(), CatalogError> {
        let of_connection = self
            .writing
            .values()
            .filter(|w| w.writer.connection == writer.connection)
            .count();
        if of_connection >= MAX_WRITES_PER_CONNECTION {
            return Err(CatalogError::TooManyWrites {
                what: "this connection".into(),
                held: of_connection,
                limit: MAX_WRITES_PER_CONNECTION,
            });
        }
        let of_uid = self
            .writing
            .values()
            .filter(|w| w.writer.uid == writer.uid)
            .count();
        if of_uid >= MAX_WRITES_PER_UID {
            return Err(CatalogError::TooManyWrites {
                what: format!("uid {}", writer.uid),
                held: of_uid,
                limit: MAX_WRITES_PER_UID,
            });
        }
        Ok(())
    }

    /// The session on `name` if `connection` holds it.
    fn held_by(&self, connection: u64, name: &str) -> Result<(), CatalogError> {
        match self.writing.get(name) {
            Some(w) if w.writer.connection == connection => Ok(()),
            other => Err(CatalogError::NotWriting {
                name: name.into(),
                holder: other.map(|w| w.writer.holder()),
            }),
        }
    }

    /// Makes the staging version of the session that `connection` holds on
    /// `name` current, as its next version, at `now` (seconds since the
    /// epoch); the version it replaces is retired.
    ///
    /// # Errors
    /// [`CatalogError::NotWriting`] when `connection` holds no session on
    /// `name` (nothing changes).
    pub fn commit_write_at(
        &mut self,
        connection: u64,
        name: &str,
        now: u64,
    ) -> Result<Committed, CatalogError> {
        self.held_by(connection, name)?;
        let Some(session) = self.writing.remove(name) else {
            return Err(CatalogError::NotWriting {
                name: name.into(),
                holder: None,
            });
        };
        self.torn.remove(name);
        let replaced = self.sets.remove(name);
        let bytes = match &replaced {
            Some(old) if session.in_place => old.bytes,
            _ => session.bytes,
        };
        // In place, the same memory is the next version: nothing retires.
        let retired = replaced
            .filter(|_| !session.in_place)
            .map(|old| RetiredVersion {
                set: old.name,
                version: old.version,
                owner_uid: old.owner_uid,
                bytes: old.bytes,
                dropped: false,
                holders: Vec::new(),
            });
        if let Some(r) = &retired {
            self.retired.push(r.clone());
        }
        let version = self.versions.entry(name.into()).or_insert(0);
        *version += 1;
        let info = SetInfo {
            name: name.into(),
            owner_uid: session.owner_uid,
            bytes,
            payload_bytes: session.staged.payload_bytes,
            tensors: session.staged.tensors,
            version: *version,
            loaded_from: format!(
                "written{} by pid {} (uid {})",
                if session.in_place { " in place" } else { "" },
                session.writer.pid,
                session.writer.uid
            ),
            created_unix: now,
        };
        self.sets.insert(name.into(), info.clone());
        Ok(Committed {
            info,
            retired,
            session,
        })
    }

    /// [`commit_write_at`](Self::commit_write_at), now.
    ///
    /// # Errors
    /// As [`commit_write_at`](Self::commit_write_at).
    pub fn commit_write(&mut self, connection: u64, name: &str) -> Result<Committed, CatalogError> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        self.commit_write_at(connection, name, now)
    }

    /// Ends the session `connection` holds on `name` without a commit: the
    /// staging version's bytes are given back; the current version does
    /// not change.
    ///
    /// # Errors
    /// [`CatalogError::NotWriting`] when `connection` holds no session on
    /// `name` (nothing changes).
    pub fn abort_write(
        &mut self,
        connection: u64,
        name: &str,
    ) -> Result<WriteSession, CatalogError> {
        self.held_by(connection, name)?;
        self.writing
            .remove(name)
            .ok_or_else(|| CatalogError::NotWriting {
                name: name.into(),
                holder: None,
            })
    }

    /// Ends the session on `name`, whoever holds it (a forced drop, a
    /// shutdown).
    pub fn abort_any(&mut self, name: &str) -> Option<WriteSession> {
        self.writing.remove(name)
    }

    /// Ends every session of `connection`, which closed (its writer
    /// exited, was killed, or let go); returns them.
    pub fn writer_gone(&mut self, connection: u64) -> Vec<WriteSession> {
        let names: Vec<String> = self
            .writing
            .values()
            .filter(|w| w.writer.connection == connection)
            .map(|w| w.set.clone())
            .collect();
        names
            .iter()
            .filter_map(|n| self.writing.remove(n))
            .collect()
    }

    /// The session on `name`, if one is open.
    pub fn writing(&self, name: &str) -> Option<&WriteSession> {
        self.writing.get(name)
    }

    /// Why a write of `name` without a layout cannot start when the service
    /// knows no layout for it: another writer creates it
    /// ([`CatalogError::Writing`]), or there is no such set.
    pub(crate) fn no_layout(&self, name: &str) -> CatalogError {
        self.writing(name).map_or_else(
            || CatalogError::NotFound { name: name.into() },
            WriteSession::refusal,
        )
    }

    /// Refuses ([`CatalogError::NotWriting`], naming the holder if any)
    /// unless connection `connection` holds the write session of `name`.
    pub(crate) fn check_writer(&self, name: &str, connection: u64) -> Result<(), CatalogError> {
        match self.writing(name) {
            Some(w) if w.writer.connection == connection => Ok(()),
            other => Err(CatalogError::NotWriting {
                name: name.into(),
                holder: other.map(|w| w.writer.holder()),
            }),
        }
    }

    /// Every open session, in set name order.
    pub fn write_sessions(&self) -> impl Iterator<Item = &WriteSession> {
        self.writing.values()
    }

    /// The retired versions readers still hold.
    pub fn retired(&self) -> &[RetiredVersion] {
        &self.retired
    }

    /// Says who holds retired version `version` of `name` now (the
    /// readers whose leases keep its memory): each of their uids is charged
    /// its bytes from now on. Nothing happens for a version not retired.
    pub fn set_retired_holders(&mut self, name: &str, version: u64, holders: &[Holder]) {
        if let Some(r) = self
            .retired
            .iter_mut()
            .find(|r| r.set == name && r.version == version)
        {
            r.holders = super::holder_uids(holders);
        }
    }

    /// Forgets retired version `version` of `name` (its last reader let
    /// go), giving its bytes back; returns it.
    pub fn release_retired(&mut self, name: &str, version: u64) -> Option<RetiredVersion> {
        let i = self
            .retired
            .iter()
            .position(|r| r.set == name && r.version == version)?;
        Some(self.retired.remove(i))
    }
}

#[cfg(test)]
#[path = "catalog_write_tests.rs"]
mod tests;
