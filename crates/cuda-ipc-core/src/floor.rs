//! The driver floor: the least a program must do with the driver to hand a
//! buffer to another process, with none of this library's logic around it
//! (no descriptor, no channel, no lease, no cache, no capability checks).
//! It is the baseline `cuda-ipc bench` measures the library against, kept
//! here so that the benchmark itself needs no `unsafe` and makes no driver
//! call of its own.
//!
//! What each hand-off costs at the least:
//! - legacy: [`export_legacy`] (`cuIpcGetMemHandle` + `cuEventRecord`) in
//!   the producer; [`open_legacy`] (`cuIpcOpenMemHandle_v2` with
//!   `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, which the driver requires, then
//!   [`wait`]) in the consumer; [`LegacyOpen::close`]
//!   (`cuStreamSynchronize` + `cuIpcCloseMemHandle`) when done;
//! - vmm: [`export_vmm`] (`cuMemExportToShareableHandle` through
//!   [`VmmBuffer::export_fd`] + `cuEventRecord`) in the producer;
//!   [`import_vmm`] (`cuMemImportFromShareableHandle` +
//!   `cuMemAddressReserve` + `cuMemMap` + `cuMemRelease` +
//!   `cuMemSetAccess`, then [`wait`]) in the consumer; [`VmmImport::unmap`]
//!   (`cuStreamSynchronize` + `cuMemUnmap` + `cuMemAddressFree`) when done.
//!
//! The wait ([`wait`]) is `cuEventQuery`, then `cuStreamWaitEvent` only if
//! the event has not completed, then `cuStreamSynchronize`: the least a
//! consumer must do before it reads, and what the library does. The
//! synchronisation before a close is the least a consumer must do so that
//! no queued work still uses the range; the library's mappings do the same
//! when dropped.
//!
//! Every function binds the device's context first, as every library call
//! does (a check of the current context when it is already bound). Errors
//! are [`Error::Driver`] naming the C call.
//!
//! What the floor leaves out, the library's owning types do: a mapping here
//! is checked against the allocation's size only when it is used as memory
//! ([`LegacyOpen::memory`], [`VmmImport::memory`]), not when it is opened.
#![allow(unsafe_code)]

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::CudaStream;
use cudarc::driver::sys;

use crate::device::Device;
use crate::driver::result::{event, ipc, mem, stream, vmm};
use crate::error::{Error, Result};
use crate::handle::IpcMemHandle;
use crate::memory::DeviceMemory;
use crate::memory::vmm::VmmBuffer;
use crate::sync::event::IpcEvent;

/// Waits for the most recent record of `event` before the next work on
/// `device`'s stream, and for that stream: `cuEventQuery`; unless complete,
/// `cuStreamWaitEvent`; then `cuStreamSynchronize`.
#[doc(alias = "cuEventQuery")]
#[doc(alias = "cuStreamWaitEvent")]
#[doc(alias = "cuStreamSynchronize")]
pub fn wait(device: &Device, event: &IpcEvent) -> Result<()> {
    device.bind()?;
    let on = device.stream().cu_stream();
    // SAFETY: the event is live for the borrow.
    if !unsafe { event::query(event.cu_event()) }? {
        // SAFETY: both are live for the borrows (the device owns its stream).
        unsafe { stream::wait_event(on, event.cu_event()) }?;
    }
    // SAFETY: the device owns its stream, live for the borrow.
    unsafe { stream::synchronize(on) }
}

/// `cuStreamSynchronize` on `device`'s stream.
fn synchronize(device: &Device) -> Result<()> {
    device.bind()?;
    // SAFETY: the device owns its stream, live for the borrow.
    unsafe { stream::synchronize(device.stream().cu_stream()) }
}

/// The legacy floor's export: `cuIpcGetMemHandle` for `memory`'s address,
/// then `event` recorded on `on` (the consumer waits on it before reading).
#[doc(alias = "cuIpcGetMemHandle")]
pub fn export_legacy(
    memory: &impl DeviceMemory,
    event: &IpcEvent,
    on: &CudaStream,
) -> Result<IpcMemHandle> {
    memory.device().bind()?;
    let handle = ipc::get_mem_handle(memory.device_address())?;
    event.record(on)?;
    Ok(handle)
}

/// The vmm floor's export: a file descriptor for `buffer`
/// (`cuMemExportToShareableHandle`), then `event` recorded on `on`. The
/// descriptor is the caller's, to send (over a Unix socket) and close.
#[doc(alias = "cuMemExportToShareableHandle")]
pub fn export_vmm(buffer: &VmmBuffer, event: &IpcEvent, on: &CudaStream) -> Result<OwnedFd> {
    let fd = buffer.export_fd()?;
    event.record(on)?;
    Ok(fd)
}

/// A legacy handle the floor opened: closed by [`LegacyOpen::close`], or
/// when dropped (errors then ignored).
#[derive(Debug)]
pub struct LegacyOpen {
    device: Device,
    /// The mapped address; 0 once closed.
    ptr: u64,
}

/// The legacy floor's open: `cuIpcOpenMemHandle_v2` with lazy peer access,
/// then [`wait`] on `event` with the device's stream.
#[doc(alias = "cuIpcOpenMemHandle")]
pub fn open_legacy(device: &Device, handle: &IpcMemHandle, event: &IpcEvent) -> Result<LegacyOpen> {
    device.bind()?;
    let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
    let ptr = ipc::open_mem_handle(*handle, flags)?;
    let opened = LegacyOpen {
        device: device.clone(),
        ptr,
    };
    // On an error the drop closes the handle.
    wait(device, event)?;
    Ok(opened)
}

impl LegacyOpen {
    /// The mapped address.
    pub fn device_address(&self) -> u64 {
        self.ptr
    }

    /// The first `len` bytes of the mapping as memory the library's copies
    /// can use; an error if the exporter's allocation is shorter
    /// (`cuMemGetAddressRange`, a call the floor itself does not make).
    #[doc(alias = "cuMemGetAddressRange")]
    pub fn memory(&self, len: usize) -> Result<FloorMemory<'_>> {
        self.device.bind()?;
        let (base, size) = mem::address_range(self.ptr)?;
        FloorMemory::within(
            &self.device,
            self.ptr,
            len,
            base.saturating_add(size).saturating_sub(self.ptr),
        )
    }

    /// `cuStreamSynchronize` on the device's stream (no queued work may use
    /// the range), then `cuIpcCloseMemHandle`.
    #[doc(alias = "cuIpcCloseMemHandle")]
    pub fn close(mut self) -> Result<()> {
        self.close_once()
    }

    fn close_once(&mut self) -> Result<()> {
        let ptr = std::mem::replace(&mut self.ptr, 0);
        if ptr == 0 {
            return Ok(());
        }
        let synced = synchronize(&self.device);
        // SAFETY: opened by `open_legacy`, closed once (`ptr` is now 0 here),
        // after the device's stream, the only one our memory view queues on.
        let closed = unsafe { ipc::close_mem_handle(ptr) };
        synced.and(closed)
    }
}

impl Drop for LegacyOpen {
    fn drop(&mut self) {
        // Errors cannot be raised from drop; a failed close leaves the
        // mapping to the context's teardown.
        let _ = self.close_once();
    }
}

/// A VMM allocation the floor imported and mapped: unmapped by
/// [`VmmImport::unmap`], or when dropped (errors then ignored).
#[derive(Debug)]
pub struct VmmImport {
    device: Device,
    /// The mapped address; 0 once unmapped.
    ptr: u64,
    size: u64,
}

/// An imported allocation handle, released when dropped.
struct Imported(sys::CUmemGenericAllocationHandle);

impl Drop for Imported {
    fn drop(&mut self) {
        // SAFETY: imported by `import_vmm`, released once, here.
        let _ = unsafe { vmm::release(self.0) };
    }
}

/// A reserved address range, freed when dropped (once unmapped).
struct Reserved {
    ptr: u64,
    size: u64,
}

impl Drop for Reserved {
    fn drop(&mut self) {
        // SAFETY: reserved by `import_vmm` and not (or no longer) mapped, freed once.
        let _ = unsafe { vmm::address_free(self.ptr, self.size) };
    }
}

/// The vmm floor's open: import `fd` (the driver does not take it; the
/// caller still closes it), reserve `size` bytes aligned to `granularity`,
/// map, release the handle (the mapping keeps the memory), grant `devices`
/// read-write access (one call), then [`wait`] on `event` with the device's
/// stream. `size` is the exporter's allocation size: the driver refuses a
/// map larger than the allocation.
#[doc(alias = "cuMemImportFromShareableHandle")]
#[doc(alias = "cuMemMap")]
pub fn import_vmm(
    device: &Device,
    fd: BorrowedFd<'_>,
    size: u64,
    granularity: u64,
    devices: &[i32],
    event: &IpcEvent,
) -> Result<VmmImport> {
    device.bind()?;
    let handle = Imported(vmm::import_fd(fd)?);
    let range = Reserved {
        ptr: vmm::address_reserve(size, granularity)?,
        size,
    };
    // SAFETY: the range was just reserved and is unmapped.
    unsafe { vmm::map(range.ptr, size, handle.0) }?;
    // From here the import owns the mapping and the range (its drop unmaps
    // and frees them).
    let mapped = VmmImport {
        device: device.clone(),
        ptr: range.ptr,
        size,
    };
    std::mem::forget(range);
    // The mapping keeps the memory: release the handle now (an error here
    // drops `mapped`, which unmaps).
    let handle = std::mem::ManuallyDrop::new(handle);
    // SAFETY: imported above, released once, here (the guard will not run).
    unsafe { vmm::release(handle.0) }?;
    // SAFETY: the range is mapped.
    unsafe { vmm::set_access_rw(mapped.ptr, size, devices) }?;
    wait(device, event)?;
    Ok(mapped)
}

impl VmmImport {
    /// The mapped address.
    pub fn device_address(&self) -> u64 {
        self.ptr
    }

    /// The mapped size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The first `len` bytes of the mapping as memory the library's copies
    /// can use; an error if `len` is more than the mapped size.
    pub fn memory(&self, len: usize) -> Result<FloorMemory<'_>> {
        FloorMemory::within(&self.device, self.ptr, len, self.size)
    }

    /// `cuStreamSynchronize` on the device's stream (no queued work may use
    /// the range), then `cuMemUnmap` and `cuMemAddressFree`.
    #[doc(alias = "cuMemUnmap")]
    #[doc(alias = "cuMemAddressFree")]
    pub fn unmap(mut self) -> Result<()> {
        self.unmap_once()
    }

    fn unmap_once(&mut self) -> Result<()> {
        let ptr = std::mem::replace(&mut self.ptr, 0);
        if ptr == 0 {
            return Ok(());
        }
        let synced = synchronize(&self.device);
        // SAFETY: mapped by `import_vmm`, unmapped once (`ptr` is now 0
        // here), after the device's stream, the only one our view queues on.
        let unmapped = unsafe { vmm::unmap(ptr, self.size) };
        // SAFETY: reserved by `import_vmm`, freed once; freed even if the
        // unmap failed, as the range is ours.
        let freed = unsafe { vmm::address_free(ptr, self.size) };
        synced.and(unmapped).and(freed)
    }
}

impl Drop for VmmImport {
    fn drop(&mut self) {
        // Errors cannot be raised from drop; a failure leaves the range to
        // the context's teardown.
        let _ = self.unmap_once();
    }
}

/// Part of a floor mapping as [`DeviceMemory`], so that the library's
/// copies can check what it holds. Borrows the mapping: it cannot be closed
/// while this lives.
#[derive(Debug)]
pub struct FloorMemory<'a> {
    device: &'a Device,
    ptr: u64,
    len: usize,
}

impl<'a> FloorMemory<'a> {
    /// `len` bytes at `ptr`, of the `available` bytes mapped from `ptr` on.
    fn within(device: &'a Device, ptr: u64, len: usize, available: u64) -> Result<Self> {
        check_within(len, available)?;
        Ok(FloorMemory { device, ptr, len })
    }
}

/// `len` bytes fit in `available`.
fn check_within(len: usize, available: u64) -> Result<()> {
    if len as u64 > available {
        return Err(Error::OutOfBounds {
            offset: 0,
            len: len as u64,
            size: available,
        });
    }
    Ok(())
}

// SAFETY: built only by `within`, over a range this module mapped on
// `device` and checked to lie inside the mapping; it borrows the mapping,
// so the range stays mapped for as long as it lives.
unsafe impl DeviceMemory for FloorMemory<'_> {
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
    fn a_view_must_fit_the_mapping() {
        assert!(check_within(4096, 4096).is_ok());
        assert!(check_within(0, 0).is_ok());
        let e = check_within(8192, 4096).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::InvalidInput);
        let text = e.to_string();
        assert!(text.contains("8192") && text.contains("4096"), "{text}");
    }
}
