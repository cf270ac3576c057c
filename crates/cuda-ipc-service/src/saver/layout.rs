//! Where each tensor of a set goes in the safetensors file that saves it,
//! and the pieces its bytes are copied in. Pure data, no CUDA call.
//!
//! The file is what `safetensors.torch.save_file` would write for the same
//! tensors: the header (its JSON, built by the `safetensors` crate's own
//! [`Metadata`], padded with spaces to a multiple of 8 bytes) after its
//! 8-byte length, then every tensor's bytes back to back, ordered by
//! element type (widest first, so each tensor starts aligned to its
//! element) and then by name.

use std::collections::{BTreeMap, HashMap, HashSet};

use safetensors::tensor::{Metadata, TensorInfo};

use crate::checkpoint::dtype::to_safetensors;
use crate::error::{Error, Result};
use crate::set::SetEntry;
use crate::set::names::EntryRole;

/// One tensor of the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Placed {
    /// The set entry whose bytes it is (an index into the set's entries).
    pub entry: usize,
    /// Its name in the file: the entry's key.
    pub name: String,
    /// Where its bytes start in the file.
    pub file_offset: u64,
    /// Its length in bytes (0 for an empty tensor, which copies nothing).
    pub len: u64,
}

/// A set's file: the header's bytes, the tensors in file order, the length.
#[derive(Clone, Debug)]
pub(crate) struct Layout {
    /// The 8-byte length and the padded JSON: the file's first bytes.
    pub header: Vec<u8>,
    pub tensors: Vec<Placed>,
    /// Entries left out: tied tensors (another key for an earlier
    /// entry's memory), which safetensors files do not carry.
    pub aliases: usize,
    pub file_len: u64,
}

fn refuse(name: &str, reason: impl std::fmt::Display) -> Error {
    Error::arg("save", format!("tensor {name:?}: {reason}"))
}

/// The file for `entries` (a set's, in its order) with `metadata` as its
/// `__metadata__` (left out when empty).
///
/// # Errors
/// A tensor whose type has no safetensors form (naming it), a key twice,
/// a set with nothing to save (only tied tensors).
pub(crate) fn layout(entries: &[SetEntry], metadata: &BTreeMap<String, String>) -> Result<Layout> {
    let mut aliases = 0;
    let mut seen = HashSet::with_capacity(entries.len());
    let mut infos = Vec::with_capacity(entries.len());
    for (index, e) in entries.iter().enumerate() {
        let (key, shape, len) = match e.role() {
            EntryRole::Alias { .. } => {
                aliases += 1;
                continue;
            }
            EntryRole::Tensor { key } => (key, e.shape.to_vec(), e.len),
            EntryRole::Empty { key, shape } => (key, shape, 0),
        };
        if !seen.insert(key) {
            return Err(refuse(key, "the set holds this key twice"));
        }
        let (dtype, shape) = to_safetensors(e.dtype, &shape).map_err(|r| refuse(key, r))?;
        infos.push((key, dtype, shape, len, index));
    }
    if infos.is_empty() {
        return Err(Error::arg(
            "save",
            "the set holds no tensor of its own (only tied ones), so there is nothing to save",
        ));
    }
    // safetensors' own order: widest type first, then by name.
    infos.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    let mut offset = 0u64;
    let mut header_tensors = Vec::with_capacity(infos.len());
    let mut placed = Vec::with_capacity(infos.len());
    for (key, dtype, shape, len, entry) in infos {
        let end = offset
            .checked_add(len)
            .ok_or_else(|| refuse(key, "the file's length overflows"))?;
        let span =
            |v: u64| usize::try_from(v).map_err(|_| refuse(key, "too large for this machine"));
        header_tensors.push((
            key.to_owned(),
            TensorInfo {
                dtype,
                shape,
                data_offsets: (span(offset)?, span(end)?),
            },
        ));
        placed.push(Placed {
            entry,
            name: key.to_owned(),
            file_offset: offset,
            len,
        });
        offset = end;
    }
    let meta: Option<HashMap<String, String>> =
        (!metadata.is_empty()).then(|| metadata.clone().into_iter().collect());
    let header = Metadata::new(meta, header_tensors)
        .map_err(|e| Error::arg("save", format!("the safetensors header: {e}")))?;
    let mut json = serde_json::to_vec(&header)
        .map_err(|e| Error::arg("save", format!("the safetensors header: {e}")))?;
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut bytes = Vec::with_capacity(8 + json.len());
    bytes.extend_from_slice(&(json.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&json);
    let data_start = bytes.len() as u64;
    for p in &mut placed {
        p.file_offset += data_start;
    }
    Ok(Layout {
        file_len: data_start + offset,
        header: bytes,
        tensors: placed,
        aliases,
    })
}

/// A piece of a tensor's bytes copied and written at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Piece {
    /// The tensor: an index into [`Layout::tensors`].
    pub tensor: usize,
    /// Bytes from the tensor's start.
    pub offset: u64,
    pub len: u64,
}

/// The pieces of every tensor's bytes, at most `piece_size` each, dealt
/// round-robin to `streams` streams, in file order on each.
pub(crate) fn pieces(layout: &Layout, piece_size: u64, streams: usize) -> Vec<Vec<Piece>> {
    let piece_size = piece_size.max(1);
    let streams = streams.max(1);
    let mut out = vec![Vec::new(); streams];
    let mut k = 0;
    for (tensor, t) in layout.tensors.iter().enumerate() {
        let mut offset = 0;
        while offset < t.len {
            let len = piece_size.min(t.len - offset);
            out[k % streams].push(Piece {
                tensor,
                offset,
                len,
            });
            k += 1;
            offset += len;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::descriptor::Dtype;
    use crate::set::names;
    use proptest::prelude::*;

    fn entry(name: &str, dtype: Dtype, shape: &[u64]) -> SetEntry {
        let len = shape.iter().product::<u64>().max(1) * dtype.size();
        SetEntry::new(name.to_string(), dtype, shape.to_vec(), 0, 0, len)
    }

    fn meta() -> BTreeMap<String, String> {
        BTreeMap::from([("format".to_string(), "pt".to_string())])
    }

    /// The file safetensors writes for the same tensors, with zeroed bytes.
    fn theirs(entries: &[(String, Dtype, Vec<u64>)]) -> Vec<u8> {
        let datas: Vec<(String, Vec<u8>, safetensors::Dtype, Vec<usize>)> = entries
            .iter()
            .map(|(n, d, s)| {
                let (st, shape) = to_safetensors(*d, s).unwrap();
                let len = (s.iter().product::<u64>() * d.size()) as usize;
                (n.clone(), vec![0u8; len], st, shape)
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = datas
            .iter()
            .map(|(n, b, d, s)| {
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
                )
            })
            .collect();
        let info = Some(meta().into_iter().collect());
        safetensors::tensor::serialize(views, info).unwrap()
    }

    #[test]
    fn the_header_is_what_safetensors_writes() {
        let specs = vec![
            ("b.weight".to_string(), Dtype::Bf16, vec![3, 5]),
            ("a.bias".to_string(), Dtype::F32, vec![7]),
            ("step".to_string(), Dtype::I64, vec![]),
            ("mask".to_string(), Dtype::Bool, vec![9]),
            ("a.weight".to_string(), Dtype::Bf16, vec![2, 2]),
        ];
        let entries: Vec<SetEntry> = specs.iter().map(|(n, d, s)| entry(n, *d, s)).collect();
        let l = layout(&entries, &meta()).unwrap();
        let file = theirs(&specs);
        assert_eq!(l.file_len as usize, file.len());
        assert_eq!(&file[..l.header.len()], &l.header[..]);
        // Widest first, then by name; back to back after the header.
        let order: Vec<&str> = l.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(order, ["step", "a.bias", "a.weight", "b.weight", "mask"]);
        let parsed = safetensors::SafeTensors::deserialize(&file).unwrap();
        for t in &l.tensors {
            let view = parsed.tensor(&t.name).unwrap();
            assert_eq!(view.data().len() as u64, t.len, "{}", t.name);
            assert_eq!(entries[t.entry].name, t.name);
        }
    }

    #[test]
    fn tied_tensors_are_left_out_and_empty_ones_kept() {
        let empty = names::empty_entry_name("cache", &[0, 4]).unwrap();
        let alias = names::alias_entry_name(0, "lm_head.weight");
        let entries = vec![
            entry("embed.weight", Dtype::F16, &[4, 2]),
            entry(&alias, Dtype::F16, &[1]),
            entry(&empty, Dtype::F32, &[1]),
        ];
        let l = layout(&entries, &BTreeMap::new()).unwrap();
        assert_eq!(l.aliases, 1);
        let names: Vec<(&str, u64)> = l.tensors.iter().map(|t| (t.name.as_str(), t.len)).collect();
        assert_eq!(names, [("cache", 0), ("embed.weight", 16)]);
        let mut file = l.header.clone();
        file.resize(l.file_len as usize, 0);
        let parsed = safetensors::SafeTensors::deserialize(&file).unwrap();
        assert_eq!(parsed.tensor("cache").unwrap().shape(), [0, 4]);
        let (_, header) = safetensors::SafeTensors::read_metadata(&file).unwrap();
        assert!(header.metadata().is_none());
    }

    #[test]
    fn what_has_no_file_form_is_refused_by_name() {
        let e = layout(&[entry("z", Dtype::C128, &[2])], &meta()).unwrap_err();
        assert!(
            e.to_string().contains("\"z\"") && e.to_string().contains("c128"),
            "{e}"
        );
        let dup = vec![entry("w", Dtype::U8, &[2]), entry("w", Dtype::U8, &[3])];
        assert!(
            layout(&dup, &meta())
                .unwrap_err()
                .to_string()
                .contains("twice")
        );
        let only_tied = vec![entry(&names::alias_entry_name(0, "x"), Dtype::U8, &[1])];
        assert!(layout(&only_tied, &meta()).is_err());
    }

    proptest! {
        #[test]
        fn pieces_cover_every_byte_once(
            lens in proptest::collection::vec(0u64..5000, 1..12),
            piece in 1u64..2000,
            streams in 1usize..6,
        ) {
            let entries: Vec<SetEntry> = lens
                .iter()
                .enumerate()
                .map(|(i, &n)| {
                    if n == 0 {
                        entry(&names::empty_entry_name(&format!("t{i}"), &[0]).unwrap(), Dtype::U8, &[1])
                    } else {
                        entry(&format!("t{i}"), Dtype::U8, &[n])
                    }
                })
                .collect();
            let l = layout(&entries, &meta()).unwrap();
            let per_stream = pieces(&l, piece, streams);
            prop_assert_eq!(per_stream.len(), streams);
            let mut covered = vec![0u32; l.file_len as usize];
            for s in &per_stream {
                for p in s {
                    prop_assert!(p.len > 0 && p.len <= piece);
                    let t = &l.tensors[p.tensor];
                    prop_assert!(p.offset + p.len <= t.len);
                    let at = (t.file_offset + p.offset) as usize;
                    for c in &mut covered[at..at + p.len as usize] {
                        *c += 1;
                    }
                }
            }
            let data = l.header.len();
            prop_assert!(covered[..data].iter().all(|&c| c == 0));
            prop_assert!(covered[data..].iter().all(|&c| c == 1));
        }
    }
}
