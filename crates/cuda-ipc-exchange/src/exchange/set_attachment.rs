//! A set attached from a publisher: its record, the views of its entries
//! and the lease that holds them.

use super::lease::LeaseGuard;
use crate::Access;
use crate::error::{Error, Result};
use crate::memory::buffer::{MappedBuffer, Mapping};
use crate::set::{NameIndex, SetEntry, SetRecord};
use bytemuck::Pod;
use std::collections::HashMap;
use std::sync::Arc;

/// A set attached from a publisher: one lease for the whole set, every chunk
/// mapped once, typed views of its buffers by name or index. The set and
/// every view made from it hold the lease; [`Subscriber::release_set`](super::Subscriber::release_set) (or
/// dropping the set and its views) releases it.
#[derive(Debug)]
pub struct SetAttachment {
    /// How every chunk of the set is mapped.
    pub(super) access: Access,
    /// The lease, and how the set waits for its publisher's work (both
    /// change when a reconnect takes the lease back).
    pub(super) guard: Arc<LeaseGuard>,
    pub(super) mappings: HashMap<u64, Arc<dyn Mapping>>,
    /// The record, shared (what outlives the attachment, a binding's lazy
    /// layout hash, reads it without a copy), and its entries by name.
    pub(super) index: NameIndex,
}

/// Where a buffer of an attached set is in this process
/// ([`SetAttachment::entry_places`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntryPlace {
    /// The local address of the first byte of its chunk's mapping.
    pub mapping_base: u64,
    /// The size of that mapping in bytes.
    pub mapping_size: u64,
    /// The local address of the buffer's first byte.
    pub address: u64,
}

impl SetAttachment {
    /// The set's name.
    pub fn name(&self) -> &str {
        &self.record().name
    }

    /// The lease id (on the connection it was last taken on: a
    /// reconnecting subscriber's new connection gives it a new one).
    pub fn lease(&self) -> u64 {
        self.guard.lease().id
    }

    /// Whether this set waits on the publisher's fence (rather than its
    /// event).
    pub fn uses_fence(&self) -> bool {
        self.guard.waiter().is_some_and(|w| w.is_fence())
    }

    /// How the set's chunks are mapped: read-only when the subscriber asked
    /// for it or the publisher's record does.
    pub fn access(&self) -> Access {
        self.access
    }

    /// Whether the set is mapped read-only: writing through any of its
    /// views fails (each view's mapping says so too, [`Mapping::read_only`]).
    pub fn read_only(&self) -> bool {
        self.access == Access::ReadOnly
    }

    /// The set record the publisher sent.
    pub fn record(&self) -> &SetRecord {
        self.index.record()
    }

    /// The set record, shared (it stays readable after the attachment is
    /// released).
    pub fn shared_record(&self) -> Arc<SetRecord> {
        Arc::clone(self.index.record())
    }

    /// The number of buffers.
    pub fn len(&self) -> usize {
        self.record().entries.len()
    }

    /// Never true: a set has at least one buffer.
    pub fn is_empty(&self) -> bool {
        self.record().entries.is_empty()
    }

    /// The buffers' entries (name, dtype, shape, place), in the producer's order.
    pub fn entries(&self) -> &[SetEntry] {
        &self.record().entries
    }

    /// The index of the buffer called `name`.
    pub fn position(&self, name: &str) -> Option<usize> {
        self.index.position(name)
    }

    /// A view of the buffer called `name` as elements of `T`.
    pub fn get<T: Pod>(&self, name: &str) -> Result<MappedBuffer<T>> {
        let i = self.position(name).ok_or_else(|| {
            Error::arg(
                "set entry",
                format!("{:?} has no buffer called {name:?}", self.record().name),
            )
        })?;
        self.view(i)
    }

    /// A view of buffer `index` as elements of `T` (its stream waits on the
    /// set's event or fence, as every view on this device shares the stream).
    pub fn view<T: Pod>(&self, index: usize) -> Result<MappedBuffer<T>> {
        let e = self.record().entries.get(index).ok_or_else(|| {
            Error::arg(
                "set entry",
                format!("index {index} is past the set's {} buffers", self.len()),
            )
        })?;
        let size = std::mem::size_of::<T>() as u64;
        if size != e.dtype.size() && size != 1 {
            return Err(Error::arg(
                "set entry",
                format!(
                    "{:?} holds {} ({}-byte elements), not {}-byte {}",
                    e.name,
                    e.dtype,
                    e.dtype.size(),
                    size,
                    std::any::type_name::<T>()
                ),
            ));
        }
        let (mapping, base) = self.place(e.chunk)?;
        Ok(
            MappedBuffer::<T>::from_bytes(mapping, base + e.offset, e.len)?
                .hold(self.guard.clone()),
        )
    }

    /// Where every buffer is in this process, in the producer's order,
    /// worked out without making a view of each (what a bulk attach from
    /// Python reads): each is checked to lie inside its chunk's mapping,
    /// as a view is, and each chunk's mapping counts the device stream as
    /// a user, as a view's does.
    pub fn entry_places(&self) -> Result<Vec<EntryPlace>> {
        // chunk id -> (mapping base, mapping size, where the chunk starts in it)
        let mut chunks: HashMap<u64, (u64, u64, u64), foldhash::fast::RandomState> =
            HashMap::with_capacity_and_hasher(
                self.mappings.len(),
                foldhash::fast::RandomState::default(),
            );
        for c in &self.record().chunks {
            if let Some(m) = self.mappings.get(&c.id) {
                m.used_streams().record(m.device().stream());
                chunks.insert(c.id, (m.base(), m.size(), c.descriptor.offset));
            }
        }
        // Entries mostly follow each other in a chunk: it is looked up
        // only when it changes.
        let mut last: Option<(u64, (u64, u64, u64))> = None;
        self.index
            .record()
            .entries
            .iter()
            .map(|e| {
                let (base, size, start) = match last {
                    Some((id, place)) if id == e.chunk => place,
                    _ => {
                        let place = *chunks.get(&e.chunk).ok_or_else(|| not_in_table(e.chunk))?;
                        last = Some((e.chunk, place));
                        place
                    }
                };
                let offset = start.checked_add(e.offset).ok_or_else(|| {
                    Error::arg("set entry", format!("{:?}: its offset overflows", e.name))
                })?;
                Error::check_range(offset, e.len, size)?;
                Ok(EntryPlace {
                    mapping_base: base,
                    mapping_size: size,
                    address: base + offset,
                })
            })
            .collect()
    }

    fn place(&self, chunk: u64) -> Result<(Arc<dyn Mapping>, u64)> {
        let mapping = self.mappings.get(&chunk).cloned();
        let base = self
            .index
            .record()
            .chunk(chunk)
            .map(|c| c.descriptor.offset);
        match (mapping, base) {
            (Some(m), Some(b)) => Ok((m, b)),
            _ => Err(not_in_table(chunk)),
        }
    }
}

/// The error for an entry whose chunk the set has not mapped.
fn not_in_table(chunk: u64) -> Error {
    Error::arg(
        "set entry",
        format!("chunk {chunk} is not in the set's table"),
    )
}
