use sys::{CUstreamWaitValue_flags, CUstreamWriteValue_flags};

use super::*;

/// `cuStreamWriteValue64_v2` with the default flags: a memory barrier,
/// then the write, after the work queued before it on `stream`.
///
/// # Safety
/// `stream` must be live and `addr` an 8-byte aligned word of device
/// memory that stays mapped until the stream has passed this write.
#[doc(alias = "cuStreamWriteValue64")]
pub(crate) unsafe fn write_value64(stream: sys::CUstream, addr: u64, value: u64) -> Result<()> {
    let flags = CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32;
    // SAFETY: the caller's contract; the symbol was checked at load.
    check("cuStreamWriteValue64", unsafe {
        sys::cuStreamWriteValue64_v2(stream, addr, value, flags)
    })
}

/// `cuStreamWaitValue64_v2` with `CU_STREAM_WAIT_VALUE_GEQ`: holds
/// `stream` until `(int64_t)(*addr - value) >= 0`.
///
/// # Safety
/// As [`write_value64`].
#[doc(alias = "cuStreamWaitValue64")]
pub(crate) unsafe fn wait_value64_geq(stream: sys::CUstream, addr: u64, value: u64) -> Result<()> {
    let flags = CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
    // SAFETY: the caller's contract; the symbol was checked at load.
    check("cuStreamWaitValue64", unsafe {
        sys::cuStreamWaitValue64_v2(stream, addr, value, flags)
    })
}

/// `cuMemHostRegister_v2` with `CU_MEMHOSTREGISTER_PORTABLE |
/// CU_MEMHOSTREGISTER_DEVICEMAP`: pins `len` bytes at `ptr` and maps
/// them for every context's devices.
///
/// # Safety
/// `ptr..ptr + len` must be a page-aligned mapping of this process that
/// stays mapped until [`host_unregister`].
#[doc(alias = "cuMemHostRegister")]
pub(crate) unsafe fn host_register(ptr: *mut c_void, len: usize) -> Result<()> {
    let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
    // SAFETY: the caller's contract; the symbol was checked at load.
    check("cuMemHostRegister", unsafe {
        sys::cuMemHostRegister_v2(ptr, len, flags)
    })
}

/// `cuMemHostUnregister`.
///
/// # Safety
/// `ptr` must have been registered with [`host_register`], and no
/// queued work may still use it.
#[doc(alias = "cuMemHostUnregister")]
pub(crate) unsafe fn host_unregister(ptr: *mut c_void) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuMemHostUnregister", unsafe {
        sys::cuMemHostUnregister(ptr)
    })
}

/// `cuMemHostGetDevicePointer_v2`: the device address of registered
/// host memory.
///
/// # Safety
/// `ptr` must lie in memory registered with [`host_register`].
#[doc(alias = "cuMemHostGetDevicePointer")]
pub(crate) unsafe fn host_device_pointer(ptr: *mut c_void) -> Result<u64> {
    let mut d = 0;
    // SAFETY: valid out-pointer; the caller's contract for `ptr`.
    check("cuMemHostGetDevicePointer", unsafe {
        sys::cuMemHostGetDevicePointer_v2(&raw mut d, ptr, 0)
    })?;
    Ok(d)
}
