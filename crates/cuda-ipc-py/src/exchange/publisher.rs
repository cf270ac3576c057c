//! The publisher's methods: `Publisher` (allocate, publish, update,
//! unpublish, arenas and sets through `sets`, rings), and the `Allocation`
//! and `Published` objects it hands out.

use std::sync::{Arc, Mutex};

use cuda_ipc::device::Device;
use cuda_ipc::exchange::{Endpoint, Publisher, PublisherConfig};
use cuda_ipc::memory::DeviceMemory;
use cuda_ipc::share::SharedBuffer;
use cuda_ipc::{Error, Result};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use super::rings::PyRingPublisher;
use crate::args::duration;
use crate::errors::{IntoPyResult, closed_error, lock};
use crate::keep::Keep;
use crate::mapping::{Layout, View, layout};
use crate::peers::{After, PyPublisher, sync_context};

/// Device memory allocated to be published (not published yet): fill it
/// through `view()`, then hand it to `Publisher.publish`.
#[pyclass(module = "cuda_ipc._core", frozen)]
pub(super) struct Allocation {
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
pub(super) struct Published {
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
    /// With `read_only_readers`, readers map every set and arena buffer
    /// read-only (the arena's chunks are then vmm memory; `publish` and
    /// `ring` are refused).
    #[new]
    #[pyo3(signature = (endpoint, *, device=crate::args::Ordinal(0), allow_uids=Vec::new(), read_only_readers=false))]
    fn new(
        py: Python<'_>,
        endpoint: &str,
        device: crate::args::Ordinal,
        allow_uids: Vec<crate::args::Uid>,
        read_only_readers: bool,
    ) -> PyResult<Self> {
        crate::args::check_endpoint(py, endpoint)?;
        let allow_uids = crate::args::uids(allow_uids);
        let config = PublisherConfig::default()
            .with_allow_uids(allow_uids)
            .with_read_only_readers(read_only_readers);
        config.validate().py()?;
        let (publisher, dev) = py
            .detach(|| -> Result<_> {
                let dev = crate::mapping::device(device.0)?;
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

    /// Whether readers map what this publisher publishes read-only.
    #[getter]
    fn read_only_readers(&self) -> PyResult<bool> {
        Ok(self.get()?.read_only_readers())
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
    /// the work queued so far on this device, waited for on the host, or
    /// on `stream`, as for `publish_set`). Returns the version (from 1).
    #[pyo3(signature = (name, stream=None))]
    fn update(&self, py: Python<'_>, name: &str, stream: Option<u64>) -> PyResult<u64> {
        let publisher = self.get()?;
        let dev = self.device.clone();
        py.detach(|| {
            After::of(stream).run(&dev, |after| match after {
                None => publisher.update(name),
                Some(s) => publisher.update_after(name, s),
            })
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
    /// device (`stream=None`: the host waits for it) or on the stream
    /// `stream` (a raw handle of this device: the device waits, the host
    /// does not); `offset` is the member's first byte in its buffer.
    #[pyo3(signature = (name, members, stream=None))]
    fn publish_set<'py>(
        &self,
        py: Python<'py>,
        name: &str,
        members: Vec<crate::sets::MemberArg<'py>>,
        stream: Option<u64>,
    ) -> PyResult<()> {
        crate::sets::publish_set(self, py, name, members, After::of(stream))
    }

    /// Tells the subscribers of the set `name` that new contents are ready
    /// (after the work queued so far on this device, or on `stream`, as
    /// for `publish_set`). Returns the version.
    #[pyo3(signature = (name, stream=None))]
    fn update_set(&self, py: Python<'_>, name: &str, stream: Option<u64>) -> PyResult<u64> {
        crate::sets::update_set(self, py, name, After::of(stream))
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

    /// Creates a ring of `slots` buffers of `slot_bytes` each under `name`;
    /// `fences_only`: each frame signals its slot's fence and records no
    /// event (readers wait on the fence; one asking for events is refused).
    #[pyo3(signature = (name, slots, slot_bytes, mechanism=None, fences_only=false))]
    fn ring(
        &self,
        py: Python<'_>,
        name: &str,
        slots: crate::args::Slots,
        slot_bytes: crate::args::SlotBytes,
        mechanism: Option<&str>,
        fences_only: bool,
    ) -> PyResult<PyRingPublisher> {
        let (slots, slot_bytes) = (slots.0, slot_bytes.0);
        let publisher = self.get()?;
        let m = crate::args::mechanism(mechanism).py()?;
        let sync = if fences_only {
            cuda_ipc::exchange::RingSync::FencesOnly
        } else {
            cuda_ipc::exchange::RingSync::EventsAndFences
        };
        let ring = py
            .detach(|| publisher.ring_with(name, slots, slot_bytes, m, sync))
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
