//! The DLPack C exchange API (DLPack 1.3, `__dlpack_c_exchange_api__`):
//! reading a tensor's address, dtype, shape, strides and device, and making
//! a tensor over mapped memory, with C calls instead of Python ones.
//!
//! A framework that speaks it (PyTorch 2.10 and later) sets
//! `__dlpack_c_exchange_api__` on its tensor type: a capsule named
//! `dlpack_exchange_api` that holds a `DLPackExchangeAPI` for the life of
//! the process. [`TorchExchange::new`] checks the capsule's name, the
//! header's version (major 1, minor 3 or later; an API of a later major
//! version is read through its `prev_api` chain) and the function
//! pointers this module calls, so a foreign or future struct is refused
//! with an error, never called blindly.
//!
//! Lifetimes: a tensor made by [`TorchExchange::make`] owns a
//! `DLManagedTensorVersioned` whose context holds a [`Keep`] (the mapping
//! and the lease); the framework calls its deleter when the tensor's
//! storage dies, on any thread, and the hold is let go of without waiting
//! (the release is the reaper's). A failed conversion leaves nothing
//! behind: whether or not the framework called the deleter before it
//! failed, the owner is freed exactly once.
#![allow(unsafe_code)]

use std::cell::UnsafeCell;
use std::ffi::{CStr, c_int, c_void};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use cuda_ipc::Error;
use cuda_ipc::descriptor::Dtype;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyType;
use smallvec::SmallVec;

use crate::dlpack::{DEVICE_CUDA, DlDataType, DlDevice, DlTensor};
use crate::errors::IntoPyResult;
use crate::keep::Keep;

/// The capsule's name, from the DLPack header.
const CAPSULE_NAME: &CStr = c"dlpack_exchange_api";

/// The oldest version whose header carries the exchange API.
const MIN_MINOR: u32 = 3;

/// The most dimensions a tensor read or made here may have (PyTorch's
/// limit is 64 too): a larger `ndim` is a corrupt struct.
pub(crate) const MAX_NDIM: usize = 64;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Version {
    major: u32,
    minor: u32,
}

#[repr(C)]
struct ApiHeader {
    version: Version,
    prev_api: *const ApiHeader,
}

#[repr(C)]
struct ManagedVersioned {
    version: Version,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut ManagedVersioned)>,
    flags: u64,
    dl_tensor: DlTensor,
}

type FromPyManaged = unsafe extern "C" fn(*mut c_void, *mut *mut ManagedVersioned) -> c_int;
type ToPy = unsafe extern "C" fn(*mut ManagedVersioned, *mut *mut c_void) -> c_int;
type FromPyDlTensor = unsafe extern "C" fn(*mut c_void, *mut DlTensor) -> c_int;

/// DLPack 1.3's `DLPackExchangeAPI`: the header, then five function
/// pointers (the allocator and the stream query are not called here).
#[repr(C)]
struct ExchangeApi {
    header: ApiHeader,
    managed_tensor_allocator: *const c_void,
    managed_tensor_from_py_object_no_sync: Option<FromPyManaged>,
    managed_tensor_to_py_object_no_sync: Option<ToPy>,
    dltensor_from_py_object_no_sync: Option<FromPyDlTensor>,
    current_work_stream: *const c_void,
}

/// The size in bytes of the structures this module reads, for the tests.
pub(crate) const API_SIZE: usize = std::mem::size_of::<ExchangeApi>();

/// What a tensor is, as read through the API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TensorMeta {
    /// The address of its first element (`data + byte_offset`).
    pub(crate) ptr: u64,
    pub(crate) device: DlDevice,
    pub(crate) dtype: DlDataType,
    pub(crate) shape: Dims,
    /// In elements; contiguous row-major ones when the producer gave none.
    pub(crate) strides: Dims,
}

/// A tensor's dimensions (or strides), inline up to four: no allocation
/// for what a model's weights have.
pub(crate) type Dims = SmallVec<[i64; 4]>;

impl TensorMeta {
    /// Whether it is a CUDA tensor of device `ordinal`.
    pub(crate) fn on_cuda(&self, ordinal: usize) -> bool {
        self.device.device_type == DEVICE_CUDA
            && usize::try_from(self.device.device_id).is_ok_and(|d| d == ordinal)
    }

    /// The element count (`None` on a negative dimension or an overflow).
    pub(crate) fn numel(&self) -> Option<u64> {
        self.shape
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(u64::try_from(d).ok()?))
    }

    /// Whether the elements are contiguous in row-major order (PyTorch's
    /// rule: strides of dimensions of size 1 do not count, and a tensor
    /// without elements is contiguous).
    pub(crate) fn is_contiguous(&self) -> bool {
        if self.shape.contains(&0) {
            return true;
        }
        let mut want: i64 = 1;
        for (&d, &s) in self.shape.iter().zip(&self.strides).rev() {
            if d != 1 {
                if s != want {
                    return false;
                }
                want = want.saturating_mul(d);
            }
        }
        true
    }
}

/// Where a tensor to make lies: the address of its first element, CUDA
/// device `ordinal`, DLPack's element type, `shape` and `strides` in
/// elements.
#[derive(Clone, Copy)]
pub(crate) struct At<'a> {
    pub(crate) ptr: u64,
    pub(crate) ordinal: usize,
    pub(crate) dtype: DlDataType,
    pub(crate) shape: &'a [i64],
    pub(crate) strides: &'a [i64],
}

/// Contiguous row-major strides of `shape`, in elements.
pub(crate) fn contiguous_strides(shape: &[i64]) -> Dims {
    let mut strides: Dims = smallvec::smallvec![0; shape.len()];
    fill_contiguous_strides(shape, &mut strides);
    strides
}

/// As [`contiguous_strides`], into `strides` (as long as `shape`).
pub(crate) fn fill_contiguous_strides(shape: &[i64], strides: &mut [i64]) {
    let mut step: i64 = 1;
    for (s, &d) in strides.iter_mut().zip(shape).rev() {
        *s = step;
        step = step.saturating_mul(d.max(1));
    }
}

/// A framework's DLPack exchange API, checked; and the tensor type it was
/// found on (the API reads only objects of that type).
#[pyclass(module = "cuda_ipc._core", frozen)]
pub(crate) struct TorchExchange {
    /// The producer's functions (its struct lives for the process, by the
    /// DLPack contract; the capsule is held too).
    to_py: ToPy,
    from_dltensor: Option<FromPyDlTensor>,
    from_managed: Option<FromPyManaged>,
    _capsule: Py<PyAny>,
    tensor_type: Py<PyType>,
    version: (u32, u32),
}

/// An error of a capsule that is not an exchange API this module reads.
fn refused(py: Python<'_>, reason: String) -> PyErr {
    crate::errors::to_py(
        py,
        &Error::InvalidArgument {
            what: "DLPack exchange API",
            reason,
        },
    )
}

#[pymethods]
impl TorchExchange {
    /// Checks `capsule` (a tensor type's `__dlpack_c_exchange_api__`) and
    /// keeps it with `tensor_type`; raises `InvalidInput` saying what is
    /// wrong with it (the caller then uses DLPack through Python).
    #[new]
    fn new(capsule: Bound<'_, PyAny>, tensor_type: Bound<'_, PyType>) -> PyResult<Self> {
        let py = capsule.py();
        // SAFETY: PyCapsule_IsValid accepts any object and never sets an
        // exception.
        let valid = unsafe { ffi::PyCapsule_IsValid(capsule.as_ptr(), CAPSULE_NAME.as_ptr()) };
        if valid != 1 {
            return Err(refused(
                py,
                format!(
                    "expected a capsule named {CAPSULE_NAME:?}, got {}",
                    capsule
                        .get_type()
                        .name()
                        .map_or_else(|_| "?".into(), |n| n.to_string())
                ),
            ));
        }
        // SAFETY: the capsule is valid with this name (checked above).
        let head = unsafe { ffi::PyCapsule_GetPointer(capsule.as_ptr(), CAPSULE_NAME.as_ptr()) }
            .cast::<ApiHeader>()
            .cast_const();
        // SAFETY: a valid capsule of that name points to a DLPackExchangeAPI
        // that starts with the stable header, alive for the process.
        let (api, version) = unsafe { find_major_1(head) }.map_err(|r| refused(py, r))?;
        // SAFETY: `api` is a version 1.3+ struct, which has these fields.
        let a = unsafe { &*api };
        let Some(to_py) = a.managed_tensor_to_py_object_no_sync else {
            return Err(refused(
                py,
                "managed_tensor_to_py_object_no_sync is null".to_owned(),
            ));
        };
        if a.dltensor_from_py_object_no_sync.is_none()
            && a.managed_tensor_from_py_object_no_sync.is_none()
        {
            return Err(refused(
                py,
                "both dltensor_from_py_object_no_sync and managed_tensor_from_py_object_no_sync \
                 are null"
                    .to_owned(),
            ));
        }
        Ok(TorchExchange {
            to_py,
            from_dltensor: a.dltensor_from_py_object_no_sync,
            from_managed: a.managed_tensor_from_py_object_no_sync,
            _capsule: capsule.unbind(),
            tensor_type: tensor_type.unbind(),
            version,
        })
    }

    /// The DLPack version of the API in use, `(major, minor)`.
    #[getter]
    fn version(&self) -> (u32, u32) {
        self.version
    }

    /// `(ptr, (device_type, device_id), (code, bits, lanes), shape,
    /// strides)` of `tensor`, read through the API (for the tests).
    #[allow(clippy::type_complexity)]
    fn read_tensor(
        &self,
        tensor: &Bound<'_, PyAny>,
    ) -> PyResult<(u64, (i32, i32), (u8, u8, u16), Vec<i64>, Vec<i64>)> {
        let m = self.read(tensor)?;
        Ok((
            m.ptr,
            (m.device.device_type, m.device.device_id),
            (m.dtype.code, m.dtype.bits, m.dtype.lanes),
            m.shape.into_vec(),
            m.strides.into_vec(),
        ))
    }

    /// Makes a tensor over `ptr` (CUDA device `ordinal`, elements of
    /// `dtype`, a descriptor name, with `shape` and `strides`) that holds
    /// nothing but a counted token (see `torch_c_owners`): for the tests of
    /// the ownership rules with a stand-in API. Only in builds with the
    /// `test-hooks` feature: nothing keeps the memory at `ptr` alive.
    #[cfg(feature = "test-hooks")]
    #[allow(clippy::needless_pass_by_value)]
    fn probe_make(
        &self,
        py: Python<'_>,
        ptr: u64,
        ordinal: usize,
        dtype: &str,
        shape: Vec<i64>,
        strides: Vec<i64>,
    ) -> PyResult<Py<PyAny>> {
        let dt = crate::args::dtype(dtype).py()?;
        let at = At {
            ptr,
            ordinal,
            dtype: crate::dlpack::data_type(dt, false),
            shape: &shape,
            strides: &strides,
        };
        self.make_with(py, None, &at)
    }
}

/// The exchange API of major version 1 in the chain that starts at `head`,
/// and its version.
///
/// # Safety
/// `head` is null or points to a `DLPackExchangeAPIHeader` whose `prev_api`
/// chain is made of such headers, as DLPack requires.
unsafe fn find_major_1(
    head: *const ApiHeader,
) -> std::result::Result<(*const ExchangeApi, (u32, u32)), String> {
    let mut at = head;
    let mut seen = Vec::new();
    for _ in 0..16 {
        if at.is_null() {
            return Err(if seen.is_empty() {
                "the capsule holds a null pointer".to_owned()
            } else {
                format!(
                    "it speaks DLPack {} and no older version; this module reads version 1.{MIN_MINOR} \
                     or a later 1.x",
                    seen.join(", ")
                )
            });
        }
        // SAFETY: non-null, a header by the caller's contract.
        let h = unsafe { &*at };
        let Version { major, minor } = h.version;
        seen.push(format!("{major}.{minor}"));
        if major == 1 {
            if minor < MIN_MINOR {
                return Err(format!(
                    "it speaks DLPack {major}.{minor}; the exchange API is version 1.{MIN_MINOR} or later"
                ));
            }
            return Ok((at.cast::<ExchangeApi>(), (major, minor)));
        }
        if major < 1 {
            return Err(format!(
                "it speaks DLPack {major}.{minor}, which has no exchange API"
            ));
        }
        at = h.prev_api;
    }
    Err("its prev_api chain is longer than 16 versions (a loop?)".to_owned())
}

/// How many owners of tensors made here are alive (tensors the framework
/// has not let go of yet).
static OWNERS: AtomicUsize = AtomicUsize::new(0);

/// `_core.torch_c_owners()`: how many tensors made through the exchange
/// API still hold their memory (for the tests).
#[pyfunction]
fn torch_c_owners() -> usize {
    OWNERS.load(Ordering::SeqCst)
}

/// What a tensor made here owns: the managed structure (its address is
/// what the framework holds), the shape and then the strides it points
/// into (inline for up to four dimensions: the owner lives in an `Arc`
/// and never moves once the pointers are set), the hold.
struct Owner {
    managed: UnsafeCell<ManagedVersioned>,
    dims: SmallVec<[i64; 8]>,
    _keep: Option<Keep>,
}

// SAFETY: the raw pointers inside point into the owner's own dims and the
// mapped memory; the structure is written once before it is handed over
// and only read afterwards, and the deleter may run on any thread (Keep is
// Send + Sync).
unsafe impl Send for Owner {}
// SAFETY: as for Send.
unsafe impl Sync for Owner {}

impl Drop for Owner {
    fn drop(&mut self) {
        OWNERS.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The deleter handed to the framework: lets go of its reference to the
/// owner (`manager_ctx` is an `Arc<Owner>` turned into a pointer).
unsafe extern "C" fn delete_owner(managed: *mut ManagedVersioned) {
    if managed.is_null() {
        return;
    }
    // SAFETY: `managed` is the structure of an Owner made by `make_with`;
    // its context is the reference made for the framework there, which
    // the framework gives back once by calling this deleter.
    unsafe {
        let ctx = (*managed).manager_ctx.cast::<Owner>().cast_const();
        drop(Arc::from_raw(ctx));
    }
}

/// The error a producer's function set, or one saying that it failed to
/// `what` without setting one.
fn framework_error(py: Python<'_>, what: &str) -> PyErr {
    PyErr::take(py).unwrap_or_else(|| {
        crate::errors::to_py(
            py,
            &Error::InvalidArgument {
                what: "tensor",
                reason: format!(
                    "the framework's DLPack exchange API could not {what} and said nothing; \
                     set {}=0 to use DLPack through Python instead",
                    "CUDA_IPC_TORCH_C_API"
                ),
            },
        )
    })
}

/// Whether the element type travels to the framework as bytes and is
/// viewed back (fp8 and fp4: consumers that predate their DLPack codes
/// refuse them; `Tensor.view(dtype)` works on every PyTorch with the type).
pub(crate) fn as_bytes(d: Dtype) -> bool {
    matches!(
        d,
        Dtype::F8E4m3fn
            | Dtype::F8E5m2
            | Dtype::F8E4m3fnuz
            | Dtype::F8E5m2fnuz
            | Dtype::F8E8m0fnu
            | Dtype::F4E2m1fnX2
    )
}

impl TorchExchange {
    /// The tensor type the API was found on.
    pub(crate) fn tensor_type<'py>(&self, py: Python<'py>) -> &Bound<'py, PyType> {
        self.tensor_type.bind(py)
    }

    /// Reads `tensor`'s address, device, dtype, shape and strides. Raises
    /// `InvalidInput` for an object of another type, the framework's error
    /// for a tensor it cannot describe (then read it through Python).
    pub(crate) fn read(&self, tensor: &Bound<'_, PyAny>) -> PyResult<TensorMeta> {
        let py = tensor.py();
        if !tensor.is_instance(self.tensor_type.bind(py))? {
            return Err(Error::InvalidArgument {
                what: "tensor",
                reason: format!(
                    "expected a {}, not {}",
                    self.tensor_type.bind(py).name()?,
                    tensor.get_type().name()?
                ),
            })
            .py();
        }
        self.read_known(tensor)
    }

    /// As [`TorchExchange::read`], for a `tensor` the caller has checked
    /// is of the API's tensor type.
    pub(crate) fn read_known(&self, tensor: &Bound<'_, PyAny>) -> PyResult<TensorMeta> {
        let py = tensor.py();
        let obj = tensor.as_ptr().cast::<c_void>();
        if let Some(f) = self.from_dltensor {
            let mut t = DlTensor::zeroed();
            // SAFETY: `obj` is a live object of the API's tensor type (held by
            // the caller, GIL held); `t` is ours to fill.
            if unsafe { f(obj, &raw mut t) } != 0 {
                return Err(framework_error(py, "describe the tensor"));
            }
            // SAFETY: the producer filled `t`; its arrays live until we
            // return to Python (we do not before copying them).
            return unsafe { decode(&t) }.py();
        }
        let Some(f) = self.from_managed else {
            // `new` refuses an API with neither function.
            return Err(refused(py, "it cannot read tensors".to_owned()));
        };
        let mut m: *mut ManagedVersioned = std::ptr::null_mut();
        // SAFETY: as above; `m` receives an owning pointer.
        if unsafe { f(obj, &raw mut m) } != 0 || m.is_null() {
            return Err(framework_error(py, "describe the tensor"));
        }
        // SAFETY: `m` is a live managed tensor we own until its deleter.
        let meta = unsafe { decode(&(*m).dl_tensor) };
        // SAFETY: hand it back once, as DLPack requires.
        unsafe {
            if let Some(d) = (*m).deleter {
                d(m);
            }
        }
        meta.py()
    }

    /// A tensor of the framework over `keep`'s memory `at`. The tensor
    /// holds `keep` until its storage dies.
    pub(crate) fn make(&self, py: Python<'_>, keep: Keep, at: &At<'_>) -> PyResult<Py<PyAny>> {
        self.make_with(py, Some(keep), at)
    }

    fn make_with(&self, py: Python<'_>, keep: Option<Keep>, at: &At<'_>) -> PyResult<Py<PyAny>> {
        let At {
            ptr,
            ordinal,
            dtype,
            shape,
            strides,
        } = *at;
        if shape.len() != strides.len() || shape.len() > MAX_NDIM {
            return Err(Error::InvalidArgument {
                what: "tensor layout",
                reason: format!(
                    "{} dimensions and {} strides (at most {MAX_NDIM} dimensions, one stride each)",
                    shape.len(),
                    strides.len()
                ),
            })
            .py();
        }
        let device_id = i32::try_from(ordinal).map_err(|_| {
            crate::errors::to_py(
                py,
                &Error::InvalidArgument {
                    what: "device",
                    reason: format!("ordinal {ordinal} is out of range"),
                },
            )
        })?;
        let ndim = shape.len();
        let mut dims: SmallVec<[i64; 8]> = SmallVec::with_capacity(2 * ndim);
        dims.extend_from_slice(shape);
        dims.extend_from_slice(strides);
        let managed = ManagedVersioned {
            version: Version {
                major: 1,
                minor: MIN_MINOR,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_owner),
            flags: 0,
            dl_tensor: DlTensor {
                data: ptr as *mut c_void,
                device: DlDevice {
                    device_type: DEVICE_CUDA,
                    device_id,
                },
                ndim: ndim as i32,
                dtype,
                // Set below, once the owner is where it stays.
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
        };
        OWNERS.fetch_add(1, Ordering::SeqCst);
        let owner = Arc::new(Owner {
            managed: UnsafeCell::new(managed),
            dims,
            _keep: keep,
        });
        let raw = owner.managed.get();
        let theirs = Arc::into_raw(Arc::clone(&owner));
        // The framework only reads the arrays (DLPack's producer owns them).
        let shape_at = owner.dims.as_ptr().cast_mut();
        // SAFETY: nobody else has the structure yet; the arrays are the
        // owner's, which stays in its Arc (neither moves nor changes) until
        // the last reference, the framework's included, is gone.
        unsafe {
            (*raw).manager_ctx = theirs.cast_mut().cast();
            (*raw).dl_tensor.shape = shape_at;
            (*raw).dl_tensor.strides = shape_at.add(ndim);
        }
        let to_py = self.to_py;
        let mut out: *mut c_void = std::ptr::null_mut();
        // SAFETY: `raw` is a complete DLManagedTensorVersioned whose ownership
        // (the `theirs` reference) the call takes; the GIL is held.
        let rc = unsafe { to_py(raw, &raw mut out) };
        if rc != 0 || out.is_null() {
            let err = framework_error(py, "make the tensor");

            // No tensor was made, so the framework holds no reference: if it
            // did not call the deleter before failing, `theirs` is still
            // counted here and is freed now; otherwise it was freed there.
            if Arc::strong_count(&owner) == 2 {
                // SAFETY: `theirs` came from Arc::into_raw above and was not
                // given back by the deleter.
                drop(unsafe { Arc::from_raw(theirs) });
            }
            if !out.is_null() {
                // SAFETY: a reference the call returned along with its error.
                unsafe { ffi::Py_DecRef(out.cast()) };
            }
            return Err(err);
        }
        // SAFETY: the call returned a new reference to the tensor.
        Ok(unsafe { Bound::from_owned_ptr(py, out.cast()) }.unbind())
    }
}

impl DlTensor {
    /// An empty structure for a producer to fill.
    fn zeroed() -> Self {
        DlTensor {
            data: std::ptr::null_mut(),
            device: DlDevice::default(),
            ndim: 0,
            dtype: DlDataType::default(),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        }
    }
}

/// Copies `t` out, checking its dimensions.
///
/// # Safety
/// `t` was filled by a DLPack producer: `shape` and, unless null, `strides`
/// point to `ndim` integers each.
unsafe fn decode(t: &DlTensor) -> cuda_ipc::Result<TensorMeta> {
    let ndim = usize::try_from(t.ndim)
        .ok()
        .filter(|&n| n <= MAX_NDIM)
        .ok_or_else(|| Error::InvalidArgument {
            what: "DLPack tensor",
            reason: format!("ndim {} is not between 0 and {MAX_NDIM}", t.ndim),
        })?;
    if ndim > 0 && t.shape.is_null() {
        return Err(Error::InvalidArgument {
            what: "DLPack tensor",
            reason: format!("{ndim} dimensions and no shape"),
        });
    }
    let shape: Dims = if ndim == 0 {
        Dims::new()
    } else {
        // SAFETY: non-null, `ndim` integers (the caller's contract).
        Dims::from_slice(unsafe { std::slice::from_raw_parts(t.shape, ndim) })
    };
    if let Some(d) = shape.iter().find(|&&d| d < 0) {
        return Err(Error::InvalidArgument {
            what: "DLPack tensor",
            reason: format!("a negative dimension ({d}) in {shape:?}"),
        });
    }
    let strides = if ndim == 0 || t.strides.is_null() {
        contiguous_strides(&shape)
    } else {
        // SAFETY: as for the shape.
        Dims::from_slice(unsafe { std::slice::from_raw_parts(t.strides, ndim) })
    };
    let ptr = (t.data as u64).wrapping_add(t.byte_offset);
    Ok(TensorMeta {
        ptr,
        device: t.device,
        dtype: t.dtype,
        shape,
        strides,
    })
}

/// Registers `TorchExchange` and `torch_c_owners`.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<TorchExchange>()?;
    m.add_function(wrap_pyfunction!(torch_c_owners, m)?)?;
    m.add("DLPACK_EXCHANGE_API_SIZE", API_SIZE)?;
    Ok(())
}
