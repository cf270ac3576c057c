//! State dicts through the DLPack C exchange API: one call publishes a
//! state dict, one attaches it, one checks an update, each looping over the
//! tensors here rather than in Python.
//!
//! The rules are those of `cuda_ipc.sets` (the path Python takes when the
//! framework has no exchange API): a tied tensor (the same view of the same
//! memory under two keys) is one entry and an alias entry
//! (`.cuda-ipc/alias/<index>/<key>`); an empty tensor travels as a
//! one-element entry named `.cuda-ipc/empty/<dims>/<key>`; a tensor already
//! in the publisher's arena is published where it is, any other is copied
//! into the arena (by Python's `copy_in`, on the framework's stream), as is
//! one whose range overlaps another's. Python keeps the rarely taken paths
//! (a refused dtype's message, the copies, empty tensors) and hands them in
//! as functions.
//!
//! Lifetimes: every tensor made for a subscriber holds the set's lease and
//! mappings ([`Keep`]) until its storage dies; the publisher's record holds
//! the tensors it returned and the arena buffers of the set.

mod attach;
mod names;
mod publish;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use cuda_ipc::arena::DeviceArenaBuffer;
use cuda_ipc::descriptor::Dtype;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};

use crate::errors::IntoPyResult;
use crate::torch_c::{Dims, TensorMeta, TorchExchange};

use names::{RESERVED, invalid, repr};

/// Arena buffers are placed at multiples of this.
const ALIGN: u64 = 256;

/// `(key, value)` of every item of a state dict, after the checks that
/// need no tensor (Python's `_check_items`).
fn items<'py>(state_dict: &Bound<'py, PyAny>) -> PyResult<Vec<(String, Bound<'py, PyAny>)>> {
    Ok(items_with_keys(state_dict)?
        .into_iter()
        .map(|g| (g.key, g.value))
        .collect())
}

/// An item of a state dict: its key, as text and as the Python string it
/// was (a dict made of these items reuses it, and its cached hash).
struct Given<'py> {
    key: String,
    key_obj: Bound<'py, PyString>,
    value: Bound<'py, PyAny>,
}

/// As [`items`], keeping each key's Python string.
fn items_with_keys<'py>(state_dict: &Bound<'py, PyAny>) -> PyResult<Vec<Given<'py>>> {
    let py = state_dict.py();
    let pairs: Vec<(Bound<'py, PyAny>, Bound<'py, PyAny>)> =
        if let Ok(d) = state_dict.cast::<PyDict>() {
            d.iter().collect()
        } else if state_dict.hasattr(intern!(py, "items"))? {
            state_dict
                .call_method0(intern!(py, "items"))?
                .try_iter()?
                .map(|kv| kv.and_then(|kv| kv.extract()))
                .collect::<PyResult<_>>()?
        } else {
            return Err(invalid(
                "state dict",
                format!(
                    "expected a state dict (a mapping of names to tensors), not {}",
                    state_dict.get_type().name()?
                ),
            ))
            .py();
        };
    if pairs.is_empty() {
        return Err(invalid(
            "state dict",
            "the state dict is empty; a set holds at least one tensor".to_owned(),
        ))
        .py();
    }
    pairs
        .into_iter()
        .map(|(k, v)| {
            let key_obj = k.cast::<PyString>().ok().cloned();
            // The string's own UTF-8 (kept by the object), copied once.
            let key = key_obj
                .as_ref()
                .map(|s| s.to_str().map(str::to_owned))
                .transpose()?
                .filter(|s| !s.is_empty());
            let (Some(key), Some(key_obj)) = (key, key_obj) else {
                return Err(invalid(
                    "state dict key",
                    format!(
                        "state dict keys must be non-empty strings, not {}",
                        k.repr()?
                    ),
                ))
                .py();
            };
            if key.starts_with(RESERVED) {
                return Err(invalid(
                    "state dict key",
                    format!(
                        "{}: keys starting with {} are reserved",
                        repr(&key),
                        repr(RESERVED)
                    ),
                ))
                .py();
            }
            Ok(Given {
                key,
                key_obj,
                value: v,
            })
        })
        .collect()
}

/// What Python hands in: the exchange API, the set's dtypes by torch dtype
/// object, and the functions of the rare paths.
struct Torch<'a, 'py> {
    api: &'a TorchExchange,
    /// torch dtype -> descriptor name.
    dtypes: &'a Bound<'py, PyDict>,
    /// `refuse(dtype, what)` raises `InvalidInput` for a dtype a set does
    /// not hold.
    refuse: &'a Bound<'py, PyAny>,
    /// The dtypes met so far, by their torch dtype object (a state dict
    /// holds a few): a look-up in `dtypes` and the name's parse once each.
    seen: std::cell::RefCell<Vec<(Py<PyAny>, Dtype)>>,
}

impl<'a, 'py> Torch<'a, 'py> {
    fn new(
        api: &'a TorchExchange,
        dtypes: &'a Bound<'py, PyDict>,
        refuse: &'a Bound<'py, PyAny>,
    ) -> Self {
        Torch {
            api,
            dtypes,
            refuse,
            seen: std::cell::RefCell::new(Vec::new()),
        }
    }

    /// The set dtype of the torch dtype object `dtype` of `key`'s tensor.
    fn dtype_of(&self, key: &str, dtype: &Bound<'py, PyAny>) -> PyResult<Dtype> {
        if let Some((_, dt)) = self.seen.borrow().iter().find(|(o, _)| dtype.is(o)) {
            return Ok(*dt);
        }
        let Some(name) = self.dtypes.get_item(dtype)? else {
            self.refuse.call1((dtype, repr(key)))?;
            return Err(invalid(
                "dtype",
                format!("{}: {dtype} is not held", repr(key)),
            ))
            .py();
        };
        let dt = crate::args::dtype(&name.extract::<String>()?).py()?;
        self.seen.borrow_mut().push((dtype.clone().unbind(), dt));
        Ok(dt)
    }
}

impl Torch<'_, '_> {
    /// The tensor `t` of `key`: its torch dtype object, set dtype and layout.
    fn read<'py>(
        &self,
        key: &str,
        t: &Bound<'py, PyAny>,
    ) -> PyResult<(Bound<'py, PyAny>, Dtype, TensorMeta)> {
        let py = t.py();
        if !t.is_instance(self.api.tensor_type(py))? {
            return Err(invalid(
                "state dict value",
                format!(
                    "{} is a {}, not a torch tensor",
                    repr(key),
                    t.get_type().name()?
                ),
            ))
            .py();
        }
        let dtype = t.getattr(intern!(py, "dtype"))?;
        let dt = self.dtype_of(key, &dtype)?;
        // The type was checked above.
        Ok((dtype, dt, self.api.read_known(t)?))
    }
}

/// What a published state dict keeps: the tensors it returned (in the
/// state dict's order, tied keys sharing one), their layouts, and the
/// arena buffers of the set. `Publisher.update_state_dict` checks a new
/// state dict against it (`changed`).
#[pyclass(module = "cuda_ipc._core", frozen)]
pub(crate) struct StateDictRecord {
    keys: Vec<String>,
    /// Position by key, made at the first update that passes a state dict.
    index: std::sync::OnceLock<HashMap<String, usize>>,
    tensors: Vec<Py<PyAny>>,
    dtypes: Vec<Py<PyAny>>,
    shapes: Vec<Dims>,
    ptrs: Vec<u64>,
    _buffers: Vec<Arc<DeviceArenaBuffer>>,
}

impl StateDictRecord {
    fn index(&self) -> &HashMap<String, usize> {
        self.index.get_or_init(|| {
            self.keys
                .iter()
                .enumerate()
                .map(|(i, k)| (k.clone(), i))
                .collect()
        })
    }
}

#[pymethods]
impl StateDictRecord {
    /// The published tensors, `{key: tensor}` in the state dict's order.
    #[getter]
    fn tensors<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, t) in self.keys.iter().zip(&self.tensors) {
            d.set_item(k, t)?;
        }
        Ok(d)
    }

    /// Checks `state_dict` against the published one (the same keys, each
    /// tensor of the same dtype and shape) and returns `[(published,
    /// new)]`, the tensors to copy: all but the empty ones and those that
    /// are the published tensor's memory, contiguous.
    fn changed<'py>(
        &self,
        state_dict: &Bound<'py, PyAny>,
        api: &TorchExchange,
        dtypes: &Bound<'py, PyDict>,
        refuse: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let py = state_dict.py();
        let given = items(state_dict)?;
        let have: HashSet<&str> = given.iter().map(|(k, _)| k.as_str()).collect();
        let missing: Vec<&String> = self
            .keys
            .iter()
            .filter(|k| !have.contains(k.as_str()))
            .collect();
        let extra: Vec<&String> = given
            .iter()
            .map(|(k, _)| k)
            .filter(|k| !self.index().contains_key(*k))
            .collect();
        if !missing.is_empty() || !extra.is_empty() {
            let list = |v: &[&String]| {
                let shown: Vec<String> = v.iter().take(5).map(|k| repr(k)).collect();
                let more = if v.len() > 5 { " ..." } else { "" };
                format!("[{}]{more}", shown.join(", "))
            };
            let mut parts = Vec::new();
            if !missing.is_empty() {
                parts.push(format!("missing {}", list(&missing)));
            }
            if !extra.is_empty() {
                parts.push(format!("unknown {}", list(&extra)));
            }
            return Err(invalid(
                "state dict",
                format!(
                    "the state dict does not have the keys of the published one: {}",
                    parts.join("; ")
                ),
            ))
            .py();
        }
        let torch = Torch::new(api, dtypes, refuse);
        let out = PyList::empty(py);
        for (key, src) in &given {
            let i = self.index()[key.as_str()];
            let (dtype, _, meta) = torch.read(key, src)?;
            let dst_dtype = self.dtypes[i].bind(py);
            if !dtype.is(dst_dtype) || meta.shape != self.shapes[i] {
                return Err(invalid(
                    "state dict value",
                    format!(
                        "{} is {dtype} {:?}; the published tensor is {dst_dtype} {:?}",
                        repr(key),
                        meta.shape,
                        self.shapes[i]
                    ),
                ))
                .py();
            }
            if meta.numel() == Some(0) || (meta.ptr == self.ptrs[i] && meta.is_contiguous()) {
                continue;
            }
            out.append((self.tensors[i].bind(py), src))?;
        }
        Ok(out)
    }
}

/// Registers the functions and `StateDictRecord`.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<StateDictRecord>()?;
    m.add_function(wrap_pyfunction!(publish::publish_state_dict_c, m)?)?;
    m.add_function(wrap_pyfunction!(attach::attach_state_dict_c, m)?)?;
    names::register(m)
}
