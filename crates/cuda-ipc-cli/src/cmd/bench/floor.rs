//! The driver floor: the bare driver calls a hand-off cannot avoid, with no
//! library logic around them (no descriptor, no channel, no lease, no
//! cache, no bounds or capability checks), so that the report can say how
//! much the library adds.
//!
//! - legacy: `cuIpcGetMemHandle` + `cuEventRecord` in the producer;
//!   `cuIpcOpenMemHandle_v2` (with `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`,
//!   which the driver requires) + the wait (below) in the consumer;
//! - vmm: `cuMemExportToShareableHandle` (through `VmmBuffer::export_fd`,
//!   which binds the context and makes that one call) + `cuEventRecord` in
//!   the producer; `cuMemImportFromShareableHandle` + `cuMemAddressReserve`
//!   + `cuMemMap` + `cuMemRelease` + `cuMemSetAccess` + the wait in the
//!     consumer.
//!
//! The wait is `cuEventQuery`, then `cuStreamWaitEvent` only if the event
//! has not completed, then `cuStreamSynchronize`: the least a consumer must
//! do, and what the library does.
//!
//! The caller makes the device's context current first (every library call
//! does, and the floor's callers do it explicitly) and has loaded the
//! driver (`Device::open`), which checks that every symbol used here exists.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_void};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::Arc;

use cuda_ipc::cudarc::driver::CudaStream;
use cuda_ipc::cudarc::driver::sys::{self, CUresult};
use cuda_ipc::{Device, DeviceMemory, Error, IpcMemHandle};

/// A driver call's result as our error, naming the call.
fn check(call: &'static str, r: CUresult) -> Result<(), Error> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Io {
            context: format!("{call} (driver floor)"),
            source: std::io::Error::other(format!("{r:?} ({})", r as i32)),
        })
    }
}

/// `cuEventRecord(event, stream)`.
pub fn record(event: sys::CUevent, stream: &CudaStream) -> Result<(), Error> {
    // SAFETY: the caller passes a live event of the current context, and the
    // stream is live for the borrow.
    check("cuEventRecord", unsafe {
        sys::cuEventRecord(event, stream.cu_stream())
    })
}

/// `cuEventQuery(event)`; unless complete, `cuStreamWaitEvent(stream,
/// event)`; then `cuStreamSynchronize(stream)`.
pub fn wait_and_sync(event: sys::CUevent, stream: &CudaStream) -> Result<(), Error> {
    // SAFETY: as in `record`.
    let done = match unsafe { sys::cuEventQuery(event) } {
        CUresult::CUDA_SUCCESS => true,
        CUresult::CUDA_ERROR_NOT_READY => false,
        r => return check("cuEventQuery", r),
    };
    if !done {
        // SAFETY: as in `record`.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(stream.cu_stream(), event, 0)
        })?;
    }
    // SAFETY: the stream is live for the borrow.
    check("cuStreamSynchronize", unsafe {
        sys::cuStreamSynchronize(stream.cu_stream())
    })
}

/// The legacy floor's export: `cuIpcGetMemHandle(ptr)` then
/// `cuEventRecord(event, stream)`.
pub fn export_legacy(
    ptr: u64,
    event: sys::CUevent,
    stream: &CudaStream,
) -> Result<IpcMemHandle, Error> {
    let mut h = std::mem::MaybeUninit::<sys::CUipcMemHandle>::uninit();
    // SAFETY: a valid out-pointer; the driver validates `ptr`.
    check("cuIpcGetMemHandle", unsafe {
        sys::cuIpcGetMemHandle(h.as_mut_ptr(), ptr)
    })?;
    // SAFETY: initialised by the successful call.
    let h = unsafe { h.assume_init() };
    record(event, stream)?;
    Ok(IpcMemHandle::new(h.reserved.map(|c| c as u8)))
}

/// A legacy handle opened by the floor; closed with [`LegacyOpen::close`].
#[derive(Debug)]
pub struct LegacyOpen {
    /// The mapped address.
    pub ptr: u64,
}

/// The legacy floor's open: `cuIpcOpenMemHandle_v2` (lazy peer access),
/// then the stream waits on the event and is synchronised.
pub fn open_legacy(
    handle: &IpcMemHandle,
    event: sys::CUevent,
    stream: &CudaStream,
) -> Result<LegacyOpen, Error> {
    let raw = sys::CUipcMemHandle {
        reserved: handle.as_bytes().map(|b| b as c_char),
    };
    let mut ptr = 0;
    // SAFETY: a valid out-pointer; the handle is passed by value.
    check("cuIpcOpenMemHandle_v2", unsafe {
        sys::cuIpcOpenMemHandle_v2(
            &raw mut ptr,
            raw,
            sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
        )
    })?;
    let opened = LegacyOpen { ptr };
    if let Err(e) = wait_and_sync(event, stream) {
        let _ = opened.close();
        return Err(e);
    }
    Ok(opened)
}

impl LegacyOpen {
    /// `cuIpcCloseMemHandle`.
    pub fn close(self) -> Result<(), Error> {
        // SAFETY: opened by `open_legacy`, closed once (this consumes it),
        // and no work uses it: the stream was synchronised after every use.
        check("cuIpcCloseMemHandle", unsafe {
            sys::cuIpcCloseMemHandle(self.ptr)
        })
    }
}

/// A VMM allocation imported and mapped by the floor; unmapped with
/// [`VmmImport::unmap`].
#[derive(Debug)]
pub struct VmmImport {
    /// The mapped address.
    pub ptr: u64,
    /// The mapped size.
    pub size: u64,
}

/// The vmm floor's open: import the file descriptor (which the driver does
/// not take; the caller closes it), reserve `size` bytes aligned to
/// `granularity`, map, release the handle (the mapping keeps the memory),
/// grant `devices` read-write access (one call), then wait on the event
/// and synchronise.
pub fn import_vmm(
    fd: BorrowedFd<'_>,
    size: u64,
    granularity: u64,
    devices: &[i32],
    event: sys::CUevent,
    stream: &CudaStream,
) -> Result<VmmImport, Error> {
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: for POSIX_FILE_DESCRIPTOR the "handle" is the int itself,
    // passed as a pointer-sized value; the out-pointer is valid.
    check("cuMemImportFromShareableHandle", unsafe {
        sys::cuMemImportFromShareableHandle(
            &raw mut handle,
            fd.as_raw_fd() as usize as *mut c_void,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
    })?;
    let release = |h| {
        // SAFETY: imported above, released once.
        let _ = unsafe { sys::cuMemRelease(h) };
    };
    let mut ptr = 0;
    // SAFETY: a valid out-pointer.
    if let Err(e) = check("cuMemAddressReserve", unsafe {
        sys::cuMemAddressReserve(&raw mut ptr, size as usize, granularity as usize, 0, 0)
    }) {
        release(handle);
        return Err(e);
    }
    let free = |p| {
        // SAFETY: reserved above, unmapped, freed once.
        let _ = unsafe { sys::cuMemAddressFree(p, size as usize) };
    };
    // SAFETY: the range was just reserved and is unmapped.
    if let Err(e) = check("cuMemMap", unsafe {
        sys::cuMemMap(ptr, size as usize, 0, handle, 0)
    }) {
        free(ptr);
        release(handle);
        return Err(e);
    }
    let mapped = VmmImport { ptr, size };
    // SAFETY: imported above, released once; the mapping keeps the memory.
    if let Err(e) = check("cuMemRelease", unsafe { sys::cuMemRelease(handle) }) {
        let _ = mapped.unmap();
        return Err(e);
    }
    let access: Vec<sys::CUmemAccessDesc> = devices
        .iter()
        .map(|&id| sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id,
            },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        })
        .collect();
    // SAFETY: the range is mapped; `access` lives for the call.
    if let Err(e) = check("cuMemSetAccess", unsafe {
        sys::cuMemSetAccess(ptr, size as usize, access.as_ptr(), access.len())
    }) {
        let _ = mapped.unmap();
        return Err(e);
    }
    if let Err(e) = wait_and_sync(event, stream) {
        let _ = mapped.unmap();
        return Err(e);
    }
    Ok(mapped)
}

impl VmmImport {
    /// `cuMemUnmap` then `cuMemAddressFree`.
    pub fn unmap(self) -> Result<(), Error> {
        // SAFETY: mapped and reserved by `import_vmm`, undone once (this
        // consumes it); the stream was synchronised after every use.
        let unmapped = check("cuMemUnmap", unsafe {
            sys::cuMemUnmap(self.ptr, self.size as usize)
        });
        // SAFETY: as above; freed even if the unmap failed, as the range is ours.
        let freed = check("cuMemAddressFree", unsafe {
            sys::cuMemAddressFree(self.ptr, self.size as usize)
        });
        unmapped.and(freed)
    }
}

/// Memory the floor mapped, as [`DeviceMemory`] so that the library's host
/// copies can check a few words of it.
pub struct RawMemory<'a> {
    /// The device it is mapped on.
    pub device: &'a Device,
    /// Its address.
    pub ptr: u64,
    /// Its length in bytes.
    pub len: usize,
}

// SAFETY: the worker builds it only over a range this floor mapped on
// `device` (`open_legacy`, `import_vmm`), and drops it before the unmap.
unsafe impl DeviceMemory for RawMemory<'_> {
    fn device(&self) -> &Device {
        self.device
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.device.stream()
    }
    fn device_address(&self) -> u64 {
        self.ptr
    }
    fn byte_len(&self) -> usize {
        self.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_name_the_call_and_the_code() {
        let e = check("cuIpcOpenMemHandle_v2", CUresult::CUDA_ERROR_INVALID_VALUE).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("cuIpcOpenMemHandle_v2 (driver floor)"),
            "{text}"
        );
        assert!(text.contains("CUDA_ERROR_INVALID_VALUE (1)"), "{text}");
        assert!(check("cuMemMap", CUresult::CUDA_SUCCESS).is_ok());
    }

    #[test]
    fn handle_bytes_round_trip_through_c_chars() {
        let mut bytes = [0u8; 64];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(37).wrapping_add(200);
        }
        let h = IpcMemHandle::new(bytes);
        let raw = sys::CUipcMemHandle {
            reserved: h.as_bytes().map(|b| b as c_char),
        };
        assert_eq!(IpcMemHandle::new(raw.reserved.map(|c| c as u8)), h);
    }
}
