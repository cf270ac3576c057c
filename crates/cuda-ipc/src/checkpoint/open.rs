//! Opening a checkpoint: finding its files, mapping them, reading their
//! headers and checking them against the index.
// One `unsafe` block: mapping a file (memmap2's `Mmap::map`), whose
// contract the module docs state and `CheckpointFile` restates.
#![allow(unsafe_code)]

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::{FileHeader, Plan, PlanOptions, ShardIndex, TensorEntry, err};
use crate::error::{Error, Result};
use crate::units::shorten;

/// The single-file checkpoint's name in a Hugging Face model directory.
pub const SINGLE_NAME: &str = "model.safetensors";
/// The sharded checkpoint's index name in a Hugging Face model directory.
pub const INDEX_NAME: &str = "model.safetensors.index.json";

/// One mapped file of a checkpoint.
///
/// The map is read-only and private to this type; the file must not be
/// truncated or rewritten while it lives (see the module docs).
#[derive(Debug)]
pub struct CheckpointFile {
    path: PathBuf,
    map: Mmap,
    data_start: u64,
    metadata: BTreeMap<String, String>,
}

impl CheckpointFile {
    /// The file's path (the index's directory joined with the shard's name,
    /// or the path given).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's length in bytes.
    pub fn len(&self) -> u64 {
        self.map.len() as u64
    }

    /// Whether the file is empty (never, for a file that opened).
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Where the tensors' bytes start (after the header).
    pub fn data_start(&self) -> u64 {
        self.data_start
    }

    /// The header's `__metadata__` strings.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }
}

/// An opened checkpoint: its files mapped, its headers validated, its
/// tensors listed (no tensor byte read yet).
#[derive(Debug)]
pub struct Checkpoint {
    path: PathBuf,
    index: Option<ShardIndex>,
    files: Vec<CheckpointFile>,
    tensors: Vec<TensorEntry>,
    by_name: HashMap<String, usize>,
}

impl Checkpoint {
    /// Opens `path`: a `.safetensors` file, a sharded checkpoint's index (a
    /// file whose name ends in `.json`), or a directory. In a directory the
    /// first that exists of [`SINGLE_NAME`], [`INDEX_NAME`], the one
    /// `*.safetensors.index.json`, the one `*.safetensors` is opened (in
    /// the order Hugging Face's `transformers` looks); a directory with none,
    /// or with several of the last two kinds, is refused, listing them.
    ///
    /// Every file is validated as the module docs say; the tensors are
    /// listed shard by shard (shards sorted by name), by offset within each.
    pub fn open(path: impl AsRef<Path>) -> Result<Checkpoint> {
        let given = path.as_ref();
        let kind = std::fs::metadata(given).map_err(|e| io_err(given, &e))?;
        let path = if kind.is_dir() {
            find_in_dir(given)?
        } else {
            given.to_path_buf()
        };
        if path.extension().is_some_and(|e| e == "json") {
            open_sharded(path)
        } else {
            open_single(path)
        }
    }

    /// The file that was opened: the `.safetensors` file or the index.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The index, for a sharded checkpoint.
    pub fn index(&self) -> Option<&ShardIndex> {
        self.index.as_ref()
    }

    /// The mapped files; [`TensorEntry::file`] indexes this.
    pub fn files(&self) -> &[CheckpointFile] {
        &self.files
    }

    /// The tensors, shard by shard and by offset within each.
    pub fn tensors(&self) -> &[TensorEntry] {
        &self.tensors
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorEntry> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes of all tensors.
    pub fn payload_bytes(&self) -> u64 {
        self.tensors.iter().map(TensorEntry::len).sum()
    }

    /// The bytes of `tensor` (one of [`Checkpoint::tensors`]), read from the
    /// map: the page cache, or the disk on first touch.
    pub fn bytes(&self, tensor: &TensorEntry) -> Result<&[u8]> {
        self.read(tensor.file, tensor.range.start, tensor.len())
    }

    /// `len` bytes of file `file` from `offset` (a [`Piece`](super::Piece)'s
    /// source), or [`Error::OutOfBounds`] / an invalid argument if there is
    /// no such range.
    pub fn read(&self, file: usize, offset: u64, len: u64) -> Result<&[u8]> {
        let f = self.files.get(file).ok_or_else(|| {
            Error::arg(
                "checkpoint file",
                format!("{file}, but the checkpoint has {} files", self.files.len()),
            )
        })?;
        Error::check_range(offset, len, f.len())?;
        Ok(&f.map[offset as usize..(offset + len) as usize])
    }

    /// The plan of a load of every tensor ([`Plan::new`]).
    pub fn plan(&self, options: &PlanOptions) -> Result<Plan> {
        Plan::new(&self.tensors, options)
    }
}

/// The checkpoint file in directory `dir`.
fn find_in_dir(dir: &Path) -> Result<PathBuf> {
    for name in [SINGLE_NAME, INDEX_NAME] {
        let p = dir.join(name);
        if p.exists() {
            return Ok(p);
        }
    }
    let mut indexes = Vec::new();
    let mut singles = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| io_err(dir, &e))? {
        let entry = entry.map_err(|e| io_err(dir, &e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".safetensors.index.json") {
            indexes.push(name);
        } else if name.ends_with(".safetensors") {
            singles.push(name);
        }
    }
    indexes.sort();
    singles.sort();
    let (found, kind) = if indexes.is_empty() {
        (singles, "*.safetensors files")
    } else {
        (indexes, "*.safetensors.index.json files")
    };
    match found.as_slice() {
        [one] => Ok(dir.join(one)),
        [] => Err(err(
            dir,
            "directory",
            format!(
                "holds no {SINGLE_NAME}, {INDEX_NAME}, *.safetensors.index.json or \
                 *.safetensors file: not a checkpoint directory"
            ),
        )),
        many => Err(err(
            dir,
            "directory",
            format!(
                "holds {} {kind} ({}) and no {} or {}: open the one you mean",
                many.len(),
                many.iter()
                    .take(8)
                    .map(|n| shorten(n, 80))
                    .collect::<Vec<_>>()
                    .join(", "),
                SINGLE_NAME,
                INDEX_NAME
            ),
        )),
    }
}

fn io_err(path: &Path, e: &std::io::Error) -> Error {
    let what = match e.kind() {
        std::io::ErrorKind::NotFound => "no such file or directory".to_string(),
        std::io::ErrorKind::PermissionDenied => {
            "permission denied: the file must be readable by this process's user".to_string()
        }
        _ => format!("cannot be read ({e})"),
    };
    err(path, "file", what)
}

/// Maps `path` read-only, after checking that it is a regular file.
fn map(path: &Path) -> Result<Mmap> {
    let meta = std::fs::metadata(path).map_err(|e| io_err(path, &e))?;
    if !meta.is_file() {
        return Err(err(
            path,
            "file",
            "not a regular file (a directory, device or pipe): not a safetensors file",
        ));
    }
    let file = File::open(path).map_err(|e| io_err(path, &e))?;
    // SAFETY: the map is read-only and private to `CheckpointFile`, which
    // hands out only shared slices of it. Its contents may still change, or
    // a read fault, if another process truncates or rewrites the file while
    // it is mapped: the module docs make that the caller's contract, as
    // every reader of checkpoints over a map does.
    unsafe { Mmap::map(&file) }.map_err(|e| err(path, "file", format!("cannot be mapped ({e})")))
}

/// A mapped file and its validated header.
fn open_file(path: PathBuf) -> Result<(CheckpointFile, Vec<TensorEntry>)> {
    let map = map(&path)?;
    let header = FileHeader::parse(&path, &map)?;
    let file = CheckpointFile {
        path,
        map,
        data_start: header.data_start,
        metadata: header.metadata,
    };
    Ok((file, header.tensors))
}

fn open_single(path: PathBuf) -> Result<Checkpoint> {
    let (file, tensors) = open_file(path.clone())?;
    let by_name = tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.clone(), i))
        .collect();
    Ok(Checkpoint {
        path,
        index: None,
        files: vec![file],
        tensors,
        by_name,
    })
}

/// A shard: its name in the index, its file, its header's tensors.
type Shard<'a> = (&'a str, CheckpointFile, Vec<TensorEntry>);

fn open_sharded(path: PathBuf) -> Result<Checkpoint> {
    let meta = std::fs::metadata(&path).map_err(|e| io_err(&path, &e))?;
    if meta.len() > super::MAX_INDEX_BYTES {
        return Err(err(
            &path,
            "file",
            format!(
                "{} bytes, more than the limit of {} for an index: not a checkpoint index",
                meta.len(),
                super::MAX_INDEX_BYTES
            ),
        ));
    }
    let text = std::fs::read(&path).map_err(|e| io_err(&path, &e))?;
    let index = ShardIndex::parse(&path, &text)?;
    let opened = open_shards(&path, &index)?;
    check_names(&path, &index, &opened)?;
    let mut files = Vec::with_capacity(opened.len());
    let mut tensors = Vec::with_capacity(index.weight_map.len());
    for (at, (_, file, header)) in opened.into_iter().enumerate() {
        tensors.extend(header.into_iter().map(|t| TensorEntry { file: at, ..t }));
        files.push(file);
    }
    let by_name = tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.clone(), i))
        .collect();
    Ok(Checkpoint {
        path,
        index: Some(index),
        files,
        tensors,
        by_name,
    })
}

/// Maps every shard the index names and reads its header.
fn open_shards<'a>(path: &Path, index: &'a ShardIndex) -> Result<Vec<Shard<'a>>> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut opened = Vec::new();
    for shard in index.shards() {
        let shard_path = dir.join(shard);
        if !shard_path.exists() {
            let named: Vec<&str> = index
                .weight_map
                .iter()
                .filter(|(_, s)| *s == shard)
                .map(|(n, _)| n.as_str())
                .collect();
            return Err(err(
                path,
                "weight_map",
                format!(
                    "missing shard {}: the index maps {} tensors to it (first {}), and no such \
                     file is in {}; download the whole checkpoint",
                    shorten(shard, 80),
                    named.len(),
                    shorten(named.first().copied().unwrap_or(""), 80),
                    dir.display()
                ),
            ));
        }
        let (file, header) = open_file(shard_path)?;
        opened.push((shard, file, header));
    }
    Ok(opened)
}

/// Each name in one shard, and in the shard the index maps it to.
fn check_names(path: &Path, index: &ShardIndex, opened: &[Shard<'_>]) -> Result<()> {
    // A name in two shards, whatever the index says.
    let mut found: HashMap<&str, usize> = HashMap::new();
    for (at, (_, file, header)) in opened.iter().enumerate() {
        for t in header {
            if let Some(&other) = found.get(t.name.as_str()) {
                return Err(err(
                    file.path(),
                    format!("tensor {}", shorten(&t.name, 80)),
                    format!(
                        "is in two shards, this one and {}: a name may appear once in a \
                         checkpoint",
                        opened[other].1.path().display()
                    ),
                ));
            }
            found.insert(&t.name, at);
        }
    }
    // Every header tensor where the index maps it.
    for (shard, file, header) in opened {
        for t in header {
            let field = || format!("tensor {}", shorten(&t.name, 80));
            match index.weight_map.get(&t.name) {
                Some(s) if s == shard => {}
                Some(s) => {
                    return Err(err(
                        file.path(),
                        field(),
                        format!(
                            "is in this shard, but the index's weight_map maps it to {}: the \
                             index does not match its shards",
                            shorten(s, 80)
                        ),
                    ));
                }
                None => {
                    return Err(err(
                        file.path(),
                        field(),
                        "is in this shard but not in the index's weight_map: the index does \
                         not match its shards",
                    ));
                }
            }
        }
    }
    if let Some((name, shard)) = index
        .weight_map
        .iter()
        .find(|(n, _)| !found.contains_key(n.as_str()))
    {
        return Err(err(
            path,
            format!("weight_map[{}]", shorten(name, 80)),
            format!(
                "maps the tensor to {}, whose header has no such tensor: the index does not \
                 match its shards",
                shorten(shard, 80)
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoint_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Checkpoint>();
    }

    #[test]
    fn reads_out_of_range_are_refused() {
        let ckpt = Checkpoint {
            path: PathBuf::new(),
            index: None,
            files: vec![],
            tensors: vec![],
            by_name: HashMap::new(),
        };
        assert!(ckpt.read(0, 0, 0).is_err());
    }
}
