//! The binary form of the hot records: updates, ring frames and acks.
//!
//! After a record's 8-byte count, a tag byte says how the rest is written:
//! `b'C'` (the first byte of a wire header's magic) for a whole wire
//! message (header and JSON payload), else one of the tags below, followed
//! by little-endian fields:
//!
//! ```text
//! tag  message     fields after the tag
//! 0xa1 ack         lease u64, slot u32, seq u64              (exactly 20 bytes)
//! 0xa2 ring_frame  lease u64, slot u32, seq u64, notice JSON (the rest)
//! 0xa3 update      lease u64, version u64, name length u32,
//!                  name (UTF-8, that many bytes), notice JSON (the rest)
//! ```
//!
//! Only the producer's notice stays JSON. Decoding is strict: the fixed
//! fields are bounds-checked before they are read, an ack has no trailing
//! bytes, a name is valid UTF-8 of exactly its length, the notice is one
//! JSON value of at most the payload limit, and what decodes equals what
//! the JSON form of the same message decodes to. A byte that is none of
//! these tags goes to the wire-message decoder, which refuses it as a bad
//! magic.

use serde_json::Value;

use crate::ChannelError;
use crate::wire::{Message, WireError};

/// The tag of a binary ack.
pub(super) const TAG_ACK: u8 = 0xa1;
/// The tag of a binary ring frame notice.
pub(super) const TAG_RING_FRAME: u8 = 0xa2;
/// The tag of a binary update notice.
pub(super) const TAG_UPDATE: u8 = 0xa3;

/// The record of `message` after `after` socket messages in binary form,
/// if it has one (an ack, a ring frame or an update).
pub(crate) fn encode_binary_record(after: u64, message: &Message) -> Option<Vec<u8>> {
    let mut r = Vec::with_capacity(64);
    r.extend_from_slice(&after.to_le_bytes());
    match message {
        Message::Ack { lease, slot, seq } => {
            r.push(TAG_ACK);
            r.extend_from_slice(&lease.to_le_bytes());
            r.extend_from_slice(&slot.to_le_bytes());
            r.extend_from_slice(&seq.to_le_bytes());
        }
        Message::RingFrame {
            lease,
            slot,
            seq,
            notice,
        } => {
            r.push(TAG_RING_FRAME);
            r.extend_from_slice(&lease.to_le_bytes());
            r.extend_from_slice(&slot.to_le_bytes());
            r.extend_from_slice(&seq.to_le_bytes());
            serde_json::to_writer(&mut r, notice).ok()?;
        }
        Message::Update {
            lease,
            name,
            version,
            notice,
        } => {
            r.push(TAG_UPDATE);
            r.extend_from_slice(&lease.to_le_bytes());
            r.extend_from_slice(&version.to_le_bytes());
            r.extend_from_slice(&u32::try_from(name.len()).ok()?.to_le_bytes());
            r.extend_from_slice(name.as_bytes());
            serde_json::to_writer(&mut r, notice).ok()?;
        }
        _ => return None,
    }
    Some(r)
}

/// Reads fixed-size fields off the front of a record's body, checking
/// each length before it reads.
struct Fields<'a> {
    rest: &'a [u8],
    what: &'static str,
}

impl<'a> Fields<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], ChannelError> {
        if self.rest.len() < n {
            return Err(ChannelError::protocol(format!(
                "a binary {} record ends {} bytes early",
                self.what,
                n - self.rest.len()
            )));
        }
        let (head, rest) = self.rest.split_at(n);
        self.rest = rest;
        Ok(head)
    }

    fn u64(&mut self) -> Result<u64, ChannelError> {
        let b = self.take(8)?;
        Ok(u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
    }

    fn u32(&mut self) -> Result<u32, ChannelError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes(b.try_into().unwrap_or([0; 4])))
    }
}

/// The producer's notice: one JSON value of at most `max_payload` bytes.
fn notice(bytes: &[u8], max_payload: u32, what: &str) -> Result<Value, ChannelError> {
    if bytes.len() > max_payload as usize {
        return Err(WireError::PayloadTooLarge {
            len: bytes.len() as u64,
            max: max_payload,
        }
        .into());
    }
    let value: Value = serde_json::from_slice(bytes).map_err(|e| {
        ChannelError::protocol(format!(
            "a binary {what} record's notice is not valid JSON: {e}"
        ))
    })?;
    if depth(&value) > MAX_NOTICE_DEPTH {
        return Err(ChannelError::protocol(format!(
            "a binary {what} record's notice nests deeper than {MAX_NOTICE_DEPTH} levels"
        )));
    }
    Ok(value)
}

/// The deepest nesting of arrays and objects the JSON decoder takes in a
/// message's notice: its limit of 128 levels, less one for the message
/// and one because it refuses the 128th (checked by a test), so that a
/// binary record decodes only what its JSON form would.
const MAX_NOTICE_DEPTH: usize = 126;

/// How deep arrays and objects nest in `value` (0 for a scalar). Recurses
/// at most as deep as the JSON decoder did.
fn depth(value: &Value) -> usize {
    match value {
        Value::Array(items) => 1 + items.iter().map(depth).max().unwrap_or(0),
        Value::Object(map) => 1 + map.values().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

/// Decodes the body of a binary record (what follows its count) whose
/// tag is one of ours; `None` if the first byte is no binary tag.
pub(super) fn decode_binary(
    body: &[u8],
    max_payload: u32,
) -> Option<Result<Message, ChannelError>> {
    let (&tag, rest) = body.split_first()?;
    let what = match tag {
        TAG_ACK => "ack",
        TAG_RING_FRAME => "ring_frame",
        TAG_UPDATE => "update",
        _ => return None,
    };
    let mut f = Fields { rest, what };
    Some(decode_fields(tag, &mut f, max_payload))
}

fn decode_fields(tag: u8, f: &mut Fields<'_>, max_payload: u32) -> Result<Message, ChannelError> {
    match tag {
        TAG_ACK => {
            let (lease, slot, seq) = (f.u64()?, f.u32()?, f.u64()?);
            if !f.rest.is_empty() {
                return Err(ChannelError::protocol(format!(
                    "a binary ack record has {} bytes after its fields",
                    f.rest.len()
                )));
            }
            Ok(Message::Ack { lease, slot, seq })
        }
        TAG_RING_FRAME => {
            let (lease, slot, seq) = (f.u64()?, f.u32()?, f.u64()?);
            let notice = notice(f.rest, max_payload, f.what)?;
            Ok(Message::RingFrame {
                lease,
                slot,
                seq,
                notice,
            })
        }
        _ => {
            let (lease, version, len) = (f.u64()?, f.u64()?, f.u32()?);
            if len > max_payload {
                return Err(WireError::PayloadTooLarge {
                    len: u64::from(len),
                    max: max_payload,
                }
                .into());
            }
            let name = std::str::from_utf8(f.take(len as usize)?)
                .map_err(|e| {
                    ChannelError::protocol(format!(
                        "a binary update record's name is not UTF-8 (valid up to byte {})",
                        e.valid_up_to()
                    ))
                })?
                .to_owned();
            let notice = notice(f.rest, max_payload, f.what)?;
            Ok(Message::Update {
                lease,
                name,
                version,
                notice,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::notices::{decode_ack_record, decode_record, encode_record};
    use crate::wire::{MAX_PAYLOAD, encode_message};
    use proptest::prelude::*;
    use serde_json::json;

    /// Both readers on `record`, which must agree.
    fn both(record: &[u8]) -> Result<(u64, Message), String> {
        let a = decode_record(record, MAX_PAYLOAD).map_err(|e| e.to_string());
        let b = decode_ack_record(record, MAX_PAYLOAD).map_err(|e| e.to_string());
        assert_eq!(a, b);
        a
    }

    fn json_record(after: u64, m: &Message) -> Vec<u8> {
        encode_record(after, &encode_message(m, 0).unwrap())
    }

    fn hot() -> impl Strategy<Value = Message> {
        let value = prop_oneof![
            Just(Value::Null),
            any::<i64>().prop_map(|n| json!(n)),
            any::<u64>().prop_map(|n| json!({ "step": n })),
            (-1.0e300f64..1.0e300).prop_map(|x| json!([x, "x"])),
            ".{0,20}".prop_map(|s| json!({ "s": s, "nested": { "a": [1, 2] } })),
        ];
        prop_oneof![
            (any::<u64>(), any::<u32>(), any::<u64>())
                .prop_map(|(lease, slot, seq)| Message::Ack { lease, slot, seq }),
            (any::<u64>(), any::<u32>(), any::<u64>(), value.clone()).prop_map(
                |(lease, slot, seq, notice)| Message::RingFrame {
                    lease,
                    slot,
                    seq,
                    notice,
                }
            ),
            (any::<u64>(), ".{0,24}", any::<u64>(), value).prop_map(
                |(lease, name, version, notice)| Message::Update {
                    lease,
                    name,
                    version,
                    notice,
                }
            ),
        ]
    }

    #[test]
    fn only_the_hot_messages_have_a_binary_form() {
        assert!(encode_binary_record(0, &Message::Ping { id: 1 }).is_none());
        let ack = Message::Ack {
            lease: 3,
            slot: 1,
            seq: 9,
        };
        let r = encode_binary_record(42, &ack).unwrap();
        assert_eq!(r.len(), 8 + 1 + 20);
        assert_eq!(r[8], TAG_ACK);
        assert_eq!(both(&r).unwrap(), (42, ack));
    }

    #[test]
    fn binary_records_are_checked_strictly() {
        let ack = encode_binary_record(
            1,
            &Message::Ack {
                lease: 3,
                slot: 1,
                seq: 9,
            },
        )
        .unwrap();
        let mut long = ack.clone();
        long.push(0);
        assert!(both(&long).unwrap_err().contains("bytes after its fields"));
        for cut in 9..ack.len() {
            assert!(both(&ack[..cut]).unwrap_err().contains("ends"), "{cut}");
        }
        let update = Message::Update {
            lease: 9,
            name: "weights".into(),
            version: 2,
            notice: json!({ "step": 1 }),
        };
        let r = encode_binary_record(5, &update).unwrap();
        assert_eq!(both(&r).unwrap(), (5, update));
        // A name longer than the record, a name that is not UTF-8, a
        // notice cut short or followed by more: errors.
        let mut bad = r.clone();
        bad[25..29].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(both(&bad).is_err());
        let mut bad = r.clone();
        bad[29] = 0xff;
        assert!(both(&bad).unwrap_err().contains("UTF-8"));
        assert!(both(&r[..r.len() - 1]).unwrap_err().contains("JSON"));
        let mut bad = r.clone();
        bad.extend_from_slice(b"{}");
        assert!(both(&bad).unwrap_err().contains("JSON"));
        // A notice over the payload limit.
        let e = decode_record(&r, 4).unwrap_err().to_string();
        assert!(e.contains("exceeds the limit of 4 bytes"), "{e}");
        // An unknown tag is a bad magic, as before.
        let mut bad = r;
        bad[8] = 0xa4;
        assert!(both(&bad).unwrap_err().contains("magic"));
    }

    #[test]
    fn notices_nest_as_deep_in_both_forms() {
        for levels in 120..132 {
            let text = "[".repeat(levels) + &"]".repeat(levels);
            let Ok(notice) = serde_json::from_str::<Value>(&text) else {
                continue;
            };
            let m = Message::RingFrame {
                lease: 1,
                slot: 0,
                seq: 1,
                notice,
            };
            let binary = both(&encode_binary_record(0, &m).unwrap()).is_ok();
            let json = both(&json_record(0, &m)).is_ok();
            assert_eq!(binary, json, "{levels} levels");
            assert_eq!(binary, levels <= MAX_NOTICE_DEPTH, "{levels} levels");
        }
    }

    proptest! {
        #[test]
        fn binary_records_round_trip(after: u64, m in hot()) {
            let r = encode_binary_record(after, &m).unwrap();
            prop_assert_eq!(both(&r).unwrap(), (after, m));
        }

        #[test]
        fn binary_and_json_forms_decode_equal(after: u64, m in hot()) {
            let binary = both(&encode_binary_record(after, &m).unwrap()).unwrap();
            let json = both(&json_record(after, &m)).unwrap();
            prop_assert_eq!(binary, json);
        }

        #[test]
        fn random_binary_bodies_never_panic(
            tag in prop_oneof![Just(TAG_ACK), Just(TAG_RING_FRAME), Just(TAG_UPDATE), any::<u8>()],
            body in prop::collection::vec(any::<u8>(), 0..120),
        ) {
            let mut r = 7u64.to_le_bytes().to_vec();
            r.push(tag);
            r.extend_from_slice(&body);
            let _ = both(&r);
        }

        #[test]
        fn damaged_binary_records_never_panic(
            m in hot(), at: usize, byte: u8, how in 0..3u8,
        ) {
            let mut r = encode_binary_record(1, &m).unwrap();
            let at = 8 + at % (r.len() - 8);
            match how {
                0 => r[at] = byte,
                1 => r.truncate(at),
                _ => r.insert(at, byte),
            }
            if let Ok((_, m)) = both(&r) {
                // Whatever decodes has a JSON form that decodes the same.
                prop_assert_eq!(both(&json_record(1, &m)).unwrap().1, m);
            }
        }
    }
}
