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
