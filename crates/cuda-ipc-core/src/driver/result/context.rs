use super::*;

/// `cuCtxEnablePeerAccess(peer, 0)` from the current context. Already
/// enabled counts as success, so calling it twice is harmless.
pub(crate) fn enable_peer_access(peer: sys::CUcontext) -> Result<()> {
    // SAFETY: `peer` is a live context held by the caller; flags must be 0.
    let r = unsafe { sys::cuCtxEnablePeerAccess(peer, 0) };
    if r == CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
        return Ok(());
    }
    check("cuCtxEnablePeerAccess", r)
}
