//! Legacy IPC memory handles.
//!
//! A handle names the exporter's memfd: its process id, descriptor number
//! and inode, so that another process of the same user opens it again
//! through `/proc/PID/fd/N` (the inode tells a reused descriptor number
//! from the allocation's). As the real driver's handles need the
//! exporter's /dev/shm, the exporter makes a marker file there and an
//! opener that cannot see it gets `CUDA_ERROR_MAP_FAILED`. The handle is of
//! the whole allocation; an opener gets the base and finds offsets itself.

use std::ffi::c_uint;
use std::os::fd::AsRawFd;

use cudarc::driver::sys::{CUdeviceptr, CUipcMem_flags, CUipcMemHandle, cudaError_enum as E};
use rustix::fs::{Mode, OFlags};
use rustix::mm::ProtFlags;

use crate::event::SHM_PREFIX;
use crate::registry::{Access, Kind, Region, assert_unused, registry};
use crate::{ctx_ok, put};

/// The first bytes of a memory handle of this fake.
const MAGIC: &[u8; 8] = b"cuFAKEmh";

/// The marker file of process `pid` in /dev/shm.
fn marker(pid: u32) -> String {
    format!("/dev/shm/{SHM_PREFIX}{pid}.mem")
}

/// The fields of a handle.
struct Fields {
    pid: u32,
    fd: i32,
    inode: u64,
    id: u64,
    size: u64,
}

impl Fields {
    fn encode(&self) -> CUipcMemHandle {
        let mut b = [0u8; 64];
        b[..8].copy_from_slice(MAGIC);
        b[8..12].copy_from_slice(&self.pid.to_le_bytes());
        b[12..16].copy_from_slice(&self.fd.to_le_bytes());
        b[16..24].copy_from_slice(&self.inode.to_le_bytes());
        b[24..32].copy_from_slice(&self.id.to_le_bytes());
        b[32..40].copy_from_slice(&self.size.to_le_bytes());
        CUipcMemHandle {
            reserved: b.map(|x| x as std::ffi::c_char),
        }
    }

    fn decode(h: &CUipcMemHandle) -> Option<Fields> {
        let b: Vec<u8> = h.reserved.iter().map(|c| *c as u8).collect();
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default());
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap_or_default());
        (&b[..8] == MAGIC && b[40..].iter().all(|x| *x == 0)).then(|| Fields {
            pid: u32_at(8),
            fd: u32_at(12) as i32,
            inode: u64_at(16),
            id: u64_at(24),
            size: u64_at(32),
        })
    }
}

fake! {
    /// `cuIpcGetMemHandle`: for memory from `cuMemAlloc` only.
    fn cuIpcGetMemHandle(pHandle: *mut CUipcMemHandle, dptr: CUdeviceptr) {
        ctx_ok()?;
        let reg = registry();
        let Some((_, Region { size, kind: Kind::Alloc { fd, id }, .. })) = reg.containing(dptr) else {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        };
        let inode = rustix::fs::fstat(fd).map_err(|_| E::CUDA_ERROR_UNKNOWN)?.st_ino;
        let pid = std::process::id();
        let path = marker(pid);
        if rustix::fs::access(path.as_str(), rustix::fs::Access::EXISTS).is_err() {
            rustix::fs::open(path.as_str(), OFlags::CREATE | OFlags::WRONLY | OFlags::CLOEXEC, Mode::from_raw_mode(0o644))
                .map_err(|_| E::CUDA_ERROR_OPERATING_SYSTEM)?;
        }
        let h = Fields { pid, fd: fd.as_raw_fd(), inode, id: *id, size: *size }.encode();
        // SAFETY: the caller's out-pointer.
        unsafe { put(pHandle, h) }
    }
}

fake! {
    /// `cuIpcOpenMemHandle_v2`: maps the exporter's whole allocation; the
    /// same handle opened again gives the same address.
    fn cuIpcOpenMemHandle_v2(pdptr: *mut CUdeviceptr, handle: CUipcMemHandle, Flags: c_uint) {
        ctx_ok()?;
        if Flags != CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as c_uint {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let f = Fields::decode(&handle).ok_or(E::CUDA_ERROR_INVALID_VALUE)?;
        if f.pid == std::process::id() {
            return Err(E::CUDA_ERROR_INVALID_CONTEXT);
        }
        let key = (f.pid, f.id);
        let mut reg = registry();
        let open = reg.regions.iter_mut().find(|(_, r)| matches!(r.kind, Kind::IpcOpen { key: k, .. } if k == key));
        if let Some((base, Region { kind: Kind::IpcOpen { refs, .. }, .. })) = open {
            *refs += 1;
            let base = *base;
            // SAFETY: the caller's out-pointer.
            return unsafe { put(pdptr, base) };
        }
        if rustix::fs::access(marker(f.pid).as_str(), rustix::fs::Access::EXISTS).is_err() {
            return Err(E::CUDA_ERROR_MAP_FAILED);
        }
        let path = format!("/proc/{}/fd/{}", f.pid, f.fd);
        let fd = rustix::fs::open(path.as_str(), OFlags::RDWR | OFlags::CLOEXEC, Mode::empty())
            .map_err(|_| E::CUDA_ERROR_INVALID_VALUE)?;
        let st = rustix::fs::fstat(&fd).map_err(|_| E::CUDA_ERROR_INVALID_VALUE)?;
        if st.st_ino != f.inode || (st.st_size as u64) < f.size {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let base = crate::registry::map(&fd, f.size, ProtFlags::READ | ProtFlags::WRITE)?;
        reg.regions.insert(base, Region { size: f.size, kind: Kind::IpcOpen { key, refs: 1 }, access: Access::ReadWrite });
        // SAFETY: the caller's out-pointer.
        unsafe { put(pdptr, base) }
    }
}

fake! {
    /// `cuIpcCloseMemHandle`: unmaps at the last close.
    fn cuIpcCloseMemHandle(dptr: CUdeviceptr) {
        ctx_ok()?;
        let mut reg = registry();
        let Some(Region { size, kind: Kind::IpcOpen { refs, .. }, .. }) = reg.regions.get_mut(&dptr) else {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        };
        *refs -= 1;
        if *refs > 0 {
            return Ok(());
        }
        let size = *size;
        assert_unused("cuIpcCloseMemHandle", "an opened legacy IPC mapping", dptr, size);
        reg.regions.remove(&dptr);
        // SAFETY: our mapping, unused (checked above).
        unsafe { crate::registry::unmap(dptr, size) };
        Ok(())
    }
}
