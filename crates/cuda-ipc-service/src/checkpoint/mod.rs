//! Checkpoints: safetensors files read for loading onto the GPU.
//!
//! The reader and the planner of the checkpoint loader, with no CUDA call:
//!
//! - [`Checkpoint::open`] opens a single `.safetensors` file, a Hugging Face
//!   sharded checkpoint (its `model.safetensors.index.json`, [`ShardIndex`]),
//!   or a directory holding either. Each file is opened through its
//!   descriptor (regular files only, decided on `fstat` of the descriptor
//!   that is read, never on the path: the `file` module) and only its
//!   header is read ([`FileHeader`], checked strictly and read by the
//!   `safetensors` crate); tensor bytes are read with `pread` when asked for
//!   ([`Checkpoint::read_into`], [`Checkpoint::bytes`]), never mapped.
//! - [`Checkpoint::open_with`] opens for someone else: its [`ReadPolicy`]
//!   decides on each file's owner and mode before a byte of it is read, and
//!   on the checkpoint's size before any header is parsed (the weight
//!   service's access rule and quota, [`crate::service`]).
//! - The element types are this crate's [`Dtype`]: every
//!   safetensors type has one except the 6-bit floats (table in [`dtype`]).
//!   A type that cannot be carried is refused when the checkpoint is
//!   opened, naming the tensor and the type, before anything is allocated.
//! - [`Plan`] lays the tensors out in arena-style chunks (each tensor at a
//!   multiple of [`DEFAULT_ALIGNMENT`](crate::arena::DEFAULT_ALIGNMENT) by
//!   default, as the arena places buffers) and splits the copy into
//!   staging pieces of a bounded size assigned round-robin to streams:
//!   each piece is a file range and the place in a chunk it goes to, and
//!   the pieces cover every tensor byte exactly once.
//! - [`Checkpoint::plan_shard`] plans the load of one tensor-parallel
//!   rank's shard ([`TpShard`], the [`tp`] module): each tensor split
//!   along the dimension its rules give, or whole.
//!
//! # The contract
//! - **Names** are the file's, byte for byte. A name appears once in a
//!   checkpoint: in one shard, and in the index's `weight_map` pointing at
//!   that shard.
//! - **Validation** is strict and every error is an
//!   [`Error::Checkpoint`] naming the file and
//!   the field: a missing shard, a name in two shards, a `weight_map` entry
//!   that its shard's header lacks (or a header tensor the index does not
//!   map there), overlapping, gapped or out-of-file data offsets, a shard
//!   path that leaves the checkpoint's directory, a file that is not
//!   safetensors, a file that is not a regular file (a FIFO, a device: it
//!   is not even opened for reading).
//! - **Limits**, each checked on the open file's length or the header's
//!   8-byte length before the bytes are read: an index of at most
//!   [`MAX_INDEX_BYTES`] naming at most [`MAX_SHARDS`] shards, a header of
//!   at most [`MAX_HEADER_BYTES`], the headers of one checkpoint together
//!   at most [`MAX_HEADER_BYTES_TOTAL`]. Opening reads nothing else, so
//!   its time and memory are bounded whatever the files are.
//! - **Files may change while open**, and that is safe: every read is a
//!   `pread` bounded by the length the file had when it was opened, so a
//!   file truncated meanwhile is an [`Error::Checkpoint`] naming it (a
//!   reader over a memory map, safetensors' own or PyTorch's, would take
//!   `SIGBUS`), and a file rewritten meanwhile gives its new bytes. Write
//!   checkpoints to a new file and rename it, as Hugging Face's tools do.
//! - **Threads.** A [`Checkpoint`] is `Send + Sync`: copies on several
//!   threads read its files at once (`pread` moves no file offset).
//!
//! ```no_run
//! use cuda_ipc_service::checkpoint::{Checkpoint, PlanOptions};
//!
//! # fn main() -> cuda_ipc_core::Result<()> {
//! let ckpt = Checkpoint::open("/models/qwen2")?;
//! let plan = ckpt.plan(&PlanOptions::default())?;
//! println!(
//!     "{} tensors, {} bytes in {} chunks, {} pieces",
//!     ckpt.tensors().len(),
//!     plan.total_bytes(),
//!     plan.chunks().len(),
//!     plan.pieces().len()
//! );
//! for piece in plan.pieces() {
//!     let bytes = ckpt.read(piece.file, piece.file_offset, piece.len)?;
//!     // ... copy `bytes` into chunk `piece.chunk` at `piece.chunk_offset`
//!     // on stream `piece.stream`.
//! #   let _ = bytes;
//! }
//! # Ok(())
//! # }
//! ```

pub mod dtype;
mod file;
mod header;
mod index;
mod open;
mod plan;
pub mod tp;

use std::ops::Range;
use std::path::Path;

pub use file::{AnyReadable, FileMeta, ReadPolicy};
pub use header::{FileHeader, MAX_HEADER_BYTES, MAX_HEADER_BYTES_TOTAL};
pub use index::{MAX_INDEX_BYTES, MAX_SHARDS, ShardIndex};
pub use open::{Checkpoint, CheckpointFile, INDEX_NAME, SINGLE_NAME};
pub use plan::{Chunk, Gather, MAX_PIECES, Piece, Placement, Plan, PlanOptions};
pub use tp::{TpRule, TpShard, shard_name};

use crate::descriptor::Dtype;
use crate::error::Error;

/// One tensor of a checkpoint: where its bytes are and what they are.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorEntry {
    /// The name, as in the file.
    pub name: String,
    /// The element type.
    pub dtype: Dtype,
    /// Dimensions, in elements of `dtype` (for `f4e2m1fnx2`, bytes of two
    /// values: the file's last dimension halved).
    pub shape: Vec<u64>,
    /// Which file of the checkpoint holds the bytes (an index into
    /// [`Checkpoint::files`]).
    pub file: usize,
    /// The bytes, as offsets in that file (not in its data section).
    pub range: Range<u64>,
}

impl TensorEntry {
    /// The tensor's length in bytes.
    pub fn len(&self) -> u64 {
        self.range.end.saturating_sub(self.range.start)
    }

    /// Whether the tensor has no bytes (a dimension of 0).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// An [`Error::Checkpoint`].
pub(crate) fn err(file: &Path, field: impl Into<String>, reason: impl Into<String>) -> Error {
    Error::Checkpoint {
        file: file.to_path_buf(),
        field: field.into(),
        reason: reason.into(),
    }
}
