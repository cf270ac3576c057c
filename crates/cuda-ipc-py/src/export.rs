//! Exporting device memory this process holds (a PyTorch tensor, a CuPy
//! array, any pointer) as a descriptor, through the library's exporter:
//! legacy handles for `cudaMalloc` memory, the pool mechanism for
//! stream-ordered memory from a shareable pool, vmm for `cuMemCreate`
//! memory (PyTorch's expandable segments).

use std::os::fd::OwnedFd;
use std::sync::Mutex;

use cuda_ipc::descriptor::Dtype;
use cuda_ipc::{Error, Handle, Result};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::codec;
use crate::errors::IntoPyResult;

/// Bytes from the first element to one past the last one reached, for
/// `shape` and element `strides`; refuses negative and overlapping strides.
fn extent(shape: &[u64], strides: &[i64]) -> Result<u64> {
    let bad = |reason: String| Error::InvalidArgument {
        what: "strides",
        reason,
    };
    if strides.len() != shape.len() {
        return Err(bad(format!(
            "{} strides for {} dimensions",
            strides.len(),
            shape.len()
        )));
    }
    let mut dims = Vec::new();
    for (i, (&d, &s)) in shape.iter().zip(strides).enumerate() {
        if d > 1 {
            let s = u64::try_from(s).map_err(|_| {
                bad(format!(
                    "stride {s} of dimension {i} is negative; make the tensor contiguous first"
                ))
            })?;
            dims.push((s, d, i));
        }
    }
    dims.sort_unstable();
    let mut span = 1u64;
    for (s, d, i) in dims {
        if s < span {
            return Err(bad(format!(
                "{strides:?} with shape {shape:?}: dimension {i} reaches elements that other \
                 indices reach too (overlapping or broadcast strides); make the tensor \
                 contiguous first"
            )));
        }
        span = (d - 1)
            .checked_mul(s)
            .and_then(|x| x.checked_add(span))
            .ok_or_else(|| bad("the extent overflows".into()))?;
    }
    Ok(span)
}

/// Row-major strides of `shape`, in elements.
fn row_major(shape: &[u64]) -> Vec<u64> {
    let mut out = vec![0u64; shape.len()];
    let mut acc = 1u64;
    for (s, d) in out.iter_mut().zip(shape).rev() {
        *s = acc;
        acc = acc.saturating_mul(*d);
    }
    out
}

/// An export: the descriptor, and the file descriptors the consumers take
/// (fd mechanisms), held open until `close`.
#[pyclass(module = "cuda_ipc._core", frozen)]
pub(crate) struct Exported {
    descriptor: String,
    fds: Mutex<Option<Vec<OwnedFd>>>,
}

#[pymethods]
impl Exported {
    /// The descriptor as a dict.
    #[getter]
    fn descriptor<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        codec::loads(py, &self.descriptor)
    }
    /// The descriptor as one line of JSON.
    fn json(&self) -> String {
        self.descriptor.clone()
    }
    /// Whether `close` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.fds
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_none()
    }
    /// Closes the export's file descriptors (consumers that mapped keep
    /// their mappings). Safe to call twice.
    fn close(&self) {
        self.fds
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
    }
    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }
    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, _exc: &Bound<'_, PyTuple>) -> bool {
        self.close();
        false
    }
}

/// Exports the elements at device address `ptr` on device `device`:
/// `dtype` (a descriptor or PyTorch name), `shape`, and `strides` in
/// elements (`None`: contiguous row-major); `event`, the 64-byte handle of
/// an interprocess event recorded after the writes, goes into the
/// descriptor for consumers to wait on.
///
/// Memory shared by a file descriptor (vmm, pool) is exported only with
/// `allow_fd`, which lets every process of this user take it with
/// `pidfd_getfd` (and ptrace this process: `PR_SET_PTRACER_ANY`); without
/// it such memory is refused (`Unsupported`) and ptrace is left as it is.
#[pyfunction]
#[pyo3(signature = (ptr, dtype, shape, strides=None, *, device=crate::args::Ordinal(0), event=None, allow_fd=false))]
#[allow(clippy::too_many_arguments)]
fn export_memory(
    py: Python<'_>,
    ptr: u64,
    dtype: &str,
    shape: Vec<u64>,
    strides: Option<Vec<i64>>,
    device: crate::args::Ordinal,
    event: Option<&[u8]>,
    allow_fd: bool,
) -> PyResult<Exported> {
    let event = event
        .map(cuda_ipc::IpcEventHandle::from_bytes)
        .transpose()
        .py()?;
    let name = dtype.strip_prefix("torch.").unwrap_or(dtype);
    let dt = name
        .parse::<Dtype>()
        .or_else(|_| cuda_ipc::torch::dtype_from_torch(name))
        .py()?;
    let elements = match &strides {
        None => shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d)),
        Some(s) => extent(&shape, s).py().map(Some)?,
    };
    let len = elements
        .and_then(|n| n.checked_mul(dt.size()))
        .filter(|&n| n > 0)
        .ok_or_else(|| Error::InvalidArgument {
            what: "shape",
            reason: format!("{shape:?} holds no elements (or too many); there is nothing to share"),
        })
        .py()?;
    let strides = strides
        .map(|s| s.iter().map(|&x| x as u64).collect::<Vec<_>>())
        .filter(|s| *s != row_major(&shape));
    let export = py
        .detach(|| -> Result<_> {
            let dev = crate::mapping::device(device.0)?;
            let mut e = cuda_ipc::share::export_pointer(&dev, ptr, len, dt)?;
            let mechanism = e.descriptor.mechanism();
            if mechanism.uses_fd() {
                if !allow_fd {
                    // `e` and its descriptors close here: nothing was shared.
                    return Err(Error::Unsupported {
                        what: "exporting memory without file descriptors (allow_fd=False)",
                        why: format!(
                            "this memory is shared by a file descriptor ({mechanism}: PyTorch's \
                             expandable segments, a shareable pool), which consumers take from \
                             this process with pidfd_getfd; pass allow_fd=True to let every \
                             process of this user do that (it may then ptrace this process: \
                             PR_SET_PTRACER_ANY), or allocate it with PyTorch's default \
                             allocator or CuPy's default pool (a legacy handle)"
                        ),
                    });
                }
                cuda_ipc::share::allow_fd_fetching()?;
            }
            e.descriptor.shape = Some(shape);
            e.descriptor.strides = strides;
            e.descriptor.event = event;
            e.descriptor.validate()?;
            Ok(e)
        })
        .py()?;
    Ok(Exported {
        descriptor: export.descriptor.to_json(),
        fds: Mutex::new(Some(export.fds)),
    })
}

/// Lets processes of the same user take file descriptors from this one
/// with `pidfd_getfd` (`PR_SET_PTRACER_ANY`), for fd-mechanism exports
/// opened without the channel.
#[pyfunction]
fn allow_fd_fetching() -> PyResult<()> {
    cuda_ipc::share::allow_fd_fetching().py()
}

/// Registers this module's functions and classes.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Exported>()?;
    m.add_function(wrap_pyfunction!(allow_fd_fetching, m)?)?;
    m.add_function(wrap_pyfunction!(export_memory, m)?)?;
    Ok(())
}
