//! A set replaced by its next version, without a GPU: new attaches get the
//! new record at once, readers of the old one are told with an update and
//! keep its ranges until they release it, records in parts are replaced
//! too, and a failed replace changes nothing.

use std::time::Duration;

use serde_json::json;

use super::tests::{client, hold, record, setup};
use super::*;
use crate::channel::Notice;

#[test]
fn a_replaced_set_tells_its_readers_and_keeps_their_ranges_until_released() {
    let (_dir, server, arena, mut book) = setup();
    let a = arena.alloc(4096).unwrap();
    book.publish(&server, &arena, "s", record(1), hold(vec![a.lease()]), None)
        .unwrap();
    let reader = client(&server);
    let old = reader.attach("s").unwrap();
    let b = arena.alloc(4096).unwrap();
    let r = book
        .replace(
            &server,
            &arena,
            "s",
            record(2),
            hold(vec![b.lease()]),
            None,
            json!({"fence_seq": 5}),
        )
        .unwrap();
    assert_eq!((r.version, r.told), (1, 1));
    let u = reader.next_update(Duration::from_secs(5)).unwrap();
    assert_eq!(u.lease, old.lease);
    assert!(
        matches!(&u.notice, Notice::Updated { version: 1, data } if data["fence_seq"] == 5),
        "{u:?}"
    );
    let new = reader.attach("s").unwrap();
    assert_eq!(new.meta, record(2));
    // The old version's range stays while its reader holds it.
    drop((a, b));
    assert_eq!(book.retired(), 1);
    assert_eq!(arena.stats().buffers, 2);
    assert_eq!(book.reap(&server), 0);
    reader.release(old.lease).unwrap();
    assert_eq!(book.reap(&server), 1);
    assert_eq!(arena.stats().buffers, 1, "only the new version's range");
    // The new version is kept whole, and updates reach its readers.
    assert!(book.update_of("s").is_some());
    reader.release(new.lease).unwrap();
    book.unpublish(&server, "s").unwrap();
    assert_eq!(arena.stats().buffers, 0);
}

#[test]
fn records_in_parts_are_replaced_and_a_missing_set_is_refused() {
    let (_dir, server, arena, mut book) = setup();
    let a = arena.alloc(4096).unwrap();
    let big = record(30_000);
    assert!(big.to_string().len() > SET_PART_BYTES);
    book.publish(&server, &arena, "s", big, hold(vec![a.lease()]), None)
        .unwrap();
    let reader = client(&server);
    let hidden = |c: &crate::channel::Client| {
        c.list()
            .unwrap()
            .into_iter()
            .filter(|e| e.name.contains("set-part"))
            .count()
    };
    let parts = hidden(&reader);
    assert!(parts > 1);
    let b = arena.alloc(4096).unwrap();
    book.replace(
        &server,
        &arena,
        "s",
        record(40_000),
        hold(vec![b.lease()]),
        None,
        json!({}),
    )
    .unwrap();
    // The old parts went with the old version; the new record's are there.
    assert!(hidden(&reader) > parts, "{} parts", hidden(&reader));
    let meta = reader.attach("s").unwrap().meta;
    assert!(meta.get(PARTS_KEY).is_some(), "{meta}");
    let c = arena.alloc(4096).unwrap();
    book.replace(
        &server,
        &arena,
        "s",
        record(1),
        hold(vec![c.lease()]),
        None,
        json!({}),
    )
    .unwrap();
    assert_eq!(hidden(&reader), 0);

    let e = book
        .replace(
            &server,
            &arena,
            "nope",
            record(1),
            hold(vec![c.lease()]),
            None,
            json!({}),
        )
        .unwrap_err();
    assert!(e.to_string().contains("nope"), "{e}");
    assert!(book.update_of("nope").is_none());
    assert_eq!(reader.attach("s").unwrap().meta, record(1));
}
