//! The properties of fuzz target `notice_record` (a record read out of the
//! channel's shared-memory rings: an 8-byte count, then a wire header and
//! its JSON payload, or a tag byte and the binary fields of an ack, a ring
//! frame or an update): the client's decoder and the server's ack reader,
//! whose fast path skips the JSON decoder for acks in this build's exact
//! form, agree on every input (the same message and count, or the same
//! error); nothing panics; what decodes, framed again in either form
//! (binary where the message has one, JSON), decodes the same; an update
//! whose notice is a pushed entry (`PushedEntry::from_notice`) decodes to
//! one that round-trips.
//!
//! Each input is tried twice: as a whole record, and as the payload of a
//! record with a valid count and header (so that the fuzzer reaches the
//! fast path and the JSON decoder without having to guess a header).
//!
//! Kept apart from `lib.rs` so that the target, and the corpus replay in
//! `crates/cuda-ipc/tests/decoders.rs`, include this one file.

use cuda_ipc::channel::PushedEntry;
use cuda_ipc::channel::notices::{binary_record_both_ways, decode_record_both_ways};
use cuda_ipc::channel::wire::{MAX_PAYLOAD, Message};

/// `b"CIPC"`, version 1, kind 1 (JSON), `len`, no descriptors.
fn record(count: u64, payload: &[u8]) -> Vec<u8> {
    let mut r = count.to_le_bytes().to_vec();
    r.extend_from_slice(b"CIPC");
    r.extend_from_slice(&1u16.to_le_bytes());
    r.extend_from_slice(&1u16.to_le_bytes());
    r.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    r.extend_from_slice(&[0; 4]);
    r.extend_from_slice(payload);
    r
}

/// Both readers on one record; the message if they accept it.
fn agree(record: &[u8]) -> Option<(u64, Message)> {
    let [full, fast] = decode_record_both_ways(record, MAX_PAYLOAD);
    match (full, fast) {
        (Ok(a), Ok(b)) => {
            assert_eq!(a, b, "the ack reader decoded another message");
            Some(a)
        }
        (Err(a), Err(b)) => {
            let (a, b) = (a.to_string(), b.to_string());
            assert!(!a.is_empty(), "an error printed as nothing");
            assert_eq!(a, b, "the two readers refuse for different reasons");
            None
        }
        (Ok(m), Err(e)) => panic!("the ack reader refused {m:?}, which the decoder takes: {e}"),
        (Err(e), Ok(m)) => panic!("the ack reader took {m:?}, which the decoder refuses: {e}"),
    }
}

/// A decoded message framed again in both forms: each must decode to it.
fn reframed(count: u64, m: &Message) {
    let [binary, json] = binary_record_both_ways(count, m);
    for r in [binary, json].into_iter().flatten() {
        assert_eq!(
            agree(&r),
            Some((count, m.clone())),
            "the message framed again decodes otherwise"
        );
    }
}

/// A decoded update's notice, read as a pushed entry where it is one:
/// nothing panics, and what decodes encodes to the same entry again.
fn pushed(m: &Message) {
    let Message::Update { notice, .. } = m else {
        return;
    };
    if let Some(Ok(p)) = PushedEntry::from_notice(notice) {
        let again = serde_json::json!({ "pushed": p });
        let back = PushedEntry::from_notice(&again).and_then(Result::ok);
        assert_eq!(
            back.as_ref(),
            Some(&p),
            "a pushed entry changed in a round trip"
        );
    }
}

/// The checks of the shared-memory record decoders on arbitrary bytes;
/// panics if a property fails.
pub fn notice_record(data: &[u8]) {
    for m in [agree(data), agree(&record(7, data))].iter().flatten() {
        pushed(&m.1);
    }
    if let Some((count, m)) = agree(data) {
        assert_eq!(
            count.to_le_bytes(),
            data[..8],
            "the count is not the first 8 bytes"
        );
        let again = agree(&record(count, &m.encode()));
        assert_eq!(
            again,
            Some((count, m.clone())),
            "the message framed again decodes otherwise"
        );
        reframed(count, &m);
    }
    if let Some((count, m)) = agree(&record(7, data)) {
        assert_eq!(count, 7);
        assert_eq!(
            Message::decode(data).ok().as_ref(),
            Some(&m),
            "a record decodes unlike its payload"
        );
        reframed(count, &m);
    }
}

/// Whether `data` is a record or a payload the readers accept (the corpus
/// replay checks that the seeds hold some).
#[allow(dead_code)] // The targets need only the checks.
pub fn is_valid(data: &[u8]) -> bool {
    agree(data).is_some() || agree(&record(7, data)).is_some()
}
