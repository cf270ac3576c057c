use super::*;

/// `cuModuleLoadData` on NUL-terminated PTX text.
pub(crate) fn load_ptx(ptx: &std::ffi::CStr) -> Result<sys::CUmodule> {
    let mut m = std::ptr::null_mut();
    // SAFETY: `ptx` is NUL-terminated and lives for the call.
    check("cuModuleLoadData", unsafe {
        sys::cuModuleLoadData(&raw mut m, ptx.as_ptr().cast())
    })?;
    Ok(m)
}

/// `cuModuleGetFunction`.
///
/// # Safety
/// The module must be live.
pub(crate) unsafe fn function(m: sys::CUmodule, name: &std::ffi::CStr) -> Result<sys::CUfunction> {
    let mut f = std::ptr::null_mut();
    // SAFETY: the caller's contract; `name` is NUL-terminated.
    check("cuModuleGetFunction", unsafe {
        sys::cuModuleGetFunction(&raw mut f, m, name.as_ptr())
    })?;
    Ok(f)
}

/// `cuModuleUnload`.
///
/// # Safety
/// The module must be live and unused afterwards.
pub(crate) unsafe fn unload(m: sys::CUmodule) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuModuleUnload", unsafe { sys::cuModuleUnload(m) })
}

/// `cuLaunchKernel` with a 1-D grid.
///
/// # Safety
/// `params` must match the kernel's parameter list and every pointer in
/// them must stay valid until the call returns; memory the kernel touches
/// must stay valid until the stream has passed it.
pub(crate) unsafe fn launch(
    f: sys::CUfunction,
    grid: u32,
    block: u32,
    stream: sys::CUstream,
    params: &mut [*mut c_void],
) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuLaunchKernel", unsafe {
        sys::cuLaunchKernel(
            f,
            grid,
            1,
            1,
            block,
            1,
            1,
            0,
            stream,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    })
}
