use super::*;

/// `cuInit(0)`.
pub(crate) fn init() -> Result<()> {
    // SAFETY: cuInit takes no pointers; the symbol was checked at load.
    check("cuInit", unsafe { sys::cuInit(0) })
}

/// `cuDriverGetVersion`.
pub(crate) fn version() -> Result<i32> {
    let mut v = 0;
    // SAFETY: `v` is a valid out-pointer for the duration of the call.
    check("cuDriverGetVersion", unsafe {
        sys::cuDriverGetVersion(&raw mut v)
    })?;
    Ok(v)
}
