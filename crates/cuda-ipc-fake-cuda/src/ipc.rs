//! Legacy IPC memory handles.
//!
//! The real driver resolves a handle in its kernel module, so a handle
//! opens from another PID, IPC, mount or user namespace. The fake gives
//! each exporting process a small server on an abstract Unix socket (named
//! by the process id and a random number, both in the handle): an opener
//! connects, names the allocation, and receives its memfd over
//! `SCM_RIGHTS`. When the exporter has freed the allocation or exited, the
//! open fails with `CUDA_ERROR_INVALID_VALUE`, as the driver's does. The
//! handle is of the whole allocation; an opener gets the base and finds
//! offsets itself.

use std::ffi::c_uint;
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::OnceLock;

use cudarc::driver::sys::{
    CUdeviceptr, CUipcMem_flags, CUipcMemHandle, CUresult, cudaError_enum as E,
};
use rustix::mm::ProtFlags;
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};

use crate::registry::{Access, Kind, Region, assert_unused, registry};
use crate::{ctx_ok, put};

/// The first bytes of a memory handle of this fake.
const MAGIC: &[u8; 8] = b"cuFAKEmh";

/// The abstract socket name of the server of process `pid` with `nonce`.
fn server_name(pid: u32, nonce: u32) -> Result<SocketAddrUnix, CUresult> {
    SocketAddrUnix::new_abstract_name(format!("cuda-ipc-fake-mem.{pid}.{nonce:08x}").as_bytes())
        .map_err(|_| E::CUDA_ERROR_OPERATING_SYSTEM)
}

/// This process's handle server: its nonce, once started.
static SERVER: OnceLock<Result<u32, CUresult>> = OnceLock::new();

/// Starts this process's handle server (once) and returns its nonce.
fn server() -> Result<u32, CUresult> {
    *SERVER.get_or_init(|| {
        let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
        let nonce = (t.tv_nsec as u32) ^ (std::process::id() << 12) | 1;
        let sock = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::STREAM,
            SocketFlags::CLOEXEC,
            None,
        )
        .map_err(|_| E::CUDA_ERROR_OPERATING_SYSTEM)?;
        rustix::net::bind(&sock, &server_name(std::process::id(), nonce)?)
            .map_err(|_| E::CUDA_ERROR_OPERATING_SYSTEM)?;
        rustix::net::listen(&sock, 64).map_err(|_| E::CUDA_ERROR_OPERATING_SYSTEM)?;
        std::thread::Builder::new()
            .name("fake-cuda-ipc".into())
            .spawn(move || {
                while let Ok(conn) = rustix::net::accept_with(&sock, SocketFlags::CLOEXEC) {
                    serve(&conn);
                }
            })
            .map_err(|_| E::CUDA_ERROR_OPERATING_SYSTEM)?;
        Ok(nonce)
    })
}

/// Answers one opener: reads an allocation number, sends a byte (1: found)
/// with the allocation's memfd attached when found.
fn serve(conn: &OwnedFd) {
    let mut id = [0u8; 8];
    if !matches!(rustix::io::read(conn, &mut id), Ok(8)) {
        return;
    }
    let id = u64::from_le_bytes(id);
    let fd = {
        let reg = registry();
        reg.regions.values().find_map(|r| match &r.kind {
            Kind::Alloc { fd, id: i } if *i == id => fd.try_clone().ok(),
            _ => None,
        })
    };
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds;
    let answer = if let Some(fd) = &fd {
        fds = [fd.as_fd()];
        control.push(SendAncillaryMessage::ScmRights(&fds));
        [1u8]
    } else {
        [0u8]
    };
    let _ = rustix::net::sendmsg(
        conn,
        &[IoSlice::new(&answer)],
        &mut control,
        SendFlags::NOSIGNAL,
    );
}

/// Asks the server `(pid, nonce)` for allocation `id`'s memfd.
fn fetch(pid: u32, nonce: u32, id: u64) -> Result<OwnedFd, CUresult> {
    let sock = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC,
        None,
    )
    .map_err(|_| E::CUDA_ERROR_OPERATING_SYSTEM)?;
    // The exporter exited (its server with it): the handle names nothing.
    rustix::net::connect(&sock, &server_name(pid, nonce)?)
        .map_err(|_| E::CUDA_ERROR_INVALID_VALUE)?;
    rustix::io::write(&sock, &id.to_le_bytes()).map_err(|_| E::CUDA_ERROR_INVALID_VALUE)?;
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut answer = [0u8];
    let got = rustix::net::recvmsg(
        &sock,
        &mut [IoSliceMut::new(&mut answer)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    );
    let mut fd = None;
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(mut received) = m {
            fd = fd.or(received.next());
        }
    }
    match (got, fd) {
        (Ok(r), Some(fd)) if r.bytes == 1 && answer[0] == 1 => Ok(fd),
        _ => Err(E::CUDA_ERROR_INVALID_VALUE),
    }
}

/// The fields of a handle.
struct Fields {
    pid: u32,
    nonce: u32,
    id: u64,
    size: u64,
}

impl Fields {
    fn encode(&self) -> CUipcMemHandle {
        let mut b = [0u8; 64];
        b[..8].copy_from_slice(MAGIC);
        b[8..12].copy_from_slice(&self.pid.to_le_bytes());
        b[12..16].copy_from_slice(&self.nonce.to_le_bytes());
        b[16..24].copy_from_slice(&self.id.to_le_bytes());
        b[24..32].copy_from_slice(&self.size.to_le_bytes());
        CUipcMemHandle {
            reserved: b.map(|x| x as std::ffi::c_char),
        }
    }

    fn decode(h: &CUipcMemHandle) -> Option<Fields> {
        let b: Vec<u8> = h.reserved.iter().map(|c| *c as u8).collect();
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default());
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap_or_default());
        (&b[..8] == MAGIC && b[32..].iter().all(|x| *x == 0)).then(|| Fields {
            pid: u32_at(8),
            nonce: u32_at(12),
            id: u64_at(16),
            size: u64_at(24),
        })
    }
}

fake! {
    /// `cuIpcGetMemHandle`: for memory from `cuMemAlloc` only.
    fn cuIpcGetMemHandle(pHandle: *mut CUipcMemHandle, dptr: CUdeviceptr) {
        ctx_ok()?;
        let nonce = server()?;
        let reg = registry();
        let Some((_, Region { size, kind: Kind::Alloc { id, .. }, .. })) = reg.containing(dptr) else {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        };
        let h = Fields { pid: std::process::id(), nonce, id: *id, size: *size }.encode();
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
        if matches!(SERVER.get(), Some(Ok(n)) if *n == f.nonce) && f.pid == std::process::id() {
            return Err(E::CUDA_ERROR_INVALID_CONTEXT);
        }
        let key = (f.pid, f.nonce, f.id);
        {
            let mut reg = registry();
            let open = reg.regions.iter_mut().find(|(_, r)| matches!(r.kind, Kind::IpcOpen { key: k, .. } if k == key));
            if let Some((base, Region { kind: Kind::IpcOpen { refs, .. }, .. })) = open {
                *refs += 1;
                let base = *base;
                // SAFETY: the caller's out-pointer.
                return unsafe { put(pdptr, base) };
            }
        }
        // Outside the registry's lock: the exporter may be this process's
        // parent asking us for something at the same time.
        let fd = fetch(f.pid, f.nonce, f.id)?;
        let st = rustix::fs::fstat(&fd).map_err(|_| E::CUDA_ERROR_INVALID_VALUE)?;
        if (st.st_size as u64) < f.size {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let base = crate::registry::map(&fd, f.size, ProtFlags::READ | ProtFlags::WRITE)?;
        registry().regions.insert(base, Region { size: f.size, kind: Kind::IpcOpen { key, refs: 1 }, access: Access::ReadWrite });
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
