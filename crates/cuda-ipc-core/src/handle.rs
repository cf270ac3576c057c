//! Handles: the 64-byte tokens CUDA uses to name memory, events and pool
//! allocations across processes.
//!
//! Each is plain data: `Copy`, comparable, hashable, printed and parsed as
//! 128 lowercase hex digits, and serialised by serde as that hex string.
//! Every way in ([`Handle::from_bytes`], `FromStr`, serde) checks the
//! length exactly; [`Handle`] has what the four share.
//!
//! A legacy [`IpcMemHandle`] (and a [`FabricHandle`]) is a *bearer token*:
//! anyone who learns its 64 bytes can map the memory. Prefer the file
//! descriptor mechanisms, passed over a peer-checked socket, where they work.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// Length in bytes of every handle type in this module.
pub const HANDLE_LEN: usize = 64;

/// What the four handle types share: each wraps exactly [`HANDLE_LEN`]
/// bytes (made from an array with `From<[u8; 64]>`, printed as hex with
/// `Display`, parsed with `FromStr`). Sealed: the library's four types are
/// the only handles.
pub trait Handle:
    sealed::Sealed + Copy + From<[u8; HANDLE_LEN]> + fmt::Display + FromStr<Err = Error>
{
    /// The 64 bytes.
    fn as_bytes(&self) -> &[u8; HANDLE_LEN];

    /// Checks that `bytes` is exactly 64 bytes long and wraps a copy.
    fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let array: [u8; HANDLE_LEN] = bytes.try_into().map_err(|_| Error::InvalidHandle {
            what: Self::WHAT,
            reason: format!("expected {HANDLE_LEN} bytes, got {}", bytes.len()),
        })?;
        Ok(Self::from(array))
    }

    /// Whether every byte is zero: no driver ever issues such a handle.
    fn is_zero(&self) -> bool {
        self.as_bytes().iter().all(|b| *b == 0)
    }
}

/// Refuses a handle whose 64 bytes are all zero (no driver issues one),
/// before it reaches the driver.
pub(crate) fn refuse_zero<H: Handle>(handle: &H) -> Result<()> {
    if handle.is_zero() {
        return Err(Error::InvalidHandle {
            what: H::WHAT,
            reason: "all 64 bytes are zero, which no driver issues".into(),
        });
    }
    Ok(())
}

pub(crate) mod sealed {
    /// What only this crate's handles have: their name in error messages.
    pub trait Sealed {
        /// What this handle is, in words, for error messages.
        const WHAT: &'static str;
    }
}

macro_rules! handle_type {
    ($(#[$meta:meta])* $name:ident, $what:literal) => {
        $(#[$meta])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name([u8; HANDLE_LEN]);

        impl sealed::Sealed for $name {
            const WHAT: &'static str = $what;
        }

        impl Handle for $name {
            fn as_bytes(&self) -> &[u8; HANDLE_LEN] {
                &self.0
            }
        }

        crate::json::read::field_from_str!($name);

        impl From<[u8; HANDLE_LEN]> for $name {
            fn from(bytes: [u8; HANDLE_LEN]) -> Self {
                Self(bytes)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                for b in &self.0 {
                    write!(f, "{b:02x}")?;
                }
                Ok(())
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({self})", stringify!($name))
            }
        }

        impl FromStr for $name {
            type Err = Error;
            /// Parses 128 hex digits (either case, no prefix, no separators).
            fn from_str(s: &str) -> Result<Self> {
                parse_hex(s, $what).map(Self)
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
                s.serialize_str(&self.to_string())
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
                let s = <std::borrow::Cow<'de, str> as serde::Deserialize>::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

handle_type!(
    /// A legacy CUDA IPC memory handle (`CUipcMemHandle`).
    ///
    /// It names the whole allocation that contains the exported pointer,
    /// never the pointer itself: an export carries the offset separately.
    IpcMemHandle,
    "IPC memory handle"
);

handle_type!(
    /// A CUDA IPC event handle (`CUipcEventHandle`), for an event created
    /// with `CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING`.
    IpcEventHandle,
    "IPC event handle"
);

handle_type!(
    /// The export data of one allocation from a shareable memory pool
    /// (`CUmemPoolPtrExportData`). Useful only together with the pool's
    /// own shareable handle (a file descriptor).
    PoolPtrHandle,
    "memory-pool pointer export data"
);

handle_type!(
    /// A fabric handle (`CUmemFabricHandle`) of a VMM allocation, valid
    /// across the nodes of one NVLink domain where an IMEX service runs.
    FabricHandle,
    "fabric handle"
);

/// Parses exactly `2 * HANDLE_LEN` hex digits, naming the first problem.
fn parse_hex(s: &str, what: &'static str) -> Result<[u8; HANDLE_LEN]> {
    let bad = |reason: String| Error::InvalidHandle { what, reason };
    if let Some((i, c)) = s.char_indices().find(|(_, c)| !c.is_ascii_hexdigit()) {
        return Err(bad(format!(
            "character {c:?} at position {i} is not a hex digit (expected {} hex digits)",
            2 * HANDLE_LEN
        )));
    }
    if s.len() != 2 * HANDLE_LEN {
        return Err(bad(format!(
            "expected {} hex digits, got {}",
            2 * HANDLE_LEN,
            s.len()
        )));
    }
    let mut out = [0u8; HANDLE_LEN];
    hex::decode_to_slice(s, &mut out).map_err(|e| bad(e.to_string()))?;
    Ok(out)
}

// Conversions to and from the driver's types, for the checked-call layer.
impl IpcMemHandle {
    pub(crate) fn from_sys(h: cudarc::driver::sys::CUipcMemHandle) -> Self {
        Self(h.reserved.map(|c| c as u8))
    }
    pub(crate) fn to_sys(self) -> cudarc::driver::sys::CUipcMemHandle {
        cudarc::driver::sys::CUipcMemHandle {
            reserved: self.0.map(|b| b as std::ffi::c_char),
        }
    }
}

impl IpcEventHandle {
    pub(crate) fn from_sys(h: cudarc::driver::sys::CUipcEventHandle) -> Self {
        Self(h.reserved.map(|c| c as u8))
    }
    pub(crate) fn to_sys(self) -> cudarc::driver::sys::CUipcEventHandle {
        cudarc::driver::sys::CUipcEventHandle {
            reserved: self.0.map(|b| b as std::ffi::c_char),
        }
    }
}

impl PoolPtrHandle {
    pub(crate) fn from_sys(h: cudarc::driver::sys::CUmemPoolPtrExportData) -> Self {
        Self(h.reserved)
    }
    pub(crate) fn to_sys(self) -> cudarc::driver::sys::CUmemPoolPtrExportData {
        cudarc::driver::sys::CUmemPoolPtrExportData { reserved: self.0 }
    }
}

impl FabricHandle {
    pub(crate) fn from_sys(h: cudarc::driver::sys::CUmemFabricHandle) -> Self {
        Self(h.data)
    }
    pub(crate) fn to_sys(self) -> cudarc::driver::sys::CUmemFabricHandle {
        cudarc::driver::sys::CUmemFabricHandle { data: self.0 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sys_round_trip_keeps_every_byte() {
        let mut bytes = [0u8; HANDLE_LEN];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(37).wrapping_add(200);
        }
        assert_eq!(
            IpcMemHandle::from_sys(IpcMemHandle(bytes).to_sys()).0,
            bytes
        );
        assert_eq!(
            IpcEventHandle::from_sys(IpcEventHandle(bytes).to_sys()).0,
            bytes
        );
        assert_eq!(
            PoolPtrHandle::from_sys(PoolPtrHandle(bytes).to_sys()).0,
            bytes
        );
        assert_eq!(
            FabricHandle::from_sys(FabricHandle(bytes).to_sys()).0,
            bytes
        );
    }
}
