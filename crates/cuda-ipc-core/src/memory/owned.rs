//! What the owned buffers of every mechanism share: [`LegacyBuffer`],
//! [`VmmBuffer`] and [`PoolBuffer`] each hold an [`Owned`] (the device,
//! stream, address, length and uses on other streams) and write the rest of
//! their common surface with [`owned_buffer!`]. Each keeps to itself what
//! differs: how it allocates, exports and frees.
//!
//! [`LegacyBuffer`]: crate::memory::legacy::LegacyBuffer
//! [`VmmBuffer`]: crate::memory::vmm::VmmBuffer
//! [`PoolBuffer`]: crate::memory::pool::PoolBuffer
#![allow(unsafe_code)] // only the `unsafe impl DeviceMemory` of `owned_buffer!`, justified where it is used

use std::sync::Arc;

use cudarc::driver::CudaStream;

use crate::device::Device;
use crate::error::Result;
use crate::memory::{ForeignUse, switch_stream};

/// The part of an owned buffer that is the same for every mechanism: `len`
/// bytes at `ptr` on `device`, used on `stream`, and the record of their
/// uses on other streams. It frees nothing: the buffer that holds it does,
/// in its `Drop`.
#[derive(Debug)]
pub(crate) struct Owned {
    pub(crate) device: Device,
    stream: Arc<CudaStream>,
    pub(crate) ptr: u64,
    pub(crate) len: usize,
    foreign: ForeignUse,
}

impl Owned {
    /// `len` bytes at `ptr` on `device`, used on the device's stream.
    pub(crate) fn new(device: &Device, ptr: u64, len: usize) -> Self {
        Owned {
            device: device.clone(),
            stream: device.stream().clone(),
            ptr,
            len,
            foreign: ForeignUse::default(),
        }
    }

    /// The stream the memory is used on, as it was last set (for a release
    /// ordered on it; copies and kernels take [`Owned::stream`]).
    pub(crate) fn own_stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The memory's stream, made to wait for the uses elsewhere so far
    /// (what [`DeviceMemory::stream`](crate::memory::DeviceMemory::stream)
    /// returns).
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        self.foreign.order(&self.stream)
    }

    /// The uses of the memory on streams other than its own.
    pub(crate) fn foreign(&self) -> &ForeignUse {
        &self.foreign
    }

    /// Uses `stream` from now on, ordered after the work queued so far (see
    /// [`switch_stream`]).
    pub(crate) fn set_stream(&mut self, stream: Arc<CudaStream>) -> Result<()> {
        let current = self.foreign.order(&self.stream);
        self.stream = switch_stream(&self.device, current, stream)?;
        Ok(())
    }

    /// Retires `finish` (the release of the memory) to the
    /// [reaper](crate::reaper) until the work queued so far on the
    /// memory's stream and on the device's stream has finished (after uses
    /// on other streams: on every stream of the device's context). Never
    /// waits.
    pub(crate) fn retire(&self, what: &'static str, finish: impl FnOnce() + Send + 'static) {
        self.foreign
            .uses(self.device.context(), [&self.stream, self.device.stream()])
            .retire(what, finish);
    }
}

/// Writes, for an owned buffer type with an [`Owned`] field named `core`,
/// what it offers through that field: [`WithStream`], [`DeviceMemory`] (whose `byte_len` is the buffer's length)
/// and cudarc's traits (through [`impl_cudarc_traits!`]).
///
/// The type name comes after `unsafe`, under a `// SAFETY:` note saying why
/// the core's range is device memory for as long as the value lives (the
/// type frees it in its `Drop`): that is the contract of [`DeviceMemory`].
///
/// [`DeviceMemory`]: crate::memory::DeviceMemory
/// [`WithStream`]: crate::memory::WithStream
/// [`impl_cudarc_traits!`]: crate::memory::impl_cudarc_traits
macro_rules! owned_buffer {
    (unsafe $ty:ident;) => {
        impl $crate::memory::WithStream for $ty {
            fn with_stream(
                mut self,
                stream: std::sync::Arc<cudarc::driver::CudaStream>,
            ) -> $crate::error::Result<Self> {
                self.core.set_stream(stream)?;
                Ok(self)
            }
        }

        // SAFETY: the note where the macro is used.
        unsafe impl $crate::memory::DeviceMemory for $ty {
            fn device(&self) -> &$crate::device::Device {
                &self.core.device
            }
            fn stream(&self) -> &std::sync::Arc<cudarc::driver::CudaStream> {
                self.core.stream()
            }
            fn device_address(&self) -> u64 {
                self.core.ptr
            }
            fn byte_len(&self) -> usize {
                self.core.len
            }
            fn foreign_use(&self) -> Option<&$crate::memory::ForeignUse> {
                Some(self.core.foreign())
            }
        }

        $crate::memory::impl_cudarc_traits!($ty, u8);
    };
}
pub(crate) use owned_buffer;
