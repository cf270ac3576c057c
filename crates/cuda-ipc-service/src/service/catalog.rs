//! The service's bookkeeping, with no GPU: the sets it holds by name, who
//! owns them, what each uid uses against its quota in bytes, and the rules
//! for loading and dropping.
//!
//! # Admission
//! A load is asked about once the checkpoint's size is known, before its
//! headers are read or parsed ([`Catalog::check_admit`], with the bytes
//! its files hold after their headers: a lower bound of what it will
//! hold), and admitted before any memory is allocated ([`Catalog::admit`]):
//! its bytes are reserved for its uid at once, so two loads at the same
//! time cannot both pass a quota that only one fits in; the reservation
//! becomes the set ([`Catalog::commit`]) or goes ([`Catalog::cancel`]). A
//! load is refused when its uid's used and reserved bytes plus its own would
//! pass the uid's quota (naming all three numbers), when the name is held
//! or being loaded, and once the service stops.
//!
//! # Dropping
//! A set may be dropped by its owner's uid and by the service's own uid;
//! while readers hold leases on it only with `force`, and the refusal names
//! the holders.
//!
//! # Writing
//! One writer at a time per set ([`Catalog::open_write`]): its staging
//! version's bytes are reserved against the set owner's quota (a new set's
//! owner is its writer) until it commits ([`Catalog::commit_write`]: the
//! staging version becomes current as the next version, and the one it
//! replaces is retired) or is aborted ([`Catalog::abort_write`], or
//! [`Catalog::writer_gone`] when the writer's connection closes). A second
//! writer is refused, naming the first.
//!
//! # Holding
//! Memory is charged until it is actually freed, to whoever keeps it. A
//! set's current version counts against its owner. A version that is no
//! longer current but that readers still map (replaced by a commit, or
//! dropped with `force`: [`Catalog::drop_set`]) stays in the books as a
//! [`RetiredVersion`], charged in full to each uid whose readers hold it
//! ([`Catalog::set_retired_holders`], which the service calls with the
//! leases it sees before each admission and each `ls` or `stats`; to the
//! owner while none is known), until its last reader lets go
//! ([`Catalog::release_retired`]). A reader that keeps an old version
//! therefore pays for it, not the owner who moved on; and a forced drop
//! frees no quota until the memory is free. [`UidUsage::held`] and
//! [`Catalog::total_bytes`] say so.
//!
//! # Quotas
//! [`Quotas`]: a default for every uid other than the service's own (the
//! service's own uid has no limit unless it has an override), and per-uid
//! overrides. The service's default is [`Quotas::for_device`]: a quarter of
//! the device's memory, so that one tenant cannot take the device from the
//! others (a sparse file of 64 GiB is 64 GiB on the device).

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// A reader holding a lease on a set (`SO_PEERCRED`: pid 0 when it runs in
/// a PID namespace the service cannot see).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Holder {
    /// The reader's process id.
    pub pid: u32,
    /// The reader's user id.
    pub uid: u32,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pid {} (uid {})", self.pid, self.uid)
    }
}

/// The holders as a list for people: `pid 12 (uid 1000), pid 13 (uid 1000)`.
pub fn holders_text(holders: &[Holder]) -> String {
    let shown: Vec<String> = holders.iter().take(8).map(Holder::to_string).collect();
    let more = holders.len().saturating_sub(shown.len());
    if more > 0 {
        format!("{} and {more} more", shown.join(", "))
    } else {
        shown.join(", ")
    }
}

/// The distinct uids of `holders`, sorted.
pub(crate) fn holder_uids(holders: &[Holder]) -> Vec<u32> {
    let mut uids: Vec<u32> = holders.iter().map(|h| h.uid).collect();
    uids.sort_unstable();
    uids.dedup();
    uids
}

#[path = "catalog_write.rs"]
mod write;

#[path = "catalog_quotas.rs"]
mod quotas;

pub(crate) use quotas::quotas_or_default;
pub use quotas::{DEFAULT_QUOTA_SHARE, Quotas};

pub use write::{
    Committed, MAX_WRITES_PER_CONNECTION, MAX_WRITES_PER_UID, RetiredVersion, Staged, WriteSession,
    WriterId,
};

/// One set the service holds.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SetInfo {
    /// Its name.
    pub name: String,
    /// The uid that loaded it (what its bytes count against).
    pub owner_uid: u32,
    /// Device bytes it holds (its arena buffers, tensors aligned in them).
    pub bytes: u64,
    /// Bytes of tensors in it.
    pub payload_bytes: u64,
    /// How many tensors.
    pub tensors: usize,
    /// Its version: 1 for the first set of this name in the service's life,
    /// one more for each later one.
    pub version: u64,
    /// The checkpoint it was loaded from.
    pub loaded_from: String,
    /// When it was committed, in seconds since the Unix epoch.
    pub created_unix: u64,
}

/// What a load brings when it commits (the catalog adds the owner, the
/// version and the time).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Loaded {
    /// Bytes of tensors.
    pub payload_bytes: u64,
    /// How many tensors.
    pub tensors: usize,
    /// The checkpoint's path.
    pub loaded_from: String,
}

impl Loaded {
    /// What a load of `tensors` tensors, `payload_bytes` bytes, from
    /// `loaded_from` brings.
    pub fn new(payload_bytes: u64, tensors: usize, loaded_from: impl Into<String>) -> Loaded {
        Loaded {
            payload_bytes,
            tensors,
            loaded_from: loaded_from.into(),
        }
    }
}

/// An admitted load: its bytes are reserved until it is committed or
/// cancelled (by value: each ticket is used once).
#[derive(Debug, PartialEq, Eq)]
#[must_use = "an admitted load keeps its bytes reserved until it is committed or cancelled"]
pub struct Ticket {
    name: String,
    uid: u32,
    bytes: u64,
}

impl Ticket {
    /// The set's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The bytes reserved.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// One uid's use of the service.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UidUsage {
    /// The uid.
    pub uid: u32,
    /// Bytes it is charged: its sets' current versions, and the old
    /// versions (replaced or dropped) that its readers keep.
    pub used: u64,
    /// Of `used`, the old versions its readers keep.
    #[serde(default)]
    pub held: u64,
    /// Bytes reserved by its loads in progress and write sessions.
    pub reserved: u64,
    /// Its quota in bytes (`None`: no limit).
    pub quota: Option<u64>,
    /// How many sets it owns.
    pub sets: usize,
}

/// Why the catalog refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CatalogError {
    /// A load that would pass its uid's quota.
    #[error(
        "uid {uid} asks for {asked} bytes, but it uses {used} (and {reserved} more for loads in \
         progress) of its quota of {quota}; drop a set (`cuda-ipc drop`) or ask for a larger \
         quota (`--quota-uid {uid}=BYTES`)"
    )]
    OverQuota {
        /// The uid.
        uid: u32,
        /// Bytes of its sets.
        used: u64,
        /// Bytes reserved by its loads in progress.
        reserved: u64,
        /// Its quota.
        quota: u64,
        /// Bytes the load asks for.
        asked: u64,
    },
    /// The name is held already.
    #[error(
        "the service holds a set {name:?} already (version {version}, uid {owner}); drop it first \
         (`cuda-ipc drop`) or choose another name"
    )]
    Exists {
        /// The name.
        name: String,
        /// Its owner.
        owner: u32,
        /// Its version.
        version: u64,
    },
    /// A load of the name is in progress.
    #[error("a set {name:?} is being loaded (by uid {uid}); wait for it, or choose another name")]
    Loading {
        /// The name.
        name: String,
        /// The loading uid.
        uid: u32,
    },
    /// No set of that name.
    #[error("the service holds no set {name:?}; `cuda-ipc ls` lists what it holds")]
    NotFound {
        /// The name.
        name: String,
    },
    /// Dropping another uid's set.
    #[error(
        "set {name:?} belongs to uid {owner}: only that uid and the service's (uid {service}) may \
         drop it, not uid {caller}"
    )]
    NotOwner {
        /// The name.
        name: String,
        /// Its owner.
        owner: u32,
        /// The service's uid.
        service: u32,
        /// Who asked.
        caller: u32,
    },
    /// Dropping a set readers still hold, without `force`.
    #[error(
        "set {name:?} is held by {} reader lease(s): {}; they must release it (or exit) first, \
         or drop it with --force (readers keep what they mapped)",
        holders.len(),
        holders_text(holders)
    )]
    Leased {
        /// The name.
        name: String,
        /// The readers holding it.
        holders: Vec<Holder>,
    },
    /// The service is stopping.
    #[error("the service is stopping (SIGTERM): it loads nothing more")]
    Stopping,
    /// A writer holds the set.
    #[error(
        "set {name:?} is being written by pid {pid} (uid {uid}); one writer at a time: wait for \
         it to commit or abort (or exit)"
    )]
    Writing {
        /// The name.
        name: String,
        /// The writer's process id.
        pid: u32,
        /// The writer's uid.
        uid: u32,
    },
    /// Writing another uid's set.
    #[error(
        "set {name:?} belongs to uid {owner}: only that uid and the service's (uid {service}) may \
         write it, not uid {caller}"
    )]
    NotWriter {
        /// The name.
        name: String,
        /// Its owner.
        owner: u32,
        /// The service's uid.
        service: u32,
        /// Who asked.
        caller: u32,
    },
    /// A commit or abort from a connection that holds no write session on
    /// the set.
    #[error(
        "this connection holds no write session on set {name:?}{}; open one first (open_write), \
         from the same connection",
        match holder { Some(h) => format!(" (it is held by {h})"), None => String::new() }
    )]
    NotWriting {
        /// The name.
        name: String,
        /// The writer that holds it, if another does.
        holder: Option<Holder>,
    },
    /// A connection or a uid holds as many write sessions as it may.
    #[error(
        "{what} already holds {held} write session(s), the most it may ({limit}); commit or \
         abort one first"
    )]
    TooManyWrites {
        /// `this connection` or `uid N`.
        what: String,
        /// Sessions it holds.
        held: usize,
        /// The limit.
        limit: usize,
    },
}

impl CatalogError {
    /// The machine-readable code a caller sees (`"over_quota"`, ...).
    pub fn code(&self) -> &'static str {
        match self {
            CatalogError::OverQuota { .. } => "over_quota",
            CatalogError::Exists { .. } => "exists",
            CatalogError::Loading { .. } => "loading",
            CatalogError::NotFound { .. } => "not_found",
            CatalogError::NotOwner { .. } | CatalogError::NotWriter { .. } => "not_owner",
            CatalogError::Leased { .. } => "leased",
            CatalogError::Stopping => "stopping",
            CatalogError::Writing { .. } => "writing",
            CatalogError::NotWriting { .. } => "not_writing",
            CatalogError::TooManyWrites { .. } => "too_many_writes",
        }
    }
}

/// The service's bookkeeping (see the module docs). Not thread-safe on its
/// own: the service keeps it behind a lock.
#[derive(Debug)]
pub struct Catalog {
    service_uid: u32,
    quotas: Quotas,
    sets: BTreeMap<String, SetInfo>,
    /// Loads in progress: name -> (uid, bytes).
    loading: BTreeMap<String, (u32, u64)>,
    /// The last version given to each name.
    versions: BTreeMap<String, u64>,
    /// Write sessions by set name.
    writing: BTreeMap<String, WriteSession>,
    /// Versions replaced by a commit that readers still hold.
    retired: Vec<RetiredVersion>,
    /// Sets whose in-place write was cut short (see `catalog_write`).
    torn: std::collections::BTreeSet<String>,
    stopping: bool,
}

impl Catalog {
    /// An empty catalog of a service running as `service_uid`.
    pub fn new(service_uid: u32, quotas: Quotas) -> Catalog {
        Catalog {
            service_uid,
            quotas,
            sets: BTreeMap::new(),
            loading: BTreeMap::new(),
            versions: BTreeMap::new(),
            writing: BTreeMap::new(),
            retired: Vec::new(),
            torn: std::collections::BTreeSet::new(),
            stopping: false,
        }
    }

    /// The service's uid.
    pub fn service_uid(&self) -> u32 {
        self.service_uid
    }

    /// The quotas.
    pub fn quotas(&self) -> &Quotas {
        &self.quotas
    }

    /// Bytes `uid` is charged: its sets' current versions and the old
    /// versions it holds (see "Holding"), of which those old versions, and
    /// its loads in progress and write sessions' staging versions.
    fn usage_of(&self, uid: u32) -> (u64, u64, u64) {
        let held: u64 = self
            .retired
            .iter()
            .filter(|r| r.charged_to(uid))
            .map(|r| r.bytes)
            .sum();
        let used = self
            .sets
            .values()
            .filter(|s| s.owner_uid == uid)
            .map(|s| s.bytes)
            .sum::<u64>()
            .saturating_add(held);
        let reserved = self
            .loading
            .values()
            .filter(|(u, _)| *u == uid)
            .map(|(_, b)| *b)
            .chain(
                self.writing
                    .values()
                    .filter(|w| w.owner_uid == uid)
                    .map(|w| w.bytes),
            )
            .sum();
        (used, held, reserved)
    }

    /// Refuses `uid` `bytes` more when they would pass its quota.
    fn check_quota(&self, uid: u32, bytes: u64) -> Result<(), CatalogError> {
        if let Some(quota) = self.quotas.of(uid, self.service_uid) {
            let (used, _, reserved) = self.usage_of(uid);
            let total = used.saturating_add(reserved).saturating_add(bytes);
            if total > quota {
                return Err(CatalogError::OverQuota {
                    uid,
                    used,
                    reserved,
                    quota,
                    asked: bytes,
                });
            }
        }
        Ok(())
    }

    /// Checks that a load of `bytes` bytes into set `name` for `uid` would
    /// be admitted now, reserving nothing: what a load asks once it knows
    /// the checkpoint's size, before it reads the headers ([`admit`]
    /// asks again with the plan's bytes).
    ///
    /// [`admit`]: Self::admit
    ///
    /// # Errors
    /// As [`admit`](Self::admit).
    pub fn check_admit(&self, uid: u32, name: &str, bytes: u64) -> Result<(), CatalogError> {
        if self.stopping {
            return Err(CatalogError::Stopping);
        }
        if let Some(s) = self.sets.get(name) {
            return Err(CatalogError::Exists {
                name: name.into(),
                owner: s.owner_uid,
                version: s.version,
            });
        }
        if let Some(&(uid, _)) = self.loading.get(name) {
            return Err(CatalogError::Loading {
                name: name.into(),
                uid,
            });
        }
        if let Some(w) = self.writing.get(name) {
            return Err(w.refusal());
        }
        self.check_quota(uid, bytes)
    }

    /// Admits a load of `bytes` bytes into set `name` for `uid` and reserves
    /// the bytes (see the module docs).
    ///
    /// # Errors
    /// [`CatalogError::Stopping`], [`CatalogError::Exists`],
    /// [`CatalogError::Loading`], [`CatalogError::Writing`],
    /// [`CatalogError::OverQuota`], in that order.
    pub fn admit(&mut self, uid: u32, name: &str, bytes: u64) -> Result<Ticket, CatalogError> {
        self.check_admit(uid, name, bytes)?;
        self.loading.insert(name.into(), (uid, bytes));
        Ok(Ticket {
            name: name.into(),
            uid,
            bytes,
        })
    }

    /// Makes an admitted load a set, at `now` (seconds since the epoch).
    pub fn commit_at(&mut self, ticket: Ticket, loaded: Loaded, now: u64) -> &SetInfo {
        let Ticket { name, uid, bytes } = ticket;
        self.loading.remove(&name);
        let version = self.versions.entry(name.clone()).or_insert(0);
        *version += 1;
        let info = SetInfo {
            name: name.clone(),
            owner_uid: uid,
            bytes,
            payload_bytes: loaded.payload_bytes,
            tensors: loaded.tensors,
            version: *version,
            loaded_from: loaded.loaded_from,
            created_unix: now,
        };
        self.sets.insert(name.clone(), info);
        &self.sets[&name]
    }

    /// Makes an admitted load a set, now.
    pub fn commit(&mut self, ticket: Ticket, loaded: Loaded) -> &SetInfo {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        self.commit_at(ticket, loaded, now)
    }

    /// Takes back a set that an earlier run of the service held (from its
    /// kept catalog image), as it was: owner, version, sizes, origin and
    /// time. The name's next version is one more than this one.
    pub fn restore(&mut self, info: SetInfo) {
        let version = self.versions.entry(info.name.clone()).or_insert(0);
        *version = (*version).max(info.version);
        self.sets.insert(info.name.clone(), info);
    }

    /// Makes the next version of `name` at least `after + 1` (a set
    /// restored from a saved file keeps its saved version, unless the name
    /// has been past it already).
    pub fn continue_versions(&mut self, name: &str, after: u64) {
        let version = self.versions.entry(name.to_owned()).or_insert(0);
        *version = (*version).max(after);
    }

    /// Gives an admitted load's bytes back (the load failed).
    pub fn cancel(&mut self, ticket: Ticket) {
        let Ticket { name, .. } = ticket;
        self.loading.remove(&name);
    }

    /// Checks that `caller` may drop `name` now, with `holders` holding
    /// leases on it.
    ///
    /// # Errors
    /// [`CatalogError::NotFound`], [`CatalogError::NotOwner`],
    /// [`CatalogError::Writing`] and [`CatalogError::Leased`] (without
    /// `force`; a forced drop of a set being written aborts the writer's
    /// session, [`Catalog::abort_any`]), in that order.
    pub fn check_drop(
        &self,
        caller: u32,
        name: &str,
        holders: &[Holder],
        force: bool,
    ) -> Result<&SetInfo, CatalogError> {
        let Some(set) = self.sets.get(name) else {
            return Err(CatalogError::NotFound { name: name.into() });
        };
        if caller != set.owner_uid && caller != self.service_uid {
            return Err(CatalogError::NotOwner {
                name: name.into(),
                owner: set.owner_uid,
                service: self.service_uid,
                caller,
            });
        }
        if let Some(w) = self.writing.get(name)
            && !force
        {
            return Err(w.refusal());
        }
        if !holders.is_empty() && !force {
            let mut holders = holders.to_vec();
            holders.sort_unstable();
            holders.dedup();
            return Err(CatalogError::Leased {
                name: name.into(),
                holders,
            });
        }
        Ok(set)
    }

    /// Forgets set `name` at shutdown, whoever holds it; returns it.
    pub fn remove(&mut self, name: &str) -> Option<SetInfo> {
        self.torn.remove(name);
        self.sets.remove(name)
    }

    /// Drops set `name` (after [`check_drop`](Self::check_drop)); returns
    /// it. While `holders` (the readers of a forced drop) keep its memory it
    /// stays counted, against them, as a dropped version among
    /// [`retired`](Self::retired), until
    /// [`release_retired`](Self::release_retired) (see "Holding").
    pub fn drop_set(&mut self, name: &str, holders: &[Holder]) -> Option<SetInfo> {
        self.torn.remove(name);
        let info = self.sets.remove(name)?;
        if !holders.is_empty() {
            self.retired.push(RetiredVersion {
                set: info.name.clone(),
                version: info.version,
                owner_uid: info.owner_uid,
                bytes: info.bytes,
                dropped: true,
                holders: holder_uids(holders),
            });
        }
        Some(info)
    }

    /// The set `name`.
    pub fn get(&self, name: &str) -> Option<&SetInfo> {
        self.sets.get(name)
    }

    /// Every set, in name order.
    pub fn sets(&self) -> impl Iterator<Item = &SetInfo> {
        self.sets.values()
    }

    /// How many loads are in progress.
    pub fn loads_in_progress(&self) -> usize {
        self.loading.len()
    }

    /// Each uid that holds a set or an old version, is loading or writing
    /// one or has a quota of its own, in uid order.
    pub fn usage(&self) -> Vec<UidUsage> {
        let mut uids: Vec<u32> = self
            .sets
            .values()
            .map(|s| s.owner_uid)
            .chain(self.loading.values().map(|(u, _)| *u))
            .chain(self.writing.values().map(|w| w.owner_uid))
            .chain(self.retired.iter().flat_map(RetiredVersion::charged))
            .chain(self.quotas.per_uid.keys().copied())
            .collect();
        uids.sort_unstable();
        uids.dedup();
        uids.into_iter()
            .map(|uid| {
                let (used, held, reserved) = self.usage_of(uid);
                UidUsage {
                    uid,
                    used,
                    held,
                    reserved,
                    quota: self.quotas.of(uid, self.service_uid),
                    sets: self.sets.values().filter(|s| s.owner_uid == uid).count(),
                }
            })
            .collect()
    }

    /// Device bytes the service holds for sets: every current version, and
    /// every old version readers still keep (each once).
    pub fn total_bytes(&self) -> u64 {
        self.sets
            .values()
            .map(|s| s.bytes)
            .chain(self.retired.iter().map(|r| r.bytes))
            .sum()
    }

    /// Refuses every load from now on (loads already admitted may commit).
    pub fn stop(&mut self) {
        self.stopping = true;
    }

    /// Whether [`stop`](Self::stop) was called.
    pub fn is_stopping(&self) -> bool {
        self.stopping
    }
}

#[cfg(test)]
#[path = "catalog_tests.rs"]
mod tests;
