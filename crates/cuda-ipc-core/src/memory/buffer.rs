//! Memory mapped from another process, whatever the mechanism, and the typed
//! view over it.
//!
//! # Contract
//! Only this library makes mappings ([`Mapping`] is sealed), so a
//! [`MappedBuffer`] always lies inside memory the driver mapped. Every view
//! (clones, slices, casts) keeps the mapping alive, and a mapping records the
//! streams its views were given ([`MappedBuffer::with_stream`]): when the
//! last reference goes, the unmap is retired to the [reaper](crate::reaper)
//! until every one of them has finished the work queued so far, so no
//! queued work uses the range after it is gone, and no drop waits. A view
//! made by the exchange layer also holds its lease, which ends (the same
//! way) when the last view is gone.
//!
//! A view can only be made from a mapping this process holds as a whole
//! (`Arc<dyn Mapping>`, which [`LegacyMapping::open`](crate::LegacyMapping::open)
//! and the other mechanisms' `open` return), or from another view, whose
//! hold it inherits ([`MappedBuffer::slice`], [`MappedBuffer::cast`]). A
//! view attached through the exchange lends out only `&dyn Mapping`, so no
//! view can be made around its lease (the exchange's `Attachment` shows it).
#![allow(unsafe_code)] // `unsafe impl DeviceMemory` and `Mapping::sleep`, justified there

use std::fmt;
use std::marker::PhantomData;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use bytemuck::Pod;
use cudarc::driver::CudaStream;

use crate::device::Device;
use crate::error::{Error, Result};
use crate::mechanism::Mechanism;
use crate::memory::{DeviceMemory, UsesOf, WithStream, impl_cudarc_traits};

pub(crate) mod sealed {
    use std::sync::Arc;

    use cudarc::driver::CudaStream;

    use crate::memory::{ForeignUse, UsesOf};

    /// Seals [`Mapping`](super::Mapping): only this crate makes mappings.
    pub trait Sealed {
        /// The streams views of this mapping queued work on.
        fn used_streams(&self) -> &UsedStreams;
    }

    /// The streams a mapping's views were used with, synchronised before the
    /// mapping is undone, and the views' uses on other streams.
    #[derive(Debug, Default)]
    pub struct UsedStreams {
        streams: std::sync::Mutex<Vec<Arc<CudaStream>>>,
        foreign: ForeignUse,
    }

    impl UsedStreams {
        /// Notes that work may be queued through the mapping on `stream`.
        #[doc(hidden)]
        pub fn record(&self, stream: &Arc<CudaStream>) {
            let mut streams = super::lock(&self.streams);
            if !streams.iter().any(|s| s.cu_stream() == stream.cu_stream()) {
                streams.push(stream.clone());
            }
        }

        /// The recorded streams.
        pub(crate) fn snapshot(&self) -> Vec<Arc<CudaStream>> {
            super::lock(&self.streams).clone()
        }

        /// The views' uses on streams other than their own (shared by every
        /// view of the mapping).
        pub(crate) fn foreign(&self) -> &ForeignUse {
            &self.foreign
        }

        /// What the mapping's release waits for: the work queued so far on
        /// every recorded stream and on `also` or, after uses on other
        /// streams, on every stream of `also`'s context.
        pub(crate) fn uses(&self, also: &Arc<CudaStream>) -> UsesOf {
            let mut streams = self.snapshot();
            streams.push(also.clone());
            self.foreign.uses(also.context(), &streams)
        }

        /// Retires `finish` to the [reaper](crate::reaper) until the work
        /// [`UsedStreams::uses`] names has finished. Never waits.
        #[doc(hidden)]
        pub fn retire(
            &self,
            also: &Arc<CudaStream>,
            what: &'static str,
            finish: impl FnOnce() + Send + 'static,
        ) {
            self.uses(also).retire(what, finish);
        }

        /// Waits for every recorded stream (they stay recorded, as views
        /// may still use them), and for the uses on other streams. Every
        /// stream is waited for even when one fails; the first failure is
        /// returned (`Drop` logs it).
        #[doc(hidden)]
        pub fn synchronize_all(&self) -> crate::error::Result<()> {
            let streams = self.snapshot();
            let mut first = match streams.first() {
                Some(s) => self.foreign.synchronize(s.context()),
                None => Ok(()),
            };
            for s in streams {
                let done = s
                    .context()
                    .bind_to_thread()
                    .map_err(|e| crate::error::from_cudarc("cuCtxSetCurrent", e))
                    // SAFETY: the stream is live (held by the snapshot).
                    .and_then(|()| unsafe { crate::driver::result::stream::finish(s.cu_stream()) });
                if let Err(e) = done {
                    tracing::warn!(error = %e, "waiting for a stream of a mapping failed");
                    if first.is_ok() {
                        first = Err(e);
                    }
                }
            }
            first
        }
    }
}

pub(crate) use sealed::UsedStreams;

/// Retires `finish`, which is given `mappings` back, to the
/// [reaper](crate::reaper) until the work queued so far through them has
/// finished (each mapping's streams, or its whole context after uses on
/// streams not its own). Never waits.
#[doc(hidden)]
pub fn retire_after_uses(
    mappings: Vec<Arc<dyn Mapping>>,
    what: &'static str,
    finish: impl FnOnce(Vec<Arc<dyn Mapping>>) + Send + 'static,
) {
    let uses = mappings
        .iter()
        .map(|m| m.used_streams().uses(m.device().stream()))
        .reduce(UsesOf::merge)
        .unwrap_or(UsesOf::Streams(Vec::new()));
    uses.retire(what, move || finish(mappings));
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Something a view keeps alive until the last view of it is gone (the
/// exchange layer's lease).
#[doc(hidden)]
pub trait Hold: Send + Sync + fmt::Debug {}

/// A whole allocation of another process, mapped into this one by this
/// library. Unmapped when the last reference drops (each mechanism's own
/// way), after every stream its views used has finished.
///
/// `base()..base() + size()` is device memory mapped on `device()` for as
/// long as the value lives. The trait is sealed: the mappings are
/// [`LegacyMapping`](crate::memory::legacy::LegacyMapping),
/// [`VmmMapping`](crate::memory::vmm::VmmMapping) and
/// [`PoolMapping`](crate::memory::pool::PoolMapping), so a [`MappedBuffer`] can't be
/// built over an arbitrary address:
///
/// ```compile_fail
/// use std::sync::Arc;
/// use cuda_ipc_core::{Device, MappedBuffer, Mapping, Mechanism};
///
/// #[derive(Debug)]
/// struct Anywhere(Device);
///
/// impl Mapping for Anywhere { // error: the trait is sealed
///     fn device(&self) -> &Device { &self.0 }
///     fn base(&self) -> u64 { 0xdead_0000 }
///     fn size(&self) -> u64 { 4096 }
///     fn mechanism(&self) -> Mechanism { Mechanism::Legacy }
/// }
///
/// let device = Device::open(0).unwrap();
/// let fake: Arc<dyn Mapping> = Arc::new(Anywhere(device));
/// let _ = MappedBuffer::<u8>::new(fake, 0, 4096);
/// ```
pub trait Mapping: sealed::Sealed + Send + Sync + fmt::Debug {
    /// The device it is mapped on.
    fn device(&self) -> &Device;
    /// The local address of the allocation's first byte.
    fn base(&self) -> u64;
    /// The size of the mapped allocation in bytes.
    fn size(&self) -> u64;
    /// How it was shared.
    fn mechanism(&self) -> Mechanism;
    /// Whether it is mapped read-only (`CU_MEM_ACCESS_FLAGS_PROT_READ`): a
    /// kernel or copy that writes through it fails. False unless the
    /// mapping says otherwise (only VMM mappings can be read-only).
    fn read_only(&self) -> bool {
        false
    }
    /// Unmaps the memory but keeps its address range reserved (nothing
    /// else can be mapped there), after the work queued through it has
    /// finished; [`wake`](Mapping::wake) maps it again at the same
    /// addresses. Only VMM and fabric mappings can sleep: the others are
    /// [`Error::Unsupported`]. A VMM mapping first waits for every stream
    /// its views used and every stream of the device's context (so the
    /// call blocks until that work is done); sleeping a sleeping mapping
    /// does nothing; if an unmap fails, what was unmapped is mapped again
    /// and the mapping stays awake.
    /// A subscriber's mappings sleep safely through
    /// the exchange's `Subscriber::sleep`, which
    /// first checks that no view of them is alive.
    ///
    /// # Safety
    /// Views of the mapping may outlive the sleep, and a kernel or copy
    /// that touches an unmapped address faults and poisons the CUDA
    /// context. From this call until [`wake`](Mapping::wake) has returned,
    /// the caller makes sure that no work touches the memory: none queued,
    /// by any thread, on any stream, through a view, a tensor, a raw
    /// address or a CUDA graph of it (work queued before the call is waited
    /// for here), and no view read or written from the host.
    ///
    /// Calling it without `unsafe` is refused:
    ///
    /// ```compile_fail,E0133
    /// fn nap(m: &dyn cuda_ipc_core::Mapping) -> cuda_ipc_core::Result<()> {
    ///     m.sleep() // error: call to unsafe function
    /// }
    /// ```
    unsafe fn sleep(&self) -> Result<()> {
        Err(Error::Unsupported {
            what: "sleeping a mapping",
            why: format!(
                "a {} mapping cannot be mapped again at the same addresses; only vmm (and fabric) \
                 mappings sleep and wake",
                self.mechanism()
            ),
        })
    }
    /// Maps a sleeping mapping again at the same addresses; does nothing
    /// to one that is awake.
    fn wake(&self) -> Result<()> {
        Ok(())
    }
    /// Whether it sleeps: its addresses are reserved but not mapped, and
    /// any access through them faults until [`wake`](Mapping::wake).
    fn asleep(&self) -> bool {
        false
    }
}

/// A typed view of `len` elements of `T` inside a [`Mapping`], with the
/// exporter's offset applied. Cloning shares the mapping; the mapping is
/// closed when the last view drops, after the streams its views used have
/// finished. A view attached through the exchange also holds the lease,
/// released when the last view (clone, slice or cast) is gone.
///
/// Implements [`DeviceMemory`] (host copies, our kernels) and cudarc's
/// `DeviceSlice`, `DevicePtr` and `DevicePtrMut`, so a mapped buffer can be a
/// kernel argument.
pub struct MappedBuffer<T> {
    mapping: Arc<dyn Mapping>,
    offset: u64,
    len: usize,
    stream: Arc<CudaStream>,
    /// Dropped after `mapping`, so a lease ends after the mapping's last
    /// view is gone (and, when it was the last reference, unmapped).
    hold: Option<Arc<dyn Hold>>,
    _elem: PhantomData<fn() -> T>,
}

impl<T> Clone for MappedBuffer<T> {
    fn clone(&self) -> Self {
        MappedBuffer {
            mapping: self.mapping.clone(),
            offset: self.offset,
            len: self.len,
            stream: self.stream.clone(),
            hold: self.hold.clone(),
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
        Error::check_range(offset, bytes, mapping.size())?;
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
        mapping.used_streams().record(&stream);
        Ok(MappedBuffer {
            mapping,
            offset,
            len,
            stream,
            hold: None,
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

    /// The number of elements of `T`, as a slice counts (the length in
    /// bytes is [`DeviceMemory::byte_len`]).
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

    /// The mapping underneath (borrowed: a view that holds a lease lends
    /// no way to make views without it). Its [`Mapping::read_only`] says
    /// whether writing through this view (a kernel, a copy into it) fails.
    pub fn mapping(&self) -> &dyn Mapping {
        &*self.mapping
    }

    /// The mapping underneath, shared.
    #[doc(hidden)]
    pub fn mapping_arc(&self) -> &Arc<dyn Mapping> {
        &self.mapping
    }

    /// Makes this view (and every view made from it) keep `hold` alive.
    #[doc(hidden)]
    #[must_use]
    pub fn hold(mut self, hold: Arc<dyn Hold>) -> Self {
        self.hold = Some(hold);
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

    /// The same bytes viewed as `U` (on the same stream, holding the same lease).
    pub fn cast<U: Pod>(&self) -> Result<MappedBuffer<U>> {
        let mut b = MappedBuffer::<U>::from_bytes(
            self.mapping.clone(),
            self.offset,
            self.byte_len() as u64,
        )?;
        b.stream.clone_from(&self.stream);
        b.hold.clone_from(&self.hold);
        Ok(b)
    }
}

impl<T: Pod> WithStream for MappedBuffer<T> {
    fn with_stream(mut self, stream: Arc<CudaStream>) -> Result<Self> {
        let current = self.mapping.used_streams().foreign().order(&self.stream);
        self.stream = crate::memory::switch_stream(self.mapping.device(), current, stream)?;
        self.mapping.used_streams().record(&self.stream);
        Ok(self)
    }
}

// SAFETY: `new` checked that the view lies inside the mapping, which only
// this crate makes (sealed) and which lives as long as the view; its stream
// is recorded in the mapping, which waits for it before unmapping.
unsafe impl<T: Pod> DeviceMemory for MappedBuffer<T> {
    fn device(&self) -> &Device {
        self.mapping.device()
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.mapping.used_streams().foreign().order(&self.stream)
    }
    fn device_address(&self) -> u64 {
        self.mapping.base() + self.offset
    }
    fn byte_len(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }
    fn foreign_use(&self) -> Option<&crate::memory::ForeignUse> {
        Some(self.mapping.used_streams().foreign())
    }
}

impl_cudarc_traits!(MappedBuffer<T>, T);
