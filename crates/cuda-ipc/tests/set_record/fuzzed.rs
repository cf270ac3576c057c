//! The fuzz corpora replayed, and property tests.

use cuda_ipc::arena::ArenaId;
use cuda_ipc::descriptor::Dtype;
use cuda_ipc::handle::Handle;
use cuda_ipc::set::table::{decode_bytes, encode_bytes};
use cuda_ipc::set::{EntryTables, MemberPlace, SetLayouts, SetRecord, TableRef};
use proptest::prelude::*;
use serde_json::{Value, json};

use super::corpus::replay;
use super::*;

// ---------------------------------------------------------------------------
// The fuzz corpus, replayed

#[test]
fn every_corpus_file_passes_the_fuzz_checks() {
    replay("set_record", fuzz_set_record::set_record, |data| {
        std::str::from_utf8(data).is_ok_and(|t| SetRecord::from_json(t).is_ok())
    });
}

#[test]
fn every_table_corpus_file_passes_the_fuzz_checks() {
    replay("set_table", fuzz_set_table::set_table, |data| {
        decode_bytes(data).is_ok()
    });
}

/// The seeds of the read-only policy say what their names say: the valid
/// ones decode with `read_only` set, the others are refused naming it.
#[test]
fn the_read_only_seeds_decode_as_named() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/set_record");
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap();
    for name in [
        "seed-valid-read-only",
        "seed-valid-v2-read-only",
        "seed-valid-v2-fabric-read-only",
    ] {
        assert!(
            SetRecord::from_json(&read(name)).unwrap().read_only,
            "{name}"
        );
    }
    for name in [
        "seed-read-only-legacy",
        "seed-read-only-pool",
        "seed-read-only-not-bool",
    ] {
        match SetRecord::from_json(&read(name)) {
            Err(cuda_ipc::Error::Descriptor { field, .. }) => {
                assert_eq!(field, "read_only", "{name}");
            }
            other => panic!("{name}: {other:?}"),
        }
    }
}

// ---------------------------------------------------------------------------
// Properties

fn dtype() -> impl Strategy<Value = Dtype> {
    prop::sample::select(Dtype::ALL.to_vec())
}

/// Valid records: 1-4 chunks, entries placed one after another with gaps,
/// with or without an event and the read-only policy.
fn record() -> impl Strategy<Value = SetRecord> {
    (
        1usize..4,
        prop::collection::vec(
            (
                dtype(),
                prop::collection::vec(1u64..12, 0..3),
                0u64..300,
                any::<prop::sample::Index>(),
            ),
            1..40,
        ),
        any::<u64>(),
        prop::option::of(any::<[u8; 64]>()),
        any::<bool>(),
    )
        .prop_map(|(n, items, arena, event, read_only)| {
            let n = n.min(items.len());
            let chunks: Vec<_> = (0..n)
                .map(|c| chunk(c as u64 * 2 + 1, 20 + c as i32, MIB))
                .collect();
            let mut cursor = vec![0u64; n];
            let mut entries = Vec::new();
            for (i, (dtype, shape, gap, which)) in items.into_iter().enumerate() {
                // The first entries go one to each chunk so that none is unused.
                let c = if i < n { i } else { which.index(n) };
                let offset = (cursor[c] + gap).next_multiple_of(dtype.size());
                let e = entry(&format!("t{i}"), dtype, &shape, chunks[c].id, offset);
                cursor[c] = offset + e.len;
                entries.push(e);
            }
            let mut r = SetRecord::new(format!("set{n}"), ArenaId(arena.max(1)), chunks, entries)
                .expect("generated records are valid");
            r.event = event.map(|b| cuda_ipc::handle::IpcEventHandle::from_bytes(&b).unwrap());
            // The chunks are vmm memory, which may be mapped read-only.
            r.read_only = read_only;
            r
        })
}

/// Sets (or with `None` removes) the field `path` of the record value `v`:
/// `key` at the top, `c.key` in its first chunk, `d.key` in that chunk's
/// descriptor.
fn set_field(v: &mut Value, path: &str, value: Option<Value>) {
    let (target, key) = match path.split_once('.') {
        Some(("c", k)) => (&mut v["chunks"][0], k),
        Some((_, k)) => (&mut v["chunks"][0]["descriptor"], k),
        None => (v, path),
    };
    let obj = target.as_object_mut().unwrap();
    match value {
        Some(x) => {
            obj.insert(key.to_string(), x);
        }
        None => {
            obj.remove(key);
        }
    }
}

/// Decodes `v`: either an error that prints, or a record that validates and
/// round-trips.
fn decodes_cleanly(v: &Value) -> Option<SetRecord> {
    match SetRecord::from_value(v) {
        Ok(r) => {
            r.validate().unwrap();
            assert_eq!(SetRecord::from_json(&r.to_json()).unwrap(), r);
            Some(r)
        }
        Err(e) => {
            assert!(!e.to_string().is_empty());
            None
        }
    }
}

fn any_json() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        (0u64..5_000_000).prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (-1e6f64..1e6).prop_map(Value::from),
        "[a-z0-9.]{0,12}".prop_map(Value::from),
        prop::collection::vec(0u64..64, 0..4).prop_map(Value::from),
        Just(json!({})),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn valid_records_round_trip(r in record()) {
        let text = r.to_json();
        let back = SetRecord::from_json(&text).unwrap();
        prop_assert_eq!(&back, &r);
        prop_assert_eq!(back.to_json(), text);
        for i in 0..r.entries.len() {
            let d = r.entry_descriptor(i).unwrap();
            prop_assert_eq!(d.byte_len, r.entries[i].len);
        }
    }

    /// Any entry field replaced by any JSON value: a valid record (equal to
    /// the original where the value was the same) or a clean error.
    #[test]
    fn entry_field_mutations_decode_or_fail_cleanly(
        r in record(), which in any::<prop::sample::Index>(), field in 0usize..6, value in any_json(),
    ) {
        let mut v = r.to_expanded_value();
        let i = which.index(r.entries.len());
        let same = v["entries"][i][field] == value;
        v["entries"][i][field] = value;
        let got = decodes_cleanly(&v);
        if same {
            prop_assert_eq!(got.as_ref(), Some(&r));
        }
    }

    /// Any top-level, chunk or chunk-descriptor field replaced, added or removed.
    #[test]
    fn record_field_mutations_decode_or_fail_cleanly(
        r in record(),
        path in prop::sample::select(vec![
            "cuda_ipc_set", "name", "arena", "event", "chunks", "entries", "read_only", "unknown",
            "c.id", "c.descriptor", "c.extra", "d.fd", "d.len", "d.alloc_size", "d.offset", "d.mechanism",
            "d.pid", "d.generation", "d.dtype", "d.shape", "d.event", "d.handle",
        ]),
        value in prop::option::of(any_json()),
    ) {
        let mut v = r.to_value();
        set_field(&mut v, path, value);
        decodes_cleanly(&v);
    }

    /// A kept entry table never changes a verdict: after its own table and
    /// another were kept, a record with any top-level, chunk or descriptor
    /// field changed, or its table's bytes edited, decodes exactly as it
    /// does without them (the same record, or the same error).
    #[test]
    fn kept_tables_change_no_verdict(
        r in record(),
        other in record(),
        path in prop::sample::select(vec![
            "", "name", "arena", "event", "chunks", "read_only", "c.id", "d.len", "d.alloc_size",
            "d.offset", "d.mechanism", "d.pid", "d.dtype",
        ]),
        value in prop::option::of(any_json()),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 0..2),
    ) {
        let tables = EntryTables::new();
        for kept in [&other, &r] {
            SetRecord::from_value_with(&kept.to_value(), Some(&tables)).unwrap();
        }
        let mut v = r.to_value();
        if !path.is_empty() {
            set_field(&mut v, path, value);
        }
        if !edits.is_empty() {
            v["entries"] = json!(base64_of(&edited(encode_bytes(&r.entries), &edits)));
        }
        let hits = tables.hits();
        let with = SetRecord::from_value_with(&v, Some(&tables));
        let without = SetRecord::from_value(&v);
        match (&with, &without) {
            (Ok(a), Ok(b)) => prop_assert_eq!(a, b),
            (Err(a), Err(b)) => prop_assert_eq!(a.to_string(), b.to_string()),
            _ => prop_assert!(false, "with kept tables {:?}, without {:?}", with, without),
        }
        // Unchanged, the record found its table.
        if path.is_empty() && edits.is_empty() {
            prop_assert_eq!(tables.hits(), hits + 1);
        }
    }

    /// A format 3 record, its table named and read through the fetch,
    /// decodes as its format 2 twin; kept under its reference, the table
    /// is read once; with a field of the reference changed (the length,
    /// the names, one more field) it decodes to the same record or fails
    /// cleanly, and without a fetch it is refused, naming the entries.
    #[test]
    fn table_references_decode_as_the_tables_they_name(
        r in record(),
        other in record(),
        parts in 1usize..4,
        change in prop::option::of((prop::sample::select(vec!["bytes", "parts", "extra"]), any_json())),
    ) {
        let text = r.to_value()["entries"].as_str().unwrap().to_owned();
        let table = TableRef {
            parts: (0..parts).map(|i| format!(".cuda-ipc/set-table/1/2/{i}")).collect(),
            bytes: text.len() as u64,
        };
        let mut v = r.to_value_with_ref(&table);
        if let Some((key, value)) = &change {
            v["entries"].as_object_mut().unwrap().insert((*key).to_owned(), value.clone());
        }
        let tables = EntryTables::new();
        // Another table kept first: it is not this one.
        SetRecord::from_value_with(&other.to_value(), Some(&tables)).unwrap();
        let mut fetched = Vec::new();
        let mut fetch = |t: &TableRef| -> cuda_ipc::Result<String> {
            fetched.push(t.clone());
            Ok(text.clone())
        };
        let first = SetRecord::from_value_fetching(&v, Some(&tables), Some(&mut fetch));
        let second = SetRecord::from_value_fetching(&v, Some(&tables), Some(&mut fetch));
        match (&first, &second) {
            (Ok(a), Ok(b)) => {
                prop_assert_eq!(a, &r);
                prop_assert_eq!(b, &r);
                prop_assert_eq!(fetched.len(), 1, "read once, then kept");
            }
            (Err(a), Err(b)) => {
                prop_assert!(change.is_some(), "the unchanged reference failed: {}", a);
                prop_assert_eq!(a.to_string(), b.to_string());
            }
            _ => prop_assert!(false, "{:?} then {:?}", first, second),
        }
        let e = SetRecord::from_value(&v).unwrap_err().to_string();
        prop_assert!(e.contains("entries"), "{}", e);
    }

    /// A kept layout never changes a verdict: after its own layout and
    /// another were described, a set with any one member field changed
    /// (name, dtype, shape, chunk, offset, length), a member added or
    /// removed, a chunk's descriptor changed, or another set name, is
    /// described exactly as `SetRecord::new` makes it (the same record, or
    /// the same error); unchanged, it shares the kept entries.
    #[test]
    fn kept_layouts_change_no_verdict(
        r in record(),
        other in record(),
        which in any::<prop::sample::Index>(),
        change in 0u8..10,
        value in 0u64..400,
        name in "[a-z.]{0,6}",
    ) {
        let layouts = SetLayouts::new();
        let mut kept_r = None;
        for kept in [&other, &r] {
            let (_, layout) = layouts
                .describe(&kept.name, kept.arena, kept.chunks.clone(), &places(&kept.entries))
                .unwrap();
            kept_r = Some(layout);
        }
        let kept_r = kept_r.unwrap();
        let mut entries = r.entries.to_vec();
        let mut chunks = r.chunks.clone();
        let mut set_name = r.name.clone();
        let i = which.index(entries.len());
        let e = &mut entries[i];
        match change {
            0 => e.name = format!("{}{name}", e.name),
            1 => e.dtype = Dtype::ALL[value as usize % Dtype::ALL.len()],
            2 => e.shape = vec![value % 13; 1 + (value % 3) as usize].into(),
            3 => e.chunk = value % 8,
            4 => e.offset = value,
            5 => e.len = value,
            6 => { entries.remove(i); }
            7 => { let copy = entries[i].clone(); entries.push(copy); }
            8 => chunks[0].descriptor.byte_len = value,
            _ => set_name = name.clone(),
        }
        let same_layout = entries[..] == r.entries[..] && chunks == r.chunks;
        let hits = layouts.hits();
        let with = layouts.describe(&set_name, r.arena, chunks.clone(), &places(&entries));
        let without = SetRecord::new(set_name.clone(), r.arena, chunks, entries.clone());
        match (&with, &without) {
            (Ok((a, layout)), Ok(b)) => {
                prop_assert_eq!(a, b);
                let v = b.to_value();
                prop_assert_eq!(Some(layout.table()), v["entries"].as_str());
            }
            (Err(a), Err(b)) => prop_assert_eq!(a.to_string(), b.to_string()),
            _ => prop_assert!(false, "with kept layouts {:?}, without {:?}", with.map(|w| w.0), without),
        }
        match with {
            // The same members over the same chunks found their layout,
            // whatever the set's name.
            Ok((a, _)) if same_layout => {
                prop_assert_eq!(layouts.hits(), hits + 1);
                prop_assert!(std::sync::Arc::ptr_eq(&a.entries, kept_r.entries()));
            }
            _ if !same_layout => prop_assert_eq!(layouts.hits(), hits),
            _ => {}
        }
    }

    /// Bytes of format 2's table flipped, cut or inserted: never a panic;
    /// what decodes re-encodes to the same bytes, and in a record it
    /// validates or fails cleanly.
    #[test]
    fn table_mutations_decode_or_fail_cleanly(
        r in record(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..4),
    ) {
        let bytes = edited(encode_bytes(&r.entries), &edits);
        fuzz_set_table::set_table(&bytes);
        if let Ok(entries) = decode_bytes(&bytes) {
            let mut v = r.to_value();
            v["entries"] = json!(base64_of(&encode_bytes(&entries)));
            decodes_cleanly(&v);
        }
    }

    /// Entries of 4 bytes at any offsets in up to 3 chunks, in any order:
    /// the record is refused exactly when two entries of one chunk share a
    /// byte (a pairwise look), and the error names an entry of such a pair.
    #[test]
    fn overlaps_are_found_whatever_the_order(
        placed in prop::collection::vec((0u64..3, 0u64..64), 3..40),
    ) {
        let chunks: Vec<_> = (0..3).map(|c| chunk(c * 2 + 1, 20 + c as i32, MIB)).collect();
        // The first three go one to each chunk, so that none is unused.
        let placed: Vec<(u64, u64)> = placed
            .iter()
            .enumerate()
            .map(|(i, &(c, slot))| (if i < 3 { i as u64 } else { c }, slot * 4))
            .collect();
        let entries: Vec<_> = placed
            .iter()
            .enumerate()
            .map(|(i, &(c, offset))| entry(&format!("t{i}"), Dtype::F32, &[1], c * 2 + 1, offset))
            .collect();
        let overlapping: Vec<usize> = (0..placed.len())
            .filter(|&i| {
                (0..placed.len()).any(|j| {
                    let ((ci, oi), (cj, oj)) = (placed[i], placed[j]);
                    i != j && ci == cj && oi < oj + 4 && oj < oi + 4
                })
            })
            .collect();
        match SetRecord::new("s".into(), ArenaId(1), chunks, entries) {
            Ok(_) => prop_assert!(overlapping.is_empty(), "{:?} overlap", overlapping),
            Err(e) => {
                let text = e.to_string();
                prop_assert!(text.contains("overlap"), "{}", text);
                prop_assert!(
                    overlapping.iter().any(|i| text.contains(&format!("entries[{i}].offset"))),
                    "{} names none of {:?}", text, overlapping
                );
            }
        }
    }

    /// Bytes of the JSON text flipped, cut or duplicated: never a panic, and
    /// what decodes is valid and round-trips.
    #[test]
    fn text_mutations_decode_or_fail_cleanly(
        r in record(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..4),
    ) {
        let bytes = edited(r.to_json().into_bytes(), &edits);
        fuzz_set_record::set_record(&bytes);
    }
}

/// `bytes` with each edit applied: `(where, byte, kind)`, kind 0 replaces
/// the byte there, 1 removes it, 2 inserts `byte` before it.
fn edited(mut bytes: Vec<u8>, edits: &[(prop::sample::Index, u8, u8)]) -> Vec<u8> {
    for &(at, byte, kind) in edits {
        if bytes.is_empty() {
            bytes.push(byte);
            continue;
        }
        let i = at.index(bytes.len());
        match kind {
            0 => bytes[i] = byte,
            1 => {
                bytes.remove(i);
            }
            _ => bytes.insert(i, byte),
        }
    }
    bytes
}

/// Standard base64 with padding, as format 2 carries its table.
fn base64_of(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// A record text longer than the limit is refused before it is parsed (a
/// 96 MiB format-1 record once took 1.8 GB of memory to be refused).
#[test]
fn an_over_long_record_is_refused_before_parsing() {
    use cuda_ipc::set::MAX_SET_RECORD_BYTES;
    // Valid JSON that would parse into millions of values.
    let mut text = String::with_capacity(MAX_SET_RECORD_BYTES + 16);
    text.push('[');
    while text.len() <= MAX_SET_RECORD_BYTES {
        text.push_str("[1,2],");
    }
    text.push_str("[]]");
    let started = std::time::Instant::now();
    let e = SetRecord::from_json(&text).unwrap_err();
    assert!(e.to_string().contains("longer than"), "{e}");
    assert!(
        started.elapsed() < std::time::Duration::from_millis(50),
        "{:?}",
        started.elapsed()
    );
}

/// Each entry of `entries` as the member that describes it.
fn places(entries: &[cuda_ipc::set::SetEntry]) -> Vec<MemberPlace<'_>> {
    entries.iter().map(MemberPlace::from).collect()
}
