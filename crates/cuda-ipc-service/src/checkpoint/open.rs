//! Opening a checkpoint: finding its files, opening them through their
//! descriptors (`file`), reading and checking their headers and the index,
//! within the limits, before any tensor byte is read.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use super::file::{
    AnyReadable, Kind, PathFd, ReadFile, ReadPolicy, list_dir, open_parent, open_path,
};
use super::header::{LEN_BYTES, header_len, parse_prefix};
use super::{
    FileHeader, MAX_HEADER_BYTES_TOTAL, MAX_INDEX_BYTES, MAX_SHARDS, Plan, PlanOptions, ShardIndex,
    TensorEntry, TpShard, err,
};
use crate::error::{Error, Result};
use crate::units::shorten;

/// The single-file checkpoint's name in a Hugging Face model directory.
pub const SINGLE_NAME: &str = "model.safetensors";
/// The sharded checkpoint's index name in a Hugging Face model directory.
pub const INDEX_NAME: &str = "model.safetensors.index.json";

/// One file of a checkpoint, open for reading (`pread`), with its
/// validated header.
#[derive(Debug)]
pub struct CheckpointFile {
    path: PathBuf,
    file: ReadFile,
    data_start: u64,
    metadata: BTreeMap<String, String>,
}

impl CheckpointFile {
    /// The file's path (the index's directory joined with the shard's name,
    /// or the path given).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's length in bytes, when it was opened.
    pub fn len(&self) -> u64 {
        self.file.len()
    }

    /// Whether the file is empty (never, for a file that opened).
    pub fn is_empty(&self) -> bool {
        self.file.len() == 0
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

/// An opened checkpoint: its files open for reading, its headers
/// validated, its tensors listed (no tensor byte read yet).
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
    /// Any regular file this process may read opens: [`Checkpoint::open_with`]
    /// opens for someone else.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] naming the file and what was wrong.
    pub fn open(path: impl AsRef<Path>) -> Result<Checkpoint> {
        Checkpoint::open_with(path, &AnyReadable)
    }

    /// [`Checkpoint::open`], asking `policy` before each file (and the
    /// directory searched) is read, on the `fstat` of its descriptor, and
    /// once the checkpoint's size is known, before any header is parsed.
    ///
    /// # Errors
    /// [`Checkpoint::open`]'s, and the policy's refusals.
    pub fn open_with(path: impl AsRef<Path>, policy: &dyn ReadPolicy) -> Result<Checkpoint> {
        let given = path.as_ref();
        let fd = open_path(given)?;
        if fd.meta().is_dir {
            let (name, found) = find_in_dir(&fd, given, policy)?;
            let path = given.join(&name);
            if path.extension().is_some_and(|e| e == "json") {
                open_sharded(path, &found, &fd, policy)
            } else {
                open_single(path, &found, policy)
            }
        } else if given.extension().is_some_and(|e| e == "json") {
            let dir = open_parent(given)?;
            open_sharded(given.to_path_buf(), &fd, &dir, policy)
        } else {
            open_single(given.to_path_buf(), &fd, policy)
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

    /// The checkpoint's files; [`TensorEntry::file`] indexes this.
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

    /// The bytes of `tensor` (one of [`Checkpoint::tensors`]), read from
    /// its file (the page cache, or the disk).
    ///
    /// # Errors
    /// As [`Checkpoint::read_into`].
    pub fn bytes(&self, tensor: &TensorEntry) -> Result<Vec<u8>> {
        self.read(tensor.file, tensor.range.start, tensor.len())
    }

    /// `len` bytes of file `file` from `offset` (a [`Piece`](super::Piece)'s
    /// source), read into a new buffer.
    ///
    /// # Errors
    /// As [`Checkpoint::read_into`].
    pub fn read(&self, file: usize, offset: u64, len: u64) -> Result<Vec<u8>> {
        let f = self.file(file)?;
        Error::check_range(offset, len, f.len())?;
        let len = usize::try_from(len)
            .map_err(|_| Error::arg("read length", "larger than this machine's address space"))?;
        let mut buf = vec![0; len];
        f.file.read_at(&f.path, offset, &mut buf)?;
        Ok(buf)
    }

    /// Fills `buf` with the bytes of file `file` from `offset` (`pread`):
    /// the way the loader reads into its staging buffers.
    ///
    /// # Errors
    /// An invalid argument for a file the checkpoint does not have,
    /// [`Error::OutOfBounds`] for a range outside the file as it was
    /// opened, and an [`Error::Checkpoint`] naming the file when it has
    /// become shorter since (truncated while it is read) or cannot be read.
    pub fn read_into(&self, file: usize, offset: u64, buf: &mut [u8]) -> Result<()> {
        let f = self.file(file)?;
        f.file.read_at(&f.path, offset, buf)
    }

    fn file(&self, file: usize) -> Result<&CheckpointFile> {
        self.files.get(file).ok_or_else(|| {
            Error::arg(
                "checkpoint file",
                format!("{file}, but the checkpoint has {} files", self.files.len()),
            )
        })
    }

    /// The plan of a load of every tensor ([`Plan::new`]).
    pub fn plan(&self, options: &PlanOptions) -> Result<Plan> {
        Plan::new(&self.tensors, options)
    }

    /// The plan of a load of `shard`'s share of every tensor
    /// ([`Plan::for_shard`]); a tensor it cannot split is an
    /// [`Error::Checkpoint`] naming its file and the tensor, and what to do.
    pub fn plan_shard(&self, options: &PlanOptions, shard: &TpShard) -> Result<Plan> {
        Plan::build(&self.tensors, options, Some(shard), &|t, why| {
            let file = self
                .files
                .get(t.file)
                .map_or(self.path.as_path(), |f| f.path.as_path());
            super::err(
                file,
                t.name.clone(),
                format!(
                    "tensor-parallel rank {} of {}: {why}",
                    shard.rank(),
                    shard.world()
                ),
            )
        })
    }
}

/// The checkpoint file in directory `dir` (listed only if `policy` lets
/// it be): its name and its descriptor.
fn find_in_dir(dir: &PathFd, shown: &Path, policy: &dyn ReadPolicy) -> Result<(String, PathFd)> {
    policy.may_read(shown, dir.meta())?;
    for name in [SINGLE_NAME, INDEX_NAME] {
        match dir.open_under(Path::new(name), &shown.join(name)) {
            Ok(fd) => return Ok((name.to_string(), fd)),
            Err(_) if !exists_under(dir, name) => {}
            Err(e) => return Err(e),
        }
    }
    let mut indexes = Vec::new();
    let mut singles = Vec::new();
    for name in list_dir(dir, shown, policy)? {
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
        [one] => {
            let fd = dir.open_under(Path::new(one), &shown.join(one))?;
            Ok((one.clone(), fd))
        }
        [] => Err(err(
            shown,
            "directory",
            format!(
                "holds no {SINGLE_NAME}, {INDEX_NAME}, *.safetensors.index.json or \
                 *.safetensors file: not a checkpoint directory"
            ),
        )),
        many => Err(err(
            shown,
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

/// Whether `name` names anything under `dir` (a dangling link does not).
fn exists_under(dir: &PathFd, name: &str) -> bool {
    dir.exists_under(Path::new(name))
}

/// A file opened for reading and its header's length, read and checked
/// (the 8 bytes that start it).
struct Prefixed {
    path: PathBuf,
    file: ReadFile,
    header_len: u64,
}

impl Prefixed {
    fn open(path: PathBuf, fd: &PathFd, policy: &dyn ReadPolicy) -> Result<Prefixed> {
        let file = ReadFile::open(fd, &path, Kind::Tensors, policy)?;
        let mut first = [0u8; LEN_BYTES as usize];
        let got = if file.len() >= LEN_BYTES {
            file.read_at(&path, 0, &mut first)?;
            Some(first)
        } else {
            None
        };
        let header_len = header_len(&path, got, file.len())?;
        Ok(Prefixed {
            path,
            file,
            header_len,
        })
    }

    /// The bytes after the header.
    fn data_bytes(&self) -> u64 {
        self.file.len() - LEN_BYTES - self.header_len
    }

    /// Reads and validates the header.
    fn finish(self) -> Result<(CheckpointFile, Vec<TensorEntry>)> {
        let len = usize::try_from(LEN_BYTES + self.header_len).map_err(|_| {
            err(
                &self.path,
                "header length",
                "larger than this machine's memory",
            )
        })?;
        let mut bytes = vec![0; len];
        self.file.read_at(&self.path, 0, &mut bytes)?;
        let header: FileHeader = parse_prefix(&self.path, &bytes, self.file.len())?;
        let file = CheckpointFile {
            path: self.path,
            file: self.file,
            data_start: header.data_start,
            metadata: header.metadata,
        };
        Ok((file, header.tensors))
    }
}

/// Asks `policy` about the files' data bytes, within the limit of their
/// headers' total, then reads their headers.
fn finish_all(
    path: &Path,
    files: Vec<Prefixed>,
    policy: &dyn ReadPolicy,
) -> Result<Vec<(CheckpointFile, Vec<TensorEntry>)>> {
    let headers: u64 = files.iter().map(|f| f.header_len).sum();
    if headers > MAX_HEADER_BYTES_TOTAL {
        return Err(err(
            path,
            "headers",
            format!(
                "its {} files' headers take {headers} bytes, more than the limit of \
                 {MAX_HEADER_BYTES_TOTAL} for one checkpoint: not a checkpoint, or a damaged one",
                files.len()
            ),
        ));
    }
    policy.may_load(files.iter().map(Prefixed::data_bytes).sum())?;
    files.into_iter().map(Prefixed::finish).collect()
}

fn open_single(path: PathBuf, fd: &PathFd, policy: &dyn ReadPolicy) -> Result<Checkpoint> {
    let file = Prefixed::open(path.clone(), fd, policy)?;
    let mut opened = finish_all(&path, vec![file], policy)?;
    let (file, tensors) = opened.pop().expect("one file");
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

fn open_sharded(
    path: PathBuf,
    fd: &PathFd,
    dir: &PathFd,
    policy: &dyn ReadPolicy,
) -> Result<Checkpoint> {
    let file = ReadFile::open(fd, &path, Kind::Index, policy)?;
    if file.len() > MAX_INDEX_BYTES {
        return Err(err(
            &path,
            "file",
            format!(
                "{} bytes, more than the limit of {MAX_INDEX_BYTES} for an index: not a \
                 checkpoint index",
                file.len()
            ),
        ));
    }
    let mut text = vec![0; usize::try_from(file.len()).unwrap_or(usize::MAX)];
    file.read_at(&path, 0, &mut text)?;
    drop(file);
    let index = ShardIndex::parse(&path, &text)?;
    drop(text);
    let opened = open_shards(&path, &index, dir, policy)?;
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

/// Opens every shard the index names (under `dir`, the index's directory)
/// and reads its header.
fn open_shards<'a>(
    path: &Path,
    index: &'a ShardIndex,
    dir: &PathFd,
    policy: &dyn ReadPolicy,
) -> Result<Vec<Shard<'a>>> {
    let shown_dir = path.parent().unwrap_or(Path::new("."));
    let shards = index.shards();
    if shards.len() > MAX_SHARDS {
        return Err(err(
            path,
            "weight_map",
            format!(
                "names {} shard files, more than the limit of {MAX_SHARDS}: not a checkpoint \
                 index, or merge its shards",
                shards.len()
            ),
        ));
    }
    let mut prefixed = Vec::with_capacity(shards.len());
    for &shard in &shards {
        let shard_path = shown_dir.join(shard);
        let fd = match dir.open_under(Path::new(shard), &shard_path) {
            Ok(fd) => fd,
            Err(_) if !exists_under(dir, shard) => {
                return Err(missing_shard(path, index, shard, shown_dir));
            }
            Err(e) => return Err(e),
        };
        prefixed.push(Prefixed::open(shard_path, &fd, policy)?);
    }
    let opened = finish_all(path, prefixed, policy)?;
    Ok(shards
        .into_iter()
        .zip(opened)
        .map(|(shard, (file, header))| (shard, file, header))
        .collect())
}

fn missing_shard(path: &Path, index: &ShardIndex, shard: &str, dir: &Path) -> Error {
    let named: Vec<&str> = index
        .weight_map
        .iter()
        .filter(|(_, s)| *s == shard)
        .map(|(n, _)| n.as_str())
        .collect();
    err(
        path,
        "weight_map",
        format!(
            "missing shard {}: the index maps {} tensors to it (first {}), and no such file is \
             in {}; download the whole checkpoint",
            shorten(shard, 80),
            named.len(),
            shorten(named.first().copied().unwrap_or(""), 80),
            dir.display()
        ),
    )
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
