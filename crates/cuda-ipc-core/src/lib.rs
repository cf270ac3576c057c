//! The sharing primitives of cuda-ipc: CUDA device memory exported by one
//! process and mapped by another, and the events and fences that order
//! their work.
//!
//! | mechanism | module | what travels | security |
//! |---|---|---|---|
//! | legacy IPC handles | [`legacy`] | 64 bytes | bearer token |
//! | VMM allocations | [`vmm`] | a file descriptor | capability |
//! | stream-ordered memory pools | [`pool`] | a file descriptor and 64 bytes | capability |
//! | fabric handles | [`vmm`] | 64 bytes | bearer token (NVLink domain) |
//!
//! [`share`] picks the best mechanism the device supports; [`descriptor`]
//! is the language-neutral record of an export; [`channel`] (the
//! `cuda-ipc-channel` crate) carries descriptors and file descriptors over
//! a Unix socket with peer checks.
//!
//! # The crates
//! Imports go one way, down this list, and the compiler holds it:
//!
//! - **`cuda-ipc-channel`**: the Unix-socket exchange, no CUDA: a server
//!   owns entries, leases and rings, a client its connection; file
//!   descriptors travel as `OwnedFd`.
//! - **`cuda-ipc-core`** (this crate): loading the driver ([`driver`]),
//!   the device and its primary context ([`device`]), ordering between
//!   processes and drops that never wait ([`event`]: [`IpcEvent`]; the
//!   [`reaper`]), the owning types of every mechanism ([`memory`]:
//!   [`LegacyBuffer`] / [`vmm::VmmBuffer`] / [`pool::PoolBuffer`] own an
//!   allocation, [`LegacyMapping`] / [`vmm::VmmMapping`] /
//!   [`pool::PoolMapping`] a mapping of another process's, [`MappedBuffer`]
//!   a typed view that holds its mapping), the [`Descriptor`], one API over
//!   the mechanisms ([`share`]), fences of shared sequence words
//!   ([`fence`]), and one [`Error`] that keeps the C call and its code.
//! - **`cuda-ipc-exchange`**: publishers and subscribers of buffers and
//!   whole weight sets, leases, per-publish events, rings, arenas, and the
//!   records they send (set records, PyTorch share records).
//! - **`cuda-ipc-service`**: safetensors checkpoints, the loader, and the
//!   weight service that owns models apart from the processes that use
//!   them.
//! - **`cuda-ipc`**: the door: re-exports the three under the paths users
//!   know (`cuda_ipc::exchange::Publisher`, `cuda_ipc::service::Service`).
//!
//! Within this crate, modules import only those below them in
//! `crates/cuda-ipc/tests/layers.rs`'s order (plain data, the driver, the
//! device, sync, memory, the descriptor, share, fences). Items marked
//! `#[doc(hidden)]` are for the crates above, not for users.
//! The feature `test-support` adds `kernels` (fill and check patterns)
//! and `floor` (the driver's floor), which serve the benchmark, the
//! command line's demo and the tests; the feature `phases` makes
//! [`phases::last`] report where a hand-off call's time went.
//!
//! `unsafe` lives only in the modules that call the driver or the kernel
//! (each with `#![allow(unsafe_code)]` and a `// SAFETY:` comment on every
//! block); [`DeviceMemory`] is an `unsafe trait` and [`Mapping`] is sealed, so
//! safe code cannot make the library read or write an arbitrary address.
//!
//! # Loading
//! The driver is loaded at run time. Without a driver every entry point
//! returns [`Error::DriverNotFound`] (or [`Error::NoDevice`]); nothing
//! panics. Start with [`Device::open`].
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod container;
pub mod descriptor;
pub mod device;
pub mod driver;
pub mod error;
pub mod fence;
#[cfg(feature = "test-support")]
pub mod floor;
pub mod handle;
#[doc(hidden)]
pub mod json;
#[cfg(feature = "test-support")]
pub mod kernels;
mod mechanism;
pub mod memory;
pub mod phases;
pub mod share;
mod sync;
pub mod units;

pub use buffer::{MappedBuffer, Mapping};
/// The exchange channel (the `cuda-ipc-channel` crate, which has no CUDA dependency).
pub use cuda_ipc_channel as channel;
/// The cudarc version this crate is built on, for matching types.
pub use cudarc;
pub use descriptor::{Descriptor, Dtype, Mechanism};
pub use device::Device;
pub use error::{Error, ErrorKind, Result};
pub use handle::{FabricHandle, Handle, IpcEventHandle, IpcMemHandle, PoolPtrHandle};
pub use legacy::{LegacyBuffer, LegacyMapping, OpenFlags};
pub use mechanism::Access;
pub use memory::{DeviceMemory, WithStream};
/// The memory layer's modules, also at the crate root.
pub use memory::{buffer, legacy, pool, vmm};
pub use sync::event::IpcEvent;
/// The ordering layer's modules, also at the crate root.
pub use sync::{event, reaper};
