//! The index of a Hugging Face sharded checkpoint
//! (`model.safetensors.index.json`).
//!
//! ```json
//! {
//!   "metadata": {"total_size": 4400000000},
//!   "weight_map": {
//!     "lm_head.weight": "model-00002-of-00002.safetensors",
//!     "model.embed_tokens.weight": "model-00001-of-00002.safetensors"
//!   }
//! }
//! ```
//!
//! `weight_map` (required) names the shard file of every tensor, relative
//! to the index's directory; `metadata` (optional) is any JSON object, and
//! its `total_size`, when present, must be a byte count. Other top-level
//! keys are ignored, as Hugging Face's loaders ignore them. A document that
//! names a key twice at any depth is refused (two readers would disagree on
//! it), and so is a shard path that could leave the directory: absolute,
//! with a `..` component, empty, or holding a NUL byte. Symbolic links
//! inside the directory are followed (the Hugging Face cache's snapshots
//! are links to its blobs): the directory's owner decides where they lead.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path};

use serde_json::{Map, Value};

use super::err;
use crate::error::Result;
use crate::json::{kind_of, parse_strict};
use crate::units::shorten;

/// The largest index accepted, in bytes (an index of 100,000 tensors takes
/// about 10 MB), checked on the open file's length before it is read.
pub const MAX_INDEX_BYTES: u64 = 16 << 20;

/// The most shard files an index may name (each is held open while the
/// checkpoint is).
pub const MAX_SHARDS: usize = 4096;

/// A sharded checkpoint's index, validated.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct ShardIndex {
    /// Tensor name -> shard file (relative to the index's directory, checked
    /// not to leave it), sorted by name.
    pub weight_map: BTreeMap<String, String>,
    /// The `metadata` object (empty if absent).
    pub metadata: Map<String, Value>,
    /// `metadata.total_size`, if given: the bytes of all tensors, as the
    /// writer counted them (not checked against the shards: writers differ
    /// on tied and shared tensors).
    pub total_size: Option<u64>,
}

impl ShardIndex {
    /// Parses and validates the text of an index. `file` only names the
    /// index in errors.
    pub fn parse(file: &Path, bytes: &[u8]) -> Result<ShardIndex> {
        if bytes.len() as u64 > MAX_INDEX_BYTES {
            return Err(err(
                file,
                "file",
                format!(
                    "{} bytes, more than the limit of {MAX_INDEX_BYTES} for an index: not a \
                     checkpoint index",
                    bytes.len()
                ),
            ));
        }
        let text = std::str::from_utf8(bytes).map_err(|e| {
            err(
                file,
                "file",
                format!("not UTF-8 ({e}): not a checkpoint index"),
            )
        })?;
        let value = parse_strict(text).map_err(|e| {
            err(
                file,
                "file",
                format!("not JSON ({e}): not a checkpoint index, or a damaged one"),
            )
        })?;
        let Value::Object(top) = value else {
            return Err(err(
                file,
                "file",
                format!(
                    "{}, not a JSON object with a \"weight_map\": not a checkpoint index",
                    kind_of(&value)
                ),
            ));
        };
        let metadata = match top.get("metadata") {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(m)) => m.clone(),
            Some(other) => {
                return Err(err(
                    file,
                    "metadata",
                    format!("{}, not an object", kind_of(other)),
                ));
            }
        };
        let total_size = match metadata.get("total_size") {
            None | Some(Value::Null) => None,
            Some(v) => Some(total_size(v).ok_or_else(|| {
                err(
                    file,
                    "metadata.total_size",
                    format!("{v}, not a byte count (a whole number from 0)"),
                )
            })?),
        };
        let map = match top.get("weight_map") {
            Some(Value::Object(m)) => m,
            None => {
                return Err(err(
                    file,
                    "weight_map",
                    "missing: an index maps every tensor name to its shard file",
                ));
            }
            Some(other) => {
                return Err(err(
                    file,
                    "weight_map",
                    format!(
                        "{}, not an object of tensor name -> shard file",
                        kind_of(other)
                    ),
                ));
            }
        };
        if map.is_empty() {
            return Err(err(file, "weight_map", "empty: the index names no tensor"));
        }
        let mut weight_map = BTreeMap::new();
        for (name, shard) in map {
            let field = || format!("weight_map[{}]", shorten(name, 80));
            if name.is_empty() {
                return Err(err(file, field(), "an empty tensor name"));
            }
            let Value::String(shard) = shard else {
                return Err(err(
                    file,
                    field(),
                    format!("{}, not a shard file name", kind_of(shard)),
                ));
            };
            check_shard_path(shard).map_err(|why| err(file, field(), why))?;
            weight_map.insert(name.clone(), shard.clone());
        }
        Ok(ShardIndex {
            weight_map,
            metadata,
            total_size,
        })
    }

    /// The distinct shard files, sorted.
    pub fn shards(&self) -> BTreeSet<&str> {
        self.weight_map.values().map(String::as_str).collect()
    }
}

/// A whole, non-negative JSON number (`1.0e3` is accepted as 1,000; some
/// writers print floats).
fn total_size(v: &Value) -> Option<u64> {
    if let Some(n) = v.as_u64() {
        return Some(n);
    }
    let f = v.as_f64()?;
    // 2^64 as f64: the first value a u64 cannot hold.
    (f >= 0.0 && f.fract() == 0.0 && f < 18_446_744_073_709_551_616.0).then_some(f as u64)
}

/// A shard path must name a file inside the index's directory: relative,
/// with only plain components (and `.`), no `..`, not empty, no NUL.
fn check_shard_path(shard: &str) -> std::result::Result<(), String> {
    let shown = shorten(shard, 80);
    if shard.is_empty() {
        return Err("an empty shard file name".into());
    }
    if shard.contains('\0') {
        return Err(format!("shard file {shown} holds a NUL byte"));
    }
    let path = Path::new(shard);
    let mut plain = 0;
    for c in path.components() {
        match c {
            Component::Normal(_) => plain += 1,
            Component::CurDir => {}
            Component::ParentDir => {
                return Err(format!(
                    "shard file {shown} leaves the checkpoint's directory (a `..` component); \
                     shards must lie in the index's directory or below it"
                ));
            }
            Component::RootDir | Component::Prefix(_) => {
                return Err(format!(
                    "shard file {shown} is an absolute path; shards are named relative to the \
                     index's directory"
                ));
            }
        }
    }
    if plain == 0 {
        return Err(format!("shard file {shown} names no file"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<ShardIndex> {
        ShardIndex::parse(
            Path::new("dir/model.safetensors.index.json"),
            text.as_bytes(),
        )
    }

    fn refused(text: &str, words: &[&str]) {
        let e = parse(text).unwrap_err().to_string();
        assert!(e.contains("model.safetensors.index.json"), "{e}");
        for w in words {
            assert!(e.contains(w), "{e:?} lacks {w:?}");
        }
    }

    #[test]
    fn a_hugging_face_index_parses() {
        let i = parse(
            r#"{"metadata": {"total_size": 12, "format": "pt"},
                "weight_map": {"b": "m-2.safetensors", "a": "m-1.safetensors",
                               "c": "./sub/m-1.safetensors"}}"#,
        )
        .unwrap();
        assert_eq!(i.total_size, Some(12));
        assert_eq!(i.weight_map["a"], "m-1.safetensors");
        assert_eq!(
            i.shards().into_iter().collect::<Vec<_>>(),
            [
                "./sub/m-1.safetensors",
                "m-1.safetensors",
                "m-2.safetensors"
            ]
        );
        assert_eq!(
            parse(r#"{"weight_map": {"a": "x"}, "other": 1}"#)
                .unwrap()
                .total_size,
            None
        );
        assert_eq!(
            parse(r#"{"metadata": {"total_size": 1.2e3}, "weight_map": {"a": "x"}}"#)
                .unwrap()
                .total_size,
            Some(1200)
        );
    }

    #[test]
    fn malformed_indexes_are_refused_naming_the_field() {
        refused("[1]", &["file", "an array"]);
        refused("{", &["not JSON"]);
        refused("{}", &["weight_map", "missing"]);
        refused(r#"{"weight_map": []}"#, &["weight_map", "an array"]);
        refused(r#"{"weight_map": {}}"#, &["weight_map", "empty"]);
        refused(
            r#"{"weight_map": {"a": 3}}"#,
            &["weight_map[\"a\"]", "a number"],
        );
        refused(r#"{"weight_map": {"": "x"}}"#, &["empty tensor name"]);
        refused(r#"{"weight_map": {"a": "x", "a": "y"}}"#, &["twice"]);
        refused(
            r#"{"metadata": 1, "weight_map": {"a": "x"}}"#,
            &["metadata", "a number"],
        );
        refused(
            r#"{"metadata": {"total_size": -1}, "weight_map": {"a": "x"}}"#,
            &["metadata.total_size", "-1"],
        );
        refused(
            r#"{"weight_map": {"a": "../x.safetensors"}}"#,
            &["`..`", "leaves"],
        );
        refused(r#"{"weight_map": {"a": "s/../../x"}}"#, &["`..`"]);
        refused(r#"{"weight_map": {"a": "/etc/passwd"}}"#, &["absolute"]);
        refused(r#"{"weight_map": {"a": ""}}"#, &["empty shard"]);
        refused(r#"{"weight_map": {"a": "."}}"#, &["names no file"]);
        refused(r#"{"weight_map": {"a": "x\u0000"}}"#, &["NUL"]);
        let e = ShardIndex::parse(Path::new("i.json"), &[0xff, b'{']).unwrap_err();
        assert!(e.to_string().contains("UTF-8"), "{e}");
    }
}
