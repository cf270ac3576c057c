//! The subscriber's side of weight sets: reading a set's record, the
//! chunk mappings it keeps, and attaching.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytemuck::Pod;
use serde_json::Value;

use crate::Access;
use crate::arena::ChunkId;
use crate::channel::{self, ChannelError, Notice};
use crate::error::{Error, Result};
use crate::memory::buffer::Mapping;
use crate::phases::Phases;
use crate::set::{EntryTables, NameIndex, SetRecord, TableRef};
use crate::share;

use super::attach::no_waiter;
use super::lease::{LeaseGuard, LeaseId, release_on};
use super::link::Connection;
use super::lock;
use super::set_attachment::SetAttachment;
use super::subscriber::{Attachment, Subscriber, awake};
use super::sync::{self};
use super::wire::EntryMeta;

use super::chunk_cache::CachedChunk;
use super::set_book::{MAX_PARTS, PARTS_KEY, chunk_entry_name, is_set_meta};
use super::set_text::SET_PART_BYTES;

/// Reads a set entry's record (from its parts when it came in parts), and
/// the entry table it names (set format 3) unless `tables` kept it.
pub(super) fn read_record(
    client: &channel::Client,
    meta: &Value,
    tables: Option<&EntryTables>,
) -> Result<SetRecord> {
    let mut fetch = |table: &TableRef| {
        read_texts(
            client,
            &table.parts,
            crate::set::MAX_SET_RECORD_BYTES,
            "entries.parts",
        )
    };
    let Some(parts) = meta.get(PARTS_KEY) else {
        return SetRecord::from_value_fetching(meta, tables, Some(&mut fetch));
    };
    let parts = parts.as_array().ok_or_else(|| Error::Descriptor {
        field: PARTS_KEY.into(),
        reason: "expected an array of entry names".into(),
    })?;
    if parts.len() > MAX_PARTS {
        return Err(Error::Descriptor {
            field: PARTS_KEY.into(),
            reason: format!(
                "{} parts is more than the {MAX_PARTS} a set record takes",
                parts.len()
            ),
        });
    }
    let names = parts
        .iter()
        .map(|p| {
            p.as_str()
                .map(str::to_owned)
                .ok_or_else(|| Error::Descriptor {
                    field: PARTS_KEY.into(),
                    reason: format!("expected an entry name, found {p}"),
                })
        })
        .collect::<Result<Vec<String>>>()?;
    let text = read_texts(client, &names, MAX_PARTS * SET_PART_BYTES, PARTS_KEY)?;
    SetRecord::from_json_fetching(&text, tables, Some(&mut fetch))
}

/// The texts of the metadata-only entries `names` (`{"text": ...}` each),
/// joined: asked for a batch at a time (one round trip for the batch),
/// each lease released as its answer comes; at most `max` bytes, checked
/// after each batch (`field` names the list in errors).
fn read_texts(
    client: &channel::Client,
    names: &[String],
    max: usize,
    field: &str,
) -> Result<String> {
    let mut text = String::new();
    for batch in names.chunks(channel::Client::METADATA_IN_FLIGHT) {
        let batch: Vec<&str> = batch.iter().map(String::as_str).collect();
        for (name, meta) in batch.iter().zip(client.metadata_of(&batch)?) {
            let piece =
                meta.get("text")
                    .and_then(Value::as_str)
                    .ok_or_else(|| Error::Descriptor {
                        field: format!("{name}.text"),
                        reason: "a part of a set record or table carries its text".into(),
                    })?;
            text.push_str(piece);
        }
        if text.len() > max {
            return Err(Error::Descriptor {
                field: field.into(),
                reason: format!("the parts pass the {max} bytes they may hold"),
            });
        }
    }
    Ok(text)
}

/// How a set's chunks are mapped: `asked` (the subscriber's wish), made
/// read-only when the publisher's record asks for read-only readers.
pub(super) fn set_access(record: &SetRecord, asked: Access) -> Access {
    asked.and(Access::read_only_if(record.read_only))
}

impl Subscriber {
    /// The mapping of chunk `id` of a set with `access`: from the cache, or
    /// mapped now from the chunk's hidden entry (the only time its file
    /// descriptors travel to this subscriber for that access).
    fn chunk_mapping(
        &self,
        conn: &Connection,
        record: &SetRecord,
        index: u64,
        access: Access,
    ) -> Result<Arc<dyn Mapping>> {
        let id = ChunkId {
            arena: record.arena,
            index,
        };
        if let Some(c) = lock(&self.chunks).get(&(id, access)) {
            return awake(c.mapping.clone());
        }
        let want = record.chunk(index).ok_or_else(|| {
            Error::arg("set record", format!("chunk {index} is not in its table"))
        })?;
        let a = conn.client.attach(&chunk_entry_name(id))?;
        let opened = EntryMeta::decode(&a.meta).and_then(|d| {
            if d.source != want.descriptor.source || d.byte_len != want.descriptor.byte_len {
                return Err(Error::Descriptor {
                    field: "chunks".into(),
                    reason: format!(
                        "the publisher's chunk {id} is not the memory the set record names"
                    ),
                });
            }
            let len = d.alloc_size;
            Ok((share::open_mapping(&self.device, &d, a.fds, access)?, len))
        });
        let (mapping, len) = match opened {
            Ok(m) => m,
            Err(e) => {
                let _ = conn.client.release(a.lease);
                return Err(e);
            }
        };
        self.opened(&mapping);
        let evicted = lock(&self.chunks).insert(
            (id, access),
            CachedChunk {
                mapping: mapping.clone(),
                lease: LeaseId {
                    id: a.lease,
                    epoch: conn.epoch,
                },
            },
            len,
        );
        self.drop_chunks(evicted);
        Ok(mapping)
    }

    /// Unmaps evicted chunks and releases their leases, outside the cache's
    /// lock (an explicit call: it waits for the streams that used them).
    pub(super) fn drop_chunks(&self, evicted: Vec<CachedChunk>) {
        for c in evicted {
            let _ = c.mapping.used_streams().synchronize_all();
            // Waited for: unmapped now, before the lease goes.
            crate::reaper::work_done(|| drop(c.mapping));
            if self.link.is_alive()
                && let Err(e) = release_on(&self.link, &self.pending, c.lease, true)
            {
                tracing::debug!(lease = c.lease.id, error = %e, "releasing a chunk lease failed");
            }
        }
    }

    /// Opens an attached set entry: its record, every chunk (mapped once,
    /// with `asked` or read-only where the record says so), the lease
    /// guard, the event or fence waited on (per the subscriber's
    /// [`SyncMode`](super::SyncMode)).
    pub(super) fn open_set(
        &self,
        conn: &Connection,
        a: channel::Attachment,
        asked: Access,
        phases: &mut Phases,
    ) -> Result<SetAttachment> {
        let channel::Attachment {
            lease,
            name,
            mut meta,
            mut fds,
            ..
        } = a;
        let opened = (|| {
            let fence = sync::take_set_fence(&mut meta)?;
            let record = read_record(&conn.client, &meta, Some(&self.tables))?;
            phases.mark("record");
            let access = set_access(&record, asked);
            let waiter = self.waiter(record.event, fence, &mut fds, "a published set")?;
            phases.mark("waiter");
            let mut mappings = HashMap::with_capacity(record.chunks.len());
            for c in &record.chunks {
                mappings.insert(c.id, self.chunk_mapping(conn, &record, c.id, access)?);
            }
            phases.mark("mappings");
            self.wait_latest(&conn.client, &waiter, self.device.stream())?;
            phases.mark("wait");
            Ok((record, access, waiter, mappings))
        })();
        let (record, access, waiter, mappings) = match opened {
            Ok(o) => o,
            Err(e) => {
                let _ = conn.client.release(lease);
                return Err(e);
            }
        };
        let record = Arc::new(record);
        let guard = LeaseGuard::with(
            &self.link,
            &self.pending,
            LeaseId {
                id: lease,
                epoch: conn.epoch,
            },
            name,
            mappings.values().cloned().collect(),
            Some(waiter),
            Some(Arc::clone(&record)),
        );
        self.hold_for_reconnects(&guard, conn.epoch);
        Ok(SetAttachment {
            index: NameIndex::new(record),
            access,
            guard,
            mappings,
        })
    }

    /// The work of [`Subscriber::attach_set_with`].
    #[tracing::instrument(level = "debug", skip(self))]
    pub(super) fn do_attach_set_with(
        &self,
        conn: &Connection,
        name: &str,
        access: Access,
    ) -> Result<SetAttachment> {
        let mut phases = Phases::start("core.attach_set");
        let a = conn.client.attach(name)?;
        phases.mark("request");
        if !is_set_meta(&a.meta) {
            let _ = conn.client.release(a.lease);
            return Err(Error::arg(
                "set",
                format!(
                    "{name:?} is a single buffer, not a set; attach it with Subscriber::attach"
                ),
            ));
        }
        self.open_set(conn, a, access, &mut phases)
    }

    /// Opens an arena buffer published with [`Publisher::publish_buffer`]
    /// (a set of one) as an [`Attachment`].
    pub(super) fn attach_arena_buffer<T: Pod>(
        &self,
        conn: &Connection,
        a: channel::Attachment,
        phases: &mut Phases,
    ) -> Result<Attachment<T>> {
        let set = self.open_set(conn, a, self.access, phases)?;
        if set.len() != 1 {
            return Err(Error::arg(
                "attach",
                format!(
                    "{:?} is a set of {} buffers; attach it with Subscriber::attach_set",
                    set.name(),
                    set.len()
                ),
            ));
        }
        let descriptor = set.record().entry_descriptor(0)?;
        let buffer = set.view::<T>(0)?;
        phases.mark("view");
        Ok(Attachment::from_parts(
            set.record().name.clone(),
            set.guard.clone(),
            buffer,
            descriptor,
        ))
    }

    /// The work of [`Subscriber::wait_set_update`].
    pub(super) fn do_wait_set_update(&self, set: &SetAttachment, timeout: Duration) -> Result<u64> {
        let deadline = crate::channel::deadline_in(timeout);
        let Some((conn, notice)) = self.next_notice_on(&set.guard, set.name(), deadline)? else {
            return Ok(set.guard.replaced_version());
        };
        match notice {
            Notice::Updated { version, data } => {
                let waiter = set.guard.waiter().ok_or_else(no_waiter)?;
                self.wait_notice(&conn.client, &waiter, self.device.stream(), &data)?;
                Ok(set.guard.updated(version))
            }
            Notice::Unpublished => Err(ChannelError::Unpublished {
                name: set.record().name.clone(),
                lease: set.lease(),
            }
            .into()),
            other => Err(ChannelError::Protocol {
                reason: format!("a notice this version does not know: {other:?}"),
            }
            .into()),
        }
    }

    /// The work of [`Subscriber::release_set`].
    pub(super) fn do_release_set(&self, set: SetAttachment) -> Result<()> {
        self.before_release();
        let SetAttachment {
            guard, mappings, ..
        } = set;
        drop(mappings);
        guard.check_no_views(1)?;
        let r = guard.end();
        drop(guard);
        let evicted = lock(&self.chunks).evict();
        self.drop_chunks(evicted);
        r
    }
}
