//! VMM allocations (`cuMemCreate`) shared as POSIX file descriptors or
//! fabric handles.
//!
//! The exporter creates physical memory whose shareable handle type is a
//! file descriptor (and, where the system allows, a fabric handle), maps it
//! into its own address space and exports a descriptor per consumer. A file
//! descriptor is a capability: only a process we hand it to (over a Unix
//! socket, with SCM_RIGHTS) can map the memory, unlike a legacy handle.
//!
//! # Who owns each file descriptor
//! - [`VmmBuffer::export_fd`] returns a new descriptor each call, owned by
//!   the caller (an `OwnedFd`): send it, then drop it. It keeps the physical
//!   memory alive only while someone holds it or a mapping made from it.
//! - [`VmmMapping::import_fd`] takes the descriptor by value: the driver does
//!   not take it over (unlike `cuImportExternalMemory`), so we close it as
//!   soon as the import is done. The mapping keeps the memory alive.
//! - Each mapping keeps the physical memory alive until it is unmapped, even
//!   after the exporter released it: dropping the exporter's [`VmmBuffer`]
//!   does not pull memory from under a consumer.
//!
//! # Read-only mappings
//! An importer may map the memory read-only ([`Access::ReadOnly`], with
//! [`VmmMapping::import_fd_with`] or [`VmmMapping::import_fabric`]):
//! `cuMemSetAccess` then grants `CU_MEM_ACCESS_FLAGS_PROT_READ` only, so a
//! kernel or copy that writes through the mapping is an invalid access and
//! the exporter's bytes do not change. How the failure shows is the
//! driver's; on an H200 with driver 580 (`tests/gpu/read_only.rs`) a
//! host-to-device copy into it is refused by the call
//! (`CUDA_ERROR_INVALID_VALUE`, the context still usable) and a kernel that
//! writes through it faults (`CUDA_ERROR_ILLEGAL_ADDRESS` at the next
//! synchronisation, the importer's context lost).
//! [`Mapping::read_only`] tells every view. This guards against
//! mistakes, not malice: whoever holds the file descriptor can import it
//! again read-write.
#![allow(unsafe_code)]

use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use cudarc::driver::sys::CUresult;

use crate::device::Device;
use crate::driver::result::vmm::{self, HandleType};
use crate::error::{Error, Result};
use crate::handle::FabricHandle;
use crate::mechanism::{Access, Mechanism};
use crate::memory::buffer::sealed::Sealed;
use crate::memory::buffer::{Mapping, UsedStreams, lock};
use crate::memory::owned::{Owned, owned_buffer};
use crate::units::round_up;

/// The handle types a VMM allocation can be exported as.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct ShareableTypes {
    /// POSIX file descriptors (one host).
    pub posix_fd: bool,
    /// Fabric handles (an NVLink domain with IMEX).
    pub fabric: bool,
}

impl ShareableTypes {
    /// File descriptors only.
    pub const FD: ShareableTypes = ShareableTypes {
        posix_fd: true,
        fabric: false,
    };
    /// File descriptors and fabric handles.
    pub const FD_AND_FABRIC: ShareableTypes = ShareableTypes {
        posix_fd: true,
        fabric: true,
    };

    pub(super) fn to_sys(self) -> HandleType {
        let mut bits = 0;
        if self.posix_fd {
            bits |= HandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0;
        }
        if self.fabric {
            bits |= HandleType::CU_MEM_HANDLE_TYPE_FABRIC.0;
        }
        sys::CUmemAllocationHandleType_enum(bits)
    }
}

/// Where IMEX channels appear when a fabric-capable system is set up.
const IMEX_CHANNELS: &str = "/dev/nvidia-caps-imex-channels";

fn fabric_unavailable(e: &Error) -> Option<Error> {
    matches!(
        e.driver_result(),
        Some(CUresult::CUDA_ERROR_NOT_PERMITTED | CUresult::CUDA_ERROR_NOT_SUPPORTED)
    ).then(|| {
        let channels = std::path::Path::new(IMEX_CHANNELS).exists();
        Error::Unsupported {
            what: "fabric handles",
            why: if channels {
                format!(
                    "the driver refused the fabric handle type ({e}) although {IMEX_CHANNELS} exists; \
                     check that the nvidia-imex service runs and that this process may open a channel"
                )
            } else {
                format!(
                    "the driver refused the fabric handle type ({e}): there is no IMEX channel \
                     ({IMEX_CHANNELS} is missing). Fabric handles need a multi-node NVLink system \
                     with the nvidia-imex service; on one machine use the vmm (file descriptor) mechanism"
                )
            },
        }
    })
}

/// The allocation granularity for `device` with these handle types.
#[doc(alias = "cuMemGetAllocationGranularity")]
pub fn granularity(device: &Device, types: ShareableTypes) -> Result<u64> {
    device.bind()?;
    vmm::granularity(&vmm::device_prop(device.ordinal() as i32, types.to_sys()))
}

/// Physical device memory from `cuMemCreate`, mapped read-write into this
/// process and exportable as file descriptors (and fabric handles).
#[derive(Debug)]
pub struct VmmBuffer {
    pub(super) core: Owned,
    pub(super) handle: sys::CUmemGenericAllocationHandle,
    pub(super) alloc_size: u64,
    pub(super) types: ShareableTypes,
    /// For an allocation taken over from another process
    /// ([`VmmBuffer::adopt_fd`]): the descriptor it came with, which
    /// exports duplicate.
    pub(super) adopted: Option<OwnedFd>,
}

impl VmmBuffer {
    /// Allocates `len` bytes (rounded up to the granularity, 2 MiB on
    /// current GPUs) exportable as file descriptors.
    pub fn alloc(device: &Device, len: usize) -> Result<Self> {
        Self::alloc_with(device, len, ShareableTypes::FD)
    }

    /// Allocates with the given shareable handle types. Asking for fabric
    /// handles where the system has no IMEX channel is
    /// [`Error::Unsupported`] with the reason.
    #[doc(alias = "cuMemCreate")]
    #[doc(alias = "cuMemMap")]
    pub fn alloc_with(device: &Device, len: usize, types: ShareableTypes) -> Result<Self> {
        if len == 0 {
            return Err(Error::arg(
                "size",
                "cannot share an empty buffer; ask for at least one byte",
            ));
        }
        device.bind()?;
        let ordinal = device.ordinal() as i32;
        let prop = vmm::device_prop(ordinal, types.to_sys());
        let gran = vmm::granularity(&prop)?;
        let alloc_size = round_up(len as u64, gran)
            .ok_or_else(|| Error::arg("size", format!("{len} bytes is too large")))?;
        let handle = vmm::create(alloc_size, &prop).map_err(|e| {
            if types.fabric {
                fabric_unavailable(&e).unwrap_or(e)
            } else {
                e
            }
        })?;
        let ptr = map_rw_or_release(handle, alloc_size, gran, ordinal)?;
        Ok(VmmBuffer {
            core: Owned::new(device, ptr, len),
            handle,
            alloc_size,
            types,
            adopted: None,
        })
    }

    /// The size of the physical allocation (a multiple of the granularity).
    pub fn alloc_size(&self) -> u64 {
        self.alloc_size
    }

    /// A new file descriptor for the allocation, owned by the caller.
    #[doc(alias = "cuMemExportToShareableHandle")]
    pub fn export_fd(&self) -> Result<OwnedFd> {
        if !self.types.posix_fd {
            return Err(Error::arg(
                "handle type",
                "this buffer was allocated without the file descriptor handle type",
            ));
        }
        if let Some(fd) = &self.adopted {
            return fd.try_clone().map_err(|e| Error::Io {
                context: "cannot duplicate the descriptor of an adopted VMM allocation".into(),
                source: e,
            });
        }
        self.core.device.bind()?;
        vmm::export_fd(self.handle)
    }

    /// The allocation's fabric handle.
    #[doc(alias = "cuMemExportToShareableHandle")]
    pub fn export_fabric(&self) -> Result<FabricHandle> {
        if !self.types.fabric {
            return Err(Error::arg(
                "handle type",
                "this buffer was allocated without the fabric handle type; use VmmBuffer::alloc_with(.., ShareableTypes::FD_AND_FABRIC)",
            ));
        }
        self.core.device.bind()?;
        vmm::export_fabric(self.handle).map_err(|e| fabric_unavailable(&e).unwrap_or(e))
    }
}

/// Exports the VMM allocation mapped at `ptr` (made by anyone in this
/// process with the file descriptor handle type): a new descriptor, the
/// mapping's base and the allocation's size.
pub(crate) fn export_existing(device: &Device, ptr: u64) -> Result<(OwnedFd, u64, u64)> {
    device.bind()?;
    let handle = vmm::retain_allocation_handle(ptr).map_err(|e| Error::Unsupported {
        what: "sharing this memory",
        why: format!(
            "the memory at {ptr:#x} is neither from cuMemAlloc, nor from a memory pool, nor a VMM allocation ({e})"
        ),
    })?;
    let range = crate::driver::result::mem::address_range(ptr);
    let fd = vmm::export_fd(handle);
    // SAFETY: retained above, released once; the mapping keeps the memory.
    let _ = unsafe { vmm::release(handle) };
    let (base, size) = range?;
    let fd = fd.map_err(|e| Error::Unsupported {
        what: "sharing this VMM allocation",
        why: format!("it was not created with the POSIX file descriptor handle type ({e})"),
    })?;
    Ok((fd, base, size))
}

/// [`map_rw`] of a handle this process just created or imported, which
/// is released if it cannot be mapped.
pub(super) fn map_rw_or_release(
    handle: sys::CUmemGenericAllocationHandle,
    size: u64,
    align: u64,
    device: i32,
) -> Result<u64> {
    map_rw(handle, size, align, device).inspect_err(|_| {
        // SAFETY: the caller's handle, not mapped (map_rw undid its work),
        // released once, here.
        let _ = unsafe { vmm::release(handle) };
    })
}

/// Reserves an address range, maps `handle` into it and grants `device`
/// read-write access; undoes everything on failure.
fn map_rw(
    handle: sys::CUmemGenericAllocationHandle,
    size: u64,
    align: u64,
    device: i32,
) -> Result<u64> {
    map_segments(&[handle], size, align, &[device], Access::ReadWrite)
}

/// The bytes of `count` segments of `segment` bytes each (sizes a peer
/// sends: checked, never wrapped).
fn segments_size(segment: u64, count: usize) -> Result<u64> {
    segment.checked_mul(count as u64).ok_or_else(|| {
        Error::arg(
            "segments",
            format!("{count} segments of {segment} bytes pass the 64-bit address space"),
        )
    })
}

/// Maps `handles`, each of `segment` bytes, back to back into one reserved
/// range, with `access` for `devices`; undoes everything on failure.
fn map_segments(
    handles: &[sys::CUmemGenericAllocationHandle],
    segment: u64,
    align: u64,
    devices: &[i32],
    access: Access,
) -> Result<u64> {
    let total = segments_size(segment, handles.len())?;
    let ptr = vmm::address_reserve(total, align)?;
    let mut mapped = 0;
    let result = (|| {
        for (i, h) in handles.iter().enumerate() {
            // SAFETY: the range was reserved above and segment i is unmapped.
            unsafe { vmm::map(ptr + i as u64 * segment, segment, *h) }?;
            mapped += 1;
        }
        // SAFETY: the whole range is mapped.
        unsafe { set_access(ptr, total, devices, access) }
    })();
    if let Err(e) = result {
        for i in 0..mapped {
            // SAFETY: segment i was mapped above and nothing used it.
            let _ = unsafe { vmm::unmap(ptr + i as u64 * segment, segment) };
        }
        // SAFETY: reserved above, now unmapped.
        let _ = unsafe { vmm::address_free(ptr, total) };
        return Err(e);
    }
    Ok(ptr)
}

/// `cuMemSetAccess` with `access` for `devices`.
///
/// # Safety
/// The range must be mapped.
pub(super) unsafe fn set_access(
    ptr: u64,
    size: u64,
    devices: &[i32],
    access: Access,
) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe {
        match access {
            Access::ReadWrite => vmm::set_access_rw(ptr, size, devices),
            Access::ReadOnly => vmm::set_access_ro(ptr, size, devices),
        }
    }
}

// SAFETY: the allocation is owned by the value and freed in its `Drop`,
// after its stream has finished; the accessors return the core's fixed
// fields.
owned_buffer! {
    unsafe VmmBuffer;
}

impl Drop for VmmBuffer {
    fn drop(&mut self) {
        // Errors cannot be raised from drop. The unmap is retired until our
        // stream's work has finished (no wait here); if the context is
        // broken its teardown frees everything.
        let (device, ptr, size, handle) = (
            self.core.device.clone(),
            self.core.ptr,
            self.alloc_size,
            self.handle,
        );
        self.core
            .retire("unmapping and releasing a VMM allocation", move || {
                let _ = device.bind();
                // SAFETY: mapped, reserved and created in `alloc_with`;
                // undone once, in reverse order, after the work queued on
                // its streams. Consumers' mappings keep the memory alive.
                unsafe {
                    let _ = vmm::unmap(ptr, size);
                    let _ = vmm::address_free(ptr, size);
                    let _ = vmm::release(handle);
                }
            });
    }
}

/// Memory of another process's VMM allocation, imported and mapped here.
/// Unmapped (and its address range freed) on drop. It can
/// [sleep](Mapping::sleep) (unmapped, its address range kept) and
/// [wake](Mapping::wake) (mapped again at the same addresses).
#[derive(Debug)]
pub struct VmmMapping {
    pub(super) device: Device,
    pub(super) ptr: u64,
    pub(super) size: u64,
    /// Each imported allocation is mapped as one segment of this size.
    pub(super) segment: u64,
    mechanism: Mechanism,
    /// What the mapping grants: read-write, or read only.
    pub(super) access: Access,
    pub(super) streams: UsedStreams,
    /// The imported allocations, one per segment, kept so that a wake can
    /// map them again; released on drop, after the unmap.
    pub(super) handles: Vec<sys::CUmemGenericAllocationHandle>,
    /// Whether it sleeps, and the devices granted access (applied again
    /// on wake).
    pub(super) state: Mutex<SleepState>,
}

/// A mapping's sleep state: whether its segments are unmapped, and the
/// devices (ordinals) its access is granted to.
#[derive(Debug)]
pub(super) struct SleepState {
    pub(super) asleep: bool,
    pub(super) devices: Vec<i32>,
}

impl VmmMapping {
    /// Imports the allocation behind `fd` (of `size` bytes, the exporter's
    /// allocation size) and maps it read-write on `device`. Closes `fd`.
    #[doc(alias = "cuMemImportFromShareableHandle")]
    pub fn import_fd(device: &Device, fd: OwnedFd, size: u64) -> Result<Arc<Self>> {
        Self::import_segments(device, vec![fd], size)
    }

    /// Imports several allocations of `segment` bytes each and maps them
    /// back to back (PyTorch's expandable segments share memory this way).
    /// Closes every descriptor.
    pub fn import_segments(device: &Device, fds: Vec<OwnedFd>, segment: u64) -> Result<Arc<Self>> {
        Self::import_segments_for(device, fds, segment, &[], Access::ReadWrite)
    }

    /// As [`VmmMapping::import_fd`], granting `access` to `device` and to
    /// the devices `also` (ordinals in this process) alike. When the memory
    /// lives on another GPU, grant its own device too: copy engines then
    /// reach the mapping (`cuMemcpy*` on a peer VMM mapping fails without
    /// it). With [`Access::ReadOnly`] a kernel or copy that writes through
    /// the mapping fails and the exporter's bytes do not change (see the
    /// module's "Read-only mappings").
    #[doc(alias = "cuMemSetAccess")]
    pub fn import_fd_with(
        device: &Device,
        fd: OwnedFd,
        size: u64,
        also: &[usize],
        access: Access,
    ) -> Result<Arc<Self>> {
        Self::import_segments_for(device, vec![fd], size, also, access)
    }

    fn import_segments_for(
        device: &Device,
        fds: Vec<OwnedFd>,
        segment: u64,
        also: &[usize],
        access: Access,
    ) -> Result<Arc<Self>> {
        if fds.is_empty() || segment == 0 {
            return Err(Error::arg(
                "VMM import",
                "needs at least one file descriptor and a non-zero size",
            ));
        }
        device.bind()?;
        let ordinal = device.ordinal() as i32;
        let gran = vmm::granularity(&vmm::device_prop(ordinal, ShareableTypes::FD.to_sys()))?;
        if !segment.is_multiple_of(gran) {
            return Err(Error::arg(
                "VMM import size",
                format!(
                    "{segment} bytes is not a multiple of the {gran}-byte granularity; pass the exporter's allocation size"
                ),
            ));
        }
        let mut handles = Vec::with_capacity(fds.len());
        for fd in &fds {
            match vmm::import_fd(fd.as_fd()) {
                Ok(h) => handles.push(h),
                Err(e) => {
                    release_all(&handles);
                    return Err(e);
                }
            }
        }
        // The driver did not take the descriptors: close them now.
        drop(fds);
        // One cuMemSetAccess for every device, not one per device.
        let mut devices = vec![device.ordinal() as i32];
        for &ordinal in also {
            if !devices.contains(&(ordinal as i32)) {
                devices.push(ordinal as i32);
            }
        }
        Self::map_imported(
            device,
            handles,
            segment,
            gran,
            devices,
            (Mechanism::Vmm, access),
        )
    }

    /// Imports a fabric handle of `size` bytes and maps it on `device`
    /// with `access` (see [`VmmMapping::import_fd_with`]).
    #[doc(alias = "cuMemImportFromShareableHandle")]
    #[doc(alias = "cuMemSetAccess")]
    pub fn import_fabric(
        device: &Device,
        handle: FabricHandle,
        size: u64,
        access: Access,
    ) -> Result<Arc<Self>> {
        crate::handle::refuse_zero(&handle)?;
        device.bind()?;
        let ordinal = device.ordinal() as i32;
        let gran = vmm::granularity(&vmm::device_prop(
            ordinal,
            ShareableTypes::FD_AND_FABRIC.to_sys(),
        ))?;
        if size == 0 || !size.is_multiple_of(gran) {
            return Err(Error::arg(
                "fabric import size",
                format!("{size} bytes is not a positive multiple of {gran}"),
            ));
        }
        let h = vmm::import_fabric(handle).map_err(|e| fabric_unavailable(&e).unwrap_or(e))?;
        Self::map_imported(
            device,
            vec![h],
            size,
            gran,
            vec![device.ordinal() as i32],
            (Mechanism::Fabric, access),
        )
    }

    /// Maps `handles` back to back, with `access` for `devices` (ordinals,
    /// `device` first). The mapping keeps the handles (a wake maps them
    /// again) and releases them on drop; they are released here if mapping
    /// fails.
    fn map_imported(
        device: &Device,
        handles: Vec<sys::CUmemGenericAllocationHandle>,
        segment: u64,
        gran: u64,
        devices: Vec<i32>,
        (mechanism, access): (Mechanism, Access),
    ) -> Result<Arc<Self>> {
        let ptr = match map_segments(&handles, segment, gran, &devices, access) {
            Ok(ptr) => ptr,
            Err(e) => {
                release_all(&handles);
                return Err(e);
            }
        };
        Ok(Arc::new(VmmMapping {
            device: device.clone(),
            ptr,
            // Checked by `map_segments`, which succeeded.
            size: segment.saturating_mul(handles.len() as u64),
            segment,
            mechanism,
            access,
            streams: UsedStreams::default(),
            handles,
            state: Mutex::new(SleepState {
                asleep: false,
                devices,
            }),
        }))
    }

    /// Grants `peer` this mapping's access too (another device of this
    /// process, with peer access to the memory's device): read-write, or
    /// read only for a read-only mapping.
    #[doc(alias = "cuMemSetAccess")]
    /// While the mapping sleeps, the grant is noted and applied on wake.
    pub fn grant_access(&self, peer: &Device) -> Result<()> {
        let ordinal = peer.ordinal() as i32;
        let mut state = lock(&self.state);
        if !state.asleep {
            self.device.bind()?;
            // SAFETY: the range is mapped (it is awake, and the state's lock
            // keeps a sleep out).
            unsafe { set_access(self.ptr, self.size, &[ordinal], self.access) }?;
        }
        if !state.devices.contains(&ordinal) {
            state.devices.push(ordinal);
        }
        Ok(())
    }
}

pub(super) fn release_all(handles: &[sys::CUmemGenericAllocationHandle]) {
    for h in handles {
        // SAFETY: each was imported once and is released once; errors mean
        // the handle is already gone.
        let _ = unsafe { vmm::release(*h) };
    }
}

impl Sealed for VmmMapping {
    fn used_streams(&self) -> &UsedStreams {
        &self.streams
    }
}

impl Mapping for VmmMapping {
    fn device(&self) -> &Device {
        &self.device
    }
    fn base(&self) -> u64 {
        self.ptr
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn mechanism(&self) -> Mechanism {
        self.mechanism
    }
    fn read_only(&self) -> bool {
        self.access == Access::ReadOnly
    }
    unsafe fn sleep(&self) -> Result<()> {
        // SAFETY: the caller keeps `Mapping::sleep`'s contract, which is
        // `VmmMapping::sleep`'s.
        unsafe { VmmMapping::sleep(self) }
    }
    fn wake(&self) -> Result<()> {
        VmmMapping::wake(self)
    }
    fn asleep(&self) -> bool {
        VmmMapping::asleep(self)
    }
}

impl Drop for VmmMapping {
    fn drop(&mut self) {
        // Errors cannot be raised from drop. The unmap is retired until the
        // device's stream and every stream the views used have finished the
        // work queued so far, so that nothing queued there uses the range
        // after unmapping (no wait here).
        let (device, ptr, size, segment) = (self.device.clone(), self.ptr, self.size, self.segment);
        let asleep = lock(&self.state).asleep;
        let handles = std::mem::take(&mut self.handles);
        self.streams.retire(
            self.device.stream(),
            "unmapping an imported VMM allocation",
            move || {
                let _ = device.bind();
                // SAFETY: reserved in `map_imported` and, unless asleep,
                // mapped segment by segment; undone once (cuMemUnmap takes
                // whole mappings), after every stream that used it has
                // finished; the handles are released last, once.
                unsafe {
                    if !asleep {
                        let mut at = ptr;
                        while at < ptr + size {
                            let _ = vmm::unmap(at, segment);
                            at += segment;
                        }
                    }
                    let _ = vmm::address_free(ptr, size);
                }
                release_all(&handles);
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_sizes_a_peer_sends_never_wrap() {
        assert_eq!(segments_size(2 << 20, 3).unwrap(), 6 << 20);
        let e = segments_size(1 << 40, 1 << 30).unwrap_err();
        assert!(e.to_string().contains("64-bit address space"), "{e}");
        assert!(segments_size(u64::MAX, 2).is_err());
        assert_eq!(segments_size(u64::MAX, 1).unwrap(), u64::MAX);
    }
}
