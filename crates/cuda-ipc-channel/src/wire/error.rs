//! What can go wrong decoding (or encoding) a wire message.

use super::{KIND_JSON, MAGIC, Message};

/// What went wrong decoding (or encoding) a message.
///
/// Each variant names what was found and what was expected.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The message does not start with `b"CIPC"`.
    #[error(
        "bad magic {found:02x?}: expected {MAGIC:02x?} (b\"CIPC\"); the peer does not speak \
         the cuda-ipc channel protocol"
    )]
    BadMagic {
        /// The four bytes found.
        found: [u8; 4],
    },

    /// The protocol version is not ours.
    #[error(
        "unsupported protocol version {found}: this side speaks version {supported}; use the \
         same cuda-ipc version on both sides"
    )]
    UnsupportedVersion {
        /// The version in the header.
        found: u16,
        /// The version we speak.
        supported: u16,
    },

    /// The payload kind is unknown.
    #[error("unknown payload kind {found}: expected {KIND_JSON} (a JSON message)")]
    UnknownKind {
        /// The kind in the header.
        found: u16,
    },

    /// The reserved header field is not zero.
    #[error("the reserved header field is {found:#06x}: expected 0")]
    ReservedNotZero {
        /// The value found.
        found: u16,
    },

    /// The payload is longer than [`MAX_PAYLOAD`](super::MAX_PAYLOAD).
    #[error("a payload of {len} bytes exceeds the limit of {max} bytes")]
    PayloadTooLarge {
        /// The payload length.
        len: u64,
        /// The limit.
        max: u32,
    },

    /// The message announces or carries more than [`MAX_FDS`](super::MAX_FDS) descriptors.
    #[error("the message carries {count} file descriptors, more than the limit of {max}")]
    TooManyFds {
        /// How many.
        count: usize,
        /// The limit.
        max: usize,
    },

    /// The input ended before the message did.
    #[error("{what} truncated: expected {expected} bytes, got {got}")]
    Truncated {
        /// Which part: "wire header" or "payload".
        what: &'static str,
        /// How many bytes were needed.
        expected: usize,
        /// How many arrived.
        got: usize,
    },

    /// The payload is not UTF-8.
    #[error("the payload is not valid UTF-8 (the first invalid byte is at offset {valid_up_to})")]
    InvalidUtf8 {
        /// The length of the valid prefix.
        valid_up_to: usize,
    },

    /// The payload is not JSON.
    #[error("the payload is not valid JSON: {reason}")]
    InvalidJson {
        /// The parser's explanation, with line and column.
        reason: String,
    },

    /// The payload is JSON but not an object with a string `"type"` field.
    #[error(
        "the payload is not a message: expected a JSON object with a string \"type\" field, found {found}"
    )]
    NotAMessage {
        /// A short description of what was found.
        found: String,
    },

    /// The `"type"` field names no message this side knows.
    #[error("unknown message type {found:?}: expected one of {}", Message::TYPES.join(", "))]
    UnknownType {
        /// The type found.
        found: String,
    },

    /// A known message type with missing, extra or ill-typed fields.
    #[error("malformed {kind:?} message: {reason}")]
    InvalidMessage {
        /// The message type.
        kind: String,
        /// What was wrong, naming the field.
        reason: String,
    },

    /// The header announced a different number of descriptors than arrived.
    #[error(
        "the header announced {expected} file descriptors but {received} arrived with the message"
    )]
    FdCountMismatch {
        /// The count in the header.
        expected: usize,
        /// The count received.
        received: usize,
    },

    /// The peer attached more descriptors than the receive buffer holds, and
    /// the kernel discarded the rest (`MSG_CTRUNC`).
    #[error(
        "the peer attached more file descriptors than the {max} a message may carry; the kernel \
         discarded the extra ones"
    )]
    FdsTruncated {
        /// The limit.
        max: usize,
    },
}
