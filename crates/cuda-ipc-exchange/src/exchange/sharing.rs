//! How a publisher shares the memory of what it publishes: from an arena
//! of chunks (the default) or each buffer exported on its own.

use crate::arena::ArenaOptions;
use crate::descriptor::Mechanism;

/// How a [`Publisher`](super::Publisher) shares memory.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Sharing {
    /// Buffers come from one arena per publisher ([`Publisher::alloc`](super::Publisher::alloc)):
    /// chunks exported once, hand-offs with no export. A consumer that maps
    /// a chunk can read every buffer in it.
    Arena {
        /// The chunks' mechanism (`None`: auto, VMM where VMM file
        /// descriptors work, else pool or legacy).
        mechanism: Option<Mechanism>,
        /// Chunk sizes, alignment, limit.
        options: ArenaOptions,
    },
    /// No arena: every buffer is its own allocation, exported when it is
    /// published ([`Publisher::publish`](super::Publisher::publish)); a consumer maps only what it is
    /// handed.
    Isolated,
}

impl Default for Sharing {
    /// `auto`: an arena of the best mechanism, with the default options.
    fn default() -> Self {
        Sharing::auto()
    }
}

impl Sharing {
    /// An arena of the best mechanism the device supports, default options.
    pub fn auto() -> Self {
        Sharing::Arena {
            mechanism: None,
            options: ArenaOptions::default(),
        }
    }

    /// An arena whose chunks use `mechanism`, default options.
    pub fn arena(mechanism: Mechanism) -> Self {
        Sharing::Arena {
            mechanism: Some(mechanism),
            options: ArenaOptions::default(),
        }
    }
}
