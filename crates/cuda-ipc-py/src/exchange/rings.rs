//! Rings: the producer's `RingPublisher`, and the subscriber's `Ring` and
//! its received `RingFrame`s.

use std::sync::{Arc, Mutex};

use cuda_ipc::device::Device;
use cuda_ipc::exchange::{RingFrame, RingPublisher, RingSubscriber, Subscriber};
use cuda_ipc::memory::DeviceMemory;
use cuda_ipc::{Error, Result};
use pyo3::exceptions::PyStopIteration;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::args::duration;
use crate::codec;
use crate::errors::{IntoPyResult, closed_error, lock};
use crate::keep::Keep;
use crate::mapping::{View, layout};
use crate::peers::{After, sync_context};

/// The producer's side of a ring: acquire a slot, fill it, publish it.
#[pyclass(module = "cuda_ipc._core", name = "RingPublisher", frozen)]
pub(super) struct PyRingPublisher {
    pub(super) ring: Arc<RingPublisher>,
    pub(super) device: Device,
    pub(super) slot_bytes: usize,
    /// Device addresses of the slots acquired so far.
    pub(super) addresses: Mutex<std::collections::HashMap<u32, u64>>,
}

#[pymethods]
impl PyRingPublisher {
    /// The number of slots.
    #[getter]
    fn slots(&self) -> usize {
        self.ring.slot_count()
    }
    /// How many subscribers the ring has now.
    fn subscribers(&self) -> usize {
        self.ring.subscribers().len()
    }
    /// Waits up to `timeout` seconds (`None`: for ever) for a free slot;
    /// returns its index.
    #[pyo3(signature = (timeout=None))]
    fn acquire(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<u32> {
        let t = timeout.map(|s| duration(Some(s))).transpose().py()?;
        let (slot, address) = py
            .detach(|| {
                self.ring
                    .acquire(t)
                    .map(|(slot, b)| (slot, b.device_address()))
            })
            .py()?;
        lock(&self.addresses).insert(slot, address);
        Ok(slot)
    }
    /// A view of slot `slot`, as `dtype` with `shape` (default: bytes).
    #[pyo3(signature = (slot, dtype="u8", shape=None))]
    fn view(&self, slot: u32, dtype: &str, shape: Option<Vec<u64>>) -> PyResult<View> {
        let ptr = self.slot_address(slot).py()?;
        let l = layout(
            ptr,
            self.slot_bytes as u64,
            self.device.ordinal(),
            dtype,
            shape,
        )
        .py()?;
        View::new(
            Keep::other(self.device.clone(), self.ring.clone()),
            l,
            None,
            false,
        )
    }
    /// Publishes a filled slot (after the work queued so far on this
    /// device, waited for on the host, or on `stream`, a raw handle of
    /// this device: the device waits, the host does not), with `extra` (a
    /// small dict) in the frame's notice. Returns the frame's sequence
    /// number.
    #[pyo3(signature = (slot, extra=None, stream=None))]
    fn publish(
        &self,
        py: Python<'_>,
        slot: u32,
        extra: Option<&Bound<'_, PyDict>>,
        stream: Option<u64>,
    ) -> PyResult<u64> {
        let extra = match extra {
            None => serde_json::Map::new(),
            Some(d) => {
                let text = codec::document_text(d.as_any(), |reason| Error::InvalidArgument {
                    what: "extra",
                    reason,
                })?;
                match serde_json::from_str(&text) {
                    Ok(serde_json::Value::Object(m)) => m,
                    _ => {
                        return Err(Error::InvalidArgument {
                            what: "extra",
                            reason: "must be a dict of JSON values".into(),
                        })
                        .py();
                    }
                }
            }
        };
        let dev = self.device.clone();
        py.detach(|| {
            After::of(stream).run(&dev, |after| match after {
                None => self.ring.publish_with(slot, extra),
                Some(s) => self.ring.publish_after(slot, extra, s),
            })
        })
        .py()
    }
}

impl PyRingPublisher {
    fn slot_address(&self, slot: u32) -> Result<u64> {
        lock(&self.addresses)
            .get(&slot)
            .copied()
            .ok_or_else(|| Error::InvalidArgument {
                what: "slot",
                reason: format!(
                    "slot {slot} was not acquired yet (the ring has {} slots); call acquire() \
                     and view the slot it returns",
                    self.ring.slot_count()
                ),
            })
    }
}

/// What a ring and its frames share.
pub(super) struct RingShared {
    pub(super) subscriber: Arc<Subscriber>,
    /// Shared with the frames not acknowledged yet (each borrows it).
    pub(super) ring: Mutex<Option<Arc<RingSubscriber<u8>>>>,
}

/// A received frame and the subscription it is acknowledged with.
struct HeldFrame {
    frame: RingFrame<u8>,
    ring: Arc<RingSubscriber<u8>>,
}

/// A subscription to a ring: iterate it for frames (`for frame in ring`),
/// acknowledge each (`frame.ack()`, or leave the `with frame:` block).
#[pyclass(module = "cuda_ipc._core", frozen)]
pub(super) struct Ring {
    pub(super) shared: Arc<RingShared>,
    pub(super) name: String,
    pub(super) device: Device,
    pub(super) timeout: Mutex<Option<f64>>,
}

impl Ring {
    /// What `f` reads of the subscription; an error once it was released.
    fn read<R>(&self, f: impl FnOnce(&RingSubscriber<u8>) -> R) -> PyResult<R> {
        lock(&self.shared.ring)
            .as_deref()
            .map(f)
            .ok_or_else(|| closed_error("ring", "attach it again"))
    }
}

#[pymethods]
impl Ring {
    /// The ring's name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }
    /// The number of slots.
    #[getter]
    fn slots(&self) -> PyResult<usize> {
        self.read(RingSubscriber::slot_count)
    }
    /// Whether frames are waited for through the publisher's fence (else
    /// its event).
    #[getter]
    fn uses_fences(&self) -> PyResult<bool> {
        self.read(RingSubscriber::uses_fences)
    }
    /// Whether iteration spins for the next frame before it sleeps: when
    /// frames are waited for on the fence from the host.
    #[getter]
    fn spins(&self) -> PyResult<bool> {
        self.read(RingSubscriber::spins)
    }
    /// How long iteration waits for a frame, in seconds (`None`: for ever).
    #[getter]
    fn get_timeout(&self) -> Option<f64> {
        *lock(&self.timeout)
    }
    #[setter]
    fn set_timeout(&self, value: Option<f64>) -> PyResult<()> {
        duration(value).py()?;
        *lock(&self.timeout) = value;
        Ok(())
    }
    /// The next frame, within `timeout` seconds (`None`: for ever).
    #[pyo3(signature = (timeout=None))]
    fn next(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<RingFrameView> {
        let t = duration(timeout).py()?;
        let ring = lock(&self.shared.ring)
            .clone()
            .ok_or_else(|| closed_error("ring", "attach it again"))?;
        let sub = self.shared.subscriber.clone();
        let held = py
            .detach(move || -> Result<_> {
                let frame = sub.next_frame(&ring, t)?;
                frame.buffer.synchronize()?;
                Ok(HeldFrame { frame, ring })
            })
            .py()?;
        Ok(RingFrameView {
            slot: held.frame.slot,
            seq: held.frame.seq,
            notice: held.frame.notice.to_string(),
            held: Mutex::new(Some(held)),
            shared: self.shared.clone(),
            device: self.device.clone(),
        })
    }
    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }
    /// Iteration ends when the publisher is gone or takes the ring back.
    fn __next__(&self, py: Python<'_>) -> PyResult<RingFrameView> {
        let timeout = *lock(&self.timeout);
        match self.next(py, timeout) {
            Err(e) if is_end(py, &e) => Err(PyStopIteration::new_err(())),
            other => other,
        }
    }
    /// Ends the subscription (after the work queued on its slots). Fails
    /// while frames are not acknowledged.
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        let ring = {
            let mut guard = lock(&self.shared.ring);
            let Some(shared) = guard.take() else {
                return Ok(());
            };
            match Arc::try_unwrap(shared) {
                Ok(ring) => ring,
                Err(shared) => {
                    let frames = Arc::strong_count(&shared) - 1;
                    *guard = Some(shared);
                    return Err(Error::InvalidArgument {
                        what: "ring release",
                        reason: format!(
                            "{frames} frame(s) are not acknowledged yet; ack() them (or leave \
                             their `with` blocks) first"
                        ),
                    })
                    .py();
                }
            }
        };
        let sub = self.shared.subscriber.clone();
        let dev = self.device.clone();
        py.detach(move || -> Result<_> {
            sync_context(&dev)?;
            sub.release_ring(ring)
        })
        .py()
    }
    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }
    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> bool {
        // Frames still held keep the subscription until they are dropped.
        let ring = lock(&self.shared.ring).take();
        py.detach(move || drop(ring));
        false
    }
}

/// Whether an error from a ring means its end (the publisher is gone, or
/// unpublished it).
fn is_end(py: Python<'_>, e: &PyErr) -> bool {
    e.value(py)
        .getattr("kind")
        .and_then(|k| k.extract::<String>())
        .is_ok_and(|k| k == "peer")
}

/// One received frame of a ring: its slot's memory (`view()`), the
/// producer's notice; `ack()` hands the slot back.
#[pyclass(module = "cuda_ipc._core", name = "RingFrame", frozen)]
pub(super) struct RingFrameView {
    slot: u32,
    seq: u64,
    notice: String,
    held: Mutex<Option<HeldFrame>>,
    shared: Arc<RingShared>,
    device: Device,
}

#[pymethods]
impl RingFrameView {
    /// The slot index.
    #[getter]
    fn slot(&self) -> u32 {
        self.slot
    }
    /// The sequence number (from 1).
    #[getter]
    fn seq(&self) -> u64 {
        self.seq
    }
    /// The producer's notice (its extra fields and the event).
    #[getter]
    fn notice<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        codec::loads(py, &self.notice)
    }
    /// A view of the slot as `dtype` with `shape` (default: bytes). Valid
    /// until `ack()`: the producer then reuses the slot.
    #[pyo3(signature = (dtype="u8", shape=None))]
    fn view(&self, dtype: &str, shape: Option<Vec<u64>>) -> PyResult<View> {
        let guard = lock(&self.held);
        let b = guard
            .as_ref()
            .map(|h| &h.frame.buffer)
            .ok_or_else(|| closed_error("frame", "take the next frame"))?;
        let ptr = b.mapping().base() + b.offset();
        let l = layout(
            ptr,
            b.byte_len() as u64,
            self.device.ordinal(),
            dtype,
            shape,
        )
        .py()?;
        View::new(Keep::other(self.device.clone(), b.clone()), l, None, false)
    }
    /// Hands the slot back to the producer (after the work queued so far on
    /// this device). Safe to call twice.
    fn ack(&self, py: Python<'_>) -> PyResult<()> {
        let Some(held) = lock(&self.held).take() else {
            return Ok(());
        };
        let sub = self.shared.subscriber.clone();
        let dev = self.device.clone();
        py.detach(move || -> Result<_> {
            sync_context(&dev)?;
            let HeldFrame { frame, ring } = held;
            sub.ack(&ring, frame)
        })
        .py()
    }
    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }
    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> PyResult<bool> {
        self.ack(py)?;
        Ok(false)
    }
}
