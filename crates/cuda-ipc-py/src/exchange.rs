//! The exchange channel from Python: `Publisher` (publish, update,
//! unpublish, rings) and `Subscriber` (attach, wait for an update, release,
//! ring frames), over `cuda_ipc::exchange`.
//!
//! The bindings of arenas and sets (`Publisher.arena_alloc`,
//! `publish_set`, `Subscriber.attach_set`, ...) are in `sets.rs`; the
//! methods here only hand over to it.
//!
//! Synchronisation with the frameworks: Python code writes with PyTorch or
//! CuPy on their own streams, which the library does not know. Before a
//! publish or an update the context is synchronised (every stream of it),
//! so the event the library records covers those writes; after an attach
//! or an update is received, the host waits for the publisher's event, so
//! any stream may read at once.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cuda_ipc::descriptor::Descriptor;
use cuda_ipc::device::Device;
use cuda_ipc::exchange::{
    Attachment as Attached, Endpoint, Publisher, PublisherConfig, RingFrame, RingPublisher,
    RingSubscriber, Subscriber, SubscriberConfig,
};
use cuda_ipc::memory::DeviceMemory;
use cuda_ipc::share::SharedBuffer;
use cuda_ipc::{Error, Result};
use pyo3::exceptions::PyStopIteration;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::args::duration;
use crate::codec;
use crate::errors::{IntoPyResult, closed_error, lock};
use crate::keep::{Keep, take_for_release};
use crate::mapping::{Layout, View, layout};
use crate::peers::{PyPublisher, PySubscriber, sync_context};

// --- the publisher ------------------------------------------------------------

/// Device memory allocated to be published (not published yet): fill it
/// through `view()`, then hand it to `Publisher.publish`.
#[pyclass(module = "cuda_ipc._core", frozen)]
struct Allocation {
    buffer: Mutex<Option<Arc<SharedBuffer>>>,
    device: Device,
}

#[pymethods]
impl Allocation {
    /// Length in bytes.
    #[getter]
    fn nbytes(&self) -> PyResult<usize> {
        Ok(self.get()?.byte_len())
    }
    /// How it is shared.
    #[getter]
    fn mechanism(&self) -> PyResult<&'static str> {
        Ok(self.get()?.mechanism().name())
    }
    /// A view as `dtype` with `shape` (default: bytes), for filling it.
    #[pyo3(signature = (dtype="u8", shape=None))]
    fn view(&self, dtype: &str, shape: Option<Vec<u64>>) -> PyResult<View> {
        let b = self.get()?;
        let l = layout(
            b.device_address(),
            b.byte_len() as u64,
            self.device.ordinal(),
            dtype,
            shape,
        )
        .py()?;
        View::new(Keep::other(self.device.clone(), b), l, None, false)
    }
}

impl Allocation {
    fn get(&self) -> PyResult<Arc<SharedBuffer>> {
        lock(&self.buffer)
            .clone()
            .ok_or_else(|| closed_error("allocation", "it was published; use the Published object"))
    }
}

/// A published buffer: write through `view()`, then `Publisher.update`.
#[pyclass(module = "cuda_ipc._core", frozen)]
struct Published {
    name: String,
    buffer: Arc<SharedBuffer>,
    layout: Layout,
    device: Device,
}

#[pymethods]
impl Published {
    /// The entry's name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }
    /// How it is shared.
    #[getter]
    fn mechanism(&self) -> &'static str {
        self.buffer.mechanism().name()
    }
    /// The element type.
    #[getter]
    fn dtype(&self) -> &'static str {
        self.layout.dtype.name()
    }
    /// The shape.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.layout.shape)
    }
    /// A view that keeps the buffer alive, as `dtype` (same size) if given.
    #[pyo3(signature = (dtype=None, raw=false))]
    fn view(&self, dtype: Option<&str>, raw: bool) -> PyResult<View> {
        View::new(
            Keep::other(self.device.clone(), self.buffer.clone()),
            self.layout.clone(),
            dtype,
            raw,
        )
    }
}

#[pymethods]
impl PyPublisher {
    /// Binds the socket `endpoint` (a name under `$XDG_RUNTIME_DIR/cuda-ipc/`,
    /// or a path with a `/`) and starts serving buffers of device `device`.
    #[new]
    #[pyo3(signature = (endpoint, *, device=crate::args::Ordinal(0), allow_uids=Vec::new()))]
    fn new(
        py: Python<'_>,
        endpoint: &str,
        device: crate::args::Ordinal,
        allow_uids: Vec<crate::args::Uid>,
    ) -> PyResult<Self> {
        crate::args::check_endpoint(py, endpoint)?;
        let allow_uids = crate::args::uids(allow_uids);
        let (publisher, dev) = py
            .detach(|| -> Result<_> {
                let dev = crate::mapping::device(device.0)?;
                let config = PublisherConfig::default().with_allow_uids(allow_uids);
                let p = Publisher::bind(&dev, Endpoint::from(endpoint), config)?;
                Ok((p, dev))
            })
            .py()?;
        let path = publisher.path().display().to_string();
        Ok(PyPublisher {
            inner: Mutex::new(Some(Arc::new(publisher))),
            device: dev,
            path,
            arena_buffers: Arc::default(),
        })
    }

    /// The socket path subscribers connect to.
    #[getter]
    fn path(&self) -> &str {
        &self.path
    }

    /// The device ordinal.
    #[getter]
    fn device(&self) -> usize {
        self.device.ordinal()
    }

    /// Allocates `nbytes` of shareable device memory (`mechanism`: legacy,
    /// vmm, pool, fabric, or `None` for the best here) to fill and publish.
    #[pyo3(signature = (nbytes, mechanism=None))]
    fn alloc(
        &self,
        py: Python<'_>,
        nbytes: crate::args::Nbytes,
        mechanism: Option<&str>,
    ) -> PyResult<Allocation> {
        let nbytes = usize::try_from(nbytes.0).map_err(|_| {
            crate::errors::to_py(
                py,
                &Error::InvalidArgument {
                    what: "nbytes",
                    reason: format!("{} bytes is too large for this machine", nbytes.0),
                },
            )
        })?;
        let m = crate::args::mechanism(mechanism).py()?;
        let dev = self.device.clone();
        let buffer = py.detach(|| SharedBuffer::alloc(&dev, nbytes, m)).py()?;
        Ok(Allocation {
            buffer: Mutex::new(Some(Arc::new(buffer))),
            device: self.device.clone(),
        })
    }

    /// Publishes `allocation` as `name`, elements of `dtype` with `shape`,
    /// after the work queued so far on this device (any stream) finished.
    #[pyo3(signature = (name, allocation, dtype="u8", shape=None))]
    fn publish(
        &self,
        py: Python<'_>,
        name: &str,
        allocation: &Allocation,
        dtype: &str,
        shape: Option<Vec<u64>>,
    ) -> PyResult<Published> {
        let publisher = self.get()?;
        let dt = crate::args::dtype(dtype).py()?;
        let l = {
            let arc = allocation.get()?;
            layout(
                arc.device_address(),
                arc.byte_len() as u64,
                self.device.ordinal(),
                dtype,
                shape,
            )
            .py()?
        };
        // The library takes the buffer itself: take it out of the allocation
        // (which holds one reference), and put it back if views of it are
        // still alive.
        let mut arc = lock(&allocation.buffer).take().ok_or_else(|| {
            closed_error("allocation", "it was published; use the Published object")
        })?;
        if Arc::strong_count(&arc) > 1 {
            // Views dropped just before hand their hold back on the
            // library's thread, after a barrier over the context: let
            // those releases run first.
            py.detach(|| cuda_ipc::reaper::settle(std::time::Duration::from_secs(10)));
            arc = match Arc::try_unwrap(arc) {
                Ok(b) => Arc::new(b),
                Err(a) => a,
            };
        }
        let buffer = Arc::try_unwrap(arc).map_err(|arc| {
            *lock(&allocation.buffer) = Some(arc);
            closed_error(
                "allocation",
                "views of it are still alive (drop the tensors made from Allocation.view, or \
                 publish through Publisher.publish in Python, which does)",
            )
        })?;
        let shape = l.shape.clone();
        let dev = self.device.clone();
        let name_owned = name.to_owned();
        let shared_buffer = py
            .detach(move || -> Result<_> {
                sync_context(&dev)?;
                publisher.publish(&name_owned, buffer, dt, Some(shape))
            })
            .py()?;
        Ok(Published {
            name: name.to_owned(),
            layout: Layout {
                ptr: shared_buffer.device_address(),
                ..l
            },
            buffer: shared_buffer,
            device: self.device.clone(),
        })
    }

    /// Tells the subscribers of `name` that new contents are ready (after
    /// the work queued so far on this device). Returns the generation.
    fn update(&self, py: Python<'_>, name: &str) -> PyResult<u64> {
        let publisher = self.get()?;
        let dev = self.device.clone();
        py.detach(|| -> Result<_> {
            sync_context(&dev)?;
            publisher.update(name)
        })
        .py()
    }

    /// Hides `name` from new subscribers and waits up to `timeout` seconds
    /// (`None`: for ever) until every lease on it is released.
    #[pyo3(signature = (name, timeout=None))]
    fn unpublish(&self, py: Python<'_>, name: &str, timeout: Option<f64>) -> PyResult<()> {
        let publisher = self.get()?;
        let t = timeout.map(|s| duration(Some(s))).transpose().py()?;
        py.detach(|| publisher.unpublish(name, t).map(drop)).py()
    }

    /// The current leases: `[{"lease", "name", "pid", "uid"}]`.
    fn leases<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        self.get()?
            .leases()
            .into_iter()
            .map(|l| {
                let d = PyDict::new(py);
                d.set_item("lease", l.lease)?;
                d.set_item("name", l.name)?;
                d.set_item("pid", l.pid)?;
                d.set_item("uid", l.uid)?;
                Ok(d)
            })
            .collect()
    }

    /// Allocates `nbytes` from this publisher's arena (no export: a new
    /// chunk, exported once, only when no chunk has room). Fill it through
    /// `view()`, then publish it in a set with `publish_set`.
    fn arena_alloc(
        &self,
        py: Python<'_>,
        nbytes: crate::args::Nbytes,
    ) -> PyResult<crate::sets::ArenaBuffer> {
        crate::sets::arena_alloc(self, py, nbytes.0)
    }

    /// Makes sure the arena has `nbytes` free, creating (and exporting) one
    /// chunk now if not; returns the bytes of chunks created.
    fn arena_reserve(&self, py: Python<'_>, nbytes: crate::args::Nbytes) -> PyResult<u64> {
        crate::sets::arena_reserve(self, py, nbytes.0)
    }

    /// The mechanism of the arena's chunks (`vmm`, `pool`, `legacy`, ...).
    fn arena_mechanism(&self, py: Python<'_>) -> PyResult<&'static str> {
        crate::sets::arena_mechanism(self, py)
    }

    /// The live arena buffer allocated here that starts at device address
    /// `ptr` and holds at least `nbytes`, if any.
    fn arena_buffer_at(&self, ptr: u64, nbytes: u64) -> Option<crate::sets::ArenaBuffer> {
        crate::sets::arena_buffer_at(self, ptr, nbytes)
    }

    /// The live arena buffer allocated here (by `arena_alloc` or by the
    /// shareable torch allocator) that holds the `nbytes` bytes from device
    /// address `ptr`, and `ptr`'s offset in it; `None` if there is none.
    fn arena_buffer_containing(
        &self,
        ptr: u64,
        nbytes: u64,
    ) -> Option<(crate::sets::ArenaBuffer, u64)> {
        crate::sets::arena_buffer_containing(self, ptr, nbytes)
    }

    /// The arena's counts: `chunks`, `chunk_bytes`, `idle_chunks`,
    /// `buffers`, `used_bytes`, `requested_bytes`, `leases`,
    /// `held_by_leases_only`, `pins`, `chunks_created`, `chunks_released`.
    fn arena_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        crate::sets::arena_stats(self, py)
    }

    /// Publishes `members`, `[(name, ArenaBuffer, dtype, shape, offset)]`,
    /// as one set called `name`, after the work queued so far on this
    /// device; `offset` is the member's first byte in its buffer.
    fn publish_set<'py>(
        &self,
        py: Python<'py>,
        name: &str,
        members: Vec<crate::sets::MemberArg<'py>>,
    ) -> PyResult<()> {
        crate::sets::publish_set(self, py, name, members)
    }

    /// Tells the subscribers of the set `name` that new contents are ready
    /// (after the work queued so far on this device). Returns the version.
    fn update_set(&self, py: Python<'_>, name: &str) -> PyResult<u64> {
        crate::sets::update_set(self, py, name)
    }

    /// Hides the set `name` from new subscribers and waits up to `timeout`
    /// seconds (`None`: for ever) until every lease on it is released.
    #[pyo3(signature = (name, timeout=None))]
    fn unpublish_set(&self, py: Python<'_>, name: &str, timeout: Option<f64>) -> PyResult<()> {
        crate::sets::unpublish_set(self, py, name, timeout)
    }

    /// Lets go of the buffers of unpublished sets whose last lease has
    /// ended; returns how many sets.
    fn reap(&self) -> PyResult<usize> {
        Ok(self.get()?.reap())
    }

    /// Unpublished sets still leased by a subscriber.
    fn retired_sets(&self) -> PyResult<usize> {
        let p = self.get()?;
        Ok(p.retired_sets())
    }

    /// Releases the arena's chunks that hold no buffer and that no
    /// subscriber maps any more; returns the bytes released.
    fn trim(&self, py: Python<'_>) -> PyResult<u64> {
        let p = self.get()?;
        py.detach(|| p.trim()).py()
    }

    /// Creates a ring of `slots` buffers of `slot_bytes` each under `name`.
    #[pyo3(signature = (name, slots, slot_bytes, mechanism=None))]
    fn ring(
        &self,
        py: Python<'_>,
        name: &str,
        slots: crate::args::Slots,
        slot_bytes: crate::args::SlotBytes,
        mechanism: Option<&str>,
    ) -> PyResult<PyRingPublisher> {
        let (slots, slot_bytes) = (slots.0, slot_bytes.0);
        let publisher = self.get()?;
        let m = crate::args::mechanism(mechanism).py()?;
        let ring = py
            .detach(|| publisher.ring(name, slots, slot_bytes, m))
            .py()?;
        Ok(PyRingPublisher {
            ring: Arc::new(ring),
            device: self.device.clone(),
            slot_bytes,
            addresses: Mutex::new(std::collections::HashMap::new()),
        })
    }

    /// Stops serving (subscribers see the publisher gone). Safe to call twice.
    fn close(&self, py: Python<'_>) {
        // Allocations of a shareable block stop here; its segments stay
        // until torch frees them.
        crate::alloc::forget(self);
        let p = lock(&self.inner).take();
        py.detach(move || drop(p));
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> bool {
        self.close(py);
        false
    }
}

/// The producer's side of a ring: acquire a slot, fill it, publish it.
#[pyclass(module = "cuda_ipc._core", name = "RingPublisher", frozen)]
struct PyRingPublisher {
    ring: Arc<RingPublisher>,
    device: Device,
    slot_bytes: usize,
    /// Device addresses of the slots acquired so far.
    addresses: Mutex<std::collections::HashMap<u32, u64>>,
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
    /// device), with `extra` (a small dict) in the frame's notice. Returns
    /// the frame's sequence number.
    #[pyo3(signature = (slot, extra=None))]
    fn publish(
        &self,
        py: Python<'_>,
        slot: u32,
        extra: Option<&Bound<'_, PyDict>>,
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
        py.detach(|| -> Result<_> {
            sync_context(&dev)?;
            self.ring.publish_with(slot, extra)
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

// --- the subscriber -----------------------------------------------------------

#[pymethods]
impl PySubscriber {
    /// Connects to the publisher at `endpoint` (a name or a path); requests
    /// time out after `timeout` seconds.
    #[new]
    #[pyo3(signature = (endpoint, *, device=crate::args::Ordinal(0), timeout=5.0, allow_uids=Vec::new()))]
    fn new(
        py: Python<'_>,
        endpoint: &str,
        device: crate::args::Ordinal,
        timeout: f64,
        allow_uids: Vec<crate::args::Uid>,
    ) -> PyResult<Self> {
        let timeout = duration(Some(timeout)).py()?;
        crate::args::check_endpoint(py, endpoint)?;
        let allow_uids = crate::args::uids(allow_uids);
        let (sub, dev) = py
            .detach(|| -> Result<_> {
                let dev = crate::mapping::device(device.0)?;
                let config = SubscriberConfig::default()
                    .with_timeout(timeout)
                    .with_allow_uids(allow_uids);
                Ok((
                    Subscriber::connect(&dev, Endpoint::from(endpoint), config)?,
                    dev,
                ))
            })
            .py()?;
        Ok(PySubscriber {
            inner: Mutex::new(Some(Arc::new(sub))),
            device: dev,
        })
    }

    /// The names published now.
    fn list(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        let s = self.get()?;
        py.detach(|| s.list()).py()
    }

    /// Whether the publisher is still there (does not block).
    fn is_alive(&self) -> PyResult<bool> {
        Ok(self.get()?.is_alive())
    }

    /// How many mappings this subscriber opened (cache misses).
    #[getter]
    fn opens(&self) -> PyResult<u64> {
        Ok(self.get()?.opens())
    }

    /// Attaches to the buffer published as `name`: a lease, the memory
    /// mapped, the publisher's event waited for.
    fn attach(&self, py: Python<'_>, name: &str) -> PyResult<Attachment> {
        let sub = self.get()?;
        let attached = py
            .detach(|| -> Result<_> {
                let a = sub.attach::<u8>(name)?;
                a.buffer().synchronize()?;
                Ok(a)
            })
            .py()?;
        let d = attached.descriptor().clone();
        let layout = Layout::of(attached.buffer(), &d);
        Ok(Attachment {
            name: attached.name().to_owned(),
            lease: attached.lease(),
            keep: Mutex::new(Some(Keep::new(attached.buffer().clone()))),
            attached: Mutex::new(Some(Arc::new(attached))),
            subscriber: sub,
            layout,
            descriptor: d,
        })
    }

    /// Attaches the set published as `name`: one lease for the whole set,
    /// each chunk mapped once, the publisher's event (or fence) waited for.
    fn attach_set(&self, py: Python<'_>, name: &str) -> PyResult<crate::sets::SetAttachment> {
        crate::sets::attach_set(self, py, name)
    }

    /// Unmaps the cached arena chunks that no set or buffer holds any more
    /// (so that the publisher may trim them).
    fn drop_idle_mappings(&self, py: Python<'_>) -> PyResult<()> {
        let s = self.get()?;
        py.detach(|| s.drop_idle_mappings());
        Ok(())
    }

    /// `(count, bytes)` of the arena chunks this subscriber keeps mapped.
    fn cached_mappings(&self) -> PyResult<(usize, u64)> {
        Ok(self.get()?.cached_mappings())
    }

    /// Subscribes to the ring `name` (every slot mapped once).
    fn attach_ring(&self, py: Python<'_>, name: &str) -> PyResult<Ring> {
        let sub = self.get()?;
        let ring = py.detach(|| sub.attach_ring::<u8>(name)).py()?;
        Ok(Ring {
            shared: Arc::new(RingShared {
                subscriber: sub,
                ring: Mutex::new(Some(Arc::new(ring))),
            }),
            name: name.to_owned(),
            device: self.device.clone(),
            timeout: Mutex::new(None),
        })
    }

    /// Disconnects (leases still held by attachments or tensors end when
    /// they die). Safe to call twice.
    fn close(&self, py: Python<'_>) {
        let s = lock(&self.inner).take();
        py.detach(move || drop(s));
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> bool {
        self.close(py);
        false
    }
}

/// A buffer attached from a publisher: a lease and a mapping. Views
/// (tensors, arrays) hold the lease too: it ends at `release()`, or when
/// this object and the last view are gone.
#[pyclass(module = "cuda_ipc._core", frozen)]
struct Attachment {
    name: String,
    lease: u64,
    /// This object's own hold (views hold clones).
    keep: Mutex<Option<Keep>>,
    /// Shared with a `wait_update` in progress (never held locked while
    /// waiting, so other threads are not blocked with the GIL held).
    attached: Mutex<Option<Arc<Attached<u8>>>>,
    subscriber: Arc<Subscriber>,
    layout: Layout,
    descriptor: Descriptor,
}

#[pymethods]
impl Attachment {
    /// The entry's name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }
    /// The lease id.
    #[getter]
    fn lease(&self) -> u64 {
        self.lease
    }
    /// Device address of the first byte.
    #[getter]
    fn ptr(&self) -> u64 {
        self.layout.ptr
    }
    /// Length in bytes.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.layout.len
    }
    /// The element type.
    #[getter]
    fn dtype(&self) -> &'static str {
        self.layout.dtype.name()
    }
    /// The shape.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.layout.shape)
    }
    /// The CUDA device ordinal.
    #[getter]
    fn device(&self) -> usize {
        self.layout.ordinal
    }
    /// How it was shared.
    #[getter]
    fn mechanism(&self) -> &'static str {
        self.descriptor.mechanism().name()
    }
    /// The descriptor the publisher sent.
    #[getter]
    fn descriptor<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        codec::loads(py, &self.descriptor.to_json())
    }
    /// Whether `release()` was called.
    #[getter]
    fn released(&self) -> bool {
        lock(&self.attached).is_none()
    }
    /// A view that holds the lease, as `dtype` (same size) if given.
    #[pyo3(signature = (dtype=None, raw=false))]
    fn view(&self, dtype: Option<&str>, raw: bool) -> PyResult<View> {
        let keep = lock(&self.keep)
            .clone()
            .ok_or_else(|| closed_error("attachment", "attach again"))?;
        View::new(keep, self.layout.clone(), dtype, raw)
    }
    /// Waits up to `timeout` seconds (`None`: for ever) for the publisher's
    /// next update, then for its event. Returns the update's generation.
    #[pyo3(signature = (timeout=None))]
    fn wait_update(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<u64> {
        let t = duration(timeout).py()?;
        let a = lock(&self.attached)
            .clone()
            .ok_or_else(|| closed_error("attachment", "attach again"))?;
        let sub = &self.subscriber;
        py.detach(|| -> Result<_> {
            let generation = sub.wait_update(&a, t)?;
            a.buffer().synchronize()?;
            Ok(generation)
        })
        .py()
    }
    /// Ends the lease now (after the work queued on the memory). Fails
    /// while tensors or arrays made from it are alive: the lease then ends
    /// when the last of them dies.
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        let Some((keep, a)) = take_for_release(
            &self.attached,
            &self.keep,
            &self.name,
            self.lease,
            "attachment",
        )?
        else {
            return Ok(());
        };
        let sub = self.subscriber.clone();
        py.detach(move || -> Result<_> {
            if let Some(k) = keep {
                k.release_now()?;
            }
            sub.release(a)
        })
        .py()
    }
    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }
    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> bool {
        // Views still alive keep the lease until they die.
        let a = lock(&self.attached).take();
        let keep = lock(&self.keep).take();
        py.detach(move || drop((keep, a)));
        false
    }
}

/// What a ring and its frames share.
struct RingShared {
    subscriber: Arc<Subscriber>,
    /// Shared with the frames not acknowledged yet (each borrows it).
    ring: Mutex<Option<Arc<RingSubscriber<u8>>>>,
}

/// A received frame and the subscription it borrows from, kept together.
struct HeldFrame {
    // Declared before `ring`: dropped first, while what it borrows lives.
    frame: RingFrame<'static, u8>,
    ring: Arc<RingSubscriber<u8>>,
}

/// The next frame of `ring`, held with the subscription it borrows.
#[allow(unsafe_code)]
fn next_held(
    subscriber: &Subscriber,
    ring: Arc<RingSubscriber<u8>>,
    timeout: Duration,
) -> Result<HeldFrame> {
    let frame = subscriber.next_frame(&ring, timeout)?;
    // SAFETY: the frame borrows the `RingSubscriber` inside the Arc's heap
    // allocation, which does not move when the Arc does. `HeldFrame` keeps
    // that Arc next to the frame and drops the frame first, so the borrow
    // never outlives what it points to; the 'static lifetime never escapes
    // (the frame is only read through `HeldFrame`, and handed back to the
    // library by `Subscriber::ack` together with the same ring).
    let frame = unsafe { std::mem::transmute::<RingFrame<'_, u8>, RingFrame<'static, u8>>(frame) };
    Ok(HeldFrame { frame, ring })
}

/// A subscription to a ring: iterate it for frames (`for frame in ring`),
/// acknowledge each (`frame.ack()`, or leave the `with frame:` block).
#[pyclass(module = "cuda_ipc._core", frozen)]
struct Ring {
    shared: Arc<RingShared>,
    name: String,
    device: Device,
    timeout: Mutex<Option<f64>>,
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
        lock(&self.shared.ring)
            .as_ref()
            .map(|r| r.slot_count())
            .ok_or_else(|| closed_error("ring", "attach it again"))
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
                let held = next_held(&sub, ring, t)?;
                held.frame.buffer.synchronize()?;
                Ok(held)
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
struct RingFrameView {
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
            .map(|h| h.frame.buffer)
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

/// Registers this module's classes.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPublisher>()?;
    m.add_class::<PySubscriber>()?;
    m.add_class::<PyRingPublisher>()?;
    m.add_class::<Allocation>()?;
    m.add_class::<Published>()?;
    m.add_class::<Attachment>()?;
    m.add_class::<Ring>()?;
    m.add_class::<RingFrameView>()?;
    Ok(())
}
