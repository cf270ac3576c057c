//! The subscriber's work for one buffer: attaching it ([`Subscriber::attach`]),
//! mapping its descriptor, and following its updates.

use std::collections::VecDeque;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytemuck::Pod;
use serde_json::Value;

use crate::channel::{ChannelError, Client, Notice};
use crate::descriptor::Descriptor;
use crate::error::{Error, Result};
use crate::memory::DeviceMemory;
use crate::memory::buffer::{MappedBuffer, Mapping};
use crate::share;

use super::attachment::Attachment;
use super::lease::{LeaseGuard, LeaseId, Standing};
use super::link::Connection;
use super::lock;
use super::subscriber::{Subscriber, awake};
use super::sync::Waiter;
use super::wire::EntryMeta;

impl Subscriber {
    /// The work of [`Subscriber::attach`], on `conn`.
    pub(super) fn do_attach<T: Pod>(&self, conn: &Connection, name: &str) -> Result<Attachment<T>> {
        let mut phases = crate::phases::Phases::start("core.attach");
        let a = conn.client.attach(name)?;
        phases.mark("request");
        if super::set_book::is_set_meta(&a.meta) {
            return self.attach_arena_buffer(conn, a, &mut phases);
        }
        let opened = self.open_descriptor::<T>(&conn.client, &a.meta, a.fds, "a published buffer");
        phases.mark("open");
        match opened {
            Ok((descriptor, buffer, waiter)) => {
                let guard = LeaseGuard::with(
                    &self.link,
                    &self.pending,
                    LeaseId {
                        id: a.lease,
                        epoch: conn.epoch,
                    },
                    a.name.clone(),
                    vec![buffer.mapping_arc().clone()],
                    Some(waiter),
                    None,
                );
                Ok(Attachment {
                    name: a.name,
                    buffer: buffer.hold(guard.clone()),
                    guard,
                    descriptor,
                })
            }
            Err(e) => {
                let _ = conn.client.release(a.lease);
                Err(e)
            }
        }
    }

    /// The mapping `descriptor` names: from the cache (the same exporter
    /// and allocation generation), or opened from `fds`.
    fn mapping(
        &self,
        descriptor: &Descriptor,
        fds: Vec<std::os::fd::OwnedFd>,
    ) -> Result<Arc<dyn Mapping>> {
        let key = descriptor
            .generation
            .map(|g| (descriptor.pid, g, self.access));
        if let Some(key) = key
            && let Some(m) = lock(&self.cache).get(&key).and_then(Weak::upgrade)
        {
            return awake(m);
        }
        let m = share::open_mapping(&self.device, descriptor, fds, self.access)?;
        self.opened(&m);
        if let Some(key) = key {
            let mut cache = lock(&self.cache);
            cache.retain(|_, w| w.strong_count() > 0);
            cache.insert(key, Arc::downgrade(&m));
        }
        Ok(m)
    }

    pub(super) fn open_descriptor<T: Pod>(
        &self,
        client: &Arc<Client>,
        meta: &Value,
        fds: Vec<std::os::fd::OwnedFd>,
        what: &str,
    ) -> Result<(Descriptor, MappedBuffer<T>, Waiter)> {
        let (descriptor, fence) = EntryMeta::decode_with_fence(meta)?;
        let mut fds = fds;
        let waiter = self.waiter(descriptor.event, fence, &mut fds, what)?;
        let mapping = self.mapping(&descriptor, fds)?;
        let buffer =
            MappedBuffer::<T>::from_bytes(mapping, descriptor.offset, descriptor.byte_len)?;
        self.wait_latest(client, &waiter, buffer.stream())?;
        Ok((descriptor, buffer, waiter))
    }

    /// The work of [`Subscriber::wait_update`].
    pub(super) fn do_wait_update<T: Pod>(
        &self,
        attached: &Attachment<T>,
        timeout: Duration,
    ) -> Result<u64> {
        let guard = &attached.guard;
        let deadline = crate::channel::deadline_in(timeout);
        match self.next_notice_on(guard, &attached.name, deadline)? {
            Some((conn, notice)) => self.apply(&conn, attached, &notice),
            None => Ok(guard.replaced_version()),
        }
    }

    /// The next notice on the lease `guard` holds on entry `name`: filed
    /// for it already, or from the client by `deadline` (filing those of
    /// other leases), with the connection it came on; through a restart of
    /// a publisher this subscriber reconnects to, on the next connection.
    /// `None` when the lease's version is no longer served (after a
    /// restart): the caller attaches the current one.
    pub(super) fn next_notice_on(
        &self,
        guard: &LeaseGuard,
        name: &str,
        deadline: Instant,
    ) -> Result<Option<(Connection, Notice)>> {
        loop {
            let conn = self.ready()?;
            let Some(lease) = lease_on(guard, &conn, name)? else {
                return Ok(None);
            };
            if let Some(notice) = lock(&self.pending)
                .get_mut(&lease)
                .and_then(VecDeque::pop_front)
            {
                return Ok(Some((conn, notice)));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let u = match conn.client.next_update(left) {
                Ok(u) => u,
                // Its publisher restarts: connect again, then wait on.
                Err(ChannelError::PeerGone)
                    if self.link.reconnects() && Instant::now() < deadline =>
                {
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            if u.lease == lease {
                return Ok(Some((conn, u.notice)));
            }
            lock(&self.pending)
                .entry(u.lease)
                .or_default()
                .push_back(u.notice);
        }
    }

    fn apply<T: Pod>(
        &self,
        conn: &Connection,
        attached: &Attachment<T>,
        notice: &Notice,
    ) -> Result<u64> {
        match notice {
            Notice::Updated { version, data } => {
                let mut phases = crate::phases::Phases::start("core.wait_update");
                let waiter = attached.guard.waiter().ok_or_else(no_waiter)?;
                self.wait_notice(&conn.client, &waiter, attached.buffer.stream(), data)?;
                phases.mark("stream_wait");
                Ok(attached.guard.updated(*version))
            }
            Notice::Unpublished => Err(ChannelError::Unpublished {
                name: attached.name.clone(),
                lease: attached.lease(),
            }
            .into()),
            other => Err(ChannelError::Protocol {
                reason: format!("a notice this version does not know: {other:?}"),
            }
            .into()),
        }
    }
}

/// The error for an attachment made without a way to wait (none is).
pub(super) fn no_waiter() -> Error {
    Error::arg("attachment", "it has no event or fence to wait on")
}

/// The lease id of `guard` on `conn`, for a wait for its updates;
/// `None` when the version it holds was replaced while no connection
/// heard of it (the wait returns at once: an update happened). The
/// publisher's refusal when it could not be taken back (tried again at
/// the next call), [`ChannelError::Unpublished`] when `name` is not
/// published any more, [`ChannelError::PeerGone`] for a lease that is
/// not taken back.
pub(super) fn lease_on(guard: &LeaseGuard, conn: &Connection, name: &str) -> Result<Option<u64>> {
    match guard.standing(conn.epoch) {
        Standing::Held => Ok(Some(guard.lease().id)),
        Standing::Replaced => Ok(None),
        Standing::Missing(Some((code, message))) => {
            Err(ChannelError::Remote { code, message }.into())
        }
        Standing::Gone if guard.record().is_some() => Err(ChannelError::Unpublished {
            name: name.to_owned(),
            lease: guard.lease().id,
        }
        .into()),
        Standing::Missing(None) | Standing::Gone => Err(ChannelError::PeerGone.into()),
    }
}
