//! Legacy CUDA IPC: `cuIpcGetMemHandle` / `cuIpcOpenMemHandle`.
//!
//! The exporter gets a 64-byte [`IpcMemHandle`] for memory from `cuMemAlloc`;
//! another process opens it and gets its own address for the same memory.
//! Three facts shape this module:
//!
//! - the handle names the whole allocation, never the pointer it was asked
//!   for, so an export carries the offset and length separately
//!   ([`LegacyExport`]);
//! - `cudaMalloc` may place a small buffer inside a larger block, and a
//!   handle to it shares the whole block: [`LegacyBuffer`] rounds every
//!   allocation up to 2 MiB so that nothing else lives in it;
//! - stream-ordered memory (`cuMemAllocAsync`) cannot be exported this way
//!   ([`Error::StreamOrdered`] says what to use instead), and a process
//!   cannot open its own handles ([`Error::SameProcess`]).
//!
//! A legacy handle is a bearer token: whoever learns its 64 bytes and runs
//! as a user allowed to use the GPU can map the memory.
#![allow(unsafe_code)]

use std::collections::HashSet;
use std::ops::BitOr;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys;
use cudarc::driver::sys::CUresult;

use crate::device::Device;
use crate::driver::result::{ipc, mem};
use crate::error::{Error, Result};
use crate::handle::IpcMemHandle;
use crate::mechanism::Mechanism;
use crate::memory::buffer::sealed::Sealed;
use crate::memory::buffer::{Mapping, UsedStreams};
use crate::memory::owned::{Owned, owned_buffer};
use crate::units::{MIB, round_up};

/// Our allocations are rounded up to this, NVIDIA's advice for IPC.
pub(crate) const ALLOCATION_GRANULE: u64 = 2 * MIB;

/// Flags for opening a legacy handle (`CUipcMem_flags`).
///
/// Current drivers require [`OpenFlags::LAZY_ENABLE_PEER_ACCESS`] on every
/// open (they reject 0 with `CUDA_ERROR_INVALID_VALUE`), so it is the
/// default; on one GPU it changes nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct OpenFlags(u32);

impl Default for OpenFlags {
    fn default() -> Self {
        OpenFlags::LAZY_ENABLE_PEER_ACCESS
    }
}

impl OpenFlags {
    /// No flags (rejected by current drivers; see the type's documentation).
    pub const NONE: OpenFlags = OpenFlags(0);
    /// Enable peer access from this device to the memory's device on
    /// demand, when the memory lives on another GPU
    /// (`CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`).
    pub const LAZY_ENABLE_PEER_ACCESS: OpenFlags =
        OpenFlags(sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32);

    /// Whether all of `other`'s flags are set.
    pub(crate) const fn contains(self, other: OpenFlags) -> bool {
        self.0 & other.0 == other.0
    }
}

impl BitOr for OpenFlags {
    type Output = OpenFlags;
    fn bitor(self, rhs: OpenFlags) -> OpenFlags {
        OpenFlags(self.0 | rhs.0)
    }
}

/// Handles this process has exported, so that opening one of them here gets
/// a clear error instead of the driver's bare 201.
fn exported_here() -> &'static Mutex<HashSet<IpcMemHandle>> {
    static SET: OnceLock<Mutex<HashSet<IpcMemHandle>>> = OnceLock::new();
    SET.get_or_init(Default::default)
}

fn lock_exported() -> std::sync::MutexGuard<'static, HashSet<IpcMemHandle>> {
    exported_here()
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What another process needs to map a legacy export.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct LegacyExport {
    /// The handle of the whole allocation.
    pub handle: IpcMemHandle,
    /// Where the exported bytes start inside the allocation.
    pub offset: u64,
    /// How many bytes are exported.
    pub len: u64,
    /// The size of the whole allocation.
    pub alloc_size: u64,
}

/// Exports `len` bytes at `ptr`, which may point anywhere inside an
/// allocation from `cuMemAlloc` (a cudarc slice from `result::malloc_sync`,
/// a PyTorch or CuPy block): the export finds the allocation's base and
/// records the offset.
///
/// # Errors
/// [`Error::StreamOrdered`] for memory from `cuMemAllocAsync`;
/// [`Error::Unsupported`] for VMM or host memory; [`Error::OutOfBounds`]
/// when the range passes the end of the allocation.
#[doc(alias = "cuIpcGetMemHandle")]
#[doc(alias = "cuMemGetAddressRange")]
pub fn export_pointer(device: &Device, ptr: u64, len: u64) -> Result<LegacyExport> {
    device.bind()?;
    let (base, size) = mem::address_range(ptr)?;
    let offset = ptr - base;
    Error::check_range(offset, len, size)?;
    let capable = mem::pointer_attribute_u32(
        ptr,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
    )?;
    if capable == 0 {
        let pool = mem::pointer_attribute_u64(
            ptr,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
        )
        .unwrap_or(0);
        return Err(if pool != 0 {
            Error::StreamOrdered { ptr }
        } else {
            Error::Unsupported {
                what: "a legacy IPC handle for this memory",
                why: format!(
                    "the memory at {ptr:#x} is not from cuMemAlloc (it is VMM or host memory); \
                     share VMM memory with the vmm mechanism"
                ),
            }
        });
    }
    let handle = ipc::get_mem_handle(ptr)?;
    lock_exported().insert(handle);
    tracing::debug!(
        ptr,
        offset,
        len,
        alloc_size = size,
        "exported legacy handle"
    );
    Ok(LegacyExport {
        handle,
        offset,
        len,
        alloc_size: size,
    })
}

/// Device memory from `cuMemAlloc`, sized so that it shares no block with
/// any other allocation, ready to export with a legacy handle.
#[derive(Debug)]
pub struct LegacyBuffer {
    core: Owned,
    alloc_size: u64,
    export: OnceLock<LegacyExport>,
}

impl LegacyBuffer {
    /// Allocates `len` bytes (rounded up to 2 MiB underneath) on `device`.
    #[doc(alias = "cuMemAlloc")]
    pub fn alloc(device: &Device, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::arg(
                "size",
                "cannot share an empty buffer; ask for at least one byte",
            ));
        }
        let alloc_size = round_up(len as u64, ALLOCATION_GRANULE)
            .ok_or_else(|| Error::arg("size", format!("{len} bytes is too large")))?;
        device.bind()?;
        let ptr = mem::alloc(alloc_size as usize)?;
        Ok(LegacyBuffer {
            core: Owned::new(device, ptr, len),
            alloc_size,
            export: OnceLock::new(),
        })
    }

    /// The size of the underlying allocation (a multiple of 2 MiB).
    pub fn alloc_size(&self) -> u64 {
        self.alloc_size
    }

    /// Exports the whole buffer. The handle is obtained once and reused.
    #[doc(alias = "cuIpcGetMemHandle")]
    pub fn export(&self) -> Result<LegacyExport> {
        if let Some(e) = self.export.get() {
            return Ok(*e);
        }
        let e = export_pointer(&self.core.device, self.core.ptr, self.core.len as u64)?;
        Ok(*self.export.get_or_init(|| e))
    }
}

// SAFETY: the allocation is owned by the value and freed in its `Drop`,
// after its stream has finished; the accessors return the core's fixed
// fields.
owned_buffer! {
    unsafe LegacyBuffer;
}

impl Drop for LegacyBuffer {
    fn drop(&mut self) {
        if let Some(e) = self.export.get() {
            lock_exported().remove(&e.handle);
        }
        // Errors cannot be raised from drop. Queued work on our stream must
        // finish before the memory goes: the free is retired to the reaper
        // until then (no wait here). A failure to free means the context is
        // broken, and its teardown frees the memory.
        let (device, ptr) = (self.core.device.clone(), self.core.ptr);
        self.core.retire("freeing a legacy buffer", move || {
            let _ = device.bind();
            // SAFETY: allocated in `alloc`, freed once, after the work
            // queued on its streams.
            let _ = unsafe { mem::free(ptr) };
        });
    }
}

/// A legacy handle opened in this process: the whole allocation, mapped.
/// Closed (`cuIpcCloseMemHandle`) when the last reference drops.
#[derive(Debug)]
pub struct LegacyMapping {
    device: Device,
    base: u64,
    size: u64,
    streams: UsedStreams,
}

impl LegacyMapping {
    /// Opens `handle` on `device`.
    ///
    /// Opening a handle this process exported fails with
    /// [`Error::SameProcess`]. Opening the same handle twice in one process
    /// returns the same address (the driver counts references).
    #[doc(alias = "cuIpcOpenMemHandle")]
    pub fn open(device: &Device, handle: IpcMemHandle, flags: OpenFlags) -> Result<Arc<Self>> {
        crate::handle::refuse_zero(&handle)?;
        if lock_exported().contains(&handle) {
            return Err(Error::SameProcess);
        }
        device.bind()?;
        let base = match ipc::open_mem_handle(handle, flags.0) {
            Ok(p) => p,
            Err(e) if e.driver_result() == Some(CUresult::CUDA_ERROR_INVALID_CONTEXT) => {
                return Err(Error::SameProcess);
            }
            Err(e)
                if e.driver_result() == Some(CUresult::CUDA_ERROR_INVALID_VALUE)
                    && !flags.contains(OpenFlags::LAZY_ENABLE_PEER_ACCESS) =>
            {
                return Err(Error::InvalidArgument {
                    what: "open flags",
                    reason: format!(
                        "{e}; the driver requires CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS on every open: pass \
                         OpenFlags::LAZY_ENABLE_PEER_ACCESS (OpenFlags::default())"
                    ),
                });
            }
            Err(e) => return Err(e),
        };
        let size = match mem::address_range(base) {
            Ok((_, size)) => size,
            Err(e) => {
                // SAFETY: just opened, not shared yet.
                let _ = unsafe { ipc::close_mem_handle(base) };
                return Err(e);
            }
        };
        tracing::debug!(base, size, "opened legacy handle");
        Ok(Arc::new(LegacyMapping {
            device: device.clone(),
            base,
            size,
            streams: UsedStreams::default(),
        }))
    }
}

impl Sealed for LegacyMapping {
    fn used_streams(&self) -> &UsedStreams {
        &self.streams
    }
}

impl Mapping for LegacyMapping {
    fn device(&self) -> &Device {
        &self.device
    }
    fn base(&self) -> u64 {
        self.base
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn mechanism(&self) -> Mechanism {
        Mechanism::Legacy
    }
}

impl Drop for LegacyMapping {
    fn drop(&mut self) {
        // Errors cannot be raised from drop. The close is retired until the
        // work queued on the device's stream and on every stream the views
        // used has finished, so that nothing uses the range after it is
        // closed (no wait here). A failure leaves the mapping to the
        // context's teardown.
        let (device, base) = (self.device.clone(), self.base);
        self.streams.retire(
            self.device.stream(),
            "closing a legacy IPC mapping",
            move || {
                let _ = device.bind();
                // SAFETY: opened in `open`, closed once, after every stream
                // that used it has finished.
                let _ = unsafe { ipc::close_mem_handle(base) };
                tracing::debug!(base, "closed legacy handle");
            },
        );
    }
}
