//! The wire format: a fixed 16-byte header, then a UTF-8 JSON payload.
//!
//! ```text
//! offset size field
//!      0    4 magic            b"CIPC"
//!      4    2 protocol version u16 little-endian, PROTOCOL_VERSION (1)
//!      6    2 payload kind     u16 little-endian, KIND_JSON (1)
//!      8    4 payload length   u32 little-endian, at most MAX_PAYLOAD
//!     12    2 fd count         u16 little-endian, at most MAX_FDS
//!     14    2 reserved         must be 0
//! ```
//!
//! The payload is one [`Message`], a JSON object whose `"type"` field names
//! the message (`{"type":"attach","id":7,"name":"weights"}`). The file
//! descriptors announced in the header travel as `SCM_RIGHTS` ancillary
//! data with the header's bytes (see `socket.rs`).
//!
//! Everything here is a pure function of its input and never panics:
//! decoding checks every field and reports the first problem precisely
//! ([`WireError`]), naming what it found and what it expected. Decoding is
//! strict: unknown message types and unknown fields are errors, since both
//! sides speak the same protocol version.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;

mod error;
mod meta;

pub use error::WireError;
pub use meta::Meta;

/// The magic bytes that start every message.
pub(crate) const MAGIC: [u8; 4] = *b"CIPC";

/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: u16 = 1;

/// The payload kind of a JSON message, the only kind so far.
pub(crate) const KIND_JSON: u16 = 1;

/// The size of a wire header in bytes.
pub const HEADER_LEN: usize = 16;

/// The largest payload a message may carry (1 MiB).
pub const MAX_PAYLOAD: u32 = 1 << 20;

/// The most file descriptors one message may carry.
pub const MAX_FDS: usize = 16;

/// A decoded wire header.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Header {
    /// The protocol version.
    pub version: u16,
    /// The payload kind (1: a JSON message, the only kind so far).
    pub kind: u16,
    /// The payload length in bytes.
    pub len: u32,
    /// The number of file descriptors sent with the message.
    pub fds: u16,
}

impl Header {
    /// A header of the current version for a JSON payload of `len` bytes
    /// with `fds` descriptors.
    pub(crate) fn json(len: u32, fds: u16) -> Header {
        Header {
            version: PROTOCOL_VERSION,
            kind: KIND_JSON,
            len,
            fds,
        }
    }
}

/// Encodes a header. Any field values are written as given (the reserved
/// field is always 0); [`decode_header`] is where they are checked.
pub(crate) fn encode_header(header: &Header) -> [u8; HEADER_LEN] {
    let mut out = [0u8; HEADER_LEN];
    out[0..4].copy_from_slice(&MAGIC);
    out[4..6].copy_from_slice(&header.version.to_le_bytes());
    out[6..8].copy_from_slice(&header.kind.to_le_bytes());
    out[8..12].copy_from_slice(&header.len.to_le_bytes());
    out[12..14].copy_from_slice(&header.fds.to_le_bytes());
    out
}

/// Decodes and checks a header from the first [`HEADER_LEN`] bytes of
/// `bytes` (the rest is ignored).
///
/// Checks, in order: length, magic, version, kind, reserved field, payload
/// length, descriptor count.
pub fn decode_header(bytes: &[u8]) -> Result<Header, WireError> {
    let Some(b) = bytes.first_chunk::<HEADER_LEN>() else {
        return Err(WireError::Truncated {
            what: "wire header",
            expected: HEADER_LEN,
            got: bytes.len(),
        });
    };
    let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
    let found = [b[0], b[1], b[2], b[3]];
    if found != MAGIC {
        return Err(WireError::BadMagic { found });
    }
    let version = u16_at(4);
    if version != PROTOCOL_VERSION {
        return Err(WireError::UnsupportedVersion {
            found: version,
            supported: PROTOCOL_VERSION,
        });
    }
    let kind = u16_at(6);
    if kind != KIND_JSON {
        return Err(WireError::UnknownKind { found: kind });
    }
    let reserved = u16_at(14);
    if reserved != 0 {
        return Err(WireError::ReservedNotZero { found: reserved });
    }
    let len = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
    if len > MAX_PAYLOAD {
        return Err(WireError::PayloadTooLarge {
            len: u64::from(len),
            max: MAX_PAYLOAD,
        });
    }
    let fds = u16_at(12);
    if usize::from(fds) > MAX_FDS {
        return Err(WireError::TooManyFds {
            count: usize::from(fds),
            max: MAX_FDS,
        });
    }
    Ok(Header {
        version,
        kind,
        len,
        fds,
    })
}

/// Encodes a whole wire message (header and payload) for `message` with `fds`
/// descriptors attached.
pub(crate) fn encode_message(message: &Message, fds: usize) -> Result<Vec<u8>, WireError> {
    if fds > MAX_FDS {
        return Err(WireError::TooManyFds {
            count: fds,
            max: MAX_FDS,
        });
    }
    let payload = message.encode();
    let len = u32::try_from(payload.len())
        .ok()
        .filter(|&l| l <= MAX_PAYLOAD)
        .ok_or(WireError::PayloadTooLarge {
            len: payload.len() as u64,
            max: MAX_PAYLOAD,
        })?;
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&encode_header(&Header::json(len, fds as u16)));
    out.extend_from_slice(&payload);
    Ok(out)
}

/// Whether a listed entry is a plain entry or a ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum EntryKind {
    /// A plain entry: metadata and file descriptors (attach with
    /// [`Client::attach`](super::Client::attach)).
    Entry,
    /// A ring of slots (attach with
    /// [`Client::attach_ring`](super::Client::attach_ring)).
    Ring,
}

/// One published entry in a [`Message::Listing`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct ListedEntry {
    /// The entry's name.
    pub name: String,
    /// Plain entry or ring.
    pub kind: EntryKind,
    /// The producer's metadata for the entry.
    pub meta: Value,
}

/// The key of an update's notice that carries a pushed entry
/// ([`Server::push`](crate::Server::push), [`PushedEntry`](crate::PushedEntry)).
pub const PUSHED_KEY: &str = "pushed";

/// A message of the channel protocol.
///
/// Requests carry an `id` that the response repeats. Notices the server
/// pushes on its own ([`Update`](Self::Update),
/// [`RingFrame`](Self::RingFrame), [`Unpublished`](Self::Unpublished)) carry
/// the lease they concern instead.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
#[non_exhaustive]
pub enum Message {
    // ---- client to server ----
    /// The client's first message.
    Hello {
        /// The protocol version the client speaks.
        protocol: u16,
        /// The client's process id (informational; the server trusts `SO_PEERCRED`).
        pid: u32,
        /// Whether the client asks for notices through shared memory (see
        /// `crate::notices`); absent means no.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        shm_notices: bool,
        /// Whether the client asks to send its pings, attaches and
        /// releases through the shared-memory ring too, and to get their
        /// answers through it when they carry no descriptors (see
        /// `crate::notices`); asked only with `shm_notices`, absent means no.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        shm_requests: bool,
    },
    /// Asks for the published entries, in name order, starting after
    /// `after` (for the next page of a long listing).
    List {
        /// The request id.
        id: u64,
        /// The last name of the previous page, if any.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        after: Option<String>,
    },
    /// Asks for a lease on a plain entry.
    Attach {
        /// The request id.
        id: u64,
        /// The entry's name.
        name: String,
    },
    /// Gives a lease back.
    Release {
        /// The request id.
        id: u64,
        /// The lease.
        lease: u64,
    },
    /// Asks for a lease on a ring (a subscription).
    AttachRing {
        /// The request id.
        id: u64,
        /// The ring's name.
        name: String,
    },
    /// Tells the server the subscriber is done with a ring frame, so the
    /// producer may reuse its slot. Has no response.
    Ack {
        /// The ring lease.
        lease: u64,
        /// The slot of the message.
        slot: u32,
        /// The sequence number of the frame.
        seq: u64,
    },
    /// Asks for a [`Pong`](Self::Pong).
    Ping {
        /// The request id.
        id: u64,
    },

    // ---- server to client ----
    /// The server's answer to [`Hello`](Self::Hello).
    Welcome {
        /// The protocol version the server speaks.
        protocol: u16,
        /// The server's process id (informational).
        pid: u32,
        /// When the server grants notices through shared memory: the
        /// capacity of each ring in bytes. The memfd, then the client's end
        /// of the wake-up socket pair come with the message.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        shm_notices: Option<u32>,
        /// Whether the server grants requests and their answers through
        /// the rings (only with `shm_notices`, and only when asked).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        shm_requests: bool,
        /// Whether another process serves this socket after this one
        /// ends (a keeper holds it and the server's state, see
        /// [`ServerConfig::restarts`](crate::ServerConfig::restarts));
        /// absent means no.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        restarts: bool,
    },
    /// A page of published entries.
    Listing {
        /// The request id.
        id: u64,
        /// The entries, in name order.
        entries: Vec<ListedEntry>,
        /// If more entries follow: the name to pass as `after` for the next page.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        next: Option<String>,
    },
    /// A lease on a plain entry; the entry's descriptors come with this message.
    Attached {
        /// The request id.
        id: u64,
        /// The new lease.
        lease: u64,
        /// The entry's metadata (shared with the server's entry, not copied).
        meta: Arc<Meta>,
        /// How many descriptors come with the message.
        fds: u16,
    },
    /// The lease was released.
    Released {
        /// The request id.
        id: u64,
    },
    /// A lease on a ring; one [`RingSlot`](Self::RingSlot) message per slot follows.
    RingAttached {
        /// The request id.
        id: u64,
        /// The new lease.
        lease: u64,
        /// The number of slots (the wire's key for what the API calls a
        /// slot count).
        slots: u32,
        /// The ring's metadata (shared with the server's entry, not copied).
        meta: Arc<Meta>,
    },
    /// One slot of a ring; the slot's descriptors come with this message.
    RingSlot {
        /// The request id of the [`AttachRing`](Self::AttachRing).
        id: u64,
        /// The ring lease.
        lease: u64,
        /// The slot index.
        slot: u32,
        /// The slot's metadata.
        meta: Value,
        /// How many descriptors come with the message.
        fds: u16,
    },
    /// A notice from the producer about an entry the client holds a lease on.
    Update {
        /// The lease.
        lease: u64,
        /// The entry's name.
        name: String,
        /// The entry's version: its update counter, from 1.
        ///
        /// The wire key stays `"generation"` (protocol version 1), so that
        /// peers built before the field was renamed still understand it.
        #[serde(rename = "generation")]
        version: u64,
        /// The producer's notice.
        notice: Value,
    },
    /// The producer filled a ring slot; the client reads it as a
    /// [`FrameNotice`](crate::FrameNotice).
    RingFrame {
        /// The ring lease.
        lease: u64,
        /// The slot.
        slot: u32,
        /// The ring's frame counter, from 1.
        seq: u64,
        /// The producer's notice.
        notice: Value,
    },
    /// The producer unpublished an entry or ring the client holds a lease on.
    Unpublished {
        /// The lease.
        lease: u64,
        /// The name.
        name: String,
    },
    /// The answer to [`Ping`](Self::Ping).
    Pong {
        /// The request id.
        id: u64,
    },
    /// An error: the answer to request `id`, or about the connection as a
    /// whole when `id` is `None` (the sender closes the connection after it).
    Error {
        /// The request id, if the error answers a request.
        id: Option<u64>,
        /// A machine-readable code, for example `"not_found"`.
        code: String,
        /// A sentence for people.
        message: String,
        /// Structured details (for `"refused"`: `{"uid":…,"allowed":[…]}`).
        #[serde(default, skip_serializing_if = "Value::is_null")]
        details: Value,
    },
    /// The producer stopped waiting for this subscriber's acks on a ring
    /// (its ack deadline passed, or it evicted the subscriber): frames up to
    /// `stale_through` are withdrawn, their slots may already be refilled.
    RingLate {
        /// The ring lease.
        lease: u64,
        /// Frames with a sequence number up to this one are withdrawn.
        stale_through: u64,
        /// Whether the subscription ended (else frames resume with the next one).
        evicted: bool,
        /// Why, for people.
        reason: String,
    },

    // ---- both ways: calls to the server's handler ----
    /// Client to server: calls `method` of the server's call handler
    /// (`server::CallHandler`) with `body`; answered by a
    /// [`Reply`](Self::Reply) or an [`Error`](Self::Error) with the same
    /// `id`. Carries no descriptors.
    Call {
        /// The request id.
        id: u64,
        /// The method: 1 to 64 of `a-z`, `0-9`, `_`, `.`.
        method: String,
        /// The method's arguments.
        body: Value,
    },
    /// Server to client: the answer to a [`Call`](Self::Call).
    Reply {
        /// The request id.
        id: u64,
        /// The method's answer.
        body: Value,
    },
}

impl Message {
    /// The `"type"` names of every message, in declaration order.
    pub const TYPES: &'static [&'static str] = &[
        "hello",
        "list",
        "attach",
        "release",
        "attach_ring",
        "ack",
        "ping",
        "welcome",
        "listing",
        "attached",
        "released",
        "ring_attached",
        "ring_slot",
        "update",
        "ring_frame",
        "unpublished",
        "pong",
        "error",
        "ring_late",
        "call",
        "reply",
    ];

    /// This message's `"type"` name.
    pub fn type_name(&self) -> &'static str {
        match self {
            Message::Hello { .. } => "hello",
            Message::List { .. } => "list",
            Message::Attach { .. } => "attach",
            Message::Release { .. } => "release",
            Message::AttachRing { .. } => "attach_ring",
            Message::Ack { .. } => "ack",
            Message::Ping { .. } => "ping",
            Message::Welcome { .. } => "welcome",
            Message::Listing { .. } => "listing",
            Message::Attached { .. } => "attached",
            Message::Released { .. } => "released",
            Message::RingAttached { .. } => "ring_attached",
            Message::RingSlot { .. } => "ring_slot",
            Message::Update { .. } => "update",
            Message::RingFrame { .. } => "ring_frame",
            Message::Unpublished { .. } => "unpublished",
            Message::Pong { .. } => "pong",
            Message::Error { .. } => "error",
            Message::RingLate { .. } => "ring_late",
            Message::Call { .. } => "call",
            Message::Reply { .. } => "reply",
        }
    }

    /// Whether clients send this message (as opposed to servers).
    pub fn is_client_message(&self) -> bool {
        matches!(
            self,
            Message::Hello { .. }
                | Message::List { .. }
                | Message::Attach { .. }
                | Message::Release { .. }
                | Message::AttachRing { .. }
                | Message::Ack { .. }
                | Message::Ping { .. }
                | Message::Call { .. }
        )
    }

    /// The number of file descriptors that must travel with this message.
    pub fn fd_count(&self) -> usize {
        match self {
            Message::Attached { fds, .. } | Message::RingSlot { fds, .. } => usize::from(*fds),
            Message::Welcome {
                shm_notices: Some(_),
                ..
            } => 2,
            _ => 0,
        }
    }

    /// Encodes the message as a UTF-8 JSON payload.
    ///
    /// # Panics
    /// Never: serializing these types cannot fail (every map key is a
    /// string and there is no custom `Serialize`).
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("serializing a channel message cannot fail")
    }

    /// Decodes a payload, checking size, UTF-8, JSON, the message type and
    /// its fields, in that order.
    pub fn decode(payload: &[u8]) -> Result<Message, WireError> {
        let text = Self::text(payload)?;
        // Only an object may be a message (serde would take an array as a
        // tagged enum, whose first element is the tag; `diagnose` refuses
        // it).
        if text.trim_start().starts_with('{')
            && let Some(message) = Self::well_formed(text)
        {
            return Ok(message);
        }
        Self::diagnose(text)
    }

    /// [`Message::decode`] without its one-pass readings: every payload
    /// through the checked passes. For tests and fuzzing, which hold the
    /// two equal.
    #[doc(hidden)]
    pub fn decode_checked(payload: &[u8]) -> Result<Message, WireError> {
        Self::diagnose(Self::text(payload)?)
    }

    /// The payload as text, within the size limit.
    fn text(payload: &[u8]) -> Result<&str, WireError> {
        if payload.len() > MAX_PAYLOAD as usize {
            return Err(WireError::PayloadTooLarge {
                len: payload.len() as u64,
                max: MAX_PAYLOAD,
            });
        }
        std::str::from_utf8(payload).map_err(|e| WireError::InvalidUtf8 {
            valid_up_to: e.valid_up_to(),
        })
    }

    /// `text` as a message if it is a well-formed one, read with the
    /// fewest passes; `None` for anything else (`diagnose` says why).
    ///
    /// A tagged enum's fields are buffered by serde before they are read,
    /// which doubles the cost of a large value: an attach's answer, whose
    /// metadata holds a set's record (2.6 KB for a set of 8 chunks: 23.8
    /// µs to decode through the enum with the checks of `diagnose`, 20.0
    /// µs in one pass through it, on the development machine), is read
    /// straight into its fields. It is known by its first bytes, as
    /// [`Message::encode`] writes them (the type first): a payload that
    /// starts so but is not a well-formed answer goes to `diagnose`, and
    /// one spelled otherwise through the enum, which reads it as well.
    fn well_formed(text: &str) -> Option<Message> {
        if text.starts_with(r#"{"type":"attached","#) {
            let a: AttachedWire = serde_json::from_str(text).ok()?;
            return Some(Message::Attached {
                id: a.id,
                lease: a.lease,
                meta: a.meta,
                fds: a.fds,
            });
        }
        serde_json::from_str(text).ok()
    }

    /// Why `text` (a payload within the size limit, valid UTF-8) is not a
    /// message, or the message it is: checked in passes that build nothing
    /// big, the JSON as a whole, then only its "type" field, then the
    /// message itself, so that the error names the first thing wrong.
    fn diagnose(text: &str) -> Result<Message, WireError> {
        serde_json::from_str::<serde::de::IgnoredAny>(text).map_err(|e| {
            WireError::InvalidJson {
                reason: e.to_string(),
            }
        })?;
        let shape = match text.trim_start().as_bytes().first() {
            Some(b'{') => None,
            Some(b'[') => Some("an array"),
            Some(b'"') => Some("a string"),
            Some(b't' | b'f') => Some("a boolean"),
            Some(b'n') => Some("null"),
            _ => Some("a number"),
        };
        if let Some(found) = shape {
            return Err(WireError::NotAMessage {
                found: found.into(),
            });
        }
        let probe: Probe = serde_json::from_str(text).map_err(|e| WireError::InvalidJson {
            reason: e.to_string(),
        })?;
        let kind = match probe.kind {
            Some(Value::String(t)) => t,
            Some(other) => {
                return Err(WireError::NotAMessage {
                    found: format!("an object whose \"type\" is {}", describe(&other)),
                });
            }
            None => {
                return Err(WireError::NotAMessage {
                    found: "an object without a \"type\" field".into(),
                });
            }
        };
        if !Message::TYPES.contains(&kind.as_str()) {
            return Err(WireError::UnknownType { found: kind });
        }
        serde_json::from_str(text).map_err(|e| WireError::InvalidMessage {
            kind,
            reason: e.to_string(),
        })
    }
}

/// The `"type"` field of a payload, read without the rest.
#[derive(Deserialize)]
struct Probe {
    #[serde(rename = "type", default)]
    kind: Option<Value>,
}

/// [`Message::Attached`] on its own, with the same fields and checks
/// (its `"type"` is known to be `"attached"` when this is read).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AttachedWire {
    #[serde(rename = "type")]
    _kind: serde::de::IgnoredAny,
    id: u64,
    lease: u64,
    meta: Arc<Meta>,
    fds: u16,
}

/// A short description of a JSON value's type, for error messages.
fn describe(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests;
