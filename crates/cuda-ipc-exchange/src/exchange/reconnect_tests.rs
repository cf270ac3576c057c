//! Taking leases back after a reconnect, without a GPU: which version a
//! restarted publisher serves against the one held, what a refusal or a
//! missing set becomes, and chunk leases taken back without their
//! descriptors being used; leases not kept are given back.

use std::time::{Duration, Instant};

use serde_json::json;

use super::super::set_book::tests::set_record;
use super::super::wire;
use super::{
    EntryMeta, Standing, TakeBack, chunk_entry_name, same_version, standing_of, take_back,
    take_back_chunk,
};
use crate::arena::{ArenaId, ChunkId};
use crate::channel::{ChannelError, Client, ClientConfig, Server, ServerConfig};
use crate::descriptor::{Descriptor, Source};
use crate::device::DeviceUuid;
use crate::set::{EntryTables, SetRecord};

fn serve() -> (tempfile::TempDir, Server, Client) {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::bind(ServerConfig::new(dir.path().join("s.sock"))).unwrap();
    let client = Client::connect(server.path(), ClientConfig::default()).unwrap();
    (dir, server, client)
}

/// Waits up to 5 s for the server to hold `n` leases.
fn leases_become(server: &Server, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while server.leases().len() != n {
        assert!(Instant::now() < deadline, "{:?}", server.leases());
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// `record` as a restarted publisher has it: the same memory, described
/// by another process (other descriptor numbers, pid, generations).
fn restarted(record: &SetRecord) -> SetRecord {
    let mut r = record.clone();
    for c in &mut r.chunks {
        c.descriptor.pid += 1;
        c.descriptor.source = Source::Vmm {
            fd: 70 + c.id as i32,
        };
        c.descriptor.generation = Some(5 + c.id);
    }
    r
}

#[test]
fn the_same_version_is_the_same_arena_places_and_entries() {
    let held = set_record(6);
    assert!(same_version(&held, &restarted(&held)));
    // The chunks listed in another order: the same memory.
    let mut swapped = restarted(&held);
    swapped.chunks.reverse();
    assert!(same_version(&held, &swapped));
    // The entries listed in another order: the same version.
    let mut reordered = restarted(&held);
    let mut entries = reordered.entries.to_vec();
    entries.reverse();
    reordered.entries = entries.into();
    assert!(same_version(&held, &reordered));
    // Another arena (a publisher that kept nothing).
    let mut other = held.clone();
    other.arena = ArenaId(100);
    assert!(!same_version(&held, &other));
    // A version written elsewhere: a tensor moved.
    let mut moved = held.clone();
    let mut entries = moved.entries.to_vec();
    entries[3].offset += 4096;
    moved.entries = entries.into();
    assert!(!same_version(&held, &moved));
    // A chunk of another size or place under the same id.
    let mut resized = held.clone();
    resized.chunks[1].descriptor.alloc_size *= 2;
    assert!(!same_version(&held, &resized));
    let mut shifted = held.clone();
    shifted.chunks[0].descriptor.offset = 1 << 21;
    assert!(!same_version(&held, &shifted));
}

#[test]
fn a_failed_attach_says_what_became_of_the_set() {
    assert_eq!(
        standing_of(ChannelError::NotFound { name: "m".into() }),
        Standing::Gone
    );
    assert_eq!(
        standing_of(ChannelError::Remote {
            code: "writing_in_place".into(),
            message: "written".into()
        }),
        Standing::Missing(Some(("writing_in_place".into(), "written".into())))
    );
    let Standing::Missing(Some((code, message))) = standing_of(ChannelError::PeerGone) else {
        panic!("a lost connection is tried again");
    };
    assert_eq!(code, "not_taken_back");
    assert!(message.contains("closed the connection"), "{message}");
}

#[test]
fn the_lease_is_taken_back_only_for_the_version_held() {
    let (_dir, server, client) = serve();
    let tables = EntryTables::new();
    let held = set_record(4);
    // Not published (dropped while no process served): gone, no lease.
    assert!(matches!(
        take_back(&client, "weights", &held, &tables),
        TakeBack::Not(Standing::Gone)
    ));
    // The same version, as the restarted publisher describes it.
    server
        .publish("weights", restarted(&held).to_value(), Vec::new())
        .unwrap();
    let got = take_back(&client, "weights", &held, &tables);
    let TakeBack::Same { lease, fence, .. } = got else {
        panic!("the version held is served: taken back, not {got:?}");
    };
    assert!(fence.is_none());
    assert_eq!(server.leases().len(), 1);
    assert_eq!(server.leases()[0].name, "weights");
    client.release(lease).unwrap();
    // A newer version under the name: the lease taken to look is given back.
    let mut newer = held.clone();
    let mut entries = newer.entries.to_vec();
    entries[0].offset += 1 << 16;
    newer.entries = entries.into();
    server.unpublish("weights").unwrap();
    server
        .publish("weights", newer.to_value(), Vec::new())
        .unwrap();
    assert!(matches!(
        take_back(&client, "weights", &held, &tables),
        TakeBack::Not(Standing::Replaced)
    ));
    leases_become(&server, 0);
    // Something else under the name: not the version held either.
    server.unpublish("weights").unwrap();
    server
        .publish("weights", json!({"plain": true}), Vec::new())
        .unwrap();
    assert!(matches!(
        take_back(&client, "weights", &held, &tables),
        TakeBack::Not(Standing::Replaced)
    ));
    leases_become(&server, 0);
}

#[test]
fn a_refused_set_is_tried_again_later() {
    let (_dir, server, client) = serve();
    let held = set_record(2);
    server
        .publish("weights", held.to_value(), Vec::new())
        .unwrap();
    server.refuse_attaches("weights", "writing_in_place", "a writer writes it in place");
    let TakeBack::Not(Standing::Missing(Some((code, message)))) =
        take_back(&client, "weights", &held, &EntryTables::new())
    else {
        panic!("refused: missing, with the refusal");
    };
    assert_eq!(code, "writing_in_place");
    assert!(message.contains("in place"), "{message}");
    assert!(server.leases().is_empty());
    // Once allowed again, it is taken back.
    server.allow_attaches("weights");
    assert!(matches!(
        take_back(&client, "weights", &held, &EntryTables::new()),
        TakeBack::Same { .. }
    ));
}

#[test]
fn a_chunk_lease_is_taken_back_when_the_chunk_is_the_one_mapped() {
    let (_dir, server, client) = serve();
    let id = ChunkId {
        arena: ArenaId(99),
        index: 3,
    };
    let chunk = Descriptor::new(Source::Vmm { fd: 0 }, 1 << 21, DeviceUuid([7; 16]), 4242);
    let memfd =
        rustix::fs::memfd_create("reconnect-test-chunk", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    let meta = wire::to_value(&EntryMeta::new(&chunk)).unwrap();
    // Not served any more: kept mapped, no lease.
    assert_eq!(take_back_chunk(&client, id, 1 << 21), None);
    server
        .publish(&chunk_entry_name(id), meta, vec![memfd])
        .unwrap();
    // The descriptors of this process open on the chunk's memfd (the
    // server's, here in the same process, and any received).
    let open_on_chunk = || {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|t| t.to_string_lossy().contains("reconnect-test-chunk"))
            .count()
    };
    assert_eq!(open_on_chunk(), 1, "the server's");
    let lease = take_back_chunk(&client, id, 1 << 21).expect("the chunk mapped here");
    assert_eq!(server.leases().len(), 1);
    assert_eq!(
        open_on_chunk(),
        1,
        "the chunk's descriptor is closed, not imported again"
    );
    client.release(lease).unwrap();
    // Another size under the id: not this memory; the lease goes back.
    assert_eq!(take_back_chunk(&client, id, 1 << 22), None);
    leases_become(&server, 0);
}
