//! Host words: a sealed memfd mapped into both processes and registered
//! with the driver.

use std::ffi::c_void;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};

use super::WORD;
use crate::device::Device;
use crate::driver::result::stream_mem as raw;
use crate::error::{Error, Result};

/// Numbers host blocks of this process; mixed with the pid, and with bit 39
/// set so that no host block shares an identity with a device block
/// (whose identity is its allocation's generation).
static HOST_BLOCKS: AtomicU64 = AtomicU64::new(1);

pub(super) fn next_host_id() -> u64 {
    (u64::from(std::process::id()) << 40) | (1 << 39) | HOST_BLOCKS.fetch_add(1, Ordering::Relaxed)
}

/// The bytes of a host block of `words` words: whole pages.
pub(super) fn host_len(words: u32) -> usize {
    (u64::from(words) * WORD).next_multiple_of(4096) as usize
}

/// Creates a sealed memfd of `len` bytes: it can never shrink or grow, so
/// that no process holding it can make another's mapping fault.
pub(super) fn create_memfd(len: usize) -> Result<OwnedFd> {
    use rustix::fs::{MemfdFlags, SealFlags};
    let io = |what: &str, e: rustix::io::Errno| {
        Error::io(format!("creating a fence block ({what})"), e.into())
    };
    let fd = rustix::fs::memfd_create(
        "cuda-ipc-fence",
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )
    .map_err(|e| io("memfd_create", e))?;
    rustix::fs::ftruncate(&fd, len as u64).map_err(|e| io("ftruncate", e))?;
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
        .map_err(|e| io("fcntl F_ADD_SEALS", e))?;
    Ok(fd)
}

/// Checks that `fd`, received from another process, is a memfd sealed
/// against shrinking and holds at least `len` bytes.
pub(super) fn check_memfd(fd: &OwnedFd, len: usize) -> Result<()> {
    let bad = |reason: String| Error::arg("fence block's file descriptor", reason);
    let seals = rustix::fs::fcntl_get_seals(fd).map_err(|e| {
        bad(format!(
            "it is not a sealed memfd ({e}); host fence blocks come from Fence::new_host"
        ))
    })?;
    if !seals.contains(rustix::fs::SealFlags::SHRINK) {
        return Err(bad(
            "its memfd can still shrink, which would fault our mapping; the exporter must seal it"
                .into(),
        ));
    }
    let size = rustix::fs::fstat(fd)
        .map_err(|e| Error::io("reading the fence block's size (fstat)", e.into()))?
        .st_size;
    if u64::try_from(size).unwrap_or(0) < len as u64 {
        return Err(bad(format!(
            "its memfd holds {size} bytes, fewer than the {len} its words need"
        )));
    }
    Ok(())
}

/// Sequence words in a memfd mapped into this process and registered with
/// the driver, reachable by the CPU at `ptr` and by the device at `dptr`.
#[derive(Debug)]
pub(super) struct HostWords {
    pub(super) device: Device,
    pub(super) fd: OwnedFd,
    ptr: *mut c_void,
    pub(super) len: usize,
    pub(super) dptr: u64,
}

// SAFETY: the mapping is process-wide memory, accessed only through atomics
// and driver calls that bind the context first.
unsafe impl Send for HostWords {}
// SAFETY: as above.
unsafe impl Sync for HostWords {}

impl HostWords {
    /// Maps `len` bytes of `fd` and registers them with the driver.
    pub(super) fn map(device: &Device, fd: OwnedFd, len: usize) -> Result<Self> {
        use rustix::mm::{MapFlags, ProtFlags};
        // SAFETY: a new shared mapping of a sealed memfd of at least `len`
        // bytes (checked by the callers): it aliases no Rust object.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                0,
            )
        }
        .map_err(|e| Error::io("mapping a fence block (mmap)", e.into()))?;
        let unmap = || {
            // SAFETY: mapped above, not yet registered or shared.
            let _ = unsafe { rustix::mm::munmap(ptr, len) };
        };
        let registered = device.bind().and_then(|()| {
            // SAFETY: `ptr..ptr + len` is the page-aligned mapping made above,
            // unregistered in drop before it is unmapped.
            unsafe { raw::host_register(ptr, len) }
        });
        if let Err(e) = registered {
            unmap();
            return Err(e);
        }
        // SAFETY: registered just above.
        match unsafe { raw::host_device_pointer(ptr) } {
            Ok(dptr) => Ok(HostWords {
                device: device.clone(),
                fd,
                ptr,
                len,
                dptr,
            }),
            Err(e) => {
                // SAFETY: registered above; nothing has used it.
                let _ = unsafe { raw::host_unregister(ptr) };
                unmap();
                Err(e)
            }
        }
    }

    /// Word `i`, which the caller has checked is in range.
    pub(super) fn word(&self, i: u32) -> &AtomicU64 {
        // SAFETY: `ptr` is page-aligned, the mapping holds at least `i + 1`
        // words and lives as long as `self`; other processes and the device
        // touch it only with aligned 64-bit accesses.
        unsafe { &*self.ptr.cast::<AtomicU64>().add(i as usize) }
    }
}

impl Drop for HostWords {
    fn drop(&mut self) {
        // Errors cannot be raised from drop: an unregister that fails leaves
        // pinned pages until the process exits, a failed unmap the same.
        // The words are dropped only by the release a `Fence` or
        // `FenceMapping` retired, after every stream that signalled or
        // waited on them has finished (see their `Drop`).
        let _ = self.device.bind();
        // SAFETY: registered in `map`, unregistered once, then unmapped once.
        unsafe {
            let _ = raw::host_unregister(self.ptr);
            let _ = rustix::mm::munmap(self.ptr, self.len);
        }
    }
}
