//! The weight service of cuda-ipc: safetensors checkpoints read and loaded
//! onto the GPU, published as weight sets, and a service that owns them
//! apart from the processes that use them. Built on `cuda-ipc-core` and
//! `cuda-ipc-exchange`; the top of the library.
//!
//! Its modules, lowest first: [`checkpoint`] (safetensors files and
//! sharded checkpoints opened with `pread`, never mapped, every header
//! checked; a [`checkpoint::Plan`] of where each tensor goes), [`loader`]
//! (a plan carried out through page-locked staging buffers and streams,
//! published as a set), [`saver`] (an attached set written as a
//! safetensors file through the same kind of buffers), [`keep`] (weights that outlive the serving
//! process: the file-descriptor store it hands its chunks and catalog
//! image to, and the [`keep::Keeper`] that holds them and runs it again),
//! and [`service`] ([`service::Service`] owns its
//! publisher, every set it loaded and its catalog of versions and per-user
//! quotas; [`service::Writer`] is the one writer of a set's next version).
//! Users reach them as `cuda_ipc::service` and so on; the command line's
//! `serve --service` runs one.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod checkpoint;
pub mod keep;
pub mod loader;
mod pinned;
pub mod saver;
pub mod service;

// The lower crates' modules under the names this crate's code uses for them.
use cuda_ipc_core::{Access, channel, descriptor, device, driver, error, json, memory, units};
use cuda_ipc_exchange::{arena, exchange, set};
