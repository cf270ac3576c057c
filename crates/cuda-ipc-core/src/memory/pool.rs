//! Stream-ordered memory pools shared between processes.
//!
//! Memory from `cuMemAllocAsync` (cudarc's default allocator) cannot be
//! shared with legacy handles. A pool created with a shareable handle type
//! can: the exporter sends the pool's file descriptor once per consumer,
//! then 64 bytes of export data per allocation ([`PoolPtrHandle`]).
//!
//! # Lifetimes and ownership
//! - [`SharedPool::export_fd`] returns a new descriptor owned by the
//!   caller; [`ImportedPool::import`] takes one by value and closes it once
//!   the driver has imported the pool (the driver does not keep it).
//! - An importer must free its imported pointers before the exporter frees
//!   the allocation ([`PoolMapping`] frees on drop; the exchange layer's
//!   leases make the exporter wait for that). If the exporter frees first,
//!   the importer's view is undefined: the memory may be handed to a new
//!   allocation. The GPU tests document what the driver does then.
//! - The importer must not touch the memory before the exporter's
//!   allocation has completed: [`SharedPool::alloc`] waits for it.
#![allow(unsafe_code)]

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::{CudaStream, sys};

use crate::device::Device;
use crate::driver::result::{mem, pool, stream as rstream};
use crate::error::{Error, Result};
use crate::handle::PoolPtrHandle;
use crate::mechanism::Mechanism;
use crate::memory::buffer::sealed::Sealed;
use crate::memory::buffer::{Mapping, UsedStreams};
use crate::memory::owned::{Owned, owned_buffer};

/// The largest pool allocation [`SharedPool::alloc`] makes for sharing.
///
/// Measured on an H200 with driver 580.159: importing a pool allocation of
/// 8 GiB in another process crashed that process (SIGSEGV inside the
/// driver), while 1 GiB allocations worked. A crash in the consumer is worse
/// than a refusal in the producer, so larger pool allocations are refused
/// with an error that says to use the vmm mechanism (which shares 8 GiB and
/// more); [`SharedPool::lift_size_limit`] tries a driver without this
/// limit.
pub const MAX_SHARED_ALLOCATION: u64 = 4 << 30;

/// A memory pool on one device whose allocations can be shared through
/// POSIX file descriptors. Destroyed when the last [`PoolBuffer`] and the
/// pool itself are dropped.
#[derive(Debug)]
pub struct SharedPool {
    device: Device,
    pool: sys::CUmemoryPool,
    /// Whether the pool has been exported once: the driver exports
    /// pointers only from a pool that has been shared.
    shared: std::sync::atomic::AtomicBool,
    /// Whether allocations over [`MAX_SHARED_ALLOCATION`] are let through.
    no_size_limit: std::sync::atomic::AtomicBool,
}

// SAFETY: a pool handle is a process-wide driver object; calls bind the context first.
unsafe impl Send for SharedPool {}
// SAFETY: as above; the driver's pool calls are thread-safe.
unsafe impl Sync for SharedPool {}

impl SharedPool {
    /// Creates a shareable pool on `device` (no size limit).
    #[doc(alias = "cuMemPoolCreate")]
    pub fn new(device: &Device) -> Result<Arc<Self>> {
        device.bind()?;
        let pool = pool::create(device.ordinal() as i32, 0)?;
        Ok(Arc::new(SharedPool {
            device: device.clone(),
            pool,
            shared: std::sync::atomic::AtomicBool::new(false),
            no_size_limit: std::sync::atomic::AtomicBool::new(false),
        }))
    }

    /// Lets allocations over [`MAX_SHARED_ALLOCATION`] through, for a
    /// driver whose importers do not crash on them (on driver 580 they
    /// do: try it with a process you can lose).
    pub fn lift_size_limit(&self) {
        self.no_size_limit
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// A new file descriptor for the pool, owned by the caller.
    #[doc(alias = "cuMemPoolExportToShareableHandle")]
    pub fn export_fd(&self) -> Result<OwnedFd> {
        self.device.bind()?;
        // SAFETY: the pool is live for as long as `self`.
        let fd = unsafe { pool::export_fd(self.pool) }?;
        self.shared
            .store(true, std::sync::atomic::Ordering::Release);
        Ok(fd)
    }

    /// Exports the pool once if nobody has yet: `cuMemPoolExportPointer`
    /// fails with `CUDA_ERROR_INVALID_VALUE` on a pool never shared.
    fn ensure_shared(&self) -> Result<()> {
        if !self.shared.load(std::sync::atomic::Ordering::Acquire) {
            drop(self.export_fd()?);
        }
        Ok(())
    }

    /// Allocates `len` bytes from the pool on the device's stream and waits
    /// until the allocation has completed, so it can be exported at once.
    #[doc(alias = "cuMemAllocFromPoolAsync")]
    pub fn alloc(self: &Arc<Self>, len: usize) -> Result<PoolBuffer> {
        if len == 0 {
            return Err(Error::arg(
                "size",
                "cannot share an empty buffer; ask for at least one byte",
            ));
        }
        if len as u64 > MAX_SHARED_ALLOCATION
            && !self
                .no_size_limit
                .load(std::sync::atomic::Ordering::Relaxed)
        {
            return Err(Error::Unsupported {
                what: "a shared pool allocation this large",
                why: format!(
                    "{len} bytes is over the {MAX_SHARED_ALLOCATION}-byte limit for pool allocations shared \
                     across processes (larger ones crashed importers on driver 580); use the vmm mechanism, \
                     or call SharedPool::lift_size_limit to try anyway"
                ),
            });
        }
        self.device.bind()?;
        let stream = self.device.stream().clone();
        let s = stream.cu_stream();
        // SAFETY: pool and stream are live.
        let ptr = unsafe { pool::alloc_async(len as u64, self.pool, s) }?;
        // SAFETY: the stream is live.
        if let Err(e) = unsafe { rstream::synchronize(s) } {
            // SAFETY: allocated above, unused.
            let _ = unsafe { pool::free_async(ptr, s) };
            return Err(e);
        }
        Ok(PoolBuffer {
            pool: self.clone(),
            core: Owned::new(&self.device, ptr, len),
        })
    }

    /// Releases memory the pool holds beyond `keep` bytes back to the device.
    #[doc(alias = "cuMemPoolTrimTo")]
    pub fn trim(&self, keep: u64) -> Result<()> {
        self.device.bind()?;
        // SAFETY: live pool.
        unsafe { pool::trim_to(self.pool, keep) }
    }

    /// The device the pool allocates on.
    pub(crate) fn device(&self) -> &Device {
        &self.device
    }
}

impl Drop for SharedPool {
    fn drop(&mut self) {
        // Every PoolBuffer holds the pool, so none is alive. The driver
        // releases the pool once frees still in flight complete. Errors
        // cannot be raised from drop.
        let _ = self.device.bind();
        // SAFETY: created in `new`, destroyed once.
        let _ = unsafe { pool::destroy(self.pool) };
    }
}

/// Exports a stream-ordered allocation this process made from any pool:
/// the pool's descriptor, the pointer's export data, the allocation's base
/// and size. Fails clearly when the pool is not shareable.
pub(crate) fn export_existing(
    device: &Device,
    ptr: u64,
) -> Result<(OwnedFd, PoolPtrHandle, u64, u64)> {
    device.bind()?;
    let raw = mem::pointer_attribute_u64(
        ptr,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
    )?;
    let (base, size) = mem::address_range(ptr)?;
    // SAFETY: the driver just named this pool as the owner of live memory.
    let fd = unsafe { pool::export_fd(raw as sys::CUmemoryPool) }.map_err(|e| Error::Unsupported {
        what: "sharing this stream-ordered memory",
        why: format!(
            "its memory pool cannot be exported ({e}); it is probably the device's default pool, which \
             cudarc's CudaStream::alloc uses. Allocate from a cuda_ipc::pool::SharedPool (or with \
             cuda_ipc::LegacyBuffer::alloc / cudarc's result::malloc_sync for legacy handles)"
        ),
    })?;
    let data = pool::export_pointer(base)?;
    Ok((fd, data, base, size))
}

/// One allocation from a [`SharedPool`]. Freed (stream-ordered) on drop.
#[derive(Debug)]
pub struct PoolBuffer {
    // Before `core`: the pool goes before the stream the free was queued on,
    // as when the stream was a field of its own after it.
    pool: Arc<SharedPool>,
    core: Owned,
}

impl PoolBuffer {
    /// The 64 bytes another process needs, with the pool, to import this allocation.
    #[doc(alias = "cuMemPoolExportPointer")]
    pub fn export(&self) -> Result<PoolPtrHandle> {
        self.pool.ensure_shared()?;
        self.pool.device.bind()?;
        pool::export_pointer(self.core.ptr)
    }

    /// The pool it came from.
    pub(crate) fn pool(&self) -> &Arc<SharedPool> {
        &self.pool
    }
}

// SAFETY: the allocation is owned by the value and freed in its `Drop`,
// after its stream has finished; the accessors return the core's fixed
// fields (its device is the pool's).
owned_buffer! {
    unsafe PoolBuffer;
}

impl Drop for PoolBuffer {
    fn drop(&mut self) {
        // Errors cannot be raised from drop. The free is ordered after the
        // work queued on our stream; after a use on other streams, it is
        // retired until the whole context has finished the work queued so
        // far (no wait here).
        let (pool, stream, ptr) = (
            self.pool.clone(),
            self.core.own_stream().clone(),
            self.core.ptr,
        );
        let free = move || {
            let _ = pool.device.bind();
            // SAFETY: allocated in `SharedPool::alloc`, freed once, ordered
            // after every use (the stream's, or the whole context's).
            let _ = unsafe { pool::free_async(ptr, stream.cu_stream()) };
        };
        if self.core.foreign().used() {
            crate::sync::reaper::after_context(
                self.pool.device.context(),
                "freeing a pool allocation",
                free,
            );
        } else {
            free();
        }
    }
}

/// Another process's pool, imported into this one. Import it once per
/// exporter, then import as many pointers as needed.
#[derive(Debug)]
pub struct ImportedPool {
    device: Device,
    pool: sys::CUmemoryPool,
    /// A stream of its own on which imported pointers are freed and waited
    /// for (nothing else queues there).
    free_stream: Arc<CudaStream>,
}

// SAFETY: a pool handle is a process-wide driver object; calls bind the context first.
unsafe impl Send for ImportedPool {}
// SAFETY: as above.
unsafe impl Sync for ImportedPool {}

impl ImportedPool {
    /// Imports the pool behind `fd` and makes sure `device` can read and
    /// write it. Closes `fd`.
    #[doc(alias = "cuMemPoolImportFromShareableHandle")]
    pub fn import(device: &Device, fd: OwnedFd) -> Result<Arc<Self>> {
        device.bind()?;
        tracing::debug!("importing a memory pool");
        let raw = pool::import_fd(fd.as_fd())?;
        // The driver did not take the descriptor.
        drop(fd);
        let free_stream = match device.context().new_stream() {
            Ok(s) => s,
            Err(e) => {
                // SAFETY: imported just above, not shared yet.
                let _ = unsafe { pool::destroy(raw) };
                return Err(crate::error::from_cudarc("cuStreamCreate", e));
            }
        };
        let imported = Arc::new(ImportedPool {
            device: device.clone(),
            pool: raw,
            free_stream,
        });
        let ordinal = device.ordinal() as i32;
        // SAFETY: the pool is live (owned by `imported`).
        if !unsafe { pool::has_access_rw(raw, ordinal) }? {
            tracing::debug!(ordinal, "granting this device access to the imported pool");
            // SAFETY: as above.
            unsafe { pool::set_access_rw(raw, ordinal) }?;
            tracing::debug!(ordinal, "granted");
        }
        Ok(imported)
    }

    /// Imports one allocation of the pool, of `size` bytes (the exporter's
    /// allocation size, used for bounds checks).
    #[doc(alias = "cuMemPoolImportPointer")]
    pub(crate) fn import_pointer(
        self: &Arc<Self>,
        data: PoolPtrHandle,
        size: u64,
    ) -> Result<Arc<PoolMapping>> {
        crate::handle::refuse_zero(&data)?;
        self.device.bind()?;
        tracing::debug!(size, "importing a pool pointer");
        // SAFETY: the pool is live.
        let ptr = unsafe { pool::import_pointer(self.pool, data) }?;
        tracing::debug!(ptr, "imported a pool pointer");
        if let Err(e) = checked_bound(mem::address_range(ptr), size) {
            let s = self.device.stream().cu_stream();
            // SAFETY: imported above, unused.
            let _ = unsafe { pool::free_async(ptr, s) };
            return Err(e);
        }
        Ok(Arc::new(PoolMapping {
            pool: self.clone(),
            ptr,
            size,
            streams: UsedStreams::default(),
        }))
    }
}

/// The bound of an imported pointer: `claimed` (the descriptor's untrusted
/// allocation size) only if the driver's size of the allocation is at least
/// that. Fails closed: when the driver can't say, the import is refused.
fn checked_bound(queried: Result<(u64, u64)>, claimed: u64) -> Result<u64> {
    // The driver's error names the call (cuMemGetAddressRange).
    let (_, actual) = queried?;
    if actual < claimed {
        return Err(Error::OutOfBounds {
            offset: 0,
            len: claimed,
            size: actual,
        });
    }
    Ok(claimed)
}

impl Drop for ImportedPool {
    fn drop(&mut self) {
        // Every PoolMapping holds the pool, so all imported pointers are
        // freed. Errors cannot be raised from drop.
        let _ = self.device.bind();
        // SAFETY: imported in `import`, destroyed once.
        let _ = unsafe { pool::destroy(self.pool) };
    }
}

/// One allocation of another process's pool, imported here. Freed on drop,
/// after the device's stream has finished with it.
#[derive(Debug)]
pub struct PoolMapping {
    pool: Arc<ImportedPool>,
    ptr: u64,
    size: u64,
    streams: UsedStreams,
}

impl Sealed for PoolMapping {
    fn used_streams(&self) -> &UsedStreams {
        &self.streams
    }
}

impl Mapping for PoolMapping {
    fn device(&self) -> &Device {
        &self.pool.device
    }
    fn base(&self) -> u64 {
        self.ptr
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn mechanism(&self) -> Mechanism {
        Mechanism::Pool
    }
}

impl Drop for PoolMapping {
    fn drop(&mut self) {
        // The free is retired until every stream the views used has
        // finished (no wait here). The driver asks that an importer's free
        // completes before the exporter frees, and the exporter may free as
        // soon as our lease is released: the lease's release runs after
        // this step, which queues the free on the pool's own stream (no
        // other work) and waits for it there. Errors cannot be raised from
        // drop.
        let pool = self.pool.clone();
        let ptr = self.ptr;
        self.streams.retire(
            self.pool.device.stream(),
            "freeing an imported pool pointer",
            move || {
                let _ = pool.device.bind();
                let s = pool.free_stream.cu_stream();
                // SAFETY: imported in `import_pointer`, freed once, after
                // every stream that used it has finished; the free is
                // waited for on a stream that holds nothing else.
                unsafe {
                    let _ = pool::free_async(ptr, s);
                    let _ = rstream::synchronize(s);
                }
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::driver::sys::CUresult;

    #[test]
    fn the_bound_fails_closed_when_the_size_is_unknown() {
        let failed = Err(crate::error::driver_error(
            "cuMemGetAddressRange",
            CUresult::CUDA_ERROR_INVALID_VALUE,
        ));
        let e = checked_bound(failed, 1 << 20).unwrap_err();
        assert_eq!(
            e.driver_result(),
            Some(CUresult::CUDA_ERROR_INVALID_VALUE),
            "{e}"
        );
    }

    #[test]
    fn the_bound_is_the_claim_only_within_the_allocation() {
        assert_eq!(checked_bound(Ok((0x1000, 4096)), 4096).unwrap(), 4096);
        assert_eq!(checked_bound(Ok((0x1000, 8192)), 4096).unwrap(), 4096);
        let e = checked_bound(Ok((0x1000, 4096)), 4097).unwrap_err();
        assert!(
            matches!(
                e,
                Error::OutOfBounds {
                    len: 4097,
                    size: 4096,
                    ..
                }
            ),
            "{e}"
        );
    }
}
