//! Loading a checkpoint onto the device and publishing it as a set.
//!
//! [`load_checkpoint`] follows a [`Plan`] of a [`Checkpoint`]:
//!
//! 1. **Memory.** One buffer of the publisher's arena per plan chunk
//!    ([`Publisher::alloc`]); each tensor lives at its planned offset in its
//!    chunk's buffer, which is how the set names it
//!    ([`SetMember::at`]).
//! 2. **Copies.** One new stream of the device's context per plan stream,
//!    each driven by its own host thread, with two page-locked staging
//!    buffers (`cuMemHostAlloc`, each as large as the stream's largest
//!    piece, at most [`PlanOptions::piece_size`]) and an event per buffer:
//!    a buffer is filled from the checkpoint (`pread`) only once the event
//!    recorded after its previous copy has passed, then copied with
//!    `cuMemcpyHtoDAsync`, so that filling one buffer overlaps the other's
//!    copy. The copy streams first wait for the work queued on the chunks'
//!    own streams. A piece that gathers rows (a tensor-parallel shard
//!    split along a dimension after the first: [`Gather`](crate::checkpoint::Gather))
//!    is read into a buffer of its stream's thread (one `pread`, at most
//!    a piece's size, reused), and its rows are gathered from there into
//!    the staging buffer.
//! 3. **Progress.** The callback hears (bytes copied, bytes in all), on the
//!    calling thread, as copies finish.
//! 4. **Publishing.** [`LoadedCheckpoint::publish`] publishes every tensor
//!    as a member of one set: the file's names, the checkpoint's dtypes and
//!    shapes (a shard's shapes, for a plan of a shard:
//!    [`load_plan_until`]). Every copy has finished (each stream synchronised) before the
//!    load returns, so the set's event covers them.
//!
//! # Errors and memory
//! Every driver call is checked. A failure while copying is an
//! [`Error::Load`] naming the file and the tensor; the other streams stop,
//! every copy already queued is waited for (by the loading threads, never
//! in a `Drop`), the staging buffers are freed and the arena buffers go
//! back to the arena. A [`LoadedCheckpoint`] holds its buffers; dropping it
//! (after publishing or not) returns them, once no set lease holds them.

mod schedule;
mod staging;

use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use crate::arena::{DeviceArenaBuffer, SetMember};
use crate::checkpoint::{Checkpoint, Plan, PlanOptions};
use crate::descriptor::Dtype;
use crate::error::{Error, Result, from_cudarc};
use crate::exchange::Publisher;
use crate::memory::DeviceMemory;

/// A checkpoint copied into a publisher's arena: its buffers (one per plan
/// chunk) and what the load did.
#[derive(Debug)]
pub struct LoadedCheckpoint {
    buffers: Vec<DeviceArenaBuffer>,
    tensors: Vec<LoadedTensor>,
    report: LoadReport,
}

/// One tensor of a [`LoadedCheckpoint`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LoadedTensor {
    /// Its name, as in the file.
    pub name: String,
    /// Its element type.
    pub dtype: Dtype,
    /// Its dimensions in elements (a tensor-parallel shard's, for a load
    /// of one).
    pub shape: Vec<u64>,
    /// The buffer holding it: an index into [`LoadedCheckpoint::buffers`].
    pub buffer: usize,
    /// Bytes from the buffer's start.
    pub offset: u64,
    /// Its length in bytes.
    pub len: u64,
}

/// What a load did.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct LoadReport {
    /// Tensors loaded.
    pub tensors: usize,
    /// Files read.
    pub files: usize,
    /// Bytes of tensors copied.
    pub payload_bytes: u64,
    /// Bytes of arena buffers allocated (tensors aligned in their chunks).
    pub allocated_bytes: u64,
    /// Streams copied on.
    pub streams: usize,
    /// Copies made (pieces of the plan).
    pub pieces: usize,
    /// The time from the first allocation until every copy had finished.
    pub elapsed: Duration,
}

impl LoadReport {
    /// Bytes of tensors per second (10^9 bytes per GB).
    pub fn gb_per_s(&self) -> f64 {
        gb_per_s(self.payload_bytes, self.elapsed)
    }
}

impl LoadedCheckpoint {
    /// The arena buffers, one per plan chunk.
    pub fn buffers(&self) -> &[DeviceArenaBuffer] {
        &self.buffers
    }

    /// Every tensor and where it lives, in the checkpoint's order.
    pub fn tensors(&self) -> &[LoadedTensor] {
        &self.tensors
    }

    /// What the load did.
    pub fn report(&self) -> &LoadReport {
        &self.report
    }

    /// Publishes every tensor as one set called `name` on `publisher`
    /// (the publisher whose arena holds the buffers): the members are the
    /// file's tensors, in the checkpoint's order.
    ///
    /// # Errors
    /// The checkpoint holds no tensor; `publisher` is another publisher
    /// than the load's; the set's errors ([`Publisher::publish_set`]).
    pub fn publish(&self, publisher: &Publisher, name: &str) -> Result<()> {
        if self.tensors.is_empty() {
            return Err(Error::arg(
                "checkpoint",
                "it holds no tensor, so there is no set to publish",
            ));
        }
        let members: Vec<SetMember<'_>> = self
            .tensors
            .iter()
            .map(|t| {
                SetMember::new(&t.name, t.dtype, &t.shape, &self.buffers[t.buffer]).at(t.offset)
            })
            .collect();
        publisher.publish_set(name, &members)
    }
}

/// `bytes` over `elapsed`, in GB/s (10^9 bytes); 0 for no time.
pub(crate) fn gb_per_s(bytes: u64, elapsed: Duration) -> f64 {
    let s = elapsed.as_secs_f64();
    if s > 0.0 { bytes as f64 / s / 1e9 } else { 0.0 }
}

/// Refuses, before anything is allocated, a checkpoint that cannot be
/// published as one set: one with no tensor, or with an empty tensor (a
/// dimension of 0: a set's entries hold at least one byte, and the entry
/// names that carry empty tensors for Python's state dicts are not part of
/// the set record Rust reads).
///
/// # Errors
/// [`Error::Checkpoint`] naming the checkpoint and the tensor.
pub fn check_publishable(ckpt: &Checkpoint) -> Result<()> {
    let refuse = |field: String, reason: String| Error::Checkpoint {
        file: ckpt.path().to_path_buf(),
        field,
        reason,
    };
    if ckpt.tensors().is_empty() {
        return Err(refuse(
            "tensors".into(),
            "it holds no tensor, so there is no set to publish or compare".into(),
        ));
    }
    if let Some(t) = ckpt.tensors().iter().find(|t| t.shape.contains(&0)) {
        return Err(refuse(
            t.name.clone(),
            format!(
                "the tensor has no element (shape {:?}), and a set cannot carry an empty \
                 tensor; drop it from the checkpoint (or publish the state dict from Python, \
                 which carries empty tensors)",
                t.shape
            ),
        ));
    }
    Ok(())
}

/// Copies `ckpt` into `publisher`'s arena following its plan with
/// `options` (see the module docs), calling `progress(done, total)` with
/// bytes of tensors as copies finish. Returns once every copy has finished.
///
/// # Errors
/// The plan's errors (before any allocation); the arena's (a publisher
/// configured isolated, out of memory); a copy's, as [`Error::Load`] naming
/// the file and the tensor. Nothing stays allocated after an error.
pub fn load_checkpoint(
    publisher: &Publisher,
    ckpt: &Checkpoint,
    options: &PlanOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<LoadedCheckpoint> {
    load_checkpoint_until(publisher, ckpt, options, progress, &AtomicBool::new(false))
}

/// [`load_checkpoint`], stopped early once `stop` is set: each stream looks
/// before each piece (a piece is at most [`PlanOptions::piece_size`]
/// bytes), so a stop takes at most one piece's read and copy per stream.
///
/// # Errors
/// [`load_checkpoint`]'s, and an [`Error::Io`] (`Interrupted`) for a load
/// stopped; nothing stays allocated after either.
pub fn load_checkpoint_until(
    publisher: &Publisher,
    ckpt: &Checkpoint,
    options: &PlanOptions,
    progress: &mut dyn FnMut(u64, u64),
    stop: &AtomicBool,
) -> Result<LoadedCheckpoint> {
    check_publishable(ckpt)?;
    let plan = ckpt.plan(options)?;
    load_plan_until(publisher, ckpt, &plan, progress, stop)
}

/// [`load_checkpoint_until`] following `plan`, a plan of `ckpt`'s tensors
/// ([`Checkpoint::plan`], or [`Checkpoint::plan_shard`] for one
/// tensor-parallel rank's shard: the tensors loaded are then the shard's,
/// with its shapes).
///
/// # Errors
/// [`load_checkpoint_until`]'s, and an invalid argument for a plan of
/// another list of tensors.
pub fn load_plan_until(
    publisher: &Publisher,
    ckpt: &Checkpoint,
    plan: &Plan,
    progress: &mut dyn FnMut(u64, u64),
    stop: &AtomicBool,
) -> Result<LoadedCheckpoint> {
    check_publishable(ckpt)?;
    if plan.placements().len() != ckpt.tensors().len() {
        return Err(Error::arg(
            "load plan",
            format!(
                "a plan of {} tensors for a checkpoint of {}",
                plan.placements().len(),
                ckpt.tensors().len()
            ),
        ));
    }
    let options = plan.options();
    let arena = publisher.arena()?;
    let device = arena.backing().device().clone();
    let started = Instant::now();
    let mut buffers = Vec::with_capacity(plan.chunks().len());
    for chunk in plan.chunks() {
        buffers.push(publisher.alloc(chunk.len)?);
    }
    device.bind()?;
    let streams = (0..options.streams)
        .map(|_| device.context().new_stream())
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| from_cudarc("cuStreamCreate", e))?;
    // The copies come after whatever the chunks' streams queued.
    for b in &buffers {
        let queued = b
            .stream()
            .record_event(None)
            .map_err(|e| from_cudarc("cuEventRecord", e))?;
        for s in &streams {
            s.wait(&queued)
                .map_err(|e| from_cudarc("cuStreamWaitEvent", e))?;
        }
    }
    copy_all(&device, ckpt, plan, &buffers, &streams, progress, stop)?;
    let elapsed = started.elapsed();
    Ok(LoadedCheckpoint {
        tensors: tensors_of(ckpt, plan),
        report: LoadReport {
            tensors: ckpt.tensors().len(),
            files: ckpt.files().len(),
            payload_bytes: plan.payload_bytes(),
            allocated_bytes: plan.total_bytes(),
            streams: streams.len(),
            pieces: plan.pieces().len(),
            elapsed,
        },
        buffers,
    })
}

/// Runs every stream's copy on its own thread; reports progress here.
fn copy_all(
    device: &crate::device::Device,
    ckpt: &Checkpoint,
    plan: &Plan,
    buffers: &[DeviceArenaBuffer],
    streams: &[std::sync::Arc<cudarc::driver::CudaStream>],
    progress: &mut dyn FnMut(u64, u64),
    stop: &AtomicBool,
) -> Result<()> {
    let job = staging::Job {
        stop,
        device,
        ckpt,
        plan,
        chunks: buffers
            .iter()
            .map(|b| (b.device_address(), b.byte_len()))
            .collect(),
        abort: AtomicBool::new(false),
    };
    crate::pinned::on_stream_threads(
        streams.len(),
        plan.payload_bytes(),
        progress,
        "load",
        |i, done| staging::copy_stream(&job, i, &streams[i], done),
    )
}

/// Every tensor of `ckpt` and its place and shape in `plan`.
fn tensors_of(ckpt: &Checkpoint, plan: &Plan) -> Vec<LoadedTensor> {
    plan.placements()
        .iter()
        .map(|p| {
            let t = &ckpt.tensors()[p.tensor];
            LoadedTensor {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: plan.shapes()[p.tensor].clone(),
                buffer: p.chunk,
                offset: p.offset,
                len: p.len,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use cudarc::driver::DriverError;
    use cudarc::driver::sys::CUresult;

    use crate::error::{Error, ErrorKind, from_cudarc};

    fn driver_error(call: &'static str, result: CUresult) -> Error {
        from_cudarc(call, DriverError(result))
    }

    #[test]
    fn a_load_error_names_the_file_and_tensor_and_keeps_its_cause() {
        let e = Error::Load {
            file: "/m/model-00002-of-00003.safetensors".into(),
            tensor: "model.layers.3.mlp.up_proj.weight".into(),
            source: Box::new(driver_error(
                "cuMemcpyHtoDAsync",
                CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,
            )),
        };
        let text = e.to_string();
        assert!(text.contains("model-00002-of-00003.safetensors"), "{text}");
        assert!(text.contains("model.layers.3.mlp.up_proj.weight"), "{text}");
        assert!(text.contains("cuMemcpyHtoDAsync"), "{text}");
        assert_eq!(
            e.driver_result(),
            Some(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS)
        );
        assert_eq!(
            e.kind(),
            driver_error("x", CUresult::CUDA_ERROR_ILLEGAL_ADDRESS).kind()
        );
        let bad = Error::Load {
            file: "f".into(),
            tensor: "t".into(),
            source: Box::new(Error::arg("x", "y")),
        };
        assert_eq!(bad.kind(), ErrorKind::InvalidInput);
    }
}
