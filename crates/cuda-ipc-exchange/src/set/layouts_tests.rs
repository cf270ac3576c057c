use super::*;
use crate::descriptor::{Descriptor, Source};
use crate::device::DeviceUuid;

fn chunk(id: u64) -> SetChunk {
    let d = Descriptor::new(Source::Vmm { fd: 10 }, 1 << 20, DeviceUuid([3; 16]), 77);
    SetChunk::new(id, d.with_generation(id))
}

/// `n` entries of 16 bytes, one after another in chunk 1, from `at`.
fn entries(n: usize, at: u64) -> Vec<SetEntry> {
    (0..n as u64)
        .map(|i| SetEntry::new(format!("w{i}"), Dtype::F32, vec![4], 1, at + i * 16, 16))
        .collect()
}

fn places(entries: &[SetEntry]) -> Vec<MemberPlace<'_>> {
    entries.iter().map(MemberPlace::from).collect()
}

fn describe(l: &SetLayouts, name: &str, e: &[SetEntry]) -> (SetRecord, Arc<SetLayout>) {
    l.describe(name, ArenaId(9), vec![chunk(1)], &places(e))
        .unwrap()
}

#[test]
fn a_layout_described_again_shares_its_entries_and_table() {
    let l = SetLayouts::new();
    let e = entries(3, 0);
    let (first, layout) = describe(&l, "a", &e);
    assert_eq!(l.hits(), 0);
    let (again, same) = describe(&l, "b", &e);
    assert_eq!(l.hits(), 1);
    assert!(Arc::ptr_eq(&layout, &same));
    assert!(Arc::ptr_eq(&first.entries, &again.entries));
    assert_eq!(again.name, "b");
    assert_eq!(
        again,
        SetRecord::new("b".into(), ArenaId(9), vec![chunk(1)], e).unwrap()
    );
    // The table is made once, and is the record's.
    assert_eq!(Some(layout.table()), again.to_value()["entries"].as_str());
    assert!(std::ptr::eq(layout.table(), same.table()));
}

#[test]
fn a_kept_layout_still_checks_the_set_name() {
    let l = SetLayouts::new();
    let e = entries(2, 0);
    describe(&l, "a", &e);
    let bad = l.describe("", ArenaId(9), vec![chunk(1)], &places(&e));
    let plain = SetRecord::new(String::new(), ArenaId(9), vec![chunk(1)], e.clone());
    assert_eq!(bad.unwrap_err().to_string(), plain.unwrap_err().to_string());
}

#[test]
fn the_least_recently_used_layout_goes_first() {
    let l = SetLayouts::new();
    let (a, b, c) = (entries(2, 0), entries(2, 64), entries(2, 128));
    describe(&l, "a", &a);
    describe(&l, "b", &b);
    // `a` used again, so `b` is the least recently used.
    describe(&l, "a2", &a);
    describe(&l, "c", &c);
    assert_eq!(l.usage(), (SetLayouts::KEPT, 4));
    let hits = l.hits();
    describe(&l, "a3", &a);
    describe(&l, "c2", &c);
    assert_eq!(l.hits(), hits + 2);
    describe(&l, "b2", &b);
    assert_eq!(l.hits(), hits + 2, "b was dropped");
}

#[test]
fn a_refused_set_keeps_nothing() {
    let l = SetLayouts::new();
    let mut e = entries(2, 0);
    e[1].offset = 8; // overlaps the first
    assert!(
        l.describe("a", ArenaId(9), vec![chunk(1)], &places(&e))
            .is_err()
    );
    assert_eq!(l.usage(), (0, 0));
}

proptest::proptest! {
    /// The record's text with its table copied in is the text `to_json`
    /// encodes, whatever the set's name holds (quotes, backslashes, the
    /// key itself, control characters, any Unicode).
    #[test]
    fn a_record_with_its_table_copied_in_is_its_json(
        name in "(\\PC|[\"\\\\\u{1}\n]|\"entries\":\"\"){0,12}",
        n in 1usize..20,
        event in proptest::option::of(proptest::array::uniform32(0u8..)),
        read_only in proptest::bool::ANY,
    ) {
        let e = entries(n, 0);
        let mut r = SetRecord::new("a".into(), ArenaId(9), vec![chunk(1)], e).unwrap();
        r.name = name;
        r.read_only = read_only;
        r.event = event.map(|b| {
            let mut bytes = [0u8; 64];
            bytes[..32].copy_from_slice(&b);
            crate::handle::IpcEventHandle::from(bytes)
        });
        let table = table::encode(&r.entries);
        let (value, text) = r.to_value_and_json_with_table(&table);
        proptest::prop_assert_eq!(text, r.to_json());
        proptest::prop_assert_eq!(value, r.to_value());
    }
}
