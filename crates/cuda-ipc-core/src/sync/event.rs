//! Interprocess events: the way two processes order their GPU work on
//! shared memory without waiting on the host.
//!
//! The producer records an [`IpcEvent`] on its stream after writing and
//! sends the event's handle (once) and a notice (each time); the consumer,
//! having opened the handle once, makes its stream wait on the event before
//! reading. Waiting applies to the most recent record made before the wait
//! is queued, so every publish must record again and notify after the
//! record.
#![allow(unsafe_code)]

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaStream, sys};

use crate::device::Device;
use crate::driver::result::{event, ipc, stream};
use crate::error::Result;
use crate::handle::IpcEventHandle;

/// How long [`IpcEvent::wait_on`] polls an event that has not completed
/// before it queues a wait on the device: long enough for a short kernel
/// to finish, short against the context switch a queued wait can cost.
pub(crate) const HOST_POLL: Duration = Duration::from_micros(50);

/// An event that can be shared with other processes
/// (`CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING`), created here or
/// opened from another process's handle. Destroyed on drop.
#[derive(Debug)]
pub struct IpcEvent {
    device: Device,
    event: sys::CUevent,
    handle: OnceLock<IpcEventHandle>,
}

// SAFETY: event handles are process-wide driver objects; every call binds the context first.
unsafe impl Send for IpcEvent {}
// SAFETY: as above; recording and waiting are thread-safe driver calls.
unsafe impl Sync for IpcEvent {}

impl IpcEvent {
    /// Creates an interprocess event on `device`.
    #[doc(alias = "cuEventCreate")]
    pub fn new(device: &Device) -> Result<Self> {
        device.bind()?;
        let flags = sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32
            | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        Ok(IpcEvent {
            device: device.clone(),
            event: event::create(flags)?,
            handle: OnceLock::new(),
        })
    }

    /// Opens an event another process exported.
    #[doc(alias = "cuIpcOpenEventHandle")]
    pub fn open(device: &Device, handle: IpcEventHandle) -> Result<Self> {
        crate::handle::refuse_zero(&handle)?;
        device.bind()?;
        let event = ipc::open_event_handle(handle)?;
        let handle_cell = OnceLock::new();
        let _ = handle_cell.set(handle);
        Ok(IpcEvent {
            device: device.clone(),
            event,
            handle: handle_cell,
        })
    }

    /// The handle to send to other processes (obtained once, then reused).
    #[doc(alias = "cuIpcGetEventHandle")]
    pub fn handle(&self) -> Result<IpcEventHandle> {
        if let Some(h) = self.handle.get() {
            return Ok(*h);
        }
        self.device.bind()?;
        // SAFETY: the event is live for as long as `self`.
        let h = unsafe { ipc::get_event_handle(self.event) }?;
        Ok(*self.handle.get_or_init(|| h))
    }

    /// Records the work queued so far on `stream`.
    #[doc(alias = "cuEventRecord")]
    pub fn record(&self, on: &CudaStream) -> Result<()> {
        self.device.bind()?;
        // SAFETY: both live.
        unsafe { event::record(self.event, on.cu_stream()) }
    }

    /// Makes `stream` wait (on the device, not the host) for the most
    /// recent record of this event, in whichever process it was made.
    ///
    /// When that record has completed (`cuEventQuery`), there is nothing to
    /// wait for and no wait is queued: a queued wait on another process's
    /// event makes a GPU shared by both processes switch to the waiting
    /// process's context, which costs about 0.15 ms on an H200 even when
    /// the work is long done. Work that is about to finish (a short kernel
    /// launched just before the event was recorded) is given up to
    /// 50 µs of polling first; longer work gets the queued wait.
    #[doc(alias = "cuStreamWaitEvent")]
    pub fn wait_on(&self, on: &CudaStream) -> Result<()> {
        self.device.bind()?;
        let started = Instant::now();
        loop {
            // SAFETY: live.
            if unsafe { event::query(self.event) }? {
                return Ok(());
            }
            if started.elapsed() >= HOST_POLL {
                break;
            }
            std::hint::spin_loop();
        }
        // SAFETY: both live.
        unsafe { stream::wait_event(on.cu_stream(), self.event) }
    }

    /// Blocks the calling thread until the most recent record has completed.
    #[doc(alias = "cuEventSynchronize")]
    pub fn synchronize(&self) -> Result<()> {
        self.device.bind()?;
        // SAFETY: live.
        unsafe { event::synchronize(self.event) }
    }

    /// Whether the most recent record has completed.
    #[doc(alias = "cuEventQuery")]
    pub fn is_complete(&self) -> Result<bool> {
        self.device.bind()?;
        // SAFETY: live.
        unsafe { event::query(self.event) }
    }

    /// The raw event, for the driver's floor (`floor`). Do not destroy it.
    #[cfg(feature = "test-support")]
    pub(crate) fn cu_event(&self) -> sys::CUevent {
        self.event
    }
}

impl Drop for IpcEvent {
    fn drop(&mut self) {
        // Errors cannot be raised from drop; a failed destroy means the
        // context is gone, which destroys the event with it.
        let _ = self.device.bind();
        // SAFETY: created or opened in this value, destroyed once.
        let _ = unsafe { event::destroy(self.event) };
    }
}
