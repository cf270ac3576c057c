//! The storage handle PyTorch's `_share_cuda_` returns, decoded.

use crate::error::Result;
use crate::handle::{FabricHandle, HANDLE_LEN, Handle, IpcMemHandle};

use super::{
    CUDA_MALLOC_HANDLE_LEN, HANDLE_VERSIONS, SEGMENT_HEADER_LEN_V2, SEGMENT_HEADER_LEN_V3,
    TYPE_CUDA_MALLOC, TYPE_EXPANDABLE_SEGMENT, torch_err,
};

/// How the payload of an expandable segment names its physical allocations.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SegmentHandles {
    /// POSIX file descriptor numbers in the exporting process, one per
    /// allocation, to be taken with `pidfd_getfd(pidfd_open(pid), fd)`.
    PosixFds(Vec<i32>),
    /// Fabric handles, one per allocation (an NVLink domain with IMEX).
    Fabric(Vec<FabricHandle>),
}

impl SegmentHandles {
    /// The number of physical allocations.
    pub fn len(&self) -> usize {
        match self {
            SegmentHandles::PosixFds(v) => v.len(),
            SegmentHandles::Fabric(v) => v.len(),
        }
    }

    /// Whether there are none (never true for a parsed handle).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The kind, in words.
    pub fn kind(&self) -> &'static str {
        match self {
            SegmentHandles::PosixFds(_) => "POSIX file descriptors",
            SegmentHandles::Fabric(_) => "fabric handles",
        }
    }
}

/// The payload of an `'e'` storage handle: the part of an expandable segment
/// PyTorch shared, as `ExpandableSegment::share` writes it.
///
/// # Layout (native byte order, little-endian on x86-64 and aarch64)
/// Version 2 (PyTorch up to 2.12), after the version and type bytes:
///
/// | bytes | field |
/// |---|---|
/// | 0..4 | `pid` (`pid_t`): the exporting process |
/// | 4..8 | padding (not always zero; ignored) |
/// | 8..16 | `segment_size` (`size_t`): bytes per physical allocation |
/// | 16..24 | `num_handles` (`size_t`): physical allocations shared |
/// | 24.. | `num_handles` handles: 4-byte `int` file descriptors, or 64-byte `CUmemFabricHandle`s |
///
/// Version 2 does not say which kind of handle follows (the importer uses
/// its own configuration); we tell them apart by the length, which is
/// unambiguous.
///
/// Version 3 (PyTorch 2.13) adds the handle type to the header
/// (pytorch/pytorch#179618: `1` POSIX file descriptor, `2` fabric). This
/// build reads it as an `i32` at bytes 24..28 followed by 4 bytes of padding
/// (a 32-byte header) and checks it against the length; if that reading does
/// not fit the length, it falls back to the version 2 layout. This version 3
/// layout was inferred from PyTorch's change notes, not from bytes a real
/// PyTorch 2.13 wrote: [`StorageHandle::parse`] refuses any handle that fits
/// neither layout exactly, so a wrong guess is an error, never a wrong mapping.
///
/// # Importing
/// Take each descriptor from `pid` (`pidfd_getfd`), import it
/// (`cuMemImportFromShareableHandle`), and map the allocations back to back
/// in one reservation of `segment_size * num_handles` bytes
/// (`vmm::VmmMapping::import_segments(device, fds, segment_size)`); the
/// tensor starts `storage_offset_bytes + tensor_offset * elem_size` bytes in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpandableSegment {
    /// The exporting process, whose descriptor table holds the file descriptors.
    pub pid: u32,
    /// The size of each physical allocation, in bytes (PyTorch uses 2 MiB
    /// for its small pool and 20 MiB for its large one).
    pub segment_size: u64,
    /// One handle per physical allocation, in address order.
    pub handles: SegmentHandles,
}

impl ExpandableSegment {
    /// The number of physical allocations.
    pub fn num_segments(&self) -> usize {
        self.handles.len()
    }

    /// The bytes to reserve and map: `segment_size * num_segments`.
    pub fn mapped_size(&self) -> Result<u64> {
        self.segment_size
            .checked_mul(self.num_segments() as u64)
            .ok_or_else(|| torch_err("the shared range of the expandable segment overflows"))
    }

    /// The file descriptor numbers in the exporter, if that is the kind.
    pub fn fds(&self) -> Option<&[i32]> {
        match &self.handles {
            SegmentHandles::PosixFds(v) => Some(v),
            SegmentHandles::Fabric(_) => None,
        }
    }
}

/// A parsed storage handle (`storage._share_cuda_()[1]`).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StorageHandle {
    /// A block of a `cudaMalloc` allocation (type `'c'`).
    CudaMalloc {
        /// The handle's version byte (2 or 3).
        version: u8,
        /// The whole allocation's legacy IPC handle.
        handle: IpcMemHandle,
    },
    /// A range of an expandable segment (type `'e'`).
    Expandable {
        /// The handle's version byte (2 or 3).
        version: u8,
        /// The shared range.
        segment: ExpandableSegment,
    },
}

fn read_u64(bytes: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[at..at + 8]);
    u64::from_ne_bytes(b)
}

fn read_i32(bytes: &[u8], at: usize) -> i32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&bytes[at..at + 4]);
    i32::from_ne_bytes(b)
}

fn describe_type(t: u8) -> String {
    if t.is_ascii_graphic() {
        format!("0x{t:02x} ({:?})", t as char)
    } else {
        format!("0x{t:02x}")
    }
}

impl StorageHandle {
    /// Parses the bytes of a storage handle, accepting versions 2 and 3 and
    /// types `'c'` and `'e'`; anything else is an [`Error::Torch`](cuda_ipc_core::Error::Torch) that
    /// names the version and type byte found.
    pub fn parse(bytes: &[u8]) -> Result<Self> {
        let (version, kind) = match bytes {
            [v, t, ..] => (*v, *t),
            _ => {
                return Err(torch_err(format!(
                    "storage handle is {} byte(s) long; a handle starts with a version byte and a \
                     type byte",
                    bytes.len()
                )));
            }
        };
        if !HANDLE_VERSIONS.contains(&version) {
            return Err(torch_err(format!(
                "storage handle version {version} (type byte {}) is not supported: this build \
                 reads versions 2 (PyTorch up to 2.12) and 3 (PyTorch 2.13)",
                describe_type(kind)
            )));
        }
        let payload = &bytes[2..];
        match kind {
            TYPE_CUDA_MALLOC => {
                if bytes.len() != CUDA_MALLOC_HANDLE_LEN {
                    return Err(torch_err(format!(
                        "storage handle of version {version}, type 'c' (cudaMalloc block) is {} \
                         bytes long; it must be {CUDA_MALLOC_HANDLE_LEN} (2 + a {HANDLE_LEN}-byte \
                         cudaIpcMemHandle)",
                        bytes.len()
                    )));
                }
                let handle = IpcMemHandle::from_bytes(payload)?;
                if handle.is_zero() {
                    return Err(torch_err(
                        "storage handle of type 'c' holds an all-zero cudaIpcMemHandle, which no \
                         driver issues",
                    ));
                }
                Ok(StorageHandle::CudaMalloc { version, handle })
            }
            TYPE_EXPANDABLE_SEGMENT => Ok(StorageHandle::Expandable {
                version,
                segment: parse_segment(version, payload)?,
            }),
            other => Err(torch_err(format!(
                "storage handle of version {version} has type byte {}: this build reads 'c' \
                 (cudaMalloc block) and 'e' (expandable segment)",
                describe_type(other)
            ))),
        }
    }

    /// The version byte.
    pub fn version(&self) -> u8 {
        match self {
            StorageHandle::CudaMalloc { version, .. }
            | StorageHandle::Expandable { version, .. } => *version,
        }
    }

    /// The type byte (`b'c'` or `b'e'`).
    pub fn type_byte(&self) -> u8 {
        match self {
            StorageHandle::CudaMalloc { .. } => TYPE_CUDA_MALLOC,
            StorageHandle::Expandable { .. } => TYPE_EXPANDABLE_SEGMENT,
        }
    }

    /// The bytes PyTorch would write for this handle (for version 3
    /// expandable segments, in the layout this build reads).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = vec![self.version(), self.type_byte()];
        match self {
            StorageHandle::CudaMalloc { handle, .. } => out.extend_from_slice(handle.as_bytes()),
            StorageHandle::Expandable { version, segment } => {
                out.extend_from_slice(&(segment.pid as i32).to_ne_bytes());
                out.extend_from_slice(&[0; 4]);
                out.extend_from_slice(&segment.segment_size.to_ne_bytes());
                out.extend_from_slice(&(segment.num_segments() as u64).to_ne_bytes());
                if *version >= 3 {
                    let kind: i32 = match segment.handles {
                        SegmentHandles::PosixFds(_) => 1,
                        SegmentHandles::Fabric(_) => 2,
                    };
                    out.extend_from_slice(&kind.to_ne_bytes());
                    out.extend_from_slice(&[0; 4]);
                }
                match &segment.handles {
                    SegmentHandles::PosixFds(fds) => {
                        for fd in fds {
                            out.extend_from_slice(&fd.to_ne_bytes());
                        }
                    }
                    SegmentHandles::Fabric(hs) => {
                        for h in hs {
                            out.extend_from_slice(h.as_bytes());
                        }
                    }
                }
            }
        }
        out
    }
}

/// Which handle kind a header says (version 3) or the length implies.
#[derive(Clone, Copy, PartialEq, Eq)]
enum HandleKind {
    Fd,
    Fabric,
}

impl HandleKind {
    fn size(self) -> usize {
        match self {
            HandleKind::Fd => 4,
            HandleKind::Fabric => HANDLE_LEN,
        }
    }
}

/// Whether `count` handles of `kind` fill exactly `available` bytes.
fn fits(count: u64, kind: HandleKind, available: usize) -> bool {
    count
        .checked_mul(kind.size() as u64)
        .is_some_and(|n| n == available as u64)
}

fn parse_segment(version: u8, payload: &[u8]) -> Result<ExpandableSegment> {
    if payload.len() < SEGMENT_HEADER_LEN_V2 {
        return Err(torch_err(format!(
            "storage handle of version {version}, type 'e' (expandable segment) has a {}-byte \
             payload, shorter than the {SEGMENT_HEADER_LEN_V2}-byte segment header",
            payload.len()
        )));
    }
    let pid = read_i32(payload, 0);
    // Bytes 4..8 are padding: older PyTorch left them uninitialised
    // (before pytorch/pytorch#161885), and 2.13 may again
    // (pytorch/pytorch#198305), so they are not checked.
    let segment_size = read_u64(payload, 8);
    let count = read_u64(payload, 16);
    let describe = || {
        format!(
            "storage handle of version {version}, type 'e' (expandable segment): header says \
             {count} segment(s) of {segment_size} bytes, and {} payload bytes follow the \
             {SEGMENT_HEADER_LEN_V2}-byte header",
            payload.len() - SEGMENT_HEADER_LEN_V2
        )
    };

    // Find the layout that accounts for every byte.
    let mut layout: Option<(usize, HandleKind)> = None;
    if version >= 3 && payload.len() >= SEGMENT_HEADER_LEN_V3 {
        let kind = match read_i32(payload, 24) {
            1 => Some(HandleKind::Fd),
            2 => Some(HandleKind::Fabric),
            _ => None,
        };
        if let Some(kind) = kind
            && fits(count, kind, payload.len() - SEGMENT_HEADER_LEN_V3)
        {
            layout = Some((SEGMENT_HEADER_LEN_V3, kind));
        }
    }
    if layout.is_none() {
        let rest = payload.len() - SEGMENT_HEADER_LEN_V2;
        layout = [HandleKind::Fd, HandleKind::Fabric]
            .into_iter()
            .find(|k| fits(count, *k, rest))
            .map(|k| (SEGMENT_HEADER_LEN_V2, k));
    }
    let Some((header_len, kind)) = layout else {
        return Err(torch_err(format!(
            "{}: that is not a whole number of 4-byte file descriptors or 64-byte fabric \
             handles for the stated count (a truncated or foreign handle)",
            describe()
        )));
    };
    if count == 0 {
        return Err(torch_err(format!("{}: no segments to map", describe())));
    }
    if pid <= 0 {
        return Err(torch_err(format!(
            "{}: the exporter's pid {pid} is not a process id",
            describe()
        )));
    }
    if segment_size == 0 {
        return Err(torch_err(format!("{}: segment size 0", describe())));
    }
    if segment_size.checked_mul(count).is_none() {
        return Err(torch_err(format!(
            "{}: the shared range overflows",
            describe()
        )));
    }
    let body = &payload[header_len..];
    let handles = match kind {
        HandleKind::Fd => {
            let fds: Vec<i32> = body.chunks_exact(4).map(|c| read_i32(c, 0)).collect();
            if let Some((i, fd)) = fds.iter().enumerate().find(|(_, fd)| **fd < 0) {
                return Err(torch_err(format!(
                    "{}: file descriptor {i} is {fd}, not a descriptor number",
                    describe()
                )));
            }
            SegmentHandles::PosixFds(fds)
        }
        HandleKind::Fabric => SegmentHandles::Fabric(
            body.chunks_exact(HANDLE_LEN)
                .map(FabricHandle::from_bytes)
                .collect::<Result<_>>()?,
        ),
    };
    Ok(ExpandableSegment {
        pid: pid as u32,
        segment_size,
        handles,
    })
}
