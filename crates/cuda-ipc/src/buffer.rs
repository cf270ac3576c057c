//! Memory mapped from another process, whatever the mechanism, and the typed
//! view over it.

use std::fmt;
use std::marker::PhantomData;
use std::ops::Range;
use std::sync::Arc;

use bytemuck::Pod;
use cudarc::driver::CudaStream;

use crate::descriptor::Mechanism;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::memory::{DeviceMemory, impl_cudarc_traits};

/// A whole allocation of another process, mapped into this one. Unmapped
/// when the last reference drops (each mechanism's own way).
///
/// # Contract
/// `base()..base() + size()` is device memory mapped on `device()` for as
/// long as the value lives.
pub trait Mapping: Send + Sync + fmt::Debug {
    /// The device it is mapped on.
    fn device(&self) -> &Device;
    /// The local address of the allocation's first byte.
    fn base(&self) -> u64;
    /// The size of the mapped allocation in bytes.
    fn size(&self) -> u64;
    /// How it was shared.
    fn mechanism(&self) -> Mechanism;
}

/// A typed view of `len` elements of `T` inside a [`Mapping`], with the
/// exporter's offset applied. Cloning shares the mapping; the mapping is
/// closed when the last view drops.
///
/// Implements [`DeviceMemory`] (host copies, our kernels) and cudarc's
/// `DeviceSlice`, `DevicePtr` and `DevicePtrMut`, so a mapped buffer can be a
/// kernel argument.
pub struct MappedBuffer<T> {
    mapping: Arc<dyn Mapping>,
    offset: u64,
    len: usize,
    stream: Arc<CudaStream>,
    _elem: PhantomData<fn() -> T>,
}

impl<T> Clone for MappedBuffer<T> {
    fn clone(&self) -> Self {
        MappedBuffer {
            mapping: self.mapping.clone(),
            offset: self.offset,
            len: self.len,
            stream: self.stream.clone(),
            _elem: PhantomData,
        }
    }
}

impl<T> fmt::Debug for MappedBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MappedBuffer")
            .field("type", &std::any::type_name::<T>())
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("mapping", &self.mapping)
            .finish_non_exhaustive()
    }
}

impl<T: Pod> MappedBuffer<T> {
    /// A view of `len` elements starting `offset` bytes into `mapping`.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] if the range passes the end of the mapping;
    /// [`Error::InvalidArgument`] if the start is not aligned for `T`.
    pub fn new(mapping: Arc<dyn Mapping>, offset: u64, len: usize) -> Result<Self> {
        let size = std::mem::size_of::<T>() as u64;
        let bytes = (len as u64)
            .checked_mul(size)
            .ok_or_else(|| Error::arg("length", format!("{len} elements overflow")))?;
        if offset
            .checked_add(bytes)
            .is_none_or(|end| end > mapping.size())
        {
            return Err(Error::OutOfBounds {
                offset,
                len: bytes,
                size: mapping.size(),
            });
        }
        let align = std::mem::align_of::<T>() as u64;
        if !(mapping.base() + offset).is_multiple_of(align) {
            return Err(Error::arg(
                "offset",
                format!(
                    "{offset} is not aligned for {} ({align}-byte alignment)",
                    std::any::type_name::<T>()
                ),
            ));
        }
        let stream = mapping.device().stream().clone();
        Ok(MappedBuffer {
            mapping,
            offset,
            len,
            stream,
            _elem: PhantomData,
        })
    }

    /// A view of `bytes` bytes starting `offset` bytes into `mapping`; the
    /// byte count must be a whole number of `T`.
    pub fn from_bytes(mapping: Arc<dyn Mapping>, offset: u64, bytes: u64) -> Result<Self> {
        let size = std::mem::size_of::<T>().max(1) as u64;
        if !bytes.is_multiple_of(size) {
            return Err(Error::arg(
                "length",
                format!(
                    "{bytes} bytes is not a whole number of {size}-byte {}",
                    std::any::type_name::<T>()
                ),
            ));
        }
        Self::new(mapping, offset, (bytes / size) as usize)
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where the view starts, in bytes from the start of the mapping.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The mapping underneath.
    pub fn mapping(&self) -> &Arc<dyn Mapping> {
        &self.mapping
    }

    /// Uses `stream` (of the same device) for this view's copies and kernels.
    #[must_use]
    pub fn with_stream(mut self, stream: Arc<CudaStream>) -> Self {
        self.stream = stream;
        self
    }

    /// A view of elements `range` of this one.
    pub fn slice(&self, range: Range<usize>) -> Result<Self> {
        if range.start > range.end || range.end > self.len {
            return Err(Error::OutOfBounds {
                offset: range.start as u64,
                len: range.end.saturating_sub(range.start) as u64,
                size: self.len as u64,
            });
        }
        let mut v = self.clone();
        v.offset += (range.start * std::mem::size_of::<T>()) as u64;
        v.len = range.len();
        Ok(v)
    }

    /// The same bytes viewed as `U`.
    pub fn cast<U: Pod>(&self) -> Result<MappedBuffer<U>> {
        MappedBuffer::<U>::from_bytes(self.mapping.clone(), self.offset, self.byte_len() as u64)
            .map(|b| b.with_stream(self.stream.clone()))
    }
}

impl<T: Pod> DeviceMemory for MappedBuffer<T> {
    fn device(&self) -> &Device {
        self.mapping.device()
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    fn device_address(&self) -> u64 {
        self.mapping.base() + self.offset
    }
    fn byte_len(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }
}

impl_cudarc_traits!(MappedBuffer<T>, T);

impl<T> Drop for MappedBuffer<T> {
    fn drop(&mut self) {
        // The mapping's own drop waits for the device's stream; work queued
        // on another stream through this view must be done before the
        // mapping can go. Errors cannot be raised from drop.
        if self.stream.cu_stream() != self.mapping.device().stream().cu_stream()
            && Arc::strong_count(&self.mapping) == 1
        {
            let _ = self.stream.synchronize();
        }
    }
}
