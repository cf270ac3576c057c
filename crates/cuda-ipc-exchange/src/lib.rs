//! The exchange of cuda-ipc: a publisher process hands device buffers and
//! whole weight sets to subscriber processes over a Unix socket, with
//! leases, per-publish events and rings. Built on `cuda-ipc-core`.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod arena;
pub mod exchange;
pub mod set;
pub mod torch;

// The core's modules under the names this crate's code uses for them.
use cuda_ipc_core::{
    channel, descriptor, device, error, fence, handle, json, mechanism, memory, phases, share, sync,
};
