//! Attaching a state dict: a tensor made through the exchange API for
//! every entry of an attached set, each holding the set's lease, with the
//! dict keys of recently attached layouts kept for reuse
//! (`_core.attach_state_dict_c`).

use std::sync::Arc;

use cuda_ipc::descriptor::Dtype;
use cuda_ipc::set::{MAX_SET_DIMS, SetEntry};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyTuple};

use crate::errors::{IntoPyResult, closed_error};
use crate::keep::Keep;
use crate::phases::Phases;
use crate::sets::SetAttachment;
use crate::torch_c::{TorchExchange, as_bytes, fill_contiguous_strides};

use super::names::{EntryRole, invalid, repr};

/// Makes the tensors of an attached set's entries through the exchange
/// API: each holds `keep` (the set's lease).
pub(super) struct Maker<'a> {
    api: &'a TorchExchange,
    keep: Keep,
    ordinal: usize,
    shape: [i64; MAX_SET_DIMS],
    strides: [i64; MAX_SET_DIMS],
}

impl Maker<'_> {
    /// The tensor of entry `e`, as `target` (its torch dtype).
    fn tensor<'py>(
        &mut self,
        py: Python<'py>,
        e: &SetEntry,
        ptr: u64,
        target: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let count = e.shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
        let fits = count
            .and_then(|c| c.checked_mul(e.dtype.size()))
            .is_some_and(|b| b <= e.len);
        if !fits
            || e.shape.len() > MAX_SET_DIMS
            || e.shape.iter().any(|&d| i64::try_from(d).is_err())
        {
            return Err(invalid(
                "set entry",
                format!(
                    "{}: shape {:?} of {} does not fit in its {} bytes",
                    repr(&e.name),
                    e.shape,
                    e.dtype,
                    e.len
                ),
            ))
            .py();
        }
        // At most MAX_SET_DIMS dimensions, each within i64 (checked above).
        let n = e.shape.len();
        for (s, &d) in self.shape.iter_mut().zip(&e.shape) {
            *s = d as i64;
        }
        fill_contiguous_strides(&self.shape[..n], &mut self.strides[..n]);
        let bytes = as_bytes(e.dtype);
        let at = crate::torch_c::At {
            ptr,
            ordinal: self.ordinal,
            dtype: crate::dlpack::data_type(e.dtype, bytes),
            shape: &self.shape[..n],
            strides: &self.strides[..n],
        };
        let t = self.api.make(py, self.keep.clone(), &at)?.into_bound(py);
        if bytes {
            t.call_method1(intern!(py, "view"), (target,))
        } else {
            Ok(t)
        }
    }
}

/// The torch dtype of each set dtype met so far (a set holds a few), from
/// the dict Python hands in.
pub(super) struct Targets<'a, 'py> {
    dtypes: &'a Bound<'py, PyDict>,
    seen: Vec<(Dtype, Bound<'py, PyAny>)>,
}

impl<'py> Targets<'_, 'py> {
    fn of(&mut self, dt: Dtype) -> PyResult<Bound<'py, PyAny>> {
        if let Some((_, t)) = self.seen.iter().find(|(d, _)| *d == dt) {
            return Ok(t.clone());
        }
        let t = self
            .dtypes
            .get_item(dt.name())?
            .ok_or_else(|| invalid("dtype", format!("unknown dtype {}", dt.name())))
            .py()?;
        if let Ok(missing) = t.cast::<PyString>() {
            return Err(invalid(
                "dtype",
                format!("this PyTorch has no torch.{missing}"),
            ))
            .py();
        }
        self.seen.push((dt, t.clone()));
        Ok(t)
    }
}

/// The dict keys made for the entries of the sets attached last, by their
/// entries (the last [`KEPT_KEYS`] layouts): a set attached again in a
/// layout its subscriber kept (the same entries, shared:
/// `Subscriber::entry_tables`) gets the same key strings, their hashes
/// made already, instead of new ones.
static KEYS: std::sync::Mutex<Vec<(Arc<[SetEntry]>, Keys)>> = std::sync::Mutex::new(Vec::new());

/// The dict keys of a set's entries, in the entries' order.
type Keys = Arc<Vec<Py<PyString>>>;

/// How many layouts' keys [`KEYS`] holds (two: double-buffered weights).
const KEPT_KEYS: usize = 2;

/// The keys kept for `entries`, if any.
pub(super) fn kept_keys(entries: &Arc<[SetEntry]>) -> Option<Keys> {
    let kept = crate::errors::lock(&KEYS);
    kept.iter()
        .find(|(e, _)| Arc::ptr_eq(e, entries))
        .map(|(_, k)| Arc::clone(k))
}

/// Keeps `keys` for `entries`, the least recently kept going first.
pub(super) fn keep_keys(entries: &Arc<[SetEntry]>, keys: Vec<Py<PyString>>) {
    let mut kept = crate::errors::lock(&KEYS);
    kept.insert(0, (Arc::clone(entries), Arc::new(keys)));
    kept.truncate(KEPT_KEYS);
}

/// `_core.attach_state_dict_c(attachment, out, api, dtypes, empty)`: fills
/// the dict `out` with a tensor of every entry of the set `attachment`
/// (a `SetAttachment`), each holding its lease; tied keys get the same
/// tensor, empty entries `empty(shape, dtype)`. `dtypes` maps descriptor
/// names to torch dtypes (or, for a type this PyTorch lacks, its name).
#[pyfunction]
pub(super) fn attach_state_dict_c(
    attachment: &Bound<'_, SetAttachment>,
    out: &Bound<'_, PyDict>,
    api: &TorchExchange,
    dtypes: &Bound<'_, PyDict>,
    empty: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let mut phases = Phases::start("attach_state_dict");
    let py = attachment.py();
    let a = attachment.get();
    let keep = crate::errors::lock(&a.keep)
        .clone()
        .ok_or_else(|| closed_error("set", "attach it again"))?;
    let mut maker = Maker {
        api,
        keep,
        ordinal: a.ordinal,
        shape: [0; MAX_SET_DIMS],
        strides: [0; MAX_SET_DIMS],
    };
    let mut targets = Targets {
        dtypes,
        seen: Vec::new(),
    };
    let mut keys: Vec<Bound<'_, PyString>> = Vec::with_capacity(a.ptrs.len());
    let before = out.len();
    let entries = a.set_entries();
    let kept = kept_keys(entries);
    // The entry's key: kept, or made from `key` (its name or the key its
    // name carries).
    let key_of = |i: usize, key: &str| match &kept {
        Some(k) => k[i].bind(py).clone(),
        None => PyString::new(py, key),
    };
    for (i, (e, &ptr)) in entries.iter().zip(&a.ptrs).enumerate() {
        let target = targets.of(e.dtype)?;
        let (key, value) = match EntryRole::of(&e.name) {
            EntryRole::Alias { index, key } => {
                let Some(first) = keys.get(index) else {
                    return Err(invalid(
                        "set entry",
                        format!(
                            "{}: {} is an alias of entry {index}, which is not before it",
                            repr(&a.name),
                            repr(key)
                        ),
                    ))
                    .py();
                };
                let v = out
                    .get_item(first)?
                    .ok_or_else(|| invalid("set entry", format!("{} is gone", repr(key))))
                    .py()?;
                (key_of(i, key), v)
            }
            EntryRole::Empty { key, shape } => (
                key_of(i, key),
                empty.call1((PyTuple::new(py, shape)?, &target))?,
            ),
            EntryRole::Tensor { .. } => (key_of(i, &e.name), maker.tensor(py, e, ptr, &target)?),
        };
        out.set_item(&key, value)?;
        if out.len() == before + keys.len() {
            // The key replaced an earlier one (the caller clears the dict).
            return Err(invalid(
                "set entry",
                format!(
                    "{} holds {} twice",
                    repr(&a.name),
                    repr(&key.extract::<String>()?)
                ),
            ))
            .py();
        }
        keys.push(key);
    }
    if kept.is_none() {
        keep_keys(entries, keys.into_iter().map(Bound::unbind).collect());
    }
    phases.mark("entries");
    Ok(())
}
