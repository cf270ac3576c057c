//! Notices through shared memory: which path notices take, and the
//! records that carry them.
//!
//! After the handshake, a client that asks for it (and a server that
//! grants it) moves the traffic that needs no descriptors off the socket:
//! the server's notices ([`Message::Update`], [`Message::RingFrame`],
//! [`Message::Unpublished`], [`Message::RingLate`]) and the client's
//! [`Message::Ack`]s travel through two single-producer single-consumer
//! rings in a memfd that the server creates, seals and sends with its
//! `welcome` (see the `cuda_ipc_shm` crate), with one end of a wake-up
//! socket pair (the server keeps the other) to wake a sleeper either way.
//! The socket stays for requests, answers, descriptors and liveness: a
//! waiting client polls its wake-up end and the socket together, so a
//! server that dies wakes it at once, and the server's reader polls the
//! socket and its wake-up end, so a client that dies is noticed at once
//! too.
//!
//! # Records
//! A record is an 8-byte little-endian count (below), then either a whole
//! wire message (header and JSON payload) without descriptors, exactly as
//! it would go on the socket, or, for the hot messages (updates, ring
//! frames and acks), a tag byte and their fields in binary, only the
//! producer's notice staying JSON (the layout is in `notices/binary.rs`).
//! Readers take both forms; this build writes the binary one where there
//! is one. The reader copies a record out of shared memory before it
//! decodes it, and checks it like a message from the socket.
//! The server reads an ack in exactly the form this build writes it
//! without the JSON decoder; any other bytes go to the decoder, which
//! alone decides what is valid (see `decode_ack_record`).
//!
//! # Order
//! A notice must not overtake a socket message it depends on (an
//! `attached` answer, then an update for that lease), nor be overtaken by
//! one sent after it. Both ends count the socket messages of the
//! connection (the `welcome` is the first). The server puts a notice in
//! the ring only when nothing waits to be written to the socket (nothing
//! queued, being sent or still to be made from a ring subscription), so
//! every socket message sent before it is already in the client's receive
//! queue; the record carries the count of those messages. The client
//! takes a record only once it has received that many socket messages,
//! and before it files socket message `n` it files every record counted
//! below `n`. So the client sees the server's messages in the order the
//! server sent them, whatever path each took.
//!
//! # Requests
//! A client may also ask (the `hello`'s `shm_requests`, granted by the
//! `welcome`'s) to send its pings, attaches and releases through its ring,
//! and to get their answers through the server's when they carry no
//! descriptors: a request then costs two writes to shared memory and no
//! system call while both ends spin, where the socket costs at least four
//! (`handoff_latency` on an H200 host: a ping took 10.7 µs on the socket
//! with the server's reader spinning and 3.4 µs through the rings; an
//! update one way 5.1 µs on the socket against 1.5 µs through the ring;
//! the bench's fresh hand-off, between processes that wake up for it, did
//! not gain).
//! The order rule
//! runs the other way too: a request's record carries the count of socket
//! messages the client sent before it, and the server takes it only once
//! it has read that many from the socket, so requests are served in the
//! order the client sent them, whatever path each took. An answer through
//! the ring follows the server's rule for notices above. A request that
//! does not fit goes on the socket; an attach whose answer carries
//! descriptors is answered on the socket.
//!
//! # Overflow
//! A notice that does not fit (the ring is full because the client does
//! not read, or the notice is longer than the ring's largest record) goes
//! on the socket instead, in order by the rule above, and the socket's
//! limits for a slow client apply to it as before
//! ([`ServerConfig::max_queued_frames`](crate::ServerConfig::max_queued_frames),
//! [`ServerConfig::send_timeout`](crate::ServerConfig::send_timeout)).
//! An ack that does not fit goes on the socket; acks need no order (an ack
//! for a lease already released is ignored).
//!
//! # Hostile peers
//! A client can write anything into its own memfd; the server never trusts
//! it: a ring whose counters or records are inconsistent, a record that
//! is not a well-formed `ack` (or request, when granted), or a consumer's
//! tail that cannot be, ends that client's connection (and only that
//! one's). A request from the ring is checked and answered exactly as one
//! from the socket, and one per turn of the connection's reader, so the
//! limit on answers waiting for a client holds; a request whose count
//! claims socket messages that never come stalls only its own connection.
//! The memfd is sealed against shrinking, so a client cannot make the
//! server fault. No descriptor the client is given shares state the
//! server depends on: the server sends the client its end of the wake-up
//! pair and closes its copy, and sends and reads its own end with
//! per-call non-blocking flags, so a client that changes its end's flags,
//! fills it, never reads it, or closes it cannot make a server thread
//! block (with an eventfd, whose file status flags every copy shares, a
//! client could clear `O_NONBLOCK` and freeze the server's next wake-up
//! write).
//!
//! # The socket as fallback
//! The socket carries the notices of every connection without the rings:
//! a client that does not ask (an older build), a server that cannot set
//! them up (it says so in its log and answers the `welcome` without
//! them), and any notice that does not fit (above). It is the fallback,
//! not a setting to choose: no environment variable changes the path.
//! [`ClientConfig::notices`](crate::ClientConfig::notices) and
//! [`ServerConfig::notices`](crate::ServerConfig::notices) set to
//! [`NoticePath::Socket`] force it, for tests and comparisons (either
//! side saying no keeps the socket).
//!
//! # Older peers
//! The request is an optional field of the `hello` (`shm_notices`), the
//! grant one of the `welcome`; neither is sent when it would say no. A
//! client of an older build never asks. A server of an older build refuses
//! the field (its decoding is strict) with a `malformed_frame` error
//! naming it, and [`Client::connect`](crate::Client::connect) then
//! connects again without asking. The binary records are not negotiated:
//! a peer built with shared-memory notices but before the binary form
//! (2026-12-01, never released) refuses them as a bad magic and ends the
//! connection; such a build is not supported.

use std::os::fd::OwnedFd;

use cuda_ipc_shm::{Area, Receiver, Sender, Side, wake_pair};

use crate::ChannelError;
use crate::wire::{HEADER_LEN, Message, WireError, decode_header};

mod binary;

pub(crate) use binary::encode_binary_record;

/// The capacity of each of a connection's two rings, in bytes (64 KiB).
pub const NOTICE_RING_BYTES: usize = cuda_ipc_shm::DEFAULT_CAPACITY;

/// How notices and acks travel between a server and a client.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum NoticePath {
    /// Through the shared-memory rings, when both sides agree and the
    /// rings can be set up, else on the socket (the default).
    #[default]
    Shm,
    /// On the socket, as every other message: the fallback path, forced
    /// (for tests and comparisons).
    Socket,
}

/// Whether the server sends this message through the ring when it can.
pub(crate) fn is_notice(message: &Message) -> bool {
    matches!(
        message,
        Message::Update { .. }
            | Message::RingFrame { .. }
            | Message::Unpublished { .. }
            | Message::RingLate { .. }
    )
}

/// Whether a client granted requests through the ring (the `welcome`'s
/// `shm_requests`) sends this message through it when it fits: the
/// requests whose order with the socket the server restores (see
/// [Requests](self#requests)).
pub(crate) fn is_ring_request(message: &Message) -> bool {
    matches!(
        message,
        Message::Ping { .. } | Message::Attach { .. } | Message::Release { .. }
    )
}

/// Whether the server may answer through the ring with this message, to
/// a client granted requests through it: an answer that carries no
/// descriptors.
pub(crate) fn is_ring_reply(message: &Message) -> bool {
    match message {
        Message::Pong { .. } | Message::Released { .. } => true,
        Message::Attached { fds, .. } => *fds == 0,
        Message::Error { id, .. } => id.is_some(),
        _ => false,
    }
}

/// A record: the socket message count, then an encoded wire message.
pub(crate) fn encode_record(after: u64, wire: &[u8]) -> Vec<u8> {
    let mut record = Vec::with_capacity(8 + wire.len());
    record.extend_from_slice(&after.to_le_bytes());
    record.extend_from_slice(wire);
    record
}

/// Decodes a record copied out of the ring: its count and its message,
/// checked as a message from the socket would be (a payload of at most
/// `max_payload` bytes, no descriptors).
pub(crate) fn decode_record(
    record: &[u8],
    max_payload: u32,
) -> Result<(u64, Message), ChannelError> {
    if let Some(decoded) = binary_record(record, max_payload) {
        return decoded;
    }
    let (count, payload) = record_payload(record, max_payload)?;
    Ok((count, Message::decode(payload)?))
}

/// A record in binary form, decoded; `None` if it is not one (its first
/// byte after the count is no binary tag).
fn binary_record(record: &[u8], max_payload: u32) -> Option<Result<(u64, Message), ChannelError>> {
    let (count, body) = record.split_first_chunk::<8>()?;
    let decoded = binary::decode_binary(body, max_payload)?;
    Some(decoded.map(|m| (u64::from_le_bytes(*count), m)))
}

/// Decodes a record from the ack ring as [`decode_record`] does, an ack
/// written as this build writes it (`{"type":"ack","lease":…,"slot":…,
/// "seq":…}`, no spaces, numbers without leading zeros) without the full
/// JSON decoder (25 ns against 470 ns a record, header checks included,
/// on the 2-core development VM). Anything
/// else, however close, goes to the full decoder, which remains the only
/// judge of what is valid (an older client's acks, any hostile bytes).
pub(crate) fn decode_ack_record(
    record: &[u8],
    max_payload: u32,
) -> Result<(u64, Message), ChannelError> {
    if let Some(decoded) = binary_record(record, max_payload) {
        return decoded;
    }
    let (count, payload) = record_payload(record, max_payload)?;
    if let Some((lease, slot, seq)) = plain_ack(payload) {
        return Ok((count, Message::Ack { lease, slot, seq }));
    }
    Ok((count, Message::decode(payload)?))
}

/// A shared-memory record decoded by both of the channel's readers: the
/// client's (`decode_record`) and the server's ack reader with its fast
/// path (`decode_ack_record`), with a payload limit of `max_payload`
/// bytes. Both take a record in either form, JSON or binary. For the
/// `notice_record` fuzz target and the tests that replay its corpus, which
/// check that the two always agree (and, with
/// [`binary_record_both_ways`], that the binary and JSON forms of a message
/// decode to it); not part of the API.
#[doc(hidden)]
pub fn decode_record_both_ways(
    record: &[u8],
    max_payload: u32,
) -> [Result<(u64, Message), ChannelError>; 2] {
    [
        decode_record(record, max_payload),
        decode_ack_record(record, max_payload),
    ]
}

/// The record of `message` after `after` socket messages in both forms:
/// binary, if the message has one (an ack, a ring frame or an update), and
/// JSON (a wire message without descriptors), if it fits in one. For the
/// `notice_record` fuzz target; not part of the API.
#[doc(hidden)]
pub fn binary_record_both_ways(after: u64, message: &Message) -> [Option<Vec<u8>>; 2] {
    [
        encode_binary_record(after, message),
        crate::wire::encode_message(message, 0)
            .ok()
            .map(|wire| encode_record(after, &wire)),
    ]
}

/// The fields of an ack payload in exactly the form `Message::encode`
/// writes, else `None`.
fn plain_ack(payload: &[u8]) -> Option<(u64, u32, u64)> {
    let rest = payload.strip_prefix(br#"{"type":"ack","lease":"#)?;
    let (lease, rest) = plain_number(rest)?;
    let rest = rest.strip_prefix(br#","slot":"#)?;
    let (slot, rest) = plain_number(rest)?;
    let rest = rest.strip_prefix(br#","seq":"#)?;
    let (seq, rest) = plain_number(rest)?;
    (rest == b"}").then_some((lease, u32::try_from(slot).ok()?, seq))
}

/// A `u64` in decimal digits without a leading zero (JSON's form), and
/// what follows it.
fn plain_number(bytes: &[u8]) -> Option<(u64, &[u8])> {
    let digits = bytes.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 || (digits > 1 && bytes[0] == b'0') {
        return None;
    }
    let mut value = 0u64;
    for b in &bytes[..digits] {
        value = value.checked_mul(10)?.checked_add(u64::from(b - b'0'))?;
    }
    Some((value, &bytes[digits..]))
}

/// A record's count and its payload, after the checks a message from the
/// socket gets (its header, a payload of at most `max_payload` bytes, no
/// descriptors).
fn record_payload(record: &[u8], max_payload: u32) -> Result<(u64, &[u8]), ChannelError> {
    let Some((count, wire)) = record.split_first_chunk::<8>() else {
        return Err(ChannelError::protocol(format!(
            "a shared-memory record of {} bytes is shorter than its 8-byte count",
            record.len()
        )));
    };
    let header = decode_header(wire)?;
    if header.len > max_payload {
        return Err(WireError::PayloadTooLarge {
            len: u64::from(header.len),
            max: max_payload,
        }
        .into());
    }
    if header.fds != 0 {
        return Err(ChannelError::protocol(
            "a shared-memory record announces file descriptors",
        ));
    }
    let payload = &wire[HEADER_LEN..];
    if payload.len() != header.len as usize {
        return Err(ChannelError::protocol(format!(
            "a shared-memory record's header announces {} payload bytes, it holds {}",
            header.len,
            payload.len()
        )));
    }
    Ok((u64::from_le_bytes(*count), payload))
}

/// The server's end of a new connection's rings: the descriptors for the
/// `welcome` (the memfd and the client's end of the wake-up pair: ours is
/// not among them, and these are closed here once sent), the notice
/// sender and the ack receiver.
pub(crate) fn server_rings() -> Result<(Vec<OwnedFd>, Sender, Receiver), ChannelError> {
    let (area, memfd) = Area::create(NOTICE_RING_BYTES).map_err(shm_error)?;
    let (ours, theirs) = wake_pair().map_err(shm_error)?;
    let (tx, rx) = area.split(Side::Creator, ours).map_err(shm_error)?;
    Ok((vec![memfd, theirs], tx, rx))
}

/// The client's end of the rings the server granted with `capacity`
/// bytes each and sent `fds` for: checks and maps the memfd (its seals
/// and size, so that the server cannot make us fault) and the wake-up
/// end, and returns the ack sender and the notice receiver.
pub(crate) fn client_rings(
    fds: Vec<OwnedFd>,
    capacity: u32,
) -> Result<(Sender, Receiver), ChannelError> {
    let Ok([memfd, wake]) = <[OwnedFd; 2]>::try_from(fds) else {
        return Err(ChannelError::protocol(
            "the server granted shared-memory notices without a memfd and a wake-up socket \
             (a server of another cuda-ipc version?); use the same version on both sides, or \
             CUDA_IPC_NOTICES=socket",
        ));
    };
    let area = Area::open(&memfd, capacity as usize).map_err(shm_error)?;
    area.split(Side::Opener, wake).map_err(shm_error)
}

/// A ring error as the channel reports it.
pub(crate) fn shm_error(e: cuda_ipc_shm::ShmError) -> ChannelError {
    match e {
        cuda_ipc_shm::ShmError::Io { context, source } => ChannelError::io(context, source),
        other => ChannelError::protocol(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{MAX_PAYLOAD, encode_message};
    use proptest::prelude::*;

    #[test]
    fn a_record_carries_its_count_and_message() {
        let m = Message::Ack {
            lease: 3,
            slot: 1,
            seq: 9,
        };
        let record = encode_record(42, &encode_message(&m, 0).unwrap());
        assert_eq!(decode_record(&record, MAX_PAYLOAD).unwrap(), (42, m));
    }

    #[test]
    fn short_or_inconsistent_records_are_errors() {
        let m = Message::Ping { id: 1 };
        let wire = encode_message(&m, 0).unwrap();
        assert!(decode_record(&[1, 2, 3], MAX_PAYLOAD).is_err());
        let mut cut = encode_record(0, &wire);
        cut.pop();
        assert!(decode_record(&cut, MAX_PAYLOAD).is_err());
        let mut long = encode_record(0, &wire);
        long.push(b' ');
        assert!(decode_record(&long, MAX_PAYLOAD).is_err());
        let with_fds = encode_record(0, &encode_message(&m, 2).unwrap());
        assert!(decode_record(&with_fds, MAX_PAYLOAD).is_err());
        let ok = encode_record(0, &wire);
        let e = decode_record(&ok, 4).unwrap_err();
        assert!(
            e.to_string().contains("exceeds the limit of 4 bytes"),
            "{e}"
        );
    }

    #[test]
    fn plain_acks_decode_as_the_full_decoder_does() {
        for (lease, slot, seq) in [(0, 0, 0), (1, 2, 3), (u64::MAX, u32::MAX, u64::MAX)] {
            let m = Message::Ack { lease, slot, seq };
            let payload = m.encode();
            assert_eq!(plain_ack(&payload), Some((lease, slot, seq)));
            let record = encode_record(5, &encode_message(&m, 0).unwrap());
            assert_eq!(decode_ack_record(&record, MAX_PAYLOAD).unwrap(), (5, m));
        }
    }

    #[test]
    fn near_misses_go_to_the_full_decoder() {
        let full = |text: &str| {
            let m = Message::Ping { id: 1 };
            let mut wire = encode_message(&m, 0).unwrap();
            wire.truncate(HEADER_LEN);
            wire[8..12].copy_from_slice(&(text.len() as u32).to_le_bytes());
            wire.extend_from_slice(text.as_bytes());
            decode_ack_record(&encode_record(0, &wire), MAX_PAYLOAD)
        };
        // Valid JSON the fast path does not take: the full decoder does.
        for ok in [
            r#"{"type":"ack","seq":3,"lease":1,"slot":2}"#,
            r#"{ "type":"ack","lease":1,"slot":2,"seq":3}"#,
        ] {
            assert_eq!(plain_ack(ok.as_bytes()), None, "{ok}");
            assert_eq!(
                full(ok).unwrap().1,
                Message::Ack {
                    lease: 1,
                    slot: 2,
                    seq: 3
                },
                "{ok}"
            );
        }
        // Not acks, or not valid: refused by both.
        for bad in [
            r#"{"type":"ack","lease":01,"slot":2,"seq":3}"#,
            r#"{"type":"ack","lease":1,"slot":4294967296,"seq":3}"#,
            r#"{"type":"ack","lease":18446744073709551616,"slot":2,"seq":3}"#,
            r#"{"type":"ack","lease":1,"slot":2,"seq":3}}"#,
            r#"{"type":"ack","lease":1,"slot":2,"seq":3,"x":0}"#,
            r#"{"type":"ack","lease":-1,"slot":2,"seq":3}"#,
            r#"{"type":"ack","lease":1,"slot":2,"seq":}"#,
            r#"{"type":"ack","lease":1,"slot":2,"seq":3"#,
        ] {
            assert_eq!(plain_ack(bad.as_bytes()), None, "{bad}");
            assert!(full(bad).is_err(), "{bad}");
        }
    }

    proptest! {
        #[test]
        fn every_ack_takes_the_fast_path(lease: u64, slot: u32, seq: u64) {
            let m = Message::Ack { lease, slot, seq };
            prop_assert_eq!(plain_ack(&m.encode()), Some((lease, slot, seq)));
        }

        #[test]
        fn the_fast_path_accepts_only_what_the_full_decoder_accepts(
            payload in prop_oneof![
                prop::collection::vec(any::<u8>(), 0..80),
                // Acks with a byte changed, cut or added.
                (any::<u64>(), any::<u32>(), any::<u64>(), any::<usize>(), any::<u8>(), 0..3u8)
                    .prop_map(|(lease, slot, seq, at, byte, how)| {
                        let mut p = Message::Ack { lease, slot, seq }.encode();
                        let at = at % p.len();
                        match how {
                            0 => p[at] = byte,
                            1 => p.truncate(at),
                            _ => p.insert(at, byte),
                        }
                        p
                    }),
            ],
        ) {
            if let Some((lease, slot, seq)) = plain_ack(&payload) {
                prop_assert_eq!(
                    Message::decode(&payload).ok(),
                    Some(Message::Ack { lease, slot, seq })
                );
            }
        }

        #[test]
        fn random_records_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode_record(&bytes, MAX_PAYLOAD);
            let _ = decode_ack_record(&bytes, MAX_PAYLOAD);
        }

        #[test]
        fn random_payloads_behind_a_valid_header_never_panic(
            payload in prop::collection::vec(any::<u8>(), 0..200),
        ) {
            let mut record = 7u64.to_le_bytes().to_vec();
            record.extend_from_slice(&crate::wire::encode_header(
                &crate::wire::Header::json(payload.len() as u32, 0),
            ));
            record.extend_from_slice(&payload);
            let _ = decode_record(&record, MAX_PAYLOAD);
            let _ = decode_ack_record(&record, MAX_PAYLOAD);
        }
    }
}
