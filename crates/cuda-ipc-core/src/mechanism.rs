//! How memory is shared between processes: the one word every layer uses
//! (the owning types, the descriptor, the command line), kept in a module of
//! its own so that none of them imports another for it.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// How memory is shared between processes.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Mechanism {
    /// A legacy IPC handle (`cuIpcGetMemHandle`): a 64-byte bearer token.
    Legacy,
    /// A VMM allocation (`cuMemCreate`) shared as a POSIX file descriptor.
    Vmm,
    /// An allocation from a shareable stream-ordered memory pool: the pool's
    /// file descriptor and the pointer's 64-byte export data.
    Pool,
    /// A VMM allocation shared as a fabric handle (NVLink domain, IMEX).
    Fabric,
}

crate::json::read::field_from_str!(Mechanism);

impl Mechanism {
    /// Every mechanism, in the order `auto` prefers them.
    pub const ALL: [Mechanism; 4] = [
        Mechanism::Vmm,
        Mechanism::Pool,
        Mechanism::Legacy,
        Mechanism::Fabric,
    ];

    /// The name used in descriptors and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Mechanism::Legacy => "legacy",
            Mechanism::Vmm => "vmm",
            Mechanism::Pool => "pool",
            Mechanism::Fabric => "fabric",
        }
    }

    /// Whether the mechanism shares file descriptors (capabilities, which
    /// travel only to a process we hand them to) rather than bearer tokens.
    pub fn uses_fd(self) -> bool {
        matches!(self, Mechanism::Vmm | Mechanism::Pool)
    }
}

impl fmt::Display for Mechanism {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Mechanism {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Mechanism::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                Error::arg(
                    "mechanism",
                    format!("{s:?} is not one of legacy, vmm, pool, fabric"),
                )
            })
    }
}

impl Mechanism {
    /// Whether memory shared with this mechanism can be mapped with
    /// `access`: read-write always; read-only only with the VMM mechanisms
    /// (vmm, fabric).
    ///
    /// # Errors
    /// [`Error::Unsupported`] for read-only legacy memory
    /// (`cuIpcOpenMemHandle` has no access flags: an opened handle is always
    /// read-write, so the protection could not be kept) and read-only pool
    /// memory (the driver has `cuMemPoolSetAccess` with a read-only flag,
    /// but this build has not tried it on an imported pool and refuses
    /// rather than promise it); both name the vmm mechanism as the way.
    pub fn check_access(self, access: Access) -> Result<()> {
        match (access, self.why_not_read_only()) {
            (Access::ReadOnly, Some(why)) => Err(Error::Unsupported {
                what: "mapping memory read-only",
                why: format!(
                    "the memory is shared with the {self} mechanism, and {why}; share it with \
                     the vmm mechanism (an arena of vmm chunks: Sharing::arena(Mechanism::Vmm), \
                     `--mechanism vmm`) to map it read-only"
                ),
            }),
            _ => Ok(()),
        }
    }

    /// Why memory of this mechanism cannot be mapped read-only (`None`:
    /// it can).
    #[doc(hidden)]
    pub fn why_not_read_only(self) -> Option<&'static str> {
        match self {
            Mechanism::Vmm | Mechanism::Fabric => None,
            Mechanism::Legacy => Some(
                "cuIpcOpenMemHandle has no access flags: a legacy handle always opens \
                 read-write, so the protection cannot be kept",
            ),
            Mechanism::Pool => Some(
                "cuMemPoolSetAccess on an imported pool has not been tried read-only by this \
                 build, so it refuses rather than promise a protection it has not seen work",
            ),
        }
    }
}

/// What a reader may do through its mapping of another process's memory:
/// read and write (the default), or only read. A read-only mapping is made
/// with `cuMemSetAccess(CU_MEM_ACCESS_FLAGS_PROT_READ)`, which only the
/// VMM mechanisms (vmm, fabric) have: a legacy handle opens read-write
/// always, and a pool's read-only import is not supported by this build.
///
/// The protection is against mistakes, not malice: a process that holds
/// the file descriptor can import it again read-write itself.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Access {
    /// Reads and writes (`CU_MEM_ACCESS_FLAGS_PROT_READWRITE`).
    #[default]
    ReadWrite,
    /// Reads only (`CU_MEM_ACCESS_FLAGS_PROT_READ`): a kernel or copy that
    /// writes through the mapping fails, and the memory does not change.
    ReadOnly,
}

impl Access {
    /// `ReadOnly` when `read_only`, else `ReadWrite`.
    pub fn read_only_if(read_only: bool) -> Access {
        if read_only {
            Access::ReadOnly
        } else {
            Access::ReadWrite
        }
    }

    /// The stricter of the two: read-only if either is (what a reader gets
    /// when it or the publisher asks for read-only).
    #[must_use]
    pub fn and(self, other: Access) -> Access {
        Access::read_only_if(self == Access::ReadOnly || other == Access::ReadOnly)
    }

    /// The name used in messages: `read-write` or `read-only`.
    pub fn name(self) -> &'static str {
        match self {
            Access::ReadWrite => "read-write",
            Access::ReadOnly => "read-only",
        }
    }
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_only_wins_when_either_side_asks() {
        use Access::{ReadOnly, ReadWrite};
        assert_eq!(Access::default(), ReadWrite);
        assert_eq!(ReadWrite.and(ReadWrite), ReadWrite);
        assert_eq!(ReadWrite.and(ReadOnly), ReadOnly);
        assert_eq!(ReadOnly.and(ReadWrite), ReadOnly);
        assert_eq!(ReadOnly.and(ReadOnly), ReadOnly);
        assert_eq!(Access::read_only_if(true), Access::ReadOnly);
        assert_eq!(Access::read_only_if(false), Access::ReadWrite);
        assert_eq!(ReadOnly.to_string(), "read-only");
        assert_eq!(ReadWrite.to_string(), "read-write");
    }

    #[test]
    fn read_only_is_refused_where_it_cannot_be_kept() {
        for m in Mechanism::ALL {
            m.check_access(Access::ReadWrite).unwrap();
        }
        Mechanism::Vmm.check_access(Access::ReadOnly).unwrap();
        Mechanism::Fabric.check_access(Access::ReadOnly).unwrap();
        for (m, says) in [
            (Mechanism::Legacy, "cuIpcOpenMemHandle has no access flags"),
            (Mechanism::Pool, "cuMemPoolSetAccess"),
        ] {
            let e = m.check_access(Access::ReadOnly).unwrap_err();
            let text = e.to_string();
            assert!(text.contains(says), "{text}");
            assert!(text.contains("vmm mechanism"), "{text}");
            assert_eq!(e.kind(), crate::ErrorKind::Unavailable, "{text}");
        }
    }
}
