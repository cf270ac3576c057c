//! `Attachment`: a buffer a subscriber attached (a lease and a mapping).

use std::sync::{Arc, Mutex};

use cuda_ipc::Result;
use cuda_ipc::descriptor::Descriptor;
use cuda_ipc::exchange::{Attachment as Attached, Subscriber};
use cuda_ipc::memory::DeviceMemory;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::args::duration;
use crate::codec;
use crate::errors::{IntoPyResult, closed_error, lock};
use crate::keep::{Keep, take_for_release};
use crate::mapping::{Layout, View};

/// A buffer attached from a publisher: a lease and a mapping. Views
/// (tensors, arrays) hold the lease too: it ends at `release()`, or when
/// this object and the last view are gone.
#[pyclass(module = "cuda_ipc._core", frozen)]
pub(super) struct Attachment {
    pub(super) name: String,
    pub(super) lease: u64,
    /// This object's own hold (views hold clones).
    pub(super) keep: Mutex<Option<Keep>>,
    /// Shared with a `wait_update` in progress (never held locked while
    /// waiting, so other threads are not blocked with the GIL held).
    pub(super) attached: Mutex<Option<Arc<Attached<u8>>>>,
    pub(super) subscriber: Arc<Subscriber>,
    pub(super) layout: Layout,
    pub(super) descriptor: Descriptor,
    /// Whether the buffer is mapped read-only.
    pub(super) read_only: bool,
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
    /// Whether the buffer is mapped read-only (the subscriber's
    /// `read_only`, or an arena buffer whose publisher serves it to
    /// read-only readers): writing through it fails.
    #[getter]
    fn read_only(&self) -> bool {
        self.read_only
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
    /// next update, then for its event. Returns the update's version.
    #[pyo3(signature = (timeout=None))]
    fn wait_update(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<u64> {
        let t = duration(timeout).py()?;
        let a = lock(&self.attached)
            .clone()
            .ok_or_else(|| closed_error("attachment", "attach again"))?;
        let sub = &self.subscriber;
        py.detach(|| -> Result<_> {
            let version = sub.wait_update(&a, t)?;
            a.buffer().synchronize()?;
            Ok(version)
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
