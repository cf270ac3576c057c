//! The header of one `.safetensors` file, validated strictly.
//!
//! A safetensors file is an 8-byte little-endian header length `n`, `n`
//! bytes of JSON (one object per tensor: `dtype`, `shape`, `data_offsets`
//! relative to the end of the header; an optional `__metadata__` object of
//! strings), then the tensors' bytes, one after another with no gap and no
//! byte left over. [`FileHeader::parse`] checks every one of those rules
//! itself, so that an error names the tensor and the field, and then has
//! the `safetensors` crate read the same header (its
//! `SafeTensors::read_metadata`), which gives the tensors' types and shapes.
//! It reads only the first `8 + n` bytes of the buffer (the rest is only
//! measured), so over a memory map it touches no tensor's pages.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::SafeTensors;
use safetensors::tensor::TensorInfo;
use serde::Deserialize;
use serde_json::Value;

use super::dtype::from_safetensors;
use super::{TensorEntry, err};
use crate::error::Result;
use crate::json::{kind_of, parse_strict};
use crate::units::shorten;

/// The largest header accepted, in bytes: the `safetensors` format's own
/// limit (100 MB; a header of 1,000 tensors takes about 100 KB).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// The bytes before the header: its length, a little-endian `u64`.
const LEN_BYTES: u64 = 8;

/// The header of one safetensors file: its tensors, in the order of their
/// bytes in the file, and its `__metadata__`.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct FileHeader {
    /// Where the tensors' bytes start in the file (`8 + n`).
    pub data_start: u64,
    /// The tensors, by increasing offset; `file` is 0 and each `range` is a
    /// range of the file's bytes (not of the data section).
    pub tensors: Vec<TensorEntry>,
    /// The `__metadata__` strings (empty if the header has none).
    pub metadata: BTreeMap<String, String>,
}

impl FileHeader {
    /// Validates the header of the safetensors file whose bytes are `bytes`
    /// (the whole file: the data section is measured, not read). `file`
    /// only names the file in errors.
    ///
    /// Refused, each naming the file and the tensor or field: a file
    /// shorter than 8 bytes; a header longer than [`MAX_HEADER_BYTES`] or
    /// than the file; a header that is not UTF-8, not a JSON object, or that
    /// names a tensor twice; a tensor entry with a missing or malformed
    /// `dtype`, `shape` or `data_offsets`, whose byte count does not match
    /// its type and shape, or whose bytes overlap another's, leave a gap,
    /// start past the end of the file or run past it; bytes after the last
    /// tensor; a type that this crate cannot carry (see the module
    /// [`dtype`](super::dtype) table).
    pub fn parse(file: &Path, bytes: &[u8]) -> Result<FileHeader> {
        let file_len = bytes.len() as u64;
        let Some(len_bytes) = bytes.first_chunk::<8>() else {
            return Err(err(
                file,
                "file",
                format!(
                    "{file_len} bytes, too short for the 8-byte header length that starts \
                     a safetensors file: not a safetensors file"
                ),
            ));
        };
        let n = u64::from_le_bytes(*len_bytes);
        if n > MAX_HEADER_BYTES {
            return Err(err(
                file,
                "header length",
                format!(
                    "{n} bytes, more than the limit of {MAX_HEADER_BYTES}: not a safetensors \
                     file, or a damaged one"
                ),
            ));
        }
        let data_start = LEN_BYTES + n;
        if data_start > file_len {
            return Err(err(
                file,
                "header length",
                format!(
                    "{n} bytes, but the file holds only {} after the length: the file is cut \
                     short, or not a safetensors file",
                    file_len - LEN_BYTES
                ),
            ));
        }
        let header = &bytes[LEN_BYTES as usize..data_start as usize];
        let text = std::str::from_utf8(header).map_err(|e| {
            err(
                file,
                "header",
                format!("not UTF-8 ({e}): not a safetensors file"),
            )
        })?;
        let value = parse_strict(text).map_err(|e| {
            err(
                file,
                "header",
                format!("not JSON ({e}): not a safetensors file, or a damaged one"),
            )
        })?;
        let Value::Object(map) = value else {
            return Err(err(
                file,
                "header",
                format!(
                    "{}, not a JSON object of tensors: not a safetensors file",
                    kind_of(&value)
                ),
            ));
        };
        let data_len = file_len - data_start;
        let mut metadata = BTreeMap::new();
        let mut tensors = Vec::with_capacity(map.len());
        for (name, entry) in &map {
            if name == "__metadata__" {
                metadata = strings(file, entry)?;
                continue;
            }
            tensors.push(tensor(file, name, entry, data_start, data_len)?);
        }
        check_offsets(file, &mut tensors, data_start, data_len)?;
        // The crate's own reading of the same header, which must agree.
        let (crate_n, meta) = SafeTensors::read_metadata(bytes)
            .map_err(|e| err(file, "header", format!("refused by safetensors: {e}")))?;
        let names = meta.tensors();
        if crate_n as u64 != n || names.len() != tensors.len() {
            return Err(err(
                file,
                "header",
                "read differently by the safetensors crate: a damaged file",
            ));
        }
        Ok(FileHeader {
            data_start,
            tensors,
            metadata,
        })
    }
}

/// The `__metadata__` object: strings only.
fn strings(file: &Path, entry: &Value) -> Result<BTreeMap<String, String>> {
    let Value::Object(map) = entry else {
        return Err(err(
            file,
            "__metadata__",
            format!("{}, not an object of strings", kind_of(entry)),
        ));
    };
    map.iter()
        .map(|(k, v)| match v {
            Value::String(s) => Ok((k.clone(), s.clone())),
            other => Err(err(
                file,
                format!("__metadata__.{}", shorten(k, 80)),
                format!("{}, not a string", kind_of(other)),
            )),
        })
        .collect()
}

/// One tensor's entry, its byte count checked against its type and shape.
fn tensor(
    file: &Path,
    name: &str,
    entry: &Value,
    data_start: u64,
    data_len: u64,
) -> Result<TensorEntry> {
    let field = || format!("tensor {}", shorten(name, 80));
    let info = TensorInfo::deserialize(entry).map_err(|e| {
        err(
            file,
            field(),
            format!("{e} (an entry is {{\"dtype\", \"shape\", \"data_offsets\"}})"),
        )
    })?;
    let (start, end) = (info.data_offsets.0 as u64, info.data_offsets.1 as u64);
    if end < start {
        return Err(err(
            file,
            field(),
            format!("data_offsets [{start}, {end}] end before they start"),
        ));
    }
    if end > data_len {
        return Err(err(
            file,
            field(),
            format!(
                "data_offsets [{start}, {end}] run past the end of the file (its data \
                 section holds {data_len} bytes): the file is cut short or the header \
                 is wrong"
            ),
        ));
    }
    let bits = info
        .shape
        .iter()
        .try_fold(info.dtype.bitsize() as u64, |acc, &d| {
            acc.checked_mul(d as u64)
        });
    match bits {
        Some(bits) if bits % 8 == 0 && bits / 8 == end - start => {}
        Some(bits) => {
            return Err(err(
                file,
                field(),
                format!(
                    "data_offsets [{start}, {end}] hold {} bytes, but {} with shape {:?} \
                     takes {} bits",
                    end - start,
                    info.dtype,
                    info.shape,
                    bits
                ),
            ));
        }
        None => {
            return Err(err(
                file,
                field(),
                format!("shape {:?} of {} overflows 64 bits", info.shape, info.dtype),
            ));
        }
    }
    let (dtype, shape) =
        from_safetensors(info.dtype, &info.shape).map_err(|e| err(file, field(), e))?;
    Ok(TensorEntry {
        name: name.to_string(),
        dtype,
        shape,
        file: 0,
        range: data_start + start..data_start + end,
    })
}

/// The tensors sorted by offset must tile the data section exactly.
fn check_offsets(
    file: &Path,
    tensors: &mut [TensorEntry],
    data_start: u64,
    data_len: u64,
) -> Result<()> {
    tensors.sort_by_key(|t| (t.range.start, t.range.end));
    let rel = |t: &TensorEntry| (t.range.start - data_start, t.range.end - data_start);
    let mut at = 0u64;
    let mut previous: Option<&TensorEntry> = None;
    for t in tensors.iter() {
        let (start, end) = rel(t);
        let field = format!("tensor {}", shorten(&t.name, 80));
        if start < at {
            let other = previous.map_or(String::new(), |p| {
                let (ps, pe) = rel(p);
                format!(" of tensor {} [{ps}, {pe}]", shorten(&p.name, 80))
            });
            return Err(err(
                file,
                field,
                format!("data_offsets [{start}, {end}] overlap the bytes{other}"),
            ));
        }
        if start > at {
            return Err(err(
                file,
                field,
                format!(
                    "data_offsets [{start}, {end}] leave {} bytes after offset {at} that belong \
                     to no tensor",
                    start - at
                ),
            ));
        }
        at = end;
        previous = Some(t);
    }
    if at != data_len {
        return Err(err(
            file,
            "data",
            format!(
                "the tensors end at offset {at} of the data section, which holds {data_len} \
                 bytes: {} bytes belong to no tensor",
                data_len - at
            ),
        ));
    }
    Ok(())
}
