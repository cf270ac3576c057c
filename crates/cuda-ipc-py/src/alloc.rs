//! A torch allocator on a publisher's arena: the two C functions that
//! `torch.cuda.memory.CUDAPluggableAllocator` loads from this module's
//! shared object, and the registry they allocate through.
//!
//! `cuda_ipc.torch.shareable(publisher)` makes a `torch.cuda.MemPool` over
//! [`cuda_ipc_torch_alloc`] / [`cuda_ipc_torch_free`] and marks the
//! publisher *active* for its device while the block runs; torch's caching
//! allocator then asks the active publisher's arena for its segments
//! ([`Publisher::alloc`]), so every tensor made in the block lives in memory
//! the publisher can hand off without a copy.
//!
//! # The contract
//! - **Which arena.** The C functions get a size, a device and a stream,
//!   nothing that names a pool, so one publisher per device is active at a
//!   time (nesting the same publisher counts). An allocation on a device
//!   with no active publisher fails.
//! - **Who owns a segment.** This module does, from the allocation until
//!   torch frees it (`torch.cuda.empty_cache()`, or the pool's end): a
//!   process-wide table of live segments, by device address, holds each
//!   arena buffer. Nothing else frees a segment: closing the publisher
//!   leaves the segments (and so the tensors in them) valid until torch
//!   frees them, and a published set holds leases on the segments it uses
//!   as on any arena buffer.
//! - **Errors.** Neither function unwinds into torch: a panic is caught.
//!   An allocation that fails returns null, which torch's caching allocator
//!   takes as out of memory (it frees its cached blocks, retries once, then
//!   raises `torch.OutOfMemoryError`); the reason is kept for
//!   `shareable_error()`, which the Python side adds to torch's error. A
//!   free of an address this module did not allocate is recorded the same
//!   way and otherwise ignored.
//! - **Ordering.** A free waits for the work queued on the device (as
//!   `cudaFree` does) before the segment's range goes back to the arena.
//! - **The GIL.** Neither function touches Python objects, so torch may
//!   call them with or without the GIL; the registry's locks are never held
//!   while Python runs.
#![allow(unsafe_code)] // `#[unsafe(no_mangle)]` on the two exported functions

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex};

use cuda_ipc::arena::DeviceArenaBuffer;
use cuda_ipc::exchange::Publisher;
use cuda_ipc::memory::DeviceMemory;
use cuda_ipc::{Error, Result};
use pyo3::prelude::*;

use crate::errors::{IntoPyResult, lock};
use crate::peers::{ArenaRegistry, PyPublisher, sync_context};

/// The exported names, for `CUDAPluggableAllocator(path, ALLOC, FREE)`.
const ALLOC_SYMBOL: &str = "cuda_ipc_torch_alloc";
const FREE_SYMBOL: &str = "cuda_ipc_torch_free";

/// The publisher a device's allocations come from.
struct Active {
    publisher: Arc<Publisher>,
    /// The publisher object's table of arena buffers, so that
    /// `arena_buffer_containing` finds the segments.
    buffers: Arc<ArenaRegistry>,
    /// `shareable` blocks of this publisher now running on the device.
    depth: usize,
}

/// Active publishers by device ordinal.
static ACTIVE: Mutex<Option<HashMap<i64, Active>>> = Mutex::new(None);
/// Live segments by device address: the only owner of each.
static LIVE: Mutex<Option<HashMap<u64, Arc<DeviceArenaBuffer>>>> = Mutex::new(None);
/// Why the last allocation or free failed, until read.
static LAST_ERROR: Mutex<Option<String>> = Mutex::new(None);

fn remember(message: String) {
    *lock(&LAST_ERROR) = Some(message);
}

/// One segment of `size` bytes from the arena of the publisher active on
/// `device`.
fn alloc(size: usize, device: c_int) -> Result<u64> {
    let (publisher, buffers) = {
        let active = lock(&ACTIVE);
        let entry = active
            .as_ref()
            .and_then(|a| a.get(&i64::from(device)))
            .ok_or_else(|| Error::InvalidArgument {
                what: "shareable allocation",
                reason: format!(
                    "no publisher is active on cuda:{device}: allocate inside \
                     `with cuda_ipc.torch.shareable(publisher):` with a publisher of that \
                     device (and not after the publisher is closed)"
                ),
            })?;
        (entry.publisher.clone(), entry.buffers.clone())
    };
    let buffer = Arc::new(publisher.alloc(size as u64)?);
    let ptr = buffer.device_address();
    buffers.insert(&buffer);
    lock(&LIVE)
        .get_or_insert_with(HashMap::new)
        .insert(ptr, buffer);
    Ok(ptr)
}

/// Gives back the segment at `ptr`.
fn free(ptr: u64) -> Result<()> {
    let buffer = lock(&LIVE)
        .as_mut()
        .and_then(|l| l.remove(&ptr))
        .ok_or_else(|| Error::InvalidArgument {
            what: "shareable free",
            reason: format!("0x{ptr:x} is not a segment this allocator handed out"),
        })?;
    // As cudaFree: the work queued on the segment finishes before its range
    // can be handed out again. A failure here (the driver shutting down at
    // exit) leaves nothing to wait for.
    let waited = sync_context(buffer.device());
    drop(buffer);
    waited
}

/// Allocates `size` bytes for torch's caching allocator from the arena of
/// the publisher active on `device` (`cuda_ipc.torch.shareable`). Returns
/// null when it cannot (no active publisher, the arena's limit, the device
/// out of memory); `shareable_error()` then says why. The stream is not
/// used: arena memory is not stream ordered.
#[unsafe(no_mangle)]
pub extern "C" fn cuda_ipc_torch_alloc(
    size: usize,
    device: c_int,
    _stream: *mut c_void,
) -> *mut c_void {
    let outcome = catch_unwind(AssertUnwindSafe(|| alloc(size, device)));
    match outcome {
        Ok(Ok(ptr)) => ptr as usize as *mut c_void,
        Ok(Err(e)) => {
            remember(format!(
                "the arena could not allocate {size} bytes on cuda:{device}: {e}"
            ));
            std::ptr::null_mut()
        }
        Err(_) => {
            remember(format!(
                "allocating {size} bytes on cuda:{device} from the arena panicked"
            ));
            std::ptr::null_mut()
        }
    }
}

/// Gives the segment at `ptr` (from [`cuda_ipc_torch_alloc`]) back to its
/// arena, after the work queued on the device. The range is handed out
/// again only when no published set holds it.
#[unsafe(no_mangle)]
pub extern "C" fn cuda_ipc_torch_free(
    ptr: *mut c_void,
    size: usize,
    device: c_int,
    _stream: *mut c_void,
) {
    let address = ptr as usize as u64;
    let outcome = catch_unwind(AssertUnwindSafe(|| free(address)));
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(e)) => remember(format!(
            "freeing {size} bytes at 0x{address:x} on cuda:{device}: {e}"
        )),
        Err(_) => remember(format!(
            "freeing {size} bytes at 0x{address:x} on cuda:{device} panicked"
        )),
    }
}

/// Makes `publisher` the source of its device's allocations (again, when it
/// already is). Fails when another publisher is active on that device.
#[pyfunction]
fn shareable_enter(publisher: &PyPublisher) -> PyResult<()> {
    let p = publisher.get()?;
    let ordinal = publisher.device.ordinal() as i64;
    let mut active = lock(&ACTIVE);
    let map = active.get_or_insert_with(HashMap::new);
    match map.get_mut(&ordinal) {
        Some(a) if Arc::ptr_eq(&a.publisher, &p) => {
            a.depth += 1;
            Ok(())
        }
        Some(a) => Err(Error::InvalidArgument {
            what: "shareable",
            reason: format!(
                "the publisher at {} is already the shareable allocator of cuda:{ordinal}; \
                 one publisher per device at a time: leave its block first",
                a.publisher.path().display()
            ),
        })
        .py(),
        None => {
            map.insert(
                ordinal,
                Active {
                    publisher: p,
                    buffers: publisher.arena_buffers.clone(),
                    depth: 1,
                },
            );
            Ok(())
        }
    }
}

/// Ends one `shareable` block of `publisher`; the last one makes its device
/// have no active publisher again.
#[pyfunction]
fn shareable_exit(publisher: &PyPublisher) {
    let ordinal = publisher.device.ordinal() as i64;
    let mut active = lock(&ACTIVE);
    let Some(map) = active.as_mut() else {
        return;
    };
    if let Some(a) = map.get_mut(&ordinal)
        && Arc::ptr_eq(&a.buffers, &publisher.arena_buffers)
    {
        a.depth -= 1;
        if a.depth == 0 {
            map.remove(&ordinal);
        }
    }
}

/// Stops `publisher` being active anywhere (at its close); the segments
/// already allocated stay until torch frees them.
pub(crate) fn forget(publisher: &PyPublisher) {
    let taken: Vec<Active> = {
        let mut active = lock(&ACTIVE);
        let Some(map) = active.as_mut() else {
            return;
        };
        let gone: Vec<i64> = map
            .iter()
            .filter(|(_, a)| Arc::ptr_eq(&a.buffers, &publisher.arena_buffers))
            .map(|(k, _)| *k)
            .collect();
        gone.into_iter().filter_map(|k| map.remove(&k)).collect()
    };
    // The publisher may stop serving here: outside the lock.
    drop(taken);
}

/// Why the last shareable allocation or free failed (and forgets it), or
/// `None`.
#[pyfunction]
fn shareable_error() -> Option<String> {
    lock(&LAST_ERROR).take()
}

/// The segments the allocator holds now, and their bytes.
#[pyfunction]
fn shareable_segments() -> (usize, u64) {
    lock(&LIVE).as_ref().map_or((0, 0), |l| {
        (l.len(), l.values().map(|b| b.byte_len()).sum())
    })
}

/// Whether a publisher is active on device `ordinal`.
#[pyfunction]
fn shareable_active(ordinal: i64) -> bool {
    lock(&ACTIVE)
        .as_ref()
        .is_some_and(|a| a.contains_key(&ordinal))
}

/// Registers this module's functions and the exported symbols' names.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("SHAREABLE_ALLOC", ALLOC_SYMBOL)?;
    m.add("SHAREABLE_FREE", FREE_SYMBOL)?;
    m.add_function(wrap_pyfunction!(shareable_enter, m)?)?;
    m.add_function(wrap_pyfunction!(shareable_exit, m)?)?;
    m.add_function(wrap_pyfunction!(shareable_error, m)?)?;
    m.add_function(wrap_pyfunction!(shareable_segments, m)?)?;
    m.add_function(wrap_pyfunction!(shareable_active, m)?)?;
    Ok(())
}
