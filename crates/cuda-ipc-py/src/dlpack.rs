//! DLPack (version 0.8, the unversioned `dltensor` capsule every consumer
//! reads): the C structures and the capsule that hands a mapped view to
//! PyTorch, CuPy, JAX or NumPy-like libraries without a copy.
//!
//! The capsule's tensor owns a [`crate::keep::Keep`]: the mapping (and
//! the lease, for memory attached over the channel) lives until the
//! consumer calls the deleter, that is until its last tensor view is gone.
#![allow(unsafe_code)]

use std::ffi::{CStr, c_void};

use pyo3::ffi;
use pyo3::prelude::*;

use crate::keep::Keep;

/// `kDLCUDA`.
pub(crate) const DEVICE_CUDA: i32 = 2;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct DlDevice {
    pub(crate) device_type: i32,
    pub(crate) device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct DlDataType {
    pub(crate) code: u8,
    pub(crate) bits: u8,
    pub(crate) lanes: u16,
}

#[repr(C)]
pub(crate) struct DlTensor {
    pub(crate) data: *mut c_void,
    pub(crate) device: DlDevice,
    pub(crate) ndim: i32,
    pub(crate) dtype: DlDataType,
    pub(crate) shape: *mut i64,
    pub(crate) strides: *mut i64,
    pub(crate) byte_offset: u64,
}

#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// The DLPack type of an element type, or with `raw` of the same-sized
/// integer a `raw` view shows ([`crate::codec::raw_dtype`]: `u8` for bool
/// and the fp8/fp4 types, `i16` for bf16, ...; `c128` stays complex).
///
/// Type codes from DLPack 1.1's `DLDataTypeCode` (the values do not depend
/// on the capsule's version): kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4,
/// kDLComplex 5, kDLBool 6, kDLFloat8_e4m3fn 10, kDLFloat8_e4m3fnuz 11,
/// kDLFloat8_e5m2 12, kDLFloat8_e5m2fnuz 13, kDLFloat8_e8m0fnu 14,
/// kDLFloat4_e2m1fn 17. PyTorch's `float4_e2m1fn_x2` is kDLFloat4_e2m1fn
/// with 4 bits and 2 lanes (as PyTorch's own DLPack export writes it).
/// Consumers that predate the fp8/fp4 codes refuse them: read those types
/// through a `raw` view.
pub(crate) fn data_type(d: cuda_ipc::Dtype, raw: bool) -> DlDataType {
    use cuda_ipc::Dtype as D;
    let d = if raw { crate::codec::raw_dtype(d) } else { d };
    let bits = u8::try_from(d.size() * 8).unwrap_or(u8::MAX);
    let (code, bits, lanes) = match d {
        D::Bool => (6, bits, 1),
        D::U8 | D::U16 | D::U32 | D::U64 => (1, bits, 1),
        D::F16 | D::F32 | D::F64 => (2, bits, 1),
        D::Bf16 => (4, bits, 1),
        D::C64 | D::C128 => (5, bits, 1),
        D::F8E4m3fn => (10, bits, 1),
        D::F8E4m3fnuz => (11, bits, 1),
        D::F8E5m2 => (12, bits, 1),
        D::F8E5m2fnuz => (13, bits, 1),
        D::F8E8m0fnu => (14, bits, 1),
        D::F4E2m1fnX2 => (17, 4, 2),
        // The signed integers, and a type added to the library later (as
        // same-sized integers).
        _ => (0, bits, 1),
    };
    DlDataType { code, bits, lanes }
}

/// What the capsule's tensor owns: the structure itself first (its address
/// is the `DLManagedTensor *`), the arrays it points into, the mapping.
#[repr(C)]
struct Owner {
    managed: DlManagedTensor,
    shape: Vec<i64>,
    strides: Vec<i64>,
    keep: Box<dyn std::any::Any + Send>,
}

unsafe extern "C" fn delete_owner(managed: *mut DlManagedTensor) {
    if managed.is_null() {
        return;
    }
    // SAFETY: `managed` is the first field of a `#[repr(C)]` Owner made by
    // `Box::into_raw` in `capsule`, and DLPack calls the deleter once.
    drop(unsafe { Box::from_raw(managed.cast::<Owner>()) });
}

const NAME: &CStr = c"dltensor";

const USED_NAME: &CStr = c"used_dltensor";

unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // A consumer that took the tensor renamed the capsule to
    // "used_dltensor" and owns it now: nothing to do, and nothing to touch
    // (an exception may be in flight while the capsule is collected; it
    // must survive). Otherwise nobody took it, and we free it, keeping any
    // exception in flight, as DLPack's reference deleter does.
    // SAFETY: called by Python with a live capsule and the GIL held;
    // `PyCapsule_IsValid` never sets an exception.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, USED_NAME.as_ptr()) == 1 {
            return;
        }
        let (mut ty, mut value, mut tb) = (
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        );
        ffi::PyErr_Fetch(&raw mut ty, &raw mut value, &raw mut tb);
        let managed = ffi::PyCapsule_GetPointer(capsule, NAME.as_ptr()).cast::<DlManagedTensor>();
        if managed.is_null() {
            // Neither name: not a capsule of ours to free.
            ffi::PyErr_WriteUnraisable(capsule);
        } else if let Some(deleter) = (*managed).deleter {
            deleter(managed);
        }
        ffi::PyErr_Restore(ty, value, tb);
    }
}

/// A `dltensor` capsule over `keep`'s memory at `ptr`, with shape and
/// strides in elements, on CUDA device `ordinal`.
pub(crate) fn capsule(
    py: Python<'_>,
    keep: Keep,
    ptr: u64,
    ordinal: usize,
    dtype: DlDataType,
    shape: &[u64],
    strides: &[u64],
) -> PyResult<Py<PyAny>> {
    owned_capsule(py, Box::new(keep), ptr, ordinal, dtype, shape, strides)
}

/// A `dltensor` capsule whose tensor owns `keep` (dropped by the deleter).
fn owned_capsule(
    py: Python<'_>,
    keep: Box<dyn std::any::Any + Send>,
    ptr: u64,
    ordinal: usize,
    dtype: DlDataType,
    shape: &[u64],
    strides: &[u64],
) -> PyResult<Py<PyAny>> {
    let mut owner = Box::new(Owner {
        managed: DlManagedTensor {
            dl_tensor: DlTensor {
                data: ptr as *mut c_void,
                device: DlDevice {
                    device_type: DEVICE_CUDA,
                    device_id: ordinal as i32,
                },
                ndim: shape.len() as i32,
                dtype,
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_owner),
        },
        shape: shape.iter().map(|&d| d as i64).collect(),
        strides: strides.iter().map(|&s| s as i64).collect(),
        keep,
    });
    owner.managed.dl_tensor.shape = owner.shape.as_mut_ptr();
    owner.managed.dl_tensor.strides = owner.strides.as_mut_ptr();
    let raw = Box::into_raw(owner);
    // SAFETY: `raw` is a live Owner; the field projection stays inside it.
    unsafe {
        (*raw).managed.manager_ctx = raw.cast();
    }
    // SAFETY: the pointer is non-null and outlives the capsule (freed by the
    // deleter, which the destructor or the consumer calls once); the name is
    // a static C string.
    let cap = unsafe { ffi::PyCapsule_New(raw.cast(), NAME.as_ptr(), Some(capsule_destructor)) };
    if cap.is_null() {
        // SAFETY: no capsule owns `raw`, so nobody else frees it.
        unsafe { delete_owner(raw.cast()) };
        return Err(PyErr::fetch(py));
    }
    // SAFETY: PyCapsule_New returned a new reference.
    Ok(unsafe { Bound::from_owned_ptr(py, cap) }.unbind())
}

#[cfg(feature = "test-hooks")]
/// Capsules made by [`probe`] whose tensor was freed.
static PROBES_FREED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[cfg(feature = "test-hooks")]
/// Counts its drop in [`PROBES_FREED`].
struct Probe;

#[cfg(feature = "test-hooks")]
impl Drop for Probe {
    fn drop(&mut self) {
        PROBES_FREED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

#[cfg(feature = "test-hooks")]
/// For the package's tests (no GPU needed): a `dltensor` capsule over no
/// memory (a null address, shape `(0,)`) made and destroyed exactly as the
/// capsules of mapped memory are, whose tensor counts its free in
/// `_dlpack_probes_freed()`.
#[pyfunction]
#[pyo3(name = "_dlpack_probe")]
fn probe(py: Python<'_>) -> PyResult<Py<PyAny>> {
    owned_capsule(
        py,
        Box::new(Probe),
        0,
        0,
        data_type(cuda_ipc::Dtype::U8, false),
        &[0],
        &[1],
    )
}

#[cfg(feature = "test-hooks")]
/// How many capsules of `_dlpack_probe()` had their tensor freed.
#[pyfunction]
#[pyo3(name = "_dlpack_probes_freed")]
fn probes_freed() -> usize {
    PROBES_FREED.load(std::sync::atomic::Ordering::SeqCst)
}

#[cfg(feature = "test-hooks")]
/// For the package's tests: makes a probe capsule (renamed
/// "used_dltensor" first when `consumed`, as a consumer does), sets an
/// exception, lets the capsule go with the exception in flight, and says
/// whether the exception survived (it is then cleared).
#[pyfunction]
#[pyo3(name = "_dlpack_probe_dropped_in_flight")]
fn probe_dropped_in_flight(py: Python<'_>, consumed: bool) -> PyResult<bool> {
    let capsule = probe(py)?;
    // SAFETY: the GIL is held; `capsule` is a live capsule whose only
    // reference is ours, given up by `drop` below; the names are static C
    // strings; the exception set here is fetched back (or found gone).
    unsafe {
        if consumed && ffi::PyCapsule_SetName(capsule.as_ptr(), USED_NAME.as_ptr()) != 0 {
            return Err(PyErr::fetch(py));
        }
        ffi::PyErr_SetString(ffi::PyExc_RuntimeError, c"in flight".as_ptr());
        drop(capsule);
        let survived = !ffi::PyErr_Occurred().is_null();
        ffi::PyErr_Clear();
        Ok(survived)
    }
}

/// Registers the test hooks (builds with the `test-hooks` feature only).
#[cfg(feature = "test-hooks")]
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(probe, m)?)?;
    m.add_function(wrap_pyfunction!(probe_dropped_in_flight, m)?)?;
    m.add_function(wrap_pyfunction!(probes_freed, m)?)?;
    Ok(())
}
