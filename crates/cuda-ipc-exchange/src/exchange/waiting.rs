//! How a subscriber waits for its publisher's work: the publisher's
//! events and fences, opened once per subscriber, and the waits on them.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use cudarc::driver::CudaStream;
use serde_json::Value;

use crate::channel::Client;
use crate::error::{Error, Result};
use crate::event::IpcEvent;
use crate::fence::FenceMapping;
use crate::handle::IpcEventHandle;

use super::lock;
use super::subscriber::Subscriber;
use super::sync::{self, SyncMode, Waiter};

impl Subscriber {
    pub(super) fn event(&self, handle: IpcEventHandle) -> Result<Arc<IpcEvent>> {
        let mut events = lock(&self.events);
        if let Some(e) = events.get(&handle) {
            return Ok(e.clone());
        }
        let e = Arc::new(IpcEvent::open(&self.device, handle)?);
        events.insert(handle, e.clone());
        Ok(e)
    }

    /// The fence block `meta` names, mapped once per subscriber.
    pub(super) fn fence(
        &self,
        meta: &super::wire::FenceMeta,
        fd: OwnedFd,
    ) -> Result<Arc<FenceMapping>> {
        let mut fences = lock(&self.fences);
        if let Some(f) = fences.get(&meta.block.id()) {
            return Ok(f.clone());
        }
        let f = Arc::new(FenceMapping::open(&self.device, &meta.block, vec![fd])?);
        fences.insert(meta.block.id(), f.clone());
        Ok(f)
    }

    /// Chooses how to wait for an entry's work, per this subscriber's
    /// [`SyncMode`]: on the publisher's event `handle` (which `what`, the
    /// kind of entry, must carry unless it waits on the fence) or on
    /// `fence`, whose file descriptor is taken out of `fds`.
    pub(super) fn waiter(
        &self,
        handle: Option<IpcEventHandle>,
        fence: Option<super::wire::FenceMeta>,
        fds: &mut Vec<OwnedFd>,
        what: &str,
    ) -> Result<Waiter> {
        // A pushed entry comes without descriptors: its fence must be one
        // this subscriber mapped already.
        let cached = match &fence {
            Some(meta) if fds.is_empty() => {
                let known = lock(&self.fences).get(&meta.block.id()).cloned();
                Some(known.ok_or_else(|| Error::Descriptor {
                    field: "fence".into(),
                    reason: format!("{what} came without its fence's descriptor, and that fence is not mapped here"),
                })?)
            }
            _ => None,
        };
        let fence = match cached {
            Some(_) => fence.map(|meta| (None, meta)),
            None => sync::take_fence_fd(fence, fds)?.map(|(fd, meta)| (Some(fd), meta)),
        };
        // Nothing to open but the fence (a fences-only ring's slots carry
        // no event): Auto takes it without trying, or logging, an event,
        // and Event cannot be served.
        let fence_only = handle.is_none() && fence.is_some();
        let mode = match self.sync {
            SyncMode::Event if fence_only => {
                return Err(Error::Unsupported {
                    what: "waiting on the publisher's events",
                    why: format!(
                        "{what} carries no event of the publisher, only its fence (as a \
                         fences-only ring's slots do: RingSync::FencesOnly); attach with \
                         SyncMode::Auto, Fence or HostFence"
                    ),
                });
            }
            SyncMode::Auto if fence_only => SyncMode::Fence,
            mode => mode,
        };
        sync::choose(
            mode,
            || {
                let handle = handle.ok_or_else(|| Error::Descriptor {
                    field: "event".into(),
                    reason: format!("{what} must carry the publisher's event"),
                })?;
                self.event(handle)
            },
            fence.as_ref().map(|(fd, meta)| {
                (meta, move || match (fd, &cached) {
                    (_, Some(mapping)) => Ok(mapping.clone()),
                    (Some(fd), None) => self.fence(
                        meta,
                        fd.try_clone()
                            .map_err(|e| Error::io("duplicating the fence's descriptor", e))?,
                    ),
                    (None, None) => Err(Error::arg("fence", "no descriptor and none mapped")),
                })
            }),
        )
    }

    /// Makes `stream` wait for the publisher's latest work (at attach), with
    /// this subscriber's deadline; abandons a fence when the publisher (on
    /// the connection `client`) is gone.
    pub(super) fn wait_latest(
        &self,
        client: &Arc<Client>,
        waiter: &Waiter,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        let client = client.clone();
        waiter.wait_latest(stream, &move || client.is_alive(), self.timeout)
    }

    /// Makes `stream` wait for the work of the update whose notice carried
    /// `data` (see [`Waiter::wait_update`]).
    pub(super) fn wait_notice(
        &self,
        client: &Arc<Client>,
        waiter: &Waiter,
        stream: &Arc<CudaStream>,
        data: &Value,
    ) -> Result<()> {
        let client = client.clone();
        waiter.wait_update(stream, data, &move || client.is_alive(), self.timeout)
    }

    /// Makes `stream` wait (GPU-side, after a host-side deadline) until the
    /// fence reaches `seq`; abandons it when the publisher is gone.
    pub(super) fn wait_fence(
        &self,
        client: &Arc<Client>,
        waiter: &Waiter,
        stream: &Arc<CudaStream>,
        seq: u64,
    ) -> Result<()> {
        let client = client.clone();
        waiter.wait_seq(stream, seq, &move || client.is_alive(), self.timeout)
    }
}
