use super::*;
use crate::handle::{IpcEventHandle, IpcMemHandle};

/// `cuIpcGetMemHandle`.
pub(crate) fn get_mem_handle(ptr: u64) -> Result<IpcMemHandle> {
    let mut h = MaybeUninit::<sys::CUipcMemHandle>::uninit();
    // SAFETY: valid out-pointer; the driver validates `ptr`.
    check("cuIpcGetMemHandle", unsafe {
        sys::cuIpcGetMemHandle(h.as_mut_ptr(), ptr)
    })?;
    // SAFETY: initialised by the successful call.
    Ok(IpcMemHandle::from_sys(unsafe { h.assume_init() }))
}

/// `cuIpcOpenMemHandle_v2`.
pub(crate) fn open_mem_handle(handle: IpcMemHandle, flags: u32) -> Result<u64> {
    let mut p = 0;
    // SAFETY: valid out-pointer; the handle is passed by value.
    check("cuIpcOpenMemHandle", unsafe {
        sys::cuIpcOpenMemHandle_v2(&raw mut p, handle.to_sys(), flags)
    })?;
    Ok(p)
}

/// `cuIpcCloseMemHandle`.
///
/// # Safety
/// `ptr` must come from `cuIpcOpenMemHandle` and no work may still use it.
pub(crate) unsafe fn close_mem_handle(ptr: u64) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuIpcCloseMemHandle", unsafe {
        sys::cuIpcCloseMemHandle(ptr)
    })
}

/// `cuIpcGetEventHandle`.
///
/// # Safety
/// `event` must be live.
pub(crate) unsafe fn get_event_handle(event: sys::CUevent) -> Result<IpcEventHandle> {
    let mut h = MaybeUninit::<sys::CUipcEventHandle>::uninit();
    // SAFETY: valid out-pointer; the caller's contract for `event`.
    check("cuIpcGetEventHandle", unsafe {
        sys::cuIpcGetEventHandle(h.as_mut_ptr(), event)
    })?;
    // SAFETY: initialised by the successful call.
    Ok(IpcEventHandle::from_sys(unsafe { h.assume_init() }))
}

/// `cuIpcOpenEventHandle`.
pub(crate) fn open_event_handle(handle: IpcEventHandle) -> Result<sys::CUevent> {
    let mut e = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the handle is passed by value.
    check("cuIpcOpenEventHandle", unsafe {
        sys::cuIpcOpenEventHandle(&raw mut e, handle.to_sys())
    })?;
    Ok(e)
}
