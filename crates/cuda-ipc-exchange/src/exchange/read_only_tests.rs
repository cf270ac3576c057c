//! Read-only readers without a GPU: the publisher's and the subscriber's
//! configuration, and the chunk cache keyed by access.

use crate::Access;
use crate::arena::{ArenaId, ChunkId};
use crate::descriptor::Mechanism;
use crate::error::ErrorKind;

use super::budget::{Held, LruCache, MappingBudget};
use super::chunk_cache::ChunkKey;
use super::{PublisherConfig, Sharing, SubscriberConfig};

#[test]
fn read_only_readers_are_off_by_default_and_checked_with_the_sharing() {
    let plain = PublisherConfig::default();
    assert!(!plain.read_only_readers);
    plain.validate().unwrap();
    // Isolated without the policy is fine.
    PublisherConfig::default()
        .with_sharing(Sharing::Isolated)
        .validate()
        .unwrap();
    let ro = PublisherConfig::default().with_read_only_readers(true);
    assert!(ro.read_only_readers);
    // `auto` (the arena then uses vmm chunks), vmm and fabric arenas.
    ro.validate().unwrap();
    for m in [Mechanism::Vmm, Mechanism::Fabric] {
        ro.clone()
            .with_sharing(Sharing::arena(m))
            .validate()
            .unwrap();
    }
    for (m, says) in [
        (Mechanism::Legacy, "cuIpcOpenMemHandle has no access flags"),
        (Mechanism::Pool, "cuMemPoolSetAccess"),
    ] {
        let e = ro
            .clone()
            .with_sharing(Sharing::arena(m))
            .validate()
            .unwrap_err();
        let text = e.to_string();
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{text}");
        assert!(text.contains("read-only readers"), "{text}");
        assert!(text.contains(says) && text.contains("vmm"), "{text}");
    }
    let e = ro
        .clone()
        .with_sharing(Sharing::Isolated)
        .validate()
        .unwrap_err();
    let text = e.to_string();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{text}");
    assert!(
        text.contains("isolated") && text.contains("arena"),
        "{text}"
    );
    // Turned off again.
    assert!(!ro.with_read_only_readers(false).read_only_readers);
}

#[test]
fn a_subscriber_maps_read_write_unless_it_asks() {
    assert_eq!(SubscriberConfig::default().access, Access::ReadWrite);
    let ro = SubscriberConfig::default().with_access(Access::ReadOnly);
    assert_eq!(ro.access, Access::ReadOnly);
    assert_eq!(ro.with_access(Access::ReadWrite).access, Access::ReadWrite);
}

struct Idle;

impl Held for Idle {
    fn held(&self) -> bool {
        false
    }
}

/// A read-only and a read-write mapping of one chunk are two cache entries:
/// neither is handed out for the other, nor replaces it.
#[test]
fn the_chunk_cache_keeps_read_only_and_read_write_apart() {
    let mut cache: LruCache<ChunkKey, Idle> = LruCache::new(MappingBudget::new(None, None));
    let id = ChunkId {
        arena: ArenaId(7),
        index: 3,
    };
    assert!(
        cache
            .insert((id, Access::ReadOnly), Idle, 1 << 20)
            .is_empty()
    );
    assert!(cache.get(&(id, Access::ReadWrite)).is_none());
    assert!(
        cache
            .insert((id, Access::ReadWrite), Idle, 1 << 20)
            .is_empty(),
        "the read-write mapping replaced the read-only one"
    );
    assert!(cache.get(&(id, Access::ReadOnly)).is_some());
    assert!(cache.get(&(id, Access::ReadWrite)).is_some());
    assert_eq!(cache.usage(), (2, 2 << 20));
}
