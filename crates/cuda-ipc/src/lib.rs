//! Share CUDA device memory between processes without copying.
//!
//! This crate is the door to three crates, re-exported here under the
//! paths users know:
//!
//! - `cuda-ipc-core`: the sharing primitives (every mechanism's owning
//!   types, events, fences, the descriptor, one error type);
//! - `cuda-ipc-exchange`: publishers and subscribers of buffers and whole
//!   weight sets, leases, rings, arenas ([`exchange`], [`set`], [`arena`],
//!   [`torch`]);
//! - `cuda-ipc-service`: checkpoints, the loader and the weight service
//!   ([`checkpoint`], [`loader`], [`saver`], [`service`]).
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub use cuda_ipc_core::*;
pub use cuda_ipc_exchange::{arena, exchange, set, torch};
pub use cuda_ipc_service::{checkpoint, keep, loader, saver, service};

/// The README's examples, compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
