//! The weight service of cuda-ipc: safetensors checkpoints read and loaded
//! onto the GPU, published as weight sets, and a service that owns them
//! apart from the processes that use them. Built on `cuda-ipc-core` and
//! `cuda-ipc-exchange`.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod checkpoint;
pub mod loader;
pub mod service;

// The lower crates' modules under the names this crate's code uses for them.
use cuda_ipc_core::{channel, descriptor, device, driver, error, json, mechanism, memory, units};
use cuda_ipc_exchange::{arena, exchange, set};
