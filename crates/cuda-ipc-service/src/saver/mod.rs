//! Saving an attached set as a safetensors checkpoint: a standard file that
//! any tool reads back (`safetensors`, PyTorch, transformers, this crate's
//! loader and `serve --service --restore`).
//!
//! [`save_set`] writes what a [`SetAttachment`] maps, while its lease holds
//! the version still: nothing pauses the set's other readers or a writer
//! of its next version (a service's writer writes a staging version, never
//! the committed one a saver holds).
//!
//! 1. **The file.** The header is built first (the `safetensors` crate's
//!    own header type; tensors ordered as `safetensors` orders them,
//!    widest type first, then by name), and the file's whole length is
//!    made in a hidden temporary file beside the destination, mapped
//!    shared where it can be. Its length is reserved first (`fallocate`: a
//!    full disk is an error before any copy), except on tmpfs, whose
//!    pages each thread allocates for its own pieces (`MADV_POPULATE_WRITE`:
//!    a full tmpfs is an error, never a `SIGBUS`).
//! 2. **Copies.** The tensors' bytes are split into pieces of at most
//!    [`SaveOptions::piece_size`], dealt round-robin to
//!    [`SaveOptions::streams`] new streams. Each stream's thread copies a
//!    piece from the device into one of its two page-locked staging
//!    buffers (`cuMemcpyDtoHAsync`) and copies the other buffer's piece
//!    into the file's mapping meanwhile: the threads write at once, where
//!    `pwrite` would take the file's lock for each piece (it is the way
//!    where the file cannot be mapped). The streams first wait for the work
//!    the device's stream holds for the set (its event or fence).
//! 3. **The end.** The file is flushed to the disk (`fsync`) and renamed
//!    to the destination, then the directory is flushed: the destination
//!    holds the whole checkpoint or nothing new. An existing destination
//!    is refused unless [`SaveOptions::overwrite`] (checked first, and
//!    again atomically at the rename).
//!
//! A set's tied tensors (a second key for an earlier tensor's memory) are
//! left out, as safetensors files carry each tensor's bytes once
//! (`save_model` in safetensors does the same); empty tensors are kept.
//! A tensor whose type has no safetensors form (`c128`) is refused by
//! name before the file is created.
//!
//! ```no_run
//! use cuda_ipc_core::Device;
//! use cuda_ipc_exchange::exchange::{Subscriber, SubscriberConfig};
//! use cuda_ipc_service::saver::{SaveOptions, save_set};
//!
//! let device = Device::open(0)?;
//! let subscriber = Subscriber::connect(&device, "weights", SubscriberConfig::default())?;
//! let set = subscriber.attach_set("model")?;
//! let report = save_set(&device, &set, "/ckpt/model.safetensors".as_ref(),
//!                       &SaveOptions::default(), &mut |_, _| {})?;
//! println!("{} bytes at {:.1} GB/s", report.payload_bytes, report.gb_per_s());
//! # Ok::<(), cuda_ipc_core::Error>(())
//! ```

mod copy;
mod layout;
mod output;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use crate::device::Device;
use crate::error::{Error, Result, from_cudarc};
use crate::exchange::SetAttachment;

/// How a save copies and what it writes.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SaveOptions {
    /// Streams (each with its thread and two staging buffers), 1 to 64.
    pub streams: usize,
    /// The largest piece copied and written at once, and so each staging
    /// buffer's size: 64 KiB to 1 GiB.
    pub piece_size: u64,
    /// Replace an existing file at the destination.
    pub overwrite: bool,
    /// The header's `__metadata__` strings (`format` is `pt` unless given).
    pub metadata: BTreeMap<String, String>,
}

impl Default for SaveOptions {
    fn default() -> Self {
        SaveOptions {
            streams: 4,
            piece_size: 16 << 20,
            overwrite: false,
            metadata: BTreeMap::new(),
        }
    }
}

impl SaveOptions {
    /// With `streams` streams.
    #[must_use]
    pub fn with_streams(mut self, streams: usize) -> Self {
        self.streams = streams;
        self
    }

    /// With pieces of at most `bytes`.
    #[must_use]
    pub fn with_piece_size(mut self, bytes: u64) -> Self {
        self.piece_size = bytes;
        self
    }

    /// Replacing an existing file, or not.
    #[must_use]
    pub fn with_overwrite(mut self, overwrite: bool) -> Self {
        self.overwrite = overwrite;
        self
    }

    /// With the metadata string `key` = `value` in the header.
    #[must_use]
    pub fn with_metadata(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.metadata.insert(key.into(), value.into());
        self
    }

    /// Checks the bounds above.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the option.
    pub fn validate(&self) -> Result<()> {
        if !(1..=64).contains(&self.streams) {
            return Err(Error::arg(
                "streams",
                format!("{} is outside 1 to 64", self.streams),
            ));
        }
        if !(64 << 10..=1 << 30).contains(&self.piece_size) {
            return Err(Error::arg(
                "piece size",
                format!("{} bytes is outside 64 KiB to 1 GiB", self.piece_size),
            ));
        }
        Ok(())
    }
}

/// What a save did.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct SaveReport {
    /// The file written.
    pub path: PathBuf,
    /// Tensors in the file.
    pub tensors: usize,
    /// Tied tensors left out.
    pub aliases: usize,
    /// Bytes of tensors copied.
    pub payload_bytes: u64,
    /// The file's length.
    pub file_bytes: u64,
    /// Streams copied on.
    pub streams: usize,
    /// Pieces copied.
    pub pieces: usize,
    /// From the file's creation until it was renamed into place, flushed.
    pub elapsed: Duration,
    /// Of `elapsed`: creating the file, reserving its length and writing
    /// the header.
    pub reserve: Duration,
    /// Of `elapsed`: the copies and the writes.
    pub copy: Duration,
    /// Of `elapsed`: flushing the file to the disk and renaming it.
    pub flush: Duration,
    /// Whether the pieces went into the file through a shared mapping
    /// (copied by every stream's thread at once), not `pwrite` (one at a
    /// time: the file's lock); see [`save_set`].
    pub mapped: bool,
}

impl SaveReport {
    /// Bytes of tensors per second (10^9 bytes per GB).
    pub fn gb_per_s(&self) -> f64 {
        crate::loader::gb_per_s(self.payload_bytes, self.elapsed)
    }
}

/// Saves `set` (attached on `device`) as the safetensors file `path` (see
/// the module docs), calling `progress(done, total)` with bytes of tensors
/// as pieces reach the file. Returns once the file is in place.
///
/// # Errors
/// Bad options; a tensor with no safetensors form; a destination that
/// exists (unless overwriting), names no file or whose directory is
/// missing; a full disk; a copy or a write that failed, as [`Error::Save`]
/// naming the file and the tensor. No file is left behind after an error.
pub fn save_set(
    device: &Device,
    set: &SetAttachment,
    path: &Path,
    options: &SaveOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<SaveReport> {
    options.validate()?;
    let mut metadata = options.metadata.clone();
    metadata
        .entry("format".into())
        .or_insert_with(|| "pt".into());
    let layout = layout::layout(set.entries(), &metadata)?;
    let places = set.entry_places()?;
    let addresses = layout
        .tensors
        .iter()
        .map(|t| places[t.entry].address)
        .collect();
    let pieces = layout::pieces(&layout, options.piece_size, options.streams);
    let started = Instant::now();
    let out = output::Output::create(path, layout.file_len, options.overwrite)?;
    out.write_at(&layout.header, 0)?;
    let reserve = started.elapsed();
    device.bind()?;
    let streams = (0..options.streams)
        .map(|_| device.context().new_stream())
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| from_cudarc("cuStreamCreate", e))?;
    // The copies come after what the device's stream holds for the set
    // (the wait on its event or fence).
    let ready = device
        .stream()
        .record_event(None)
        .map_err(|e| from_cudarc("cuEventRecord", e))?;
    for s in &streams {
        s.wait(&ready)
            .map_err(|e| from_cudarc("cuStreamWaitEvent", e))?;
    }
    let job = copy::Job {
        device,
        layout: &layout,
        addresses,
        out: &out,
        abort: AtomicBool::new(false),
    };
    let total: u64 = layout.tensors.iter().map(|t| t.len).sum();
    crate::pinned::on_stream_threads(streams.len(), total, progress, "save", |i, done| {
        copy::save_stream(&job, &pieces[i], &streams[i], done)
    })?;
    let copied = started.elapsed();
    let mapped = out.is_mapped();
    out.finish()?;
    Ok(SaveReport {
        path: path.to_path_buf(),
        tensors: layout.tensors.len(),
        aliases: layout.aliases,
        payload_bytes: total,
        file_bytes: layout.file_len,
        streams: streams.len(),
        pieces: pieces.iter().map(Vec::len).sum(),
        elapsed: started.elapsed(),
        reserve,
        copy: copied.saturating_sub(reserve),
        flush: started.elapsed().saturating_sub(copied),
        mapped,
    })
}
