//! Opening descriptors and PyTorch share records: the mapped memory as a
//! Python object with `__cuda_array_interface__` and DLPack.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Mutex, OnceLock};

use cuda_ipc::buffer::MappedBuffer;
use cuda_ipc::descriptor::{Descriptor, Dtype};
use cuda_ipc::device::{Device, DeviceUuid};
use cuda_ipc::event::IpcEvent;
use cuda_ipc::torch::{SegmentHandles, ShareRecord, StorageHandle};
use cuda_ipc::vmm::VmmMapping;
use cuda_ipc::{Error, Result};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::args::dtype;
use crate::codec;
use crate::dlpack;
use crate::errors::{IntoPyResult, closed_error};
use crate::keep::{Keep, LIVE};

/// Runs every retired release that is due, waiting up to `timeout` seconds
/// (`None`: 10) for their GPU work; returns whether none is left. Freeing a
/// tensor or closing a mapping never waits: the unmap and the lease's
/// release run on a thread of the library once the work queued on the
/// memory has finished. Call this where a program must see the effect (the
/// memory unmapped, the publisher told) before it goes on.
#[pyfunction]
#[pyo3(signature = (timeout=None))]
fn settle(py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
    let timeout = match timeout {
        None => std::time::Duration::from_secs(10),
        Some(t) if t.is_finite() && t >= 0.0 => std::time::Duration::from_secs_f64(t),
        Some(t) => {
            return Err(Error::InvalidArgument {
                what: "timeout",
                reason: format!("{t} is not a number of seconds (0 or more)"),
            })
            .py();
        }
    };
    Ok(py.detach(|| cuda_ipc::reaper::settle(timeout)))
}

/// How many releases (unmaps, frees, lease releases) wait for their GPU
/// work or for the library's thread to run them.
#[pyfunction]
fn retiring() -> usize {
    cuda_ipc::reaper::retiring()
}

/// The devices this process opened, by ordinal (a context each).
pub(crate) fn device(ordinal: usize) -> Result<Device> {
    static DEVICES: OnceLock<Mutex<HashMap<usize, Device>>> = OnceLock::new();
    let mut map = DEVICES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(d) = map.get(&ordinal) {
        return Ok(d.clone());
    }
    let d = Device::open(ordinal)?;
    map.insert(ordinal, d.clone());
    Ok(d)
}

/// The device to map on: `ordinal` if given, else the one the exporter
/// named, if this process sees it.
fn device_for(uuid: DeviceUuid, ordinal: Option<usize>) -> Result<Device> {
    if let Some(o) = ordinal {
        return device(o);
    }
    match cuda_ipc::device::ordinal_of(uuid)? {
        Some(o) => device(o),
        None => Err(Error::Unsupported {
            what: "the exporter's GPU",
            why: format!(
                "device {uuid} is not visible in this process; check CUDA_VISIBLE_DEVICES, or \
                 pass device=ORDINAL to map on another GPU that can reach it"
            ),
        }),
    }
}

/// Where the exported elements lie and what they are.
#[derive(Clone, Debug)]
pub(crate) struct Layout {
    /// Device address of the first exported byte.
    pub(crate) ptr: u64,
    pub(crate) len: u64,
    pub(crate) dtype: Dtype,
    pub(crate) shape: Vec<u64>,
    /// In elements; `None` when contiguous row-major.
    pub(crate) strides: Option<Vec<u64>>,
    pub(crate) ordinal: usize,
}

impl Layout {
    pub(crate) fn of(buffer: &MappedBuffer<u8>, d: &Descriptor) -> Self {
        let ptr = buffer.mapping().base() + buffer.offset();
        let shape = d.shape.clone().unwrap_or_else(|| vec![d.elements()]);
        Layout {
            ptr,
            len: d.byte_len,
            dtype: d.dtype,
            shape,
            strides: d.strides.clone(),
            ordinal: buffer.mapping().device().ordinal(),
        }
    }

    /// Strides in elements, row-major when not given.
    pub(crate) fn element_strides(&self) -> Vec<u64> {
        if let Some(s) = &self.strides {
            return s.clone();
        }
        let mut out = vec![0u64; self.shape.len()];
        let mut acc = 1u64;
        for (s, d) in out.iter_mut().zip(&self.shape).rev() {
            *s = acc;
            acc = acc.saturating_mul(*d);
        }
        out
    }
}

/// The layout of `len` bytes at `ptr` as `dtype` with `shape` (default:
/// one dimension of every whole element).
pub(crate) fn layout(
    ptr: u64,
    len: u64,
    ordinal: usize,
    dtype_name: &str,
    shape: Option<Vec<u64>>,
) -> Result<Layout> {
    let dt = dtype(dtype_name)?;
    let shape = shape.unwrap_or_else(|| vec![len / dt.size()]);
    let bytes = shape
        .iter()
        .try_fold(dt.size(), |a, &d| a.checked_mul(d))
        .filter(|&b| b <= len)
        .ok_or_else(|| Error::InvalidArgument {
            what: "shape",
            reason: format!("{shape:?} of {dt} does not fit in the {len} bytes of the buffer"),
        })?;
    Ok(Layout {
        ptr,
        len: bytes,
        dtype: dt,
        shape,
        strides: None,
        ordinal,
    })
}

/// The element type a view shows: `dtype` (a descriptor, NumPy or PyTorch
/// name) if given, which must be the same size as the mapping's.
fn target_dtype(own: Dtype, dtype: Option<&str>) -> Result<Dtype> {
    let Some(name) = dtype else { return Ok(own) };
    let name = name.strip_prefix("torch.").unwrap_or(name);
    let dt = name
        .parse::<Dtype>()
        .or_else(|_| cuda_ipc::torch::dtype_from_torch(name))
        .map_err(|_| Error::InvalidArgument {
            what: "dtype",
            reason: format!(
                "unknown dtype {name:?}; known: {}",
                Dtype::ALL.map(Dtype::name).join(", ")
            ),
        })?;
    if dt.size() != own.size() {
        return Err(Error::InvalidArgument {
            what: "dtype",
            reason: format!(
                "cannot view {own} elements as {dt}: the element sizes differ ({} and {} bytes)",
                own.size(),
                dt.size()
            ),
        });
    }
    Ok(dt)
}

/// The `__cuda_array_interface__` (version 3) of a layout.
fn cai_of<'py>(
    py: Python<'py>,
    layout: &Layout,
    dtype: Dtype,
    raw: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let typestr = if raw {
        codec::raw_typestr(dtype)
    } else {
        codec::typestr(dtype)
    };
    let cai = PyDict::new(py);
    cai.set_item("version", 3)?;
    cai.set_item("shape", PyTuple::new(py, &layout.shape)?)?;
    cai.set_item("typestr", typestr)?;
    cai.set_item("descr", vec![("", typestr)])?;
    cai.set_item("data", (layout.ptr, false))?;
    match &layout.strides {
        Some(s) => cai.set_item(
            "strides",
            PyTuple::new(py, s.iter().map(|x| x * dtype.size()))?,
        )?,
        None => cai.set_item("strides", py.None())?,
    }
    // The exporter's event, if any, was waited for when the memory was opened.
    cai.set_item("stream", py.None())?;
    Ok(cai)
}

fn dlpack_of(
    py: Python<'_>,
    keep: &Keep,
    layout: &Layout,
    dtype: Dtype,
    raw: bool,
) -> PyResult<Py<PyAny>> {
    dlpack::capsule(
        py,
        keep.clone(),
        layout.ptr,
        layout.ordinal,
        dlpack::data_type(dtype, raw),
        &layout.shape,
        &layout.element_strides(),
    )
}

/// A view of mapped memory that keeps it mapped: what a tensor or array
/// built from it holds on to. Offers DLPack and the CUDA array interface.
#[pyclass(module = "cuda_ipc._core", frozen)]
pub(crate) struct View {
    keep: Keep,
    layout: Layout,
    dtype: Dtype,
    raw: bool,
}

impl View {
    /// A view of `layout` held by `keep`, as `dtype` (same size; `None`:
    /// the layout's own) or, with `raw`, a same-sized integer type.
    pub(crate) fn new(
        keep: Keep,
        layout: Layout,
        dtype: Option<&str>,
        raw: bool,
    ) -> PyResult<Self> {
        let dtype = target_dtype(layout.dtype, dtype).py()?;
        Ok(View {
            keep,
            layout,
            dtype,
            raw,
        })
    }
}

#[pymethods]
impl View {
    /// The CUDA array interface (version 3).
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        cai_of(py, &self.layout, self.dtype, self.raw)
    }

    /// A DLPack capsule; the consumer's tensor keeps the memory mapped.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<Py<PyAny>>,
        max_version: Option<Py<PyAny>>,
        dl_device: Option<Py<PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let _ = (stream, max_version, dl_device);
        if copy == Some(true) {
            return Err(pyo3::exceptions::PyBufferError::new_err(
                "mapped memory is shared without copying; copy=True is not supported",
            ));
        }
        dlpack_of(py, &self.keep, &self.layout, self.dtype, self.raw)
    }

    /// `(kDLCUDA, ordinal)`.
    fn __dlpack_device__(&self) -> (i32, usize) {
        (dlpack::DEVICE_CUDA, self.layout.ordinal)
    }
}

/// Memory another process exported, mapped here.
#[pyclass(module = "cuda_ipc._core", name = "Mapping", frozen)]
pub(crate) struct PyMapping {
    keep: Mutex<Option<Keep>>,
    /// Set once `__cuda_array_interface__` was read: whatever was built
    /// from it (a CuPy array, a tensor) holds this object, not the memory,
    /// so `close` leaves the memory to this object's own end.
    cai_given: std::sync::atomic::AtomicBool,
    /// The hold `close` kept for those consumers (dropped with the object).
    closed_keep: Mutex<Option<Keep>>,
    layout: Layout,
    descriptor: String,
    mechanism: String,
    segments: usize,
}

impl PyMapping {
    pub(crate) fn new(
        buffer: MappedBuffer<u8>,
        d: &Descriptor,
        mechanism: String,
        segments: usize,
    ) -> Self {
        PyMapping {
            layout: Layout::of(&buffer, d),
            keep: Mutex::new(Some(Keep::new(buffer))),
            cai_given: std::sync::atomic::AtomicBool::new(false),
            closed_keep: Mutex::new(None),
            descriptor: d.to_json(),
            mechanism,
            segments,
        }
    }

    fn keep(&self) -> PyResult<Keep> {
        self.keep
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
            .ok_or_else(|| closed_error("mapping", "open the descriptor again"))
    }
}

#[pymethods]
impl PyMapping {
    /// Device address of the first exported byte.
    #[getter]
    fn ptr(&self) -> u64 {
        self.layout.ptr
    }
    /// Exported length in bytes.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.layout.len
    }
    /// The element type (descriptor name).
    #[getter]
    fn dtype(&self) -> &'static str {
        self.layout.dtype.name()
    }
    /// Dimensions in elements.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.layout.shape)
    }
    /// Strides in elements, `None` when contiguous row-major.
    #[getter]
    fn strides<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyTuple>>> {
        self.layout
            .strides
            .as_ref()
            .map(|s| PyTuple::new(py, s))
            .transpose()
    }
    /// The CUDA device ordinal it is mapped on.
    #[getter]
    fn device(&self) -> usize {
        self.layout.ordinal
    }
    /// How it was shared (`legacy`, `vmm`, `pool`, `fabric`, or
    /// `torch_segments` for several expandable segments).
    #[getter]
    fn mechanism(&self) -> &str {
        &self.mechanism
    }
    /// How many allocations it maps.
    #[getter]
    fn segments(&self) -> usize {
        self.segments
    }
    /// The descriptor, canonical (for a share record: the descriptor of the
    /// mapped range).
    #[getter]
    fn descriptor<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        codec::loads(py, &self.descriptor)
    }
    /// Whether `close` was called (views may still hold the memory).
    #[getter]
    fn closed(&self) -> bool {
        self.keep
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_none()
    }

    /// A view that keeps the memory mapped, as `dtype` (same size) if
    /// given; `raw` shows a same-sized signed integer type instead.
    #[pyo3(signature = (dtype=None, raw=false))]
    fn view(&self, dtype: Option<&str>, raw: bool) -> PyResult<View> {
        View::new(self.keep()?, self.layout.clone(), dtype, raw)
    }

    /// The CUDA array interface (version 3). Objects built from it hold
    /// this object, not the memory: once it was read, `close()` leaves the
    /// memory mapped until this object itself is gone (so an array or
    /// tensor made from it never outlives the mapping).
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.keep()?;
        self.cai_given.store(true, Ordering::SeqCst);
        cai_of(py, &self.layout, self.layout.dtype, false)
    }

    /// A DLPack capsule; the consumer's tensor keeps the memory mapped.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<Py<PyAny>>,
        max_version: Option<Py<PyAny>>,
        dl_device: Option<Py<PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        self.view(None, false)?
            .__dlpack__(py, stream, max_version, dl_device, copy)
    }

    /// `(kDLCUDA, ordinal)`.
    fn __dlpack_device__(&self) -> (i32, usize) {
        (dlpack::DEVICE_CUDA, self.layout.ordinal)
    }

    /// Lets go of this object's hold: unmapped once no view, tensor or
    /// array made from it is alive (and the GPU work queued on it is done).
    /// If `__cuda_array_interface__` was read, what was built from it holds
    /// this object instead of the memory, so the memory then stays until
    /// this object is gone. Never waits. Safe to call twice.
    fn close(&self, py: Python<'_>) {
        let keep = self
            .keep
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if self.cai_given.load(Ordering::SeqCst) {
            *self
                .closed_keep
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = keep;
            return;
        }
        py.detach(move || drop(keep));
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> bool {
        self.close(py);
        false
    }

    fn __repr__(&self) -> String {
        let state = if self.closed() {
            "closed".to_string()
        } else {
            format!("ptr=0x{:x}", self.layout.ptr)
        };
        format!(
            "<cuda_ipc.Mapping {} {}{:?} {} bytes on cuda:{} {state}>",
            self.mechanism,
            self.layout.dtype,
            self.layout.shape,
            self.layout.len,
            self.layout.ordinal
        )
    }
}

/// Opens a descriptor: maps it and waits for the exporter's event.
pub(crate) fn open_descriptor(d: &Descriptor, ordinal: Option<usize>) -> Result<PyMapping> {
    let device = device_for(d.device_uuid, ordinal)?;
    let buffer = cuda_ipc::share::open::<u8>(&device, d, Vec::new())?;
    if d.event.is_some() {
        device.synchronize()?;
    }
    Ok(PyMapping::new(
        buffer,
        d,
        d.mechanism().name().to_string(),
        1,
    ))
}

/// Opens a PyTorch share record: one allocation through its descriptor,
/// several expandable segments mapped side by side.
fn open_record(r: &ShareRecord, ordinal: Option<usize>) -> Result<PyMapping> {
    let err = match r.to_descriptor() {
        Ok(d) => return open_descriptor(&d, ordinal),
        Err(e) => e,
    };
    let StorageHandle::Expandable { segment, .. } = r.parse_storage_handle()? else {
        return Err(err);
    };
    let SegmentHandles::PosixFds(numbers) = &segment.handles else {
        return Err(err);
    };
    if numbers.len() < 2 {
        return Err(err);
    }
    let layout = r.tensor_layout()?;
    let device = device_for(r.device_uuid, ordinal)?;
    let fds = numbers
        .iter()
        .map(|&n| cuda_ipc::share::fetch_fd(segment.pid, n))
        .collect::<Result<Vec<_>>>()?;
    let mapping = VmmMapping::import_segments(&device, fds, segment.segment_size)?;
    let buffer = MappedBuffer::<u8>::from_bytes(mapping, layout.offset, layout.byte_len)?;
    if let Some(h) = r.event() {
        let event = IpcEvent::open(&device, h)?;
        event.synchronize()?;
    }
    let mut d = Descriptor::new(
        cuda_ipc::descriptor::Source::Vmm { fd: numbers[0] },
        segment.mapped_size()?,
        r.device_uuid,
        segment.pid,
    )
    .with_range(layout.offset, layout.byte_len)
    .with_dtype(layout.dtype)
    .with_shape(layout.shape);
    d.strides = layout.strides;
    Ok(PyMapping::new(
        buffer,
        &d,
        "torch_segments".into(),
        numbers.len(),
    ))
}

/// Maps a descriptor or a PyTorch share record (a dict, JSON text or
/// bytes) on the exporter's device (or `device`), after the exporter's
/// event if it sent one.
#[pyfunction]
#[pyo3(signature = (descriptor, *, device=None))]
fn open(
    py: Python<'_>,
    descriptor: &Bound<'_, PyAny>,
    device: Option<crate::args::Ordinal>,
) -> PyResult<PyMapping> {
    let device = device.map(|d| d.0);
    let text = codec::document_text(descriptor, |reason| Error::Descriptor {
        field: "(document)".into(),
        reason,
    })?;
    // A share record has the `torch_share` key; anything else (malformed
    // JSON included) is read as a descriptor, whose decoder says what is wrong.
    let is_record = serde_json::from_str::<serde_json::Value>(&text)
        .is_ok_and(|v| v.get(cuda_ipc::torch::RECORD_KEY).is_some());
    if is_record {
        let r = ShareRecord::from_json(&text).py()?;
        py.detach(|| open_record(&r, device)).py()
    } else {
        let d = Descriptor::from_json(&text).py()?;
        py.detach(|| open_descriptor(&d, device)).py()
    }
}

/// The `__cuda_array_interface__` (version 3) of a descriptor's exported
/// bytes mapped at device address `ptr` (the first exported byte). `stream`
/// is the interface's `stream` entry; `raw` gives a same-sized integer type
/// string (`<i2` for bf16 and u16, ...), for reinterpretation.
#[pyfunction]
#[pyo3(signature = (ptr, descriptor, stream=None, raw=false))]
fn cuda_array_interface<'py>(
    py: Python<'py>,
    ptr: u64,
    descriptor: &Bound<'py, PyAny>,
    stream: Option<u64>,
    raw: bool,
) -> PyResult<Bound<'py, PyDict>> {
    if stream == Some(0) {
        return Err(Error::InvalidArgument {
            what: "stream",
            reason:
                "the CUDA array interface forbids stream 0; use 1 for the legacy default stream"
                    .into(),
        })
        .py();
    }
    let d = codec::descriptor_of(descriptor)?;
    let layout = Layout {
        ptr,
        len: d.byte_len,
        dtype: d.dtype,
        shape: d.shape.clone().unwrap_or_else(|| vec![d.elements()]),
        strides: d.strides.clone(),
        ordinal: 0,
    };
    let cai = cai_of(py, &layout, d.dtype, raw)?;
    cai.set_item("stream", stream)?;
    Ok(cai)
}

/// How many mappings this process holds that are not unmapped yet
/// (closed mappings count until their last view dies).
#[pyfunction]
fn live_mappings() -> usize {
    LIVE.load(Ordering::SeqCst)
}

/// The UUID of CUDA device `ordinal` (`GPU-...`).
#[pyfunction]
#[pyo3(signature = (ordinal=crate::args::Ordinal(0)))]
fn device_uuid(ordinal: crate::args::Ordinal) -> PyResult<String> {
    Ok(device(ordinal.0).py()?.uuid().to_string())
}

/// `(free, total)` bytes of device `ordinal`'s memory.
#[pyfunction]
#[pyo3(signature = (ordinal=crate::args::Ordinal(0)))]
fn mem_info(ordinal: crate::args::Ordinal) -> PyResult<(u64, u64)> {
    device(ordinal.0).py()?.memory_info().py()
}

/// How many CUDA devices the driver sees.
#[pyfunction]
fn device_count() -> PyResult<usize> {
    cuda_ipc::driver::device_count().py()
}

/// Registers this module's functions and classes.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyMapping>()?;
    m.add_class::<View>()?;
    m.add_function(wrap_pyfunction!(open, m)?)?;
    m.add_function(wrap_pyfunction!(live_mappings, m)?)?;
    m.add_function(wrap_pyfunction!(settle, m)?)?;
    m.add_function(wrap_pyfunction!(retiring, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_array_interface, m)?)?;
    m.add_function(wrap_pyfunction!(device_uuid, m)?)?;
    m.add_function(wrap_pyfunction!(mem_info, m)?)?;
    m.add_function(wrap_pyfunction!(device_count, m)?)?;
    Ok(())
}
