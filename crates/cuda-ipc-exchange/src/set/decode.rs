//! The set record's JSON fields, decoded strictly: every error names the
//! field it is about.

use serde_json::Value;

use super::{MAX_SET_DIMS, MAX_SET_NAME_LEN, SET_VERSION_KEY, SetChunk, SetEntry};
use crate::descriptor::{Descriptor, Dtype};
use crate::error::{Error, Result};
use crate::json::{Fields, kind_of};

pub(super) const FIELDS: &[&str] = &[
    SET_VERSION_KEY,
    "name",
    "arena",
    "chunks",
    "entries",
    "event",
    "read_only",
];
pub(super) const CHUNK_FIELDS: &[&str] = &["id", "descriptor"];
pub(super) const ENTRY_FIELDS: [&str; 6] = ["name", "dtype", "shape", "chunk", "offset", "len"];

pub(super) fn field_err(field: &str, reason: impl Into<String>) -> Error {
    Error::Descriptor {
        field: field.to_string(),
        reason: reason.into(),
    }
}

pub(super) fn set_err(field: &str, reason: String) -> Error {
    field_err(field, reason)
}

/// `e` with its field put under `prefix` (for errors of nested records).
pub(super) fn nested(prefix: &str, e: Error) -> Error {
    match e {
        Error::Descriptor { field, reason } => Error::Descriptor {
            field: format!("{prefix}.{field}"),
            reason,
        },
        other => field_err(prefix, other.to_string()),
    }
}

/// The name of a field in errors, built only when there is an error (a
/// record of 10,000 entries would otherwise format 100,000 names to decode).
pub(super) trait FieldName {
    fn name(self) -> String;
}

impl FieldName for &str {
    fn name(self) -> String {
        self.to_string()
    }
}

/// `entries[i]`, or `entries[i].field`.
pub(super) struct EntryField(pub(super) usize, pub(super) Option<&'static str>);

impl FieldName for EntryField {
    fn name(self) -> String {
        match self.1 {
            Some(f) => format!("entries[{}].{f}", self.0),
            None => format!("entries[{}]", self.0),
        }
    }
}

/// `entries[i].shape[d]`.
pub(super) struct ShapeDim(pub(super) usize, pub(super) usize);

impl FieldName for ShapeDim {
    fn name(self) -> String {
        format!("entries[{}].shape[{}]", self.0, self.1)
    }
}

pub(super) fn u64_of(field: impl FieldName, v: &Value) -> Result<u64> {
    v.as_u64().ok_or_else(|| {
        let field = field.name();
        match v {
            Value::Number(n) if n.is_f64() => {
                field_err(&field, format!("{n} is not a whole number"))
            }
            Value::Number(n) => field_err(&field, format!("{n} is negative")),
            other => field_err(
                &field,
                format!(
                    "expected a non-negative whole number, found {}",
                    kind_of(other)
                ),
            ),
        }
    })
}

pub(super) fn array_of<'a>(
    field: impl FieldName,
    v: &'a Value,
    what: &str,
) -> Result<&'a Vec<Value>> {
    v.as_array().ok_or_else(|| {
        field_err(
            &field.name(),
            format!("expected an array of {what}, found {}", kind_of(v)),
        )
    })
}

pub(super) fn str_of(field: impl FieldName, v: &Value) -> Result<&str> {
    v.as_str().ok_or_else(|| {
        field_err(
            &field.name(),
            format!("expected a string, found {}", kind_of(v)),
        )
    })
}

pub(super) fn check_name(field: impl FieldName, name: &str) -> Result<()> {
    if name.is_empty() {
        return Err(field_err(&field.name(), "must not be empty"));
    }
    if name.len() > MAX_SET_NAME_LEN {
        return Err(field_err(
            &field.name(),
            format!(
                "{} bytes is longer than the {MAX_SET_NAME_LEN} allowed",
                name.len()
            ),
        ));
    }
    // Printable ASCII (the usual name) is checked a byte at a time; other
    // text a character at a time (the C1 controls are not ASCII).
    if name.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return Ok(());
    }
    if let Some(c) = name.chars().find(|c| c.is_control()) {
        return Err(field_err(
            &field.name(),
            format!("{name:?} holds the control character {c:?}"),
        ));
    }
    Ok(())
}

pub(super) fn decode_chunk(i: usize, v: &Value) -> Result<SetChunk> {
    let at = format!("chunks[{i}]");
    let map = v.as_object().ok_or_else(|| {
        field_err(
            &at,
            format!(
                "expected an object {{id, descriptor}}, found {}",
                kind_of(v)
            ),
        )
    })?;
    let f = Fields::new(map, set_err);
    if let Some(unknown) = f.unknown(CHUNK_FIELDS) {
        return Err(field_err(
            &format!("{at}.{unknown}"),
            "unknown field (a chunk has id and descriptor)",
        ));
    }
    let id = f.req::<u64>("id").map_err(|e| nested(&at, e))?;
    let d = f.req::<&Value>("descriptor").map_err(|e| nested(&at, e))?;
    let descriptor =
        Descriptor::from_value(d).map_err(|e| nested(&format!("{at}.descriptor"), e))?;
    Ok(SetChunk { id, descriptor })
}

pub(super) fn decode_entry(i: usize, v: &Value) -> Result<SetEntry> {
    let at = |field: &'static str| EntryField(i, Some(field));
    let items = array_of(EntryField(i, None), v, "6 fields")?;
    if items.len() != ENTRY_FIELDS.len() {
        return Err(field_err(
            &format!("entries[{i}]"),
            format!(
                "{} fields where an entry has 6: [{}]",
                items.len(),
                ENTRY_FIELDS.join(", ")
            ),
        ));
    }
    let name = str_of(at("name"), &items[0])?.to_string();
    let dtype: Dtype = str_of(at("dtype"), &items[1])?
        .parse()
        .map_err(|e: Error| field_err(&at("dtype").name(), e.to_string()))?;
    let dims = array_of(at("shape"), &items[2], "whole numbers")?;
    if dims.len() > MAX_SET_DIMS {
        return Err(field_err(
            &at("shape").name(),
            format!(
                "{} dimensions is more than the {MAX_SET_DIMS} allowed",
                dims.len()
            ),
        ));
    }
    let shape = dims
        .iter()
        .enumerate()
        .map(|(d, v)| u64_of(ShapeDim(i, d), v))
        .collect::<Result<super::Shape>>()?;
    Ok(SetEntry {
        name,
        dtype,
        shape,
        chunk: u64_of(at("chunk"), &items[3])?,
        offset: u64_of(at("offset"), &items[4])?,
        len: u64_of(at("len"), &items[5])?,
    })
}
