//! The entry table of set format 2: every entry of a set in one compact
//! binary table, carried in the record's `entries` field as base64 text.
//!
//! Format 1 wrote each entry as a JSON array; a set of 1,000 tensors was
//! then about 100 KB of JSON, parsed into a tree of 10,000 values on every
//! attach (about 1 ms of a weight-set hand-off on the development machine).
//! The table is about a third of that size and decodes in one pass.
//!
//! Layout: unsigned LEB128 integers (`uN` below), strings as a length and
//! UTF-8 bytes:
//!
//! ```text
//! table := count:uN entry{count}
//! entry := name_len:uN name dtype_len:uN dtype ndims:uN dim:uN{ndims} chunk:uN offset:uN len:uN
//! ```
//!
//! `dtype` is the element type's name (`f32`, `bf16`, `f8e4m3fn`, `c64`,
//! ...: [`Dtype`]), so a type added later needs no new format: records
//! that carry it read in every build that knows the name, and builds
//! older than the name (the fp8, fp4 and complex types came after format
//! 2) refuse them with an error that names the entry's `dtype`. Decoding is
//! strict: integers in their shortest form and within 64 bits, lengths
//! within the limits of [`super`] before anything is read or allocated,
//! no bytes after the last entry; errors name the entry and its field.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;

use super::{
    EntryField, FieldName, MAX_SET_DIMS, MAX_SET_ENTRIES, MAX_SET_NAME_LEN, SetEntry, field_err,
};
use crate::descriptor::Dtype;
use crate::error::{Error, Result};

/// The longest element type name the table holds.
const MAX_DTYPE_LEN: u64 = 16;

/// The fewest bytes an entry takes (a one-byte name, a two-byte dtype name,
/// no dimensions): bounds what a table's count may reserve.
const MIN_ENTRY_BYTES: usize = 8;

/// The entries as a base64 table.
pub(super) fn encode(entries: &[SetEntry]) -> String {
    STANDARD.encode(encode_bytes(entries))
}

/// The entries as a binary table (before base64).
pub fn encode_bytes(entries: &[SetEntry]) -> Vec<u8> {
    let mut buf = Vec::with_capacity(8 + entries.len() * 32);
    put(&mut buf, entries.len() as u64);
    for e in entries {
        put_str(&mut buf, &e.name);
        put_str(&mut buf, e.dtype.name());
        put(&mut buf, e.shape.len() as u64);
        for &d in &e.shape {
            put(&mut buf, d);
        }
        put(&mut buf, e.chunk);
        put(&mut buf, e.offset);
        put(&mut buf, e.len);
    }
    buf
}

fn put(buf: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        buf.push((v & 0x7f) as u8 | 0x80);
        v >>= 7;
    }
    buf.push(v as u8);
}

fn put_str(buf: &mut Vec<u8>, s: &str) {
    put(buf, s.len() as u64);
    buf.extend_from_slice(s.as_bytes());
}

/// Decodes a base64 table (the `entries` field of format 2).
pub(super) fn decode(text: &str) -> Result<Vec<SetEntry>> {
    let bytes = STANDARD.decode(text).map_err(|e| {
        field_err(
            "entries",
            format!("not base64 ({e}); set format 2 carries its entries as a base64 table"),
        )
    })?;
    decode_bytes(&bytes)
}

/// Decodes a binary table (after base64). The entries are not checked
/// against a chunk table here: [`super::SetRecord::validate`] does that.
pub fn decode_bytes(bytes: &[u8]) -> Result<Vec<SetEntry>> {
    let mut r = Reader {
        buf: bytes,
        at: 0,
        last_dtype: None,
    };
    let count = r.varint(|| "entries".to_string())?;
    if count > MAX_SET_ENTRIES as u64 {
        return Err(field_err(
            "entries",
            format!("{count} entries is more than the {MAX_SET_ENTRIES} allowed"),
        ));
    }
    let count = count as usize;
    let mut entries = Vec::with_capacity(count.min(bytes.len() / MIN_ENTRY_BYTES + 1));
    for i in 0..count {
        entries.push(r.entry(i)?);
    }
    if r.at != bytes.len() {
        return Err(field_err(
            "entries",
            format!(
                "{} bytes follow the last of the {count} entries of the table",
                bytes.len() - r.at
            ),
        ));
    }
    Ok(entries)
}

struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
    /// The last dtype name read and its type: neighbouring entries mostly
    /// share one, which is then parsed once.
    last_dtype: Option<(&'a str, Dtype)>,
}

impl<'a> Reader<'a> {
    /// One LEB128 integer; `field` names it in errors.
    fn varint(&mut self, field: impl FnOnce() -> String) -> Result<u64> {
        let mut v = 0u64;
        for i in 0..10 {
            let Some(&b) = self.buf.get(self.at) else {
                return Err(field_err(
                    &field(),
                    "the entry table ends inside this field",
                ));
            };
            self.at += 1;
            if i == 9 && b > 1 {
                return Err(field_err(&field(), "the integer passes 64 bits"));
            }
            v |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                if b == 0 && i > 0 {
                    return Err(field_err(
                        &field(),
                        "the integer is not in its shortest form",
                    ));
                }
                return Ok(v);
            }
        }
        Err(field_err(&field(), "the integer passes 64 bits"))
    }

    /// `n` bytes, at most `max`.
    fn bytes(&mut self, n: u64, max: u64, field: impl Fn() -> String) -> Result<&'a [u8]> {
        if n > max {
            return Err(field_err(
                &field(),
                format!("{n} bytes is longer than the {max} allowed"),
            ));
        }
        let rest = self.buf.len() - self.at;
        if n > rest as u64 {
            return Err(field_err(
                &field(),
                "the entry table ends inside this field",
            ));
        }
        let s = &self.buf[self.at..self.at + n as usize];
        self.at += n as usize;
        Ok(s)
    }

    fn str(&mut self, max: u64, field: impl Fn() -> String) -> Result<&'a str> {
        let n = self.varint(&field)?;
        let b = self.bytes(n, max, &field)?;
        std::str::from_utf8(b).map_err(|e| field_err(&field(), format!("not UTF-8: {e}")))
    }

    fn entry(&mut self, i: usize) -> Result<SetEntry> {
        let at = |f: &'static str| move || EntryField(i, Some(f)).name();
        let name = self.str(MAX_SET_NAME_LEN as u64, at("name"))?.to_string();
        let text = self.str(MAX_DTYPE_LEN, at("dtype"))?;
        let dtype = match self.last_dtype {
            Some((last, dt)) if last == text => dt,
            _ => {
                let dt: Dtype = text
                    .parse()
                    .map_err(|e: Error| field_err(&at("dtype")(), e.to_string()))?;
                self.last_dtype = Some((text, dt));
                dt
            }
        };
        let ndims = self.varint(at("shape"))?;
        if ndims > MAX_SET_DIMS as u64 {
            return Err(field_err(
                &at("shape")(),
                format!("{ndims} dimensions is more than the {MAX_SET_DIMS} allowed"),
            ));
        }
        let mut shape = super::Shape::with_capacity(ndims as usize);
        for d in 0..ndims as usize {
            shape.push(self.varint(|| super::ShapeDim(i, d).name())?);
        }
        Ok(SetEntry {
            name,
            dtype,
            shape,
            chunk: self.varint(at("chunk"))?,
            offset: self.varint(at("offset"))?,
            len: self.varint(at("len"))?,
        })
    }
}
