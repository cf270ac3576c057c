use super::*;

/// `cuMemAlloc_v2`.
pub(crate) fn alloc(bytes: usize) -> Result<u64> {
    let mut p = 0;
    // SAFETY: valid out-pointer.
    check("cuMemAlloc", unsafe {
        sys::cuMemAlloc_v2(&raw mut p, bytes)
    })?;
    Ok(p)
}

/// `cuMemFree_v2`.
///
/// # Safety
/// `ptr` must come from `cuMemAlloc` and no work may still use it.
pub(crate) unsafe fn free(ptr: u64) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuMemFree", unsafe { sys::cuMemFree_v2(ptr) })
}

/// `cuMemGetInfo_v2`: (free, total) bytes of the current context's device.
pub(crate) fn info() -> Result<(u64, u64)> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: valid out-pointers.
    check("cuMemGetInfo", unsafe {
        sys::cuMemGetInfo_v2(&raw mut free, &raw mut total)
    })?;
    Ok((free as u64, total as u64))
}

/// `cuMemGetAddressRange_v2`: (base, size) of the allocation holding `ptr`.
pub(crate) fn address_range(ptr: u64) -> Result<(u64, u64)> {
    let (mut base, mut size) = (0u64, 0usize);
    // SAFETY: valid out-pointers; the driver validates `ptr`.
    check("cuMemGetAddressRange", unsafe {
        sys::cuMemGetAddressRange_v2(&raw mut base, &raw mut size, ptr)
    })?;
    Ok((base, size as u64))
}

/// `cuPointerGetAttribute` for attributes whose value is a 64-bit integer or pointer.
pub(crate) fn pointer_attribute_u64(ptr: u64, attr: sys::CUpointer_attribute) -> Result<u64> {
    let mut v: u64 = 0;
    // SAFETY: every attribute we ask for this way writes at most 8 bytes.
    check("cuPointerGetAttribute", unsafe {
        sys::cuPointerGetAttribute((&raw mut v).cast::<c_void>(), attr, ptr)
    })?;
    Ok(v)
}

/// `cuPointerGetAttribute` for attributes whose value is a 32-bit integer.
pub(crate) fn pointer_attribute_u32(ptr: u64, attr: sys::CUpointer_attribute) -> Result<u32> {
    let mut v: u32 = 0;
    // SAFETY: the attribute writes 4 bytes.
    check("cuPointerGetAttribute", unsafe {
        sys::cuPointerGetAttribute((&raw mut v).cast::<c_void>(), attr, ptr)
    })?;
    Ok(v)
}

/// `cuMemcpyDtoHAsync_v2`.
///
/// # Safety
/// `src..src+len` must be device memory and `dst` valid for `len` bytes
/// until the stream has passed this copy.
pub unsafe fn copy_dtoh_async(
    dst: *mut c_void,
    src: u64,
    len: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuMemcpyDtoHAsync", unsafe {
        sys::cuMemcpyDtoHAsync_v2(dst, src, len, stream)
    })
}

/// `cuMemcpyHtoDAsync_v2`.
///
/// # Safety
/// As `copy_dtoh_async`, the other way round.
pub unsafe fn copy_htod_async(
    dst: u64,
    src: *const c_void,
    len: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuMemcpyHtoDAsync", unsafe {
        sys::cuMemcpyHtoDAsync_v2(dst, src, len, stream)
    })
}

/// `cuMemHostAlloc` with no flags: `len` bytes of page-locked host memory
/// for this context, which asynchronous copies read without a bounce.
#[doc(alias = "cuMemHostAlloc")]
pub fn host_alloc(len: usize) -> Result<*mut c_void> {
    let mut p = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    check("cuMemHostAlloc", unsafe {
        sys::cuMemHostAlloc(&raw mut p, len, 0)
    })?;
    Ok(p)
}

/// `cuMemFreeHost`.
///
/// # Safety
/// `ptr` must come from [`host_alloc`], freed once, and no queued work may
/// still use it.
#[doc(alias = "cuMemFreeHost")]
pub unsafe fn host_free(ptr: *mut c_void) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuMemFreeHost", unsafe { sys::cuMemFreeHost(ptr) })
}

/// `cuMemcpyDtoDAsync_v2`.
///
/// # Safety
/// Both ranges must be device memory of at least `len` bytes.
pub(crate) unsafe fn copy_dtod_async(
    dst: u64,
    src: u64,
    len: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuMemcpyDtoDAsync", unsafe {
        sys::cuMemcpyDtoDAsync_v2(dst, src, len, stream)
    })
}

/// `cuMemcpyPeerAsync`: copies between the memory of two contexts.
///
/// # Safety
/// Both ranges must be device memory of their contexts, of at least `len` bytes.
pub(crate) unsafe fn copy_peer_async(
    dst: u64,
    dst_ctx: sys::CUcontext,
    src: u64,
    src_ctx: sys::CUcontext,
    len: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuMemcpyPeerAsync", unsafe {
        sys::cuMemcpyPeerAsync(dst, dst_ctx, src, src_ctx, len, stream)
    })
}

/// `cuMemsetD32Async`.
///
/// # Safety
/// `dst` must be 4-byte aligned device memory of at least `4 * count` bytes.
pub(crate) unsafe fn set_d32_async(
    dst: u64,
    value: u32,
    count: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuMemsetD32Async", unsafe {
        sys::cuMemsetD32Async(dst, value, count, stream)
    })
}
