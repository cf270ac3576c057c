//! Handles and descriptors without a GPU: round trips of every form, and
//! every malformed field rejected with an error that names it.

use std::str::FromStr;

use cuda_ipc::descriptor::{FORMAT_VERSION, Source};
use cuda_ipc::device::DeviceUuid;
use cuda_ipc::handle::{HANDLE_LEN, Handle};
use cuda_ipc::{
    Descriptor, Dtype, Error, FabricHandle, IpcEventHandle, IpcMemHandle, Mechanism, PoolPtrHandle,
};
use proptest::prelude::*;
use serde_json::{Value, json};

fn handle_bytes(seed: u8) -> [u8; HANDLE_LEN] {
    std::array::from_fn(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
}

fn legacy() -> Descriptor {
    Descriptor::new(
        Source::Legacy {
            handle: IpcMemHandle::from(handle_bytes(1)),
        },
        4 << 20,
        DeviceUuid([7; 16]),
        4242,
    )
    .with_range(1 << 20, 3 << 20)
    .with_dtype(Dtype::U32)
    .with_shape(vec![3 << 18])
    .with_event(IpcEventHandle::from(handle_bytes(9)))
    .with_generation(77)
}

/// `legacy()` with another source.
fn with_source(source: Source) -> Descriptor {
    let mut d = legacy();
    d.source = source;
    d
}

#[test]
fn handles_reject_wrong_lengths_and_non_hex() {
    assert!(
        IpcMemHandle::from_bytes(&[0; 63])
            .unwrap_err()
            .to_string()
            .contains("expected 64 bytes, got 63")
    );
    assert!(IpcMemHandle::from_bytes(&[0; 65]).is_err());
    assert_eq!(
        IpcMemHandle::from_bytes(&handle_bytes(3))
            .unwrap()
            .as_bytes(),
        &handle_bytes(3)
    );
    let e = IpcEventHandle::from_str(&"a".repeat(126))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("IPC event handle") && e.contains("expected 128 hex digits, got 126"),
        "{e}"
    );
    let e = PoolPtrHandle::from_str(&format!("{}z", "0".repeat(127)))
        .unwrap_err()
        .to_string();
    assert!(e.contains("'z' at position 127"), "{e}");
    let e = FabricHandle::from_str("").unwrap_err().to_string();
    assert!(e.contains("fabric handle"), "{e}");
    // Upper case is accepted; output is lower case.
    let h = IpcMemHandle::from(handle_bytes(200));
    assert_eq!(
        IpcMemHandle::from_str(&h.to_string().to_uppercase()).unwrap(),
        h
    );
    assert_eq!(h.to_string(), hex::encode(handle_bytes(200)));
    assert!(IpcMemHandle::from([0; 64]).is_zero());
}

#[test]
fn handles_serialise_as_hex_strings() {
    let h = IpcMemHandle::from(handle_bytes(5));
    let v = serde_json::to_value(h).unwrap();
    assert_eq!(v, Value::String(h.to_string()));
    assert_eq!(serde_json::from_value::<IpcMemHandle>(v).unwrap(), h);
    assert!(serde_json::from_value::<IpcMemHandle>(json!(12)).is_err());
    assert!(serde_json::from_value::<IpcMemHandle>(json!("abc")).is_err());
}

#[test]
fn every_mechanism_round_trips() {
    let sources = [
        Source::Legacy {
            handle: IpcMemHandle::from(handle_bytes(1)),
        },
        Source::Vmm { fd: 7 },
        Source::Pool {
            fd: 9,
            ptr: PoolPtrHandle::from(handle_bytes(2)),
        },
        Source::Fabric {
            handle: FabricHandle::from(handle_bytes(3)),
        },
    ];
    for (source, mechanism) in sources.into_iter().zip([
        Mechanism::Legacy,
        Mechanism::Vmm,
        Mechanism::Pool,
        Mechanism::Fabric,
    ]) {
        let d = with_source(source);
        let text = d.to_json();
        assert_eq!(Descriptor::from_json(&text).unwrap(), d, "{text}");
        assert_eq!(d.mechanism(), mechanism);
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["cuda_ipc"], FORMAT_VERSION);
        assert_eq!(v["elem_size"], 4);
        assert_eq!(v["mechanism"], mechanism.name());
    }
}

/// Applies `edit` to a valid descriptor's JSON and expects an error naming `field`.
fn rejects(edit: impl FnOnce(&mut serde_json::Map<String, Value>), field: &str, why: &str) {
    let mut v = legacy().to_value();
    edit(v.as_object_mut().unwrap());
    let e = Descriptor::from_value(&v).unwrap_err();
    match &e {
        Error::Descriptor { field: f, reason } => {
            assert_eq!(f, field, "{e}");
            assert!(
                reason.contains(why),
                "{field}: expected {why:?} in {reason:?}"
            );
        }
        other => panic!("expected a descriptor error for {field}, got {other}"),
    }
}

#[test]
#[allow(clippy::too_many_lines)] // one line per malformed field
fn every_malformed_field_is_named() {
    rejects(|m| drop(m.remove("cuda_ipc")), "cuda_ipc", "missing");
    rejects(
        |m| drop(m.insert("cuda_ipc".into(), json!(2))),
        "cuda_ipc",
        "format 2 is not supported",
    );
    rejects(
        |m| drop(m.insert("cuda_ipc".into(), json!("1"))),
        "cuda_ipc",
        "found a string",
    );
    rejects(
        |m| drop(m.insert("mechanism".into(), json!("smoke signals"))),
        "mechanism",
        "not one of",
    );
    rejects(|m| drop(m.remove("handle")), "handle", "missing");
    rejects(
        |m| drop(m.insert("handle".into(), json!("xx"))),
        "handle",
        "not a hex digit",
    );
    rejects(
        |m| drop(m.insert("handle".into(), json!("ab"))),
        "handle",
        "expected 128 hex digits",
    );
    rejects(
        |m| drop(m.insert("fd".into(), json!(3))),
        "fd",
        "does not belong to a legacy descriptor",
    );
    rejects(
        |m| drop(m.insert("alloc_size".into(), json!(-1))),
        "alloc_size",
        "negative",
    );
    rejects(
        |m| drop(m.insert("alloc_size".into(), json!(1.5))),
        "alloc_size",
        "not a whole number",
    );
    rejects(
        |m| drop(m.insert("alloc_size".into(), json!(0))),
        "alloc_size",
        "greater than zero",
    );
    rejects(
        |m| drop(m.insert("len".into(), json!(0))),
        "len",
        "greater than zero",
    );
    rejects(
        |m| drop(m.insert("len".into(), json!(6))),
        "len",
        "whole number of 4-byte",
    );
    rejects(
        |m| drop(m.insert("offset".into(), json!(2))),
        "offset",
        "not aligned",
    );
    rejects(
        |m| drop(m.insert("offset".into(), json!(4 << 20))),
        "len",
        "passes the end",
    );
    rejects(
        |m| drop(m.insert("offset".into(), json!(u64::MAX - 3))),
        "len",
        "passes the end",
    );
    rejects(
        |m| drop(m.insert("dtype".into(), json!("u128"))),
        "dtype",
        "not one of",
    );
    rejects(
        |m| drop(m.insert("elem_size".into(), json!(8))),
        "elem_size",
        "does not match dtype u32",
    );
    rejects(
        |m| drop(m.insert("shape".into(), json!([1, 2]))),
        "shape",
        "holds 2 elements",
    );
    rejects(
        |m| drop(m.insert("shape".into(), json!([u64::MAX, u64::MAX]))),
        "shape",
        "overflows",
    );
    rejects(
        |m| drop(m.insert("shape".into(), json!([1, -2]))),
        "shape[1]",
        "negative",
    );
    rejects(
        |m| drop(m.insert("shape".into(), json!("big"))),
        "shape",
        "expected an array",
    );
    rejects(
        |m| drop(m.insert("strides".into(), json!([1, 1]))),
        "strides",
        "2 strides for 1 dimensions",
    );
    rejects(
        |m| {
            m.insert("shape".into(), json!([1024, 768]));
            m.insert("strides".into(), json!([2048, 1]));
        },
        "strides",
        "past the",
    );
    rejects(
        |m| {
            m.remove("shape");
            m.insert("strides".into(), json!([1]));
        },
        "strides",
        "without shape",
    );
    rejects(
        |m| drop(m.insert("device_uuid".into(), json!("GPU-1"))),
        "device_uuid",
        "wrong grouping",
    );
    rejects(
        |m| drop(m.insert("pid".into(), json!(0))),
        "pid",
        "not a process id",
    );
    rejects(
        |m| drop(m.insert("pid".into(), json!(1u64 << 40))),
        "pid",
        "not a process id",
    );
    rejects(
        |m| drop(m.insert("event".into(), json!(""))),
        "event",
        "expected 128 hex digits",
    );
    rejects(
        |m| drop(m.insert("generation".into(), json!(-5))),
        "generation",
        "negative",
    );
    rejects(
        |m| drop(m.insert("colour".into(), json!("blue"))),
        "colour",
        "unknown field",
    );
}

#[test]
fn fd_mechanisms_have_their_own_rules() {
    let mut v = with_source(Source::Vmm { fd: 5 }).to_value();
    v["handle"] = json!(IpcMemHandle::from(handle_bytes(1)).to_string());
    assert!(
        Descriptor::from_value(&v)
            .unwrap_err()
            .to_string()
            .contains("does not belong to a vmm descriptor")
    );
    let mut v = with_source(Source::Vmm { fd: 5 }).to_value();
    v["fd"] = json!(1u64 << 35);
    assert!(
        Descriptor::from_value(&v)
            .unwrap_err()
            .to_string()
            .contains("not a file descriptor number")
    );
    let mut v = with_source(Source::Pool {
        fd: 5,
        ptr: PoolPtrHandle::from(handle_bytes(4)),
    })
    .to_value();
    v.as_object_mut().unwrap().remove("fd");
    assert!(
        Descriptor::from_value(&v)
            .unwrap_err()
            .to_string()
            .contains("`fd`: missing")
    );
}

#[test]
fn documents_that_are_not_objects_are_refused() {
    for text in [
        "",
        "[]",
        "null",
        "42",
        "\"descriptor\"",
        "{",
        "{\"cuda_ipc\":1,}",
    ] {
        let e = Descriptor::from_json(text).unwrap_err().to_string();
        assert!(e.contains("(document)"), "{text:?}: {e}");
    }
}

#[test]
fn mechanism_and_dtype_names_round_trip() {
    for m in Mechanism::ALL {
        assert_eq!(m.name().parse::<Mechanism>().unwrap(), m);
    }
    for d in Dtype::ALL {
        assert_eq!(d.name().parse::<Dtype>().unwrap(), d);
        assert!([1, 2, 4, 8, 16].contains(&d.size()));
    }
}

fn arb_source() -> impl Strategy<Value = Source> {
    let bytes = proptest::array::uniform32(any::<u8>()).prop_map(|h| {
        let mut b = [0u8; 64];
        b[..32].copy_from_slice(&h);
        b[32..].copy_from_slice(&h);
        b
    });
    prop_oneof![
        bytes.clone().prop_map(|b| Source::Legacy {
            handle: IpcMemHandle::from(b)
        }),
        (0..i32::MAX).prop_map(|fd| Source::Vmm { fd }),
        ((0..i32::MAX), bytes.clone()).prop_map(|(fd, b)| Source::Pool {
            fd,
            ptr: PoolPtrHandle::from(b)
        }),
        bytes.prop_map(|b| Source::Fabric {
            handle: FabricHandle::from(b)
        }),
    ]
}

proptest! {
    #[test]
    fn valid_descriptors_round_trip(
        source in arb_source(),
        dtype in proptest::sample::select(Dtype::ALL.to_vec()),
        elems in 1u64..1 << 30,
        before in 0u64..1 << 20,
        after in 0u64..1 << 20,
        pid in 1u32..u32::MAX,
        generation in proptest::option::of(any::<u64>()),
        with_shape in any::<bool>(),
    ) {
        let size = dtype.size();
        let mut d = Descriptor::new(source, (before + elems + after) * size, DeviceUuid([3; 16]), pid)
            .with_range(before * size, elems * size)
            .with_dtype(dtype);
        d.shape = with_shape.then(|| vec![elems]);
        d.generation = generation;
        prop_assert_eq!(Descriptor::from_json(&d.to_json()).unwrap(), d);
    }

    #[test]
    fn the_decoder_never_panics(text in ".{0,300}") {
        let _ = Descriptor::from_json(&text);
    }

    #[test]
    fn mutated_valid_descriptors_never_panic(at in 0usize..400, byte in any::<u8>()) {
        let mut bytes = legacy().to_json().into_bytes();
        let i = at % bytes.len();
        bytes[i] = byte;
        if let Ok(text) = String::from_utf8(bytes) {
            let _ = Descriptor::from_json(&text);
        }
    }

    #[test]
    fn handles_round_trip(bytes in proptest::collection::vec(any::<u8>(), 64)) {
        let h = IpcMemHandle::from_bytes(&bytes).unwrap();
        prop_assert_eq!(h.to_string().parse::<IpcMemHandle>().unwrap(), h);
        prop_assert_eq!(&h.as_bytes()[..], &bytes[..]);
    }

    #[test]
    fn handles_of_other_lengths_are_refused(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        prop_assume!(bytes.len() != 64);
        prop_assert!(IpcMemHandle::from_bytes(&bytes).is_err());
        prop_assert!(IpcEventHandle::from_str(&hex_of(&bytes)).is_err());
    }
}

fn hex_of(b: &[u8]) -> String {
    hex::encode(b)
}
