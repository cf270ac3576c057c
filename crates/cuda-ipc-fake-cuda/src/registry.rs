//! What the fake knows of this process's device memory: every range a
//! device pointer may point into, the VMM handles and reservations, the
//! pools; and the host mappings under them (memfds mapped `MAP_SHARED`).

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Mutex, MutexGuard};

use cudarc::driver::sys::{CUresult, cudaError_enum as E};
use rustix::mm::{MapFlags, ProtFlags};

use crate::{Res, lock};

/// What the device may do with a range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Access {
    /// Nothing (a VMM mapping before `cuMemSetAccess`, an imported pool
    /// before `cuMemPoolSetAccess`).
    None,
    /// Reads only.
    Read,
    /// Reads and writes.
    ReadWrite,
}

impl Access {
    /// The page protection that gives the host the same rights.
    pub(crate) fn prot(self) -> ProtFlags {
        match self {
            Access::None => ProtFlags::empty(),
            Access::Read => ProtFlags::READ,
            Access::ReadWrite => ProtFlags::READ | ProtFlags::WRITE,
        }
    }
}

/// Where a range of device memory comes from.
#[derive(Debug)]
pub(crate) enum Kind {
    /// `cuMemAlloc`: its own memfd, which a legacy IPC handle names.
    Alloc {
        /// The memory.
        fd: OwnedFd,
        /// A number no other allocation of this process has had.
        id: u64,
    },
    /// A legacy IPC handle opened here (each open of the same handle counts).
    IpcOpen {
        /// The exporter's process id, server nonce and allocation number.
        key: (u32, u32, u64),
        /// How many opens are not closed yet.
        refs: u32,
    },
    /// A VMM handle mapped with `cuMemMap`.
    Vmm {
        /// The physical allocation's handle.
        handle: u64,
    },
    /// An allocation from a pool, or a pointer imported from another
    /// process's pool (counted per import).
    Pool {
        /// The pool's handle.
        pool: usize,
        /// Where the allocation starts in the pool's memfd.
        offset: u64,
        /// Imported from another process (freeing it only forgets it).
        imported: bool,
        /// Imports not freed yet (1 for an allocation of this process).
        refs: u32,
    },
    /// Host memory the device may use: `cuMemHostAlloc` (owned) or
    /// `cuMemHostRegister` (the caller's).
    Host {
        /// Allocated by `cuMemHostAlloc`, so `cuMemFreeHost` unmaps it.
        owned: bool,
    },
}

/// One range of device memory.
#[derive(Debug)]
pub(crate) struct Region {
    /// Its size in bytes.
    pub(crate) size: u64,
    /// What made it.
    pub(crate) kind: Kind,
    /// What the device may do with it.
    pub(crate) access: Access,
}

/// All of this process's device memory.
#[derive(Default)]
pub(crate) struct Registry {
    /// Ranges by start address.
    pub(crate) regions: BTreeMap<u64, Region>,
    /// Bytes of device memory this process allocated (`cuMemGetInfo`).
    pub(crate) allocated: u64,
    /// The last number handed out by [`Registry::next_id`].
    last_id: u64,
    /// VMM physical allocations by handle.
    pub(crate) handles: HashMap<u64, crate::vmm::Physical>,
    /// Address ranges reserved with `cuMemAddressReserve`: start -> size.
    pub(crate) reservations: BTreeMap<u64, u64>,
    /// Memory pools by handle.
    pub(crate) pools: HashMap<usize, crate::pool::Pool>,
}

static REGISTRY: Mutex<Option<Registry>> = Mutex::new(None);

/// The registry, locked. Stream queues are locked after it, never before.
pub(crate) fn registry() -> RegistryGuard {
    let mut g = lock(&REGISTRY);
    g.get_or_insert_with(Registry::default);
    RegistryGuard(g)
}

/// The locked registry.
pub(crate) struct RegistryGuard(MutexGuard<'static, Option<Registry>>);

impl std::ops::Deref for RegistryGuard {
    type Target = Registry;
    fn deref(&self) -> &Registry {
        self.0
            .as_ref()
            .unwrap_or_else(|| unreachable!("made by registry()"))
    }
}

impl std::ops::DerefMut for RegistryGuard {
    fn deref_mut(&mut self) -> &mut Registry {
        self.0
            .as_mut()
            .unwrap_or_else(|| unreachable!("made by registry()"))
    }
}

impl Registry {
    /// A new number, for allocation ids and VMM handles.
    pub(crate) fn next_id(&mut self) -> u64 {
        self.last_id += 1;
        self.last_id
    }

    /// The range holding `addr`: its start and the region.
    pub(crate) fn containing(&self, addr: u64) -> Option<(u64, &Region)> {
        let (base, r) = self.regions.range(..=addr).next_back()?;
        (addr < base + r.size).then_some((*base, r))
    }

    /// `Ok` when `len` bytes at `addr` are device memory the device may
    /// read (and write, when `write`), possibly over several adjacent
    /// ranges; `CUDA_ERROR_INVALID_VALUE` otherwise.
    pub(crate) fn check(&self, addr: u64, len: u64, write: bool) -> Res {
        let need = if write {
            Access::ReadWrite
        } else {
            Access::Read
        };
        let end = addr.checked_add(len).ok_or(E::CUDA_ERROR_INVALID_VALUE)?;
        let mut at = addr;
        while at < end || (len == 0 && at == addr) {
            let (base, r) = self.containing(at).ok_or(E::CUDA_ERROR_INVALID_VALUE)?;
            if self.access_of(r) < need {
                return Err(E::CUDA_ERROR_INVALID_VALUE);
            }
            at = base + r.size;
            if len == 0 {
                break;
            }
        }
        Ok(())
    }

    /// What the device may do with `r`: a pool allocation has its pool's
    /// access, anything else its own.
    fn access_of(&self, r: &Region) -> Access {
        match r.kind {
            Kind::Pool { pool, .. } => self.pools.get(&pool).map_or(Access::None, |p| p.access),
            _ => r.access,
        }
    }
}

/// Aborts the process when work queued on a stream, not finished yet,
/// uses `size` bytes at `base`, which `call` is about to free or unmap:
/// on a GPU that work would read or write memory that is gone.
pub(crate) fn assert_unused(call: &str, what: &str, base: u64, size: u64) {
    if let Some(user) = crate::stream::in_flight_user(base, size) {
        eprintln!(
            "cuda-ipc fake driver: {call} releases {what} [{base:#x}, {:#x}) while {user}, \
             queued earlier and not finished, still uses it: on a GPU that work would touch \
             freed memory. Order the release after that work (an event, or the stream's \
             own order). Aborting.",
            base + size
        );
        std::process::abort();
    }
}

/// The host's page size.
pub(crate) fn page_size() -> u64 {
    // SAFETY: sysconf reads a constant of the system.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 { n as u64 } else { 4096 }
}

/// A new memfd of `size` bytes (sparse: pages come when touched).
pub(crate) fn memfd(size: u64) -> Result<OwnedFd, CUresult> {
    let fd = rustix::fs::memfd_create("cuda-ipc-fake-device", rustix::fs::MemfdFlags::CLOEXEC)
        .map_err(|_| E::CUDA_ERROR_OUT_OF_MEMORY)?;
    rustix::fs::ftruncate(&fd, size).map_err(|_| E::CUDA_ERROR_OUT_OF_MEMORY)?;
    Ok(fd)
}

/// Maps `size` bytes of `fd` shared, anywhere, with `prot`.
pub(crate) fn map(fd: impl AsFd, size: u64, prot: ProtFlags) -> Result<u64, CUresult> {
    // SAFETY: a new mapping at an address the kernel picks; nothing else
    // is affected.
    let p = unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            size as usize,
            prot,
            MapFlags::SHARED,
            fd,
            0,
        )
    }
    .map_err(|_| E::CUDA_ERROR_OUT_OF_MEMORY)?;
    Ok(p as u64)
}

/// Maps `size` bytes of `fd` from `offset` at exactly `addr`, replacing
/// what was there (part of a reservation of ours).
///
/// # Safety
/// `addr..addr + size` is a range this fake reserved and nothing uses.
pub(crate) unsafe fn map_fixed(
    addr: u64,
    fd: impl AsFd,
    offset: u64,
    size: u64,
    prot: ProtFlags,
) -> Res {
    // SAFETY: the caller's contract: the range is ours to replace.
    unsafe {
        rustix::mm::mmap(
            addr as *mut _,
            size as usize,
            prot,
            MapFlags::SHARED | MapFlags::FIXED,
            fd,
            offset,
        )
    }
    .map(|_| ())
    .map_err(|_| E::CUDA_ERROR_OUT_OF_MEMORY)
}

/// Reserves `size` bytes of address space aligned to `align`, inaccessible.
pub(crate) fn reserve(size: u64, align: u64) -> Result<u64, CUresult> {
    let align = align.max(crate::registry::page_size());
    let total = size + align;
    // SAFETY: a new private mapping at an address the kernel picks.
    let p = unsafe {
        rustix::mm::mmap_anonymous(
            std::ptr::null_mut(),
            total as usize,
            ProtFlags::empty(),
            MapFlags::PRIVATE | MapFlags::NORESERVE,
        )
    }
    .map_err(|_| E::CUDA_ERROR_OUT_OF_MEMORY)? as u64;
    let start = p.next_multiple_of(align);
    // SAFETY: the unaligned head and the tail are parts of the mapping just
    // made that nothing uses.
    unsafe {
        if start > p {
            let _ = rustix::mm::munmap(p as *mut _, (start - p) as usize);
        }
        let tail = start + size;
        if p + total > tail {
            let _ = rustix::mm::munmap(tail as *mut _, (p + total - tail) as usize);
        }
    }
    Ok(start)
}

/// Puts an inaccessible anonymous mapping back over `size` bytes at `addr`
/// (what a reservation holds where nothing is mapped).
///
/// # Safety
/// The range is part of a reservation of ours and nothing uses it.
pub(crate) unsafe fn unmap_to_reserved(addr: u64, size: u64) {
    // SAFETY: the caller's contract.
    let _ = unsafe {
        rustix::mm::mmap_anonymous(
            addr as *mut _,
            size as usize,
            ProtFlags::empty(),
            MapFlags::PRIVATE | MapFlags::NORESERVE | MapFlags::FIXED,
        )
    };
}

/// Unmaps `size` bytes at `addr`.
///
/// # Safety
/// The range is a mapping this fake made and nothing uses it any more.
pub(crate) unsafe fn unmap(addr: u64, size: u64) {
    // SAFETY: the caller's contract. An error (which the kernel gives only
    // for bad arguments) leaves the mapping: a leak, not a fault.
    let _ = unsafe { rustix::mm::munmap(addr as *mut _, size as usize) };
}

/// Sets the host protection of `size` bytes at `addr`.
///
/// # Safety
/// The range is a mapping this fake made.
pub(crate) unsafe fn protect(addr: u64, size: u64, access: Access) -> Res {
    let flags = rustix::mm::MprotectFlags::from_bits_truncate(access.prot().bits());
    // SAFETY: the caller's contract.
    unsafe { rustix::mm::mprotect(addr as *mut _, size as usize, flags) }
        .map_err(|_| E::CUDA_ERROR_INVALID_VALUE)
}
