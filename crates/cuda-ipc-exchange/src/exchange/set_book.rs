//! What a publisher keeps about its sets: how it shares memory, the book
//! of sets published and retired, the arena behind them, and the names of
//! their hidden entries.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, OnceLock};

use serde_json::{Value, json};

use crate::arena::{
    Arena, ArenaLease, Chunk, ChunkBacking, ChunkId, ChunkPin, DeviceArena, DeviceChunk,
    DeviceChunks,
};
use crate::channel::wire::Meta;
use crate::channel::{ChannelError, Server};
use crate::error::{Error, Result};
use crate::set::{SET_VERSION_KEY, SetLayout, SetRecord, TableRef};

use super::set_order::{ChunkStream, SetHold, SetOrder};
use super::set_text::{SET_PART_BYTES, meta_with_text, publish_pieces, unpublish_all};
use super::sharing::Sharing;
use super::sync::{self, FenceSlot, SetFence};
use super::wire::{self, EntryMeta};

/// The most parts a set record travels in (96 MiB of JSON, far more than
/// the most entries a record holds take).
pub(super) const MAX_PARTS: usize = 1024;

/// The key of a set entry's metadata that lists the parts of its record.
pub(super) const PARTS_KEY: &str = "cuda_ipc_set_parts";

/// Entry tables of at least this many bytes (about 300 entries) travel by
/// reference (set format 3): published once per layout as hidden entries,
/// which a subscriber that kept the table does not read again.
pub const TABLE_REF_MIN_BYTES: usize = 16 * 1024;

/// Tables no published or leased set names that the book keeps published
/// (the most recently used), for the next set of their layout.
pub(super) const IDLE_TABLES: usize = 2;

/// A set's record as its publisher hands it to the book: the JSON value
/// and its compact JSON text (a publisher writes it, the base64 table
/// copied in whole), which is not encoded again.
pub(super) struct RecordJson {
    pub(super) value: Value,
    pub(super) text: String,
}

impl From<Value> for RecordJson {
    /// The record `value`, encoded here.
    fn from(value: Value) -> Self {
        let text = value.to_string();
        RecordJson { value, text }
    }
}

/// The prefix of the hidden entries a publisher makes for its arena.
pub const HIDDEN_ENTRY_PREFIX: &str = ".cuda-ipc/";

/// The hidden entry that carries a chunk's descriptor and descriptors.
pub fn chunk_entry_name(id: ChunkId) -> String {
    format!("{HIDDEN_ENTRY_PREFIX}chunk/{}/{}", id.arena, id.index)
}

/// Whether an entry's metadata is a set record (or the parts of one).
pub(super) fn is_set_meta(meta: &Value) -> bool {
    meta.get(SET_VERSION_KEY).is_some() || meta.get(PARTS_KEY).is_some()
}

/// A chunk that can be published as a hidden entry: its metadata and
/// copies of its file descriptors (no new export).
pub(super) trait ChunkEntry {
    fn entry(&self) -> Result<(Value, Vec<OwnedFd>)>;
}

impl ChunkEntry for DeviceChunk {
    fn entry(&self) -> Result<(Value, Vec<OwnedFd>)> {
        let fds = self
            .fds()
            .iter()
            .map(|fd| {
                fd.try_clone()
                    .map_err(|e| Error::arg("chunk descriptor", format!("cannot dup: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((wire::to_value(&EntryMeta::new(self.descriptor()))?, fds))
    }
}

struct Published<B: ChunkBacking>
where
    B::Chunk: ChunkStream,
{
    leases: Vec<ArenaLease<B>>,
    /// What an update records the set's event after, worked out at publish.
    order: Arc<SetOrder<B>>,
    parts: Vec<String>,
    /// The layout whose published table its record names, if it does.
    table: Option<u64>,
    /// The set's fence slot, if it has one.
    fence: Option<FenceSlot>,
}

/// An entry table published as hidden entries, by the id of its layout.
struct PublishedTable {
    layout: u64,
    table: TableRef,
    /// The book's clock when a record last named it.
    used: u64,
}

/// What stays alive after an entry is unpublished, until its last lease ends.
struct Retired<B: ChunkBacking> {
    names: Vec<String>,
    /// The entry by id, when its name lives on in a newer entry (a set
    /// replaced by [`Book::replace`]).
    entry: Option<u64>,
    /// The layout whose published table the record named, if it did.
    table: Option<u64>,
    _leases: Vec<ArenaLease<B>>,
    _pin: Option<ChunkPin<B>>,
    _fence: Option<FenceSlot>,
}

/// The publisher's bookkeeping of arena entries: which chunks are published
/// as hidden entries, which sets hold which leases, what waits for its last
/// consumer. Generic over the backing so that it runs without a GPU.
pub(super) struct Book<B: ChunkBacking>
where
    B::Chunk: ChunkStream,
{
    sets: HashMap<String, Published<B>>,
    chunks: HashMap<u64, ChunkPin<B>>,
    retired: Vec<Retired<B>>,
    parts: u64,
    tables: Vec<PublishedTable>,
    clock: u64,
}

impl<B: ChunkBacking> Default for Book<B>
where
    B::Chunk: ChunkStream,
{
    fn default() -> Self {
        Book {
            sets: HashMap::new(),
            chunks: HashMap::new(),
            retired: Vec::new(),
            parts: 0,
            tables: Vec::new(),
            clock: 0,
        }
    }
}

impl<B: ChunkBacking> Book<B>
where
    B::Chunk: ChunkEntry + ChunkStream,
{
    /// Publishes `chunk` as a hidden entry unless it is already.
    fn ensure_chunk(&mut self, server: &Server, arena: &Arena<B>, chunk: &Chunk<B>) -> Result<()> {
        let id = chunk.id();
        if self.chunks.contains_key(&id.index) {
            return Ok(());
        }
        let pin = arena.pin(id)?;
        let (meta, fds) = chunk.backing().entry()?;
        server.publish(&chunk_entry_name(id), meta, fds)?;
        self.chunks.insert(id.index, pin);
        Ok(())
    }

    /// Publishes a set record under `name`, holding `hold` (the members'
    /// leases, and the set's order that its updates use) and the fence's
    /// slot while it is published and leased. The fence, if any,
    /// travels beside the record: its metadata under
    /// [`SET_FENCE_KEY`](sync::SET_FENCE_KEY), its file descriptor as the
    /// entry's only one.
    #[cfg(test)]
    pub(super) fn publish(
        &mut self,
        server: &Server,
        arena: &Arena<B>,
        name: &str,
        record: impl Into<RecordJson>,
        hold: SetHold<B>,
        fence: Option<SetFence>,
    ) -> Result<()> {
        self.publish_naming(server, arena, name, (record.into(), None), hold, fence)
    }

    /// [`publish`](Self::publish) of `record`, whose entries are
    /// `layout`'s: its table goes in the record, or, from
    /// [`TABLE_REF_MIN_BYTES`], by reference to hidden entries published
    /// once for the layout ([`record_for`](Self::record_for)).
    #[allow(clippy::too_many_arguments)] // publish's, and the layout
    pub(super) fn publish_layout(
        &mut self,
        server: &Server,
        arena: &Arena<B>,
        name: &str,
        record: &SetRecord,
        layout: &SetLayout,
        hold: SetHold<B>,
        fence: Option<SetFence>,
    ) -> Result<()> {
        if self.sets.contains_key(name) {
            return Err(ChannelError::AlreadyExists { name: name.into() }.into());
        }
        let json = self.record_for(server, arena, record, layout)?;
        self.publish_naming(server, arena, name, json, hold, fence)
    }

    /// `record`'s JSON: with `layout`'s table in it, or naming the hidden
    /// entries that hold the table (published here unless they are), with
    /// the layout's id.
    fn record_for(
        &mut self,
        server: &Server,
        arena: &Arena<B>,
        record: &SetRecord,
        layout: &SetLayout,
    ) -> Result<(RecordJson, Option<u64>)> {
        let text = layout.table();
        if text.len() < TABLE_REF_MIN_BYTES {
            return Ok((record_json(record, layout), None));
        }
        self.clock += 1;
        let clock = self.clock;
        let table = if let Some(t) = self.tables.iter_mut().find(|t| t.layout == layout.id()) {
            t.used = clock;
            t.table.clone()
        } else {
            let prefix = format!(
                "{HIDDEN_ENTRY_PREFIX}set-table/{}/{}",
                arena.id(),
                layout.id()
            );
            let parts = publish_pieces(server, &prefix, text)?;
            let table = TableRef {
                parts,
                bytes: text.len() as u64,
            };
            self.tables.push(PublishedTable {
                layout: layout.id(),
                table: table.clone(),
                used: clock,
            });
            table
        };
        let value = record.to_value_with_ref(&table);
        Ok((RecordJson::from(value), Some(layout.id())))
    }

    fn publish_naming(
        &mut self,
        server: &Server,
        arena: &Arena<B>,
        name: &str,
        (record, table): (RecordJson, Option<u64>),
        hold: SetHold<B>,
        fence: Option<SetFence>,
    ) -> Result<()> {
        self.reap(server);
        if self.sets.contains_key(name) {
            return Err(ChannelError::AlreadyExists { name: name.into() }.into());
        }
        let SetHold { leases, order } = hold;
        for c in order.chunks() {
            self.ensure_chunk(server, arena, c)?;
        }
        let (meta, parts) =
            self.publish_parts(server, arena, record, fence.as_ref().map(|f| &f.meta))?;
        let (fds, fence) = match fence {
            Some(f) => (vec![f.fd], Some(f.slot)),
            None => (Vec::new(), None),
        };
        if let Err(e) = server.publish(name, meta, fds) {
            for p in &parts {
                let _ = server.unpublish(p);
            }
            return Err(e.into());
        }
        self.sets.insert(
            name.to_owned(),
            Published {
                leases,
                order,
                parts,
                table,
                fence,
            },
        );
        Ok(())
    }

    /// The metadata of a set entry for `record` and its `fence`: the record
    /// with the fence, its text made once here (the server sends that text
    /// as it is), or, when the text is longer than [`SET_PART_BYTES`], the
    /// list of the record's parts, published here as hidden entries
    /// (returned too), with the fence. The record's text is used as it
    /// is: no part of the record is encoded again.
    fn publish_parts(
        &mut self,
        server: &Server,
        arena: &Arena<B>,
        record: RecordJson,
        fence: Option<&wire::FenceMeta>,
    ) -> Result<(Meta, Vec<String>)> {
        let RecordJson { mut value, text } = record;
        let fence = fence.map(wire::to_value).transpose()?;
        let fence_text = fence.as_ref().map(Value::to_string);
        let whole = text.len()
            + fence_text
                .as_ref()
                .map_or(0, |f| f.len() + sync::SET_FENCE_KEY.len() + 4);
        if whole > SET_PART_BYTES {
            // The record alone goes in the parts; the fence stays on the entry.
            return self.publish_text_parts(server, arena, &text, fence);
        }
        let Some((fence, fence_text)) = fence.zip(fence_text) else {
            return Ok((meta_with_text(value, text)?, Vec::new()));
        };
        // The fence goes in as the object's last member, in the text too.
        sync::put_set_fence(&mut value, fence)?;
        let mut with = text;
        if with.pop() != Some('}') {
            return Err(Error::arg("set entry", "its record is not a JSON object"));
        }
        if with.len() > 1 {
            with.push(',');
        }
        for piece in ["\"", sync::SET_FENCE_KEY, "\":", &fence_text, "}"] {
            with.push_str(piece);
        }
        Ok((meta_with_text(value, with)?, Vec::new()))
    }

    /// Publishes `text`, a set record's, as hidden part entries of at most
    /// [`SET_PART_BYTES`] each (their metadata's text written here, not
    /// encoded), and returns the set entry's metadata, which lists them,
    /// with `fence`, and the parts' names.
    fn publish_text_parts(
        &mut self,
        server: &Server,
        arena: &Arena<B>,
        text: &str,
        fence: Option<Value>,
    ) -> Result<(Meta, Vec<String>)> {
        self.parts += 1;
        let prefix = format!(
            "{HIDDEN_ENTRY_PREFIX}set-part/{}/{}",
            arena.id(),
            self.parts
        );
        let parts = publish_pieces(server, &prefix, text)?;
        let mut meta = json!({ PARTS_KEY: parts, "bytes": text.len() });
        if let Some(f) = fence
            && let Err(e) = sync::put_set_fence(&mut meta, f)
        {
            unpublish_all(server, &parts);
            return Err(e);
        }
        Ok((Meta::new(meta), parts))
    }

    /// Publishes a set record under `name` in place of the set published
    /// there (see [`Server::replace`]): its holders get `notice` as an
    /// update and keep it until they release it, then its leases go; new
    /// attaches get the new record.
    #[cfg(test)]
    #[allow(clippy::too_many_arguments)] // publish's arguments and the notice
    pub(super) fn replace(
        &mut self,
        server: &Server,
        arena: &Arena<B>,
        name: &str,
        record: impl Into<RecordJson>,
        hold: SetHold<B>,
        fence: Option<SetFence>,
        notice: Value,
    ) -> Result<crate::channel::Replaced> {
        self.replace_naming(
            server,
            arena,
            name,
            (record.into(), None),
            hold,
            fence,
            notice,
        )
    }

    /// [`replace`](Self::replace) of `record`, whose entries are
    /// `layout`'s (its table by reference, as
    /// [`publish_layout`](Self::publish_layout) puts it).
    #[allow(clippy::too_many_arguments)] // replace's, and the layout
    pub(super) fn replace_layout(
        &mut self,
        server: &Server,
        arena: &Arena<B>,
        name: &str,
        (record, layout): (&SetRecord, &SetLayout),
        hold: SetHold<B>,
        fence: Option<SetFence>,
        notice: Value,
    ) -> Result<crate::channel::Replaced> {
        if !self.sets.contains_key(name) {
            return Err(ChannelError::NotFound { name: name.into() }.into());
        }
        let json = self.record_for(server, arena, record, layout)?;
        self.replace_naming(server, arena, name, json, hold, fence, notice)
    }

    #[allow(clippy::too_many_arguments)] // replace's
    fn replace_naming(
        &mut self,
        server: &Server,
        arena: &Arena<B>,
        name: &str,
        (record, table): (RecordJson, Option<u64>),
        hold: SetHold<B>,
        fence: Option<SetFence>,
        notice: Value,
    ) -> Result<crate::channel::Replaced> {
        self.reap(server);
        let Some(old) = self.sets.remove(name) else {
            return Err(ChannelError::NotFound { name: name.into() }.into());
        };
        let SetHold { leases, order } = hold;
        let (fds, slot, fence_meta) = match fence {
            Some(f) => (vec![f.fd], Some(f.slot), Some(f.meta)),
            None => (Vec::new(), None, None),
        };
        let mut parts = Vec::new();
        let replaced = order
            .chunks()
            .iter()
            .try_for_each(|c| self.ensure_chunk(server, arena, c))
            .and_then(|()| {
                let (meta, p) = self.publish_parts(server, arena, record, fence_meta.as_ref())?;
                parts = p;
                Ok(server.replace(name, meta, fds, notice)?)
            });
        let replaced = match replaced {
            Ok(r) => r,
            Err(e) => {
                for p in &parts {
                    let _ = server.unpublish(p);
                }
                self.sets.insert(name.to_owned(), old);
                return Err(e);
            }
        };
        for p in &old.parts {
            let _ = server.unpublish(p);
        }
        self.retired.push(Retired {
            names: old.parts,
            entry: Some(replaced.old_entry),
            table: old.table,
            _leases: old.leases,
            _pin: None,
            _fence: old.fence,
        });
        self.sets.insert(
            name.to_owned(),
            Published {
                leases,
                order,
                parts,
                table,
                fence: slot,
            },
        );
        self.reap(server);
        Ok(replaced)
    }

    /// What an update of the published set `name` needs: its order (what
    /// its event is recorded after) and its fence slot, if it has one. One
    /// lookup and one reference count, whatever the set's size.
    pub(super) fn update_of(&self, name: &str) -> Option<(Arc<SetOrder<B>>, Option<u32>)> {
        self.sets
            .get(name)
            .map(|s| (Arc::clone(&s.order), s.fence.as_ref().map(FenceSlot::slot)))
    }

    /// Whether `name` is a set (or arena buffer) of this book.
    pub(super) fn contains(&self, name: &str) -> bool {
        self.sets.contains_key(name)
    }

    /// Unpublishes a set: no new attaches; its leases stay until its last
    /// consumer's lease ends.
    pub(super) fn unpublish(&mut self, server: &Server, name: &str) -> Result<()> {
        let set = self
            .sets
            .remove(name)
            .ok_or_else(|| Error::from(ChannelError::NotFound { name: name.into() }))?;
        let mut names = vec![name.to_owned()];
        let r = server.unpublish(name);
        for p in set.parts {
            let _ = server.unpublish(&p);
            names.push(p);
        }
        self.retired.push(Retired {
            names,
            entry: None,
            table: set.table,
            _leases: set.leases,
            _pin: None,
            _fence: set.fence,
        });
        self.reap(server);
        Ok(r?)
    }

    /// Drops what waited for consumers whose leases have all ended; returns
    /// how many retired entries were let go.
    pub(super) fn reap(&mut self, server: &Server) -> usize {
        let before = self.retired.len();
        self.retired.retain(|r| {
            r.entry.is_some_and(|id| server.entry_lease_count(id) > 0)
                || r.names.iter().any(|n| server.lease_count(n) > 0)
        });
        let reaped = before - self.retired.len();
        self.retire_tables(server);
        reaped
    }

    /// Unpublishes the tables that no published or retired set names,
    /// but the [`IDLE_TABLES`] used last (their parts wait as retired
    /// entries for the leases of readers reading them).
    fn retire_tables(&mut self, server: &Server) {
        let named: Vec<u64> = self
            .sets
            .values()
            .filter_map(|s| s.table)
            .chain(self.retired.iter().filter_map(|r| r.table))
            .collect();
        let mut idle: Vec<(u64, u64)> = self
            .tables
            .iter()
            .filter(|t| !named.contains(&t.layout))
            .map(|t| (t.used, t.layout))
            .collect();
        if idle.len() <= IDLE_TABLES {
            return;
        }
        idle.sort_unstable_by(|a, b| b.cmp(a));
        for (_, layout) in idle.into_iter().skip(IDLE_TABLES) {
            let Some(at) = self.tables.iter().position(|t| t.layout == layout) else {
                continue;
            };
            let t = self.tables.swap_remove(at);
            unpublish_all(server, &t.table.parts);
            self.retired.push(Retired {
                names: t.table.parts,
                entry: None,
                table: None,
                _leases: Vec::new(),
                _pin: None,
                _fence: None,
            });
        }
    }

    /// Tables published as hidden entries, named or idle.
    #[cfg(test)]
    pub(super) fn tables(&self) -> usize {
        self.tables.len()
    }

    /// Unpublishes the hidden entries of chunks that hold no buffer, then
    /// trims the arena: a chunk goes when no consumer maps it any more.
    pub(super) fn trim(&mut self, server: &Server, arena: &Arena<B>) -> u64 {
        let idle: Vec<u64> = arena
            .chunks()
            .into_iter()
            .filter(|c| c.buffers == 0)
            .map(|c| c.id.index)
            .collect();
        for index in idle {
            if let Some(pin) = self.chunks.remove(&index) {
                let name = chunk_entry_name(pin.chunk().id());
                let _ = server.unpublish(&name);
                self.retired.push(Retired {
                    names: vec![name],
                    entry: None,
                    table: None,
                    _leases: Vec::new(),
                    _pin: Some(pin),
                    _fence: None,
                });
            }
        }
        self.reap(server);
        arena.trim()
    }

    /// Entries waiting for their last consumer.
    pub(super) fn retired(&self) -> usize {
        self.retired.len()
    }
}

/// `record`'s JSON value and text, with `layout`'s table (made once for
/// the layout) copied into both (what a record whose table is short
/// carries, see [`Book::record_for`]).
fn record_json(record: &SetRecord, layout: &SetLayout) -> RecordJson {
    let (value, text) = record.to_value_and_json_with_table(layout.table());
    RecordJson { value, text }
}

/// The arena side of a [`Publisher`](super::Publisher): its arena (made at the first use) and
/// the bookkeeping of what it published from it.
pub(super) struct PublisherArena {
    pub(super) sharing: Sharing,
    pub(super) arena: OnceLock<DeviceArena>,
    pub(super) book: std::sync::Mutex<Book<DeviceChunks>>,
    /// The layouts of the sets described last (a set published again in
    /// the same places is checked and encoded once).
    pub(super) layouts: crate::set::SetLayouts,
}

impl PublisherArena {
    pub(super) fn new(sharing: Sharing) -> Self {
        PublisherArena {
            sharing,
            arena: OnceLock::new(),
            book: std::sync::Mutex::new(Book::default()),
            layouts: crate::set::SetLayouts::new(),
        }
    }
}

#[cfg(test)]
#[path = "set_tests.rs"]
pub(super) mod tests;

#[cfg(test)]
#[path = "set_order_tests.rs"]
mod order_tests;

#[cfg(test)]
#[path = "set_replace_tests.rs"]
mod replace_tests;

#[cfg(test)]
#[path = "set_table_tests.rs"]
mod table_tests;
