//! Quotas (see "Quotas" in the parent module): a default for every uid
//! other than the service's own, per-uid overrides, and the service's
//! default, a share of its device.

use std::collections::BTreeMap;

use crate::error::Result;

/// How much of the device's memory each uid other than the service's own
/// may hold by default: a quarter ([`Quotas::for_device`]).
pub const DEFAULT_QUOTA_SHARE: u64 = 4;

/// Quotas: a default for every uid other than the service's own, and
/// per-uid overrides (see the module docs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Quotas {
    /// Bytes each uid other than the service's own may hold without an
    /// override (`None`: no limit). The service's own uid has no limit
    /// unless it has an override.
    pub default: Option<u64>,
    /// Per-uid limits in bytes, in place of the default (the service's own
    /// uid too).
    pub per_uid: BTreeMap<u32, u64>,
}

impl Quotas {
    /// No limit for anyone.
    pub fn unlimited() -> Quotas {
        Quotas::default()
    }

    /// The default of a service on a device of `device_bytes`: each uid
    /// other than the service's own may hold a [quarter](DEFAULT_QUOTA_SHARE)
    /// of it, so that no tenant can take the device from the others.
    pub fn for_device(device_bytes: u64) -> Quotas {
        Quotas::unlimited().with_default(Some(device_bytes / DEFAULT_QUOTA_SHARE))
    }

    /// `bytes` for every uid other than the service's without an override
    /// (`None`: no limit).
    #[must_use]
    pub fn with_default(mut self, bytes: Option<u64>) -> Quotas {
        self.default = bytes;
        self
    }

    /// `bytes` for `uid`, in place of the default.
    #[must_use]
    pub fn with_uid(mut self, uid: u32, bytes: u64) -> Quotas {
        self.per_uid.insert(uid, bytes);
        self
    }

    /// The quota of `uid` in a service running as `service_uid` (`None`:
    /// no limit).
    pub fn of(&self, uid: u32, service_uid: u32) -> Option<u64> {
        match self.per_uid.get(&uid) {
            Some(&q) => Some(q),
            None if uid == service_uid => None,
            None => self.default,
        }
    }
}

/// `quotas`, or the default of a service on a device of `device_bytes()`
/// bytes ([`Quotas::for_device`]), asked only then.
///
/// # Errors
/// `device_bytes`'s.
pub(crate) fn quotas_or_default(
    quotas: Option<Quotas>,
    device_bytes: impl FnOnce() -> Result<u64>,
) -> Result<Quotas> {
    match quotas {
        Some(q) => Ok(q),
        None => Ok(Quotas::for_device(device_bytes()?)),
    }
}
