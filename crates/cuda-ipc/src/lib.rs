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
//! # Crates and layers
//! Imports go one way, down this list; the compiler enforces the crate
//! boundaries, and `tests/layers.rs` the order of this crate's modules (a
//! folder is one layer; no module imports one listed below it).
//!
//! | crate, folder or module | layer | what it owns |
//! |---|---|---|
//! | `cudarc` (dependency) | generated driver bindings | nothing: raw symbols, loaded at run time |
//! | `cuda-ipc`: [`error`], [`units`], [`phases`], [`handle`], the mechanism word, [`container`] | plain data, no driver calls | [`Error`] keeps the C call and the raw code; [`IpcMemHandle`] and the other handles are 64-byte `Copy` values |
//! | `cuda-ipc`: [`driver`] (`driver/`, with the private `driver/result/`) | loading the driver; one checked function per driver call, the fence's included | nothing: each call returns `Result` and names the C function |
//! | `cuda-ipc`: [`device`] | the device, its primary context and stream | [`Device`] holds the context |
//! | `cuda-ipc`: [`sync`] (`sync/`: [`event`], [`reaper`]) | ordering between processes; drops that never wait | [`IpcEvent`] owns an event; the reaper owns what drops retired until its work is done |
//! | `cuda-ipc`: [`memory`] (`memory/`: [`legacy`], [`vmm`], [`pool`], [`buffer`]), [`kernels`] | owning types of every mechanism, released in `Drop` | [`LegacyBuffer`] / [`vmm::VmmBuffer`] / [`pool::PoolBuffer`] own an allocation; [`LegacyMapping`] / [`vmm::VmmMapping`] / [`pool::PoolMapping`] own a mapping of another process's allocation (sealed [`Mapping`]); [`MappedBuffer`] is a typed view holding its mapping and, when attached through the exchange, its lease |
//! | `cuda-ipc`: [`descriptor`], [`torch`], [`set`] | plain-data records | [`Descriptor`], [`set::SetRecord`] and [`torch::ShareRecord`] are strictly decoded, language-neutral records that own nothing |
//! | `cuda-ipc`: [`share`] | one API over the mechanisms | [`share::SharedBuffer`] owns an allocation of any mechanism |
//! | `cuda-ipc`: [`fence`], [`arena`], [`floor`] | built on `share` | [`fence::Fence`] owns shared sequence words; [`arena::Arena`] owns its chunks, and an [`arena::ArenaBuffer`] a range until it and every lease on it are gone; [`floor`] is the driver floor the benchmark compares against |
//! | `cuda-ipc`: [`checkpoint`] | safetensors checkpoints read and planned for loading, no CUDA | [`checkpoint::Checkpoint`] owns its files' descriptors (read with `pread`, never mapped); [`checkpoint::Plan`] is plain data |
//! | `cuda-ipc-channel`, re-exported as [`channel`] | Unix-socket exchange, no CUDA | the server owns entries, leases and rings; the client owns its connection; file descriptors travel as `OwnedFd` |
//! | `cuda-ipc`: [`exchange`] | publishers and subscribers | [`exchange::Publisher`] owns what it published until every lease ends; [`exchange::Subscriber`] owns its connection, its mapping cache and its leases |
//! | `cuda-ipc`: [`loader`] | checkpoints loaded and published as sets | [`loader::load_checkpoint`] owns its streams and page-locked staging buffers for the length of a load |
//! | `cuda-ipc`: [`service`] | the weight service: a publisher that owns what it loads, a catalog with per-uid quotas, an admin protocol of channel calls | [`service::Service`] owns its publisher, every set it loaded and the catalog until it is shut down |
//! | `cuda-ipc-bench` | the benchmark, no `unsafe` | its consumer processes |
//! | `cuda-ipc-cli` (the `cuda-ipc` command) | a thin front, no `unsafe` | nothing of its own: every command calls the library |
//!
//! The modules of [`memory`] and [`sync`] are also re-exported at the crate
//! root (`cuda_ipc::legacy`, `cuda_ipc::event`, ...), where they were before
//! the folders.
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

pub mod arena;
pub mod checkpoint;
pub mod container;
pub mod descriptor;
pub mod device;
pub mod driver;
pub mod error;
pub mod exchange;
pub mod fence;
pub mod floor;
pub mod handle;
mod json;
pub mod kernels;
pub mod loader;
mod mechanism;
pub mod memory;
pub mod phases;
pub mod service;
pub mod set;
pub mod share;
pub mod sync;
pub mod torch;
pub mod units;

pub use buffer::{MappedBuffer, Mapping};
/// The exchange channel (the `cuda-ipc-channel` crate, which has no CUDA dependency).
pub use cuda_ipc_channel as channel;
/// The cudarc version this crate is built on, for matching types.
pub use cudarc;
pub use descriptor::{Descriptor, Dtype, Mechanism};
pub use device::Device;
pub use error::{Error, ErrorKind, Result};
pub use handle::{FabricHandle, IpcEventHandle, IpcMemHandle, PoolPtrHandle};
pub use legacy::{LegacyBuffer, LegacyMapping, OpenFlags};
pub use mechanism::Access;
pub use memory::DeviceMemory;
/// The memory layer's modules, also at the crate root.
pub use memory::{buffer, legacy, pool, vmm};
pub use sync::event::IpcEvent;
/// The ordering layer's modules, also at the crate root.
pub use sync::{event, reaper};

/// The README's examples, compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
