//! The properties the fuzz targets check, one function per decoder.
//!
//! Each function takes arbitrary bytes, feeds them to one of cuda-ipc's
//! decoders and panics only if a property fails:
//!
//! - the decoder never panics (whatever the input);
//! - what decodes re-encodes to something that decodes to an equal value
//!   (and, where the encoding is canonical, to the same text);
//! - every error prints (its `Display` does not panic and is not empty).
//!
//! The fuzz targets in `fuzz_targets/` call these functions, and
//! `crates/cuda-ipc/tests/decoders.rs` includes this file to replay every
//! file of `fuzz/corpus/` through them in a plain `cargo test`, so that CI
//! keeps the corpus as regression tests without cargo-fuzz.

use std::fmt::Display;

use cuda_ipc::channel::wire::{
    HEADER_LEN, MAX_FDS, MAX_PAYLOAD, Message, WireError, decode_header,
};
use cuda_ipc::descriptor::{Descriptor, Dtype, Mechanism};
use cuda_ipc::device::DeviceUuid;
use cuda_ipc::handle::{
    FabricHandle, HANDLE_LEN, Handle, IpcEventHandle, IpcMemHandle, PoolPtrHandle,
};
use cuda_ipc::torch::{ShareRecord, StorageHandle};
use cuda_ipc::units::{ByteSize, parse_u32};

/// The checks of one decoder: panics if a property fails.
pub type Check = fn(&[u8]);

/// The decoders, by fuzz target name, for tools that replay a corpus.
pub const TARGETS: &[(&str, Check)] = &[
    ("descriptor", descriptor),
    ("frame_header", frame_header),
    ("frame_message", frame_message),
    ("hex_handle", hex_handle),
    ("cli_size", cli_size),
    ("torch_record", torch_record),
];

/// An error must say something.
fn explained(e: &impl Display) {
    assert!(!e.to_string().is_empty(), "an error printed as nothing");
}

/// `Descriptor::from_json` (also through `FromStr` and serde) and
/// `Mechanism`/`Dtype` names: a descriptor that decodes is valid, and
/// `to_json` gives the same descriptor back, in the same text every time.
pub fn descriptor(data: &[u8]) {
    // Raw bytes: serde_json rejects invalid UTF-8 itself.
    if let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) {
        let _ = Descriptor::from_value(&value).map_err(|e| explained(&e));
    }
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = text.parse::<Mechanism>().map_err(|e| explained(&e));
    let _ = text.parse::<Dtype>().map_err(|e| explained(&e));
    let parsed = Descriptor::from_json(text);
    let via_serde = serde_json::from_str::<Descriptor>(text);
    assert_eq!(
        parsed.is_ok(),
        via_serde.is_ok(),
        "from_json and serde disagree on {text:?}"
    );
    match parsed {
        Ok(d) => {
            d.validate().expect("a decoded descriptor must validate");
            let json = d.to_json();
            let again = Descriptor::from_json(&json)
                .unwrap_or_else(|e| panic!("to_json wrote {json:?}, which does not parse: {e}"));
            assert_eq!(
                again, d,
                "the round trip through {json:?} changed the descriptor"
            );
            assert_eq!(again.to_json(), json, "to_json is not canonical");
            assert_eq!(
                via_serde.ok().as_ref(),
                Some(&d),
                "serde decoded another descriptor"
            );
            assert_eq!(d.to_string(), json);
        }
        Err(e) => explained(&e),
    }
}

/// `channel::wire::decode_header`: a header that decodes is within the
/// limits, and its fields are exactly the bytes of the documented layout
/// (`b"CIPC"`, version, kind, length, descriptor count, a zero reserved
/// field, all little-endian).
pub fn frame_header(data: &[u8]) {
    match decode_header(data) {
        Ok(h) => {
            assert!(
                h.len <= MAX_PAYLOAD,
                "accepted a payload of {} bytes",
                h.len
            );
            assert!(usize::from(h.fds) <= MAX_FDS, "accepted {} fds", h.fds);
            let u16_at = |i: usize| u16::from_le_bytes([data[i], data[i + 1]]);
            assert_eq!(&data[..4], b"CIPC", "accepted a bad magic");
            assert_eq!(u16_at(4), h.version);
            assert_eq!(u16_at(6), h.kind);
            assert_eq!(
                u32::from_le_bytes([data[8], data[9], data[10], data[11]]),
                h.len
            );
            assert_eq!(u16_at(12), h.fds);
            assert_eq!(u16_at(14), 0, "accepted a non-zero reserved field");
        }
        Err(e) => {
            if data.len() < HEADER_LEN {
                assert!(matches!(e, WireError::Truncated { .. }), "{e:?}");
            }
            explained(&e);
        }
    }
}

/// `channel::wire::Message::decode`: it decides as its checked passes do
/// (`decode_checked`: the same message or the same error), and a message
/// that decodes encodes to a payload that decodes to an equal message. (That the library frames it
/// with a header that decodes again is checked by the channel crate's unit
/// tests, which replay this target's corpus too.)
pub fn frame_message(data: &[u8]) {
    // The one-pass readings decide as the checked passes do.
    assert_eq!(
        Message::decode(data),
        Message::decode_checked(data),
        "decode and its checked passes disagree"
    );
    match Message::decode(data) {
        Ok(m) => {
            assert!(Message::TYPES.contains(&m.type_name()));
            let payload = m.encode();
            let again = Message::decode(&payload).unwrap_or_else(|e| {
                panic!(
                    "encode wrote {:?}, which does not decode: {e}",
                    String::from_utf8_lossy(&payload)
                )
            });
            assert_eq!(again, m, "the round trip changed the message");
        }
        Err(e) => explained(&e),
    }
}

/// One 64-byte handle type: hex text (`FromStr`, serde) and raw bytes.
macro_rules! check_handle {
    ($t:ty, $text:expr, $data:expr) => {{
        let (text, data): (Option<&str>, &[u8]) = ($text, $data);
        if let Some(text) = text {
            match text.parse::<$t>() {
                Ok(h) => {
                    assert_eq!(text.len(), 2 * HANDLE_LEN);
                    let shown = h.to_string();
                    assert_eq!(shown, text.to_ascii_lowercase(), "Display is not the hex");
                    assert_eq!(shown.parse::<$t>().ok(), Some(h));
                    // serde reads the same hex string.
                    let quoted = serde_json::to_string(text).expect("a string serializes");
                    assert_eq!(serde_json::from_str::<$t>(&quoted).ok(), Some(h));
                }
                Err(e) => explained(&e),
            }
        }
        match <$t>::from_bytes(data) {
            Ok(h) => assert_eq!(&h.as_bytes()[..], data, "from_bytes changed the bytes"),
            Err(e) => {
                assert_ne!(data.len(), HANDLE_LEN, "from_bytes refused 64 bytes: {e}");
                explained(&e);
            }
        }
    }};
}

/// `IpcMemHandle` and the other 64-byte handles (`FromStr`, `from_bytes`,
/// serde) and `DeviceUuid`: what parses prints back as the same lowercase
/// hex; `from_bytes` takes exactly 64 bytes and keeps them.
pub fn hex_handle(data: &[u8]) {
    let text = std::str::from_utf8(data).ok();
    check_handle!(IpcMemHandle, text, data);
    check_handle!(IpcEventHandle, text, data);
    check_handle!(PoolPtrHandle, text, data);
    check_handle!(FabricHandle, text, data);
    // serde straight from JSON text, as descriptors carry handles.
    if let Ok(h) = serde_json::from_slice::<IpcMemHandle>(data) {
        let back = serde_json::to_string(&h).expect("a handle serializes");
        assert_eq!(serde_json::from_str::<IpcMemHandle>(&back).ok(), Some(h));
    }
    if let Some(text) = text {
        match text.parse::<DeviceUuid>() {
            Ok(u) => {
                let shown = u.to_string();
                assert_eq!(shown, text.to_ascii_lowercase().replacen("gpu-", "GPU-", 1));
                assert_eq!(shown.parse::<DeviceUuid>().ok(), Some(u));
            }
            Err(e) => explained(&e),
        }
    }
}

/// `units::ByteSize::from_str` and `units::parse_u32`: what parses prints
/// back (`Display`, and hex for values) to the same number, and only digits,
/// a `0x` prefix, unit letters and spaces are accepted (no signs).
pub fn cli_size(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let plain = |s: &str| {
        s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c.is_whitespace())
    };
    match text.parse::<ByteSize>() {
        Ok(size) => {
            assert!(plain(text), "accepted {text:?} as {size:?}");
            let shown = size.to_string();
            assert_eq!(shown.parse::<ByteSize>().ok(), Some(size), "{shown:?}");
            assert_eq!(
                format!("{:#x}", size.0).parse::<ByteSize>().ok(),
                Some(size)
            );
        }
        Err(e) => explained(&e),
    }
    match parse_u32(text) {
        Ok(v) => {
            assert!(plain(text), "accepted {text:?} as {v}");
            assert_eq!(parse_u32(&v.to_string()).ok(), Some(v));
            assert_eq!(parse_u32(&format!("{v:#x}")).ok(), Some(v));
            assert_eq!(
                text.parse::<ByteSize>().ok(),
                Some(ByteSize(u64::from(v))),
                "a 32-bit value is also a size"
            );
        }
        Err(e) => explained(&e),
    }
}

/// `torch::ShareRecord` decoding and `torch::StorageHandle::parse`: a
/// record that decodes round-trips through `to_json`, and so does a handle
/// through `to_bytes`; what converts to a descriptor is a valid descriptor.
pub fn torch_record(data: &[u8]) {
    match StorageHandle::parse(data) {
        Ok(h) => {
            let bytes = h.to_bytes();
            assert_eq!(StorageHandle::parse(&bytes).as_ref().ok(), Some(&h));
            if let StorageHandle::Expandable { segment, .. } = &h {
                assert!(segment.num_segments() > 0);
                segment
                    .mapped_size()
                    .expect("a parsed segment's size fits in 64 bits");
            }
        }
        Err(e) => explained(&e),
    }
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let parsed = ShareRecord::from_json(text);
    assert_eq!(
        parsed.is_ok(),
        serde_json::from_str::<ShareRecord>(text).is_ok(),
        "from_json and serde disagree on {text:?}"
    );
    let record = match parsed {
        Ok(r) => r,
        Err(e) => return explained(&e),
    };
    let json = record.to_json();
    let again = ShareRecord::from_json(&json)
        .unwrap_or_else(|e| panic!("to_json wrote {json:?}, which does not parse: {e}"));
    assert_eq!(
        again, record,
        "the round trip through {json:?} changed the record"
    );
    assert_eq!(again.to_json(), json, "to_json is not canonical");
    let _ = record.event();
    let _ = record.parse_storage_handle().map_err(|e| explained(&e));
    let _ = record.tensor_layout().map_err(|e| explained(&e));
    match record.to_descriptor() {
        Ok(d) => {
            d.validate()
                .expect("to_descriptor made an invalid descriptor");
            let back = Descriptor::from_json(&d.to_json())
                .unwrap_or_else(|e| panic!("the converted descriptor does not parse: {e}"));
            assert_eq!(back, d);
        }
        Err(e) => explained(&e),
    }
}
