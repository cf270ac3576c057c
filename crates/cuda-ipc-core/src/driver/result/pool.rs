use super::*;
use crate::handle::PoolPtrHandle;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// `cuMemPoolCreate` for device memory shareable as POSIX file descriptors.
pub(crate) fn create(device: i32, max_size: u64) -> Result<sys::CUmemoryPool> {
    // SAFETY: plain data for which all zeroes is the documented default.
    let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
    props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    props.location = sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: device,
    };
    props.maxSize = max_size as usize;
    let mut pool = std::ptr::null_mut();
    // SAFETY: valid pointers for the call.
    check("cuMemPoolCreate", unsafe {
        sys::cuMemPoolCreate(&raw mut pool, &raw const props)
    })?;
    Ok(pool)
}

/// `cuMemPoolDestroy`.
///
/// # Safety
/// The pool must be live and not used afterwards.
pub(crate) unsafe fn destroy(pool: sys::CUmemoryPool) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuMemPoolDestroy", unsafe { sys::cuMemPoolDestroy(pool) })
}

/// `cuMemPoolTrimTo`.
///
/// # Safety
/// The pool must be live.
pub(crate) unsafe fn trim_to(pool: sys::CUmemoryPool, keep: u64) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuMemPoolTrimTo", unsafe {
        sys::cuMemPoolTrimTo(pool, keep as usize)
    })
}

/// `cuMemPoolExportToShareableHandle` as a POSIX file descriptor, owned by the caller.
///
/// # Safety
/// The pool must be live.
pub(crate) unsafe fn export_fd(pool: sys::CUmemoryPool) -> Result<OwnedFd> {
    let mut fd: std::ffi::c_int = -1;
    // SAFETY: for POSIX_FILE_DESCRIPTOR the driver writes an int.
    check("cuMemPoolExportToShareableHandle", unsafe {
        sys::cuMemPoolExportToShareableHandle(
            (&raw mut fd).cast::<c_void>(),
            pool,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    })?;
    // SAFETY: a new descriptor that we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `cuMemPoolImportFromShareableHandle`. The caller keeps owning `fd`.
pub(crate) fn import_fd(fd: BorrowedFd<'_>) -> Result<sys::CUmemoryPool> {
    let mut pool = std::ptr::null_mut();
    // SAFETY: for POSIX_FILE_DESCRIPTOR the handle is the int itself.
    check("cuMemPoolImportFromShareableHandle", unsafe {
        sys::cuMemPoolImportFromShareableHandle(
            &raw mut pool,
            fd.as_raw_fd() as usize as *mut c_void,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    })?;
    Ok(pool)
}

/// `cuMemPoolSetAccess`, read-write for `device`.
///
/// # Safety
/// The pool must be live.
pub(crate) unsafe fn set_access_rw(pool: sys::CUmemoryPool, device: i32) -> Result<()> {
    let desc = super::vmm::access_rw(device);
    // SAFETY: `desc` lives for the call; the caller's contract.
    check("cuMemPoolSetAccess", unsafe {
        sys::cuMemPoolSetAccess(pool, &raw const desc, 1)
    })
}

/// `cuMemPoolGetAccess`: whether `device` has read-write access to the pool.
///
/// # Safety
/// The pool must be live.
pub(crate) unsafe fn has_access_rw(pool: sys::CUmemoryPool, device: i32) -> Result<bool> {
    let mut location = sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: device,
    };
    let mut flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE;
    // SAFETY: valid pointers for the call; the caller's contract.
    check("cuMemPoolGetAccess", unsafe {
        sys::cuMemPoolGetAccess(&raw mut flags, pool, &raw mut location)
    })?;
    Ok(flags == sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
}

/// `cuMemAllocFromPoolAsync`.
///
/// # Safety
/// Pool and stream must be live.
pub(crate) unsafe fn alloc_async(
    size: u64,
    pool: sys::CUmemoryPool,
    stream: sys::CUstream,
) -> Result<u64> {
    let mut p = 0;
    // SAFETY: valid out-pointer; the caller's contract.
    check("cuMemAllocFromPoolAsync", unsafe {
        sys::cuMemAllocFromPoolAsync(&raw mut p, size as usize, pool, stream)
    })?;
    Ok(p)
}

/// `cuMemFreeAsync`.
///
/// # Safety
/// `ptr` must be a live pool allocation (or an imported one) not used by later work.
pub(crate) unsafe fn free_async(ptr: u64, stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuMemFreeAsync", unsafe {
        sys::cuMemFreeAsync(ptr, stream)
    })
}

/// `cuMemPoolExportPointer`.
pub(crate) fn export_pointer(ptr: u64) -> Result<PoolPtrHandle> {
    let mut d = MaybeUninit::<sys::CUmemPoolPtrExportData>::uninit();
    // SAFETY: valid out-pointer; the driver validates `ptr`.
    check("cuMemPoolExportPointer", unsafe {
        sys::cuMemPoolExportPointer(d.as_mut_ptr(), ptr)
    })?;
    // SAFETY: initialised by the successful call.
    Ok(PoolPtrHandle::from_sys(unsafe { d.assume_init() }))
}

/// `cuMemPoolImportPointer`.
///
/// # Safety
/// The pool must be live (imported).
pub(crate) unsafe fn import_pointer(pool: sys::CUmemoryPool, data: PoolPtrHandle) -> Result<u64> {
    let mut p = 0;
    let mut d = data.to_sys();
    // SAFETY: valid pointers for the call; the caller's contract.
    check("cuMemPoolImportPointer", unsafe {
        sys::cuMemPoolImportPointer(&raw mut p, pool, &raw mut d)
    })?;
    Ok(p)
}
