//! Virtual memory management: physical allocations are memfds, exported
//! and imported as duplicated descriptors; reservations are inaccessible
//! anonymous mappings that `cuMemMap` replaces with the memfd's pages and
//! `cuMemSetAccess` opens with `mprotect`.

use std::ffi::{c_int, c_ulonglong, c_void};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, IntoRawFd, OwnedFd};

use cudarc::driver::sys::{
    CUdeviceptr, CUmemAccess_flags as AF, CUmemAccessDesc, CUmemAllocationGranularity_flags,
    CUmemAllocationHandleType as HT, CUmemAllocationProp, CUmemGenericAllocationHandle,
    CUmemLocationType, CUresult, cudaError_enum as E,
};

use crate::registry::{Access, Kind, Region, Registry, assert_unused, registry};
use crate::{ctx_ok, put};

/// The allocation granularity, minimum and recommended: 2 MiB, as on
/// current GPUs.
pub(crate) const GRANULE: u64 = 2 << 20;

/// The name the fake gives the memfds of VMM allocations (imports check it).
pub(crate) const VMM_MEMFD: &str = "cuda-ipc-fake-device";

/// One physical allocation.
#[derive(Debug)]
pub(crate) struct Physical {
    /// Its memory.
    fd: OwnedFd,
    /// Its size in bytes.
    size: u64,
    /// Handle references (create, import, retain) and mappings.
    refs: u32,
    /// Made here by `cuMemCreate`, so counted in `cuMemGetInfo`.
    counted: bool,
    /// The handle types it may be exported as.
    types: u32,
}

impl Registry {
    /// Drops one reference to physical allocation `h`.
    fn unref(&mut self, h: u64) {
        let Some(p) = self.handles.get_mut(&h) else {
            return;
        };
        p.refs -= 1;
        if p.refs == 0
            && let Some(p) = self.handles.remove(&h)
            && p.counted
        {
            self.allocated -= p.size;
        }
    }
}

/// Whether `fd` is a memfd this fake made with name `name`.
pub(crate) fn is_our_memfd(fd: BorrowedFd<'_>, name: &str) -> bool {
    let link = format!("/proc/self/fd/{}", fd.as_raw_fd());
    std::fs::read_link(link)
        .is_ok_and(|p| p.to_string_lossy().starts_with(&format!("/memfd:{name} ")))
}

/// Checks a property block: pinned memory on device 0.
///
/// # Safety
/// `prop` is null or valid for reads.
unsafe fn check_prop(prop: *const CUmemAllocationProp) -> Result<CUmemAllocationProp, CUresult> {
    // SAFETY: the caller's contract.
    let prop = unsafe { prop.as_ref() }.ok_or(E::CUDA_ERROR_INVALID_VALUE)?;
    if prop.location.type_ != CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE {
        return Err(E::CUDA_ERROR_INVALID_VALUE);
    }
    if prop.location.id != 0 {
        return Err(E::CUDA_ERROR_INVALID_DEVICE);
    }
    Ok(*prop)
}

fake! {
    /// `cuMemGetAllocationGranularity`: 2 MiB.
    fn cuMemGetAllocationGranularity(
        granularity: *mut usize,
        prop: *const CUmemAllocationProp,
        option: CUmemAllocationGranularity_flags,
    ) {
        let _ = option;
        // SAFETY: the caller's pointer.
        unsafe { check_prop(prop) }?;
        // SAFETY: the caller's out-pointer.
        unsafe { put(granularity, GRANULE as usize) }
    }
}

fake! {
    /// `cuMemCreate`: a memfd; fabric handles are `CUDA_ERROR_NOT_SUPPORTED`.
    fn cuMemCreate(handle: *mut CUmemGenericAllocationHandle, size: usize, prop: *const CUmemAllocationProp, flags: c_ulonglong) {
        ctx_ok()?;
        // SAFETY: the caller's pointer.
        let prop = unsafe { check_prop(prop) }?;
        let size = size as u64;
        if flags != 0 || size == 0 || !size.is_multiple_of(GRANULE) {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let types = prop.requestedHandleTypes.0;
        if types & HT::CU_MEM_HANDLE_TYPE_FABRIC.0 != 0 {
            return Err(E::CUDA_ERROR_NOT_SUPPORTED);
        }
        let mut reg = registry();
        if reg.allocated + size > crate::device::TOTAL_MEMORY {
            return Err(E::CUDA_ERROR_OUT_OF_MEMORY);
        }
        let fd = crate::registry::memfd(size)?;
        let h = reg.next_id();
        reg.allocated += size;
        reg.handles.insert(h, Physical { fd, size, refs: 1, counted: true, types });
        // SAFETY: the caller's out-pointer.
        unsafe { put(handle, h) }
    }
}

fake! {
    /// `cuMemRelease`: the memory goes once no mapping holds it either.
    fn cuMemRelease(handle: CUmemGenericAllocationHandle) {
        ctx_ok()?;
        let mut reg = registry();
        if !reg.handles.contains_key(&handle) {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        reg.unref(handle);
        Ok(())
    }
}

fake! {
    /// `cuMemRetainAllocationHandle`: the allocation mapped at `addr`.
    fn cuMemRetainAllocationHandle(handle: *mut CUmemGenericAllocationHandle, addr: *mut c_void) {
        ctx_ok()?;
        let mut reg = registry();
        let h = match reg.containing(addr as u64) {
            Some((_, Region { kind: Kind::Vmm { handle }, .. })) => *handle,
            _ => return Err(E::CUDA_ERROR_INVALID_VALUE),
        };
        if let Some(p) = reg.handles.get_mut(&h) {
            p.refs += 1;
        }
        // SAFETY: the caller's out-pointer.
        unsafe { put(handle, h) }
    }
}

fake! {
    /// `cuMemExportToShareableHandle`: a new descriptor (POSIX file
    /// descriptors only), owned by the caller.
    fn cuMemExportToShareableHandle(shareableHandle: *mut c_void, handle: CUmemGenericAllocationHandle, handleType: HT, flags: c_ulonglong) {
        ctx_ok()?;
        if flags != 0 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        if handleType == HT::CU_MEM_HANDLE_TYPE_FABRIC {
            return Err(E::CUDA_ERROR_NOT_SUPPORTED);
        }
        if handleType != HT::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let reg = registry();
        let p = reg.handles.get(&handle).ok_or(E::CUDA_ERROR_INVALID_VALUE)?;
        if p.types & handleType.0 == 0 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let fd = p.fd.try_clone().map_err(|_| E::CUDA_ERROR_OPERATING_SYSTEM)?;
        // SAFETY: the caller's out-pointer, an int for this handle type.
        unsafe { put(shareableHandle.cast::<c_int>(), fd.into_raw_fd()) }
    }
}

fake! {
    /// `cuMemImportFromShareableHandle`: the descriptor must be one of this
    /// fake's VMM memfds; the caller keeps owning it.
    fn cuMemImportFromShareableHandle(handle: *mut CUmemGenericAllocationHandle, osHandle: *mut c_void, shHandleType: HT) {
        ctx_ok()?;
        if shHandleType != HT::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR {
            return Err(E::CUDA_ERROR_NOT_SUPPORTED);
        }
        let raw = osHandle as usize as c_int;
        if raw < 0 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller's descriptor, borrowed for this call only.
        let fd = unsafe { BorrowedFd::borrow_raw(raw) };
        if !is_our_memfd(fd, VMM_MEMFD) {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let size = rustix::fs::fstat(fd).map_err(|_| E::CUDA_ERROR_INVALID_VALUE)?.st_size as u64;
        let fd = fd.try_clone_to_owned().map_err(|_| E::CUDA_ERROR_OPERATING_SYSTEM)?;
        let mut reg = registry();
        let h = reg.next_id();
        let types = HT::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0;
        reg.handles.insert(h, Physical { fd, size, refs: 1, counted: false, types });
        // SAFETY: the caller's out-pointer.
        unsafe { put(handle, h) }
    }
}

fake! {
    /// `cuMemAddressReserve`: inaccessible address space.
    fn cuMemAddressReserve(ptr: *mut CUdeviceptr, size: usize, alignment: usize, addr: CUdeviceptr, flags: c_ulonglong) {
        ctx_ok()?;
        let _ = addr;
        let size = size as u64;
        if flags != 0 || size == 0 || !size.is_multiple_of(GRANULE) {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let start = crate::registry::reserve(size, (alignment as u64).max(GRANULE))?;
        registry().reservations.insert(start, size);
        // SAFETY: the caller's out-pointer.
        unsafe { put(ptr, start) }
    }
}

fake! {
    /// `cuMemAddressFree`: a whole reservation, with nothing mapped in it.
    fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) {
        ctx_ok()?;
        let mut reg = registry();
        if reg.reservations.get(&ptr) != Some(&(size as u64)) {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        if reg.regions.range(ptr..ptr + size as u64).next().is_some() {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        reg.reservations.remove(&ptr);
        // SAFETY: our reservation, with nothing mapped in it.
        unsafe { crate::registry::unmap(ptr, size as u64) };
        Ok(())
    }
}

/// Whether `ptr..ptr + size` lies inside one reservation.
fn reserved(reg: &Registry, ptr: u64, size: u64) -> bool {
    reg.reservations
        .range(..=ptr)
        .next_back()
        .is_some_and(|(b, s)| ptr + size <= b + s)
}

fake! {
    /// `cuMemMap`: the allocation's pages at `ptr`, inaccessible until
    /// `cuMemSetAccess`.
    fn cuMemMap(ptr: CUdeviceptr, size: usize, offset: usize, handle: CUmemGenericAllocationHandle, flags: c_ulonglong) {
        ctx_ok()?;
        let size = size as u64;
        let mut reg = registry();
        let phys = reg.handles.get(&handle).ok_or(E::CUDA_ERROR_INVALID_VALUE)?;
        if flags != 0 || offset != 0 || size == 0 || size > phys.size || !size.is_multiple_of(GRANULE) {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        if !reserved(&reg, ptr, size) || reg.containing(ptr).is_some() || reg.regions.range(ptr..ptr + size).next().is_some() {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: inside a reservation of ours, where nothing is mapped.
        unsafe { crate::registry::map_fixed(ptr, phys.fd.as_fd(), 0, size, Access::None.prot()) }?;
        if let Some(p) = reg.handles.get_mut(&handle) {
            p.refs += 1;
        }
        reg.regions.insert(ptr, Region { size, kind: Kind::Vmm { handle }, access: Access::None });
        Ok(())
    }
}

/// The VMM mappings that make up exactly `ptr..ptr + size`, by start.
fn mappings(reg: &Registry, ptr: u64, size: u64) -> Result<Vec<u64>, CUresult> {
    let mut at = ptr;
    let mut found = Vec::new();
    while at < ptr + size {
        match reg.regions.get(&at) {
            Some(
                r @ Region {
                    kind: Kind::Vmm { .. },
                    ..
                },
            ) if at + r.size <= ptr + size => {
                found.push(at);
                at += r.size;
            }
            _ => return Err(E::CUDA_ERROR_INVALID_VALUE),
        }
    }
    if found.is_empty() {
        Err(E::CUDA_ERROR_INVALID_VALUE)
    } else {
        Ok(found)
    }
}

fake! {
    /// `cuMemUnmap`: whole mappings only; the range stays reserved.
    fn cuMemUnmap(ptr: CUdeviceptr, size: usize) {
        ctx_ok()?;
        let size = size as u64;
        let mut reg = registry();
        let found = mappings(&reg, ptr, size)?;
        assert_unused("cuMemUnmap", "a VMM mapping", ptr, size);
        for at in found {
            if let Some(Region { size, kind: Kind::Vmm { handle }, .. }) = reg.regions.remove(&at) {
                // SAFETY: our mapping inside our reservation, unused (checked above).
                unsafe { crate::registry::unmap_to_reserved(at, size) };
                reg.unref(handle);
            }
        }
        Ok(())
    }
}

/// The access a descriptor list gives device 0.
///
/// # Safety
/// `desc` is valid for `count` descriptors.
pub(crate) unsafe fn access_of(
    desc: *const CUmemAccessDesc,
    count: usize,
) -> Result<Access, CUresult> {
    if desc.is_null() || count == 0 {
        return Err(E::CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the caller's contract.
    let descs = unsafe { std::slice::from_raw_parts(desc, count) };
    let mut access = None;
    for d in descs {
        if d.location.type_ != CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE || d.location.id != 0
        {
            return Err(E::CUDA_ERROR_INVALID_DEVICE);
        }
        access = Some(match d.flags {
            AF::CU_MEM_ACCESS_FLAGS_PROT_NONE => Access::None,
            AF::CU_MEM_ACCESS_FLAGS_PROT_READ => Access::Read,
            AF::CU_MEM_ACCESS_FLAGS_PROT_READWRITE => Access::ReadWrite,
            AF::CU_MEM_ACCESS_FLAGS_PROT_MAX => return Err(E::CUDA_ERROR_INVALID_VALUE),
        });
    }
    access.ok_or(E::CUDA_ERROR_INVALID_VALUE)
}

fake! {
    /// `cuMemSetAccess`: device 0's rights over whole mappings.
    fn cuMemSetAccess(ptr: CUdeviceptr, size: usize, desc: *const CUmemAccessDesc, count: usize) {
        ctx_ok()?;
        // SAFETY: the caller's descriptors.
        let access = unsafe { access_of(desc, count) }?;
        let size = size as u64;
        let mut reg = registry();
        for at in mappings(&reg, ptr, size)? {
            if let Some(r) = reg.regions.get_mut(&at) {
                // SAFETY: our mapping.
                unsafe { crate::registry::protect(at, r.size, access) }?;
                r.access = access;
            }
        }
        Ok(())
    }
}
