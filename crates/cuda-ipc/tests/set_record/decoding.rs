//! Strict decoding of formats 1 to 3: round trips, format 1 read expanded,
//! format 2's tables and format 3's references refused byte by byte.

use cuda_ipc::arena::ArenaId;
use cuda_ipc::descriptor::{Descriptor, Dtype, Source};
use cuda_ipc::set::table::{decode_bytes, encode_bytes};
use cuda_ipc::set::{EntryTables, SetChunk, SetRecord, TableRef};
use serde_json::{Value, json};

use super::fields::refused_v2;
use super::*;

// ---------------------------------------------------------------------------
// Decoding and its errors

/// Found by the `set_record` fuzz target (2026-12-01): a chunk that starts
/// at an odd byte of its allocation made a bf16 entry at an even offset in
/// the chunk misaligned; the record was accepted, and its entry's
/// descriptor then refused. The record is refused now.
#[test]
fn an_entry_misaligned_by_its_chunks_offset_is_refused() {
    let odd = SetChunk::new(
        3,
        Descriptor::new(Source::Vmm { fd: 9 }, 4 * MIB, UUID, 4242)
            .with_range(1, 4 * MIB - 1)
            .with_generation(9),
    );
    let e = SetRecord::new(
        "weights".into(),
        ArenaId(1),
        vec![odd],
        vec![entry("w", Dtype::Bf16, &[1024], 3, 1024)],
    )
    .unwrap_err();
    let text = e.to_string();
    assert!(text.contains("entries[0].offset"), "{text}");
    assert!(text.contains("byte 1025 of chunk 3"), "{text}");
    // Where the chunk's offset keeps the elements aligned, it is accepted.
    let even = SetChunk::new(
        3,
        Descriptor::new(Source::Vmm { fd: 9 }, 4 * MIB, UUID, 4242)
            .with_range(2, 4 * MIB - 2)
            .with_generation(9),
    );
    let r = SetRecord::new(
        "weights".into(),
        ArenaId(1),
        vec![even],
        vec![entry("w", Dtype::Bf16, &[1024], 3, 1024)],
    )
    .unwrap();
    r.entry_descriptor(0).unwrap();
}

#[test]
fn a_record_with_a_key_twice_is_refused() {
    let text = sample().to_json();
    // The same key twice: a strict reader refuses, rather than take the last.
    let twice = text.replacen(r#"{"arena":"#, r#"{"name":"other","arena":"#, 1);
    assert_ne!(twice, text);
    let e = SetRecord::from_json(&twice).unwrap_err();
    assert!(e.to_string().contains("appears twice"), "{e}");
}

#[test]
fn total_bytes_saturate_instead_of_wrapping() {
    let mut r = sample();
    for e in std::sync::Arc::make_mut(&mut r.entries) {
        e.len = u64::MAX / 2;
    }
    assert_eq!(r.total_bytes(), u64::MAX);
}

/// The buffer and mapping types are `Send + Sync` by their fields alone (no
/// `unsafe impl`): a field added later that is not stops this from compiling.
#[test]
fn memory_types_are_send_and_sync_by_their_fields() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<cuda_ipc::LegacyBuffer>();
    send_sync::<cuda_ipc::LegacyMapping>();
    send_sync::<cuda_ipc::vmm::VmmBuffer>();
    send_sync::<cuda_ipc::vmm::VmmMapping>();
    send_sync::<cuda_ipc::pool::PoolBuffer>();
    send_sync::<cuda_ipc::pool::PoolMapping>();
}

#[test]
fn a_record_round_trips_through_json() {
    let r = sample();
    let text = r.to_json();
    assert!(text.starts_with(r#"{"arena":"#), "{text}");
    assert!(text.contains(r#""cuda_ipc_set":2"#), "{text}");
    let back = SetRecord::from_json(&text).unwrap();
    assert_eq!(back, r);
    assert_eq!(back.to_json(), text);
    assert_eq!(text.parse::<SetRecord>().unwrap(), r);
    assert_eq!(serde_json::from_str::<SetRecord>(&text).unwrap(), r);
    assert_eq!(serde_json::to_string(&r).unwrap(), text);
    assert_eq!(r.total_bytes(), 262_144 + 1024 + 2 * MIB + 8);
    let d = r.entry_descriptor(2).unwrap();
    assert_eq!(
        (d.offset, d.byte_len, d.dtype),
        (1024, 2 * MIB, Dtype::Bf16)
    );
    assert_eq!(d.source, Source::Vmm { fd: 9 });
    assert_eq!(d.shape.as_deref(), Some(&[1024u64, 1024][..]));
    assert!(r.entry_descriptor(4).is_err());
}

#[test]
fn format_1_is_read_and_written_expanded() {
    let r = sample();
    let expanded = r.to_expanded_value();
    let text = expanded.to_string();
    assert!(text.contains(r#""cuda_ipc_set":1"#), "{text}");
    assert!(
        text.contains(r#"["layer0.bias","f32",[256],0,262144,1024]"#),
        "{text}"
    );
    assert_eq!(SetRecord::from_value(&expanded).unwrap(), r);
    // Read as format 1, written as format 2.
    assert_eq!(SetRecord::from_json(&text).unwrap().to_json(), r.to_json());
    // The table is smaller than the arrays it replaces.
    assert!(
        r.to_json().len() < text.len(),
        "{} vs {}",
        r.to_json().len(),
        text.len()
    );
}

/// A hand-written table: count 1, then one entry.
fn one_entry_table(
    name: &[u8],
    dtype: &[u8],
    shape: &[u64],
    chunk: u64,
    offset: u64,
    len: u64,
) -> Vec<u8> {
    fn put(b: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            b.push((v & 0x7f) as u8 | 0x80);
            v >>= 7;
        }
        b.push(v as u8);
    }
    let mut b = Vec::new();
    put(&mut b, 1);
    put(&mut b, name.len() as u64);
    b.extend_from_slice(name);
    put(&mut b, dtype.len() as u64);
    b.extend_from_slice(dtype);
    put(&mut b, shape.len() as u64);
    for &d in shape {
        put(&mut b, d);
    }
    for v in [chunk, offset, len] {
        put(&mut b, v);
    }
    b
}

/// `bytes` decoded as a table fails naming `field`, with `says`.
fn table_refused(bytes: &[u8], field: &str, says: &str) {
    match decode_bytes(bytes).unwrap_err() {
        cuda_ipc::Error::Descriptor { field: f, reason } => {
            assert_eq!(f, field, "{reason}");
            assert!(reason.contains(says), "{field}: {reason}");
        }
        other => panic!("not a field error: {other}"),
    }
}

#[test]
fn format_2_tables_are_strict() {
    let good = one_entry_table(b"w", b"f32", &[2, 3], 0, 256, 24);
    let e = &decode_bytes(&good).unwrap()[0];
    assert_eq!(
        (e.name.as_str(), e.dtype, e.shape.as_slice()),
        ("w", Dtype::F32, &[2u64, 3][..])
    );
    assert_eq!((e.chunk, e.offset, e.len), (0, 256, 24));
    assert_eq!(encode_bytes(std::slice::from_ref(e)), good);
    // Cut anywhere: the field it ends in is named.
    for cut in 0..good.len() {
        let err = decode_bytes(&good[..cut]).unwrap_err().to_string();
        assert!(err.contains("ends inside"), "cut at {cut}: {err}");
    }
    table_refused(
        &[good.clone(), vec![0]].concat(),
        "entries",
        "1 bytes follow the last",
    );
    table_refused(&[0x81, 0x00], "entries", "shortest form");
    table_refused(&[0xff; 10], "entries", "passes 64 bits");
    table_refused(
        &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02],
        "entries",
        "passes 64 bits",
    );
    table_refused(
        &[0xa1, 0x8d, 0x06],
        "entries",
        "100001 entries is more than",
    );
    table_refused(
        &one_entry_table(&[b'a'; 257], b"f32", &[], 0, 0, 4),
        "entries[0].name",
        "257 bytes is longer",
    );
    table_refused(
        &one_entry_table(&[0xff, 0xfe], b"f32", &[], 0, 0, 4),
        "entries[0].name",
        "not UTF-8",
    );
    table_refused(
        &one_entry_table(b"w", b"f128", &[], 0, 0, 16),
        "entries[0].dtype",
        "not one of",
    );
    table_refused(
        &one_entry_table(b"w", &[b'x'; 17], &[], 0, 0, 16),
        "entries[0].dtype",
        "17 bytes is longer",
    );
    table_refused(
        &one_entry_table(b"w", b"u8", &[1; 33], 0, 0, 1),
        "entries[0].shape",
        "33 dimensions",
    );
    // A count that promises more than the bytes hold allocates nothing
    // first: it ends inside entry 1.
    let mut lying = good.clone();
    lying[0] = 0xa0;
    lying.insert(1, 0x9c);
    lying.insert(2, 0x01);
    let err = decode_bytes(&lying).unwrap_err().to_string();
    assert!(
        err.contains("ends inside") || err.contains("entries["),
        "{err}"
    );
    // In a record: not base64, and not a string.
    refused_v2(
        |v| v["entries"] = json!("not base64!"),
        "entries",
        "not base64",
    );
    refused_v2(
        |v| v["entries"] = json!([["w", "f32", [1], 0, 0, 4]]),
        "entries",
        "expected the base64 entry table",
    );
}

/// A format 3 record's table reference, read through a fetch: each error
/// names the field (`entries.bytes`, `entries.parts[i]`, ...), a fetch
/// that fails fails the decode, and without a fetch the record is refused,
/// saying where its table is.
#[test]
fn format_3_references_are_strict() {
    let r = sample();
    let text = r.to_value()["entries"].as_str().unwrap().to_owned();
    let table = TableRef {
        parts: vec![
            ".cuda-ipc/set-table/1/7/0".into(),
            ".cuda-ipc/set-table/1/7/1".into(),
        ],
        bytes: text.len() as u64,
    };
    let good = r.to_value_with_ref(&table);
    assert_eq!(good["cuda_ipc_set"], 3);
    let read = |v: &Value, give: Option<&str>| {
        let mut fetch = |t: &TableRef| -> cuda_ipc::Result<String> {
            assert_eq!(
                t.parts.len(),
                v["entries"]["parts"].as_array().map_or(0, Vec::len)
            );
            give.map(str::to_owned)
                .ok_or_else(|| cuda_ipc::Error::Descriptor {
                    field: "fetch".into(),
                    reason: "the publisher is gone".into(),
                })
        };
        SetRecord::from_value_fetching(v, None, Some(&mut fetch))
    };
    assert_eq!(read(&good, Some(&text)).unwrap(), r);
    let field_of = |e: cuda_ipc::Error| match e {
        cuda_ipc::Error::Descriptor { field, reason } => (field, reason),
        other => panic!("not a field error: {other}"),
    };
    // The fetch's own error, and a text of another length.
    assert_eq!(field_of(read(&good, None).unwrap_err()).0, "fetch");
    let (f, why) = field_of(read(&good, Some(&text[1..])).unwrap_err());
    assert_eq!(
        (f.as_str(), why.contains("hold")),
        ("entries.bytes", true),
        "{why}"
    );
    // No fetch: refused, naming where the table is.
    let (f, why) = field_of(SetRecord::from_value(&good).unwrap_err());
    assert_eq!(f, "entries");
    assert!(why.contains("Subscriber"), "{why}");
    for (edit, field, says) in [
        (json!("AAAA"), "entries", "table reference"),
        (json!({ "parts": ["a"] }), "entries.bytes", "missing"),
        (
            json!({ "parts": ["a"], "bytes": 0 }),
            "entries.bytes",
            "between 1",
        ),
        (json!({ "parts": [], "bytes": 4 }), "entries.parts", "1 to"),
        (
            json!({ "parts": [""], "bytes": 4 }),
            "entries.parts[0]",
            "empty",
        ),
        (
            json!({ "parts": ["a", 5], "bytes": 4 }),
            "entries.parts[1]",
            "entry name",
        ),
        (
            json!({ "parts": ["a\u{7}"], "bytes": 4 }),
            "entries.parts[0]",
            "control",
        ),
        (
            json!({ "parts": ["a"], "bytes": 4, "hash": 1 }),
            "entries.hash",
            "unknown",
        ),
    ] {
        let mut v = good.clone();
        v["entries"] = edit;
        let (f, why) = field_of(read(&v, Some(&text)).unwrap_err());
        assert_eq!(f, field, "{why}");
        assert!(why.contains(says), "{field}: {why}");
    }
    let mut v = good.clone();
    v["entries"]["parts"] = json!(vec!["a"; cuda_ipc::set::MAX_TABLE_PARTS + 1]);
    assert_eq!(
        field_of(read(&v, Some(&text)).unwrap_err()).0,
        "entries.parts"
    );
    // Format 2 with a reference, format 3 with a table: refused.
    let mut v = good.clone();
    v["cuda_ipc_set"] = json!(2);
    assert_eq!(field_of(read(&v, Some(&text)).unwrap_err()).0, "entries");
    // Kept under its reference, per arena: another arena's record of the
    // same reference reads its own table.
    let tables = EntryTables::new();
    let mut fetched = 0;
    let mut fetch = |_: &TableRef| -> cuda_ipc::Result<String> {
        fetched += 1;
        Ok(text.clone())
    };
    let mut other_arena = good.clone();
    other_arena["arena"] = json!(17);
    for v in [&good, &good, &other_arena, &other_arena] {
        SetRecord::from_value_fetching(v, Some(&tables), Some(&mut fetch)).unwrap();
    }
    assert_eq!((fetched, tables.hits()), (2, 2));
}
