//! Entry names: the reserved prefixes under which a set carries what an
//! entry cannot hold as it is (empty and tied tensors), the longest name a
//! set takes, and keys quoted for messages as Python quotes them.

use cuda_ipc::{Error, Result};

/// Entry names under this prefix carry what an entry cannot hold as it is.
pub(super) const RESERVED: &str = ".cuda-ipc/";
const EMPTY: &str = ".cuda-ipc/empty/";
pub(super) const ALIAS: &str = ".cuda-ipc/alias/";
/// The longest entry name a set record takes.
const MAX_NAME_BYTES: usize = 256;

pub(super) fn invalid(what: &'static str, reason: String) -> Error {
    Error::InvalidArgument { what, reason }
}

pub(super) fn repr(s: &str) -> String {
    // Python's repr of a str for the messages (close enough: the keys of
    // a state dict are printable).
    if s.contains('\'') && !s.contains('"') {
        format!("\"{s}\"")
    } else {
        format!("'{}'", s.replace('\\', "\\\\").replace('\'', "\\'"))
    }
}

/// The entry name that carries the empty tensor `key` of `shape`.
pub(super) fn empty_name(key: &str, shape: &[i64]) -> String {
    let dims: Vec<String> = shape.iter().map(i64::to_string).collect();
    format!("{EMPTY}{}/{key}", dims.join("x"))
}

/// `(key, shape)` of an entry named by [`empty_name`].
pub(super) fn parse_empty(name: &str) -> Option<(&str, Vec<u64>)> {
    let (dims, key) = name.strip_prefix(EMPTY)?.split_once('/')?;
    if key.is_empty() {
        return None;
    }
    let shape = dims
        .split('x')
        .map(|d| {
            (!d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
                .then(|| d.parse::<u64>().ok())
                .flatten()
        })
        .collect::<Option<Vec<u64>>>()?;
    shape.contains(&0).then_some((key, shape))
}

/// `(index, key)` of an alias entry.
pub(super) fn parse_alias(name: &str) -> Option<(usize, &str)> {
    let (index, key) = name.strip_prefix(ALIAS)?.split_once('/')?;
    if key.is_empty() || index.is_empty() || !index.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((index.parse().ok()?, key))
}

pub(super) fn check_entry_name(key: &str, entry: &str) -> Result<()> {
    if entry.len() > MAX_NAME_BYTES {
        return Err(invalid(
            "state dict key",
            format!(
                "{}: the entry name is longer than the {MAX_NAME_BYTES} bytes a set takes",
                repr(key)
            ),
        ));
    }
    Ok(())
}
