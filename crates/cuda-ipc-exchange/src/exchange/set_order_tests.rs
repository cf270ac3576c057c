//! What the book keeps for a set's updates, without a GPU: the set's
//! distinct chunks and streams are worked out once at publish, an update
//! asks each distinct chunk once whatever the number of members, and the
//! kept order follows unpublish, republish and trim.

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use super::tests::{MemChunks, client, hold, record, setup};
use super::*;
use crate::arena::ArenaBuffer;
use crate::exchange::set_order::SetOrder;

/// The asks of every lane of `arena`'s backing so far.
fn asks(arena: &Arena<MemChunks>) -> usize {
    arena.backing().lanes.iter().map(|l| l.asked()).sum()
}

/// The order the book keeps for `name`.
fn order_of(book: &Book<MemChunks>, name: &str) -> Arc<SetOrder<MemChunks>> {
    book.update_of(name).expect("published").0
}

/// `n` leases cycling over `buffers`: a set of `n` members.
fn members(buffers: &[ArenaBuffer<MemChunks>], n: usize) -> Vec<ArenaLease<MemChunks>> {
    (0..n).map(|i| buffers[i % buffers.len()].lease()).collect()
}

#[test]
fn a_sets_chunks_and_streams_are_worked_out_once_at_publish() {
    let (_dir, server, _, mut book) = setup();
    // Two stand-in streams; chunks 0 and 2 on the first, chunk 1 on the second.
    let arena = super::tests::arena_on(2);
    let bufs: Vec<_> = [600 << 10, 300 << 10, 600 << 10, 600 << 10]
        .iter()
        .map(|n| arena.alloc(*n).unwrap())
        .collect();
    let ids: Vec<_> = bufs.iter().map(|b| b.chunk().id().index).collect();
    assert_eq!(ids, [0, 0, 1, 2]);
    let h = hold(members(&bufs, 1000));
    let kept = Arc::clone(h.order());
    book.publish(&server, &arena, "w", record(1000), h, None)
        .unwrap();
    let order = order_of(&book, "w");
    assert!(
        Arc::ptr_eq(&order, &kept),
        "the book keeps what publish made"
    );
    let chunks: Vec<u64> = order.chunks().iter().map(|c| c.id().index).collect();
    assert_eq!(chunks, [0, 1, 2], "distinct, in the members' order");
    assert_eq!(order.streams().len(), 2, "distinct streams");
    assert!(Arc::ptr_eq(&order.streams()[0], &arena.backing().lanes[0]));
    assert!(Arc::ptr_eq(&order.streams()[1], &arena.backing().lanes[1]));
    // Each update takes the same order (no new one, no member visited).
    for _ in 0..3 {
        assert!(Arc::ptr_eq(&order_of(&book, "w"), &kept));
    }
    assert!(book.update_of("nope").is_none());
}

#[test]
fn an_update_asks_each_chunk_once_whatever_the_number_of_members() {
    let (_dir, server, arena, mut book) = setup();
    let bufs: Vec<_> = [600 << 10, 600 << 10, 600 << 10]
        .iter()
        .map(|n| arena.alloc(*n).unwrap())
        .collect();
    let mut per_update = Vec::new();
    for n in [3, 100, 10_000] {
        let name = format!("set{n}");
        book.publish(
            &server,
            &arena,
            &name,
            record(1),
            hold(members(&bufs, n)),
            None,
        )
        .unwrap();
        let order = order_of(&book, &name);
        let before = asks(&arena);
        let streams = order.ordered_streams().len();
        per_update.push((asks(&arena) - before, streams));
    }
    // Three chunks, one stream: three asks (an atomic load each on a
    // device chunk that was not used elsewhere), at 3 or 10,000 members.
    assert_eq!(per_update, [(3, 1), (3, 1), (3, 1)]);
}

#[test]
fn the_kept_order_follows_unpublish_and_republish() {
    let (_dir, server, arena, mut book) = setup();
    let a = arena.alloc(600 << 10).unwrap();
    let b = arena.alloc(600 << 10).unwrap();
    assert_ne!(a.chunk().id(), b.chunk().id());
    book.publish(&server, &arena, "s", record(1), hold(vec![a.lease()]), None)
        .unwrap();
    let first = order_of(&book, "s");
    let consumer = client(&server);
    let lease = consumer.attach("s").unwrap().lease;
    book.unpublish(&server, "s").unwrap();
    assert!(book.update_of("s").is_none(), "unpublished: no update");
    assert_eq!(book.retired(), 1, "leased: its members are kept");
    // The name again, on other memory: a new order, of the new chunk.
    book.publish(&server, &arena, "s", record(1), hold(vec![b.lease()]), None)
        .unwrap();
    let second = order_of(&book, "s");
    assert!(!Arc::ptr_eq(&first, &second));
    let ids = |o: &SetOrder<MemChunks>| o.chunks().iter().map(|c| c.id()).collect::<Vec<_>>();
    assert_eq!(ids(&second), [b.chunk().id()]);
    assert_eq!(
        ids(&first),
        [a.chunk().id()],
        "an order taken earlier stays whole"
    );
    consumer.release(lease).unwrap();
    assert_eq!(book.reap(&server), 1);
    assert_eq!(ids(&order_of(&book, "s")), [b.chunk().id()]);
}

#[test]
fn trimming_leaves_a_published_sets_order_and_chunks_alone() {
    let (_dir, server, arena, mut book) = setup();
    let kept = arena.alloc(600 << 10).unwrap();
    let gone = arena.alloc(600 << 10).unwrap();
    let (kept_id, gone_id) = (kept.chunk().id(), gone.chunk().id());
    book.publish(
        &server,
        &arena,
        "kept",
        record(1),
        hold(vec![kept.lease()]),
        None,
    )
    .unwrap();
    book.publish(
        &server,
        &arena,
        "gone",
        record(1),
        hold(vec![gone.lease()]),
        None,
    )
    .unwrap();
    book.unpublish(&server, "gone").unwrap();
    drop(gone);
    // Only the chunk that holds no buffer goes, with its hidden entry.
    assert_eq!(book.trim(&server, &arena), 1 << 20);
    let names: Vec<String> = client(&server)
        .list()
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert!(names.contains(&chunk_entry_name(kept_id)), "{names:?}");
    assert!(!names.contains(&chunk_entry_name(gone_id)), "{names:?}");
    let order = order_of(&book, "kept");
    let ids: Vec<_> = order.chunks().iter().map(|c| c.id()).collect();
    assert_eq!(ids, [kept_id]);
    assert_eq!(order.ordered_streams().len(), 1);
    // A set on a chunk made after the trim gets that chunk (a new index).
    let fresh = arena.alloc(600 << 10).unwrap();
    assert!(fresh.chunk().id().index > gone_id.index);
    book.publish(
        &server,
        &arena,
        "fresh",
        record(1),
        hold(vec![fresh.lease()]),
        None,
    )
    .unwrap();
    let ids: Vec<_> = order_of(&book, "fresh")
        .chunks()
        .iter()
        .map(|c| c.id())
        .collect();
    assert_eq!(ids, [fresh.chunk().id()]);
}

#[test]
fn an_update_notice_carries_the_fence_number_only_whatever_the_record() {
    let (_dir, server, arena, mut book) = setup();
    let bufs: Vec<_> = (0..4).map(|_| arena.alloc(4096).unwrap()).collect();
    // A record of 10,000 entries (it travels in parts).
    let big = json!({
        crate::set::SET_VERSION_KEY: 1,
        "entries": (0..10_000).map(|i| format!("layer{i}.weight")).collect::<Vec<_>>(),
    });
    book.publish(
        &server,
        &arena,
        "big",
        big,
        hold(members(&bufs, 10_000)),
        None,
    )
    .unwrap();
    let consumer = client(&server);
    let set = consumer.attach("big").unwrap();
    let notice = json!({ "fence_seq": 7 });
    assert_eq!(server.update("big", notice.clone()).unwrap(), 1);
    let u = consumer.next_update(Duration::from_secs(5)).unwrap();
    assert_eq!(u.lease, set.lease);
    match u.notice {
        crate::channel::Notice::Updated { version, data } => {
            assert_eq!(version, 1);
            assert_eq!(data, notice, "the notice is what the publisher sent");
        }
        other => panic!("{other:?}"),
    }
}
