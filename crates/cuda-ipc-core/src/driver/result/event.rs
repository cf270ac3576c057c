use super::*;

/// `cuEventCreate`.
pub(crate) fn create(flags: u32) -> Result<sys::CUevent> {
    let mut e = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    check("cuEventCreate", unsafe {
        sys::cuEventCreate(&raw mut e, flags)
    })?;
    Ok(e)
}

/// `cuEventRecord`.
///
/// # Safety
/// Both handles must be live.
pub(crate) unsafe fn record(event: sys::CUevent, stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuEventRecord", unsafe {
        sys::cuEventRecord(event, stream)
    })
}

/// `cuEventSynchronize`.
///
/// # Safety
/// The event must be live.
pub(crate) unsafe fn synchronize(event: sys::CUevent) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuEventSynchronize", unsafe {
        sys::cuEventSynchronize(event)
    })
}

/// `cuEventQuery`: `Ok(true)` when complete, `Ok(false)` when not ready.
///
/// # Safety
/// The event must be live.
pub(crate) unsafe fn query(event: sys::CUevent) -> Result<bool> {
    // SAFETY: the caller's contract.
    ready("cuEventQuery", unsafe { sys::cuEventQuery(event) })
}

/// `cuEventDestroy_v2`.
///
/// # Safety
/// The event must be live and not used afterwards.
pub(crate) unsafe fn destroy(event: sys::CUevent) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuEventDestroy", unsafe { sys::cuEventDestroy_v2(event) })
}
