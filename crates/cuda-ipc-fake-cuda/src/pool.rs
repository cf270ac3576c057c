//! Stream-ordered memory pools: one sparse memfd per pool, mapped whole,
//! with a first-fit allocator over it in the process that made it. An
//! exported pool is a duplicated descriptor; an exported pointer is the
//! pool's inode, the allocation's offset and its size.

use std::collections::BTreeMap;
use std::ffi::{c_int, c_ulonglong, c_void};
use std::os::fd::{AsFd, BorrowedFd, IntoRawFd, OwnedFd};

use cudarc::driver::sys::{
    CUdeviceptr, CUmemAccess_flags as AF, CUmemAccessDesc, CUmemAllocationHandleType as HT,
    CUmemLocation, CUmemLocationType, CUmemPoolProps, CUmemPoolPtrExportData, CUmemoryPool,
    CUresult, CUstream, cudaError_enum as E,
};
use rustix::mm::ProtFlags;

use crate::registry::{Access, Kind, Region, Registry, assert_unused, registry};
use crate::stream::{Op, lookup};
use crate::{ctx_ok, put};

/// The alignment of pool allocations.
const ALIGN: u64 = 512;
/// The name the fake gives pool memfds (imports check it).
const POOL_MEMFD: &str = "cuda-ipc-fake-pool";
/// The first bytes of a pointer's export data.
const MAGIC: &[u8; 8] = b"cuFAKEpp";

/// One pool, made here or imported.
#[derive(Debug)]
pub(crate) struct Pool {
    fd: OwnedFd,
    inode: u64,
    /// Where the whole memfd is mapped in this process.
    base: u64,
    size: u64,
    /// What device 0 may do with the pool's memory.
    pub(crate) access: Access,
    imported: bool,
    /// Shareable as POSIX file descriptors.
    shareable: bool,
    /// Free ranges (offset -> length) of a pool made here.
    free: BTreeMap<u64, u64>,
    /// Allocations of this process not freed yet.
    live: usize,
    /// Destroyed while allocations were live: unmapped at the last free.
    destroyed: bool,
}

impl Pool {
    fn new(fd: OwnedFd, size: u64, imported: bool, shareable: bool) -> Result<Pool, CUresult> {
        let inode = rustix::fs::fstat(&fd)
            .map_err(|_| E::CUDA_ERROR_INVALID_VALUE)?
            .st_ino;
        let base = crate::registry::map(&fd, size, ProtFlags::READ | ProtFlags::WRITE)?;
        let access = if imported {
            Access::None
        } else {
            Access::ReadWrite
        };
        let free = if imported {
            BTreeMap::new()
        } else {
            BTreeMap::from([(0, size)])
        };
        Ok(Pool {
            fd,
            inode,
            base,
            size,
            access,
            imported,
            shareable,
            free,
            live: 0,
            destroyed: false,
        })
    }

    /// First fit: the offset of `size` free bytes.
    fn take(&mut self, size: u64) -> Option<u64> {
        let (&at, &len) = self.free.iter().find(|(_, l)| **l >= size)?;
        self.free.remove(&at);
        if len > size {
            self.free.insert(at + size, len - size);
        }
        Some(at)
    }

    /// Gives `size` bytes at `at` back, merged with their neighbours.
    fn give(&mut self, mut at: u64, mut size: u64) {
        if let Some((&next, &len)) = self.free.range(at + size..).next()
            && next == at + size
        {
            self.free.remove(&next);
            size += len;
        }
        if let Some((&prev, &len)) = self.free.range(..at).next_back()
            && prev + len == at
        {
            self.free.remove(&prev);
            at = prev;
            size += len;
        }
        self.free.insert(at, size);
    }
}

impl Registry {
    /// A new pool's handle.
    fn add_pool(&mut self, pool: Pool) -> usize {
        let h = 0xfa00_0000_0000 + (self.next_id() as usize) * 16;
        self.pools.insert(h, pool);
        h
    }

    /// Unmaps and forgets pool `h` (nothing of it may be in use).
    fn drop_pool(&mut self, call: &str, h: usize) {
        if let Some(p) = self.pools.remove(&h) {
            assert_unused(call, "a memory pool's memory", p.base, p.size);
            // SAFETY: our mapping of the whole pool, unused (checked above).
            unsafe { crate::registry::unmap(p.base, p.size) };
        }
    }
}

/// The process's default pool (cudarc's `CudaStream::alloc` uses it): not
/// shareable.
fn default_pool(reg: &mut Registry) -> Result<usize, CUresult> {
    static DEFAULT: std::sync::Mutex<usize> = std::sync::Mutex::new(0);
    let mut d = crate::lock(&DEFAULT);
    if *d == 0 {
        let size = crate::device::TOTAL_MEMORY;
        let fd = crate::registry::memfd(size)?;
        *d = reg.add_pool(Pool::new(fd, size, false, false)?);
    }
    Ok(*d)
}

/// Allocates `size` bytes from pool `h` at once (the stream's order is
/// only needed for reuse, which the fake does not do early).
fn alloc(reg: &mut Registry, h: usize, size: usize, stream: CUstream) -> Result<u64, CUresult> {
    lookup(stream)?;
    let size = (size as u64).next_multiple_of(ALIGN);
    if size == 0 {
        return Err(E::CUDA_ERROR_INVALID_VALUE);
    }
    if reg.allocated + size > crate::device::TOTAL_MEMORY {
        return Err(E::CUDA_ERROR_OUT_OF_MEMORY);
    }
    let pool = reg.pools.get_mut(&h).ok_or(E::CUDA_ERROR_INVALID_VALUE)?;
    if pool.imported || pool.destroyed {
        return Err(E::CUDA_ERROR_INVALID_VALUE);
    }
    let offset = pool.take(size).ok_or(E::CUDA_ERROR_OUT_OF_MEMORY)?;
    pool.live += 1;
    let ptr = pool.base + offset;
    reg.allocated += size;
    let kind = Kind::Pool {
        pool: h,
        offset,
        imported: false,
        refs: 1,
    };
    reg.regions.insert(
        ptr,
        Region {
            size,
            kind,
            access: Access::ReadWrite,
        },
    );
    Ok(ptr)
}

fake! {
    /// `cuMemPoolCreate`: device memory, shareable as POSIX file
    /// descriptors or not at all; fabric is `CUDA_ERROR_NOT_SUPPORTED`.
    fn cuMemPoolCreate(pool: *mut CUmemoryPool, poolProps: *const CUmemPoolProps) {
        ctx_ok()?;
        // SAFETY: the caller's pointer.
        let props = unsafe { poolProps.as_ref() }.ok_or(E::CUDA_ERROR_INVALID_VALUE)?;
        if props.location.type_ != CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE || props.location.id != 0 {
            return Err(E::CUDA_ERROR_INVALID_DEVICE);
        }
        let shareable = match props.handleTypes {
            HT::CU_MEM_HANDLE_TYPE_NONE => false,
            HT::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR => true,
            _ => return Err(E::CUDA_ERROR_NOT_SUPPORTED),
        };
        let size = match props.maxSize as u64 {
            0 => crate::device::TOTAL_MEMORY,
            n => n.next_multiple_of(crate::vmm::GRANULE),
        };
        let fd = rustix::fs::memfd_create(POOL_MEMFD, rustix::fs::MemfdFlags::CLOEXEC)
            .map_err(|_| E::CUDA_ERROR_OUT_OF_MEMORY)?;
        rustix::fs::ftruncate(&fd, size).map_err(|_| E::CUDA_ERROR_OUT_OF_MEMORY)?;
        let h = registry().add_pool(Pool::new(fd, size, false, shareable)?);
        // SAFETY: the caller's out-pointer.
        unsafe { put(pool, h as CUmemoryPool) }
    }
}

fake! {
    /// `cuMemPoolDestroy`: a pool with live allocations goes at their last free.
    fn cuMemPoolDestroy(pool: CUmemoryPool) {
        ctx_ok()?;
        let h = pool as usize;
        let mut reg = registry();
        let p = reg.pools.get_mut(&h).ok_or(E::CUDA_ERROR_INVALID_VALUE)?;
        if p.imported {
            // Imported pointers not freed keep their ranges; the mapping goes.
            reg.drop_pool("cuMemPoolDestroy", h);
        } else if p.live == 0 {
            reg.drop_pool("cuMemPoolDestroy", h);
        } else {
            p.destroyed = true;
        }
        Ok(())
    }
}

fake! {
    /// `cuMemPoolTrimTo`: the fake keeps no cached memory, so nothing to do.
    fn cuMemPoolTrimTo(pool: CUmemoryPool, minBytesToKeep: usize) {
        ctx_ok()?;
        let _ = minBytesToKeep;
        if registry().pools.contains_key(&(pool as usize)) { Ok(()) } else { Err(E::CUDA_ERROR_INVALID_VALUE) }
    }
}

fake! {
    /// `cuMemPoolExportToShareableHandle`: a new descriptor, owned by the caller.
    fn cuMemPoolExportToShareableHandle(handle_out: *mut c_void, pool: CUmemoryPool, handleType: HT, flags: c_ulonglong) {
        ctx_ok()?;
        if flags != 0 || handleType != HT::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let reg = registry();
        let p = reg.pools.get(&(pool as usize)).ok_or(E::CUDA_ERROR_INVALID_VALUE)?;
        if !p.shareable || p.imported {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let fd = p.fd.try_clone().map_err(|_| E::CUDA_ERROR_OPERATING_SYSTEM)?;
        // SAFETY: the caller's out-pointer, an int for this handle type.
        unsafe { put(handle_out.cast::<c_int>(), fd.into_raw_fd()) }
    }
}

fake! {
    /// `cuMemPoolImportFromShareableHandle`: maps the exporter's pool; the
    /// caller keeps owning the descriptor. No access until `cuMemPoolSetAccess`.
    fn cuMemPoolImportFromShareableHandle(pool_out: *mut CUmemoryPool, handle: *mut c_void, handleType: HT, flags: c_ulonglong) {
        ctx_ok()?;
        if flags != 0 || handleType != HT::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let raw = handle as usize as c_int;
        if raw < 0 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller's descriptor, borrowed for this call only.
        let fd = unsafe { BorrowedFd::borrow_raw(raw) };
        if !crate::vmm::is_our_memfd(fd, POOL_MEMFD) {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let size = rustix::fs::fstat(fd).map_err(|_| E::CUDA_ERROR_INVALID_VALUE)?.st_size as u64;
        let fd = fd.as_fd().try_clone_to_owned().map_err(|_| E::CUDA_ERROR_OPERATING_SYSTEM)?;
        let h = registry().add_pool(Pool::new(fd, size, true, true)?);
        // SAFETY: the caller's out-pointer.
        unsafe { put(pool_out, h as CUmemoryPool) }
    }
}

fake! {
    /// `cuMemPoolSetAccess`: device 0's rights over the pool's memory.
    fn cuMemPoolSetAccess(pool: CUmemoryPool, map: *const CUmemAccessDesc, count: usize) {
        ctx_ok()?;
        // SAFETY: the caller's descriptors.
        let access = unsafe { crate::vmm::access_of(map, count) }?;
        let mut reg = registry();
        let p = reg.pools.get_mut(&(pool as usize)).ok_or(E::CUDA_ERROR_INVALID_VALUE)?;
        if !p.imported && access != Access::ReadWrite {
            // The owning device always has full access to its own pool.
            return Err(E::CUDA_ERROR_INVALID_DEVICE);
        }
        // SAFETY: our mapping of the whole pool.
        unsafe { crate::registry::protect(p.base, p.size, access) }?;
        p.access = access;
        Ok(())
    }
}

fake! {
    /// `cuMemPoolGetAccess`.
    fn cuMemPoolGetAccess(flags: *mut AF, memPool: CUmemoryPool, location: *mut CUmemLocation) {
        ctx_ok()?;
        // SAFETY: the caller's pointer.
        let loc = unsafe { location.as_ref() }.ok_or(E::CUDA_ERROR_INVALID_VALUE)?;
        if loc.type_ != CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE || loc.id != 0 {
            return Err(E::CUDA_ERROR_INVALID_DEVICE);
        }
        let access = registry().pools.get(&(memPool as usize)).ok_or(E::CUDA_ERROR_INVALID_VALUE)?.access;
        let f = match access {
            Access::None => AF::CU_MEM_ACCESS_FLAGS_PROT_NONE,
            Access::Read => AF::CU_MEM_ACCESS_FLAGS_PROT_READ,
            Access::ReadWrite => AF::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the caller's out-pointer.
        unsafe { put(flags, f) }
    }
}

fake! {
    /// `cuMemAllocFromPoolAsync`.
    fn cuMemAllocFromPoolAsync(dptr: *mut CUdeviceptr, bytesize: usize, pool: CUmemoryPool, hStream: CUstream) {
        ctx_ok()?;
        let p = alloc(&mut registry(), pool as usize, bytesize, hStream)?;
        // SAFETY: the caller's out-pointer.
        unsafe { put(dptr, p) }
    }
}

fake! {
    /// `cuMemAllocAsync`: from the process's default pool.
    fn cuMemAllocAsync(dptr: *mut CUdeviceptr, bytesize: usize, hStream: CUstream) {
        ctx_ok()?;
        let mut reg = registry();
        let h = default_pool(&mut reg)?;
        let p = alloc(&mut reg, h, bytesize, hStream)?;
        // SAFETY: the caller's out-pointer.
        unsafe { put(dptr, p) }
    }
}

/// Runs a stream-ordered free of the pool range at `ptr`.
fn free_now(ptr: u64) {
    let mut reg = registry();
    let Some(Region {
        size,
        kind:
            Kind::Pool {
                pool,
                offset,
                imported,
                refs,
            },
        ..
    }) = reg.regions.get_mut(&ptr)
    else {
        return; // freed twice: the first free took it
    };
    let (size, pool, offset, imported) = (*size, *pool, *offset, *imported);
    *refs -= 1;
    if *refs > 0 {
        return;
    }
    let what = if imported {
        "a pointer imported from a pool"
    } else {
        "a pool allocation"
    };
    assert_unused("cuMemFreeAsync", what, ptr, size);
    reg.regions.remove(&ptr);
    if imported {
        return;
    }
    reg.allocated -= size;
    let Some(p) = reg.pools.get_mut(&pool) else {
        return;
    };
    p.give(offset, size);
    p.live -= 1;
    if p.destroyed && p.live == 0 {
        reg.drop_pool(
            "cuMemFreeAsync (the last allocation of a destroyed pool)",
            pool,
        );
    }
}

fake! {
    /// `cuMemFreeAsync`: the memory goes when the stream reaches the free;
    /// work of any stream still using it then aborts the process.
    fn cuMemFreeAsync(dptr: CUdeviceptr, hStream: CUstream) {
        ctx_ok()?;
        match registry().regions.get(&dptr) {
            Some(Region { kind: Kind::Pool { .. }, .. }) => {}
            _ => return Err(E::CUDA_ERROR_INVALID_VALUE),
        }
        lookup(hStream)?.push(Op {
            what: "a stream-ordered free (cuMemFreeAsync)",
            uses: Vec::new(),
            run: Box::new(move || free_now(dptr)),
        });
        Ok(())
    }
}

/// The fields of a pointer's export data.
fn encode(inode: u64, offset: u64, size: u64) -> CUmemPoolPtrExportData {
    let mut d = CUmemPoolPtrExportData { reserved: [0; 64] };
    d.reserved[..8].copy_from_slice(MAGIC);
    d.reserved[8..16].copy_from_slice(&inode.to_le_bytes());
    d.reserved[16..24].copy_from_slice(&offset.to_le_bytes());
    d.reserved[24..32].copy_from_slice(&size.to_le_bytes());
    d
}

fake! {
    /// `cuMemPoolExportPointer`: for the start of an allocation of a
    /// shareable pool made here.
    fn cuMemPoolExportPointer(shareData_out: *mut CUmemPoolPtrExportData, ptr: CUdeviceptr) {
        ctx_ok()?;
        let reg = registry();
        let Some(Region { size, kind: Kind::Pool { pool, offset, imported: false, .. }, .. }) = reg.regions.get(&ptr) else {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        };
        let p = reg.pools.get(pool).ok_or(E::CUDA_ERROR_INVALID_VALUE)?;
        if !p.shareable {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller's out-pointer.
        unsafe { put(shareData_out, encode(p.inode, *offset, *size)) }
    }
}

fake! {
    /// `cuMemPoolImportPointer`: the same offset in the imported pool.
    fn cuMemPoolImportPointer(ptr_out: *mut CUdeviceptr, pool: CUmemoryPool, shareData: *mut CUmemPoolPtrExportData) {
        ctx_ok()?;
        // SAFETY: the caller's pointer.
        let d = unsafe { shareData.as_ref() }.ok_or(E::CUDA_ERROR_INVALID_VALUE)?;
        let u64_at = |i: usize| u64::from_le_bytes(d.reserved[i..i + 8].try_into().unwrap_or_default());
        let (inode, offset, size) = (u64_at(8), u64_at(16), u64_at(24));
        let h = pool as usize;
        let mut reg = registry();
        let p = reg.pools.get(&h).ok_or(E::CUDA_ERROR_INVALID_VALUE)?;
        let valid = &d.reserved[..8] == MAGIC && p.imported && inode == p.inode && size > 0
            && offset.checked_add(size).is_some_and(|end| end <= p.size);
        if !valid {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let ptr = p.base + offset;
        match reg.regions.get_mut(&ptr) {
            Some(Region { kind: Kind::Pool { pool, refs, .. }, .. }) if *pool == h => *refs += 1,
            Some(_) => return Err(E::CUDA_ERROR_INVALID_VALUE),
            None => {
                let kind = Kind::Pool { pool: h, offset, imported: true, refs: 1 };
                reg.regions.insert(ptr, Region { size, kind, access: Access::ReadWrite });
            }
        }
        // SAFETY: the caller's out-pointer.
        unsafe { put(ptr_out, ptr) }
    }
}
