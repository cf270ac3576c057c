//! The wire form of GPU-side fences (`cuda_ipc::fence`), without a GPU:
//! block records and references round-trip, and decoding is strict.
//! The fences themselves are tested on a GPU in `tests/gpu_fence/`.

use cuda_ipc::descriptor::{Descriptor, Dtype, Source};
use cuda_ipc::device::DeviceUuid;
use cuda_ipc::fence::{FenceBlock, FenceRef};
use cuda_ipc::handle::IpcMemHandle;
use proptest::prelude::*;
use serde_json::{Value, json};

/// The largest sequence number the wire format allows (2^62 - 1).
const MAX_SEQ: u64 = (1 << 62) - 1;

/// The most words a block holds, and the first word index refused.
const MAX_WORDS: u32 = 1 << 16;

fn block_descriptor(
    source: Source,
    words: u32,
    offset: u64,
    generation: Option<u64>,
) -> Descriptor {
    let len = u64::from(words) * 8;
    let mut d = Descriptor::new(
        source,
        (offset + len).next_multiple_of(2 << 20),
        DeviceUuid([7; 16]),
        4242,
    )
    .with_range(offset, len)
    .with_dtype(Dtype::U64)
    .with_shape(vec![u64::from(words)]);
    d.generation = generation;
    d
}

fn arb_source() -> impl Strategy<Value = Source> {
    prop_oneof![
        prop::array::uniform32(1u8..).prop_map(|h| {
            let mut handle = [0u8; 64];
            handle[..32].copy_from_slice(&h);
            Source::Legacy {
                handle: IpcMemHandle::from(handle),
            }
        }),
        (0..=i32::MAX).prop_map(|fd| Source::Vmm { fd }),
    ]
}

fn arb_block() -> impl Strategy<Value = FenceBlock> {
    (arb_source(), 1..=MAX_WORDS, 0u64..1024, any::<u64>()).prop_map(
        |(source, words, slot, generation)| {
            FenceBlock::new(
                block_descriptor(source, words, slot * 8, Some(generation)),
                words,
            )
            .expect("a valid block")
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
        ".{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(2, 8, 3, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..3).prop_map(Value::from),
            prop::collection::btree_map("[a-z_]{1,10}", inner, 0..3)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn decode_block(v: &Value) -> Result<FenceBlock, String> {
    serde_json::from_value::<FenceBlock>(v.clone()).map_err(|e| e.to_string())
}

fn decode_ref(v: &Value) -> Result<FenceRef, String> {
    serde_json::from_value::<FenceRef>(v.clone()).map_err(|e| e.to_string())
}

#[test]
fn a_reference_has_three_named_fields() {
    let r = FenceRef {
        block: 9,
        word: 3,
        seq: 17,
    };
    let v = serde_json::to_value(r).unwrap();
    assert_eq!(v, json!({"block": 9, "word": 3, "seq": 17}));
    assert_eq!(decode_ref(&v).unwrap(), r);
}

#[test]
fn references_with_bad_numbers_or_extra_fields_are_refused() {
    for (v, says) in [
        (json!({"block": 1, "word": 0, "seq": 0}), "sequence number"),
        (
            json!({"block": 1, "word": 0, "seq": MAX_SEQ + 1}),
            "sequence number",
        ),
        (json!({"block": 1, "word": MAX_WORDS, "seq": 1}), "word"),
        (
            json!({"block": 1, "word": 0, "seq": 1, "x": 1}),
            "unknown field",
        ),
        (json!({"block": 1, "seq": 1}), "missing field"),
        (json!({"block": -1, "word": 0, "seq": 1}), "invalid value"),
        (json!({"block": 1, "word": 0, "seq": 1.5}), "invalid type"),
    ] {
        let e = decode_ref(&v).expect_err(&v.to_string());
        assert!(e.contains(says), "{v}: {e}");
    }
}

#[test]
fn a_block_names_its_descriptor_and_words() {
    let b = FenceBlock::new(block_descriptor(Source::Vmm { fd: 5 }, 4, 0, Some(77)), 4).unwrap();
    let v = serde_json::to_value(&b).unwrap();
    assert_eq!(v["words"], json!(4));
    assert_eq!(v["descriptor"]["mechanism"], json!("vmm"));
    assert_eq!(v["descriptor"]["dtype"], json!("u64"));
    assert_eq!(b.id(), 77);
    assert_eq!(decode_block(&v).unwrap(), b);
}

#[test]
fn blocks_that_are_not_whole_aligned_u64_words_are_refused() {
    let ok = block_descriptor(Source::Vmm { fd: 5 }, 4, 0, Some(1));
    let mut wrong_dtype = ok.clone();
    wrong_dtype.dtype = Dtype::U32;
    wrong_dtype.byte_len = 32;
    wrong_dtype.shape = None;
    let mut unaligned = ok.clone();
    unaligned.offset = 4;
    let no_generation = block_descriptor(Source::Vmm { fd: 5 }, 4, 0, None);
    for (d, words, says) in [
        (ok.clone(), 5, "not 5 words"),
        (ok.clone(), 0, "outside"),
        (ok.clone(), MAX_WORDS + 1, "outside"),
        (wrong_dtype, 4, "not u64"),
        (unaligned, 4, "aligned"),
        (no_generation, 4, "generation"),
    ] {
        let e = FenceBlock::new(d.clone(), words).expect_err(says);
        assert!(e.to_string().contains(says), "{says}: {e}");
        let v = json!({"descriptor": d.to_value(), "words": words});
        let e = decode_block(&v).expect_err(says);
        assert!(e.contains(says), "{says}: {e}");
    }
    let v = json!({"descriptor": ok.to_value(), "words": 4, "event": null});
    assert!(decode_block(&v).unwrap_err().contains("unknown field"));
    let v = json!({"descriptor": "vmm", "words": 4});
    assert!(decode_block(&v).is_err());
}

proptest! {
    #[test]
    fn references_round_trip(block in any::<u64>(), word in 0..MAX_WORDS, seq in 1..=MAX_SEQ) {
        let r = FenceRef { block, word, seq };
        let text = serde_json::to_string(&r).unwrap();
        prop_assert_eq!(serde_json::from_str::<FenceRef>(&text).unwrap(), r);
    }

    #[test]
    fn blocks_round_trip(b in arb_block()) {
        let text = serde_json::to_string(&b).unwrap();
        prop_assert_eq!(serde_json::from_str::<FenceBlock>(&text).unwrap(), b);
    }

    /// Any JSON in place of a field of a valid record either decodes to a
    /// record that passes its own checks and round-trips, or is refused
    /// with an error; it never panics.
    #[test]
    fn any_json_in_a_field_decodes_strictly(
        b in arb_block(),
        field in prop::sample::select(vec!["descriptor", "host", "words", "block", "word", "seq", "extra"]),
        junk in arb_json(),
    ) {
        let mut v = serde_json::to_value(&b).unwrap();
        v[field] = junk.clone();
        if let Ok(d) = decode_block(&v) {
            prop_assert!(matches!(field, "descriptor" | "host" | "words"));
            let again = serde_json::to_value(&d).unwrap();
            prop_assert_eq!(decode_block(&again).unwrap(), d);
        }
        let mut r = json!({"block": 1, "word": 2, "seq": 3});
        r[field] = junk;
        if let Ok(d) = decode_ref(&r) {
            prop_assert!(d.seq >= 1 && d.seq <= MAX_SEQ && d.word < MAX_WORDS);
            prop_assert!(matches!(field, "block" | "word" | "seq"));
        }
    }

    /// Arbitrary text never panics either decoder.
    #[test]
    fn arbitrary_text_never_panics(text in ".{0,200}") {
        let _ = serde_json::from_str::<FenceBlock>(&text);
        let _ = serde_json::from_str::<FenceRef>(&text);
    }
}

#[test]
fn a_host_block_names_its_memfd() {
    let b = FenceBlock::host(9, 1234, 55, 16).unwrap();
    let v = serde_json::to_value(&b).unwrap();
    assert_eq!(
        v,
        json!({"host": {"fd": 9, "pid": 1234, "id": 55}, "words": 16})
    );
    assert!(b.is_host() && b.descriptor().is_none());
    assert_eq!(b.id(), 55);
    assert_eq!(decode_block(&v).unwrap(), b);
}

#[test]
fn a_block_needs_exactly_one_placement() {
    let d = block_descriptor(Source::Vmm { fd: 5 }, 4, 0, Some(1)).to_value();
    let host = json!({"fd": 3, "pid": 10, "id": 2});
    for (v, says) in [
        (json!({"words": 4}), "neither"),
        (json!({"descriptor": d, "host": host, "words": 4}), "both"),
        (
            json!({"host": {"fd": -1, "pid": 10, "id": 2}, "words": 4}),
            "file descriptor",
        ),
        (
            json!({"host": {"fd": 3, "pid": 0, "id": 2}, "words": 4}),
            "process id 0",
        ),
        (
            json!({"host": {"fd": 3, "pid": 10, "id": 2, "x": 1}, "words": 4}),
            "unknown field",
        ),
        (
            json!({"host": {"fd": 3, "pid": 10}, "words": 4}),
            "missing field",
        ),
        (json!({"host": host, "words": 0}), "outside"),
    ] {
        let e = decode_block(&v).expect_err(says);
        assert!(e.contains(says), "{v}: {e}");
    }
}

proptest! {
    #[test]
    fn host_blocks_round_trip(fd in 0..=i32::MAX, pid in 1u32.., id in any::<u64>(), words in 1..=MAX_WORDS) {
        let b = FenceBlock::host(fd, pid, id, words).unwrap();
        let text = serde_json::to_string(&b).unwrap();
        prop_assert_eq!(serde_json::from_str::<FenceBlock>(&text).unwrap(), b);
    }
}
