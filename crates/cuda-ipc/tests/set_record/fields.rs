//! Records refused field by field (every error names the field), entry
//! names, records built by hand, ten thousand entries, the set's event and
//! the read-only flag.

use cuda_ipc::arena::ArenaId;
use cuda_ipc::descriptor::{Dtype, Source};
use cuda_ipc::set::SetRecord;
use serde_json::{Value, json};

use super::*;

/// As `refused`, on the record in format 2.
pub(super) fn refused_v2(edit: impl FnOnce(&mut Value), field: &str, says: &str) {
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
pub(super) fn refused(edit: impl FnOnce(&mut Value), field: &str, says: &str) {
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
        handle: FabricHandle::from([n; 64]),
    });
    fabric.read_only = true;
    fabric.validate().unwrap();
    assert_eq!(SetRecord::from_json(&fabric.to_json()).unwrap(), fabric);
    // Legacy and pool memory cannot be: such a record is refused, naming the field.
    for (mechanism, source) in [
        (
            "legacy",
            Box::new(|n| Source::Legacy {
                handle: IpcMemHandle::from([n; 64]),
            }) as Box<dyn Fn(u8) -> Source>,
        ),
        (
            "pool",
            Box::new(|n| Source::Pool {
                fd: i32::from(n) + 20,
                ptr: PoolPtrHandle::from([n; 64]),
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
