//! The exchange of cuda-ipc: a publisher process hands device buffers and
//! whole weight sets to subscriber processes over a Unix socket, with
//! leases, per-publish events and rings. Built on `cuda-ipc-core` (the
//! memory, events, fences and descriptors it moves) and `cuda-ipc-channel`
//! (the socket it moves them over); `cuda-ipc-service` builds on it.
//!
//! Its modules, lowest first: [`torch`] (PyTorch's share records, read
//! and written strictly), [`set`] (a weight set's record: chunks and
//! entries, decoded strictly, with layouts kept for sets published again),
//! [`arena`] (chunks of device memory shared once and carved into
//! buffers, each range held until its last lease ends), and [`exchange`]
//! ([`exchange::Publisher`] owns what it published until every lease on it
//! ends; [`exchange::Subscriber`] owns its connection, its mapping cache and
//! its leases; every public method of each is in one file). Most users reach
//! them through the `cuda-ipc` crate, as `cuda_ipc::exchange` and so on.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod arena;
pub mod exchange;
pub mod set;
pub mod torch;

// The core's modules under the names this crate's code uses for them.
use cuda_ipc_core::{
    Access, Mechanism, channel, descriptor, device, error, event, fence, handle, json, memory,
    phases, reaper, share,
};
