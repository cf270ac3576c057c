//! Layouts of written sets: a new set's tensors as its writer gives them
//! (checked as a set record's entries are), their sizes, and the layout
//! hash a commit names.

use std::collections::HashSet;

use crate::descriptor::Dtype;
use crate::set::{MAX_SET_DIMS, MAX_SET_ENTRIES, MAX_SET_NAME_LEN, SetEntry};

use super::admin::TensorSpec;

/// The arena's alignment of each tensor's buffer, in bytes.
pub(crate) const TENSOR_ALIGN: u64 = 256;

/// A checked tensor: its type and its size in bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Tensor {
    pub(crate) name: String,
    pub(crate) dtype: Dtype,
    pub(crate) shape: Vec<u64>,
    pub(crate) bytes: u64,
}

/// Checks a layout as a set record's entries are checked (1 to
/// [`MAX_SET_ENTRIES`] tensors; names non-empty, at most
/// [`MAX_SET_NAME_LEN`] bytes, no control characters, each once; a known
/// dtype; at most [`MAX_SET_DIMS`] dimensions, none 0; a size that fits
/// 64 bits).
///
/// # Errors
/// A sentence naming the tensor (`layout[i]`) and the field.
pub(crate) fn check(layout: &[TensorSpec]) -> Result<Vec<Tensor>, String> {
    if layout.is_empty() {
        return Err("layout: a set needs at least one tensor".into());
    }
    if layout.len() > MAX_SET_ENTRIES {
        return Err(format!(
            "layout: {} tensors is more than the {MAX_SET_ENTRIES} a set holds",
            layout.len()
        ));
    }
    let mut names = HashSet::with_capacity(layout.len());
    layout
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let at = |field: &str, why: String| format!("layout[{i}].{field}: {why}");
            if t.name.is_empty() {
                return Err(at("name", "must not be empty".into()));
            }
            if t.name.len() > MAX_SET_NAME_LEN {
                return Err(at(
                    "name",
                    format!(
                        "{} bytes is longer than the {MAX_SET_NAME_LEN} allowed",
                        t.name.len()
                    ),
                ));
            }
            if let Some(c) = t.name.chars().find(|c| c.is_control()) {
                return Err(at("name", format!("holds the control character {c:?}")));
            }
            if !names.insert(t.name.as_str()) {
                return Err(at("name", format!("{:?} names another tensor too", t.name)));
            }
            let dtype: Dtype = t.dtype.parse().map_err(|e| at("dtype", format!("{e}")))?;
            if t.shape.len() > MAX_SET_DIMS {
                return Err(at(
                    "shape",
                    format!("{} dimensions, more than {MAX_SET_DIMS}", t.shape.len()),
                ));
            }
            if t.shape.contains(&0) {
                return Err(at(
                    "shape",
                    format!(
                        "{:?} has a dimension of 0; a set's tensors hold at least one element",
                        t.shape
                    ),
                ));
            }
            let bytes = t
                .shape
                .iter()
                .try_fold(1u64, |a, d| a.checked_mul(*d))
                .and_then(|n| n.checked_mul(dtype.size()))
                .ok_or_else(|| {
                    at(
                        "shape",
                        format!("{:?} of {dtype} overflows 64 bits", t.shape),
                    )
                })?;
            Ok(Tensor {
                name: t.name.clone(),
                dtype,
                shape: t.shape.clone(),
                bytes,
            })
        })
        .collect()
}

/// Device bytes of a layout as the quota counts them: each tensor in its
/// own arena buffer, at [`TENSOR_ALIGN`].
pub(crate) fn device_bytes(tensors: &[Tensor]) -> u64 {
    tensors
        .iter()
        .map(|t| t.bytes.div_ceil(TENSOR_ALIGN).saturating_mul(TENSOR_ALIGN))
        .fold(0u64, u64::saturating_add)
}

/// The layout hash of a set's entries: FNV-1a (64 bits) over each entry's
/// name, dtype, shape, chunk, offset and length, in order, as 16 hex
/// digits. The service computes it from the staging version it published
/// and the writer from the record it attached
/// ([`SetAttachment::entries`](crate::exchange::SetAttachment::entries)),
/// so a commit names what the writer actually wrote into.
pub fn layout_hash(entries: &[SetEntry]) -> String {
    use std::hash::Hasher;
    let mut h = fnv::FnvHasher::default();
    let mut eat = |bytes: &[u8]| h.write(bytes);
    for e in entries {
        eat(&(e.name.len() as u64).to_le_bytes());
        eat(e.name.as_bytes());
        eat(e.dtype.name().as_bytes());
        eat(&(e.shape.len() as u64).to_le_bytes());
        for d in &e.shape {
            eat(&d.to_le_bytes());
        }
        for n in [e.chunk, e.offset, e.len] {
            eat(&n.to_le_bytes());
        }
    }
    format!("{:016x}", h.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, dtype: &str, shape: &[u64]) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            dtype: dtype.into(),
            shape: shape.to_vec(),
        }
    }

    #[test]
    fn layouts_are_checked_as_set_entries_are_naming_the_tensor() {
        let ok = check(&[spec("w", "bf16", &[3, 5]), spec("b", "f32", &[])]).unwrap();
        assert_eq!(ok[0].bytes, 30);
        assert_eq!(ok[1].bytes, 4);
        assert_eq!(device_bytes(&ok), 512);
        for (layout, field) in [
            (vec![], "at least one"),
            (vec![spec("", "f32", &[1])], "layout[0].name"),
            (vec![spec("a\n", "f32", &[1])], "control"),
            (
                vec![spec("a", "f32", &[1]), spec("a", "f32", &[1])],
                "layout[1].name",
            ),
            (vec![spec("a", "float", &[1])], "layout[0].dtype"),
            (vec![spec("a", "f32", &[2, 0])], "dimension of 0"),
            (vec![spec("a", "f32", &[1; 33])], "dimensions"),
            (vec![spec("a", "f32", &[u64::MAX, 2])], "overflows"),
            (vec![spec(&"n".repeat(257), "f32", &[1])], "longer"),
        ] {
            let e = check(&layout).unwrap_err();
            assert!(e.contains(field), "{field}: {e}");
        }
    }

    #[test]
    fn the_layout_hash_covers_names_types_shapes_and_places() {
        let e = |name: &str, dtype, shape: &[u64], offset| {
            SetEntry::new(name.into(), dtype, shape, 0, offset, 8)
        };
        let base = [e("a", Dtype::F32, &[2], 0), e("b", Dtype::F32, &[2], 256)];
        let h = layout_hash(&base);
        // The value is part of the service's protocol (a writer of one
        // build commits to a service of another): it must not change.
        assert_eq!(h, "d9d72d94aeb8b041");
        assert_eq!(h.len(), 16);
        assert_eq!(h, layout_hash(&base.clone()));
        for other in [
            [e("a", Dtype::F32, &[2], 0), e("c", Dtype::F32, &[2], 256)],
            [e("a", Dtype::F32, &[2], 0), e("b", Dtype::I32, &[2], 256)],
            [
                e("a", Dtype::F32, &[2], 0),
                e("b", Dtype::F32, &[1, 2], 256),
            ],
            [e("a", Dtype::F32, &[2], 0), e("b", Dtype::F32, &[2], 512)],
            [e("b", Dtype::F32, &[2], 256), e("a", Dtype::F32, &[2], 0)],
        ] {
            assert_ne!(layout_hash(&other), h, "{other:?}");
        }
    }
}
