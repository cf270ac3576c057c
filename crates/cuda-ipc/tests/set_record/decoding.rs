//! Strict decoding of formats 1 to 3, with errors that name the field.

use cuda_ipc::arena::ArenaId;
use cuda_ipc::descriptor::{Descriptor, Dtype, Source};
use cuda_ipc::set::table::{decode_bytes, encode_bytes};
use cuda_ipc::set::{EntryTables, SetChunk, SetRecord, TableRef};
use serde_json::{Value, json};

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

/// As `refused`, on the record in format 2.
fn refused_v2(edit: impl FnOnce(&mut Value), field: &str, says: &str) {
    let mut v = sample().to_value();
    edit(&mut v);
    match SetRecord::from_value(&v).unwrap_err() {
        cuda_ipc::Error::Descriptor { field: f, reason } => {
            assert_eq!(f, field, "{reason}");
            assert!(reason.contains(says), "{reason}");
        }
        other => panic!("not a field error: {other}"),
    }
}

/// Applies `edit` to the sample's JSON in format 1 (each entry an array,
/// so that one field can be edited) and expects an error naming `field`
/// whose reason contains `says`. The checks after decoding are the same for
/// both formats.
fn refused(edit: impl FnOnce(&mut Value), field: &str, says: &str) {
    let mut v = sample().to_expanded_value();
    edit(&mut v);
    let e = SetRecord::from_value(&v).unwrap_err();
    match &e {
        cuda_ipc::Error::Descriptor { field: f, reason } => {
            assert_eq!(f, field, "{e}");
            assert!(reason.contains(says), "{e}");
        }
        other => panic!("not a field error: {other}"),
    }
    assert!(SetRecord::from_json(&v.to_string()).is_err());
}

/// Entry names may hold any printable text, ASCII or not; a control
/// character of either set (C0 and DEL, which are ASCII, or C1, which is
/// not) is refused with the entry's field named, in both formats.
#[test]
fn entry_names_refuse_every_control_character_and_keep_any_other_text() {
    for bad in [
        "a\nb",
        "tab\there",
        "del\u{7f}",
        "\u{1b}[31m",
        "nel\u{85}x",
        "\u{9f}",
        "é\u{80}",
    ] {
        refused(
            |v| v["entries"][1][0] = json!(bad),
            "entries[1].name",
            "control character",
        );
        refused_v2(
            |v| {
                let mut r = SetRecord::from_value(v).unwrap();
                std::sync::Arc::make_mut(&mut r.entries)[1].name = bad.into();
                // to_value writes what it is given; the decoder checks it.
                *v = r.to_value();
            },
            "entries[1].name",
            "control character",
        );
    }
    for good in [
        "layer.0 weight~",
        "é",
        "层.权重",
        "\u{a0}nbsp",
        "emoji \u{1f600}",
    ] {
        let mut v = sample().to_expanded_value();
        v["entries"][1][0] = json!(good);
        let r = SetRecord::from_value(&v).unwrap_or_else(|e| panic!("{good:?}: {e}"));
        assert_eq!(r.entries[1].name, good);
        let back = SetRecord::from_json(&r.to_json()).unwrap();
        assert_eq!(back.entries[1].name, good);
    }
}

#[test]
fn bad_records_are_refused_with_the_field_named() {
    refused(
        |v| v["cuda_ipc_set"] = json!(4),
        "cuda_ipc_set",
        "set format 4 is not supported",
    );
    refused(|v| v["extra"] = json!(1), "extra", "unknown field");
    refused(
        |v| {
            v.as_object_mut()
                .unwrap()
                .remove("cuda_ipc_set")
                .map(drop)
                .unwrap();
        },
        "cuda_ipc_set",
        "missing",
    );
    refused(|v| v["name"] = json!(""), "name", "empty");
    refused(
        |v| v["name"] = json!("a\u{0}b"),
        "name",
        "control character",
    );
    refused(|v| v["arena"] = json!(0), "arena", "zero");
    refused(|v| v["arena"] = json!(-1), "arena", "negative");
    refused(|v| v["entries"] = json!([]), "entries", "at least one");
    refused(|v| v["chunks"] = json!([]), "chunks", "at least one");
    refused(
        |v| v["entries"][1][0] = json!("layer0.weight"),
        "entries[1].name",
        "another entry",
    );
    refused(
        |v| v["entries"][1][4] = json!(262_140),
        "entries[1].offset",
        "overlap entries[0]",
    );
    refused(
        |v| v["entries"][0][4] = json!(262_144),
        "entries[1].offset",
        "overlap entries[0]",
    );
    refused(
        |v| v["entries"][1][4] = json!(2 * MIB - 4),
        "entries[1].len",
        "passes the end of chunk 0",
    );
    refused(
        |v| v["entries"][1][4] = json!(262_146),
        "entries[1].offset",
        "not aligned",
    );
    refused(
        |v| v["entries"][1][5] = json!(1028),
        "entries[1].len",
        "shape [256] of f32 holds 1024",
    );
    refused(
        |v| v["entries"][1][3] = json!(1),
        "entries[1].chunk",
        "not the id of a chunk",
    );
    refused(
        |v| v["entries"][1][1] = json!("f128"),
        "entries[1].dtype",
        "not one of",
    );
    refused(
        |v| v["entries"][1][2] = json!([1.5]),
        "entries[1].shape[0]",
        "not a whole number",
    );
    refused(
        |v| v["entries"][1][2] = json!(vec![1; 33]),
        "entries[1].shape",
        "dimensions",
    );
    refused(
        |v| v["entries"][1] = json!(["x", "u8"]),
        "entries[1]",
        "2 fields where an entry has 6",
    );
    refused(
        |v| v["entries"][1] = json!({"name": "x"}),
        "entries[1]",
        "expected an array",
    );
}

#[test]
fn bad_chunk_tables_are_refused_with_the_field_named() {
    refused(
        |v| {
            v["chunks"]
                .as_array_mut()
                .unwrap()
                .push(json!({"id": 5, "descriptor": chunk(5, 11, MIB).descriptor.to_value()}));
        },
        "chunks[2]",
        "no entry uses chunk 5",
    );
    refused(
        |v| v["chunks"][1]["id"] = json!(0),
        "chunks[1].id",
        "also chunks[0]",
    );
    refused(
        |v| v["chunks"][1]["descriptor"]["fd"] = json!(7),
        "chunks[1].descriptor",
        "same memory as chunks[0]",
    );
    refused(
        |v| v["chunks"][1]["descriptor"]["pid"] = json!(1),
        "chunks[1].descriptor.pid",
        "one arena",
    );
    refused(
        |v| {
            v["chunks"][1]["descriptor"]["device_uuid"] =
                json!("GPU-00000000-0000-0000-0000-000000000000");
        },
        "chunks[1].descriptor.device_uuid",
        "one arena",
    );
    refused(
        |v| v["chunks"][1]["descriptor"]["event"] = json!("ab".repeat(64)),
        "chunks[1].descriptor.event",
        "set's `event` field",
    );
    refused(
        |v| {
            v["chunks"][1]["descriptor"]["dtype"] = json!("u32");
            v["chunks"][1]["descriptor"]["elem_size"] = json!(4);
        },
        "chunks[1].descriptor.dtype",
        "as bytes",
    );
    refused(
        |v| v["chunks"][1]["descriptor"]["fd"] = json!(-3),
        "chunks[1].descriptor.fd",
        "negative",
    );
    refused(
        |v| v["chunks"][1]["descriptor"]["len"] = json!(0),
        "chunks[1].descriptor.len",
        "greater than zero",
    );
    refused(
        |v| v["chunks"][1]["extra"] = json!(0),
        "chunks[1].extra",
        "unknown field",
    );
    refused(
        |v| v["chunks"][1] = json!(5),
        "chunks[1]",
        "expected an object",
    );
    refused(|v| v["event"] = json!("zz"), "event", "hex");
}

#[test]
fn the_set_event_round_trips_and_reaches_entry_descriptors() {
    let mut v = sample().to_value();
    v["event"] = json!("0f".repeat(64));
    let r = SetRecord::from_value(&v).unwrap();
    assert!(r.event.is_some());
    assert_eq!(r.entry_descriptor(0).unwrap().event, r.event);
    assert_eq!(SetRecord::from_json(&r.to_json()).unwrap(), r);
}

#[test]
fn records_built_by_hand_are_validated() {
    let e = SetRecord::new(
        "w".into(),
        ArenaId(1),
        vec![chunk(0, 3, MIB)],
        vec![entry("a", Dtype::U8, &[MIB + 1], 0, 0)],
    )
    .unwrap_err();
    assert!(e.to_string().contains("entries[0].len"), "{e}");
}

/// A set of 10,000 entries in 8 chunks round-trips, and its encoding stays
/// under the channel's 1 MiB frame payload with names of real models.
#[test]
fn ten_thousand_entries() {
    let chunks: Vec<_> = (0..8).map(|c| chunk(c, 10 + c as i32, 256 * MIB)).collect();
    let entries: Vec<_> = (0..10_000u64)
        .map(|i| {
            let (c, slot) = (i % 8, i / 8);
            entry(
                &format!("model.layers.{}.mlp.w{}", i / 10, i % 10),
                Dtype::F32,
                &[32, 128],
                c,
                slot * 16_384,
            )
        })
        .collect();
    let r = SetRecord::new("llm".into(), ArenaId(99), chunks, entries).unwrap();
    let text = r.to_json();
    assert!(text.len() < 1 << 20, "{} bytes", text.len());
    let back = SetRecord::from_json(&text).unwrap();
    assert_eq!(back.entries.len(), 10_000);
    assert_eq!(back, r);
    // One overlap among 10,000 is found, and named.
    let mut v = r.to_expanded_value();
    v["entries"][9_999][4] = json!(1_248 * 16_384 + 4);
    let e = SetRecord::from_value(&v).map(drop).unwrap_err();
    assert!(e.to_string().contains("entries[9999].offset"), "{e}");
}

// ---------------------------------------------------------------------------
// The publisher's read-only policy

/// `sample()` with its chunks' memory named by `source(n)` instead.
fn sample_of(source: impl Fn(u8) -> Source) -> SetRecord {
    let mut r = sample();
    for (n, c) in r.chunks.iter_mut().enumerate() {
        c.descriptor.source = source(n as u8 + 1);
    }
    r
}

#[test]
fn read_only_is_written_only_when_asked_for_and_read_back() {
    use cuda_ipc::handle::{FabricHandle, IpcMemHandle, PoolPtrHandle};
    let plain = sample();
    assert!(!plain.read_only);
    // Not asked for: not written, so older readers read the record as before.
    assert!(
        !plain.to_json().contains("read_only"),
        "{}",
        plain.to_json()
    );
    assert!(plain.to_expanded_value().get("read_only").is_none());
    let mut r = sample();
    r.read_only = true;
    r.validate().unwrap();
    let text = r.to_json();
    assert!(text.contains(r#""read_only":true"#), "{text}");
    let back = SetRecord::from_json(&text).unwrap();
    assert!(back.read_only);
    assert_eq!(back, r);
    assert_eq!(back.to_json(), text);
    assert_eq!(SetRecord::from_value(&r.to_expanded_value()).unwrap(), r);
    // An old record (no field), an explicit false and null all read as false.
    for value in [None, Some(json!(false)), Some(Value::Null)] {
        let mut v = plain.to_value();
        if let Some(x) = value.clone() {
            v["read_only"] = x;
        }
        let got = SetRecord::from_value(&v).unwrap();
        assert!(!got.read_only, "{value:?}");
        assert_eq!(got, plain);
    }
    // Fabric memory is VMM memory: it can be mapped read-only too.
    let mut fabric = sample_of(|n| Source::Fabric {
        handle: FabricHandle::new([n; 64]),
    });
    fabric.read_only = true;
    fabric.validate().unwrap();
    assert_eq!(SetRecord::from_json(&fabric.to_json()).unwrap(), fabric);
    // Legacy and pool memory cannot be: such a record is refused, naming the field.
    for (mechanism, source) in [
        (
            "legacy",
            Box::new(|n| Source::Legacy {
                handle: IpcMemHandle::new([n; 64]),
            }) as Box<dyn Fn(u8) -> Source>,
        ),
        (
            "pool",
            Box::new(|n| Source::Pool {
                fd: i32::from(n) + 20,
                ptr: PoolPtrHandle::new([n; 64]),
            }),
        ),
    ] {
        let mut r = sample_of(source);
        r.validate().unwrap();
        let mut v = r.to_value();
        v["read_only"] = json!(true);
        let e = SetRecord::from_value(&v).unwrap_err();
        let text = e.to_string();
        assert!(
            matches!(&e, cuda_ipc::Error::Descriptor { field, .. } if field == "read_only"),
            "{text}"
        );
        assert!(text.contains(mechanism) && text.contains("vmm"), "{text}");
        r.read_only = true;
        assert!(r.validate().is_err(), "{mechanism}");
    }
}

#[test]
fn a_read_only_that_is_not_a_boolean_is_refused() {
    for bad in [json!(1), json!("true"), json!([true]), json!({})] {
        refused(
            |v| v["read_only"] = bad.clone(),
            "read_only",
            "expected true or false",
        );
    }
}
