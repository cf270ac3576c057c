//! How a [`Subscriber`](super::Subscriber) connects: its timeout, the
//! publishers' user ids it accepts, how it waits, how many idle mappings
//! it keeps, and how it maps.

use std::time::Duration;

use crate::Access;

use super::budget::MappingBudget;
use super::link::Reconnect;
use super::sync::SyncMode;

/// How a [`Subscriber`](super::Subscriber) connects: `SubscriberConfig::default()`, adjusted
/// with the `with_` methods.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SubscriberConfig {
    /// How long a request may take (5 s by default).
    pub timeout: Duration,
    /// User ids the publisher may run as besides our own.
    pub allow_uids: Vec<u32>,
    /// How streams wait for the publisher's work: its event or its fence
    /// ([`SyncMode::Auto`] by default: the event where it opens).
    pub sync: SyncMode,
    /// How many idle chunk mappings the subscriber keeps for reuse.
    pub mapping_budget: MappingBudget,
    /// How long a wait for the publisher's answer or update polls before
    /// it sleeps (ring frames are waited for without)
    /// ([`ClientConfig::spin`](crate::channel::ClientConfig::spin): 50 µs by
    /// default; `Duration::ZERO` sleeps at once).
    pub spin: Duration,
    /// How this subscriber maps what it attaches ([`Access::ReadWrite`] by
    /// default). [`Access::ReadOnly`] maps every buffer, set and ring slot
    /// read-only (only VMM memory can be: legacy and pool memory are then
    /// refused with [`Error::Unsupported`](crate::error::Error::Unsupported)); a set whose publisher asks for
    /// read-only readers is mapped read-only whatever this says.
    pub access: Access,
    /// Whether it connects again when the publisher's process ends
    /// ([`Reconnect::IfPublisherRestarts`] by default: only when the
    /// publisher said another process serves after it, as the weight
    /// service under its keeper does).
    pub reconnect: Reconnect,
}

impl Default for SubscriberConfig {
    fn default() -> Self {
        let client = crate::channel::ClientConfig::default();
        SubscriberConfig {
            timeout: Duration::from_secs(5),
            allow_uids: Vec::new(),
            sync: SyncMode::Auto,
            mapping_budget: MappingBudget::default(),
            spin: client.spin,
            access: Access::ReadWrite,
            reconnect: Reconnect::default(),
        }
    }
}

impl SubscriberConfig {
    /// How long a wait polls before it sleeps (see [`SubscriberConfig::spin`]).
    #[must_use]
    pub fn with_spin(mut self, spin: Duration) -> Self {
        self.spin = spin;
        self
    }

    /// How long a request may take.
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Accepts a publisher running as one of these user ids too, besides our own.
    #[must_use]
    pub fn with_allow_uids(mut self, uids: impl IntoIterator<Item = u32>) -> Self {
        self.allow_uids.extend(uids);
        self
    }

    /// How this subscriber maps what it attaches (see
    /// [`SubscriberConfig::access`]).
    #[must_use]
    pub fn with_access(mut self, access: Access) -> Self {
        self.access = access;
        self
    }

    /// Whether it connects again when the publisher's process ends (see
    /// [`SubscriberConfig::reconnect`] and
    /// [`Subscriber`](super::Subscriber)'s "When the publisher's process
    /// ends").
    #[must_use]
    pub fn with_reconnect(mut self, reconnect: Reconnect) -> Self {
        self.reconnect = reconnect;
        self
    }

    /// How streams wait for the publisher's work (see [`SyncMode`]).
    #[must_use]
    pub fn with_sync(mut self, sync: SyncMode) -> Self {
        self.sync = sync;
        self
    }

    /// Keeps at most `bytes` bytes (`None`: no limit) and `count` (`None`:
    /// no limit) of cached chunk mappings, evicting the least recently used
    /// of those that no lease holds.
    #[must_use]
    pub fn with_mapping_budget(mut self, bytes: Option<u64>, count: Option<usize>) -> Self {
        self.mapping_budget = MappingBudget::new(bytes, count);
        self
    }
}
