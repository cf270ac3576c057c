use super::*;
use crate::handle::FabricHandle;
use std::os::fd::{FromRawFd, OwnedFd};

pub(crate) use sys::CUmemAllocationHandleType as HandleType;

/// Properties of pinned device memory on `device` with the given shareable handle types.
pub(crate) fn device_prop(device: i32, handle_types: HandleType) -> sys::CUmemAllocationProp {
    // SAFETY: the struct is plain data for which all zeroes is the documented default.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = handle_types;
    prop.location = sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: device,
    };
    prop
}

/// `cuMemGetAllocationGranularity` (recommended granularity).
pub(crate) fn granularity(prop: &sys::CUmemAllocationProp) -> Result<u64> {
    let mut g = 0usize;
    // SAFETY: valid pointers for the call.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(
            &raw mut g,
            prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        )
    })?;
    Ok(g as u64)
}

/// `cuMemCreate`.
pub(crate) fn create(
    size: u64,
    prop: &sys::CUmemAllocationProp,
) -> Result<sys::CUmemGenericAllocationHandle> {
    let mut h = 0;
    // SAFETY: valid pointers for the call.
    check("cuMemCreate", unsafe {
        sys::cuMemCreate(&raw mut h, size as usize, prop, 0)
    })?;
    Ok(h)
}

/// `cuMemRelease`.
///
/// # Safety
/// `h` must come from `cuMemCreate` or an import, released once.
pub(crate) unsafe fn release(h: sys::CUmemGenericAllocationHandle) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuMemRelease", unsafe { sys::cuMemRelease(h) })
}

/// `cuMemRetainAllocationHandle`: the physical allocation mapped at `ptr`
/// (released with [`release`]).
pub(crate) fn retain_allocation_handle(ptr: u64) -> Result<sys::CUmemGenericAllocationHandle> {
    let mut h = 0;
    // SAFETY: valid out-pointer; the driver validates the address.
    check("cuMemRetainAllocationHandle", unsafe {
        sys::cuMemRetainAllocationHandle(&raw mut h, ptr as usize as *mut c_void)
    })?;
    Ok(h)
}

/// `cuMemExportToShareableHandle` as a POSIX file descriptor, owned by the caller.
pub(crate) fn export_fd(h: sys::CUmemGenericAllocationHandle) -> Result<OwnedFd> {
    let mut fd: std::ffi::c_int = -1;
    // SAFETY: for POSIX_FILE_DESCRIPTOR the driver writes an int.
    check("cuMemExportToShareableHandle", unsafe {
        sys::cuMemExportToShareableHandle(
            (&raw mut fd).cast::<c_void>(),
            h,
            HandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    })?;
    // SAFETY: on success the driver returns a new descriptor that we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `cuMemExportToShareableHandle` as a fabric handle.
pub(crate) fn export_fabric(h: sys::CUmemGenericAllocationHandle) -> Result<FabricHandle> {
    let mut out = MaybeUninit::<sys::CUmemFabricHandle>::uninit();
    // SAFETY: for FABRIC the driver writes a CUmemFabricHandle.
    check("cuMemExportToShareableHandle", unsafe {
        sys::cuMemExportToShareableHandle(
            out.as_mut_ptr().cast::<c_void>(),
            h,
            HandleType::CU_MEM_HANDLE_TYPE_FABRIC,
            0,
        )
    })?;
    // SAFETY: initialised by the successful call.
    Ok(FabricHandle::from_sys(unsafe { out.assume_init() }))
}

/// `cuMemImportFromShareableHandle` from a POSIX file descriptor.
///
/// The driver does not take the descriptor: the caller still owns and closes it.
pub(crate) fn import_fd(
    fd: std::os::fd::BorrowedFd<'_>,
) -> Result<sys::CUmemGenericAllocationHandle> {
    use std::os::fd::AsRawFd;
    let mut h = 0;
    // SAFETY: for POSIX_FILE_DESCRIPTOR the "handle" is the int itself, passed as a pointer-sized value.
    check("cuMemImportFromShareableHandle", unsafe {
        sys::cuMemImportFromShareableHandle(
            &raw mut h,
            fd.as_raw_fd() as usize as *mut c_void,
            HandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
    })?;
    Ok(h)
}

/// `cuMemImportFromShareableHandle` from a fabric handle.
pub(crate) fn import_fabric(handle: FabricHandle) -> Result<sys::CUmemGenericAllocationHandle> {
    let mut h = 0;
    let mut data = handle.to_sys();
    // SAFETY: for FABRIC the handle argument points at a CUmemFabricHandle.
    check("cuMemImportFromShareableHandle", unsafe {
        sys::cuMemImportFromShareableHandle(
            &raw mut h,
            (&raw mut data).cast::<c_void>(),
            HandleType::CU_MEM_HANDLE_TYPE_FABRIC,
        )
    })?;
    Ok(h)
}

/// `cuMemAddressReserve`.
pub(crate) fn address_reserve(size: u64, alignment: u64) -> Result<u64> {
    let mut p = 0;
    // SAFETY: valid out-pointer.
    check("cuMemAddressReserve", unsafe {
        sys::cuMemAddressReserve(&raw mut p, size as usize, alignment as usize, 0, 0)
    })?;
    Ok(p)
}

/// `cuMemAddressFree`.
///
/// # Safety
/// The range must come from `cuMemAddressReserve` and be unmapped.
pub(crate) unsafe fn address_free(ptr: u64, size: u64) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuMemAddressFree", unsafe {
        sys::cuMemAddressFree(ptr, size as usize)
    })
}

/// `cuMemMap`.
///
/// # Safety
/// `ptr..ptr+size` must be a reserved, unmapped range.
pub(crate) unsafe fn map(ptr: u64, size: u64, h: sys::CUmemGenericAllocationHandle) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuMemMap", unsafe {
        sys::cuMemMap(ptr, size as usize, 0, h, 0)
    })
}

/// `cuMemUnmap`.
///
/// # Safety
/// The range must be mapped and no work may still use it.
pub(crate) unsafe fn unmap(ptr: u64, size: u64) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuMemUnmap", unsafe { sys::cuMemUnmap(ptr, size as usize) })
}

/// `cuMemSetAccess`, read-write for each listed device.
///
/// # Safety
/// The range must be mapped.
pub(crate) unsafe fn set_access_rw(ptr: u64, size: u64, devices: &[i32]) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { set_access(ptr, size, devices, access_rw) }
}

/// `cuMemSetAccess`, read-only for each listed device
/// (`CU_MEM_ACCESS_FLAGS_PROT_READ`): a kernel or copy that writes through
/// the range then fails.
///
/// # Safety
/// The range must be mapped.
pub(crate) unsafe fn set_access_ro(ptr: u64, size: u64, devices: &[i32]) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { set_access(ptr, size, devices, access_ro) }
}

/// `cuMemSetAccess` with the descriptor `desc` makes for each device.
///
/// # Safety
/// The range must be mapped.
unsafe fn set_access(
    ptr: u64,
    size: u64,
    devices: &[i32],
    desc: fn(i32) -> sys::CUmemAccessDesc,
) -> Result<()> {
    let descs: Vec<sys::CUmemAccessDesc> = devices.iter().map(|d| desc(*d)).collect();
    // SAFETY: `descs` lives for the call; the caller's contract for the range.
    check("cuMemSetAccess", unsafe {
        sys::cuMemSetAccess(ptr, size as usize, descs.as_ptr(), descs.len())
    })
}

/// A read-write access descriptor for `device`.
pub(crate) fn access_rw(device: i32) -> sys::CUmemAccessDesc {
    access_desc(
        device,
        sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    )
}

/// A read-only access descriptor for `device`.
pub(crate) fn access_ro(device: i32) -> sys::CUmemAccessDesc {
    access_desc(
        device,
        sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ,
    )
}

fn access_desc(device: i32, flags: sys::CUmemAccess_flags) -> sys::CUmemAccessDesc {
    sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device,
        },
        flags,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_descriptors_carry_the_flag_asked_for() {
        let ro = access_ro(3);
        assert_eq!(
            ro.flags,
            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ
        );
        assert_eq!(ro.location.id, 3);
        let rw = access_rw(1);
        assert_eq!(
            rw.flags,
            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        );
        assert_eq!(rw.location.id, 1);
    }
}
