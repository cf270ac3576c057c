//! The set record (`cuda_ipc::set`): strict decoding of formats 1 and 2
//! with errors that name the field, format 2's entry table byte by byte,
//! 10,000 entries, the fuzz corpora of `fuzz/set_record` and
//! `fuzz/set_table` replayed, and property tests (round trip; every
//! mutation decodes to a valid record or fails cleanly).

use std::path::{Path, PathBuf};

use cuda_ipc::arena::ArenaId;
use cuda_ipc::descriptor::{Descriptor, Dtype, Source};
use cuda_ipc::device::DeviceUuid;
use cuda_ipc::set::table::{decode_bytes, encode_bytes};
use cuda_ipc::set::{SetChunk, SetEntry, SetRecord};
use proptest::prelude::*;
use serde_json::{Value, json};

#[path = "../../../fuzz/src/set_record.rs"]
mod fuzz_set_record;

#[path = "../../../fuzz/src/set_table.rs"]
mod fuzz_set_table;

const UUID: DeviceUuid = DeviceUuid([7; 16]);
const MIB: u64 = 1 << 20;

fn chunk(id: u64, fd: i32, len: u64) -> SetChunk {
    SetChunk::new(
        id,
        Descriptor::new(Source::Vmm { fd }, len, UUID, 4242)
            .with_generation(u64::from(fd.unsigned_abs())),
    )
}

fn entry(name: &str, dtype: Dtype, shape: &[u64], chunk: u64, offset: u64) -> SetEntry {
    let len = shape.iter().product::<u64>() * dtype.size();
    SetEntry::new(name.into(), dtype, shape.to_vec(), chunk, offset, len)
}

fn sample() -> SetRecord {
    SetRecord::new(
        "weights".into(),
        ArenaId(0x1234_5678_9abc_def0),
        vec![chunk(0, 7, 2 * MIB), chunk(3, 9, 4 * MIB)],
        vec![
            entry("layer0.weight", Dtype::F32, &[256, 256], 0, 0),
            entry("layer0.bias", Dtype::F32, &[256], 0, 262_144),
            entry("layer1.weight", Dtype::Bf16, &[1024, 1024], 3, 1024),
            entry("step", Dtype::I64, &[], 0, 263_168),
        ],
    )
    .unwrap()
}

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
    for e in &mut r.entries {
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

#[test]
fn bad_records_are_refused_with_the_field_named() {
    refused(
        |v| v["cuda_ipc_set"] = json!(3),
        "cuda_ipc_set",
        "set format 3 is not supported",
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
// The fuzz corpus, replayed

/// Replays every file of `fuzz/corpus/<target>` through `check` (the fuzz
/// target's properties); at least two must be valid (`is_valid`).
fn replay(target: &str, check: fn(&[u8]), is_valid: fn(&[u8]) -> bool) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(
        files.len() >= 5,
        "only {} corpus files in {target}",
        files.len()
    );
    let decoded = files
        .iter()
        .filter(|f| {
            let data = std::fs::read(f).unwrap();
            check(&data);
            is_valid(&data)
        })
        .count();
    assert!(
        decoded >= 2,
        "the seeds of {target} should hold valid inputs"
    );
}

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

// ---------------------------------------------------------------------------
// Properties

fn dtype() -> impl Strategy<Value = Dtype> {
    prop::sample::select(Dtype::ALL.to_vec())
}

/// Valid records: 1-4 chunks, entries placed one after another with gaps.
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
    )
        .prop_map(|(n, items, arena, event)| {
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
            r
        })
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
            "cuda_ipc_set", "name", "arena", "event", "chunks", "entries", "unknown",
            "c.id", "c.descriptor", "c.extra", "d.fd", "d.len", "d.alloc_size", "d.offset", "d.mechanism",
            "d.pid", "d.generation", "d.dtype", "d.shape", "d.event", "d.handle",
        ]),
        value in prop::option::of(any_json()),
    ) {
        let mut v = r.to_value();
        let (target, key) = match path.split_once('.') {
            Some(("c", k)) => (&mut v["chunks"][0], k),
            Some((_, k)) => (&mut v["chunks"][0]["descriptor"], k),
            None => (&mut v, path),
        };
        let obj = target.as_object_mut().unwrap();
        match value {
            Some(x) => { obj.insert(key.to_string(), x); }
            None => { obj.remove(key); }
        }
        decodes_cleanly(&v);
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
