//! The share record: a tensor shared by PyTorch, as language-neutral JSON.

use serde_json::{Map, Value};

use crate::descriptor::{Descriptor, Dtype, Source};
use crate::device::DeviceUuid;
use crate::error::{Error, Result};
use crate::handle::{Handle, IpcEventHandle};
use crate::json::{Fields, kind_of};

use super::{
    RECORD_FORMAT, RECORD_KEY, SegmentHandles, StorageHandle, dtype_from_torch, field_err,
    torch_dtype_name, torch_err,
};

/// Where a tensor lies in the memory its storage handle shares, and what it
/// holds: the part of a [`Descriptor`] that does not depend on the mechanism.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct TensorLayout {
    /// Bytes from the start of the shared memory (the `cudaMalloc`
    /// allocation, or the first shared segment) to the tensor's first element.
    pub offset: u64,
    /// Bytes from the first element to one past the last one reached.
    pub byte_len: u64,
    /// The element type.
    pub dtype: Dtype,
    /// Dimensions in elements.
    pub shape: Vec<u64>,
    /// Strides in elements, if the tensor is not contiguous row-major.
    pub strides: Option<Vec<u64>>,
}

/// A CUDA tensor shared by PyTorch, as language-neutral JSON (see the
/// [module documentation](super) for the format). Decoding is strict: unknown
/// fields, wrong types, negative or fractional sizes and malformed hex are
/// errors that name the field.
///
/// Decoded with [`ShareRecord::from_json`] (or from PyTorch's tuple by the
/// Python package); to build one by hand, start from [`ShareRecord::new`]
/// and set the fields (more may come).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
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
    /// A record of a contiguous one-dimensional tensor that fills its
    /// storage of `storage_size_bytes` bytes (`dtype` elements), with no
    /// reference counter and no event: set the other fields as needed.
    pub fn new(
        storage_handle: Vec<u8>,
        storage_size_bytes: u64,
        dtype: Dtype,
        device_uuid: DeviceUuid,
        pid: u32,
    ) -> Self {
        ShareRecord {
            storage_handle,
            storage_size_bytes,
            storage_offset_bytes: 0,
            tensor_size: vec![storage_size_bytes / dtype.size()],
            tensor_stride: vec![1],
            tensor_offset: 0,
            dtype,
            storage_device: 0,
            device_uuid,
            pid,
            requires_grad: false,
            ref_counter_handle: None,
            ref_counter_offset: None,
            event_handle: None,
            event_sync_required: false,
            alloc_size: None,
        }
    }

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
        let format = f.req::<u64>(RECORD_KEY)?;
        if format != RECORD_FORMAT {
            return Err(field_err(
                RECORD_KEY,
                format!(
                    "record format {format} is not supported; this build reads format {RECORD_FORMAT}"
                ),
            ));
        }
        let tensor_size = f.req::<Vec<u64>>("tensor_size")?;
        let tensor_stride = f.req::<Vec<i64>>("tensor_stride")?;
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
        let dtype = dtype_from_torch(f.req::<&str>("dtype")?).map_err(|e| match e {
            Error::Torch(m) => field_err("dtype", m),
            e => e,
        })?;
        let pid = f.req::<u32>("pid")?;
        if pid == 0 {
            return Err(field_err("pid", "0 is not a process id"));
        }
        let device_uuid: DeviceUuid = f
            .req::<&str>("device_uuid")?
            .parse()
            .map_err(|e: Error| field_err("device_uuid", e))?;
        let event_handle = match f.opt::<Vec<u8>>("event_handle")? {
            None => None,
            Some(bytes) => {
                Some(IpcEventHandle::from_bytes(&bytes).map_err(|e| field_err("event_handle", e))?)
            }
        };
        let event_sync_required = f.opt::<bool>("event_sync_required")?.unwrap_or(false);
        if event_sync_required && event_handle.is_none() {
            return Err(field_err(
                "event_handle",
                "missing, but event_sync_required is true",
            ));
        }
        let storage_handle = f.req::<Vec<u8>>("storage_handle")?;
        if storage_handle.is_empty() {
            return Err(field_err("storage_handle", "empty"));
        }
        let record = ShareRecord {
            storage_handle,
            storage_size_bytes: f.req::<u64>("storage_size_bytes")?,
            storage_offset_bytes: f.req::<u64>("storage_offset_bytes")?,
            tensor_size,
            tensor_stride,
            tensor_offset: f.req::<u64>("tensor_offset")?,
            dtype,
            storage_device: f.req::<u32>("storage_device")?,
            device_uuid,
            pid,
            requires_grad: f.opt::<bool>("requires_grad")?.unwrap_or(false),
            ref_counter_handle: f.opt::<Vec<u8>>("ref_counter_handle")?,
            ref_counter_offset: f.opt::<u64>("ref_counter_offset")?,
            event_handle,
            event_sync_required,
            alloc_size: f.opt::<u64>("alloc_size")?,
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
            m.insert("event_handle".into(), e.to_string().into());
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
            byte_len: len,
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
        let mut d = Descriptor::new(source, alloc_size, self.device_uuid, pid)
            .with_range(layout.offset, layout.byte_len);
        d.dtype = layout.dtype;
        d.shape = Some(layout.shape);
        d.strides = layout.strides;
        d.event = event;
        d.validate()?;
        Ok(d)
    }
}

crate::json::json_record!(ShareRecord);
