//! Share CUDA device memory between processes without copying.
//!
//! A process exports a device buffer; another process maps the same memory,
//! works on it, and both order their work with interprocess events. This
//! crate gives safe types for every way CUDA offers this:
//!
//! | mechanism | module | what travels | security |
//! |---|---|---|---|
//! | legacy IPC handles | [`legacy`] | 64 bytes | bearer token |
//! | VMM allocations | [`vmm`] | a file descriptor | capability |
//! | stream-ordered memory pools | [`pool`] | a file descriptor and 64 bytes | capability |
//! | fabric handles | [`vmm`] | 64 bytes | bearer token (NVLink domain) |
//!
//! [`share`] picks the best mechanism the device supports; [`descriptor`]
//! is the language-neutral record of an export; [`channel`] carries
//! descriptors and file descriptors over a Unix socket with peer checks;
//! [`exchange`] builds publishers, subscribers, leases, per-publish events
//! and rings on top of it.
//!
//! # Loading
//! The driver is loaded at run time. Without a driver every entry point
//! returns [`Error::DriverNotFound`] (or [`Error::NoDevice`]); nothing
//! panics. Start with [`Device::open`].
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod arena;
pub mod buffer;
pub mod descriptor;
pub mod device;
pub mod driver;
pub mod error;
pub mod event;
pub mod exchange;
pub mod fence;
pub mod floor;
pub mod handle;
mod json;
pub mod kernels;
pub mod legacy;
mod mechanism;
pub mod memory;
pub mod pool;
mod result;
pub mod set;
pub mod share;
pub mod torch;
pub mod units;
pub mod vmm;

pub use buffer::{MappedBuffer, Mapping};
/// The exchange channel (the `cuda-ipc-channel` crate, which has no CUDA dependency).
pub use cuda_ipc_channel as channel;
/// The cudarc version this crate is built on, for matching types.
pub use cudarc;
pub use descriptor::{Descriptor, Dtype, Mechanism};
pub use device::Device;
pub use error::{Error, ErrorKind, Result};
pub use event::IpcEvent;
pub use handle::{FabricHandle, IpcEventHandle, IpcMemHandle, PoolPtrHandle};
pub use legacy::{LegacyBuffer, LegacyMapping, OpenFlags};
pub use memory::DeviceMemory;

/// The README's examples, compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
