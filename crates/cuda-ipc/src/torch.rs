//! Interoperability with PyTorch's CUDA tensor sharing.
//!
//! When PyTorch sends a CUDA tensor to another process
//! (`torch.multiprocessing`), `torch.multiprocessing.reductions.reduce_tensor`
//! turns it into the arguments of `rebuild_cuda_tensor`:
//!
//! ```text
//! (tensor_cls, tensor_size, tensor_stride, tensor_offset, storage_cls, dtype,
//!  storage_device, storage_handle, storage_size_bytes, storage_offset_bytes,
//!  requires_grad, ref_counter_handle, ref_counter_offset, event_handle,
//!  event_sync_required)
//! ```
//!
//! A [`ShareRecord`] is those arguments as language-neutral JSON (bytes as
//! hex, sizes as arrays, the dtype as a name), plus what a process that is not
//! PyTorch needs besides: the exporter's process id and the device's UUID.
//! The Python helper `cuda_ipc.torch_share_record(tensor)` writes one:
//!
//! ```json
//! {"torch_share": 1,
//!  "storage_handle": "0263<128 hex digits>",
//!  "storage_size_bytes": 4096, "storage_offset_bytes": 1024,
//!  "tensor_size": [4, 8], "tensor_stride": [8, 1], "tensor_offset": 16,
//!  "dtype": "float32", "storage_device": 0,
//!  "device_uuid": "GPU-12345678-9abc-def0-0102-030405060708", "pid": 4242,
//!  "requires_grad": false,
//!  "ref_counter_handle": "2f746f7263685f...", "ref_counter_offset": 0,
//!  "event_handle": "<128 hex digits>", "event_sync_required": true}
//! ```
//!
//! [`ShareRecord::to_descriptor`] turns it into our [`Descriptor`], which
//! [`share::open`](crate::share) (or `cuda-ipc open`) maps.
//!
//! # The storage handle
//! `storage._share_cuda_()` returns the handle written by the caching
//! allocator's `shareIpcHandle`: a version byte (2 up to PyTorch 2.12, 3 from
//! 2.13), a type byte, then a payload ([`StorageHandle::parse`]):
//!
//! - `'c'`: a block of a `cudaMalloc` allocation; the payload is the
//!   allocation's 64-byte `cudaIpcMemHandle_t` (66 bytes in all). The same in
//!   versions 2 and 3. `storage_offset_bytes` is the storage's offset inside
//!   the allocation.
//! - `'e'`: a range of an *expandable segment* (`PYTORCH_CUDA_ALLOC_CONF=
//!   expandable_segments:True`), a VMM reservation mapped from equal-sized
//!   physical allocations. The payload ([`ExpandableSegment`]) is a header
//!   (the exporter's pid, the size of one physical allocation, their number)
//!   followed by one shareable handle per allocation: a POSIX file
//!   descriptor number in the exporter (taken with `pidfd_getfd`), or a
//!   64-byte fabric handle. `storage_offset_bytes` is then the storage's
//!   offset from the start of the first shared allocation.
//!
//! # What is carried and what is not
//! PyTorch's own reference counting (`ref_counter_handle`, a shared-memory
//! file the consumer decrements when done) is recorded but not used: a
//! consumer that is not PyTorch never decrements it, so the exporter must
//! release it itself when its consumers are done (the Python helper's
//! `Export.close()` does). See `docs/PYTHON.md` for lifetimes.

use std::fmt;

use serde_json::{Map, Value};

use crate::descriptor::{Descriptor, Dtype, Source};
use crate::device::DeviceUuid;
use crate::error::{Error, Result};
use crate::handle::{FabricHandle, HANDLE_LEN, IpcEventHandle, IpcMemHandle};
use crate::json::{Fields, kind_of};

/// The record format this build writes and reads.
pub const RECORD_FORMAT: u64 = 1;

/// The key that carries the record format (and marks a JSON object as a
/// PyTorch share record rather than a [`Descriptor`]).
pub const RECORD_KEY: &str = "torch_share";

/// Storage handle versions this build reads.
pub const HANDLE_VERSIONS: [u8; 2] = [2, 3];

/// Type byte of a `cudaMalloc` block (`SHAREABLE_CUDA_MALLOC`).
pub const TYPE_CUDA_MALLOC: u8 = b'c';

/// Type byte of an expandable segment (`SHAREABLE_CUDA_EXPANDABLE_SEGMENT`).
pub const TYPE_EXPANDABLE_SEGMENT: u8 = b'e';

/// Length of a `'c'` storage handle: version, type and a 64-byte IPC handle.
pub const CUDA_MALLOC_HANDLE_LEN: usize = 2 + HANDLE_LEN;

/// Length of the expandable segment header up to version 2:
/// `{pid: i32, 4 bytes of padding, segment_size: u64, num_handles: u64}`.
pub const SEGMENT_HEADER_LEN_V2: usize = 24;

/// Length of the expandable segment header of version 3 as this build reads
/// it: the version 2 header followed by the handle type (`i32`) and 4 bytes
/// of padding. See [`ExpandableSegment`] for how sure we are of it.
pub const SEGMENT_HEADER_LEN_V3: usize = 32;

fn torch_err(reason: impl Into<String>) -> Error {
    Error::Torch(reason.into())
}

fn field_err(field: &str, reason: impl fmt::Display) -> Error {
    Error::Torch(format!("field `{field}`: {reason}"))
}

/// The PyTorch name of an element type (`torch.float32` is `"float32"`).
pub fn torch_dtype_name(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::Bool => "bool",
        Dtype::U8 => "uint8",
        Dtype::I8 => "int8",
        Dtype::U16 => "uint16",
        Dtype::I16 => "int16",
        Dtype::U32 => "uint32",
        Dtype::I32 => "int32",
        Dtype::U64 => "uint64",
        Dtype::I64 => "int64",
        Dtype::F16 => "float16",
        Dtype::Bf16 => "bfloat16",
        Dtype::F32 => "float32",
        Dtype::F64 => "float64",
    }
}

/// The element type of a PyTorch dtype name (`"float32"`, `"bfloat16"`,
/// ...: `str(torch.float32)` without the `torch.` prefix).
pub fn dtype_from_torch(name: &str) -> Result<Dtype> {
    if let Some(d) = Dtype::ALL
        .into_iter()
        .find(|d| torch_dtype_name(*d) == name)
    {
        return Ok(d);
    }
    let known: Vec<_> = Dtype::ALL.iter().map(|d| torch_dtype_name(*d)).collect();
    let hint = if let Some(bare) = name.strip_prefix("torch.") {
        format!(" (write {bare:?}, without the torch. prefix)")
    } else {
        String::new()
    };
    Err(torch_err(format!(
        "dtype {name:?} cannot be shared{hint}: the element types that can are {}",
        known.join(", ")
    )))
}

/// How the payload of an expandable segment names its physical allocations.
#[derive(Clone, Debug, PartialEq, Eq)]
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
    /// types `'c'` and `'e'`; anything else is an [`Error::Torch`] that
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

/// Where a tensor lies in the memory its storage handle shares, and what it
/// holds: the part of a [`Descriptor`] that does not depend on the mechanism.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorLayout {
    /// Bytes from the start of the shared memory (the `cudaMalloc`
    /// allocation, or the first shared segment) to the tensor's first element.
    pub offset: u64,
    /// Bytes from the first element to one past the last one reached.
    pub len: u64,
    /// The element type.
    pub dtype: Dtype,
    /// Dimensions in elements.
    pub shape: Vec<u64>,
    /// Strides in elements, if the tensor is not contiguous row-major.
    pub strides: Option<Vec<u64>>,
}

/// A CUDA tensor shared by PyTorch, as language-neutral JSON (see the
/// [module documentation](self) for the format). Decoding is strict: unknown
/// fields, wrong types, negative or fractional sizes and malformed hex are
/// errors that name the field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShareRecord {
    /// `storage._share_cuda_()`'s handle, raw (see [`StorageHandle`]).
    pub storage_handle: Vec<u8>,
    /// Size of the tensor's storage in bytes.
    pub storage_size_bytes: u64,
    /// Offset of the storage from the start of the shared memory, in bytes.
    pub storage_offset_bytes: u64,
    /// `tensor.size()`.
    pub tensor_size: Vec<u64>,
    /// `tensor.stride()`, in elements (kept signed so that a negative stride
    /// is reported as such by [`ShareRecord::to_descriptor`]).
    pub tensor_stride: Vec<i64>,
    /// `tensor.storage_offset()`, in elements.
    pub tensor_offset: u64,
    /// The element type.
    pub dtype: Dtype,
    /// The device ordinal in the exporting process (informational: ordinals
    /// differ between processes; `device_uuid` names the device).
    pub storage_device: u32,
    /// The device's UUID.
    pub device_uuid: DeviceUuid,
    /// The exporting process.
    pub pid: u32,
    /// `tensor.requires_grad`.
    pub requires_grad: bool,
    /// The name of PyTorch's shared-memory reference counter file, raw.
    pub ref_counter_handle: Option<Vec<u8>>,
    /// This tensor's slot in the reference counter file.
    pub ref_counter_offset: Option<u64>,
    /// The interprocess event PyTorch recorded after the tensor's pending work.
    pub event_handle: Option<IpcEventHandle>,
    /// Whether the consumer must wait on `event_handle` before reading.
    pub event_sync_required: bool,
    /// The size of the whole shared allocation, when the exporter knew it
    /// (PyTorch's tuple does not carry it).
    pub alloc_size: Option<u64>,
}

const FIELDS: &[&str] = &[
    RECORD_KEY,
    "storage_handle",
    "storage_size_bytes",
    "storage_offset_bytes",
    "tensor_size",
    "tensor_stride",
    "tensor_offset",
    "dtype",
    "storage_device",
    "device_uuid",
    "pid",
    "requires_grad",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
    "alloc_size",
];

/// `field_err` in the shape the shared field decoder wants.
fn record_field_err(field: &str, reason: String) -> Error {
    field_err(field, reason)
}

/// The strides of a contiguous row-major tensor of `shape`, in elements.
fn row_major(shape: &[u64]) -> Option<Vec<u64>> {
    let mut strides = vec![0u64; shape.len()];
    let mut acc = 1u64;
    for (s, d) in strides.iter_mut().zip(shape).rev() {
        *s = acc;
        acc = acc.checked_mul(*d)?;
    }
    Some(strides)
}

/// The number of elements from the first to one past the last one reached,
/// `1 + sum((d - 1) * s)`, after checking that no two indices reach the same
/// element: visiting the dimensions that matter (size > 1) by increasing
/// stride, each stride must step past everything the smaller ones reach.
fn extent(shape: &[u64], strides: &[u64], given: &[i64]) -> Result<u64> {
    let mut dims: Vec<(u64, u64, usize)> = shape
        .iter()
        .zip(strides)
        .enumerate()
        .filter(|(_, (d, _))| **d > 1)
        .map(|(i, (d, s))| (*s, *d, i))
        .collect();
    dims.sort_unstable();
    let mut span = 1u64; // elements reached so far, as an exclusive bound
    for (s, d, i) in &dims {
        if *s < span {
            return Err(field_err(
                "tensor_stride",
                format!(
                    "{given:?} with tensor_size {shape:?}: dimension {i} (stride {s}) reaches \
                     elements that other indices reach too (overlapping or broadcast strides); \
                     make the tensor contiguous first"
                ),
            ));
        }
        span = (d - 1)
            .checked_mul(*s)
            .and_then(|x| x.checked_add(span))
            .ok_or_else(|| field_err("tensor_stride", "the tensor's extent overflows"))?;
    }
    Ok(span)
}

impl ShareRecord {
    /// Parses and validates a record from JSON text.
    pub fn from_json(text: &str) -> Result<Self> {
        let value: Value = crate::json::parse_strict(text)
            .map_err(|e| field_err("(document)", format!("not valid JSON: {e}")))?;
        Self::from_value(&value)
    }

    /// Validates a record already parsed as JSON.
    pub fn from_value(value: &Value) -> Result<Self> {
        let map = value.as_object().ok_or_else(|| {
            field_err(
                "(document)",
                format!("expected a JSON object, found {}", kind_of(value)),
            )
        })?;
        if let Some(unknown) = map.keys().find(|k| !FIELDS.contains(&k.as_str())) {
            let hint = if unknown == crate::descriptor::VERSION_KEY {
                " (this is a cuda-ipc descriptor, not a PyTorch share record)"
            } else {
                ""
            };
            return Err(field_err(
                unknown,
                format!("unknown field (this reader knows record format {RECORD_FORMAT}){hint}"),
            ));
        }
        let f = Fields::new(map, record_field_err);
        let format = f.u64(RECORD_KEY)?;
        if format != RECORD_FORMAT {
            return Err(field_err(
                RECORD_KEY,
                format!(
                    "record format {format} is not supported; this build reads format {RECORD_FORMAT}"
                ),
            ));
        }
        let tensor_size = f.u64_list("tensor_size")?;
        let tensor_stride = f.i64_list("tensor_stride")?;
        if tensor_stride.len() != tensor_size.len() {
            return Err(field_err(
                "tensor_stride",
                format!(
                    "{} strides for the {} dimensions of tensor_size",
                    tensor_stride.len(),
                    tensor_size.len()
                ),
            ));
        }
        let dtype = dtype_from_torch(f.str("dtype")?).map_err(|e| match e {
            Error::Torch(m) => field_err("dtype", m),
            e => e,
        })?;
        let pid = f.u32("pid")?;
        if pid == 0 {
            return Err(field_err("pid", "0 is not a process id"));
        }
        let device_uuid: DeviceUuid = f
            .str("device_uuid")?
            .parse()
            .map_err(|e: Error| field_err("device_uuid", e))?;
        let event_handle = match f.opt_hex("event_handle")? {
            None => None,
            Some(bytes) => {
                Some(IpcEventHandle::from_bytes(&bytes).map_err(|e| field_err("event_handle", e))?)
            }
        };
        let event_sync_required = f.bool("event_sync_required", false)?;
        if event_sync_required && event_handle.is_none() {
            return Err(field_err(
                "event_handle",
                "missing, but event_sync_required is true",
            ));
        }
        let storage_handle = f.hex("storage_handle")?;
        if storage_handle.is_empty() {
            return Err(field_err("storage_handle", "empty"));
        }
        let record = ShareRecord {
            storage_handle,
            storage_size_bytes: f.u64("storage_size_bytes")?,
            storage_offset_bytes: f.u64("storage_offset_bytes")?,
            tensor_size,
            tensor_stride,
            tensor_offset: f.u64("tensor_offset")?,
            dtype,
            storage_device: f.u32("storage_device")?,
            device_uuid,
            pid,
            requires_grad: f.bool("requires_grad", false)?,
            ref_counter_handle: f.opt_hex("ref_counter_handle")?,
            ref_counter_offset: f.opt_u64("ref_counter_offset")?,
            event_handle,
            event_sync_required,
            alloc_size: f.opt_u64("alloc_size")?,
        };
        Ok(record)
    }

    /// The record as a JSON value.
    pub fn to_value(&self) -> Value {
        let mut m = Map::new();
        m.insert(RECORD_KEY.into(), RECORD_FORMAT.into());
        m.insert(
            "storage_handle".into(),
            hex::encode(&self.storage_handle).into(),
        );
        m.insert("storage_size_bytes".into(), self.storage_size_bytes.into());
        m.insert(
            "storage_offset_bytes".into(),
            self.storage_offset_bytes.into(),
        );
        m.insert("tensor_size".into(), self.tensor_size.clone().into());
        m.insert("tensor_stride".into(), self.tensor_stride.clone().into());
        m.insert("tensor_offset".into(), self.tensor_offset.into());
        m.insert("dtype".into(), torch_dtype_name(self.dtype).into());
        m.insert("storage_device".into(), self.storage_device.into());
        m.insert("device_uuid".into(), self.device_uuid.to_string().into());
        m.insert("pid".into(), self.pid.into());
        m.insert("requires_grad".into(), self.requires_grad.into());
        if let Some(h) = &self.ref_counter_handle {
            m.insert("ref_counter_handle".into(), hex::encode(h).into());
        }
        if let Some(o) = self.ref_counter_offset {
            m.insert("ref_counter_offset".into(), o.into());
        }
        if let Some(e) = self.event_handle {
            m.insert("event_handle".into(), e.to_hex().into());
        }
        m.insert(
            "event_sync_required".into(),
            self.event_sync_required.into(),
        );
        if let Some(a) = self.alloc_size {
            m.insert("alloc_size".into(), a.into());
        }
        Value::Object(m)
    }

    /// The record as one line of JSON.
    pub fn to_json(&self) -> String {
        self.to_value().to_string()
    }

    /// The event a consumer must wait on before reading, if any (the
    /// record's `event_handle` when `event_sync_required`).
    pub fn event(&self) -> Option<IpcEventHandle> {
        self.event_handle.filter(|_| self.event_sync_required)
    }

    /// Parses [`ShareRecord::storage_handle`].
    pub fn parse_storage_handle(&self) -> Result<StorageHandle> {
        StorageHandle::parse(&self.storage_handle)
    }

    /// Where the tensor lies in the shared memory and what it holds, after
    /// checking its shape and strides: negative strides and strides under
    /// which two indices reach the same element are refused, and the tensor
    /// must lie inside its storage.
    pub fn tensor_layout(&self) -> Result<TensorLayout> {
        let elem = self.dtype.size();
        let shape = &self.tensor_size;
        if self.tensor_stride.len() != shape.len() {
            return Err(field_err(
                "tensor_stride",
                format!(
                    "{} strides for the {} dimensions of tensor_size",
                    self.tensor_stride.len(),
                    shape.len()
                ),
            ));
        }
        let mut strides = Vec::with_capacity(shape.len());
        for (i, s) in self.tensor_stride.iter().enumerate() {
            let s = u64::try_from(*s).map_err(|_| {
                field_err(
                    &format!("tensor_stride[{i}]"),
                    format!(
                        "{s} is negative; negative strides cannot be described (make the tensor \
                         contiguous first)"
                    ),
                )
            })?;
            strides.push(s);
        }
        let numel = shape
            .iter()
            .try_fold(1u64, |acc, d| acc.checked_mul(*d))
            .ok_or_else(|| field_err("tensor_size", "the number of elements overflows"))?;
        if numel == 0 {
            return Err(field_err(
                "tensor_size",
                format!("{shape:?} holds no elements; there is nothing to share"),
            ));
        }
        let extent = extent(shape, &strides, &self.tensor_stride)?;
        let len = extent
            .checked_mul(elem)
            .ok_or_else(|| field_err("tensor_size", "the tensor's byte length overflows"))?;
        let start_in_storage = self
            .tensor_offset
            .checked_mul(elem)
            .ok_or_else(|| field_err("tensor_offset", "overflows"))?;
        let end_in_storage = start_in_storage
            .checked_add(len)
            .ok_or_else(|| field_err("tensor_offset", "overflows"))?;
        if end_in_storage > self.storage_size_bytes {
            return Err(field_err(
                "storage_size_bytes",
                format!(
                    "the tensor reaches byte {end_in_storage} of its storage (offset {} elements \
                     of {elem} bytes, {len} bytes long), but the storage has {} bytes",
                    self.tensor_offset, self.storage_size_bytes
                ),
            ));
        }
        let offset = self
            .storage_offset_bytes
            .checked_add(start_in_storage)
            .ok_or_else(|| field_err("storage_offset_bytes", "overflows"))?;
        let strides = if row_major(shape).is_some_and(|rm| {
            rm.iter()
                .zip(&strides)
                .zip(shape)
                .all(|((a, b), d)| *d == 1 || a == b)
        }) {
            None
        } else {
            Some(strides)
        };
        Ok(TensorLayout {
            offset,
            len,
            dtype: self.dtype,
            shape: shape.clone(),
            strides,
        })
    }

    /// The record as our [`Descriptor`].
    ///
    /// - `'c'` handles become legacy descriptors: `offset` is
    ///   `storage_offset_bytes + tensor_offset * elem_size`; `alloc_size` is
    ///   the record's `alloc_size` when given, else the lower bound
    ///   `storage_offset_bytes + storage_size_bytes` (the importer maps the
    ///   whole allocation whatever this says).
    /// - `'e'` handles of a single physical allocation become vmm
    ///   descriptors (POSIX file descriptor, fetched from the exporter with
    ///   `pidfd_getfd`) or fabric descriptors; `alloc_size` is the segment
    ///   size.
    /// - `'e'` handles of several allocations cannot be one descriptor (it
    ///   names one file descriptor): the error says so, and
    ///   [`ShareRecord::parse_storage_handle`] with
    ///   [`ShareRecord::tensor_layout`] give what an import of the segments
    ///   needs.
    ///
    /// Shape and strides are carried (strides only when the tensor is not
    /// contiguous), and the event when `event_sync_required`.
    pub fn to_descriptor(&self) -> Result<Descriptor> {
        let storage = self.parse_storage_handle()?;
        let layout = self.tensor_layout()?;
        let storage_end = self
            .storage_offset_bytes
            .checked_add(self.storage_size_bytes)
            .ok_or_else(|| field_err("storage_size_bytes", "overflows"))?;
        let (source, alloc_size, pid) = match storage {
            StorageHandle::CudaMalloc { handle, .. } => {
                let alloc_size = match self.alloc_size {
                    Some(a) if a < storage_end => {
                        return Err(field_err(
                            "alloc_size",
                            format!(
                                "{a} bytes, but the storage ends at byte {storage_end} of the \
                                 allocation"
                            ),
                        ));
                    }
                    Some(a) => a,
                    None => storage_end,
                };
                (Source::Legacy { handle }, alloc_size, self.pid)
            }
            StorageHandle::Expandable { segment, .. } => {
                if segment.pid != self.pid {
                    return Err(torch_err(format!(
                        "the storage handle names process {} as the owner of the segment, but \
                         the record's pid is {}",
                        segment.pid, self.pid
                    )));
                }
                let mapped = segment.mapped_size()?;
                if storage_end > mapped {
                    return Err(field_err(
                        "storage_size_bytes",
                        format!(
                            "the storage ends at byte {storage_end} of the shared range, but \
                             the storage handle shares {mapped} bytes ({} segment(s) of {})",
                            segment.num_segments(),
                            segment.segment_size
                        ),
                    ));
                }
                let source = match &segment.handles {
                    SegmentHandles::PosixFds(fds) if fds.len() == 1 => Source::Vmm { fd: fds[0] },
                    SegmentHandles::Fabric(hs) if hs.len() == 1 => Source::Fabric { handle: hs[0] },
                    handles => {
                        return Err(torch_err(format!(
                            "the tensor lies in an expandable segment shared as {} {}: a \
                             descriptor names one allocation, so it cannot describe this share. \
                             Import the segments with vmm::VmmMapping::import_segments (see \
                             torch::ExpandableSegment), or share the tensor from a process \
                             without expandable_segments:True",
                            handles.len(),
                            handles.kind()
                        )));
                    }
                };
                (source, segment.segment_size, segment.pid)
            }
        };
        let event = self.event();
        let d = Descriptor {
            source,
            alloc_size,
            offset: layout.offset,
            len: layout.len,
            dtype: layout.dtype,
            shape: Some(layout.shape),
            strides: layout.strides,
            device_uuid: self.device_uuid,
            pid,
            event,
            generation: None,
        };
        d.validate()?;
        Ok(d)
    }
}

crate::json::json_record!(ShareRecord);
