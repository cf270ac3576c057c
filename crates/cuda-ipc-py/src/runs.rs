//! Few DLPack imports for many tensors.
//!
//! Making a torch tensor through DLPack costs about 10 µs in PyTorch
//! (`torch.from_dlpack` asks for the current stream and the device index in
//! Python), so a state dict of 1,000 entries took 10 ms that way. The
//! entries of an attached set lie in few mapped chunks, though: a *run* is
//! one stretch of one chunk that holds entries of one dtype whose distances
//! from the run's first byte are whole elements. Python imports each run
//! once and makes every entry with `torch.as_strided` over it (about 1 µs).
//! An entry that fits no run (its bytes are not its shape's, or it has
//! none) is left to the per-entry path.

use cuda_ipc::descriptor::Dtype;
use cuda_ipc::{Error, Result};
use pyo3::prelude::*;
use std::collections::HashMap;

use crate::errors::IntoPyResult;

/// What the planner needs of one entry.
#[derive(Debug, Clone)]
pub(crate) struct Placed {
    /// The local address of its chunk's first byte: one mapping, one chunk.
    pub(crate) chunk: u64,
    /// The chunk's size in bytes.
    pub(crate) chunk_size: u64,
    /// The local address of the entry's first byte.
    pub(crate) ptr: u64,
    pub(crate) len: u64,
    pub(crate) dtype: Dtype,
    pub(crate) shape: Vec<u64>,
}

/// A stretch of one chunk that one tensor covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Run {
    pub(crate) ptr: u64,
    /// In bytes, a whole number of elements.
    pub(crate) len: u64,
    pub(crate) dtype: Dtype,
}

/// Where an entry lies in its run: `offset` and `strides` in elements
/// (row-major, contiguous).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Place {
    pub(crate) run: usize,
    pub(crate) offset: u64,
    pub(crate) strides: Vec<u64>,
}

/// Contiguous row-major strides of `shape`, in elements; `None` when the
/// element count overflows.
fn strides_of(shape: &[u64]) -> Option<Vec<u64>> {
    let mut strides = vec![0; shape.len()];
    let mut step: u64 = 1;
    for (s, &d) in strides.iter_mut().zip(shape).rev() {
        *s = step;
        step = step.checked_mul(d)?;
    }
    Some(strides)
}

/// Whether `e` can be placed in a run: its bytes are exactly its shape's,
/// at least one, and inside its chunk.
fn placeable(e: &Placed) -> Option<Vec<u64>> {
    let size = e.dtype.size();
    let count = e.shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d))?;
    let end = e.ptr.checked_add(e.len)?;
    let chunk_end = e.chunk.checked_add(e.chunk_size)?;
    if e.len == 0 || count.checked_mul(size)? != e.len || e.ptr < e.chunk || end > chunk_end {
        return None;
    }
    strides_of(&e.shape)
}

/// The runs of `entries` and each entry's place in one (`None`: make that
/// entry on its own). Entries of a run share its chunk and dtype, and their
/// distances from the run's first byte are whole elements; a run spans from
/// its first entry's first byte to its last entry's last.
pub(crate) fn plan(entries: &[Placed]) -> (Vec<Run>, Vec<Option<Place>>) {
    // (chunk, dtype, phase) -> run index; the run's [start, end) grows.
    let mut index: HashMap<(u64, Dtype, u64), usize> = HashMap::new();
    let mut spans: Vec<(u64, u64, Dtype)> = Vec::new();
    let mut of: Vec<Option<(usize, Vec<u64>)>> = Vec::with_capacity(entries.len());
    for e in entries {
        let Some(strides) = placeable(e) else {
            of.push(None);
            continue;
        };
        let phase = (e.ptr - e.chunk) % e.dtype.size();
        let run = *index.entry((e.chunk, e.dtype, phase)).or_insert_with(|| {
            spans.push((e.ptr, e.ptr + e.len, e.dtype));
            spans.len() - 1
        });
        let span = &mut spans[run];
        span.0 = span.0.min(e.ptr);
        span.1 = span.1.max(e.ptr + e.len);
        of.push(Some((run, strides)));
    }
    let runs: Vec<Run> = spans
        .iter()
        .map(|&(start, end, dtype)| Run {
            ptr: start,
            len: end - start,
            dtype,
        })
        .collect();
    let places = of
        .into_iter()
        .zip(entries)
        .map(|(p, e)| {
            p.map(|(run, strides)| Place {
                run,
                offset: (e.ptr - runs[run].ptr) / e.dtype.size(),
                strides,
            })
        })
        .collect();
    (runs, places)
}

/// `[(ptr, len, dtype)]` of `runs`, for Python.
pub(crate) fn runs_tuples(runs: &[Run]) -> Vec<(u64, u64, &'static str)> {
    runs.iter()
        .map(|r| (r.ptr, r.len, r.dtype.name()))
        .collect()
}

/// `[(run, offset, strides) or None]` of `places`, for Python.
pub(crate) fn places_tuples(places: &[Option<Place>]) -> Vec<Option<(usize, u64, Vec<u64>)>> {
    places
        .iter()
        .map(|p| p.as_ref().map(|p| (p.run, p.offset, p.strides.clone())))
        .collect()
}

/// `_core.plan_runs(entries)`: the planner on its own, for the tests.
/// `entries`: `[(chunk, chunk_size, ptr, len, dtype, shape)]`; returns
/// `(runs, places)` as `SetAttachment.runs` does.
#[pyfunction]
#[allow(clippy::type_complexity)]
fn plan_runs(
    entries: Vec<(u64, u64, u64, u64, String, Vec<u64>)>,
) -> PyResult<(
    Vec<(u64, u64, &'static str)>,
    Vec<Option<(usize, u64, Vec<u64>)>>,
)> {
    let items = entries
        .into_iter()
        .map(|(chunk, chunk_size, ptr, len, dtype, shape)| {
            let dtype = dtype.parse::<Dtype>().map_err(|_| Error::InvalidArgument {
                what: "dtype",
                reason: format!("unknown dtype {dtype:?}"),
            })?;
            Ok(Placed {
                chunk,
                chunk_size,
                ptr,
                len,
                dtype,
                shape,
            })
        })
        .collect::<Result<Vec<_>>>()
        .py()?;
    let (runs, places) = plan(&items);
    Ok((runs_tuples(&runs), places_tuples(&places)))
}

/// Registers `plan_runs`.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(plan_runs, m)?)?;
    Ok(())
}
