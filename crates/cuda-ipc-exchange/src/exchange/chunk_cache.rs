//! The chunk mappings a subscriber keeps between attaches, each with the
//! lease that tells the publisher it is mapped.

use std::sync::Arc;

use crate::Access;
use crate::arena::ChunkId;
use crate::channel::ChannelError;
use crate::memory::buffer::{Mapping, retire_after_uses};

use super::budget::{Held, LruCache};
use super::lease::{LeaseId, Pending, release_on};
use super::link::Link;

/// A chunk mapping in the subscriber's cache, with the lease on the chunk's
/// hidden entry that tells the publisher it is mapped (of an ended
/// connection, until a reconnect takes it back: the mapping stays all the
/// same).
pub(super) struct CachedChunk {
    pub(super) mapping: Arc<dyn Mapping>,
    pub(super) lease: LeaseId,
}

impl CachedChunk {
    /// Retires the chunk without waiting: unmapped once the streams that
    /// used it have finished, then its lease released (no answer awaited).
    pub(super) fn retire(self, link: &Arc<Link>, pending: &Arc<Pending>) {
        let CachedChunk { mapping, lease } = self;
        let (link, pending) = (link.clone(), pending.clone());
        retire_after_uses(vec![mapping], "unmapping an idle chunk", move |mappings| {
            crate::reaper::work_done(|| drop(mappings));
            if let Err(e) = release_on(&link, &pending, lease, false)
                && !matches!(e, ChannelError::PeerGone)
            {
                tracing::debug!(lease = lease.id, error = %e, "releasing a chunk lease failed");
            }
        });
    }
}

impl Held for CachedChunk {
    fn held(&self) -> bool {
        Arc::strong_count(&self.mapping) > 1
    }
}

/// The key of a cached chunk mapping: the chunk and the access it was mapped
/// with, so that a read-only and a read-write mapping of one chunk are two
/// entries (each with its own lease), never one handed out for the other.
pub(super) type ChunkKey = (ChunkId, Access);

/// The subscriber's cache of chunk mappings.
pub(super) type ChunkCache = LruCache<ChunkKey, CachedChunk>;
