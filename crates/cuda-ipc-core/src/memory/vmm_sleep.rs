//! Sleep and wake of an imported VMM mapping: unmapped with its address
//! range kept, then mapped again at the same addresses, so that what
//! recorded those addresses (a CUDA graph captured over the memory, a
//! tensor's pointer) is valid again after the wake.
//!
//! The physical memory stays with its exporter the whole time (the mapping
//! keeps its imported handles, and its lease when it came through the
//! exchange); a sleep gives back the mapping only. While a mapping sleeps,
//! its addresses are reserved and unmapped: no other allocation can land
//! there, and a kernel or copy that touches them faults (and poisons the
//! CUDA context) instead of reading anything. Not touching sleeping memory
//! is the caller's part, as for every engine that sleeps its weights: the
//! library cannot see every use (views, tensors, raw addresses, CUDA
//! graphs), so [`Mapping::sleep`](crate::memory::buffer::Mapping::sleep) is an `unsafe fn`. A subscriber
//! sleeps its mappings safely when none of them has a view left
//! ([`Subscriber::sleep`](crate::exchange::Subscriber::sleep)).
#![allow(unsafe_code)]

use crate::driver::result::vmm;
use crate::error::Result;
use crate::memory::buffer::lock;
use crate::memory::vmm::{VmmMapping, set_access};

impl VmmMapping {
    /// Unmaps every segment, keeping the address range reserved and the
    /// imported allocations; first waits for the work queued through the
    /// mapping (every stream its views used, and every stream of the
    /// device's context: PyTorch's and CuPy's too), so this call blocks
    /// until that work is done. Sleeping a sleeping
    /// mapping does nothing. If an unmap fails, the segments already
    /// unmapped are mapped again and the mapping stays awake.
    ///
    /// # Safety
    /// From this call until [`wake`](Self::wake) has returned, no work may
    /// touch the memory: none queued, by any thread, on any stream, through
    /// a view, a tensor, a raw address or a CUDA graph of it, and no view
    /// read or written from the host (a kernel or copy on an unmapped
    /// address faults and poisons the context). The wait above covers the
    /// work queued before the call only: work queued by another thread
    /// while it waits would run after the unmap.
    #[doc(alias = "cuMemUnmap")]
    pub(crate) unsafe fn sleep(&self) -> Result<()> {
        let mut state = lock(&self.state);
        if state.asleep {
            return Ok(());
        }
        self.device.bind()?;
        self.streams.synchronize_all()?;
        self.device
            .context()
            .synchronize()
            .map_err(|e| crate::error::from_cudarc("cuCtxSynchronize", e))?;
        for i in 0..self.handles.len() {
            let at = self.segment_at(i);
            // SAFETY: segment i is mapped (the mapping is awake and the
            // state's lock keeps other sleeps and wakes out); the work
            // queued through it before this call has finished (waited for
            // above) and the caller queues none until the wake.
            if let Err(e) = unsafe { vmm::unmap(at, self.segment) } {
                // Map back what was unmapped, so the mapping stays whole.
                let back = self.map_range(0..i, &state.devices);
                return Err(match back {
                    Ok(()) => e,
                    Err(again) => crate::error::Error::arg(
                        "sleeping a VMM mapping",
                        format!(
                            "unmapping segment {i} failed ({e}) and mapping the first {i} again \
                             failed too ({again}); drop the mapping"
                        ),
                    ),
                });
            }
        }
        state.asleep = true;
        Ok(())
    }

    /// Maps every segment again at the addresses it had, with the access
    /// it had, for every device granted (on this mapping's device too). A
    /// mapping that is awake is left as it is. On failure, what was mapped
    /// is unmapped again and the mapping still sleeps.
    #[doc(alias = "cuMemMap")]
    #[doc(alias = "cuMemSetAccess")]
    pub(crate) fn wake(&self) -> Result<()> {
        let mut state = lock(&self.state);
        if !state.asleep {
            return Ok(());
        }
        self.device.bind()?;
        self.map_range(0..self.handles.len(), &state.devices)?;
        state.asleep = false;
        Ok(())
    }

    /// Whether it sleeps (see [`Mapping::sleep`](crate::memory::buffer::Mapping::sleep)).
    pub(crate) fn asleep(&self) -> bool {
        lock(&self.state).asleep
    }

    /// The address of segment `i`.
    fn segment_at(&self, i: usize) -> u64 {
        self.ptr + i as u64 * self.segment
    }

    /// Maps segments `range` (unmapped, in the reserved range) and grants
    /// `devices` the mapping's access to them; on failure unmaps what it
    /// mapped.
    fn map_range(&self, range: std::ops::Range<usize>, devices: &[i32]) -> Result<()> {
        if range.is_empty() {
            return Ok(());
        }
        let mut mapped = range.start;
        let result = (|| {
            for i in range.clone() {
                // SAFETY: the range is reserved for as long as `self` lives
                // and segment i is not mapped; handle i is live (released
                // only on drop).
                unsafe { vmm::map(self.segment_at(i), self.segment, self.handles[i]) }?;
                mapped = i + 1;
            }
            let start = self.segment_at(range.start);
            let len = (range.end - range.start) as u64 * self.segment;
            // SAFETY: segments `range` were mapped just above.
            unsafe { set_access(start, len, devices, self.access) }
        })();
        if result.is_err() {
            for i in range.start..mapped {
                // SAFETY: mapped above, never used.
                let _ = unsafe { vmm::unmap(self.segment_at(i), self.segment) };
            }
        }
        result
    }
}
