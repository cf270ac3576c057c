//! Arenas and sets from Python, over `cuda_ipc::exchange`: `ArenaBuffer`
//! (a buffer of a publisher's arena, filled through its views), the
//! publisher's `publish_set` / `update_set` / `unpublish_set`, and
//! `SetAttachment`, a set attached by a subscriber.
//!
//! Lifetimes: an `ArenaBuffer` object and every view (tensor, array) made
//! from it hold the buffer; a published set holds its members too, until
//! its last subscriber's lease ends. A `SetAttachment` holds the set's one
//! lease and its chunk mappings; every view of one of its entries holds
//! them as well, so the lease ends at `release()`, or when the attachment
//! and the last view are gone (or the process exits).
//!
//! Synchronisation is the channel's (see `exchange`): publishing and
//! updating wait for the work queued on the whole context first; attaching
//! and receiving an update wait on the host for the publisher's event or
//! fence, so every stream may read at once.

use std::sync::{Arc, Mutex, OnceLock};

use cuda_ipc::arena::{DeviceArenaBuffer, SetMember};
use cuda_ipc::descriptor::Dtype;
use cuda_ipc::device::Device;
use cuda_ipc::exchange::SetAttachment as Attached;
use cuda_ipc::memory::DeviceMemory;
use cuda_ipc::{Error, Result};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::args::duration;
use crate::codec;
use crate::errors::{IntoPyResult, closed_error, lock};
use crate::keep::{Keep, take_for_release};
use crate::mapping::{Layout, View, layout};
use crate::peers::{After, PyPublisher, PySubscriber};
use crate::runs::{self, Place, Placed, Run};

// --- the publisher ------------------------------------------------------------

/// A buffer of a publisher's arena: fill it through `view()`, then publish
/// it as a member of a set (`Publisher.publish_set`). The buffer lives while
/// this object, a view of it or a set that holds it lives.
#[pyclass(module = "cuda_ipc._core", frozen)]
pub(crate) struct ArenaBuffer {
    buffer: Arc<DeviceArenaBuffer>,
    device: Device,
}

#[pymethods]
impl ArenaBuffer {
    /// Device address of the first byte.
    #[getter]
    fn ptr(&self) -> u64 {
        self.buffer.device_address()
    }
    /// Length in bytes, as asked for.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.buffer.byte_len()
    }
    /// Bytes from the start of its chunk.
    #[getter]
    fn offset(&self) -> u64 {
        self.buffer.offset()
    }
    /// The index of its chunk in the arena.
    #[getter]
    fn chunk(&self) -> u64 {
        self.buffer.chunk().id().index
    }
    /// How many published sets (one per subscriber lease) hold it.
    #[getter]
    fn leases(&self) -> usize {
        self.buffer.leases()
    }
    /// The CUDA device ordinal.
    #[getter]
    fn device(&self) -> usize {
        self.device.ordinal()
    }
    /// A view as `dtype` with `shape` (default: bytes) that keeps the buffer.
    #[pyo3(signature = (dtype="u8", shape=None))]
    fn view(&self, dtype: &str, shape: Option<Vec<u64>>) -> PyResult<View> {
        let l = layout(
            self.buffer.device_address(),
            self.buffer.byte_len(),
            self.device.ordinal(),
            dtype,
            shape,
        )
        .py()?;
        View::new(
            Keep::other(self.device.clone(), self.buffer.clone()),
            l,
            None,
            false,
        )
    }
    fn __repr__(&self) -> String {
        format!(
            "<cuda_ipc.ArenaBuffer {} bytes at 0x{:x} (chunk {}, offset {}) on cuda:{}>",
            self.buffer.byte_len(),
            self.buffer.device_address(),
            self.buffer.chunk().id().index,
            self.buffer.offset(),
            self.device.ordinal()
        )
    }
}

impl ArenaBuffer {
    /// The Python object of `buffer`, a buffer of `device`.
    pub(crate) fn new(buffer: Arc<DeviceArenaBuffer>, device: Device) -> Self {
        ArenaBuffer { buffer, device }
    }
}

/// A new buffer of `nbytes` from `p`'s arena, registered (so that memory
/// already in the arena is published without a copy).
pub(crate) fn alloc_registered(
    p: &PyPublisher,
    py: Python<'_>,
    nbytes: u64,
) -> PyResult<Arc<DeviceArenaBuffer>> {
    let publisher = p.get()?;
    let buffer = Arc::new(py.detach(|| publisher.alloc(nbytes)).py()?);
    p.arena_buffers.insert(&buffer);
    Ok(buffer)
}

/// `Publisher.arena_alloc`.
pub(crate) fn arena_alloc(p: &PyPublisher, py: Python<'_>, nbytes: u64) -> PyResult<ArenaBuffer> {
    let buffer = alloc_registered(p, py, nbytes)?;
    Ok(ArenaBuffer {
        buffer,
        device: p.device.clone(),
    })
}

/// `Publisher.arena_reserve`.
pub(crate) fn arena_reserve(p: &PyPublisher, py: Python<'_>, nbytes: u64) -> PyResult<u64> {
    let publisher = p.get()?;
    py.detach(|| publisher.arena()?.reserve(nbytes)).py()
}

/// `Publisher.arena_mechanism`.
pub(crate) fn arena_mechanism(p: &PyPublisher, py: Python<'_>) -> PyResult<&'static str> {
    let publisher = p.get()?;
    py.detach(|| Ok(publisher.arena()?.backing().mechanism().name()))
        .py()
}

/// `Publisher.arena_buffer_at`.
pub(crate) fn arena_buffer_at(p: &PyPublisher, ptr: u64, nbytes: u64) -> Option<ArenaBuffer> {
    p.arena_buffers.find(ptr, nbytes).map(|buffer| ArenaBuffer {
        buffer,
        device: p.device.clone(),
    })
}

/// `Publisher.arena_buffer_containing`.
pub(crate) fn arena_buffer_containing(
    p: &PyPublisher,
    ptr: u64,
    nbytes: u64,
) -> Option<(ArenaBuffer, u64)> {
    p.arena_buffers
        .containing(ptr, nbytes)
        .map(|(buffer, offset)| {
            (
                ArenaBuffer {
                    buffer,
                    device: p.device.clone(),
                },
                offset,
            )
        })
}

/// `Publisher.arena_stats`.
pub(crate) fn arena_stats<'py>(p: &PyPublisher, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
    let publisher = p.get()?;
    let s = py
        .detach(|| publisher.arena().map(cuda_ipc::arena::Arena::stats))
        .py()?;
    let d = PyDict::new(py);
    d.set_item("chunks", s.chunks)?;
    d.set_item("chunk_bytes", s.chunk_bytes)?;
    d.set_item("idle_chunks", s.idle_chunks)?;
    d.set_item("buffers", s.buffers)?;
    d.set_item("used_bytes", s.used_bytes)?;
    d.set_item("requested_bytes", s.requested_bytes)?;
    d.set_item("leases", s.leases)?;
    d.set_item("held_by_leases_only", s.held_by_leases_only)?;
    d.set_item("pins", s.pins)?;
    d.set_item("chunks_created", s.chunks_created)?;
    d.set_item("chunks_released", s.chunks_released)?;
    Ok(d)
}

/// One member of `Publisher.publish_set`: `(name, buffer, dtype, shape,
/// offset)`, `offset` the member's first byte in the buffer.
pub(crate) type MemberArg<'py> = (String, Bound<'py, ArenaBuffer>, String, Vec<u64>, u64);

/// `Publisher.publish_set`.
pub(crate) fn publish_set(
    p: &PyPublisher,
    py: Python<'_>,
    name: &str,
    members: Vec<MemberArg<'_>>,
    after: After,
) -> PyResult<()> {
    let publisher = p.get()?;
    if members.is_empty() {
        return Err(Error::InvalidArgument {
            what: "set members",
            reason: format!("{name:?} has none; a set holds at least one buffer"),
        })
        .py();
    }
    let mut owned = Vec::with_capacity(members.len());
    for (i, (member, buffer, dt, shape, offset)) in members.into_iter().enumerate() {
        let dt = member_dtype(i, &member, &dt).py()?;
        owned.push((member, buffer.get().buffer.clone(), dt, shape, offset));
    }
    let dev = p.device.clone();
    py.detach(move || -> Result<()> {
        let members: Vec<SetMember<'_>> = owned
            .iter()
            .map(|(name, buffer, dtype, shape, offset)| {
                SetMember::new(name, *dtype, shape, buffer).at(*offset)
            })
            .collect();
        after.run(&dev, |stream| match stream {
            Some(s) => publisher.publish_set_after(name, &members, s),
            None => publisher.publish_set(name, &members),
        })
    })
    .py()
}

/// The element type of member `index`, or an error that names the member.
fn member_dtype(index: usize, member: &str, name: &str) -> Result<Dtype> {
    crate::args::dtype(name).map_err(|_| Error::InvalidArgument {
        what: "set member dtype",
        reason: format!(
            "member {index} ({member:?}) has the unknown dtype {name:?}; a set holds {}",
            Dtype::ALL.map(Dtype::name).join(", ")
        ),
    })
}

/// `Publisher.update_set`.
pub(crate) fn update_set(
    p: &PyPublisher,
    py: Python<'_>,
    name: &str,
    after: After,
) -> PyResult<u64> {
    let mut phases = crate::phases::Phases::start("update_set");
    let clock = &mut phases;
    let publisher = p.get()?;
    let dev = p.device.clone();
    py.detach(|| -> Result<u64> {
        after.run(&dev, |stream| {
            // The context's wait (none when ordered after a stream).
            clock.mark("sync_context");
            let v = match stream {
                Some(s) => publisher.update_set_after(name, s)?,
                None => publisher.update_set(name)?,
            };
            clock.mark("update_set");
            Ok(v)
        })
    })
    .py()
}

/// `Publisher.unpublish_set`.
pub(crate) fn unpublish_set(
    p: &PyPublisher,
    py: Python<'_>,
    name: &str,
    timeout: Option<f64>,
) -> PyResult<()> {
    let publisher = p.get()?;
    let t = duration(timeout).py()?;
    py.detach(|| publisher.unpublish_set(name, Some(t))).py()
}

// --- the subscriber -----------------------------------------------------------

/// A set attached from a publisher: one lease, each chunk mapped once, and
/// a view of every entry by index or name. Views hold the lease too: it
/// ends at `release()`, or when this object and the last view are gone.
#[pyclass(module = "cuda_ipc._core", frozen)]
pub(crate) struct SetAttachment {
    pub(crate) name: String,
    lease: u64,
    uses_fence: bool,
    /// Whether the chunks are mapped read-only.
    read_only: bool,
    pub(crate) ordinal: usize,
    /// Each entry's device address in this process (its name, dtype,
    /// shape and length are the record's).
    pub(crate) ptrs: Vec<u64>,
    /// The record (shared with the attachment and readable after its
    /// release) and its entries by name.
    index: cuda_ipc::set::NameIndex,
    /// Each entry's chunk mapping: `(local address, size)`.
    chunks: Vec<(u64, u64)>,
    /// The entries grouped for few DLPack imports (`runs`, `places`),
    /// planned at the first read (the C API path makes every tensor on
    /// its own and never reads them).
    runs: OnceLock<(Vec<Run>, Vec<Option<Place>>)>,
    /// The layout hash of its entries (what a service writer commits),
    /// worked out at the first read of `layout_hash` from the record.
    layout_hash: OnceLock<String>,
    /// This object's own hold (views hold clones): a view of the first
    /// entry, which holds the lease and, through it, every chunk mapping.
    pub(crate) keep: Mutex<Option<Keep>>,
    /// Shared with a `wait_update` in progress (never held locked while
    /// waiting).
    set: Mutex<Option<Arc<Attached>>>,
    subscriber: Arc<cuda_ipc::exchange::Subscriber>,
}

/// `Subscriber.attach_set`: read-only when `read_only`, else as the
/// subscriber maps (read-only all the same where the publisher asks).
pub(crate) fn attach_set(
    s: &PySubscriber,
    py: Python<'_>,
    name: &str,
    read_only: bool,
) -> PyResult<SetAttachment> {
    let mut phases = crate::phases::Phases::start("attach_set");
    let clock = &mut phases;
    let sub = s.get()?;
    let (set, first, ptrs, chunks) = py
        .detach(|| -> Result<_> {
            let set = if read_only {
                sub.attach_set_with(name, cuda_ipc::Access::ReadOnly)?
            } else {
                sub.attach_set(name)?
            };
            clock.mark("core attach_set");
            // Every view of the set shares the device stream that waited on
            // the publisher's event or fence.
            let first = set.view::<u8>(0)?;
            first.synchronize()?;
            clock.mark("synchronize");
            let places = set.entry_places()?;
            let mut ptrs = Vec::with_capacity(places.len());
            let mut chunks = Vec::with_capacity(places.len());
            for p in places {
                chunks.push((p.mapping_base, p.mapping_size));
                ptrs.push(p.address);
            }
            clock.mark("entries");
            Ok((set, first, ptrs, chunks))
        })
        .py()?;
    Ok(SetAttachment {
        layout_hash: OnceLock::new(),
        name: set.name().to_owned(),
        lease: set.lease(),
        uses_fence: set.uses_fence(),
        read_only: set.read_only(),
        ordinal: s.device.ordinal(),
        ptrs,
        index: cuda_ipc::set::NameIndex::new(set.shared_record()),
        chunks,
        runs: OnceLock::new(),
        keep: Mutex::new(Some(Keep::new(first))),
        set: Mutex::new(Some(Arc::new(set))),
        subscriber: sub,
    })
}

impl SetAttachment {
    /// The entries in the publisher's order (each at `ptrs[i]` here).
    pub(crate) fn set_entries(&self) -> &Arc<[cuda_ipc::set::SetEntry]> {
        &self.index.record().entries
    }

    /// The runs and each entry's place in one, planned at the first call.
    fn runs_and_places(&self) -> &(Vec<Run>, Vec<Option<Place>>) {
        self.runs.get_or_init(|| {
            let items: Vec<Placed> = self
                .set_entries()
                .iter()
                .zip(&self.ptrs)
                .zip(&self.chunks)
                .map(|((e, &ptr), &(chunk, chunk_size))| Placed {
                    chunk,
                    chunk_size,
                    ptr,
                    len: e.len,
                    dtype: e.dtype,
                    shape: e.shape.to_vec(),
                })
                .collect();
            runs::plan(&items)
        })
    }

    /// The position of the entry called `name`.
    fn position_of(&self, name: &str) -> Option<usize> {
        self.index.position(name)
    }

    /// The position of `key`: an index, or an entry's name.
    fn position(&self, key: &Bound<'_, PyAny>) -> Result<usize> {
        if let Ok(i) = key.extract::<usize>() {
            if i < self.ptrs.len() {
                return Ok(i);
            }
            return Err(Error::InvalidArgument {
                what: "set entry",
                reason: format!(
                    "index {i} is past the {} entries of {:?}",
                    self.ptrs.len(),
                    self.name
                ),
            });
        }
        if let Ok(name) = key.extract::<String>() {
            return self
                .position_of(&name)
                .ok_or_else(|| Error::InvalidArgument {
                    what: "set entry",
                    reason: format!("{:?} has no entry called {name:?}", self.name),
                });
        }
        Err(Error::InvalidArgument {
            what: "set entry",
            reason: "expected an index (int) or an entry name (str)".into(),
        })
    }

    fn live(&self) -> PyResult<Arc<Attached>> {
        lock(&self.set)
            .clone()
            .ok_or_else(|| closed_error("set", "attach it again"))
    }
}

#[pymethods]
impl SetAttachment {
    /// The set's name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }
    /// The lease id.
    #[getter]
    fn lease(&self) -> u64 {
        self.lease
    }
    /// The layout hash of its entries (names, dtypes, shapes, places), as
    /// a service's `commit` names it.
    #[getter]
    fn layout_hash(&self) -> &str {
        self.layout_hash
            .get_or_init(|| cuda_ipc::service::layout::layout_hash(self.set_entries()))
    }
    /// Whether updates are waited for through the publisher's fence (else
    /// its event).
    #[getter]
    fn uses_fence(&self) -> bool {
        self.uses_fence
    }
    /// Whether the set is mapped read-only (asked for at attach, or the
    /// publisher serves it to read-only readers): writing through any of
    /// its tensors or views fails.
    #[getter]
    fn read_only(&self) -> bool {
        self.read_only
    }
    /// The CUDA device ordinal.
    #[getter]
    fn device(&self) -> usize {
        self.ordinal
    }
    /// The bytes of every entry together.
    #[getter]
    fn nbytes(&self) -> u64 {
        // Saturating: sizes come from the publisher.
        self.set_entries()
            .iter()
            .fold(0u64, |sum, e| sum.saturating_add(e.len))
    }
    /// Whether `release()` was called.
    #[getter]
    fn released(&self) -> bool {
        lock(&self.set).is_none()
    }
    /// The entries in the publisher's order: `[(name, dtype, shape, ptr,
    /// nbytes)]`, `ptr` the device address in this process.
    #[getter]
    fn entries<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyTuple>>> {
        self.set_entries()
            .iter()
            .zip(&self.ptrs)
            .map(|(e, &ptr)| {
                (
                    e.name.as_str(),
                    e.dtype.name(),
                    PyTuple::new(py, &e.shape)?,
                    ptr,
                    e.len,
                )
                    .into_pyobject(py)
            })
            .collect()
    }
    /// The set record the publisher sent, as a dict in format 1 (each
    /// entry a list), as `parse_set_record` returns it.
    #[getter]
    fn record<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let set = self.live()?;
        codec::loads(py, &set.record().to_expanded_value().to_string())
    }
    fn __len__(&self) -> usize {
        self.ptrs.len()
    }
    /// The index of the entry called `name`, or `None`.
    fn index(&self, name: &str) -> Option<usize> {
        self.position_of(name)
    }
    /// A view of entry `key` (an index or a name) that holds the set's
    /// lease, as `dtype` (same size) if given; `raw` shows a same-sized
    /// signed integer type instead.
    #[pyo3(signature = (key, dtype=None, raw=false))]
    fn view(&self, key: &Bound<'_, PyAny>, dtype: Option<&str>, raw: bool) -> PyResult<View> {
        let i = self.position(key).py()?;
        let keep = lock(&self.keep)
            .clone()
            .ok_or_else(|| closed_error("set", "attach it again"))?;
        let e = &self.set_entries()[i];
        let l = Layout {
            ptr: self.ptrs[i],
            len: e.len,
            dtype: e.dtype,
            shape: e.shape.to_vec(),
            strides: None,
            ordinal: self.ordinal,
        };
        View::new(keep, l, dtype, raw)
    }
    /// The entries grouped for few DLPack imports: `(runs, places)`, `runs`
    /// `[(ptr, nbytes, dtype)]` (stretches of one mapped chunk holding
    /// entries of one dtype), `places[i]` `(run, offset, strides)` (in
    /// elements) of entry `i` in its run, or `None` for an entry to make on
    /// its own (`view`). See `run_view`.
    #[getter]
    #[allow(clippy::type_complexity)]
    fn runs(
        &self,
    ) -> (
        Vec<(u64, u64, &'static str)>,
        Vec<Option<(usize, u64, Vec<u64>)>>,
    ) {
        let (runs, places) = self.runs_and_places();
        (runs::runs_tuples(runs), runs::places_tuples(places))
    }
    /// A one-dimensional view of run `run` (see `runs`) that holds the
    /// set's lease, as `dtype` (same size) if given; `raw` as for `view`.
    #[pyo3(signature = (run, dtype=None, raw=false))]
    fn run_view(&self, run: usize, dtype: Option<&str>, raw: bool) -> PyResult<View> {
        let r = self
            .runs_and_places()
            .0
            .get(run)
            .ok_or_else(|| Error::InvalidArgument {
                what: "run",
                reason: format!(
                    "run {run} is past the {} runs of {:?}",
                    self.runs_and_places().0.len(),
                    self.name
                ),
            })
            .py()?;
        let keep = lock(&self.keep)
            .clone()
            .ok_or_else(|| closed_error("set", "attach it again"))?;
        let l = Layout {
            ptr: r.ptr,
            len: r.len,
            dtype: r.dtype,
            shape: vec![r.len / r.dtype.size()],
            strides: None,
            ordinal: self.ordinal,
        };
        View::new(keep, l, dtype, raw)
    }
    /// Waits up to `timeout` seconds (`None`: for ever) for the publisher's
    /// next update of the set, then for its event (or fence). Returns the
    /// update's version.
    #[pyo3(signature = (timeout=None))]
    fn wait_update(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<u64> {
        let mut phases = crate::phases::Phases::start("wait_update");
        let clock = &mut phases;
        let t = duration(timeout).py()?;
        let set = self.live()?;
        let sub = &self.subscriber;
        py.detach(|| -> Result<u64> {
            let version = sub.wait_set_update(&set, t)?;
            clock.mark("wait_set_update");
            set.view::<u8>(0)?.synchronize()?;
            clock.mark("synchronize");
            Ok(version)
        })
        .py()
    }
    /// Ends the lease now (after the work queued on the memory); the chunks
    /// stay mapped in the subscriber's cache for the next set. Fails while
    /// tensors or arrays made from it are alive: the lease then ends when
    /// the last of them dies.
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        let Some((keep, set)) =
            take_for_release(&self.set, &self.keep, &self.name, self.lease, "set")?
        else {
            return Ok(());
        };
        let sub = self.subscriber.clone();
        py.detach(move || -> Result<()> {
            if let Some(k) = keep {
                k.release_now()?;
            }
            sub.release_set(set)
        })
        .py()
    }
    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }
    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> bool {
        // Views still alive keep the lease until they die.
        let set = lock(&self.set).take();
        let keep = lock(&self.keep).take();
        py.detach(move || drop((keep, set)));
        false
    }
    fn __repr__(&self) -> String {
        let state = if self.released() { " released" } else { "" };
        format!(
            "<cuda_ipc.SetAttachment {:?}: {} entries, {} bytes, lease {}{state}>",
            self.name,
            self.ptrs.len(),
            self.nbytes(),
            self.lease
        )
    }
}

/// Registers this module's classes and functions.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ArenaBuffer>()?;
    m.add_class::<SetAttachment>()?;
    Ok(())
}
