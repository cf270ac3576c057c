//! The memory layer: device memory of every mechanism, owned or mapped.
//!
//! - [`legacy`]: legacy IPC handles (`cuIpcGetMemHandle`), [`LegacyBuffer`]
//!   and [`LegacyMapping`];
//! - [`vmm`]: VMM allocations (`cuMemCreate`) shared as file descriptors or
//!   fabric handles, [`VmmBuffer`] and [`VmmMapping`];
//! - [`pool`]: stream-ordered memory pools, [`PoolBuffer`] and
//!   [`PoolMapping`];
//! - [`buffer`]: the sealed [`Mapping`] over all three, and the typed view
//!   [`MappedBuffer`];
//! - `owned` (private): what the three owned buffers share, written once;
//! - this module: [`DeviceMemory`], what every piece of memory offers.
//!
//! The folder imports the driver layer, [`device`](crate::device), the
//! [reaper](crate::reaper) (drops retire their unmaps and frees there),
//! and the plain-data modules ([`handle`](crate::handle),
//! [`units`](crate::units), [`error`](crate::error), the mechanism word);
//! never [`share`](crate::share), the descriptor or anything above them.
//! Within it, the mechanisms import [`buffer`], `owned` and this module,
//! and [`buffer`] and `owned` import this module. Its modules are also reachable at the
//! crate root, as `cuda_ipc::legacy`, `cuda_ipc::vmm`, `cuda_ipc::pool` and
//! `cuda_ipc::buffer`.
//!
//! [`LegacyBuffer`]: legacy::LegacyBuffer
//! [`LegacyMapping`]: legacy::LegacyMapping
//! [`VmmBuffer`]: vmm::VmmBuffer
//! [`VmmMapping`]: vmm::VmmMapping
//! [`PoolBuffer`]: pool::PoolBuffer
//! [`PoolMapping`]: pool::PoolMapping
//! [`Mapping`]: buffer::Mapping
//! [`MappedBuffer`]: buffer::MappedBuffer
//!
//! # Device memory
//! What every piece of device memory in this crate offers, exported or
//! mapped: its address, its length, its device and stream, and copies to and
//! from the host.
//!
//! Device memory shared between processes is aliased by nature (another
//! process may write it at any time), so writes take `&self`: ordering is
//! the job of events, not of Rust's borrows. Every copy here runs on the
//! memory's stream and waits for it, so it is ordered after work queued
//! there and after any event that stream was made to wait on.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use bytemuck::Pod;
use cudarc::driver::{CudaEvent, CudaStream};

use crate::device::Device;
use crate::driver::result::{mem, stream as rstream};
use crate::error::{Error, Result};

pub mod buffer;
pub mod legacy;
mod owned;
pub mod pool;
pub mod vmm;
mod vmm_adopt;
mod vmm_sleep;

/// Device memory this process can use: owned, exported or mapped.
///
/// The library's copies and kernels read and write the range this trait
/// reports without further checks, so implementing it is `unsafe`. The
/// library implements it for every memory it makes; a program implements it
/// only for memory it allocated itself through the driver.
///
/// # Safety
/// For as long as the value lives (and while work queued through it on
/// [`DeviceMemory::stream`] may still run):
/// - `device_address()..device_address() + byte_len()` is device memory
///   usable from `device()`'s context, readable and writable;
/// - `device_address()`, `byte_len()`, `device()` and `stream()` return the
///   same values every time;
/// - `stream()` is a stream of `device()`'s context.
///
/// Safe code cannot claim an arbitrary address is device memory:
///
/// ```compile_fail
/// use std::sync::Arc;
/// use cuda_ipc_core::{Device, DeviceMemory};
/// use cuda_ipc_core::cudarc::driver::CudaStream;
///
/// struct Anywhere(Device);
///
/// impl DeviceMemory for Anywhere { // error: the trait requires `unsafe impl`
///     fn device(&self) -> &Device { &self.0 }
///     fn stream(&self) -> &Arc<CudaStream> { self.0.stream() }
///     fn device_address(&self) -> u64 { 0xdead_0000 }
///     fn byte_len(&self) -> usize { 4096 }
/// }
/// ```
pub unsafe trait DeviceMemory {
    /// The device the memory lives on (or, for a mapping, is mapped into).
    fn device(&self) -> &Device;

    /// The stream our helpers queue work on for this memory.
    ///
    /// For the memory this crate makes, work queued on the returned stream
    /// is ordered after every earlier use of the memory on other streams
    /// (through cudarc's traits, or as the source of our copies): once such a use
    /// happened, the stream is made to wait for it before it is returned.
    fn stream(&self) -> &Arc<CudaStream>;

    /// The address of the first byte, as a `CUdeviceptr`.
    fn device_address(&self) -> u64;

    /// The length in bytes.
    fn byte_len(&self) -> usize;

    /// The record of this memory's uses on streams other than its own, for
    /// the memory this crate makes (`None`: uses on other streams are
    /// waited for on the host instead).
    #[doc(hidden)]
    fn foreign_use(&self) -> Option<&ForeignUse> {
        None
    }

    /// Copies the whole memory into `dst` (whose length must match) after the
    /// work queued on [`DeviceMemory::stream`], and waits for the copy.
    #[doc(alias = "cuMemcpyDtoHAsync")]
    fn read_into<T: Pod>(&self, dst: &mut [T]) -> Result<()>
    where
        Self: Sized,
    {
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(dst);
        check_len(bytes.len(), self.byte_len())?;
        self.device().bind()?;
        let s = self.stream().cu_stream();
        // SAFETY: the source is this memory (the trait's contract); the
        // destination is a live host slice of the same length, and we wait
        // for the copy before it can be touched again.
        unsafe {
            mem::copy_dtoh_async(
                bytes.as_mut_ptr().cast(),
                self.device_address(),
                bytes.len(),
                s,
            )?;
            rstream::synchronize(s)
        }
    }

    /// Copies the whole memory into a new vector of `T` (the byte length must
    /// be a multiple of `size_of::<T>()`).
    fn to_vec<T: Pod>(&self) -> Result<Vec<T>>
    where
        Self: Sized,
    {
        let size = std::mem::size_of::<T>().max(1);
        if !self.byte_len().is_multiple_of(size) {
            return Err(Error::arg(
                "element type",
                format!(
                    "{} bytes is not a whole number of {size}-byte elements",
                    self.byte_len()
                ),
            ));
        }
        let mut v = vec![T::zeroed(); self.byte_len() / size];
        self.read_into(&mut v)?;
        Ok(v)
    }

    /// Copies `src` (whose byte length must match) into the memory, after the
    /// work queued on [`DeviceMemory::stream`], and waits for the copy.
    #[doc(alias = "cuMemcpyHtoDAsync")]
    fn write_from<T: Pod>(&self, src: &[T]) -> Result<()>
    where
        Self: Sized,
    {
        let bytes: &[u8] = bytemuck::cast_slice(src);
        check_len(bytes.len(), self.byte_len())?;
        self.device().bind()?;
        let s = self.stream().cu_stream();
        // SAFETY: as in `read_into`, the other way round.
        unsafe {
            mem::copy_htod_async(self.device_address(), bytes.as_ptr().cast(), bytes.len(), s)?;
            rstream::synchronize(s)
        }
    }

    /// Copies all of `src`, which lives on another device, into this memory
    /// on [`DeviceMemory::stream`] (`cuMemcpyPeerAsync`; the lengths must
    /// match), after the work queued on `src`'s stream. Waits for the copy:
    /// `src`'s context cannot record that its memory is still being read, so
    /// `src` may be dropped as soon as this returns.
    #[doc(alias = "cuMemcpyPeerAsync")]
    fn copy_from_peer(&self, src: &impl DeviceMemory) -> Result<()>
    where
        Self: Sized,
    {
        copy_in(self, src, || {
            // SAFETY: both ranges are live device memory of their devices' contexts.
            unsafe {
                mem::copy_peer_async(
                    self.device_address(),
                    self.device().context().cu_ctx(),
                    src.device_address(),
                    src.device().context().cu_ctx(),
                    self.byte_len(),
                    self.stream().cu_stream(),
                )
            }
        })
    }

    /// Waits until the work queued on [`DeviceMemory::stream`] is done
    /// (`cuStreamQuery`, then `cuStreamSynchronize` only when work is
    /// left: an idle stream returns at once, also where the driver's
    /// synchronize is slow, as for memory imported from another process's
    /// pool).
    #[doc(alias = "cuStreamSynchronize")]
    fn synchronize(&self) -> Result<()> {
        self.device().bind()?;
        // SAFETY: the stream is live for as long as the memory.
        unsafe { rstream::finish(self.stream().cu_stream()) }
    }

    /// A view of `len` bytes starting `offset` bytes into this memory.
    fn region(&self, offset: u64, len: u64) -> Result<Region<'_, Self>>
    where
        Self: Sized,
    {
        Error::check_range(offset, len, self.byte_len() as u64)?;
        Ok(Region {
            of: self,
            offset,
            len,
        })
    }

    /// Queues a device-to-device copy of all of `src` into this memory on
    /// [`DeviceMemory::stream`] (the lengths must match), after the work
    /// queued on `src`'s stream. For memory of this crate on the same device
    /// it does not wait: the copy counts as a use of `src` on this stream,
    /// which `src`'s own stream and its release wait for. Memory a program
    /// made, or on another context, is waited for before this returns.
    #[doc(alias = "cuMemcpyDtoDAsync")]
    fn copy_from_device(&self, src: &impl DeviceMemory) -> Result<()>
    where
        Self: Sized,
    {
        copy_in(self, src, || {
            // SAFETY: both ranges are live device memory of this length.
            unsafe {
                mem::copy_dtod_async(
                    self.device_address(),
                    src.device_address(),
                    self.byte_len(),
                    self.stream().cu_stream(),
                )
            }
        })
    }
}

/// Memory of this crate whose copies and kernels can move to another stream
/// of the device's primary context: [`LegacyBuffer`](legacy::LegacyBuffer),
/// [`VmmBuffer`](vmm::VmmBuffer), [`PoolBuffer`](pool::PoolBuffer),
/// [`SharedBuffer`](crate::share::SharedBuffer) and
/// [`MappedBuffer`](buffer::MappedBuffer).
pub trait WithStream: DeviceMemory + Sized {
    /// Uses `stream` for this memory's copies and kernels (and, for a
    /// [`PoolBuffer`](pool::PoolBuffer), its free); work queued before the switch stays
    /// ordered before work queued after it (the new stream waits on an
    /// event). A mapping (and a lease a view holds) waits for `stream` too
    /// before it goes.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `stream` belongs to another context
    /// than the device's primary one, where the memory lives.
    fn with_stream(self, stream: Arc<CudaStream>) -> Result<Self>;
}

/// A byte range of some [`DeviceMemory`], itself usable as device memory
/// (made by [`DeviceMemory::region`]).
#[derive(Debug)]
pub struct Region<'a, M: DeviceMemory> {
    of: &'a M,
    offset: u64,
    len: u64,
}

// SAFETY: `region` checked that the range lies inside `of`'s, which is
// borrowed for the region's lifetime.
unsafe impl<M: DeviceMemory> DeviceMemory for Region<'_, M> {
    fn device(&self) -> &Device {
        self.of.device()
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.of.stream()
    }
    fn device_address(&self) -> u64 {
        self.of.device_address() + self.offset
    }
    fn byte_len(&self) -> usize {
        self.len as usize
    }
    fn foreign_use(&self) -> Option<&ForeignUse> {
        self.of.foreign_use()
    }
}

/// What every copy from device memory `src` into `dst` does around the
/// copy that `queue` queues on `dst`'s stream: the lengths must match, and
/// `src` is used on `dst`'s stream while it queues, ordered after `src`'s
/// own work, and its release waits for the copy (on another device: the
/// host waits).
fn copy_in<D: DeviceMemory, S: DeviceMemory>(
    dst: &D,
    src: &S,
    queue: impl FnOnce() -> Result<()>,
) -> Result<()> {
    check_len(src.byte_len(), dst.byte_len())?;
    dst.device().bind()?;
    let _src_use = order_streams(src, dst.stream());
    queue()
}

fn check_len(host: usize, device: usize) -> Result<()> {
    if host == device {
        Ok(())
    } else {
        Err(Error::arg(
            "host buffer",
            format!(
                "{host} bytes on the host for {device} bytes on the device; the lengths must match"
            ),
        ))
    }
}

/// Implements cudarc's `DeviceSlice`, `DevicePtr` and `DevicePtrMut` for a
/// type that implements [`DeviceMemory`], so it can be a kernel argument and
/// be used with cudarc's copies.
///
/// When cudarc asks for the pointer on another stream than the memory's
/// own, that stream first waits for the memory's stream (an event), and the
/// use is recorded in the memory's [`ForeignUse`] (see [`order_streams`]).
#[doc(hidden)]
#[macro_export]
macro_rules! impl_cudarc_traits {
    ($ty:ident $(<$t:ident>)?, $elem:ty) => {
        impl$(<$t: bytemuck::Pod>)? cudarc::driver::DeviceSlice<$elem> for $ty$(<$t>)? {
            fn len(&self) -> usize {
                $crate::memory::DeviceMemory::byte_len(self) / std::mem::size_of::<$elem>().max(1)
            }
            fn stream(&self) -> &std::sync::Arc<cudarc::driver::CudaStream> {
                $crate::memory::DeviceMemory::stream(self)
            }
        }

        impl$(<$t: bytemuck::Pod>)? cudarc::driver::DevicePtr<$elem> for $ty$(<$t>)? {
            fn device_ptr<'a>(
                &'a self,
                stream: &'a cudarc::driver::CudaStream,
            ) -> (cudarc::driver::sys::CUdeviceptr, cudarc::driver::SyncOnDrop<'a>) {
                (
                    $crate::memory::DeviceMemory::device_address(self),
                    $crate::memory::order_streams(self, stream),
                )
            }
        }

        impl$(<$t: bytemuck::Pod>)? cudarc::driver::DevicePtrMut<$elem> for $ty$(<$t>)? {
            fn device_ptr_mut<'a>(
                &'a mut self,
                stream: &'a cudarc::driver::CudaStream,
            ) -> (cudarc::driver::sys::CUdeviceptr, cudarc::driver::SyncOnDrop<'a>) {
                (
                    $crate::memory::DeviceMemory::device_address(self),
                    $crate::memory::order_streams(self, stream),
                )
            }
        }
    };
}
#[doc(hidden)]
pub use crate::impl_cudarc_traits;

/// Orders a use of `memory` on `stream` and returns the guard that ends it
/// (cudarc's contract for `DevicePtr`):
///
/// - on the memory's own stream, nothing to do (its [`DeviceMemory::stream`]
///   is already ordered after uses elsewhere);
/// - on another stream of the same context, for memory of this crate,
///   `stream` waits for the memory's stream (an event, no host wait), and
///   the guard records the memory's [`ForeignUse`] event on `stream` when
///   the use is queued: later work on the memory's stream waits for it, and
///   the memory's release waits for its whole context;
/// - otherwise (a stream of another context, memory a program made, or
///   events that cudarc does not track), `stream` waits for the memory's
///   stream and the guard synchronises `stream` on the host.
#[doc(hidden)]
pub fn order_streams<'a, M: DeviceMemory + ?Sized>(
    memory: &'a M,
    stream: &'a CudaStream,
) -> cudarc::driver::SyncOnDrop<'a> {
    let own = memory.stream();
    if own.cu_stream() == stream.cu_stream() {
        return cudarc::driver::SyncOnDrop::Record(None);
    }
    // Errors are recorded in the context, as cudarc itself does in these traits.
    stream.context().record_err(stream.join(own));
    match memory.foreign_use().and_then(|f| f.begin(own, stream)) {
        Some(event) => cudarc::driver::SyncOnDrop::Record(Some((event, stream))),
        None => cudarc::driver::SyncOnDrop::Sync(Some(stream)),
    }
}

/// What a release waits for before it runs (see [`ForeignUse::uses`]).
pub(crate) enum UsesOf {
    /// The work queued so far on these streams.
    Streams(Vec<Arc<CudaStream>>),
    /// The work queued so far on every stream of the context.
    Context(Arc<cudarc::driver::CudaContext>),
}

impl UsesOf {
    /// What a release of both waits for.
    #[must_use]
    pub(crate) fn merge(self, other: UsesOf) -> UsesOf {
        match (self, other) {
            (UsesOf::Context(c), _) | (_, UsesOf::Context(c)) => UsesOf::Context(c),
            (UsesOf::Streams(mut a), UsesOf::Streams(b)) => {
                a.extend(b);
                UsesOf::Streams(a)
            }
        }
    }

    /// Retires `finish` to the [reaper](crate::reaper) until that work has
    /// finished. Never waits.
    pub(crate) fn retire(self, what: &'static str, finish: impl FnOnce() + Send + 'static) {
        match self {
            UsesOf::Streams(streams) => crate::sync::reaper::after_streams(&streams, what, finish),
            UsesOf::Context(ctx) => crate::sync::reaper::after_context(&ctx, what, finish),
        }
    }
}

/// Uses of a piece of memory on streams other than its own (cudarc's copies
/// and launches given another stream, our copies from it): one event,
/// recorded on the other stream after each such use.
///
/// Once a use happened, the memory's stream waits for the event whenever it
/// is asked for (so work queued there is ordered after the use), each later
/// use elsewhere waits for it too (so the event covers every use made one
/// after another), and the memory's release waits for its whole context
/// (so uses from several threads at once are covered as well). Memory never
/// used elsewhere pays one atomic load.
#[doc(hidden)]
#[derive(Debug, Default)]
pub struct ForeignUse {
    event: OnceLock<CudaEvent>,
    used: AtomicBool,
}

impl ForeignUse {
    /// Whether the memory was used on another stream.
    pub(crate) fn used(&self) -> bool {
        self.used.load(Ordering::Acquire)
    }

    /// Makes `own` (the memory's stream) wait for the uses elsewhere so far,
    /// and returns it.
    pub(crate) fn order<'s>(&self, own: &'s Arc<CudaStream>) -> &'s Arc<CudaStream> {
        if self.used()
            && let Some(event) = self.event.get()
        {
            own.context().record_err(own.wait(event));
        }
        own
    }

    /// Starts a use on `stream` (which already waits for `own`): returns the
    /// event the guard records there, or `None` when events cannot order it
    /// (another context, or cudarc not recording events).
    fn begin(&self, own: &CudaStream, stream: &CudaStream) -> Option<&CudaEvent> {
        let ctx = stream.context();
        if ctx.cu_ctx() != own.context().cu_ctx() || !ctx.is_managing_stream_synchronization() {
            return None;
        }
        let event = if let Some(e) = self.event.get() {
            e
        } else {
            let made = ctx.new_event(None).ok()?;
            self.event.get_or_init(|| made)
        };
        if self.used.swap(true, Ordering::AcqRel) {
            ctx.record_err(stream.wait(event));
        }
        Some(event)
    }

    /// What the memory's release waits for: the work queued so far on
    /// `streams` or, when the memory was used on other streams, on every
    /// stream of `ctx`.
    pub(crate) fn uses<'s>(
        &self,
        ctx: &Arc<cudarc::driver::CudaContext>,
        streams: impl IntoIterator<Item = &'s Arc<CudaStream>>,
    ) -> UsesOf {
        if self.used() {
            UsesOf::Context(ctx.clone())
        } else {
            UsesOf::Streams(streams.into_iter().cloned().collect())
        }
    }

    /// Waits for the uses elsewhere (an explicit wait: the whole context,
    /// when there were any).
    pub(crate) fn synchronize(&self, ctx: &Arc<cudarc::driver::CudaContext>) -> Result<()> {
        if self.used() {
            ctx.synchronize()
                .map_err(|e| crate::error::from_cudarc("cuCtxSynchronize", e))?;
        }
        Ok(())
    }
}

/// The one implementation of every memory type's `with_stream`: checks
/// that `new` is a stream of `device`'s context, and orders it after the
/// work queued so far on `current` (`new` waits on an event recorded on
/// `current`), so that work queued before the switch stays ordered before
/// work queued after it, and waiting for `new` (as a release does) also
/// waits for it. Returns `new`.
///
/// # Errors
/// [`Error::InvalidArgument`] when `new` belongs to another context (another
/// device, or a context that is not the device's primary one): the memory's
/// address means nothing there. A driver error when the ordering event
/// cannot be recorded or waited on.
pub(crate) fn switch_stream(
    device: &Device,
    current: &Arc<CudaStream>,
    new: Arc<CudaStream>,
) -> Result<Arc<CudaStream>> {
    if new.context().cu_ctx() != device.context().cu_ctx() {
        return Err(Error::arg(
            "stream",
            format!(
                "it belongs to another CUDA context than device {}'s primary context, where this \
                 memory lives; make the stream with the device's context \
                 (device.context().new_stream())",
                device.ordinal()
            ),
        ));
    }
    if new.cu_stream() != current.cu_stream() {
        new.join(current)
            .map_err(|e| crate::error::from_cudarc("cuStreamWaitEvent", e))?;
    }
    Ok(new)
}
