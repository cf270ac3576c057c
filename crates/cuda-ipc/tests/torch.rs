//! PyTorch share records: decoding, storage handles and conversion to
//! descriptors, on recorded examples (no GPU needed).
//!
//! `tests/data/torch/cases.json` is shared with the Python package's tests
//! (`python/tests/test_torch_records.py`): both converters must agree on
//! every case. It is written by `python/tests/make_torch_fixtures.py`.

use cuda_ipc::descriptor::{Descriptor, Dtype, Source};
use cuda_ipc::device::DeviceUuid;
use cuda_ipc::error::{Error, ErrorKind};
use cuda_ipc::handle::{FabricHandle, Handle, IpcEventHandle, IpcMemHandle};
use cuda_ipc::torch::{
    self, ExpandableSegment, SegmentHandles, ShareRecord, StorageHandle, dtype_from_torch,
    torch_dtype_name,
};
use proptest::prelude::*;
use serde_json::{Value, json};

const CASES: &str = include_str!("data/torch/cases.json");

const MIB: u64 = 1 << 20;

fn cases() -> Vec<Value> {
    let doc: Value = serde_json::from_str(CASES).expect("cases.json is valid JSON");
    doc["cases"].as_array().expect("a cases array").clone()
}

fn convert(record: &Value) -> Result<Descriptor, Error> {
    ShareRecord::from_value(record)?.to_descriptor()
}

#[test]
fn recorded_cases_convert_as_expected() {
    let cases = cases();
    assert!(cases.len() > 50, "only {} cases", cases.len());
    let mut failures = Vec::new();
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let got = convert(&case["record"]);
        match (case.get("descriptor"), case.get("error"), got) {
            (Some(expected), None, Ok(d)) => {
                if d.to_value() != *expected {
                    failures.push(format!("{name}: got {}, expected {expected}", d.to_value()));
                }
                // What we produce is a valid descriptor for every reader.
                let again = Descriptor::from_json(&d.to_json()).unwrap();
                assert_eq!(again, d, "{name}");
            }
            (Some(_), None, Err(e)) => failures.push(format!("{name}: unexpected error: {e}")),
            (None, Some(want), Ok(d)) => {
                failures.push(format!("{name}: expected an error with {want}, got {d}"));
            }
            (None, Some(want), Err(e)) => {
                let text = e.to_string();
                if !text.contains(want.as_str().unwrap()) {
                    failures.push(format!("{name}: error {text:?} lacks {want}"));
                }
                if e.kind() != ErrorKind::InvalidInput {
                    failures.push(format!("{name}: error kind {:?}", e.kind()));
                }
            }
            _ => failures.push(format!("{name}: a case needs a descriptor or an error")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn records_round_trip_through_json() {
    for case in cases() {
        let Ok(r) = ShareRecord::from_value(&case["record"]) else {
            continue;
        };
        let text = r.to_json();
        assert_eq!(ShareRecord::from_json(&text).unwrap(), r);
        let via_serde: ShareRecord = serde_json::from_str(&text).unwrap();
        assert_eq!(via_serde, r);
        assert_eq!(text.parse::<ShareRecord>().unwrap(), r);
    }
}

/// Records written by a real PyTorch on a GPU host (see
/// `tests/data/torch/recorded/README.md`); none may be present.
#[test]
fn recorded_pytorch_records_decode_and_convert() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/torch/recorded");
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut seen = 0;
    for entry in entries {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("json") {
            continue;
        }
        seen += 1;
        let name = path.display().to_string();
        let doc: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let record =
            ShareRecord::from_value(&doc["record"]).unwrap_or_else(|e| panic!("{name}: {e}"));
        let handle = record
            .parse_storage_handle()
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(
            Value::from(handle.version()),
            doc["handle_version"],
            "{name}"
        );
        assert_eq!(
            Value::from((handle.type_byte() as char).to_string()),
            doc["handle_type"],
            "{name}"
        );
        let expect = doc["expect"].as_str().unwrap();
        match record.to_descriptor() {
            Ok(d) => assert_eq!(d.mechanism().name(), expect, "{name}"),
            Err(e) => {
                assert_eq!(expect, "segments", "{name}: {e}");
                assert!(e.to_string().contains("import_segments"), "{name}: {e}");
                record.tensor_layout().unwrap();
            }
        }
    }
    println!("{seen} recorded PyTorch share record(s) checked");
}

fn mem_handle() -> IpcMemHandle {
    let mut b = [0u8; 64];
    for (i, x) in b.iter_mut().enumerate() {
        *x = (i as u8).wrapping_mul(13).wrapping_add(1);
    }
    IpcMemHandle::from(b)
}

fn segment_bytes(version: u8, fds: &[i32]) -> Vec<u8> {
    let mut v = vec![version, b'e'];
    v.extend_from_slice(&4242i32.to_le_bytes());
    v.extend_from_slice(&[0; 4]);
    v.extend_from_slice(&(2 * MIB).to_le_bytes());
    v.extend_from_slice(&(fds.len() as u64).to_le_bytes());
    if version >= 3 {
        v.extend_from_slice(&1i32.to_le_bytes());
        v.extend_from_slice(&[0; 4]);
    }
    for fd in fds {
        v.extend_from_slice(&fd.to_le_bytes());
    }
    v
}

#[test]
fn cuda_malloc_handles_of_both_versions() {
    for version in [2u8, 3] {
        let mut bytes = vec![version, b'c'];
        bytes.extend_from_slice(mem_handle().as_bytes());
        assert_eq!(bytes.len(), 66);
        let h = StorageHandle::parse(&bytes).unwrap();
        assert_eq!(
            h,
            StorageHandle::CudaMalloc {
                version,
                handle: mem_handle()
            }
        );
        assert_eq!(h.version(), version);
        assert_eq!(h.type_byte(), b'c');
        assert_eq!(h.to_bytes(), bytes);
    }
}

#[test]
fn expandable_segment_payload_is_parsed_fully() {
    // 66 bytes, like a 'c' handle: 2 + 24 + 10 descriptors of 4 bytes.
    let fds: Vec<i32> = (30..40).collect();
    let bytes = segment_bytes(2, &fds);
    assert_eq!(bytes.len(), 66);
    let h = StorageHandle::parse(&bytes).unwrap();
    let StorageHandle::Expandable { version, segment } = &h else {
        panic!("{h:?}")
    };
    assert_eq!(*version, 2);
    assert_eq!(segment.pid, 4242);
    assert_eq!(segment.segment_size, 2 * MIB);
    assert_eq!(segment.num_segments(), 10);
    assert_eq!(segment.fds(), Some(&fds[..]));
    assert_eq!(segment.mapped_size().unwrap(), 20 * MIB);
    assert_eq!(h.to_bytes(), bytes);

    let v3 = segment_bytes(3, &[7, 8]);
    assert_eq!(v3.len(), 2 + 32 + 8);
    let h3 = StorageHandle::parse(&v3).unwrap();
    assert_eq!(
        h3,
        StorageHandle::Expandable {
            version: 3,
            segment: ExpandableSegment {
                pid: 4242,
                segment_size: 2 * MIB,
                handles: SegmentHandles::PosixFds(vec![7, 8]),
            }
        }
    );
    assert_eq!(h3.to_bytes(), v3);
}

#[test]
fn version_3_segment_in_the_version_2_layout_is_read_too() {
    // Should PyTorch 2.13 keep the 24-byte header, the length says so.
    let mut bytes = segment_bytes(2, &[11]);
    bytes[0] = 3;
    let h = StorageHandle::parse(&bytes).unwrap();
    let StorageHandle::Expandable { segment, .. } = h else {
        panic!()
    };
    assert_eq!(segment.fds(), Some(&[11][..]));
}

#[test]
fn fabric_segments_are_told_apart_by_length() {
    let fabric = FabricHandle::from([9; 64]);
    let seg = StorageHandle::Expandable {
        version: 2,
        segment: ExpandableSegment {
            pid: 99,
            segment_size: 20 * MIB,
            handles: SegmentHandles::Fabric(vec![fabric, fabric, fabric]),
        },
    };
    let bytes = seg.to_bytes();
    assert_eq!(bytes.len(), 2 + 24 + 3 * 64);
    assert_eq!(StorageHandle::parse(&bytes).unwrap(), seg);
    let SegmentHandles::Fabric(hs) = (match StorageHandle::parse(&bytes).unwrap() {
        StorageHandle::Expandable { segment, .. } => segment.handles,
        _ => panic!("not an expandable segment"),
    }) else {
        panic!()
    };
    assert_eq!(hs.len(), 3);
}

#[test]
fn bad_versions_and_types_name_what_was_found() {
    let mut bytes = vec![3u8, b'q'];
    bytes.extend_from_slice(&[1; 64]);
    let text = StorageHandle::parse(&bytes).unwrap_err().to_string();
    assert!(
        text.contains("version 3") && text.contains("0x71 ('q')"),
        "{text}"
    );
    bytes[0] = 9;
    let text = StorageHandle::parse(&bytes).unwrap_err().to_string();
    assert!(
        text.contains("version 9") && text.contains("0x71 ('q')"),
        "{text}"
    );
    bytes[0] = 2;
    bytes[1] = 0;
    let text = StorageHandle::parse(&bytes).unwrap_err().to_string();
    assert!(text.contains("type byte 0x00"), "{text}");
    for short in [&[][..], &[2u8][..]] {
        let text = StorageHandle::parse(short).unwrap_err().to_string();
        assert!(text.contains("version byte and a type byte"), "{text}");
    }
}

#[test]
fn dtype_names_map_both_ways() {
    let expected = [
        ("float32", Dtype::F32),
        ("float16", Dtype::F16),
        ("bfloat16", Dtype::Bf16),
        ("float64", Dtype::F64),
        ("int8", Dtype::I8),
        ("uint8", Dtype::U8),
        ("int16", Dtype::I16),
        ("int32", Dtype::I32),
        ("int64", Dtype::I64),
        ("bool", Dtype::Bool),
        ("uint16", Dtype::U16),
        ("uint32", Dtype::U32),
        ("uint64", Dtype::U64),
        ("float8_e4m3fn", Dtype::F8E4m3fn),
        ("float8_e5m2", Dtype::F8E5m2),
        ("float8_e4m3fnuz", Dtype::F8E4m3fnuz),
        ("float8_e5m2fnuz", Dtype::F8E5m2fnuz),
        ("float8_e8m0fnu", Dtype::F8E8m0fnu),
        ("float4_e2m1fn_x2", Dtype::F4E2m1fnX2),
        ("complex64", Dtype::C64),
        ("complex128", Dtype::C128),
    ];
    assert_eq!(expected.len(), Dtype::ALL.len());
    for (name, d) in expected {
        assert_eq!(dtype_from_torch(name).unwrap(), d);
        assert_eq!(torch_dtype_name(d), name);
    }
    for bad in ["complex32", "uint4", "int1", "qint8", "", "Float32", "f32"] {
        let e = dtype_from_torch(bad).unwrap_err();
        assert!(matches!(e, Error::Torch(_)), "{bad}");
        let text = e.to_string();
        assert!(text.contains(&format!("{bad:?}")), "names the type: {text}");
        assert!(
            text.contains("bfloat16, float32"),
            "lists what works: {text}"
        );
        assert!(text.contains("float8_e4m3fn"), "lists what works: {text}");
        assert!(
            text.contains("view the tensor as uint8 first (t.view(torch.uint8))"),
            "says what to do: {text}"
        );
    }
    let e = dtype_from_torch("torch.float8_e5m2")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(r#"write "float8_e5m2", without the torch. prefix"#),
        "{e}"
    );
}

fn uuid() -> DeviceUuid {
    "GPU-5e2c7a1f-03b4-4c6d-9e8f-0a1b2c3d4e5f".parse().unwrap()
}

fn base_record(handle: Vec<u8>) -> ShareRecord {
    ShareRecord::new(handle, 4096, Dtype::F32, uuid(), 4242)
}

fn c_bytes() -> Vec<u8> {
    let mut v = vec![2u8, b'c'];
    v.extend_from_slice(mem_handle().as_bytes());
    v
}

#[test]
fn several_segments_give_a_layout_but_no_descriptor() {
    let mut r = base_record(segment_bytes(2, &[20, 21]));
    r.storage_offset_bytes = 2 * MIB - 1024; // straddles the two segments
    let err = r.to_descriptor().unwrap_err().to_string();
    assert!(err.contains("import_segments"), "{err}");
    let layout = r.tensor_layout().unwrap();
    assert_eq!(layout.offset, 2 * MIB - 1024);
    assert_eq!(layout.byte_len, 4096);
    assert_eq!(layout.strides, None);
    let StorageHandle::Expandable { segment, .. } = r.parse_storage_handle().unwrap() else {
        panic!()
    };
    assert!(layout.offset + layout.byte_len <= segment.mapped_size().unwrap());
}

#[test]
fn event_is_carried_only_when_required() {
    let mut r = base_record(c_bytes());
    let ev = IpcEventHandle::from([5; 64]);
    r.event_handle = Some(ev);
    assert_eq!(r.to_descriptor().unwrap().event, None);
    r.event_sync_required = true;
    assert_eq!(r.to_descriptor().unwrap().event, Some(ev));
}

#[test]
fn legacy_descriptor_fields() {
    let mut r = base_record(c_bytes());
    r.storage_offset_bytes = 4096;
    r.tensor_offset = 10;
    r.tensor_size = vec![100];
    r.alloc_size = Some(2 * MIB);
    let d = r.to_descriptor().unwrap();
    assert_eq!(
        d.source,
        Source::Legacy {
            handle: mem_handle()
        }
    );
    assert_eq!(d.offset, 4096 + 40);
    assert_eq!(d.byte_len, 400);
    assert_eq!(d.alloc_size, 2 * MIB);
    assert_eq!(d.shape, Some(vec![100]));
    assert_eq!(d.strides, None);
    assert_eq!(d.pid, 4242);
    assert_eq!(d.device_uuid, uuid());
}

#[test]
fn errors_are_torch_errors_with_the_prefix() {
    let e = ShareRecord::from_json("{").unwrap_err();
    assert!(matches!(e, Error::Torch(_)));
    assert!(e.to_string().starts_with("PyTorch share record: "), "{e}");
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
}

#[test]
fn record_key_marks_a_record() {
    let v = json!({ torch::RECORD_KEY: 1 });
    let text = ShareRecord::from_value(&v).unwrap_err().to_string();
    assert!(text.contains("missing"), "{text}");
}

// --- properties -----------------------------------------------------------

fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        "[0-9a-fg-z]{0,140}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(
                prop_oneof![
                    Just("storage_handle".to_string()),
                    Just("tensor_size".to_string()),
                    Just("tensor_stride".to_string()),
                    Just("dtype".to_string()),
                    "[a-z_]{1,12}"
                ],
                inner,
                0..6
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A valid record: a (possibly permuted, possibly sliced) view of a
/// contiguous tensor.
fn valid_record() -> impl Strategy<Value = ShareRecord> {
    (
        prop::collection::vec(1u64..6, 0..5),
        any::<prop::sample::Index>(),
        0u64..50,
        0u64..64,
        0u64..256,
        prop::sample::select(Dtype::ALL.to_vec()),
        prop_oneof![
            (prop::sample::select(vec![2u8, 3]), any::<[u8; 32]>()).prop_map(|(v, seed)| {
                let mut b = vec![v, b'c'];
                b.extend_from_slice(&seed);
                b.extend_from_slice(&seed);
                b[2] |= 1; // never all zero
                b
            }),
            (prop::sample::select(vec![2u8, 3]), 0i32..1000).prop_map(|(v, fd)| {
                let mut b = segment_bytes(v, &[fd]);
                // A 20 MiB segment, so that every generated tensor fits.
                b[10..18].copy_from_slice(&(20 * MIB).to_le_bytes());
                b
            }),
        ],
        (any::<bool>(), any::<[u8; 64]>()),
    )
        .prop_map(
            |(shape, perm, tensor_offset, slack, storage_off_elems, dtype, handle, (ev, evb))| {
                let elem = dtype.size();
                let rm: Vec<u64> = {
                    let mut s = vec![0u64; shape.len()];
                    let mut acc = 1;
                    for i in (0..shape.len()).rev() {
                        s[i] = acc;
                        acc *= shape[i];
                    }
                    s
                };
                // Rotate the dimensions to get a transposed view.
                let n = shape.len();
                let k = if n == 0 { 0 } else { perm.index(n) };
                let size: Vec<u64> = (0..n).map(|i| shape[(i + k) % n]).collect();
                let stride: Vec<i64> = (0..n).map(|i| rm[(i + k) % n] as i64).collect();
                let numel: u64 = shape.iter().product();
                let mut r = ShareRecord::new(
                    handle,
                    (tensor_offset + numel + slack) * elem,
                    dtype,
                    uuid(),
                    4242,
                );
                r.storage_offset_bytes = storage_off_elems * elem;
                r.tensor_size = size;
                r.tensor_stride = stride;
                r.tensor_offset = tensor_offset;
                r.requires_grad = ev;
                r.ref_counter_handle = Some(b"/torch_4242_1_0".to_vec());
                r.ref_counter_offset = Some(2);
                r.event_handle = Some(IpcEventHandle::from(evb));
                r.event_sync_required = ev;
                r
            },
        )
}

proptest! {
    #[test]
    fn storage_handle_parser_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..400)) {
        let _ = StorageHandle::parse(&bytes);
    }

    #[test]
    fn storage_handle_parser_never_panics_on_plausible_prefixes(
        version in prop::sample::select(vec![1u8, 2, 3, 4]),
        kind in prop::sample::select(vec![b'c', b'e', b'x']),
        rest in prop::collection::vec(any::<u8>(), 0..200),
    ) {
        let mut bytes = vec![version, kind];
        bytes.extend_from_slice(&rest);
        if let Ok(h) = StorageHandle::parse(&bytes) {
            // Whatever parses re-encodes to bytes that parse the same
            // (padding, which is not checked, comes back as zeros).
            let again = StorageHandle::parse(&h.to_bytes()).unwrap();
            prop_assert_eq!(again, h);
        }
    }

    #[test]
    fn record_decoder_never_panics(text in ".{0,300}") {
        let _ = ShareRecord::from_json(&text);
    }

    #[test]
    fn record_decoder_never_panics_on_json(v in any_json()) {
        if let Ok(r) = ShareRecord::from_value(&v) {
            let _ = r.to_descriptor();
        }
    }

    #[test]
    fn valid_records_round_trip_and_convert(r in valid_record()) {
        let back = ShareRecord::from_json(&r.to_json()).unwrap();
        prop_assert_eq!(&back, &r);
        let d = r.to_descriptor().unwrap();
        let elem = r.dtype.size();
        prop_assert_eq!(d.offset, r.storage_offset_bytes + r.tensor_offset * elem);
        prop_assert_eq!(d.byte_len, r.tensor_size.iter().product::<u64>() * elem);
        prop_assert_eq!(d.shape.as_deref(), Some(&r.tensor_size[..]));
        prop_assert_eq!(d.dtype, r.dtype);
        prop_assert_eq!(d.event.is_some(), r.event_sync_required);
        if let Some(strides) = &d.strides {
            let given: Vec<u64> = r.tensor_stride.iter().map(|s| *s as u64).collect();
            prop_assert_eq!(strides, &given);
        }
        prop_assert_eq!(Descriptor::from_json(&d.to_json()).unwrap(), d);
    }

    #[test]
    fn mutated_valid_records_never_panic(r in valid_record(), key in 0usize..17, junk in any_json()) {
        let mut v = r.to_value();
        let keys: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        let k = keys[key % keys.len()].clone();
        v.as_object_mut().unwrap().insert(k, junk);
        if let Ok(r) = ShareRecord::from_value(&v) {
            let _ = r.to_descriptor();
        }
    }
}
