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
//! [`ShareRecord::to_descriptor`] turns it into our [`Descriptor`](cuda_ipc_core::Descriptor), which
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

use crate::descriptor::Dtype;
use crate::error::{Error, Result};
use crate::handle::HANDLE_LEN;

mod handle;
mod record;

pub use handle::{ExpandableSegment, SegmentHandles, StorageHandle};
pub use record::{ShareRecord, TensorLayout};

/// The record format this build writes and reads.
pub const RECORD_FORMAT: u64 = 1;

/// The key that carries the record format (and marks a JSON object as a
/// PyTorch share record rather than a [`Descriptor`](cuda_ipc_core::Descriptor)).
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
    dtype.torch_name()
}

/// The element type of a PyTorch dtype name (`"float32"`, `"bfloat16"`,
/// `"float8_e4m3fn"`, ...: `str(torch.float32)` without the `torch.`
/// prefix). Types without a [`Dtype`] (the sub-byte `uint1`..`uint7` and
/// `int1`..`int7`, quantized types, `complex32`) are refused, naming the
/// type and saying to share its bytes as `uint8` instead.
pub fn dtype_from_torch(name: &str) -> Result<Dtype> {
    if let Some(d) = Dtype::ALL
        .into_iter()
        .find(|d| torch_dtype_name(*d) == name)
    {
        return Ok(d);
    }
    let known: Vec<_> = Dtype::ALL.iter().map(|d| torch_dtype_name(*d)).collect();
    let known = known.join(", ");
    Err(torch_err(if let Some(bare) = name.strip_prefix("torch.") {
        format!(
            "dtype {name:?} cannot be shared (write {bare:?}, without the torch. prefix): \
             the element types that can are {known}"
        )
    } else {
        // Sub-byte (uint1..uint7, int1..int7), quantized and other types
        // travel as their bytes, which the reader views back.
        format!(
            "dtype {name:?} cannot be shared: the element types that can are {known}; to share \
             its bytes, view the tensor as uint8 first (t.view(torch.uint8)) and view them back \
             as the type after reading"
        )
    }))
}
