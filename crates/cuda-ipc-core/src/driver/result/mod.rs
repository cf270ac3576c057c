//! Checked driver calls: one function per C call, grouped by area, each
//! returning `Result<_, Error>` with the C function's name in the error.
//!
//! This is the only module besides `driver` that touches
//! `cudarc::driver::sys`. Callers must have made a context current on the
//! thread (`Device::bind`) and must have loaded the driver
//! (`driver::load`), which checks that every symbol used here exists, so
//! that no call can panic on a missing symbol.
#![allow(unsafe_code)]
// Each area is a submodule (a file of this folder) and uses all of the
// imports here (`use super::*`).
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

/// The answer of a query call (`cuEventQuery`, `cuStreamQuery`): `true`
/// when the work is complete, `false` when it is not ready; any other
/// result is an error naming the call.
#[inline]
pub(crate) fn ready(call: &'static str, r: CUresult) -> Result<bool> {
    match r {
        CUresult::CUDA_SUCCESS => Ok(true),
        CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        r => Err(driver_error(call, r)),
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
    "cuStreamGetCtx",
    "cuStreamQuery",
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
    // Stream memory operations and registered host memory (fences).
    "cuStreamWriteValue64_v2",
    "cuStreamWaitValue64_v2",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuMemHostGetDevicePointer_v2",
    // Page-locked staging buffers (the checkpoint loader).
    "cuMemHostAlloc",
    "cuMemFreeHost",
];

/// Driver-wide calls.
pub(crate) mod driver;

/// Device queries; none needs a current context.
pub(crate) mod device;

/// Context-wide calls; the context to act on must be current.
pub(crate) mod context;

/// Plain device memory.
pub mod mem;

/// Streams (those we do not reach through cudarc).
pub(crate) mod stream;

/// Legacy IPC.
pub(crate) mod ipc;

/// Events.
pub(crate) mod event;

/// Virtual memory management (cuMem* with physical handles).
pub(crate) mod vmm;

/// Stream-ordered memory pools.
pub(crate) mod pool;

/// Modules and launches.
#[cfg(feature = "test-support")]
pub(crate) mod module;

/// Stream memory operations (`cuStreamWriteValue64`, `cuStreamWaitValue64`)
/// and host memory registered with the driver: what fences are made of.
pub(crate) mod stream_mem;

#[cfg(test)]
mod tests {
    /// Every area's source, to find the driver calls it makes.
    const AREAS: [(&str, &str); 11] = [
        ("driver", include_str!("driver.rs")),
        ("device", include_str!("device.rs")),
        ("context", include_str!("context.rs")),
        ("mem", include_str!("mem.rs")),
        ("stream", include_str!("stream.rs")),
        ("ipc", include_str!("ipc.rs")),
        ("event", include_str!("event.rs")),
        ("vmm", include_str!("vmm.rs")),
        ("pool", include_str!("pool.rs")),
        ("module", include_str!("module.rs")),
        ("stream_mem", include_str!("stream_mem.rs")),
    ];

    /// A driver call whose symbol is not checked at load would panic on a
    /// driver that lacks it (cudarc's loader panics on first use): every
    /// `sys::cu...(` called here must be in `SYMBOLS`.
    #[test]
    fn every_driver_call_is_checked_at_load() {
        let mut calls = 0;
        for (area, text) in AREAS {
            for (i, _) in text.match_indices("sys::cu") {
                let name: String = text[i + "sys::".len()..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !text[i + "sys::".len() + name.len()..].starts_with('(') {
                    continue; // a type or a constant, not a call
                }
                calls += 1;
                assert!(
                    super::SYMBOLS.contains(&name.as_str()),
                    "result::{area} calls {name}, which SYMBOLS does not check at load"
                );
            }
        }
        assert!(
            calls > 40,
            "found only {calls} driver calls: the scan is broken"
        );
    }
}
