//! What a reconnect did ([`Reconnected`]), and the calls it makes again
//! on a new connection (the work is in `reconnect.rs`).

use std::time::Duration;

use serde_json::Value;

/// A call made again on every new connection ([`Subscriber::call_and_keep`](super::Subscriber::call_and_keep)).
#[derive(Clone, Debug)]
pub(super) struct KeptCall {
    pub(super) method: String,
    pub(super) key: String,
    pub(super) body: Value,
    pub(super) timeout: Duration,
}

impl KeptCall {
    /// Whether this is the call kept as `method` and `key`.
    pub(super) fn is(&self, method: &str, key: &str) -> bool {
        self.method == method && self.key == key
    }
}

/// What [`Subscriber::reconnect`](super::Subscriber::reconnect) did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Reconnected {
    /// Whether it made a new connection (`false`: the connection was up).
    pub connected: bool,
    /// The sets whose lease it took back: the publisher serves the version
    /// held.
    pub retaken: Vec<String>,
    /// The sets held whose version the publisher no longer serves (it
    /// serves a newer one): still mapped, at the same addresses, without a
    /// lease; attach them again for the current version.
    pub old_versions: Vec<String>,
    /// The sets it could not take back, and why: no longer published, or
    /// refused for now (a write in place, a torn set: tried again at the
    /// next call).
    pub not_retaken: Vec<(String, String)>,
    /// Cached chunk mappings whose lease it took back.
    pub chunks: usize,
    /// Cached chunk mappings kept without a lease (the publisher no longer
    /// serves the chunk).
    pub chunks_unleased: usize,
}
