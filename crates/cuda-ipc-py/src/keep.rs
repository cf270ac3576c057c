//! Holds on device memory: while any clone of a [`Keep`] lives, the
//! mapping (and the lease, for memory attached over the channel) or the
//! published buffer it holds stays. Mapping objects, views, DLPack capsules,
//! set attachments and the torch C API's tensors hold one.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cuda_ipc::buffer::MappedBuffer;
use cuda_ipc::device::Device;
use cuda_ipc::{Error, Result};
use pyo3::prelude::*;

use crate::errors::{IntoPyResult, lock};

/// Mappings of this process not unmapped yet.
pub(crate) static LIVE: AtomicUsize = AtomicUsize::new(0);

/// A hold on device memory: the mapping (and the lease, for memory
/// attached over the channel) or the published buffer stays while any
/// `Keep` of it lives. Mapping objects and every DLPack capsule or
/// CUDA-array-interface view hold one.
#[derive(Clone)]
pub(crate) struct Keep {
    inner: Arc<KeepInner>,
}

impl std::fmt::Debug for Keep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keep").finish_non_exhaustive()
    }
}

struct KeepInner {
    device: Device,
    /// Counted in `live_mappings`.
    live: bool,
    hold: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl Keep {
    /// A hold on mapped memory (counted in `live_mappings`).
    pub(crate) fn new(buffer: MappedBuffer<u8>) -> Self {
        LIVE.fetch_add(1, Ordering::SeqCst);
        Keep {
            inner: Arc::new(KeepInner {
                device: buffer.mapping().device().clone(),
                live: true,
                hold: Some(Box::new(buffer)),
            }),
        }
    }

    /// Lets go of this hold now, for an explicit release (which may wait,
    /// without the GIL): when it is the last, the context's work is waited
    /// for and the memory let go of here, so that what the caller releases
    /// next (a lease) sees it gone. Otherwise the others keep it.
    pub(crate) fn release_now(self) -> Result<()> {
        let Ok(mut inner) = Arc::try_unwrap(self.inner) else {
            return Ok(());
        };
        let waited = inner
            .device
            .context()
            .synchronize()
            .map_err(|e| cuda_ipc::error::from_cudarc("cuCtxSynchronize", e));
        drop(inner.hold.take());
        if std::mem::replace(&mut inner.live, false) {
            LIVE.fetch_sub(1, Ordering::SeqCst);
        }
        waited
    }

    /// How many holds there are on this memory (this one included).
    pub(crate) fn holders(&self) -> usize {
        Arc::strong_count(&self.inner)
    }

    /// A hold on anything else that owns device memory of `device`.
    pub(crate) fn other(device: Device, hold: impl std::any::Any + Send + Sync) -> Self {
        Keep {
            inner: Arc::new(KeepInner {
                device,
                live: false,
                hold: Some(Box::new(hold)),
            }),
        }
    }
}

impl Drop for KeepInner {
    fn drop(&mut self) {
        // The last holder. Work any framework queued on the memory, on any
        // stream of the context (PyTorch's and CuPy's streams are not
        // ours to know), must finish before it is let go: the release is
        // retired until a barrier over the context has passed, on the
        // library's thread. Never waits here, with or without the GIL.
        let Some(hold) = self.hold.take() else {
            return;
        };
        let live = self.live;
        cuda_ipc::reaper::after_context(
            self.device.context(),
            "releasing memory handed to Python",
            move || {
                drop(hold);
                if live {
                    LIVE.fetch_sub(1, Ordering::SeqCst);
                }
            },
        );
    }
}

/// Takes what an explicit `release()` ends out of its owner: `None` if it
/// was released already; an error, with the owner left as it was, while
/// views made from it are alive (the lease then ends with the last of
/// them) or while another thread waits on it.
pub(crate) fn take_for_release<T>(
    slot: &Mutex<Option<Arc<T>>>,
    keep: &Mutex<Option<Keep>>,
    name: &str,
    lease: u64,
    what: &str,
) -> PyResult<Option<(Option<Keep>, T)>> {
    let mut guard = lock(slot);
    let Some(shared) = guard.take() else {
        return Ok(None);
    };
    let mut own = lock(keep);
    let views = own.as_ref().map_or(0, |k| k.holders().saturating_sub(1));
    if views > 0 {
        *guard = Some(shared);
        return Err(Error::ViewsAlive {
            name: name.to_owned(),
            lease,
            views,
        })
        .py();
    }
    match Arc::try_unwrap(shared) {
        Ok(t) => Ok(Some((own.take(), t))),
        Err(shared) => {
            *guard = Some(shared);
            Err(Error::InvalidArgument {
                what: "release",
                reason: format!(
                    "another thread is waiting for an update of this {what}; release it after \
                     that wait returns"
                ),
            })
            .py()
        }
    }
}
