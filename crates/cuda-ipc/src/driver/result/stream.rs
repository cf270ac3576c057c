use super::*;

/// `cuStreamWaitEvent`.
///
/// # Safety
/// Both handles must be live.
pub(crate) unsafe fn wait_event(stream: sys::CUstream, event: sys::CUevent) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuStreamWaitEvent", unsafe {
        sys::cuStreamWaitEvent(stream, event, 0)
    })
}

/// `cuStreamSynchronize`.
///
/// # Safety
/// The stream must be live.
pub(crate) unsafe fn synchronize(stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuStreamSynchronize", unsafe {
        sys::cuStreamSynchronize(stream)
    })
}
