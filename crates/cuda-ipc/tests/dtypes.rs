//! Every element type a checkpoint carries (`descriptor::Dtype`): the
//! table (names, sizes, raw integer types, PyTorch names), descriptors and
//! set records of each type round-tripped (set records in format 1 and in
//! format 2's binary table), records of the types an older build wrote
//! still read, and unknown names refused with the known ones listed.

use cuda_ipc::arena::ArenaId;
use cuda_ipc::descriptor::{Descriptor, Dtype, Source};
use cuda_ipc::device::DeviceUuid;
use cuda_ipc::set::table::{decode_bytes, encode_bytes};
use cuda_ipc::set::{SetChunk, SetEntry, SetRecord};
use cuda_ipc::torch::{dtype_from_torch, torch_dtype_name};
use serde_json::Value;

const UUID: DeviceUuid = DeviceUuid([7; 16]);
const MIB: u64 = 1 << 20;

/// The types added for checkpoints: (type, descriptor name, bytes, PyTorch name).
const CHECKPOINT_TYPES: [(Dtype, &str, u64, &str); 8] = [
    (Dtype::F8E4m3fn, "f8e4m3fn", 1, "float8_e4m3fn"),
    (Dtype::F8E5m2, "f8e5m2", 1, "float8_e5m2"),
    (Dtype::F8E4m3fnuz, "f8e4m3fnuz", 1, "float8_e4m3fnuz"),
    (Dtype::F8E5m2fnuz, "f8e5m2fnuz", 1, "float8_e5m2fnuz"),
    (Dtype::F8E8m0fnu, "f8e8m0fnu", 1, "float8_e8m0fnu"),
    (Dtype::F4E2m1fnX2, "f4e2m1fnx2", 1, "float4_e2m1fn_x2"),
    (Dtype::C64, "c64", 8, "complex64"),
    (Dtype::C128, "c128", 16, "complex128"),
];

#[test]
fn the_checkpoint_types_have_their_names_and_sizes() {
    for (d, name, size, torch) in CHECKPOINT_TYPES {
        assert_eq!(d.name(), name);
        assert_eq!(d.to_string(), name);
        assert_eq!(name.parse::<Dtype>().unwrap(), d);
        assert_eq!(d.size(), size, "{name}");
        assert_eq!(torch_dtype_name(d), torch);
        assert_eq!(dtype_from_torch(torch).unwrap(), d);
        assert!(Dtype::ALL.contains(&d), "{name} is in Dtype::ALL");
    }
}

#[test]
fn the_table_has_no_name_twice() {
    let mut names: Vec<_> = Dtype::ALL.iter().map(|d| d.name()).collect();
    let mut torch: Vec<_> = Dtype::ALL.iter().map(|d| torch_dtype_name(*d)).collect();
    names.sort_unstable();
    names.dedup();
    torch.sort_unstable();
    torch.dedup();
    assert_eq!(names.len(), Dtype::ALL.len());
    assert_eq!(torch.len(), Dtype::ALL.len());
    // The set table stores the name with a length of at most 16 bytes.
    assert!(names.iter().all(|n| n.len() <= 16));
}

#[test]
fn raw_is_a_same_sized_integer() {
    let integers = [Dtype::U8, Dtype::I8, Dtype::I16, Dtype::I32, Dtype::I64];
    for d in Dtype::ALL {
        match d.raw() {
            Some(r) => {
                assert_eq!(r.size(), d.size(), "{d}");
                assert!(integers.contains(&r), "{d} -> {r}");
                assert_eq!(r.raw(), Some(r), "{r} is its own raw type");
            }
            None => assert_eq!(d, Dtype::C128, "only c128 has no integer of its size"),
        }
    }
    for d in [
        Dtype::F8E4m3fn,
        Dtype::F8E5m2,
        Dtype::F8E4m3fnuz,
        Dtype::F8E5m2fnuz,
        Dtype::F8E8m0fnu,
        Dtype::F4E2m1fnX2,
        Dtype::Bool,
    ] {
        assert_eq!(d.raw(), Some(Dtype::U8), "{d}: its bits as bytes");
    }
    assert_eq!(Dtype::C64.raw(), Some(Dtype::I64));
    assert_eq!(Dtype::Bf16.raw(), Some(Dtype::I16));
}

#[test]
fn an_unknown_name_is_refused_listing_the_known_ones() {
    for bad in [
        "f8",
        "float8_e4m3fn",
        "F8E4M3FN",
        "c32",
        "u4",
        "f4e2m1fn",
        "",
    ] {
        let e = bad.parse::<Dtype>().unwrap_err().to_string();
        assert!(e.contains(&format!("{bad:?} is not one of")), "{e}");
        assert!(e.contains("f8e4m3fn, f8e5m2"), "{e}");
        assert!(e.contains("c64, c128"), "{e}");
    }
}

#[test]
fn a_descriptor_of_every_type_round_trips() {
    for d in Dtype::ALL {
        let desc = Descriptor::new(Source::Vmm { fd: 5 }, 2 * MIB, UUID, 4242)
            .with_range(0, 64 * d.size())
            .with_dtype(d)
            .with_shape(vec![4, 16]);
        let text = desc.to_json();
        assert!(
            text.contains(&format!(r#""dtype":"{}""#, d.name())),
            "{text}"
        );
        assert!(
            text.contains(&format!(r#""elem_size":{}"#, d.size())),
            "{text}"
        );
        assert_eq!(Descriptor::from_json(&text).unwrap(), desc, "{text}");
    }
}

#[test]
fn a_descriptor_with_the_wrong_element_size_is_refused() {
    let desc = Descriptor::new(Source::Vmm { fd: 5 }, 2 * MIB, UUID, 4242)
        .with_range(0, 64)
        .with_dtype(Dtype::C128);
    let text = desc
        .to_json()
        .replace(r#""elem_size":16"#, r#""elem_size":8"#);
    let e = Descriptor::from_json(&text).unwrap_err().to_string();
    assert!(e.contains("elem_size"), "{e}");
}

fn chunk(id: u64, fd: i32, len: u64) -> SetChunk {
    SetChunk::new(
        id,
        Descriptor::new(Source::Vmm { fd }, len, UUID, 4242)
            .with_generation(u64::from(fd.unsigned_abs())),
    )
}

fn entry(name: &str, dtype: Dtype, shape: &[u64], offset: u64) -> SetEntry {
    let len = shape.iter().product::<u64>() * dtype.size();
    SetEntry::new(name.into(), dtype, shape.to_vec(), 0, offset, len)
}

/// A checkpoint's mix: every new type, and the old ones beside them.
fn checkpoint() -> SetRecord {
    let mut entries = Vec::new();
    let mut offset = 0;
    for (i, (d, ..)) in CHECKPOINT_TYPES.iter().enumerate() {
        let e = entry(&format!("layers.{i}.{}", d.name()), *d, &[3, 5], offset);
        offset += e.len.next_multiple_of(256);
        entries.push(e);
    }
    entries.push(entry("norm.weight", Dtype::Bf16, &[7], offset));
    entries.push(entry("step", Dtype::I64, &[], offset + 256));
    SetRecord::new(
        "fp8-model".into(),
        ArenaId(9),
        vec![chunk(0, 7, 2 * MIB)],
        entries,
    )
    .unwrap()
}

#[test]
fn a_set_of_the_checkpoint_types_round_trips_in_both_formats() {
    let r = checkpoint();
    // Format 2: the binary table carries the names.
    let text = r.to_json();
    assert!(text.contains(r#""cuda_ipc_set":2"#), "{text}");
    let back = SetRecord::from_json(&text).unwrap();
    assert_eq!(back, r);
    for (e, (d, name, size, _)) in back.entries.iter().zip(CHECKPOINT_TYPES) {
        assert_eq!((e.dtype, e.dtype.name()), (d, name));
        assert_eq!(e.len, 15 * size, "{name}: 3 x 5 elements");
        let desc = back
            .entry_descriptor(back.entries.iter().position(|x| x == e).unwrap())
            .unwrap();
        assert_eq!((desc.dtype, desc.byte_len), (d, 15 * size));
    }
    // Format 1: the entries as JSON arrays with the names.
    let expanded = r.to_expanded_value();
    let one = expanded.to_string();
    assert!(one.contains(r#"["layers.6.c64","c64",[3,5],0,"#), "{one}");
    assert!(
        one.contains(r#"["layers.5.f4e2m1fnx2","f4e2m1fnx2",[3,5],0,"#),
        "{one}"
    );
    assert_eq!(SetRecord::from_value(&expanded).unwrap(), r);
    assert_eq!(SetRecord::from_json(&one).unwrap().to_json(), text);
}

#[test]
fn the_binary_table_carries_each_type_by_name() {
    for (d, name, ..) in CHECKPOINT_TYPES {
        let e = entry("w", d, &[2], 0);
        let bytes = encode_bytes(std::slice::from_ref(&e));
        let needle = [&[u8::try_from(name.len()).unwrap()][..], name.as_bytes()].concat();
        assert!(
            bytes.windows(needle.len()).any(|w| w == needle),
            "{name} is written as its length and name"
        );
        assert_eq!(decode_bytes(&bytes).unwrap(), vec![e]);
    }
}

#[test]
fn a_table_of_runs_of_types_comes_back_entry_by_entry() {
    // The decoder parses a dtype name once per run of equal names: every
    // change of type, back and forth, must still be read.
    let types = [
        Dtype::F32,
        Dtype::F32,
        Dtype::Bf16,
        Dtype::F32,
        Dtype::Bf16,
        Dtype::Bf16,
    ];
    let entries: Vec<SetEntry> = types
        .iter()
        .enumerate()
        .map(|(i, &d)| entry(&format!("w{i}"), d, &[2], i as u64 * 256))
        .collect();
    assert_eq!(decode_bytes(&encode_bytes(&entries)).unwrap(), entries);
    // An unknown name after a known one is still refused, naming its entry.
    let bytes = encode_bytes(&[
        entry("a", Dtype::F8E5m2, &[2], 0),
        entry("b", Dtype::F8E5m2, &[2], 256),
    ]);
    let second = bytes.windows(6).rposition(|w| w == b"f8e5m2").unwrap();
    let mut bad = bytes.clone();
    bad[second + 5] = b'3';
    let text = decode_bytes(&bad).unwrap_err().to_string();
    assert!(text.contains("entries[1].dtype"), "{text}");
}

#[test]
fn a_table_with_an_unknown_type_is_refused_naming_it() {
    let e = entry("w", Dtype::F8E5m2, &[2], 0);
    let bytes = encode_bytes(&[e]);
    // "f8e5m2" -> "f8e5m3": a type this build does not know.
    let pos = bytes.windows(6).position(|w| w == b"f8e5m2").unwrap();
    let mut bad = bytes.clone();
    bad[pos + 5] = b'3';
    let text = decode_bytes(&bad).unwrap_err().to_string();
    assert!(text.contains("entries[0].dtype"), "{text}");
    assert!(text.contains(r#""f8e5m3" is not one of"#), "{text}");
}

#[test]
fn complex128_entries_must_be_16_byte_aligned() {
    let e = entry("z", Dtype::C128, &[4], 8);
    let err = SetRecord::new("z".into(), ArenaId(1), vec![chunk(0, 7, 2 * MIB)], vec![e])
        .unwrap_err()
        .to_string();
    assert!(err.contains("entries[0].offset"), "{err}");
    assert!(err.contains("16-byte c128"), "{err}");
}

/// A format 1 record as the build before the checkpoint types wrote it
/// (bf16, f32, i64 only) still reads, and reads the same written again.
#[test]
fn a_record_of_an_older_build_still_reads() {
    let old = r#"{"cuda_ipc_set":1,"name":"weights","arena":1,
        "chunks":[{"id":0,"descriptor":{"cuda_ipc":1,"mechanism":"vmm","fd":7,
          "alloc_size":2097152,"offset":0,"len":2097152,"dtype":"u8","elem_size":1,
          "device_uuid":"GPU-07070707-0707-0707-0707-070707070707","pid":4242,"generation":7}}],
        "entries":[["w","bf16",[4,4],0,0,32],["b","f32",[4],0,256,16],["step","i64",[],0,512,8]]}"#;
    let r = SetRecord::from_json(old).unwrap();
    let types: Vec<_> = r.entries.iter().map(|e| e.dtype).collect();
    assert_eq!(types, [Dtype::Bf16, Dtype::F32, Dtype::I64]);
    assert_eq!(SetRecord::from_json(&r.to_json()).unwrap(), r);
    let v: Value = serde_json::from_str(old).unwrap();
    assert_eq!(SetRecord::from_value(&v).unwrap(), r);
}

/// The fuzz seeds of the checkpoint types are valid (the replay in
/// `tests/decoders.rs` only checks that no decoder panics on them).
#[test]
fn the_fuzz_seeds_of_the_checkpoint_types_decode() {
    let corpus = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
    let read = |p: &str| std::fs::read(corpus.join(p)).unwrap();
    let entries = decode_bytes(&read("set_table/seed-valid-checkpoint-types")).unwrap();
    let types: Vec<_> = entries.iter().map(|e| e.dtype).collect();
    let mut want: Vec<_> = CHECKPOINT_TYPES.iter().map(|t| t.0).collect();
    want.push(Dtype::Bf16);
    assert_eq!(types, want);
    for format in ["v1", "v2"] {
        let text = read(&format!("set_record/seed-valid-{format}-checkpoint-types"));
        let r = SetRecord::from_json(std::str::from_utf8(&text).unwrap()).unwrap();
        assert_eq!(*r.entries, *entries, "{format}");
    }
    for (seed, d) in [
        ("seed-vmm-complex128", Dtype::C128),
        ("seed-vmm-fp4x2", Dtype::F4E2m1fnX2),
    ] {
        let text = read(&format!("descriptor/{seed}"));
        let desc = Descriptor::from_json(std::str::from_utf8(&text).unwrap()).unwrap();
        assert_eq!(desc.dtype, d);
    }
}
