//! The wire format: round trips, the documented layout, precise errors.

use std::fmt::Write as _;

use proptest::prelude::*;
use serde_json::{Value, json};

use super::*;

#[test]
#[allow(clippy::too_many_lines)] // one sample of every message
fn type_names_match_serde_tags() {
    let samples = [
        Message::Hello {
            protocol: 1,
            pid: 1,
            shm_notices: true,
            shm_requests: true,
        },
        Message::List { id: 1, after: None },
        Message::Attach {
            id: 1,
            name: "a".into(),
        },
        Message::Release { id: 1, lease: 2 },
        Message::AttachRing {
            id: 1,
            name: "r".into(),
        },
        Message::Ack {
            lease: 1,
            slot: 0,
            seq: 1,
        },
        Message::Ping { id: 1 },
        Message::Welcome {
            protocol: 1,
            pid: 1,
            shm_notices: None,
            shm_requests: false,
            restarts: false,
        },
        Message::Listing {
            id: 1,
            entries: vec![],
            next: None,
        },
        Message::Attached {
            id: 1,
            lease: 1,
            meta: Arc::new(json!({}).into()),
            fds: 0,
        },
        Message::Released { id: 1 },
        Message::RingAttached {
            id: 1,
            lease: 1,
            slots: 1,
            meta: Arc::new(json!(null).into()),
        },
        Message::RingSlot {
            id: 1,
            lease: 1,
            slot: 0,
            meta: json!(1),
            fds: 0,
        },
        Message::Update {
            lease: 1,
            name: "a".into(),
            version: 1,
            notice: json!([]),
        },
        Message::RingFrame {
            lease: 1,
            slot: 0,
            seq: 1,
            notice: json!("x"),
        },
        Message::Unpublished {
            lease: 1,
            name: "a".into(),
        },
        Message::Pong { id: 1 },
        Message::Error {
            id: None,
            code: "c".into(),
            message: "m".into(),
            details: Value::Null,
        },
        Message::RingLate {
            lease: 1,
            stale_through: 3,
            evicted: false,
            reason: "late".into(),
        },
        Message::Call {
            id: 1,
            method: "ls".into(),
            body: json!({}),
        },
        Message::Reply {
            id: 1,
            body: json!({"sets": []}),
        },
    ];
    assert_eq!(samples.len(), Message::TYPES.len());
    for (m, t) in samples.iter().zip(Message::TYPES) {
        assert_eq!(m.type_name(), *t);
        let v: Value = serde_json::from_slice(&m.encode()).unwrap();
        assert_eq!(v["type"], json!(t));
        assert_eq!(&Message::decode(&m.encode()).unwrap(), m);
    }
}

#[test]
fn header_round_trips() {
    let h = Header::json(1234, 3);
    let bytes = encode_header(&h);
    assert_eq!(&bytes[..4], b"CIPC");
    assert_eq!(bytes.len(), HEADER_LEN);
    assert_eq!(decode_header(&bytes).unwrap(), h);
    // Trailing bytes are ignored.
    let mut longer = bytes.to_vec();
    longer.extend_from_slice(b"{}");
    assert_eq!(decode_header(&longer).unwrap(), h);
    // The layout is little-endian, as documented.
    assert_eq!(
        bytes,
        [
            b'C', b'I', b'P', b'C', 1, 0, 1, 0, 0xd2, 0x04, 0, 0, 3, 0, 0, 0
        ]
    );
}

#[test]
fn malformed_headers_are_rejected_precisely() {
    let good = encode_header(&Header::json(10, 0));
    let with = |f: &dyn Fn(&mut [u8; HEADER_LEN])| {
        let mut b = good;
        f(&mut b);
        decode_header(&b).unwrap_err()
    };

    assert_eq!(
        decode_header(&good[..7]).unwrap_err(),
        WireError::Truncated {
            what: "wire header",
            expected: 16,
            got: 7
        }
    );
    assert_eq!(
        with(&|b| b[..4].copy_from_slice(b"HTTP")),
        WireError::BadMagic { found: *b"HTTP" }
    );
    assert_eq!(
        with(&|b| b[4] = 2),
        WireError::UnsupportedVersion {
            found: 2,
            supported: PROTOCOL_VERSION
        }
    );
    assert_eq!(with(&|b| b[6] = 9), WireError::UnknownKind { found: 9 });
    assert_eq!(
        with(&|b| b[15] = 1),
        WireError::ReservedNotZero { found: 0x100 }
    );
    assert_eq!(
        with(&|b| b[8..12].copy_from_slice(&(MAX_PAYLOAD + 1).to_le_bytes())),
        WireError::PayloadTooLarge {
            len: u64::from(MAX_PAYLOAD) + 1,
            max: MAX_PAYLOAD
        }
    );
    assert_eq!(
        with(&|b| b[12] = 17),
        WireError::TooManyFds {
            count: 17,
            max: MAX_FDS
        }
    );
    // The limits themselves are accepted.
    assert!(decode_header(&encode_header(&Header::json(MAX_PAYLOAD, MAX_FDS as u16))).is_ok());

    // Messages say what was found and what was expected.
    let text = with(&|b| b[4] = 2).to_string();
    assert!(
        text.contains("version 2") && text.contains("speaks version 1"),
        "{text}"
    );
    let text = with(&|b| b[..4].copy_from_slice(b"HTTP")).to_string();
    assert!(
        text.contains("bad magic") && text.contains("CIPC"),
        "{text}"
    );
}

#[test]
fn messages_round_trip_and_match_the_documented_json() {
    let m = Message::Attach {
        id: 7,
        name: "weights".into(),
    };
    assert_eq!(
        serde_json::from_slice::<Value>(&m.encode()).unwrap(),
        json!({"type": "attach", "id": 7, "name": "weights"})
    );
    assert_eq!(Message::decode(&m.encode()).unwrap(), m);

    let e = Message::Error {
        id: None,
        code: "refused".into(),
        message: "no".into(),
        details: json!({"uid": 5}),
    };
    assert_eq!(Message::decode(&e.encode()).unwrap(), e);
    // An update's version travels under its protocol-1 key, "generation".
    let u = Message::Update {
        lease: 3,
        name: "w".into(),
        version: 2,
        notice: json!(null),
    };
    assert_eq!(
        serde_json::from_slice::<Value>(&u.encode()).unwrap(),
        json!({"type": "update", "lease": 3, "name": "w", "generation": 2, "notice": null})
    );
    assert_eq!(
        Message::decode(br#"{"type":"update","lease":3,"name":"w","generation":2,"notice":null}"#)
            .unwrap(),
        u
    );
    // Optional fields may be left out.
    assert_eq!(
        Message::decode(br#"{"type":"list","id":1}"#).unwrap(),
        Message::List { id: 1, after: None }
    );
    assert_eq!(
        Message::decode(br#"{"type":"error","id":null,"code":"c","message":"m"}"#).unwrap(),
        Message::Error {
            id: None,
            code: "c".into(),
            message: "m".into(),
            details: Value::Null
        }
    );

    let frame = encode_message(&m, 0).unwrap();
    let h = decode_header(&frame).unwrap();
    assert_eq!(h.kind, KIND_JSON);
    assert_eq!(h.len as usize, frame.len() - HEADER_LEN);
    assert_eq!(Message::decode(&frame[HEADER_LEN..]).unwrap(), m);
}

#[test]
fn malformed_payloads_are_rejected_precisely() {
    let err = |bytes: &[u8]| Message::decode(bytes).unwrap_err();

    assert_eq!(
        err(b"{\"type\":\"ping\",\"id\":1\xff}"),
        WireError::InvalidUtf8 { valid_up_to: 21 }
    );
    assert!(matches!(err(b""), WireError::InvalidJson { .. }));
    assert!(matches!(err(b"{\"type\":"), WireError::InvalidJson { .. }));
    assert!(matches!(err(b"{} x"), WireError::InvalidJson { .. }));
    let deep = "[".repeat(10_000);
    assert!(matches!(
        err(deep.as_bytes()),
        WireError::InvalidJson { .. }
    ));

    assert!(matches!(err(b"[1,2]"), WireError::NotAMessage { found } if found == "an array"));
    assert!(
        matches!(err(b"{\"id\":1}"), WireError::NotAMessage { found } if found.contains("without"))
    );
    assert!(
        matches!(err(b"{\"type\":5}"), WireError::NotAMessage { found } if found.contains("a number"))
    );
    assert_eq!(
        err(br#"{"type":"frobnicate"}"#),
        WireError::UnknownType {
            found: "frobnicate".into()
        }
    );
    let missing = err(br#"{"type":"attach","id":1}"#);
    assert!(
        matches!(&missing, WireError::InvalidMessage { kind, reason } if kind == "attach" && reason.contains("name")),
        "{missing:?}"
    );
    let extra = err(br#"{"type":"ping","id":1,"extra":true}"#);
    assert!(
        matches!(&extra, WireError::InvalidMessage { reason, .. } if reason.contains("unknown field")),
        "{extra:?}"
    );
    let wrong = err(br#"{"type":"hello","protocol":70000,"pid":1}"#);
    assert!(
        matches!(&wrong, WireError::InvalidMessage { reason, .. } if reason.contains("70000")),
        "{wrong:?}"
    );
    let negative = err(br#"{"type":"ping","id":-1}"#);
    assert!(matches!(negative, WireError::InvalidMessage { .. }));

    let big = vec![b' '; MAX_PAYLOAD as usize + 1];
    assert!(matches!(err(&big), WireError::PayloadTooLarge { .. }));

    // The unknown-type message lists the known types.
    let text = err(br#"{"type":"frobnicate"}"#).to_string();
    assert!(
        text.contains("attach_ring") && text.contains("frobnicate"),
        "{text}"
    );
}

#[test]
fn encode_message_enforces_limits() {
    let huge = Message::Attached {
        id: 1,
        lease: 1,
        meta: Arc::new(Value::String("x".repeat(MAX_PAYLOAD as usize)).into()),
        fds: 0,
    };
    assert!(matches!(
        encode_message(&huge, 0),
        Err(WireError::PayloadTooLarge { .. })
    ));
    assert!(matches!(
        encode_message(&Message::Ping { id: 1 }, MAX_FDS + 1),
        Err(WireError::TooManyFds { .. })
    ));
}

fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        ".{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map(".{0,6}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

// One arm per message type.
#[allow(clippy::too_many_lines)]
fn arb_message() -> impl Strategy<Value = Message> {
    let name = ".{0,16}";
    prop_oneof![
        (any::<u16>(), any::<u32>(), any::<bool>(), any::<bool>()).prop_map(
            |(protocol, pid, shm_notices, shm_requests)| Message::Hello {
                protocol,
                pid,
                shm_notices,
                shm_requests,
            }
        ),
        (any::<u64>(), prop::option::of(name)).prop_map(|(id, after)| Message::List { id, after }),
        (any::<u64>(), name).prop_map(|(id, name)| Message::Attach { id, name }),
        (any::<u64>(), any::<u64>()).prop_map(|(id, lease)| Message::Release { id, lease }),
        (any::<u64>(), name).prop_map(|(id, name)| Message::AttachRing { id, name }),
        (any::<u64>(), any::<u32>(), any::<u64>()).prop_map(|(lease, slot, seq)| Message::Ack {
            lease,
            slot,
            seq
        }),
        any::<u64>().prop_map(|id| Message::Ping { id }),
        (
            any::<u16>(),
            any::<u32>(),
            prop::option::of(any::<u32>()),
            any::<bool>(),
            any::<bool>()
        )
            .prop_map(|(protocol, pid, shm_notices, shm_requests, restarts)| {
                Message::Welcome {
                    protocol,
                    pid,
                    shm_notices,
                    shm_requests,
                    restarts,
                }
            }),
        (
            any::<u64>(),
            prop::collection::vec(
                (name, any::<bool>(), arb_json()).prop_map(|(name, ring, meta)| {
                    ListedEntry {
                        name,
                        kind: if ring {
                            EntryKind::Ring
                        } else {
                            EntryKind::Entry
                        },
                        meta,
                    }
                }),
                0..3
            ),
            prop::option::of(name)
        )
            .prop_map(|(id, entries, next)| Message::Listing { id, entries, next }),
        (any::<u64>(), any::<u64>(), arb_json(), any::<u16>()).prop_map(
            |(id, lease, meta, fds)| Message::Attached {
                id,
                lease,
                meta: Arc::new(meta.into()),
                fds
            }
        ),
        any::<u64>().prop_map(|id| Message::Released { id }),
        (any::<u64>(), any::<u64>(), any::<u32>(), arb_json()).prop_map(
            |(id, lease, slots, meta)| Message::RingAttached {
                id,
                lease,
                slots,
                meta: Arc::new(meta.into())
            }
        ),
        (
            any::<u64>(),
            any::<u64>(),
            any::<u32>(),
            arb_json(),
            any::<u16>()
        )
            .prop_map(|(id, lease, slot, meta, fds)| Message::RingSlot {
                id,
                lease,
                slot,
                meta,
                fds
            }),
        (any::<u64>(), name, any::<u64>(), arb_json()).prop_map(
            |(lease, name, version, notice)| Message::Update {
                lease,
                name,
                version,
                notice
            }
        ),
        (any::<u64>(), any::<u32>(), any::<u64>(), arb_json()).prop_map(
            |(lease, slot, seq, notice)| Message::RingFrame {
                lease,
                slot,
                seq,
                notice
            }
        ),
        (any::<u64>(), name).prop_map(|(lease, name)| Message::Unpublished { lease, name }),
        any::<u64>().prop_map(|id| Message::Pong { id }),
        (prop::option::of(any::<u64>()), name, name, arb_json()).prop_map(
            |(id, code, message, details)| Message::Error {
                id,
                code,
                message,
                details
            }
        ),
        (any::<u64>(), any::<u64>(), any::<bool>(), name).prop_map(
            |(lease, stale_through, evicted, reason)| Message::RingLate {
                lease,
                stale_through,
                evicted,
                reason
            }
        ),
        arb_call_or_reply(),
    ]
}

fn arb_call_or_reply() -> impl Strategy<Value = Message> {
    prop_oneof![
        (any::<u64>(), ".{0,16}", arb_json()).prop_map(|(id, method, body)| Message::Call {
            id,
            method,
            body
        }),
        (any::<u64>(), arb_json()).prop_map(|(id, body)| Message::Reply { id, body }),
    ]
}

/// Text that looks like messages, to get past the JSON parser into the
/// message checks.
fn arb_message_like() -> impl Strategy<Value = String> {
    let ty = prop_oneof![
        prop::sample::select(Message::TYPES.to_vec()).prop_map(str::to_owned),
        "[a-z_]{0,12}",
    ];
    let field = prop_oneof![
        Just("id"),
        Just("name"),
        Just("lease"),
        Just("slot"),
        Just("seq"),
        Just("meta"),
        Just("fds"),
        Just("protocol"),
        Just("pid"),
        Just("code"),
        Just("message"),
        Just("entries"),
        Just("method"),
        Just("body"),
        Just("x"),
    ];
    let value = prop_oneof![
        Just("1".to_owned()),
        Just("-1".to_owned()),
        Just("null".to_owned()),
        Just("\"s\"".to_owned()),
        Just("[]".to_owned()),
        Just("{}".to_owned()),
        Just("1e400".to_owned()),
        Just("18446744073709551616".to_owned()),
        any::<u64>().prop_map(|n| n.to_string()),
    ];
    (ty, prop::collection::vec((field, value), 0..6)).prop_map(|(ty, fields)| {
        let mut s = format!("{{\"type\":\"{ty}\"");
        for (f, v) in fields {
            let _ = write!(s, ",\"{f}\":{v}");
        }
        s.push('}');
        s
    })
}

proptest! {
    #[test]
    fn decode_header_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..40)) {
        let _ = decode_header(&bytes);
    }

    #[test]
    fn decode_header_accepts_exactly_valid_headers(len in any::<u32>(), fds in any::<u16>()) {
        let bytes = encode_header(&Header::json(len, fds));
        let valid = len <= MAX_PAYLOAD && usize::from(fds) <= MAX_FDS;
        prop_assert_eq!(decode_header(&bytes).is_ok(), valid);
        if valid {
            prop_assert_eq!(decode_header(&bytes).unwrap(), Header::json(len, fds));
        }
    }

    #[test]
    fn message_decode_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = Message::decode(&bytes);
    }

    #[test]
    fn message_decode_never_panics_on_message_like_json(text in arb_message_like()) {
        let _ = Message::decode(text.as_bytes());
    }

    /// The one-pass readings of `decode` decide as `diagnose`'s checks
    /// do: the same message, or the same error.
    #[test]
    fn fast_paths_agree_with_the_checks(text in prop_oneof![
        arb_message_like(),
        arb_message().prop_map(|m| String::from_utf8(m.encode()).unwrap()),
    ]) {
        prop_assert_eq!(Message::decode(text.as_bytes()), Message::diagnose(&text));
    }

    #[test]
    fn messages_round_trip(m in arb_message()) {
        let bytes = m.encode();
        prop_assert_eq!(Message::decode(&bytes).unwrap(), m.clone());
        let frame = encode_message(&m, 0).unwrap();
        let h = decode_header(&frame).unwrap();
        prop_assert_eq!(h.len as usize, bytes.len());
    }
}

/// The corpora of the `frame_header` and `frame_message` fuzz targets, through
/// the properties only this crate can check: what decodes is framed by
/// [`encode_message`] and [`encode_header`] into bytes that decode again.
#[test]
fn fuzz_corpora_round_trip_through_the_encoders() {
    let corpus = |target: &str| {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../fuzz/corpus")
            .join(target);
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        assert!(!files.is_empty(), "{} is empty", dir.display());
        files.into_iter().map(|p| std::fs::read(p).unwrap())
    };
    for data in corpus("frame_header") {
        if let Ok(h) = decode_header(&data) {
            assert_eq!(&encode_header(&h)[..], &data[..HEADER_LEN]);
        }
    }
    for data in corpus("frame_message") {
        let Ok(m) = Message::decode(&data) else {
            continue;
        };
        match encode_message(&m, m.fd_count()) {
            Ok(bytes) => {
                let h = decode_header(&bytes).expect("encode_message wrote a bad header");
                assert_eq!(h.len as usize, bytes.len() - HEADER_LEN);
                assert_eq!(usize::from(h.fds), m.fd_count());
                assert_eq!(Message::decode(&bytes[HEADER_LEN..]).as_ref(), Ok(&m));
            }
            // A message may announce more descriptors than a wire message
            // carries, or re-encode longer than it came (1E2 -> 100.0).
            Err(e) => assert!(
                matches!(
                    e,
                    WireError::TooManyFds { .. } | WireError::PayloadTooLarge { .. }
                ),
                "encode_message failed with {e:?}"
            ),
        }
    }
}

#[test]
fn calls_and_replies_match_the_documented_json_and_are_strict() {
    let call = Message::Call {
        id: 4,
        method: "drop".into(),
        body: json!({"set": "model", "force": false}),
    };
    assert_eq!(
        serde_json::from_slice::<Value>(&call.encode()).unwrap(),
        json!({"type": "call", "id": 4, "method": "drop", "body": {"set": "model", "force": false}})
    );
    assert!(call.is_client_message());
    assert_eq!(call.fd_count(), 0);
    let reply = Message::Reply {
        id: 4,
        body: json!({"dropped": "model"}),
    };
    assert!(!reply.is_client_message());
    assert_eq!(Message::decode(&reply.encode()).unwrap(), reply);
    // A body is required (null is one), and nothing else may come along.
    let missing = Message::decode(br#"{"type":"call","id":1,"method":"ls"}"#).unwrap_err();
    assert!(
        matches!(&missing, WireError::InvalidMessage { kind, reason } if kind == "call" && reason.contains("body")),
        "{missing:?}"
    );
    assert!(Message::decode(br#"{"type":"call","id":1,"method":"ls","body":null}"#).is_ok());
    let extra = Message::decode(br#"{"type":"reply","id":1,"body":{},"fds":1}"#).unwrap_err();
    assert!(
        matches!(&extra, WireError::InvalidMessage { reason, .. } if reason.contains("unknown field")),
        "{extra:?}"
    );
}

/// An attach's answer read on its own path keeps every check of the enum:
/// each of these decodes as `diagnose` decides, and the valid one to the
/// message.
#[test]
fn attached_answers_keep_the_checks() {
    let cases = [
        r#"{"type":"attached","id":1,"lease":2,"meta":{"a":[1,2]},"fds":0}"#,
        r#"  {"type":"attached","id":1,"lease":2,"meta":null,"fds":3}"#,
        r#"{"type":"attached","id":1,"lease":2,"meta":{},"fds":0,"x":1}"#,
        r#"{"type":"attached","id":1,"lease":2,"fds":0}"#,
        r#"{"type":"attached","id":-1,"lease":2,"meta":{},"fds":0}"#,
        r#"{"type":"attached","id":1,"lease":2,"meta":{},"fds":70000}"#,
        r#"{"type":"attached","type":"attached","id":1,"lease":2,"meta":{},"fds":0}"#,
        r#"{"type":"attached","id":1,"id":1,"lease":2,"meta":{},"fds":0}"#,
        r#"{"type":"attached","id":1,"lease":2,"meta":{},"fds":0} x"#,
        r#"["attached",1,2,{},0]"#,
    ];
    for text in cases {
        assert_eq!(
            Message::decode(text.as_bytes()),
            Message::diagnose(text),
            "{text}"
        );
    }
    assert_eq!(
        Message::decode(cases[0].as_bytes()).unwrap(),
        Message::Attached {
            id: 1,
            lease: 2,
            meta: Arc::new(json!({"a": [1, 2]}).into()),
            fds: 0,
        }
    );
    for text in &cases[2..] {
        assert!(Message::decode(text.as_bytes()).is_err(), "{text}");
    }
}
