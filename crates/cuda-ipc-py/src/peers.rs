//! The Python objects of the exchange's two peers, `Publisher` and
//! `Subscriber`: what each holds, for the modules that bind to them
//! (`exchange` for their own methods, `sets` for arenas and sets, `alloc`
//! for the torch allocator, `state_dict`), and what every publish and
//! update is ordered after ([`After`]: the context, or one stream).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Weak};

use cuda_ipc::arena::DeviceArenaBuffer;
use cuda_ipc::device::Device;
use cuda_ipc::exchange::{Publisher, Subscriber};
use cuda_ipc::memory::DeviceMemory;
use cuda_ipc::{Error, Result};
use pyo3::prelude::*;

use crate::errors::{closed_error, lock};

/// Waits for every stream of `device`'s context (PyTorch's and CuPy's
/// included).
pub(crate) fn sync_context(device: &Device) -> Result<()> {
    device
        .context()
        .synchronize()
        .map_err(|e| Error::Unsupported {
            what: "synchronising the context",
            why: e.to_string(),
        })
}

/// What a publish or an update from Python is ordered after: every stream
/// of the device's context, waited for on the host (`stream=None` where a
/// call is framework-neutral), or the work queued so far on one stream, a
/// raw handle of the caller's framework (PyTorch's current stream for the
/// state dict calls), waited for on the device only.
#[derive(Clone, Copy, Debug)]
pub(crate) enum After {
    Context,
    Stream(u64),
}

impl After {
    /// `stream`: a raw `CUstream` of the publisher's device, or `None` for
    /// the whole context.
    pub(crate) fn of(stream: Option<u64>) -> Self {
        stream.map_or(After::Context, After::Stream)
    }

    /// Runs `f` ordered after this: the context synchronised first (and
    /// `f` given no stream), or `f` given the stream wrapped (borrowed: it
    /// stays the framework's).
    pub(crate) fn run<T>(
        self,
        device: &Device,
        f: impl FnOnce(Option<&cuda_ipc::cudarc::driver::CudaStream>) -> Result<T>,
    ) -> Result<T> {
        match self {
            After::Context => {
                sync_context(device)?;
                f(None)
            }
            After::Stream(raw) => {
                // SAFETY: the handle is the caller's stream (the Python API's
                // contract, as for torch.cuda.ExternalStream: PyTorch's
                // current stream, or one the caller passed), alive for this
                // call; borrow_stream checks that it is of this device.
                let stream = unsafe { device.borrow_stream(raw) }?;
                f(Some(&stream))
            }
        }
    }
}

/// Serves device buffers by name to subscribers in other processes.
#[pyclass(module = "cuda_ipc._core", name = "Publisher", frozen)]
pub(crate) struct PyPublisher {
    pub(crate) inner: Mutex<Option<Arc<Publisher>>>,
    pub(crate) device: Device,
    pub(crate) path: String,
    /// The arena buffers allocated through this object, by address.
    pub(crate) arena_buffers: Arc<ArenaRegistry>,
}

impl PyPublisher {
    pub(crate) fn get(&self) -> PyResult<Arc<Publisher>> {
        lock(&self.inner)
            .clone()
            .ok_or_else(|| closed_error("publisher", "make a new Publisher"))
    }
}

/// The arena buffers a publisher object allocated, by device address, so
/// that memory already in the arena is published without a copy. Holds no
/// buffer alive: an entry whose buffer is gone does not match.
#[derive(Default)]
pub(crate) struct ArenaRegistry {
    inner: Mutex<Registry>,
}

#[derive(Default)]
struct Registry {
    by_ptr: BTreeMap<u64, Weak<DeviceArenaBuffer>>,
    /// Dead entries are swept when the table reaches this size.
    sweep_at: usize,
}

impl ArenaRegistry {
    pub(crate) fn insert(&self, buffer: &Arc<DeviceArenaBuffer>) {
        let mut r = lock(&self.inner);
        r.by_ptr
            .insert(buffer.device_address(), Arc::downgrade(buffer));
        if r.by_ptr.len() >= r.sweep_at {
            r.by_ptr.retain(|_, w| w.strong_count() > 0);
            r.sweep_at = (r.by_ptr.len() * 2).max(64);
        }
    }

    pub(crate) fn find(&self, ptr: u64, nbytes: u64) -> Option<Arc<DeviceArenaBuffer>> {
        lock(&self.inner)
            .by_ptr
            .get(&ptr)?
            .upgrade()
            .filter(|b| b.byte_len() >= nbytes)
    }

    /// The live buffer that holds the `nbytes` bytes from device address
    /// `ptr`, and `ptr`'s offset in it.
    pub(crate) fn containing(
        &self,
        ptr: u64,
        nbytes: u64,
    ) -> Option<(Arc<DeviceArenaBuffer>, u64)> {
        let r = lock(&self.inner);
        // Live buffers never overlap, so the first live one that starts at
        // or below `ptr` is the only one that can hold it; dead entries
        // (their ranges may since have been handed out again) are skipped.
        let buffer = r
            .by_ptr
            .range(..=ptr)
            .rev()
            .find_map(|(_, w)| w.upgrade())?;
        let offset = offset_within(&buffer, ptr, nbytes)?;
        Some((buffer, offset))
    }
}

/// `ptr`'s offset in `buffer` when the `nbytes` bytes from device address
/// `ptr` all lie in it.
pub(crate) fn offset_within(buffer: &DeviceArenaBuffer, ptr: u64, nbytes: u64) -> Option<u64> {
    let offset = ptr.checked_sub(buffer.device_address())?;
    let end = offset.checked_add(nbytes)?;
    (end <= buffer.byte_len()).then_some(offset)
}

/// Connects to a publisher and maps what it publishes.
#[pyclass(module = "cuda_ipc._core", name = "Subscriber", frozen)]
pub(crate) struct PySubscriber {
    pub(crate) inner: Mutex<Option<Arc<Subscriber>>>,
    pub(crate) device: Device,
}

impl PySubscriber {
    pub(crate) fn get(&self) -> PyResult<Arc<Subscriber>> {
        lock(&self.inner)
            .clone()
            .ok_or_else(|| closed_error("subscriber", "make a new Subscriber"))
    }
}
