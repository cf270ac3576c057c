//! Plain device memory (`cuMemAlloc`), page-locked and registered host
//! memory, pointer queries, copies and fills.

use std::ffi::{c_uchar, c_uint, c_void};

use cudarc::driver::sys::{
    CUcontext, CUdeviceptr, CUmemorytype, CUpointer_attribute as P, CUstream, cudaError_enum as E,
};
use rustix::mm::{MapFlags, ProtFlags};

use crate::registry::{Access, Kind, Region, assert_unused, registry};
use crate::stream::{Op, Raw, lookup};
use crate::{Res, ctx_ok, put, set_sticky};

/// The size of a mapping of `size` bytes: whole pages.
pub(crate) fn page_round(size: u64) -> u64 {
    size.next_multiple_of(crate::registry::page_size())
}

/// A device range an operation touches: address, length, whether it writes.
pub(crate) type Touch = (u64, u64, bool);

/// Queues `run` on `stream` after checking that every range in `touches`
/// is device memory with the access needed (`CUDA_ERROR_INVALID_VALUE`
/// otherwise, as the driver refuses a copy into read-only memory). When it
/// runs, the ranges are checked again: a range gone bad by then (only a
/// kernel's can) fails the context with `CUDA_ERROR_ILLEGAL_ADDRESS`.
pub(crate) fn queue(
    stream: CUstream,
    what: &'static str,
    touches: Vec<Touch>,
    check_now: bool,
    run: impl FnOnce() + Send + 'static,
) -> Res {
    ctx_ok()?;
    let s = lookup(stream)?;
    if check_now {
        let reg = registry();
        for (addr, len, write) in &touches {
            reg.check(*addr, *len, *write)?;
        }
    }
    let uses = touches.iter().map(|(a, l, _)| (*a, *l)).collect();
    s.push(Op {
        what,
        uses,
        run: Box::new(move || {
            if ctx_ok_anywhere().is_err() {
                return; // the context failed: nothing runs any more
            }
            let ok = {
                let reg = registry();
                touches
                    .iter()
                    .all(|(a, l, w)| reg.check(*a, *l, *w).is_ok())
            };
            if ok {
                run();
            } else {
                eprintln!(
                    "cuda-ipc fake driver: {what} touched memory it may not access (not mapped, or read-only); \
                     the context fails with CUDA_ERROR_ILLEGAL_ADDRESS"
                );
                set_sticky(E::CUDA_ERROR_ILLEGAL_ADDRESS);
            }
        }),
    });
    Ok(())
}

/// `Ok` unless the context failed (on a worker thread, where no context is current).
fn ctx_ok_anywhere() -> Res {
    match ctx_ok() {
        Err(E::CUDA_ERROR_ILLEGAL_ADDRESS) => Err(E::CUDA_ERROR_ILLEGAL_ADDRESS),
        _ => Ok(()),
    }
}

/// Copies `len` bytes; the ranges may overlap.
fn copy(dst: Raw, src: Raw, len: usize) {
    // SAFETY: both ranges were checked (device ranges against the registry
    // just before, host ranges by the caller's contract with the driver).
    unsafe { std::ptr::copy(src.0 as *const u8, dst.0 as *mut u8, len) };
}

fake! {
    /// `cuMemAlloc_v2`: a memfd of its own, mapped read-write.
    fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) {
        ctx_ok()?;
        if bytesize == 0 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let size = page_round(bytesize as u64);
        let mut reg = registry();
        if reg.allocated + size > crate::device::TOTAL_MEMORY {
            return Err(E::CUDA_ERROR_OUT_OF_MEMORY);
        }
        let fd = crate::registry::memfd(size)?;
        let base = crate::registry::map(&fd, size, ProtFlags::READ | ProtFlags::WRITE)?;
        let id = reg.next_id();
        reg.allocated += size;
        reg.regions.insert(base, Region { size, kind: Kind::Alloc { fd, id }, access: Access::ReadWrite });
        // SAFETY: the caller's out-pointer.
        unsafe { put(dptr, base) }
    }
}

fake! {
    /// `cuMemFree_v2`: `dptr` must be what `cuMemAlloc` returned.
    fn cuMemFree_v2(dptr: CUdeviceptr) {
        ctx_ok()?;
        if dptr == 0 {
            return Ok(());
        }
        let mut reg = registry();
        let size = match reg.regions.get(&dptr) {
            Some(Region { size, kind: Kind::Alloc { .. }, .. }) => *size,
            _ => return Err(E::CUDA_ERROR_INVALID_VALUE),
        };
        assert_unused("cuMemFree", "device memory from cuMemAlloc", dptr, size);
        reg.regions.remove(&dptr);
        reg.allocated -= size;
        // SAFETY: our mapping, which no queued work uses (checked above).
        unsafe { crate::registry::unmap(dptr, size) };
        Ok(())
    }
}

fake! {
    /// `cuMemGetInfo_v2`: free is the total less this process's allocations.
    fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) {
        ctx_ok()?;
        let t = crate::device::TOTAL_MEMORY;
        let used = registry().allocated.min(t);
        // SAFETY: the caller's out-pointers.
        unsafe {
            put(free, (t - used) as usize)?;
            put(total, t as usize)
        }
    }
}

fake! {
    /// `cuMemGetAddressRange_v2`: the allocation (or mapping) holding `dptr`.
    fn cuMemGetAddressRange_v2(pbase: *mut CUdeviceptr, psize: *mut usize, dptr: CUdeviceptr) {
        ctx_ok()?;
        let (base, size) = {
            let reg = registry();
            let (base, r) = reg.containing(dptr).ok_or(E::CUDA_ERROR_NOT_FOUND)?;
            (base, r.size)
        };
        // SAFETY: the caller's out-pointers; either may be null.
        unsafe {
            if !pbase.is_null() {
                put(pbase, base)?;
            }
            if !psize.is_null() {
                put(psize, size as usize)?;
            }
        }
        Ok(())
    }
}

fake! {
    /// `cuPointerGetAttribute` for the attributes the library and cudarc
    /// ask for; memory the fake does not know is `CUDA_ERROR_INVALID_VALUE`.
    fn cuPointerGetAttribute(data: *mut c_void, attribute: P, ptr: CUdeviceptr) {
        ctx_ok()?;
        let reg = registry();
        let (base, r) = reg.containing(ptr).ok_or(E::CUDA_ERROR_INVALID_VALUE)?;
        let host = matches!(r.kind, Kind::Host { .. });
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: a valid out-pointer to a local.
        unsafe { crate::device::cuCtxGetCurrent(&raw mut ctx) };
        // SAFETY: the caller's buffer, of the attribute's type.
        unsafe {
            match attribute {
                P::CU_POINTER_ATTRIBUTE_CONTEXT => put(data.cast::<CUcontext>(), ctx),
                P::CU_POINTER_ATTRIBUTE_MEMORY_TYPE => put(
                    data.cast::<c_uint>(),
                    if host { CUmemorytype::CU_MEMORYTYPE_HOST } else { CUmemorytype::CU_MEMORYTYPE_DEVICE } as c_uint,
                ),
                P::CU_POINTER_ATTRIBUTE_DEVICE_POINTER => put(data.cast::<u64>(), ptr),
                P::CU_POINTER_ATTRIBUTE_HOST_POINTER if host => put(data.cast::<u64>(), ptr),
                P::CU_POINTER_ATTRIBUTE_IS_MANAGED => put(data.cast::<c_uint>(), 0),
                P::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL => put(data.cast::<i32>(), 0),
                P::CU_POINTER_ATTRIBUTE_MAPPED => put(data.cast::<c_uint>(), 1),
                P::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE => {
                    put(data.cast::<c_uint>(), c_uint::from(matches!(r.kind, Kind::Alloc { .. })))
                }
                P::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR => put(data.cast::<u64>(), base),
                P::CU_POINTER_ATTRIBUTE_RANGE_SIZE => put(data.cast::<usize>(), r.size as usize),
                P::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE => put(
                    data.cast::<usize>(),
                    match r.kind { Kind::Pool { pool, .. } => pool, _ => 0 },
                ),
                _ => Err(E::CUDA_ERROR_INVALID_VALUE),
            }
        }
    }
}

/// Whether `len` bytes at `p` are page-locked (allocated or registered)
/// host memory: asynchronous copies treat anything else as pageable.
fn page_locked(p: u64, len: u64) -> bool {
    let reg = registry();
    matches!(reg.containing(p), Some((base, Region { size, kind: Kind::Host { .. }, .. })) if p + len <= base + size)
}

fake! {
    /// `cuMemcpyDtoHAsync_v2`: into pageable memory it returns once the
    /// copy is done, as the driver's does (cudarc relies on it).
    fn cuMemcpyDtoHAsync_v2(dstHost: *mut c_void, srcDevice: CUdeviceptr, ByteCount: usize, hStream: CUstream) {
        let (dst, src) = (Raw(dstHost as usize), Raw(srcDevice as usize));
        queue(hStream, "a device-to-host copy", vec![(srcDevice, ByteCount as u64, false)], true, move || {
            copy(dst, src, ByteCount);
        })?;
        if !page_locked(dstHost as u64, ByteCount as u64) {
            lookup(hStream)?.synchronize();
        }
        Ok(())
    }
}

fake! {
    /// `cuMemcpyHtoDAsync_v2`: into read-only memory is
    /// `CUDA_ERROR_INVALID_VALUE`; pageable source bytes are staged at the
    /// call, so the caller may reuse them at once, as with the driver.
    fn cuMemcpyHtoDAsync_v2(dstDevice: CUdeviceptr, srcHost: *const c_void, ByteCount: usize, hStream: CUstream) {
        let dst = Raw(dstDevice as usize);
        let touches = vec![(dstDevice, ByteCount as u64, true)];
        if page_locked(srcHost as u64, ByteCount as u64) {
            let src = Raw(srcHost as usize);
            return queue(hStream, "a host-to-device copy", touches, true, move || copy(dst, src, ByteCount));
        }
        let staged: Vec<u8> = if ByteCount == 0 || srcHost.is_null() {
            Vec::new()
        } else {
            // SAFETY: the caller's `ByteCount` readable bytes.
            unsafe { std::slice::from_raw_parts(srcHost.cast::<u8>(), ByteCount) }.to_vec()
        };
        queue(hStream, "a host-to-device copy", touches, true, move || {
            copy(dst, Raw(staged.as_ptr() as usize), staged.len());
        })
    }
}

fake! {
    /// `cuMemcpyDtoDAsync_v2`.
    fn cuMemcpyDtoDAsync_v2(dstDevice: CUdeviceptr, srcDevice: CUdeviceptr, ByteCount: usize, hStream: CUstream) {
        let (dst, src) = (Raw(dstDevice as usize), Raw(srcDevice as usize));
        let n = ByteCount as u64;
        queue(hStream, "a device-to-device copy", vec![(srcDevice, n, false), (dstDevice, n, true)], true, move || {
            copy(dst, src, ByteCount);
        })
    }
}

fake! {
    /// `cuMemcpyAsync` (unified addressing: either side may be device memory).
    fn cuMemcpyAsync(dst: CUdeviceptr, src: CUdeviceptr, ByteCount: usize, hStream: CUstream) {
        // SAFETY: the same arguments, passed on.
        match unsafe { cuMemcpyDtoDAsync_v2(dst, src, ByteCount, hStream) } {
            E::CUDA_SUCCESS => Ok(()),
            e => Err(e),
        }
    }
}

fake! {
    /// `cuMemcpyPeerAsync`: one device, so a device-to-device copy.
    fn cuMemcpyPeerAsync(
        dstDevice: CUdeviceptr,
        dstContext: CUcontext,
        srcDevice: CUdeviceptr,
        srcContext: CUcontext,
        ByteCount: usize,
        hStream: CUstream,
    ) {
        if !crate::device::is_context(dstContext) || !crate::device::is_context(srcContext) {
            return Err(E::CUDA_ERROR_INVALID_CONTEXT);
        }
        // SAFETY: the same arguments, passed on.
        match unsafe { cuMemcpyDtoDAsync_v2(dstDevice, srcDevice, ByteCount, hStream) } {
            E::CUDA_SUCCESS => Ok(()),
            e => Err(e),
        }
    }
}

/// Queues a fill of `count` elements of `value`'s size.
fn fill<T: Copy + Send + 'static>(
    dst: CUdeviceptr,
    value: T,
    count: usize,
    stream: CUstream,
) -> Res {
    let bytes = (count * size_of::<T>()) as u64;
    if !dst.is_multiple_of(size_of::<T>() as u64) {
        return Err(E::CUDA_ERROR_INVALID_VALUE);
    }
    let at = Raw(dst as usize);
    queue(
        stream,
        "a fill (cuMemsetD*)",
        vec![(dst, bytes, true)],
        true,
        move || {
            // SAFETY: checked device memory of `count` aligned elements.
            let s = unsafe { std::slice::from_raw_parts_mut(at.0 as *mut T, count) };
            s.fill(value);
        },
    )
}

fake! {
    /// `cuMemsetD32Async`.
    fn cuMemsetD32Async(dstDevice: CUdeviceptr, ui: c_uint, N: usize, hStream: CUstream) {
        fill(dstDevice, ui, N, hStream)
    }
}

fake! {
    /// `cuMemsetD8Async`.
    fn cuMemsetD8Async(dstDevice: CUdeviceptr, uc: c_uchar, N: usize, hStream: CUstream) {
        fill(dstDevice, uc, N, hStream)
    }
}

/// Waits for the default stream (the synchronous calls run there).
fn sync_default() -> Res {
    lookup(std::ptr::null_mut())?.synchronize();
    ctx_ok()
}

fake! {
    /// `cuMemsetD8_v2`: on the default stream, waited for.
    fn cuMemsetD8_v2(dstDevice: CUdeviceptr, uc: c_uchar, N: usize) {
        fill(dstDevice, uc, N, std::ptr::null_mut())?;
        sync_default()
    }
}

fake! {
    /// `cuMemcpyHtoD_v2`: on the default stream, waited for.
    fn cuMemcpyHtoD_v2(dstDevice: CUdeviceptr, srcHost: *const c_void, ByteCount: usize) {
        // SAFETY: the same arguments, passed on.
        match unsafe { cuMemcpyHtoDAsync_v2(dstDevice, srcHost, ByteCount, std::ptr::null_mut()) } {
            E::CUDA_SUCCESS => sync_default(),
            e => Err(e),
        }
    }
}

fake! {
    /// `cuMemcpyDtoH_v2`: on the default stream, waited for.
    fn cuMemcpyDtoH_v2(dstHost: *mut c_void, srcDevice: CUdeviceptr, ByteCount: usize) {
        // SAFETY: the same arguments, passed on.
        match unsafe { cuMemcpyDtoHAsync_v2(dstHost, srcDevice, ByteCount, std::ptr::null_mut()) } {
            E::CUDA_SUCCESS => sync_default(),
            e => Err(e),
        }
    }
}

fake! {
    /// `cuMemHostAlloc`: anonymous host pages the device may use.
    fn cuMemHostAlloc(pp: *mut *mut c_void, bytesize: usize, Flags: c_uint) {
        ctx_ok()?;
        let _ = Flags;
        if bytesize == 0 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let size = page_round(bytesize as u64);
        // SAFETY: a new mapping at an address the kernel picks.
        let p = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                size as usize,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
            )
        }
        .map_err(|_| E::CUDA_ERROR_OUT_OF_MEMORY)?;
        registry().regions.insert(p as u64, Region { size, kind: Kind::Host { owned: true }, access: Access::ReadWrite });
        // SAFETY: the caller's out-pointer.
        unsafe { put(pp, p) }
    }
}

fake! {
    /// `cuMemFreeHost`.
    fn cuMemFreeHost(p: *mut c_void) {
        ctx_ok()?;
        let mut reg = registry();
        let size = match reg.regions.get(&(p as u64)) {
            Some(Region { size, kind: Kind::Host { owned: true }, .. }) => *size,
            _ => return Err(E::CUDA_ERROR_INVALID_VALUE),
        };
        assert_unused("cuMemFreeHost", "page-locked host memory", p as u64, size);
        reg.regions.remove(&(p as u64));
        // SAFETY: our mapping, unused (checked above).
        unsafe { crate::registry::unmap(p as u64, size) };
        Ok(())
    }
}

fake! {
    /// `cuMemHostRegister_v2`: the range becomes device memory at the same address.
    fn cuMemHostRegister_v2(p: *mut c_void, bytesize: usize, Flags: c_uint) {
        ctx_ok()?;
        let _ = Flags;
        let (base, size) = (p as u64, bytesize as u64);
        if p.is_null() || size == 0 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let mut reg = registry();
        let taken = reg.containing(base).is_some()
            || reg.regions.range(base..base + size).next().is_some();
        if taken {
            return Err(E::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
        }
        reg.regions.insert(base, Region { size, kind: Kind::Host { owned: false }, access: Access::ReadWrite });
        Ok(())
    }
}

fake! {
    /// `cuMemHostUnregister`.
    fn cuMemHostUnregister(p: *mut c_void) {
        ctx_ok()?;
        let mut reg = registry();
        let size = match reg.regions.get(&(p as u64)) {
            Some(Region { size, kind: Kind::Host { owned: false }, .. }) => *size,
            _ => return Err(E::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED),
        };
        assert_unused("cuMemHostUnregister", "registered host memory", p as u64, size);
        reg.regions.remove(&(p as u64));
        Ok(())
    }
}

fake! {
    /// `cuMemHostGetDevicePointer_v2`: the same address, for registered or
    /// page-locked host memory.
    fn cuMemHostGetDevicePointer_v2(pdptr: *mut CUdeviceptr, p: *mut c_void, Flags: c_uint) {
        ctx_ok()?;
        if Flags != 0 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        match registry().containing(p as u64) {
            Some((_, Region { kind: Kind::Host { .. }, .. })) => {}
            _ => return Err(E::CUDA_ERROR_INVALID_VALUE),
        }
        // SAFETY: the caller's out-pointer.
        unsafe { put(pdptr, p as u64) }
    }
}
