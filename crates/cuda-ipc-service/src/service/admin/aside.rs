//! The bodies of `aside` and `back`: a reader stepping aside from a set
//! for a write in place, and coming back (the service's `in_place`
//! module); and of `ready`, a reconnecting reader's first call.

use serde::{Deserialize, Serialize};

use super::Request;

/// `aside`: this connection's mappings of `set` sleep, and it will not
/// wake them before `back` answers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct AsideRequest {
    /// The set.
    pub set: String,
}

impl Request for AsideRequest {
    const METHOD: &'static str = "aside";
    type Answer = AsideAnswer;
}

/// The answer to `aside`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct AsideAnswer {
    /// The set.
    pub set: String,
    /// Its current version.
    pub version: u64,
    /// Whether a writer writes it in place now.
    pub writing_in_place: bool,
}

/// `back`: waits until no in-place write of `set` is open (or `timeout_ms`
/// passes), then takes back this connection's `aside`. With `next`, waits
/// also until a write has committed the version after the one this
/// connection stepped aside from (a reader that stepped aside for the
/// next update, before its writer started).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct BackRequest {
    /// The set.
    pub set: String,
    /// How long to wait, in milliseconds (default and most:
    /// [`MAX_BACK_WAIT_MS`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Wait for the next version, not only for a write in progress.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub next: bool,
}

impl Request for BackRequest {
    const METHOD: &'static str = "back";
    type Answer = BackAnswer;
}

/// The answer to `back`: the version to wake to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct BackAnswer {
    /// The set.
    pub set: String,
    /// Its version now (the in-place write's, if it committed).
    pub version: u64,
}

/// The longest a `back` waits (an in-place write of a large model takes
/// seconds; a writer that never commits is cut off by its connection).
pub const MAX_BACK_WAIT_MS: u64 = 600_000;

/// `ready`: answered once the service serves what it kept through a
/// restart (every call waits for that): the first call of a reader that
/// connects again after the serving process ended
/// ([`READY_METHOD`](crate::exchange::READY_METHOD)), before it takes its
/// leases back. The body is `{}`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReadyRequest {}

impl Request for ReadyRequest {
    const METHOD: &'static str = crate::exchange::READY_METHOD;
    type Answer = ReadyAnswer;
}

/// The answer to `ready`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct ReadyAnswer {
    /// How many sets the service serves.
    pub sets: usize,
}

/// The most sets a `reconnected` call names.
pub const MAX_RECONNECTED_PENDING: usize = 64;

/// `reconnected`: a reader that connected again after a restart took back
/// what it could ([`RECONNECTED_METHOD`](crate::exchange::RECONNECTED_METHOD)).
/// `pending` are the sets it still maps and could not take back yet (a
/// write in place or a torn set refused it for now): writes in place of
/// those still wait for it; of the rest, no longer.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct ReconnectedRequest {
    /// The sets still mapped and not taken back.
    pub pending: Vec<String>,
}

impl Request for ReconnectedRequest {
    const METHOD: &'static str = crate::exchange::RECONNECTED_METHOD;
    type Answer = ReconnectedAnswer;
}

/// The answer to `reconnected`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct ReconnectedAnswer {
    /// Readers of the serving process before that have not connected
    /// again (this one counts while it has sets pending).
    pub not_reconnected: usize,
}
