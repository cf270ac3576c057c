//! The driver, the one device and its primary context.

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_uint};
use std::sync::OnceLock;

use cudarc::driver::sys::{
    CUcontext, CUdevice, CUdevice_P2PAttribute, CUdevice_attribute as A, CUuuid,
    cudaError_enum as E,
};

use crate::{Res, ctx_ok, initialised, put};

/// The device's name.
const NAME: &str = "cuda-ipc fake GPU";
/// The device's UUID, the same in every process.
pub(crate) const UUID: [u8; 16] = *b"cuda-ipc-fakeGPU";
/// The device's PCI bus id.
const PCI_BUS_ID: &str = "0000:fa:00.0";
/// The device's memory, in bytes.
pub(crate) const TOTAL_MEMORY: u64 = 16 << 30;
/// The driver version reported: CUDA 13.0.
const DRIVER_VERSION: c_int = 13000;

/// Set by a successful `cuInit`: how many devices are visible (0 or 1).
pub(crate) static INIT: OnceLock<c_int> = OnceLock::new();

/// The primary context: any non-null pointer the fake recognises.
static PRIMARY: u8 = 0;

fn primary() -> CUcontext {
    (&raw const PRIMARY).cast_mut().cast()
}

thread_local! {
    /// The context current on this thread (null or [`PRIMARY`]).
    static CURRENT: Cell<CUcontext> = const { Cell::new(std::ptr::null_mut()) };
}

/// Whether the primary context is current on the calling thread.
pub(crate) fn is_current() -> bool {
    CURRENT.with(|c| c.get() == primary())
}

/// Whether `ctx` is the fake's context.
pub(crate) fn is_context(ctx: CUcontext) -> bool {
    ctx == primary()
}

/// How many devices `CUDA_VISIBLE_DEVICES` leaves visible: the list stops
/// at its first entry that is neither `0` nor this device's UUID (or a
/// prefix of it), as the driver's parsing does.
fn visible_devices() -> c_int {
    let Ok(list) = std::env::var("CUDA_VISIBLE_DEVICES") else {
        return 1;
    };
    let uuid = uuid_text();
    match list.split(',').next().map(str::trim) {
        Some("0") => 1,
        Some(s) if s.len() > 4 && uuid.starts_with(s) => 1,
        _ => 0,
    }
}

/// The UUID as `nvidia-smi` prints it (`GPU-xxxxxxxx-xxxx-...`).
fn uuid_text() -> String {
    let mut s = String::from("GPU-");
    for (i, b) in UUID.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            s.push('-');
        }
        s.push(char::from_digit(u32::from(b >> 4), 16).unwrap_or('0'));
        s.push(char::from_digit(u32::from(b & 15), 16).unwrap_or('0'));
    }
    s
}

/// `Ok` for device 0 when it is visible.
fn check_device(dev: CUdevice) -> Res {
    initialised()?;
    if dev == 0 && INIT.get() == Some(&1) {
        Ok(())
    } else {
        Err(E::CUDA_ERROR_INVALID_DEVICE)
    }
}

/// Copies `text` into the caller's buffer of `len` bytes, NUL-terminated
/// (truncated if needed).
///
/// # Safety
/// `buf` is valid for `len` bytes.
unsafe fn put_str(buf: *mut c_char, len: c_int, text: &str) -> Res {
    if buf.is_null() || len <= 0 {
        return Err(E::CUDA_ERROR_INVALID_VALUE);
    }
    let n = text.len().min(len as usize - 1);
    // SAFETY: `n + 1 <= len` bytes of the caller's buffer.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), buf, n);
        buf.add(n).write(0);
    }
    Ok(())
}

fake! {
    /// `cuInit`: flags must be 0; no visible device is `CUDA_ERROR_NO_DEVICE`.
    fn cuInit(Flags: c_uint) {
        if Flags != 0 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let n = *INIT.get_or_init(visible_devices);
        if n == 0 { Err(E::CUDA_ERROR_NO_DEVICE) } else { Ok(()) }
    }
}

fake! {
    /// `cuDriverGetVersion`: 13000 (CUDA 13.0).
    fn cuDriverGetVersion(driverVersion: *mut c_int) {
        // SAFETY: the caller's out-pointer.
        unsafe { put(driverVersion, DRIVER_VERSION) }
    }
}

fake! {
    /// `cuDeviceGetCount`.
    fn cuDeviceGetCount(count: *mut c_int) {
        initialised()?;
        // SAFETY: the caller's out-pointer.
        unsafe { put(count, *INIT.get().unwrap_or(&0)) }
    }
}

fake! {
    /// `cuDeviceGet`: ordinal 0 only.
    fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int) {
        check_device(ordinal)?;
        // SAFETY: the caller's out-pointer.
        unsafe { put(device, 0) }
    }
}

/// The value of attribute `a`: what makes the library choose each mechanism.
fn attribute(a: A) -> c_int {
    match a {
        A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR => 9,
        A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT => 132,
        A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK
        | A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X
        | A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y => 1024,
        A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z => 64,
        A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X => i32::MAX,
        A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y | A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z => 65535,
        A::CU_DEVICE_ATTRIBUTE_WARP_SIZE => 32,
        A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID => 0xfa,
        A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING
        | A::CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED
        | A::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED
        | A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
        | A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED
        | A::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS
        | A::CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY
        | A::CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS
        | A::CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED
        | A::CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED
        // Pools share as bit 1, POSIX file descriptors (not fabric, bit 8).
        | A::CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES => 1,
        // Everything else (fabric handles, MPS, managed memory, compute
        // mode "default", minor version 0...) is 0.
        _ => 0,
    }
}

fake! {
    /// `cuDeviceGetAttribute`.
    fn cuDeviceGetAttribute(pi: *mut c_int, attrib: A, dev: CUdevice) {
        check_device(dev)?;
        // SAFETY: the caller's out-pointer.
        unsafe { put(pi, attribute(attrib)) }
    }
}

fake! {
    /// `cuDeviceGetName`.
    fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) {
        check_device(dev)?;
        // SAFETY: the caller's buffer of `len` bytes.
        unsafe { put_str(name, len, NAME) }
    }
}

fake! {
    /// `cuDeviceGetUuid_v2`.
    fn cuDeviceGetUuid_v2(uuid: *mut CUuuid, dev: CUdevice) {
        check_device(dev)?;
        let u = CUuuid { bytes: UUID.map(|b| b as c_char) };
        // SAFETY: the caller's out-pointer.
        unsafe { put(uuid, u) }
    }
}

fake! {
    /// `cuDeviceGetPCIBusId`.
    fn cuDeviceGetPCIBusId(pciBusId: *mut c_char, len: c_int, dev: CUdevice) {
        check_device(dev)?;
        // SAFETY: the caller's buffer of `len` bytes.
        unsafe { put_str(pciBusId, len, PCI_BUS_ID) }
    }
}

fake! {
    /// `cuDeviceTotalMem_v2`.
    fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) {
        check_device(dev)?;
        // SAFETY: the caller's out-pointer.
        unsafe { put(bytes, TOTAL_MEMORY as usize) }
    }
}

fake! {
    /// `cuDeviceCanAccessPeer`: one device, so never.
    fn cuDeviceCanAccessPeer(canAccessPeer: *mut c_int, dev: CUdevice, peerDev: CUdevice) {
        check_device(dev)?;
        check_device(peerDev)?;
        // SAFETY: the caller's out-pointer.
        unsafe { put(canAccessPeer, 0) }
    }
}

fake! {
    /// `cuDeviceGetP2PAttribute`: a device and itself is `CUDA_ERROR_INVALID_DEVICE`.
    fn cuDeviceGetP2PAttribute(
        value: *mut c_int,
        attrib: CUdevice_P2PAttribute,
        srcDevice: CUdevice,
        dstDevice: CUdevice,
    ) {
        let _ = (value, attrib);
        check_device(srcDevice)?;
        check_device(dstDevice)?;
        Err(E::CUDA_ERROR_INVALID_DEVICE)
    }
}

fake! {
    /// `cuDevicePrimaryCtxRetain`: the one context (never destroyed).
    fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) {
        check_device(dev)?;
        // SAFETY: the caller's out-pointer.
        unsafe { put(pctx, primary()) }
    }
}

fake! {
    /// `cuDevicePrimaryCtxRelease_v2`: the context stays (its memory with
    /// it), which no test can tell from a context made again.
    fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) {
        check_device(dev)
    }
}

fake! {
    /// `cuCtxSetCurrent`: the fake's context or null.
    fn cuCtxSetCurrent(ctx: CUcontext) {
        initialised()?;
        if !ctx.is_null() && !is_context(ctx) {
            return Err(E::CUDA_ERROR_INVALID_CONTEXT);
        }
        CURRENT.with(|c| c.set(ctx));
        Ok(())
    }
}

fake! {
    /// `cuCtxGetCurrent`.
    fn cuCtxGetCurrent(pctx: *mut CUcontext) {
        initialised()?;
        let ctx = CURRENT.with(Cell::get);
        // SAFETY: the caller's out-pointer.
        unsafe { put(pctx, ctx) }
    }
}

fake! {
    /// `cuCtxGetDevice`.
    fn cuCtxGetDevice(device: *mut CUdevice) {
        ctx_ok()?;
        // SAFETY: the caller's out-pointer.
        unsafe { put(device, 0) }
    }
}

fake! {
    /// `cuCtxSynchronize`: waits for every stream of the process.
    fn cuCtxSynchronize() {
        ctx_ok()?;
        crate::stream::synchronize_all();
        ctx_ok()
    }
}

fake! {
    /// `cuCtxEnablePeerAccess`: there is no other context to reach.
    fn cuCtxEnablePeerAccess(peerContext: CUcontext, Flags: c_uint) {
        ctx_ok()?;
        if Flags != 0 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        if is_context(peerContext) {
            return Err(E::CUDA_ERROR_INVALID_DEVICE);
        }
        Err(E::CUDA_ERROR_INVALID_CONTEXT)
    }
}
