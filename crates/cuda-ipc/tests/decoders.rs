//! Robustness of every decoder of untrusted input, without cargo-fuzz.
//!
//! - Every file of the fuzz corpora (`fuzz/corpus/<target>/`) is replayed
//!   through the same checks the fuzz targets run (`fuzz/src/lib.rs`,
//!   `admin_body.rs` and `notice_record.rs`, included here; `shm_ring`'s
//!   corpus is replayed by the `cuda-ipc-shm` crate's `tests/fuzzed.rs`),
//!   so a plain `cargo test` keeps what fuzzing found as regression tests.
//! - Inputs that broke a decoder, found by fuzzing, each as a named test.
//! - Property tests (proptest) that no other test file has: sizes and
//!   32-bit values (`units`), device UUIDs, near-miss handles of every
//!   type, and descriptors with one field replaced by any JSON. The other
//!   decoders have theirs where their module's tests live: descriptors and
//!   handles in `tests/descriptor.rs`, the channel's wire messages in
//!   the `cuda-ipc-channel` crate's unit tests (`src/wire/tests.rs`),
//!   PyTorch share records in `tests/torch.rs`.

use std::path::{Path, PathBuf};

use cuda_ipc::channel::wire::Message;
use cuda_ipc::descriptor::{Descriptor, Dtype, Source};
use cuda_ipc::device::DeviceUuid;
use cuda_ipc::handle::{FabricHandle, HANDLE_LEN, IpcEventHandle, IpcMemHandle, PoolPtrHandle};
use cuda_ipc::units::{ByteSize, parse_u32};
use proptest::prelude::*;
use serde_json::{Value, json};

#[path = "support/corpus.rs"]
mod corpus;
#[path = "../../../fuzz/src/admin_body.rs"]
mod fuzz_admin_body;
#[path = "../../../fuzz/src/catalog_image.rs"]
mod fuzz_catalog_image;
#[path = "../../../fuzz/src/lib.rs"]
mod fuzz_checks;
#[path = "../../../fuzz/src/notice_record.rs"]
mod fuzz_notice_record;
#[path = "../../../fuzz/src/readers_book.rs"]
mod fuzz_readers_book;

// ---------------------------------------------------------------------------
// The fuzz corpora, replayed

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus")
}

#[test]
fn every_fuzz_corpus_file_passes_its_checks() {
    let mut failures = Vec::new();
    let mut total = 0;
    for (target, check) in fuzz_checks::TARGETS {
        let dir = corpus_dir().join(target);
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("cannot read the corpus {}: {e}", dir.display()))
            .map(|entry| entry.unwrap().path())
            .filter(|p| p.is_file())
            .collect();
        files.sort();
        assert!(
            files.len() >= 5,
            "the corpus of {target} has only {} files",
            files.len()
        );
        for file in files {
            // A fuzzer running on the corpus replaces files as it shrinks them.
            let Ok(data) = std::fs::read(&file) else {
                continue;
            };
            total += 1;
            if let Err(panic) = std::panic::catch_unwind(|| check(&data)) {
                let why = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_default();
                failures.push(format!("{target}: {}: {why}", file.display()));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {total} corpus files failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    println!("replayed {total} corpus files");
}

/// `fuzz/notice_record`: the records of the channel's shared-memory rings,
/// read by the client's decoder and by the server's ack reader (its fast
/// path), which must agree.
#[test]
fn the_notice_record_corpus_passes_its_checks() {
    corpus::replay(
        "notice_record",
        fuzz_notice_record::notice_record,
        fuzz_notice_record::is_valid,
    );
}

/// `fuzz/admin_body`: every admin method's request and answer bodies.
#[test]
fn the_admin_body_corpus_passes_its_checks() {
    corpus::replay(
        "admin_body",
        fuzz_admin_body::admin_body,
        fuzz_admin_body::is_valid,
    );
}

/// `fuzz/catalog_image`: the catalog image a restarted service reads back.
#[test]
fn the_catalog_image_corpus_passes_its_checks() {
    corpus::replay(
        "catalog_image",
        fuzz_catalog_image::catalog_image,
        fuzz_catalog_image::is_valid,
    );
}

/// `fuzz/readers_book`: the readers' book a restarted service reads back.
#[test]
fn the_readers_book_corpus_passes_its_checks() {
    corpus::replay(
        "readers_book",
        fuzz_readers_book::readers_book,
        fuzz_readers_book::is_valid,
    );
}

// ---------------------------------------------------------------------------
// What fuzzing found

/// `fuzz/frame_message`: serde_json without `float_roundtrip` reads many
/// floats one unit in the last place off, so a float in a `meta` or a
/// `notice` changed between producer and consumer.
#[test]
fn floats_in_messages_survive_the_wire_exactly() {
    for x in [
        9.999_999_999_999_999e41,
        1e42,
        1.071_566_039_146_582_6e-75,
        0.1,
        f64::MAX,
        f64::MIN_POSITIVE,
        5e-324,
        -0.0,
    ] {
        let m = Message::RingFrame {
            lease: 1,
            slot: 0,
            seq: 1,
            notice: json!({ "scale": x }),
        };
        let back = Message::decode(&m.encode()).unwrap();
        assert_eq!(back, m, "{x:e}");
        let Message::RingFrame { notice, .. } = back else {
            unreachable!()
        };
        assert_eq!(notice["scale"].as_f64().unwrap().to_bits(), x.to_bits());
    }
    // The input the fuzzer found: 43 nines.
    let text = format!(
        r#"{{"type":"ring_frame","lease":1,"slot":0,"seq":1,"notice":{}}}"#,
        "9".repeat(43)
    );
    let m = Message::decode(text.as_bytes()).unwrap();
    assert_eq!(Message::decode(&m.encode()).unwrap(), m);
}

/// `fuzz/cli_size`: `parse_u32` took a leading `+` (Rust's integer parsers
/// do), and `ByteSize` took one after `0x`, although neither accepts signs.
#[test]
fn signs_are_refused_in_sizes_and_values() {
    for text in ["+1", "+0x10", "0x+10", " +7 ", "0X+ff"] {
        let e = parse_u32(text).unwrap_err().to_string();
        assert!(e.contains("32-bit unsigned value"), "{text:?}: {e}");
    }
    for text in ["+1", "0x+10", "0X+ff", "+1MiB"] {
        let e = text.parse::<ByteSize>().unwrap_err().to_string();
        assert!(e.contains("expected a whole number"), "{text:?}: {e}");
    }
    assert_eq!(parse_u32(" 0x10 ").unwrap(), 16);
    assert_eq!(parse_u32("42").unwrap(), 42);
    assert_eq!("0x10".parse::<ByteSize>().unwrap(), ByteSize(16));
}

/// A descriptor that names a key twice was read as its last value
/// (serde_json's way), although decoding is strict: two readers of one
/// document could disagree on what it says. Now an error names the key, at
/// any depth, in descriptors and PyTorch share records alike.
#[test]
fn duplicate_keys_are_refused() {
    let good = sample_descriptor().to_json();
    let twice = good.replacen('{', "{\"offset\":0,", 1);
    let e = Descriptor::from_json(&twice).unwrap_err().to_string();
    assert!(e.contains("\"offset\" appears twice"), "{e}");
    let nested = good.replacen("\"shape\":[", "\"shape\":[{\"a\":1,\"a\":2},", 1);
    assert!(
        Descriptor::from_json(&nested)
            .unwrap_err()
            .to_string()
            .contains("appears twice")
    );
    let e = serde_json::from_str::<Descriptor>(&twice)
        .unwrap_err()
        .to_string();
    assert!(e.contains("appears twice"), "{e}");
    let e = cuda_ipc::torch::ShareRecord::from_json(r#"{"a":1,"a":1}"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("appears twice"), "{e}");
    assert_eq!(Descriptor::from_json(&good).unwrap().to_json(), good);
}

/// `alloc_size` 2^64 was "not a whole number" (serde_json reads a whole
/// number past u64 as a float); it is too large, and the error says so.
#[test]
fn whole_numbers_past_u64_are_too_large() {
    let good = sample_descriptor().to_value();
    for (n, why) in [
        ("18446744073709551616", "too large"),
        ("99999999999999999999999", "too large"),
        ("-1", "negative"),
        ("1.5", "not a whole number"),
    ] {
        let mut v = good.clone();
        v["alloc_size"] = serde_json::from_str(n).unwrap();
        let e = Descriptor::from_json(&v.to_string())
            .unwrap_err()
            .to_string();
        assert!(e.contains("alloc_size") && e.contains(why), "{n}: {e}");
    }
}

fn sample_descriptor() -> Descriptor {
    let mut v = json!({
        "cuda_ipc": 1,
        "mechanism": "legacy",
        "handle": "ab".repeat(64),
        "alloc_size": 4096,
        "offset": 0,
        "len": 16,
        "dtype": "u32",
        "device_uuid": "GPU-00000000-0000-0000-0000-000000000000",
        "pid": 1
    });
    v["shape"] = json!([4]);
    Descriptor::from_value(&v).unwrap()
}

// ---------------------------------------------------------------------------
// Properties: descriptors

fn arb_handle() -> impl Strategy<Value = [u8; HANDLE_LEN]> {
    prop::collection::vec(any::<u8>(), HANDLE_LEN)
        .prop_map(|v| v.try_into().expect("the strategy makes 64 bytes"))
}

fn arb_source() -> impl Strategy<Value = Source> {
    prop_oneof![
        arb_handle().prop_map(|h| Source::Legacy {
            handle: IpcMemHandle::from(h)
        }),
        (0..=i32::MAX).prop_map(|fd| Source::Vmm { fd }),
        ((0..=i32::MAX), arb_handle()).prop_map(|(fd, h)| Source::Pool {
            fd,
            ptr: PoolPtrHandle::from(h)
        }),
        arb_handle().prop_map(|h| Source::Fabric {
            handle: FabricHandle::from(h)
        }),
    ]
}

/// Valid descriptors: any mechanism, element type and placement, with no
/// shape, a 1- or 2-dimensional shape, or a strided view.
fn arb_descriptor() -> impl Strategy<Value = Descriptor> {
    (
        arb_source(),
        prop::sample::select(Dtype::ALL.to_vec()),
        1u64..1 << 20,
        0u64..1 << 20,
        0u64..1 << 20,
        0usize..4,
        prop::array::uniform16(any::<u8>()),
        1u32..,
        prop::option::of(arb_handle()),
        prop::option::of(any::<u64>()),
    )
        .prop_map(
            |(source, dtype, count, offset, slack, layout, uuid, pid, event, generation)| {
                let elem = dtype.size();
                let len = count * elem;
                let offset = offset * elem;
                let (shape, strides) = match layout {
                    0 => (None, None),
                    1 => (Some(vec![count]), None),
                    // A column: every second element of `count` (at least one).
                    2 => (Some(vec![count.div_ceil(2), 1]), Some(vec![2, 1])),
                    _ => (Some(vec![1, count]), None),
                };
                let mut d = Descriptor::new(source, offset + len + slack, DeviceUuid(uuid), pid)
                    .with_range(offset, len)
                    .with_dtype(dtype);
                d.shape = shape;
                d.strides = strides;
                d.event = event.map(IpcEventHandle::from);
                d.generation = generation;
                d
            },
        )
}

fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        ".{0,20}".prop_map(Value::from),
        "[0-9a-f]{126,130}".prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            prop::collection::btree_map("[a-z_]{1,12}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

const DESCRIPTOR_KEYS: &[&str] = &[
    "cuda_ipc",
    "mechanism",
    "handle",
    "fd",
    "alloc_size",
    "offset",
    "len",
    "dtype",
    "elem_size",
    "shape",
    "strides",
    "device_uuid",
    "pid",
    "event",
    "generation",
    "unknown",
];

proptest! {
    /// One field of a valid descriptor replaced by any JSON (or removed):
    /// an error that names a field, or a descriptor that round-trips.
    #[test]
    fn mutated_descriptors_are_refused_or_round_trip(
        d in arb_descriptor(),
        key in prop::sample::select(DESCRIPTOR_KEYS),
        junk in prop::option::of(arb_json()),
    ) {
        let mut v = d.to_value();
        let map = v.as_object_mut().unwrap();
        match junk {
            Some(j) => { map.insert(key.to_owned(), j); }
            None => { map.remove(key); }
        }
        let text = v.to_string();
        match Descriptor::from_value(&v) {
            Ok(_) => fuzz_checks::descriptor(text.as_bytes()),
            Err(e) => {
                let shown = e.to_string();
                prop_assert!(!shown.is_empty());
                prop_assert!(matches!(e, cuda_ipc::Error::Descriptor { .. }), "{}", shown);
            }
        }
    }
}

proptest! {
    /// Any valid descriptor with any one of its keys written a second time
    /// (with any JSON) is refused, naming the key.
    #[test]
    fn a_repeated_key_is_always_refused(
        d in arb_descriptor(),
        pick in any::<prop::sample::Index>(),
        junk in arb_json(),
    ) {
        let v = d.to_value();
        let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
        let key = keys[pick.index(keys.len())];
        let text = v.to_string();
        let extra = format!("{{{}:{},", Value::from(key.as_str()), junk);
        let twice = text.replacen('{', &extra, 1);
        let e = Descriptor::from_json(&twice).unwrap_err().to_string();
        prop_assert!(e.contains("appears twice"), "{}", e);
        prop_assert!(Descriptor::from_json(&text).is_ok());
    }
}

// ---------------------------------------------------------------------------
// Properties: handles and device UUIDs

proptest! {
    #[test]
    fn handle_parsers_never_panic(text in ".{0,140}", bytes in prop::collection::vec(any::<u8>(), 0..140)) {
        fuzz_checks::hex_handle(text.as_bytes());
        fuzz_checks::hex_handle(&bytes);
    }

    /// A handle's hex with one character changed, added or removed.
    #[test]
    fn near_handles_are_refused(bytes in arb_handle(), at in 0usize..128, c in any::<char>(), op in 0u8..3) {
        let mut hex: Vec<char> = IpcMemHandle::from(bytes).to_string().chars().collect();
        match op {
            0 => hex[at] = c,
            1 => hex.insert(at, c),
            _ => { hex.remove(at); }
        }
        let text: String = hex.into_iter().collect();
        let ok = op == 0 && c.is_ascii_hexdigit();
        prop_assert_eq!(text.parse::<IpcMemHandle>().is_ok(), ok, "{}", text);
        fuzz_checks::hex_handle(text.as_bytes());
    }

    #[test]
    fn device_uuids_print_and_parse_back(bytes in prop::array::uniform16(any::<u8>())) {
        let u = DeviceUuid(bytes);
        let text = u.to_string();
        prop_assert_eq!(text.parse::<DeviceUuid>().unwrap(), u);
        fuzz_checks::hex_handle(text.as_bytes());
    }
}

// ---------------------------------------------------------------------------
// Properties: sizes and 32-bit values

proptest! {
    #[test]
    fn sizes_print_and_parse_back(n in any::<u64>(), shift in 0u32..50) {
        for size in [ByteSize(n), ByteSize(n >> shift << shift)] {
            let shown = size.to_string();
            prop_assert_eq!(shown.parse::<ByteSize>().unwrap(), size, "{}", shown);
            prop_assert_eq!(format!("{:#x}", size.0).parse::<ByteSize>().unwrap(), size);
            fuzz_checks::cli_size(shown.as_bytes());
        }
    }

    #[test]
    fn values_print_and_parse_back(v in any::<u32>()) {
        prop_assert_eq!(parse_u32(&v.to_string()).unwrap(), v);
        prop_assert_eq!(parse_u32(&format!("{v:#x}")).unwrap(), v);
        prop_assert_eq!(parse_u32(&format!("{v:#X}").replacen("0X", "0x", 1)).unwrap(), v);
    }

    #[test]
    fn size_parsers_never_panic(text in "[ +\\-0-9xXa-zA-Z.]{0,24}|.{0,24}") {
        fuzz_checks::cli_size(text.as_bytes());
    }
}
