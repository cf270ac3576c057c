//! What the exchange puts in the channel's JSON: the metadata of entries and
//! rings, and the notices of updates and ring frames, as typed records. The
//! channel carries them as `serde_json::Value`; the field names are the wire
//! format (the Python module reads the same records), so they don't change.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::descriptor::Descriptor;
use crate::error::{Error, Result};
use crate::fence::FenceBlock;
use crate::handle::IpcEventHandle;

/// The metadata of a published buffer, or of one slot of a ring.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct EntryMeta {
    /// The descriptor, as [`Descriptor::to_value`] writes it; decoded by
    /// [`Descriptor::from_value`], whose errors name the field.
    descriptor: Value,
    /// The fence signalled with every publish and update (absent when the
    /// publisher has none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    fence: Option<FenceMeta>,
}

impl EntryMeta {
    pub(super) fn new(descriptor: &Descriptor) -> Self {
        Self::with_fence(descriptor, None)
    }

    /// The metadata of an entry whose publishes also signal `fence`.
    pub(super) fn with_fence(descriptor: &Descriptor, fence: Option<FenceMeta>) -> Self {
        EntryMeta {
            descriptor: descriptor.to_value(),
            fence,
        }
    }

    /// Decodes an entry's metadata and its descriptor.
    pub(super) fn decode(meta: &Value) -> Result<Descriptor> {
        Ok(Self::decode_with_fence(meta)?.0)
    }

    /// Decodes an entry's metadata: its descriptor and fence.
    pub(super) fn decode_with_fence(meta: &Value) -> Result<(Descriptor, Option<FenceMeta>)> {
        let m = EntryMeta::deserialize(meta).map_err(|e| Error::Descriptor {
            field: "descriptor".into(),
            reason: format!(
                "the entry's metadata is not {{\"descriptor\": ..., \"fence\": ...}}: {e}"
            ),
        })?;
        Ok((Descriptor::from_value(&m.descriptor)?, m.fence))
    }
}

/// The metadata of a ring as a whole.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct RingMeta {
    /// The size of every slot, in bytes.
    pub(super) slot_bytes: usize,
}

/// The body of an update's notice (the channel's `Notice::Updated::data`):
/// nothing beyond the channel's own fields (the event to wait on is the
/// publisher's, named by the descriptor).
#[derive(Debug, Default, Serialize, Deserialize)]
pub(super) struct UpdateBody {
    /// The sequence number the entry's fence word reaches after the update.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) fence_seq: Option<u64>,
}

/// The body of a ring frame's notice (the channel's `FrameNotice::notice`):
/// the producer's extra fields and the event recorded after the slot was
/// written (none from a fences-only ring).
#[derive(Debug, PartialEq, Serialize, Deserialize)]
pub(super) struct FrameBody {
    /// The ring's interprocess event, as hex; absent where the ring
    /// records none ([`RingSync::FencesOnly`](super::RingSync::FencesOnly)).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) event: Option<IpcEventHandle>,
    /// The sequence number the slot's fence word reaches with this frame.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) fence_seq: Option<u64>,
    /// The producer's own fields (a timestamp, a frame number).
    #[serde(flatten)]
    pub(super) extra: Map<String, Value>,
}

impl FrameBody {
    /// Decodes a frame's notice.
    pub(super) fn decode(notice: &Value) -> Result<Self> {
        FrameBody::deserialize(notice).map_err(|e| {
            Error::arg(
                "ring frame",
                format!(
                    "the frame's notice is not one a ring sends (an event handle in hex where \
                     the ring records events, a fence_seq number, the producer's fields): {e}"
                ),
            )
        })
    }
}

/// A record as the channel carries it.
pub(super) fn to_value(record: &impl Serialize) -> Result<Value> {
    serde_json::to_value(record)
        .map_err(|e| Error::arg("exchange record", format!("cannot be written as JSON: {e}")))
}

/// What an entry's or slot's metadata says about its fence: the block (its
/// file descriptor is `fds[fd]` of the entry's), the word to wait on and
/// the word that announces what to wait for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FenceMeta {
    /// The block.
    pub(super) block: FenceBlock,
    /// The index of the block's file descriptor among the entry's.
    pub(super) fd: usize,
    /// The word the device signals.
    pub(super) word: u32,
    /// The word announcing the last sequence number queued; `None` for ring
    /// slots (each frame's notice says it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) announce: Option<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    /// Small JSON values of every kind.
    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            "[a-f0-9]{0,130}".prop_map(Value::from),
            ".{0,8}".prop_map(Value::from),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
                prop::collection::btree_map("[a-z_]{1,9}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Whatever a peer puts in a frame's notice (the keys a frame has,
        /// with values of any type, and others), decoding returns a body
        /// or an error that names the ring frame, never a panic; a body
        /// that decodes encodes back to a notice that decodes to it.
        #[test]
        fn frame_notices_decode_or_are_refused(
            event in prop::option::of(arb_json()),
            fence_seq in prop::option::of(arb_json()),
            extra in prop::collection::btree_map("[a-z_]{1,9}", arb_json(), 0..4),
        ) {
            let mut m: Map<String, Value> = extra.into_iter().collect();
            if let Some(e) = event {
                m.insert("event".into(), e);
            }
            if let Some(f) = fence_seq {
                m.insert("fence_seq".into(), f);
            }
            match FrameBody::decode(&Value::Object(m)) {
                Err(e) => prop_assert!(e.to_string().contains("ring frame"), "{}", e),
                Ok(body) => {
                    let again = FrameBody::decode(&to_value(&body).unwrap()).unwrap();
                    prop_assert_eq!(again, body);
                }
            }
        }

        /// A frame as a ring sends it, with or without an event, comes back
        /// whole, the producer's fields beside it.
        #[test]
        fn frame_bodies_round_trip(
            handle in prop::option::of(prop::array::uniform32(any::<u8>())),
            fence_seq in prop::option::of(any::<u64>()),
            extra in prop::collection::btree_map("[a-d]{1,6}", arb_json(), 0..4),
        ) {
            let event = handle.map(|h| {
                let mut bytes = [0u8; 64];
                bytes[..32].copy_from_slice(&h);
                IpcEventHandle::from(bytes)
            });
            let body = FrameBody { event, fence_seq, extra: extra.into_iter().collect() };
            let back = FrameBody::decode(&to_value(&body).unwrap()).unwrap();
            prop_assert_eq!(back, body);
        }
    }

    #[test]
    fn frame_notices_keep_the_producer_fields_beside_the_event() {
        let event = IpcEventHandle::from([7; 64]);
        let mut extra = Map::new();
        extra.insert("stamp".into(), json!(42));
        let v = to_value(&FrameBody {
            event: Some(event),
            fence_seq: Some(9),
            extra,
        })
        .unwrap();
        assert_eq!(v["fence_seq"], 9);
        assert_eq!(v["stamp"], 42);
        assert_eq!(v["event"], event.to_string());
        let back = FrameBody::decode(&v).unwrap();
        assert_eq!(back.event, Some(event));
        assert_eq!(back.extra["stamp"], 42);
        assert_eq!(back.fence_seq, Some(9));
        assert!(!back.extra.contains_key("fence_seq"));
    }

    #[test]
    fn a_fences_only_frame_carries_no_event() {
        let mut extra = Map::new();
        extra.insert("stamp".into(), json!(42));
        let v = to_value(&FrameBody {
            event: None,
            fence_seq: Some(3),
            extra,
        })
        .unwrap();
        assert_eq!(v, json!({ "fence_seq": 3, "stamp": 42 }));
        let back = FrameBody::decode(&v).unwrap();
        assert_eq!(back.event, None);
        assert_eq!(back.fence_seq, Some(3));
        assert_eq!(back.extra["stamp"], 42);
        assert!(!back.extra.contains_key("event"));
    }

    #[test]
    fn bad_records_say_what_is_wrong() {
        let e = FrameBody::decode(&json!({ "event": 7 })).unwrap_err();
        assert!(e.to_string().contains("event"), "{e}");
        let e = FrameBody::decode(&json!({ "event": "zz" })).unwrap_err();
        assert!(e.to_string().contains("ring frame"), "{e}");
        let e = EntryMeta::decode(&json!({ "descriptr": {} })).unwrap_err();
        assert!(e.to_string().contains("descriptor"), "{e}");
        assert_eq!(to_value(&UpdateBody::default()).unwrap(), json!({}));
        assert_eq!(
            to_value(&RingMeta { slot_bytes: 4096 }).unwrap(),
            json!({ "slot_bytes": 4096 })
        );
    }
}
