//! A record's entry table, decoded from its format's field or found
//! among the tables a reader kept.

use std::borrow::Cow;
use std::sync::Arc;

use serde_json::Value;

use super::decode::{array_of, decode_entry, field_err};
use super::{
    ArenaId, EntryTables, MAX_SET_ENTRIES, SET_FORMAT_TABLE_REF, SetChunk, SetEntry, SetRecord,
    TableFetch, TableRef, table,
};
use crate::error::Result;
use crate::json::kind_of;

/// A record's entries as decoded, and what a reader keeps of them.
pub(super) struct DecodedEntries<'a> {
    pub(super) entries: Arc<[SetEntry]>,
    /// Found among the reader's kept tables: checked already.
    pub(super) kept: bool,
    /// The table's text, and its reference in format 3, to keep once the
    /// record is checked (none in format 1).
    pub(super) text: Option<(Cow<'a, str>, Option<TableRef>)>,
}

/// The entries of a record of format `version` whose `entries` field is
/// `field`, over `chunks`: decoded, or found among `tables`; a format 3
/// table read through `fetch` unless kept. Not checked yet.
pub(super) fn decode_entries<'a>(
    version: u64,
    field: &'a Value,
    arena: ArenaId,
    chunks: &[SetChunk],
    tables: Option<&EntryTables>,
    fetch: Option<TableFetch<'_>>,
) -> Result<DecodedEntries<'a>> {
    let decoded = |entries, text| DecodedEntries {
        entries,
        kept: false,
        text,
    };
    let found = |entries| DecodedEntries {
        entries,
        kept: true,
        text: None,
    };
    if version == 1 {
        let values = array_of("entries", field, "entries")?;
        if values.len() > MAX_SET_ENTRIES {
            return Err(field_err(
                "entries",
                format!(
                    "{} entries is more than the {MAX_SET_ENTRIES} allowed",
                    values.len()
                ),
            ));
        }
        let entries = values
            .iter()
            .enumerate()
            .map(|(i, v)| decode_entry(i, v))
            .collect::<Result<Vec<_>>>()?;
        return Ok(decoded(entries.into(), None));
    }
    if version != SET_FORMAT_TABLE_REF {
        let text = field.as_str().ok_or_else(|| {
            field_err(
                "entries",
                format!(
                    "expected the base64 entry table of set format 2, found {}",
                    kind_of(field)
                ),
            )
        })?;
        return Ok(match tables.and_then(|t| t.find(text, chunks)) {
            Some(entries) => found(entries),
            None => decoded(
                table::decode(text)?.into(),
                Some((Cow::Borrowed(text), None)),
            ),
        });
    }
    let r = TableRef::from_value(field)?;
    if let Some(entries) = tables.and_then(|t| t.find_ref(arena, &r, chunks)) {
        return Ok(found(entries));
    }
    let fetch = fetch.ok_or_else(|| {
        field_err(
            "entries",
            "the entry table of this format 3 record is in the publisher's entries it \
             names; attach the set through a Subscriber, which reads them",
        )
    })?;
    let text = fetch(&r)?;
    if text.len() as u64 != r.bytes {
        return Err(field_err(
            "entries.bytes",
            format!(
                "the table's entries hold {} bytes, the record says {}",
                text.len(),
                r.bytes
            ),
        ));
    }
    let entries = table::decode(&text)?.into();
    Ok(decoded(entries, Some((Cow::Owned(text), Some(r)))))
}

crate::json::json_record!(SetRecord);
