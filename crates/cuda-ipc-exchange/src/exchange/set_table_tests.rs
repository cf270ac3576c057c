//! Entry tables by reference (set format 3) through a real channel,
//! without a GPU: a long table is published once per layout as hidden
//! entries that every record of the layout names, a reader that kept it
//! reads nothing more, a short one stays in the record, and a table stays
//! published while a set naming it is published or leased (the two used
//! last stay besides, for the next set of their layout).

use std::sync::Arc;

use super::tests::{client, hold, set_record, setup};
use super::*;
use crate::channel::Client;
use crate::exchange::set_attach::read_record;
use crate::set::{EntryTables, MemberPlace, SetLayouts};

/// `base`'s members described as the set `name` through `layouts`.
fn describe(layouts: &SetLayouts, name: &str, base: &SetRecord) -> (SetRecord, Arc<SetLayout>) {
    let places: Vec<MemberPlace<'_>> = base.entries.iter().map(MemberPlace::from).collect();
    layouts
        .describe(name, base.arena, base.chunks.clone(), &places)
        .unwrap()
}

/// Attaches `name`, reads its record through `tables`, releases it;
/// returns the entry's metadata and what the read gave.
fn read(consumer: &Client, name: &str, tables: &EntryTables) -> (Value, Result<SetRecord>) {
    let a = consumer.attach(name).unwrap();
    let r = read_record(consumer, &a.meta, Some(tables));
    consumer.release(a.lease).unwrap();
    (a.meta, r)
}

/// The names of the hidden entries a format 3 record's metadata names.
fn table_parts(meta: &Value) -> Vec<String> {
    meta["entries"]["parts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn long_tables_travel_once_per_layout_and_a_reader_that_kept_one_reads_it_no_more() {
    let (_dir, server, arena, mut book) = setup();
    let buf = arena.alloc(4096).unwrap();
    let consumer = client(&server);
    let layouts = SetLayouts::new();
    for n in [100, 1000, 10_000] {
        let base = set_record(n);
        let by_ref = base.to_value()["entries"].as_str().unwrap().len() >= TABLE_REF_MIN_BYTES;
        let before = book.tables();
        let (a, layout) = describe(&layouts, &format!("a{n}"), &base);
        let (b, layout_b) = describe(&layouts, &format!("b{n}"), &base);
        assert!(Arc::ptr_eq(&layout, &layout_b), "{n}: one layout");
        for r in [&a, &b] {
            book.publish_layout(
                &server,
                &arena,
                &r.name,
                r,
                &layout,
                hold(vec![buf.lease()]),
                None,
            )
            .unwrap();
        }
        assert_eq!(
            book.tables(),
            before + usize::from(by_ref),
            "{n}: one table for both"
        );
        let (kept, fresh) = (EntryTables::new(), EntryTables::new());
        let (meta, got) = read(&consumer, &a.name, &kept);
        assert_eq!(got.unwrap(), a, "{n}");
        assert_eq!(meta[SET_VERSION_KEY], if by_ref { 3 } else { 2 }, "{n}");
        assert!(
            meta.get(PARTS_KEY).is_none(),
            "{n}: the record alone is short"
        );
        if by_ref {
            // With the table's entries gone from the server, the reader
            // that kept the table reads the other set of its layout; one
            // that did not fails, naming the first entry it asked for.
            let parts = table_parts(&meta);
            assert_eq!(parts.len() > 1, n == 10_000, "{n}: {parts:?}");
            for p in &parts {
                server.unpublish(p).unwrap();
            }
            assert_eq!(read(&consumer, &b.name, &kept).1.unwrap(), b, "{n}");
            let e = read(&consumer, &b.name, &fresh).1.unwrap_err().to_string();
            assert!(e.contains(&parts[0]), "{n}: {e}");
            assert_eq!(kept.hits(), 1);
        } else {
            assert_eq!(read(&consumer, &b.name, &fresh).1.unwrap(), b, "{n}");
        }
        for r in [&a, &b] {
            book.unpublish(&server, &r.name).unwrap();
        }
    }
}

#[test]
fn a_table_stays_while_a_set_naming_it_is_leased_and_idle_ones_go_past_two() {
    let (_dir, server, arena, mut book) = setup();
    let buf = arena.alloc(4096).unwrap();
    let consumer = client(&server);
    let layouts = SetLayouts::new();
    let publish = |book: &mut Book<_>, name: &str, n: usize| {
        let (r, layout) = describe(&layouts, name, &set_record(n));
        book.publish_layout(
            &server,
            &arena,
            name,
            &r,
            &layout,
            hold(vec![buf.lease()]),
            None,
        )
        .unwrap();
    };
    // A reader holds s0 while it is unpublished: its table stays, and
    // another reader of the record can still read it.
    publish(&mut book, "s0", 1000);
    let held = consumer.attach("s0").unwrap();
    book.unpublish(&server, "s0").unwrap();
    let parts0 = table_parts(&held.meta);
    assert!(read_record(&consumer, &held.meta, None).is_ok());
    // Three more layouts, each published and unpublished with no reader:
    // the two used last stay idle, the first of them goes.
    for k in 1..=3 {
        let name = format!("s{k}");
        publish(&mut book, &name, 1000 + k);
        book.unpublish(&server, &name).unwrap();
    }
    assert_eq!(book.tables(), 3, "s0's (leased) and the two idle used last");
    consumer.release(held.lease).unwrap();
    book.reap(&server);
    assert_eq!(
        book.tables(),
        2,
        "s0's table is idle now, and older than the two"
    );
    let e = consumer.attach(&parts0[0]).unwrap_err();
    assert!(e.to_string().contains("no entry named"), "{e}");
    assert!(read_record(&consumer, &held.meta, None).is_err());
}
