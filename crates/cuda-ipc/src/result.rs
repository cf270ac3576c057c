//! Checked driver calls: one function per C call, grouped by area, each
//! returning `Result<_, Error>` with the C function's name in the error.
//!
//! This is the only module besides `driver` that touches
//! `cudarc::driver::sys`. Callers must have made a context current on the
//! thread (`Device::bind`) and must have loaded the driver
//! (`driver::load`), which checks that every symbol used here exists, so
//! that no call can panic on a missing symbol.
#![allow(unsafe_code)]
// Each area is a submodule of this one file and uses all of its imports.
#![allow(clippy::wildcard_imports)]

use std::ffi::c_void;
use std::mem::MaybeUninit;

use cudarc::driver::sys::{self, CUresult};

use crate::error::{Result, driver_error};

/// Turns a `CUresult` into our `Result`, naming the call.
#[inline]
pub(crate) fn check(call: &'static str, r: CUresult) -> Result<()> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(driver_error(call, r))
    }
}

/// Every driver symbol this crate calls, checked once at load time.
pub(crate) const SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDeviceGetName",
    "cuDeviceGetUuid_v2",
    "cuDeviceGetPCIBusId",
    "cuDeviceTotalMem_v2",
    "cuDeviceCanAccessPeer",
    "cuDeviceGetP2PAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuCtxGetCurrent",
    "cuCtxSynchronize",
    "cuCtxEnablePeerAccess",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemGetInfo_v2",
    "cuMemGetAddressRange_v2",
    "cuPointerGetAttribute",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemsetD32Async",
    "cuMemcpyPeerAsync",
    "cuEventElapsedTime_v2",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
    "cuIpcGetEventHandle",
    "cuIpcOpenEventHandle",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuEventQuery",
    "cuEventDestroy_v2",
    "cuMemGetAllocationGranularity",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemRetainAllocationHandle",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemPoolCreate",
    "cuMemPoolDestroy",
    "cuMemPoolExportToShareableHandle",
    "cuMemPoolImportFromShareableHandle",
    "cuMemPoolExportPointer",
    "cuMemPoolImportPointer",
    "cuMemPoolSetAccess",
    "cuMemPoolGetAccess",
    "cuMemPoolTrimTo",
    "cuMemAllocFromPoolAsync",
    "cuMemFreeAsync",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
];

/// Driver-wide calls.
pub(crate) mod driver {
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
}

/// Device queries; none needs a current context.
pub(crate) mod device {
    use super::*;
    pub(crate) use sys::CUdevice_attribute as Attr;

    /// `cuDeviceGetCount`.
    pub(crate) fn count() -> Result<usize> {
        let mut n = 0;
        // SAFETY: valid out-pointer.
        check("cuDeviceGetCount", unsafe {
            sys::cuDeviceGetCount(&raw mut n)
        })?;
        Ok(n.max(0) as usize)
    }

    /// `cuDeviceGet`.
    pub(crate) fn get(ordinal: usize) -> Result<sys::CUdevice> {
        let mut d = 0;
        // SAFETY: valid out-pointer; the driver checks the ordinal.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&raw mut d, ordinal as i32)
        })?;
        Ok(d)
    }

    /// `cuDeviceGetAttribute`.
    pub(crate) fn attribute(dev: sys::CUdevice, attr: Attr) -> Result<i32> {
        let mut v = 0;
        // SAFETY: valid out-pointer; `dev` came from cuDeviceGet.
        check("cuDeviceGetAttribute", unsafe {
            sys::cuDeviceGetAttribute(&raw mut v, attr, dev)
        })?;
        Ok(v)
    }

    /// `cuDeviceGetName`.
    pub(crate) fn name(dev: sys::CUdevice) -> Result<String> {
        let mut buf = [0 as std::ffi::c_char; 256];
        // SAFETY: the buffer's length is passed; the driver NUL-terminates.
        check("cuDeviceGetName", unsafe {
            sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, dev)
        })?;
        Ok(c_chars_to_string(&buf))
    }

    /// `cuDeviceGetUuid_v2`.
    pub(crate) fn uuid(dev: sys::CUdevice) -> Result<[u8; 16]> {
        let mut u = MaybeUninit::<sys::CUuuid>::uninit();
        // SAFETY: valid out-pointer, initialised by the call on success.
        check("cuDeviceGetUuid", unsafe {
            sys::cuDeviceGetUuid_v2(u.as_mut_ptr(), dev)
        })?;
        // SAFETY: the call succeeded, so `u` is initialised.
        let u = unsafe { u.assume_init() };
        Ok(u.bytes.map(|c| c as u8))
    }

    /// `cuDeviceGetPCIBusId`.
    pub(crate) fn pci_bus_id(dev: sys::CUdevice) -> Result<String> {
        let mut buf = [0 as std::ffi::c_char; 64];
        // SAFETY: the buffer's length is passed; the driver NUL-terminates.
        check("cuDeviceGetPCIBusId", unsafe {
            sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, dev)
        })?;
        Ok(c_chars_to_string(&buf))
    }

    /// `cuDeviceTotalMem_v2`.
    pub(crate) fn total_mem(dev: sys::CUdevice) -> Result<u64> {
        let mut n = 0usize;
        // SAFETY: valid out-pointer.
        check("cuDeviceTotalMem", unsafe {
            sys::cuDeviceTotalMem_v2(&raw mut n, dev)
        })?;
        Ok(n as u64)
    }

    /// `cuDeviceCanAccessPeer`.
    pub(crate) fn can_access_peer(dev: sys::CUdevice, peer: sys::CUdevice) -> Result<bool> {
        let mut v = 0;
        // SAFETY: valid out-pointer.
        check("cuDeviceCanAccessPeer", unsafe {
            sys::cuDeviceCanAccessPeer(&raw mut v, dev, peer)
        })?;
        Ok(v != 0)
    }

    /// `cuDeviceGetP2PAttribute`.
    pub(crate) fn p2p_attribute(
        attr: sys::CUdevice_P2PAttribute,
        src: sys::CUdevice,
        dst: sys::CUdevice,
    ) -> Result<i32> {
        let mut v = 0;
        // SAFETY: valid out-pointer.
        check("cuDeviceGetP2PAttribute", unsafe {
            sys::cuDeviceGetP2PAttribute(&raw mut v, attr, src, dst)
        })?;
        Ok(v)
    }

    fn c_chars_to_string(buf: &[std::ffi::c_char]) -> String {
        let bytes: Vec<u8> = buf
            .iter()
            .take_while(|c| **c != 0)
            .map(|c| *c as u8)
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// Context-wide calls; the context to act on must be current.
pub(crate) mod context {
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
}

/// Plain device memory.
pub(crate) mod mem {
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
    pub(crate) unsafe fn copy_dtoh_async(
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
    /// As [`copy_dtoh_async`], the other way round.
    pub(crate) unsafe fn copy_htod_async(
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
}

/// Streams (those we do not reach through cudarc).
pub(crate) mod stream {
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
}

/// Legacy IPC.
pub(crate) mod ipc {
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
}

/// Events.
pub(crate) mod event {
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
        match unsafe { sys::cuEventQuery(event) } {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => Err(driver_error("cuEventQuery", r)),
        }
    }

    /// `cuEventDestroy_v2`.
    ///
    /// # Safety
    /// The event must be live and not used afterwards.
    pub(crate) unsafe fn destroy(event: sys::CUevent) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuEventDestroy", unsafe { sys::cuEventDestroy_v2(event) })
    }
}

/// Virtual memory management (cuMem* with physical handles).
pub(crate) mod vmm {
    use super::*;
    use crate::handle::FabricHandle;
    use std::os::fd::{FromRawFd, OwnedFd};

    pub(crate) use sys::CUmemAllocationHandleType as HandleType;

    /// Properties of pinned device memory on `device` with the given shareable handle types.
    pub(crate) fn device_prop(device: i32, handle_types: HandleType) -> sys::CUmemAllocationProp {
        // SAFETY: the struct is plain data for which all zeroes is the documented default.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.requestedHandleTypes = handle_types;
        prop.location = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device,
        };
        prop
    }

    /// `cuMemGetAllocationGranularity` (recommended granularity).
    pub(crate) fn granularity(prop: &sys::CUmemAllocationProp) -> Result<u64> {
        let mut g = 0usize;
        // SAFETY: valid pointers for the call.
        check("cuMemGetAllocationGranularity", unsafe {
            sys::cuMemGetAllocationGranularity(
                &raw mut g,
                prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
        })?;
        Ok(g as u64)
    }

    /// `cuMemCreate`.
    pub(crate) fn create(
        size: u64,
        prop: &sys::CUmemAllocationProp,
    ) -> Result<sys::CUmemGenericAllocationHandle> {
        let mut h = 0;
        // SAFETY: valid pointers for the call.
        check("cuMemCreate", unsafe {
            sys::cuMemCreate(&raw mut h, size as usize, prop, 0)
        })?;
        Ok(h)
    }

    /// `cuMemRelease`.
    ///
    /// # Safety
    /// `h` must come from `cuMemCreate` or an import, released once.
    pub(crate) unsafe fn release(h: sys::CUmemGenericAllocationHandle) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemRelease", unsafe { sys::cuMemRelease(h) })
    }

    /// `cuMemRetainAllocationHandle`: the physical allocation mapped at `ptr`
    /// (released with [`release`]).
    pub(crate) fn retain_allocation_handle(ptr: u64) -> Result<sys::CUmemGenericAllocationHandle> {
        let mut h = 0;
        // SAFETY: valid out-pointer; the driver validates the address.
        check("cuMemRetainAllocationHandle", unsafe {
            sys::cuMemRetainAllocationHandle(&raw mut h, ptr as usize as *mut c_void)
        })?;
        Ok(h)
    }

    /// `cuMemExportToShareableHandle` as a POSIX file descriptor, owned by the caller.
    pub(crate) fn export_fd(h: sys::CUmemGenericAllocationHandle) -> Result<OwnedFd> {
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: for POSIX_FILE_DESCRIPTOR the driver writes an int.
        check("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                (&raw mut fd).cast::<c_void>(),
                h,
                HandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        // SAFETY: on success the driver returns a new descriptor that we now own.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// `cuMemExportToShareableHandle` as a fabric handle.
    pub(crate) fn export_fabric(h: sys::CUmemGenericAllocationHandle) -> Result<FabricHandle> {
        let mut out = MaybeUninit::<sys::CUmemFabricHandle>::uninit();
        // SAFETY: for FABRIC the driver writes a CUmemFabricHandle.
        check("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                out.as_mut_ptr().cast::<c_void>(),
                h,
                HandleType::CU_MEM_HANDLE_TYPE_FABRIC,
                0,
            )
        })?;
        // SAFETY: initialised by the successful call.
        Ok(FabricHandle::from_sys(unsafe { out.assume_init() }))
    }

    /// `cuMemImportFromShareableHandle` from a POSIX file descriptor.
    ///
    /// The driver does not take the descriptor: the caller still owns and closes it.
    pub(crate) fn import_fd(
        fd: std::os::fd::BorrowedFd<'_>,
    ) -> Result<sys::CUmemGenericAllocationHandle> {
        use std::os::fd::AsRawFd;
        let mut h = 0;
        // SAFETY: for POSIX_FILE_DESCRIPTOR the "handle" is the int itself, passed as a pointer-sized value.
        check("cuMemImportFromShareableHandle", unsafe {
            sys::cuMemImportFromShareableHandle(
                &raw mut h,
                fd.as_raw_fd() as usize as *mut c_void,
                HandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        Ok(h)
    }

    /// `cuMemImportFromShareableHandle` from a fabric handle.
    pub(crate) fn import_fabric(handle: FabricHandle) -> Result<sys::CUmemGenericAllocationHandle> {
        let mut h = 0;
        let mut data = handle.to_sys();
        // SAFETY: for FABRIC the handle argument points at a CUmemFabricHandle.
        check("cuMemImportFromShareableHandle", unsafe {
            sys::cuMemImportFromShareableHandle(
                &raw mut h,
                (&raw mut data).cast::<c_void>(),
                HandleType::CU_MEM_HANDLE_TYPE_FABRIC,
            )
        })?;
        Ok(h)
    }

    /// `cuMemAddressReserve`.
    pub(crate) fn address_reserve(size: u64, alignment: u64) -> Result<u64> {
        let mut p = 0;
        // SAFETY: valid out-pointer.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&raw mut p, size as usize, alignment as usize, 0, 0)
        })?;
        Ok(p)
    }

    /// `cuMemAddressFree`.
    ///
    /// # Safety
    /// The range must come from `cuMemAddressReserve` and be unmapped.
    pub(crate) unsafe fn address_free(ptr: u64, size: u64) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemAddressFree", unsafe {
            sys::cuMemAddressFree(ptr, size as usize)
        })
    }

    /// `cuMemMap`.
    ///
    /// # Safety
    /// `ptr..ptr+size` must be a reserved, unmapped range.
    pub(crate) unsafe fn map(
        ptr: u64,
        size: u64,
        h: sys::CUmemGenericAllocationHandle,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemMap", unsafe {
            sys::cuMemMap(ptr, size as usize, 0, h, 0)
        })
    }

    /// `cuMemUnmap`.
    ///
    /// # Safety
    /// The range must be mapped and no work may still use it.
    pub(crate) unsafe fn unmap(ptr: u64, size: u64) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemUnmap", unsafe { sys::cuMemUnmap(ptr, size as usize) })
    }

    /// `cuMemSetAccess`, read-write for each listed device.
    ///
    /// # Safety
    /// The range must be mapped.
    pub(crate) unsafe fn set_access_rw(ptr: u64, size: u64, devices: &[i32]) -> Result<()> {
        let descs: Vec<sys::CUmemAccessDesc> = devices.iter().map(|d| access_rw(*d)).collect();
        // SAFETY: `descs` lives for the call; the caller's contract for the range.
        check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(ptr, size as usize, descs.as_ptr(), descs.len())
        })
    }

    /// A read-write access descriptor for `device`.
    pub(crate) fn access_rw(device: i32) -> sys::CUmemAccessDesc {
        sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: device,
            },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        }
    }
}

/// Stream-ordered memory pools.
pub(crate) mod pool {
    use super::*;
    use crate::handle::PoolPtrHandle;
    use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

    /// `cuMemPoolCreate` for device memory shareable as POSIX file descriptors.
    pub(crate) fn create(device: i32, max_size: u64) -> Result<sys::CUmemoryPool> {
        // SAFETY: plain data for which all zeroes is the documented default.
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.handleTypes =
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        props.location = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device,
        };
        props.maxSize = max_size as usize;
        let mut pool = std::ptr::null_mut();
        // SAFETY: valid pointers for the call.
        check("cuMemPoolCreate", unsafe {
            sys::cuMemPoolCreate(&raw mut pool, &raw const props)
        })?;
        Ok(pool)
    }

    /// `cuMemPoolDestroy`.
    ///
    /// # Safety
    /// The pool must be live and not used afterwards.
    pub(crate) unsafe fn destroy(pool: sys::CUmemoryPool) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemPoolDestroy", unsafe { sys::cuMemPoolDestroy(pool) })
    }

    /// `cuMemPoolTrimTo`.
    ///
    /// # Safety
    /// The pool must be live.
    pub(crate) unsafe fn trim_to(pool: sys::CUmemoryPool, keep: u64) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemPoolTrimTo", unsafe {
            sys::cuMemPoolTrimTo(pool, keep as usize)
        })
    }

    /// `cuMemPoolExportToShareableHandle` as a POSIX file descriptor, owned by the caller.
    ///
    /// # Safety
    /// The pool must be live.
    pub(crate) unsafe fn export_fd(pool: sys::CUmemoryPool) -> Result<OwnedFd> {
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: for POSIX_FILE_DESCRIPTOR the driver writes an int.
        check("cuMemPoolExportToShareableHandle", unsafe {
            sys::cuMemPoolExportToShareableHandle(
                (&raw mut fd).cast::<c_void>(),
                pool,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        // SAFETY: a new descriptor that we now own.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// `cuMemPoolImportFromShareableHandle`. The caller keeps owning `fd`.
    pub(crate) fn import_fd(fd: BorrowedFd<'_>) -> Result<sys::CUmemoryPool> {
        let mut pool = std::ptr::null_mut();
        // SAFETY: for POSIX_FILE_DESCRIPTOR the handle is the int itself.
        check("cuMemPoolImportFromShareableHandle", unsafe {
            sys::cuMemPoolImportFromShareableHandle(
                &raw mut pool,
                fd.as_raw_fd() as usize as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        Ok(pool)
    }

    /// `cuMemPoolSetAccess`, read-write for `device`.
    ///
    /// # Safety
    /// The pool must be live.
    pub(crate) unsafe fn set_access_rw(pool: sys::CUmemoryPool, device: i32) -> Result<()> {
        let desc = super::vmm::access_rw(device);
        // SAFETY: `desc` lives for the call; the caller's contract.
        check("cuMemPoolSetAccess", unsafe {
            sys::cuMemPoolSetAccess(pool, &raw const desc, 1)
        })
    }

    /// `cuMemPoolGetAccess`: whether `device` has read-write access to the pool.
    ///
    /// # Safety
    /// The pool must be live.
    pub(crate) unsafe fn has_access_rw(pool: sys::CUmemoryPool, device: i32) -> Result<bool> {
        let mut location = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device,
        };
        let mut flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE;
        // SAFETY: valid pointers for the call; the caller's contract.
        check("cuMemPoolGetAccess", unsafe {
            sys::cuMemPoolGetAccess(&raw mut flags, pool, &raw mut location)
        })?;
        Ok(flags == sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    }

    /// `cuMemAllocFromPoolAsync`.
    ///
    /// # Safety
    /// Pool and stream must be live.
    pub(crate) unsafe fn alloc_async(
        size: u64,
        pool: sys::CUmemoryPool,
        stream: sys::CUstream,
    ) -> Result<u64> {
        let mut p = 0;
        // SAFETY: valid out-pointer; the caller's contract.
        check("cuMemAllocFromPoolAsync", unsafe {
            sys::cuMemAllocFromPoolAsync(&raw mut p, size as usize, pool, stream)
        })?;
        Ok(p)
    }

    /// `cuMemFreeAsync`.
    ///
    /// # Safety
    /// `ptr` must be a live pool allocation (or an imported one) not used by later work.
    pub(crate) unsafe fn free_async(ptr: u64, stream: sys::CUstream) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemFreeAsync", unsafe {
            sys::cuMemFreeAsync(ptr, stream)
        })
    }

    /// `cuMemPoolExportPointer`.
    pub(crate) fn export_pointer(ptr: u64) -> Result<PoolPtrHandle> {
        let mut d = MaybeUninit::<sys::CUmemPoolPtrExportData>::uninit();
        // SAFETY: valid out-pointer; the driver validates `ptr`.
        check("cuMemPoolExportPointer", unsafe {
            sys::cuMemPoolExportPointer(d.as_mut_ptr(), ptr)
        })?;
        // SAFETY: initialised by the successful call.
        Ok(PoolPtrHandle::from_sys(unsafe { d.assume_init() }))
    }

    /// `cuMemPoolImportPointer`.
    ///
    /// # Safety
    /// The pool must be live (imported).
    pub(crate) unsafe fn import_pointer(
        pool: sys::CUmemoryPool,
        data: PoolPtrHandle,
    ) -> Result<u64> {
        let mut p = 0;
        let mut d = data.to_sys();
        // SAFETY: valid pointers for the call; the caller's contract.
        check("cuMemPoolImportPointer", unsafe {
            sys::cuMemPoolImportPointer(&raw mut p, pool, &raw mut d)
        })?;
        Ok(p)
    }
}

/// Modules and launches.
pub(crate) mod module {
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
    pub(crate) unsafe fn function(
        m: sys::CUmodule,
        name: &std::ffi::CStr,
    ) -> Result<sys::CUfunction> {
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
}
