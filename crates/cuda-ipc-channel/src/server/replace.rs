//! Replacing a published entry with a new one under the same name, for
//! versions: new attaches get the new entry at once, the holders of the
//! old one keep it (and its descriptors) until they release it, and are
//! told with an [`Update`](crate::Notice::Updated) on their lease, not an
//! `unpublished` notice (the name lives on).

use std::collections::BTreeSet;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use serde_json::Value;

use crate::wire::Meta;
use crate::{ChannelError, lock, validate_entry_name};

use super::state::{Body, Entry};
use super::{Server, check_fds, encoded_meta, json_size};

/// What [`Server::replace`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Replaced {
    /// The old entry's id, for [`Server::entry_lease_count`].
    pub old_entry: u64,
    /// The new entry's id.
    pub new_entry: u64,
    /// The version the old entry's holders were told (its update count).
    pub version: u64,
    /// How many leases were told.
    pub told: usize,
}

impl Server {
    /// Publishes `meta` and `fds` under `name`, which must be published,
    /// in place of its entry, in one step: an attach sees the old entry or
    /// the new one, never neither. Every lease on the old entry is sent
    /// `notice` as an update (as [`Server::update`] does); the old entry
    /// stays, unpublished, until its last lease ends.
    ///
    /// # Errors
    /// [`ChannelError::NotFound`] when `name` is not published,
    /// [`ChannelError::ShutDown`], and [`Server::publish`]'s checks of
    /// `meta` and `fds`.
    pub fn replace(
        &self,
        name: &str,
        meta: impl Into<Meta>,
        fds: Vec<OwnedFd>,
        notice: Value,
    ) -> Result<Replaced, ChannelError> {
        validate_entry_name(name)?;
        check_fds(fds.len())?;
        let (meta, meta_bytes) = encoded_meta(meta.into())?;
        json_size(&notice, "notice")?;
        let mut guard = lock(&self.shared.state);
        let st = &mut *guard;
        let old_id = st.published_id(name)?;
        let new_id = st.new_id();
        st.entries.insert(
            new_id,
            Entry {
                name: name.into(),
                meta: Arc::new(meta),
                meta_bytes,
                published: true,
                leases: BTreeSet::new(),
                body: Body::Plain { fds, version: 0 },
            },
        );
        st.names.insert(name.into(), new_id);
        let Some(old) = st.entries.get_mut(&old_id) else {
            return Err(ChannelError::NotFound { name: name.into() });
        };
        old.published = false;
        let version = match &mut old.body {
            Body::Plain { version, .. } => {
                *version += 1;
                *version
            }
            Body::Ring(_) => 0,
        };
        let holders: Vec<(u64, Arc<super::conn::Conn>)> = old
            .leases
            .iter()
            .filter_map(|lease| {
                let conn = st.conns.get(&st.leases.get(lease)?.conn)?;
                Some((*lease, Arc::clone(conn)))
            })
            .collect();
        if old.leases.is_empty() {
            st.entries.remove(&old_id);
        }
        let told = holders.len();
        self.send_updates(&holders, name, version, notice);
        drop(guard);
        self.shared.changed.notify_all();
        Ok(Replaced {
            old_entry: old_id,
            new_entry: new_id,
            version,
            told,
        })
    }

    /// The number of leases on the entry with id `entry` (0 once it is
    /// gone), as [`Replaced::old_entry`] names it.
    pub fn entry_lease_count(&self, entry: u64) -> usize {
        lock(&self.shared.state)
            .entries
            .get(&entry)
            .map_or(0, |e| e.leases.len())
    }
}
