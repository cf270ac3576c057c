//! One buffer attached from a publisher: the [`Attachment`] (the
//! subscriber's work of attaching one and following its updates is in
//! `attach.rs`).

use std::sync::Arc;

use bytemuck::Pod;

use crate::descriptor::Descriptor;
use crate::memory::buffer::MappedBuffer;

use super::lease::LeaseGuard;

/// A buffer attached from a publisher: a lease and a typed mapping. The
/// buffer and every view made from it hold the lease.
///
/// Layers: made from the channel's [`Attachment`](crate::channel::Attachment)
/// (the lease, the metadata and raw descriptors) by importing the
/// descriptors; the same word, one layer up.
///
/// Its buffer lends out only `&dyn Mapping`, so no view can be made
/// around its lease:
///
/// ```compile_fail
/// # fn f(a: cuda_ipc_exchange::exchange::Attachment<u8>) -> cuda_ipc_core::Result<()> {
/// use cuda_ipc_core::MappedBuffer;
/// // error: expected `Arc<dyn Mapping>`, found `&dyn Mapping`
/// let unleased = MappedBuffer::<u8>::new(a.buffer().mapping().clone(), 0, 1)?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Attachment<T> {
    pub(super) name: String,
    pub(super) guard: Arc<LeaseGuard>,
    pub(super) buffer: MappedBuffer<T>,
    pub(super) descriptor: Descriptor,
}

impl<T: Pod> Attachment<T> {
    pub(super) fn from_parts(
        name: String,
        guard: Arc<LeaseGuard>,
        buffer: MappedBuffer<T>,
        descriptor: Descriptor,
    ) -> Self {
        Attachment {
            name,
            guard,
            buffer,
            descriptor,
        }
    }

    /// The guard and the buffer, for a release.
    pub(super) fn into_parts(self) -> (Arc<LeaseGuard>, MappedBuffer<T>) {
        (self.guard, self.buffer)
    }

    /// The mapped buffer; its stream waits on the publisher's event.
    pub fn buffer(&self) -> &MappedBuffer<T> {
        &self.buffer
    }
    /// The entry's name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The lease id (on the connection it was last taken on: a
    /// reconnecting subscriber's new connection gives it a new one).
    pub fn lease(&self) -> u64 {
        self.guard.lease().id
    }
    /// The descriptor the publisher sent.
    pub fn descriptor(&self) -> &Descriptor {
        &self.descriptor
    }
    /// Whether this buffer waits on the publisher's fence (rather than its
    /// event).
    pub fn uses_fence(&self) -> bool {
        self.guard.waiter().is_some_and(|w| w.is_fence())
    }
    /// Whether the buffer is mapped read-only (the subscriber's
    /// [`SubscriberConfig::access`](super::SubscriberConfig::access), or an
    /// arena buffer whose publisher asks for read-only readers): writing
    /// through it fails.
    pub fn read_only(&self) -> bool {
        self.buffer.mapping().read_only()
    }
}
