//! The set record: a versioned, language-neutral JSON record of a named set
//! of many buffers (a model's weights) that live in the chunks of one
//! [arena](crate::arena).
//!
//! A set record holds a **chunk table**, the [`Descriptor`] of every chunk
//! the set uses, once, so that a consumer maps each chunk once, and one
//! **entry** per buffer: its name, element type, shape, the chunk it lives
//! in (by the chunk's id in its arena) and its byte offset and byte length
//! in that chunk. Offsets count from the first byte the chunk's descriptor
//! names (`descriptor.offset` into the allocation), so an entry's bytes are
//! `descriptor.offset + offset .. + len` of the allocation.
//!
//! Format 2, which this build writes, carries the entries as one compact
//! binary table in base64 text (see [`table`] for its layout): a set of
//! 1,000 tensors is about a third of format 1's JSON and decodes in one
//! pass instead of a tree of 10,000 JSON values.
//!
//! ```json
//! {"cuda_ipc_set":2,"name":"weights","arena":1311768467294899695,
//!  "chunks":[{"id":0,"descriptor":{"cuda_ipc":1,"mechanism":"vmm","fd":7, ...}}],
//!  "entries":"AgxsYXllcjAud2VpZ2h0A2YzMgKACIAIAAAAgICAAg..."}
//! ```
//!
//! Format 1, which this build still reads (and writes with
//! [`SetRecord::to_expanded_value`], for people and tests), has the same
//! fields with the entries as JSON arrays, `[name, dtype, shape, chunk,
//! offset, len]`:
//!
//! ```json
//! {"cuda_ipc_set":1, ..., "entries":[["layer0.weight","f32",[1024,1024],0,0,4194304],
//!                                    ["layer0.bias","f32",[1024],0,4194304,4096]]}
//! ```
//!
//! Entries carry their element type by name ([`Dtype`]: `f32`, `bf16`,
//! `f8e4m3fn`, `f4e2m1fnx2`, `c64`, ...) in both formats. A record of
//! the fp8, fp4 or complex types is refused by builds older than them
//! (their decoder names the entry's `dtype` field); records written by
//! older builds read unchanged.
//!
//! The optional `event` is one interprocess event for the whole set,
//! recorded after the producer's writes; chunk descriptors carry none of
//! their own.
//!
//! The optional `read_only` (a boolean, `false` when absent) is the
//! publisher's policy that readers map the set's chunks read-only
//! ([`Access::ReadOnly`](cuda_ipc_core::Access)); a subscriber then maps them so
//! whatever it asked for. It is written only when true, so records of
//! publishers that do not ask for it read unchanged by older builds, and an
//! older build refuses a record that asks for it (an unknown field) rather
//! than map it read-write.
//!
//! Decoding is strict: unknown fields and versions, wrong types, duplicate
//! chunks or names, entries that overlap, pass the end of their chunk, are
//! misaligned for their element type or whose length disagrees with their
//! shape, chunks of different devices, processes or mechanisms, chunks no
//! entry uses, and `read_only` on chunks whose mechanism cannot be mapped
//! read-only (legacy, pool) are all errors ([`Error::Descriptor`]) that name
//! the field (`entries[17].offset`).
//!
//! A consumer that maps a chunk can read every buffer in it, whether the
//! set names it or not: see the security note of [`arena`](crate::arena).

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{Map, Value};

use crate::descriptor::{Descriptor, Dtype};
use crate::error::{Error, Result};
use crate::handle::IpcEventHandle;
use crate::json::{Fields, kind_of};

/// The identity of an arena, unique across processes in practice (random
/// per arena), for consumers' mapping caches.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ArenaId(pub u64);

impl ArenaId {
    /// A new identity: random, never zero, distinct from every other made by
    /// this process.
    pub(crate) fn new() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        // The standard library seeds every `RandomState` from the operating
        // system's random source; the counter keeps ids of this process apart.
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let id = RandomState::new().hash_one((std::process::id(), n));
        ArenaId(id.max(1))
    }
}

impl fmt::Display for ArenaId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl fmt::Debug for ArenaId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ArenaId({self})")
    }
}

mod decode;
mod entries;
use entries::decode_entries;
mod layouts;
pub mod names;
pub mod table;
mod tables;
mod validate;
mod weights;

use decode::{
    EntryField, FIELDS, FieldName, ShapeDim, array_of, check_name, decode_chunk, field_err, nested,
    set_err,
};
pub use layouts::{MemberPlace, SetLayout, SetLayouts};
pub use tables::EntryTables;
pub use weights::{SplitMix64, weight_sizes};

/// Each chunk's position in a record's table, by chunk id (looked up once
/// per entry while a record is checked).
type ChunkPositions = HashMap<u64, usize, foldhash::fast::RandomState>;

/// The set record format this build writes for a record that carries its
/// entry table ([`SetRecord::to_value`]); a publisher sends a long table
/// by reference instead ([`SET_FORMAT_TABLE_REF`]).
pub const SET_FORMAT_VERSION: u64 = 2;

/// The set record formats this build reads: 1 (entries as JSON), 2 (the
/// entries as one base64 table), 3 (format 2 with the table in hidden
/// entries of the publisher, named by a [`TableRef`]).
pub const SET_FORMAT_VERSIONS_READ: [u64; 3] = [1, 2, 3];

/// The set record format whose entry table is named, not carried
/// ([`TableRef`]).
pub const SET_FORMAT_TABLE_REF: u64 = 3;

/// The most hidden entries a [`TableRef`] names.
pub const MAX_TABLE_PARTS: usize = 1024;

/// Where a format 3 record's entry table is: the hidden entries of the
/// publisher that hold its base64 text in order, and the text's length.
/// A publisher names each table it publishes once (the names are never
/// reused for another table), so a reader that kept a table under these
/// names reads nothing more.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableRef {
    /// The entries holding the text, in order (at least one).
    pub parts: Vec<String>,
    /// The text's length in bytes.
    pub bytes: u64,
}

impl TableRef {
    /// The reference as the record's `entries` field.
    pub fn to_value(&self) -> Value {
        let mut m = Map::new();
        m.insert("bytes".into(), self.bytes.into());
        m.insert(
            "parts".into(),
            Value::Array(self.parts.iter().map(|p| p.clone().into()).collect()),
        );
        Value::Object(m)
    }

    /// Decodes the `entries` field of a format 3 record.
    fn from_value(v: &Value) -> Result<Self> {
        let map = v.as_object().ok_or_else(|| {
            field_err(
                "entries",
                format!(
                    "expected the table reference of set format 3, found {}",
                    kind_of(v)
                ),
            )
        })?;
        let f = Fields::new(map, |field, reason| {
            field_err(&format!("entries.{field}"), reason)
        });
        if let Some(unknown) = f.unknown(&["parts", "bytes"]) {
            return Err(field_err(&format!("entries.{unknown}"), "unknown field"));
        }
        let bytes = f.req::<u64>("bytes")?;
        if bytes == 0 || bytes > MAX_SET_RECORD_BYTES as u64 {
            return Err(field_err(
                "entries.bytes",
                format!("{bytes} is not between 1 and {MAX_SET_RECORD_BYTES}"),
            ));
        }
        let parts = array_of("entries.parts", f.req::<&Value>("parts")?, "entry names")?;
        if parts.is_empty() || parts.len() > MAX_TABLE_PARTS {
            return Err(field_err(
                "entries.parts",
                format!(
                    "{} names; a table is in 1 to {MAX_TABLE_PARTS} entries",
                    parts.len()
                ),
            ));
        }
        let parts = parts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let at = || format!("entries.parts[{i}]");
                let name = p.as_str().ok_or_else(|| {
                    field_err(&at(), format!("expected an entry name, found {p}"))
                })?;
                crate::channel::validate_entry_name(name)
                    .map_err(|e| field_err(&at(), e.to_string()))?;
                Ok(name.to_owned())
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(TableRef { parts, bytes })
    }
}

/// How a reader gets the text of a table a format 3 record names, when it
/// kept none under that name (a [`Subscriber`](crate::exchange::Subscriber)
/// reads the publisher's entries).
pub type TableFetch<'a> = &'a mut dyn FnMut(&TableRef) -> Result<String>;

/// The key that carries the set record's format version.
pub const SET_VERSION_KEY: &str = "cuda_ipc_set";

/// The most entries a set record holds.
pub const MAX_SET_ENTRIES: usize = 100_000;

/// The longest set record's JSON text [`SetRecord::from_json`] parses (16
/// MiB, 64 times what the channel carries as an entry's metadata): the
/// size is checked before parsing, which takes about 20 times the text
/// in memory.
pub const MAX_SET_RECORD_BYTES: usize = 16 << 20;

/// The most chunks a set record's table holds.
pub const MAX_SET_CHUNKS: usize = 4096;

/// The longest name of a set or an entry, in bytes of UTF-8.
pub const MAX_SET_NAME_LEN: usize = 256;

/// The most dimensions of an entry's shape.
pub const MAX_SET_DIMS: usize = 32;

/// One chunk of a set's chunk table.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SetChunk {
    /// The chunk's index in its arena ([`ChunkId::index`](crate::arena::ChunkId)).
    pub id: u64,
    /// The chunk's descriptor: the whole chunk, as bytes (`u8`, no shape, no event).
    pub descriptor: Descriptor,
}

/// A set entry's dimensions: inline up to four (no allocation for what
/// model weights have), on the heap beyond.
pub type Shape = smallvec::SmallVec<[u64; 4]>;

/// One buffer of a set.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SetEntry {
    /// The buffer's name, unique in the set.
    pub name: String,
    /// What it holds.
    pub dtype: Dtype,
    /// Its dimensions in elements, row-major and contiguous (`[]` for a scalar).
    pub shape: Shape,
    /// The id of the chunk it lives in.
    pub chunk: u64,
    /// Bytes from the start of the chunk's described bytes to the buffer.
    pub offset: u64,
    /// Its length in bytes: the elements of `shape` times the dtype's size.
    pub len: u64,
}

/// A shared record's entry positions by name, made at the first look-up
/// (most attaches never look one up): what an attached set keeps.
#[derive(Debug)]
pub struct NameIndex {
    record: std::sync::Arc<SetRecord>,
    index: std::sync::OnceLock<HashMap<String, usize>>,
}

impl NameIndex {
    /// The index of `record`'s entries (made at the first look-up).
    pub fn new(record: std::sync::Arc<SetRecord>) -> Self {
        NameIndex {
            record,
            index: std::sync::OnceLock::new(),
        }
    }

    /// The record indexed.
    pub fn record(&self) -> &std::sync::Arc<SetRecord> {
        &self.record
    }

    /// The position of the entry called `name`.
    pub fn position(&self, name: &str) -> Option<usize> {
        self.index
            .get_or_init(|| self.record.name_index())
            .get(name)
            .copied()
    }
}

/// A named set of buffers in the chunks of one arena.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SetRecord {
    /// The set's name.
    pub name: String,
    /// The arena the chunks belong to (with a chunk's id, the key of a
    /// consumer's mapping cache).
    pub arena: ArenaId,
    /// Every chunk the entries use, once.
    pub chunks: Vec<SetChunk>,
    /// The buffers, in the producer's order (shared: a subscriber that
    /// decodes a table it has decoded before reuses it, [`EntryTables`]).
    pub entries: Arc<[SetEntry]>,
    /// An interprocess event recorded after the producer's writes, if any.
    pub event: Option<IpcEventHandle>,
    /// Whether readers must map the set's chunks read-only (the
    /// publisher's policy; `read_only` in JSON, written only when true).
    pub read_only: bool,
}

impl SetChunk {
    /// Chunk `id` of its arena, described by `descriptor` (the whole chunk
    /// as bytes).
    pub fn new(id: u64, descriptor: Descriptor) -> Self {
        SetChunk { id, descriptor }
    }
}

impl SetEntry {
    /// The buffer `name` of `dtype` in `shape`, `len` bytes at `offset` in
    /// chunk `chunk` (checked with the record: [`SetRecord::validate`]).
    pub fn new(
        name: String,
        dtype: Dtype,
        shape: impl Into<Shape>,
        chunk: u64,
        offset: u64,
        len: u64,
    ) -> Self {
        SetEntry {
            name,
            dtype,
            shape: shape.into(),
            chunk,
            offset,
            len,
        }
    }

    /// What the entry stands for: an ordinary tensor, a tensor tied to an
    /// earlier entry, or an empty tensor ([`names`]).
    #[must_use]
    pub fn role(&self) -> names::EntryRole<'_> {
        names::EntryRole::of(&self.name)
    }
}

impl SetRecord {
    /// A set record with no event, validated.
    pub fn new(
        name: String,
        arena: ArenaId,
        chunks: Vec<SetChunk>,
        entries: Vec<SetEntry>,
    ) -> Result<Self> {
        let r = SetRecord {
            name,
            arena,
            chunks,
            entries: entries.into(),
            event: None,
            read_only: false,
        };
        r.validate()?;
        Ok(r)
    }

    /// Parses and validates a set record from JSON text of at most
    /// [`MAX_SET_RECORD_BYTES`]; a longer text is refused before it is parsed.
    pub fn from_json(text: &str) -> Result<Self> {
        Self::from_json_with(text, None)
    }

    /// As [`from_json`](Self::from_json), reusing an entry table kept in
    /// `tables` (and keeping the one read) when given.
    pub fn from_json_with(text: &str, tables: Option<&EntryTables>) -> Result<Self> {
        Self::from_json_fetching(text, tables, None)
    }

    /// As [`from_json_with`](Self::from_json_with), reading a format 3
    /// record's table through `fetch` (see
    /// [`from_value_fetching`](Self::from_value_fetching)).
    pub fn from_json_fetching(
        text: &str,
        tables: Option<&EntryTables>,
        fetch: Option<TableFetch<'_>>,
    ) -> Result<Self> {
        if text.len() > MAX_SET_RECORD_BYTES {
            return Err(field_err(
                "(document)",
                format!(
                    "{} bytes is longer than the {MAX_SET_RECORD_BYTES} a set record may have",
                    text.len()
                ),
            ));
        }
        // The strict parser refuses duplicate keys, as for descriptors and
        // share records: a record a peer sends has one reading.
        let value: Value = crate::json::parse_strict(text)
            .map_err(|e| field_err("(document)", format!("not valid JSON: {e}")))?;
        Self::from_value_fetching(&value, tables, fetch)
    }

    /// Validates a set record already parsed as JSON.
    pub fn from_value(value: &Value) -> Result<Self> {
        Self::from_value_with(value, None)
    }

    /// As [`from_value`](Self::from_value), reusing an entry table kept in
    /// `tables` (and keeping the one read) when given: a record whose table
    /// text and chunk table are those of a kept table shares its entries,
    /// already checked; everything else in it is checked as always.
    pub fn from_value_with(value: &Value, tables: Option<&EntryTables>) -> Result<Self> {
        Self::from_value_fetching(value, tables, None)
    }

    /// As [`from_value_with`](Self::from_value_with), reading a format 3
    /// record's table through `fetch` when `tables` kept none under its
    /// [`TableRef`] (without `fetch`, a format 3 record is refused: its
    /// table is not in it).
    pub fn from_value_fetching(
        value: &Value,
        tables: Option<&EntryTables>,
        fetch: Option<TableFetch<'_>>,
    ) -> Result<Self> {
        let map = value.as_object().ok_or_else(|| {
            field_err(
                "(document)",
                format!("expected a JSON object, found {}", kind_of(value)),
            )
        })?;
        let f = Fields::new(map, set_err);
        if let Some(unknown) = f.unknown(FIELDS) {
            return Err(field_err(
                unknown,
                "unknown field (this reader knows set formats 1 to 3)",
            ));
        }
        let version = f.req::<u64>(SET_VERSION_KEY)?;
        if !SET_FORMAT_VERSIONS_READ.contains(&version) {
            return Err(field_err(
                SET_VERSION_KEY,
                format!(
                    "set format {version} is not supported; this build reads set formats 1 to 3"
                ),
            ));
        }
        let name = f.req::<&str>("name")?.to_string();
        let arena = ArenaId(f.req::<u64>("arena")?);
        let chunk_values = array_of("chunks", f.req::<&Value>("chunks")?, "chunks")?;
        if chunk_values.len() > MAX_SET_CHUNKS {
            return Err(field_err(
                "chunks",
                format!(
                    "{} chunks is more than the {MAX_SET_CHUNKS} allowed",
                    chunk_values.len()
                ),
            ));
        }
        let chunks = chunk_values
            .iter()
            .enumerate()
            .map(|(i, v)| decode_chunk(i, v))
            .collect::<Result<Vec<_>>>()?;
        let decoded = decode_entries(
            version,
            f.req::<&Value>("entries")?,
            arena,
            &chunks,
            tables,
            fetch,
        )?;
        let r = SetRecord {
            name,
            arena,
            chunks,
            entries: decoded.entries,
            event: f.opt("event")?,
            read_only: f.opt::<bool>("read_only")?.unwrap_or(false),
        };
        if decoded.kept {
            // The entries were checked over these chunks when kept.
            r.validate_head()?;
        } else {
            r.validate()?;
            if let (Some(t), Some((text, named))) = (tables, decoded.text) {
                t.keep(&text, &r.chunks, &r.entries, named.map(|n| (arena, n)));
            }
        }
        Ok(r)
    }

    /// Checks names, the chunk table and every entry's place; the decoder
    /// calls it, and so should code that builds a record by hand.
    pub fn validate(&self) -> Result<()> {
        let chunks = self.validate_head()?;
        validate::entries(self, &chunks)
    }

    /// Checks everything but the entries (the name, the arena, the chunk
    /// table, the read-only policy); returns each chunk's position by id.
    pub(crate) fn validate_head(&self) -> Result<ChunkPositions> {
        check_name("name", &self.name)?;
        if self.arena.0 == 0 {
            return Err(field_err("arena", "must not be zero"));
        }
        let chunks = validate::chunks(self)?;
        if self.read_only {
            // Every chunk has chunks[0]'s mechanism (checked above).
            let mechanism = self.chunks[0].descriptor.mechanism();
            mechanism
                .check_access(crate::Access::ReadOnly)
                .map_err(|e| field_err("read_only", e.to_string()))?;
        }
        Ok(chunks)
    }

    /// Each entry's position by name (names are unique in a valid record).
    pub fn name_index(&self) -> HashMap<String, usize> {
        self.entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.name.clone(), i))
            .collect()
    }

    /// The chunk with this id.
    pub fn chunk(&self, id: u64) -> Option<&SetChunk> {
        self.chunks.iter().find(|c| c.id == id)
    }

    /// The bytes of all entries together (saturating: a record's entries
    /// each lie inside a chunk, but tied entries may count the same bytes
    /// twice, so the sum of a hostile record is bounded only by 64 bits).
    pub fn total_bytes(&self) -> u64 {
        self.entries
            .iter()
            .fold(0u64, |sum, e| sum.saturating_add(e.len))
    }

    /// A descriptor of entry `index` alone (its chunk's descriptor narrowed
    /// to the entry, with the set's event), for consumers that open buffers
    /// one by one. Mapping it maps the whole chunk.
    pub fn entry_descriptor(&self, index: usize) -> Result<Descriptor> {
        let e = self.entries.get(index).ok_or_else(|| {
            Error::arg(
                "set entry",
                format!(
                    "index {index} is past the set's {} entries",
                    self.entries.len()
                ),
            )
        })?;
        let chunk = self.chunk(e.chunk).ok_or_else(|| {
            field_err(
                &format!("entries[{index}].chunk"),
                format!("{} is not the id of a chunk in the table", e.chunk),
            )
        })?;
        let offset = chunk
            .descriptor
            .offset
            .checked_add(e.offset)
            .ok_or_else(|| {
                field_err(&format!("entries[{index}].offset"), "the offset overflows")
            })?;
        let mut d = chunk.descriptor.clone();
        d.offset = offset;
        d.byte_len = e.len;
        d.dtype = e.dtype;
        d.shape = Some(e.shape.to_vec());
        d.strides = None;
        d.event = self.event;
        d.validate()?;
        Ok(d)
    }

    /// The record as a JSON value in format 2, the entries as one base64
    /// table (keys sorted): what a publisher sends.
    pub fn to_value(&self) -> Value {
        self.value_with(2, Value::String(table::encode(&self.entries)))
    }

    /// The record as a JSON value in format 3: its table named by `table`
    /// (the entries' table published apart, see [`TableRef`]).
    pub fn to_value_with_ref(&self, table: &TableRef) -> Value {
        self.value_with(SET_FORMAT_TABLE_REF, table.to_value())
    }

    /// The record as a JSON value in format 1, every entry a JSON array
    /// (keys sorted): for people reading a record, and for readers that
    /// know only format 1. Decoders read both.
    pub fn to_expanded_value(&self) -> Value {
        let entries = self
            .entries
            .iter()
            .map(|e| {
                Value::Array(vec![
                    e.name.clone().into(),
                    e.dtype.name().into(),
                    e.shape.to_vec().into(),
                    e.chunk.into(),
                    e.offset.into(),
                    e.len.into(),
                ])
            })
            .collect();
        self.value_with(1, Value::Array(entries))
    }

    /// [`to_value`](Self::to_value) and [`to_json`](Self::to_json) with
    /// the entries' table made before (a [`SetLayout`]'s), the record
    /// built once: the table is copied into the text whole instead of
    /// encoded as a JSON string (base64 needs no escapes): the same value
    /// and text.
    pub(crate) fn to_value_and_json_with_table(&self, table: &str) -> (Value, String) {
        // Every other string of the record is escaped, so `"entries":""`
        // (an empty string after the key) is found only as the key itself;
        // the table goes between its quotes.
        const EMPTY: &str = r#""entries":"""#;
        debug_assert_eq!(table, table::encode(&self.entries));
        let mut value = self.value_with(2, Value::String(String::new()));
        let head = value.to_string();
        let at = head
            .find(EMPTY)
            .map(|at| at + EMPTY.len() - 1)
            .expect("the record has its entries field");
        let mut text = String::with_capacity(head.len() + table.len());
        text.push_str(&head[..at]);
        text.push_str(table);
        text.push_str(&head[at..]);
        value["entries"] = Value::String(table.to_owned());
        (value, text)
    }

    fn value_with(&self, version: u64, entries: Value) -> Value {
        let mut m = Map::new();
        m.insert(SET_VERSION_KEY.into(), version.into());
        m.insert("name".into(), self.name.clone().into());
        m.insert("arena".into(), self.arena.0.into());
        let chunks = self
            .chunks
            .iter()
            .map(|c| {
                let mut o = Map::new();
                o.insert("id".into(), c.id.into());
                o.insert("descriptor".into(), c.descriptor.to_value());
                Value::Object(o)
            })
            .collect();
        m.insert("chunks".into(), Value::Array(chunks));
        m.insert("entries".into(), entries);
        if let Some(e) = self.event {
            m.insert("event".into(), e.to_string().into());
        }
        if self.read_only {
            m.insert("read_only".into(), true.into());
        }
        Value::Object(m)
    }

    /// The record as one line of JSON, format 2.
    pub fn to_json(&self) -> String {
        self.to_value().to_string()
    }
}
