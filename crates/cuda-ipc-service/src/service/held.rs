//! What the service holds of each set's current version: its buffers,
//! its tensors' layout and places, and how many restarts it was kept
//! through.

use super::layout::Tensor;
use crate::loader::LoadedCheckpoint;

/// The buffers of a set's current version, kept until it is dropped or
/// replaced, and its layout (what a write session copies).
pub(super) struct Held {
    pub(super) tensors: Vec<Tensor>,
    /// Each tensor's place: its buffer (an index into
    /// [`Held::buffers`]) and its offset there.
    pub(super) places: Vec<(usize, u64)>,
    buffers: HeldBuffers,
    /// Restarts of the serving process this version was kept through.
    pub(super) restarts: u64,
    /// The layout hash of its record, once a write in place described it
    /// (the same for every in-place version: the same tensors at the same
    /// places).
    pub(super) in_place_hash: Option<String>,
}

/// A version's buffers: its ranges go back to the arena when they drop.
enum HeldBuffers {
    Loaded(LoadedCheckpoint),
    Written(Vec<crate::arena::DeviceArenaBuffer>),
}

impl Held {
    pub(super) fn loaded(loaded: LoadedCheckpoint) -> Held {
        Held {
            tensors: tensors_of(&loaded),
            places: loaded
                .tensors()
                .iter()
                .map(|t| (t.buffer, t.offset))
                .collect(),
            buffers: HeldBuffers::Loaded(loaded),
            restarts: 0,
            in_place_hash: None,
        }
    }

    pub(super) fn written(
        tensors: Vec<Tensor>,
        buffers: Vec<crate::arena::DeviceArenaBuffer>,
    ) -> Held {
        Held {
            places: (0..tensors.len()).map(|i| (i, 0)).collect(),
            tensors,
            buffers: HeldBuffers::Written(buffers),
            restarts: 0,
            in_place_hash: None,
        }
    }

    /// A version taken back after a restart (its `restarts`-th).
    pub(super) fn restored(
        tensors: Vec<Tensor>,
        places: Vec<(usize, u64)>,
        buffers: Vec<crate::arena::DeviceArenaBuffer>,
        restarts: u64,
    ) -> Held {
        Held {
            tensors,
            places,
            buffers: HeldBuffers::Written(buffers),
            restarts,
            in_place_hash: None,
        }
    }

    pub(super) fn buffers(&self) -> &[crate::arena::DeviceArenaBuffer] {
        match &self.buffers {
            HeldBuffers::Loaded(l) => l.buffers(),
            HeldBuffers::Written(b) => b,
        }
    }
}

/// The layout of a loaded checkpoint's tensors.
fn tensors_of(loaded: &crate::loader::LoadedCheckpoint) -> Vec<Tensor> {
    loaded
        .tensors()
        .iter()
        .map(|t| Tensor {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            bytes: t.len,
        })
        .collect()
}
