//! Entry names that carry what an entry cannot hold as it is.
//!
//! Every entry of a set holds at least one byte, and each holds its own
//! bytes. Two tensors of a model's state dict do not fit that: a tensor
//! tied to an earlier one (the same memory under a second key, as
//! `lm_head.weight` and `model.embed_tokens.weight`) and an empty tensor
//! (a dimension of 0). Both travel as a one-element entry under a name with
//! the reserved prefix [`RESERVED_PREFIX`], whose own element holds
//! nothing:
//!
//! ```text
//! .cuda-ipc/alias/INDEX/KEY      KEY is the tensor of entry INDEX (an earlier entry)
//! .cuda-ipc/empty/D0xD1x.../KEY  KEY is an empty tensor of shape [D0, D1, ...] (a Di is 0)
//! ```
//!
//! [`EntryRole::of`] reads a name back; any other name, a reserved one
//! that does not parse included, is an ordinary entry whose key is its
//! name. Python's `attach_state_dict` and `publish_state_dict` and the
//! CLI's `attach --set --checkpoint` read and write these names through
//! this module only.

/// Entry names under this prefix carry what an entry cannot hold as it is.
pub const RESERVED_PREFIX: &str = ".cuda-ipc/";
/// The prefix of an empty tensor's entry.
pub const EMPTY_PREFIX: &str = ".cuda-ipc/empty/";
/// The prefix of a tied tensor's entry.
pub const ALIAS_PREFIX: &str = ".cuda-ipc/alias/";

/// What a set entry stands for, read from its name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EntryRole<'a> {
    /// An ordinary entry: the tensor `key` is the entry's own bytes.
    Tensor {
        /// The tensor's key (the entry's name).
        key: &'a str,
    },
    /// The tensor `key` is the tensor of the entry at `index` (tied
    /// weights); the entry's own element holds nothing.
    Alias {
        /// The index of the entry it is tied to.
        index: usize,
        /// The tensor's key.
        key: &'a str,
    },
    /// The tensor `key` is empty, of `shape` (a dimension is 0); the
    /// entry's own element holds nothing.
    Empty {
        /// The tensor's key.
        key: &'a str,
        /// Its shape, with at least one 0.
        shape: Vec<u64>,
    },
}

impl<'a> EntryRole<'a> {
    /// What the entry named `name` stands for.
    #[must_use]
    pub fn of(name: &'a str) -> EntryRole<'a> {
        if let Some((index, key)) = parse_alias(name) {
            EntryRole::Alias { index, key }
        } else if let Some((key, shape)) = parse_empty(name) {
            EntryRole::Empty { key, shape }
        } else {
            EntryRole::Tensor { key: name }
        }
    }

    /// The tensor's key.
    #[must_use]
    pub fn key(&self) -> &'a str {
        match self {
            EntryRole::Tensor { key }
            | EntryRole::Alias { key, .. }
            | EntryRole::Empty { key, .. } => key,
        }
    }
}

/// The entry name that carries the empty tensor `key` of `shape`, or
/// `None` where `shape` has no 0 (the tensor is not empty).
#[must_use]
pub fn empty_entry_name(key: &str, shape: &[u64]) -> Option<String> {
    if !shape.contains(&0) {
        return None;
    }
    let dims: Vec<String> = shape.iter().map(u64::to_string).collect();
    Some(format!("{EMPTY_PREFIX}{}/{key}", dims.join("x")))
}

/// The entry name that says `key` is the tensor of entry `index`.
#[must_use]
pub fn alias_entry_name(index: usize, key: &str) -> String {
    format!("{ALIAS_PREFIX}{index}/{key}")
}

/// A run of ASCII digits as a number (no sign, no blanks, within range).
fn digits<T: std::str::FromStr>(s: &str) -> Option<T> {
    (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
        .then(|| s.parse().ok())
        .flatten()
}

/// `(key, shape)` of a name made by [`empty_entry_name`].
fn parse_empty(name: &str) -> Option<(&str, Vec<u64>)> {
    let (dims, key) = name.strip_prefix(EMPTY_PREFIX)?.split_once('/')?;
    if key.is_empty() {
        return None;
    }
    let shape = dims.split('x').map(digits).collect::<Option<Vec<u64>>>()?;
    shape.contains(&0).then_some((key, shape))
}

/// `(index, key)` of a name made by [`alias_entry_name`].
fn parse_alias(name: &str) -> Option<(usize, &str)> {
    let (index, key) = name.strip_prefix(ALIAS_PREFIX)?.split_once('/')?;
    if key.is_empty() {
        return None;
    }
    Some((digits(index)?, key))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn names_read_back_as_what_they_carry() {
        let e = empty_entry_name("model.bias", &[0, 3]).unwrap();
        assert_eq!(e, ".cuda-ipc/empty/0x3/model.bias");
        assert_eq!(
            EntryRole::of(&e),
            EntryRole::Empty {
                key: "model.bias",
                shape: vec![0, 3]
            }
        );
        let a = alias_entry_name(7, "lm_head.weight");
        assert_eq!(a, ".cuda-ipc/alias/7/lm_head.weight");
        assert_eq!(
            EntryRole::of(&a),
            EntryRole::Alias {
                index: 7,
                key: "lm_head.weight"
            }
        );
        assert_eq!(EntryRole::of("w").key(), "w");
        // Keys may hold slashes.
        let a = alias_entry_name(0, "a/b/c");
        assert_eq!(EntryRole::of(&a).key(), "a/b/c");
    }

    #[test]
    fn a_shape_without_a_zero_is_not_empty() {
        assert_eq!(empty_entry_name("w", &[2, 3]), None);
        assert_eq!(empty_entry_name("w", &[]), None);
    }

    #[test]
    fn reserved_names_that_do_not_parse_are_ordinary_entries() {
        for name in [
            ".cuda-ipc/alias/x/w",
            ".cuda-ipc/alias/-1/w",
            ".cuda-ipc/alias/+1/w",
            ".cuda-ipc/alias/ 1/w",
            ".cuda-ipc/alias/1/",
            ".cuda-ipc/alias/1",
            ".cuda-ipc/alias/99999999999999999999999/w",
            ".cuda-ipc/empty/2x3/w",
            ".cuda-ipc/empty//w",
            ".cuda-ipc/empty/0x/w",
            ".cuda-ipc/empty/0x-1/w",
            ".cuda-ipc/empty/ 0/w",
            ".cuda-ipc/empty/0/",
            ".cuda-ipc/other/w",
        ] {
            assert_eq!(
                EntryRole::of(name),
                EntryRole::Tensor { key: name },
                "{name}"
            );
        }
    }

    proptest! {
        #[test]
        fn every_made_name_reads_back(
            key in "[a-z./_0-9]{1,40}",
            index in 0usize..1_000_000,
            mut shape in proptest::collection::vec(0u64..5_000, 1..6),
            zero_at in 0usize..6,
        ) {
            let a = alias_entry_name(index, &key);
            prop_assert_eq!(EntryRole::of(&a), EntryRole::Alias { index, key: &key });
            let at = zero_at % shape.len();
            shape[at] = 0;
            let e = empty_entry_name(&key, &shape).unwrap();
            prop_assert_eq!(EntryRole::of(&e), EntryRole::Empty { key: &key, shape: shape.clone() });
        }

        #[test]
        fn any_name_reads_without_a_panic(
            prefix in prop_oneof![Just(ALIAS_PREFIX), Just(EMPTY_PREFIX), Just("")],
            rest in "\\PC{0,60}",
        ) {
            let name = format!("{prefix}{rest}");
            let role = EntryRole::of(&name);
            prop_assert!(name.ends_with(role.key()));
        }
    }
}
