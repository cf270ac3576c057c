//! The header of one `.safetensors` file, validated strictly.
//!
//! A safetensors file is an 8-byte little-endian header length `n`, `n`
//! bytes of JSON (one object per tensor: `dtype`, `shape`, `data_offsets`
//! relative to the end of the header; an optional `__metadata__` object of
//! strings), then the tensors' bytes, one after another with no gap and no
//! byte left over. [`FileHeader::parse`] checks every one of those rules
//! itself, so that an error names the tensor and the field, and then has
//! the `safetensors` crate read the same header (its `Metadata`), which
//! must agree on every tensor's offsets. Only the first `8 + n` bytes are
//! read (the rest of the file is only measured), and `n` is checked against
//! [`MAX_HEADER_BYTES`] before the header is read.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::tensor::{Metadata, TensorInfo};
use serde::Deserialize;
use serde_json::Value;

use super::dtype::from_safetensors;
use super::{TensorEntry, err};
use crate::error::Result;
use crate::json::{kind_of, parse_strict};
use crate::units::shorten;

/// The largest header accepted, in bytes: 16 MiB, below the `safetensors`
/// format's own limit (100 MB), which costs seconds and gigabytes to
/// parse. A header of 1,000 tensors takes about 150 KB, of 100,000 about
/// 15 MB.
pub const MAX_HEADER_BYTES: u64 = 16 << 20;

/// The most bytes the headers of one checkpoint's files may take together
/// (64 MiB: a checkpoint of 400,000 tensors), checked before any of them is
/// read.
pub const MAX_HEADER_BYTES_TOTAL: u64 = 64 << 20;

/// The bytes before the header: its length, a little-endian `u64`.
pub(super) const LEN_BYTES: u64 = 8;

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
        let n = header_len(file, bytes.first_chunk::<8>().copied(), file_len)?;
        parse_prefix(file, &bytes[..(LEN_BYTES + n) as usize], file_len)
    }
}

/// The header's length `n` that the file's first 8 bytes (`None`: the file
/// is shorter) give, checked against [`MAX_HEADER_BYTES`] and the file's
/// length.
pub(super) fn header_len(file: &Path, first: Option<[u8; 8]>, file_len: u64) -> Result<u64> {
    let Some(len_bytes) = first else {
        return Err(err(
            file,
            "file",
            format!(
                "{file_len} bytes, too short for the 8-byte header length that starts a \
                 safetensors file: not a safetensors file"
            ),
        ));
    };
    let n = u64::from_le_bytes(len_bytes);
    if n > MAX_HEADER_BYTES {
        return Err(err(
            file,
            "header length",
            format!(
                "{n} bytes, more than the limit of {MAX_HEADER_BYTES} (a header of 100,000 \
                 tensors takes about 15 MB): not a safetensors file, or a damaged one"
            ),
        ));
    }
    if LEN_BYTES + n > file_len {
        return Err(err(
            file,
            "header length",
            format!(
                "{n} bytes, but the file holds only {} after the length: the file is cut \
                 short, or not a safetensors file",
                file_len.saturating_sub(LEN_BYTES)
            ),
        ));
    }
    Ok(n)
}

/// Validates a header from `bytes`, the file's first `8 + n` bytes, of a
/// file of `file_len` bytes (see [`FileHeader::parse`]).
pub(super) fn parse_prefix(file: &Path, bytes: &[u8], file_len: u64) -> Result<FileHeader> {
    let data_start = bytes.len() as u64;
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
    let meta: Metadata = serde_json::from_str(text)
        .map_err(|e| err(file, "header", format!("refused by safetensors: {e}")))?;
    let agrees = meta.tensors().len() == tensors.len()
        && tensors.iter().all(|t| {
            meta.info(&t.name).is_some_and(|i| {
                (i.data_offsets.0 as u64, i.data_offsets.1 as u64)
                    == (t.range.start - data_start, t.range.end - data_start)
            })
        });
    if !agrees {
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
