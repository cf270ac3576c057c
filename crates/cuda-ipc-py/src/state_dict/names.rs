//! Entry names: the reserved prefixes under which a set carries what an
//! entry cannot hold as it is (empty and tied tensors), the longest name a
//! set takes, and keys quoted for messages as Python quotes them.

use cuda_ipc::set::MAX_SET_NAME_LEN;
use cuda_ipc::set::names::{ALIAS_PREFIX, EMPTY_PREFIX};
pub(super) use cuda_ipc::set::names::{EntryRole, RESERVED_PREFIX as RESERVED, alias_entry_name};
use cuda_ipc::{Error, Result};
use pyo3::prelude::*;

pub(super) fn invalid(what: &'static str, reason: String) -> Error {
    Error::InvalidArgument { what, reason }
}

pub(super) fn repr(s: &str) -> String {
    // Python's repr of a str for the messages (close enough: the keys of
    // a state dict are printable).
    if s.contains('\'') && !s.contains('"') {
        format!("\"{s}\"")
    } else {
        format!("'{}'", s.replace('\\', "\\\\").replace('\'', "\\'"))
    }
}

/// The entry name that carries the empty tensor `key` of `shape` (which
/// has a 0: the caller found no bytes in it).
pub(super) fn empty_name(key: &str, shape: &[i64]) -> Result<String> {
    let dims: Vec<u64> = shape
        .iter()
        .map(|&d| u64::try_from(d).unwrap_or(u64::MAX))
        .collect();
    cuda_ipc::set::names::empty_entry_name(key, &dims).ok_or_else(|| {
        invalid(
            "tensor",
            format!("{}: shape {shape:?} holds no bytes but has no 0", repr(key)),
        )
    })
}

pub(super) fn check_entry_name(key: &str, entry: &str) -> Result<()> {
    if entry.len() > MAX_SET_NAME_LEN {
        return Err(invalid(
            "state dict key",
            format!(
                "{}: the entry name is longer than the {MAX_SET_NAME_LEN} bytes a set takes",
                repr(key)
            ),
        ));
    }
    Ok(())
}

/// `_core.entry_role(name)`: what the set entry `name` stands for:
/// `("tensor", name)`, `("alias", index, key)` or `("empty", key, shape)`
/// (`cuda_ipc::set::names`, the one reading of these names).
#[pyfunction]
fn entry_role<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, pyo3::types::PyTuple>> {
    use pyo3::IntoPyObjectExt as _;
    let items = match EntryRole::of(name) {
        EntryRole::Tensor { key } => {
            vec!["tensor".into_bound_py_any(py)?, key.into_bound_py_any(py)?]
        }
        EntryRole::Alias { index, key } => vec![
            "alias".into_bound_py_any(py)?,
            index.into_bound_py_any(py)?,
            key.into_bound_py_any(py)?,
        ],
        EntryRole::Empty { key, shape } => vec![
            "empty".into_bound_py_any(py)?,
            key.into_bound_py_any(py)?,
            pyo3::types::PyTuple::new(py, shape)?.into_any(),
        ],
    };
    pyo3::types::PyTuple::new(py, items)
}

/// `_core.empty_entry_name(key, shape)`: the entry name of the empty
/// tensor `key` of `shape`, or `None` where `shape` has no 0.
#[pyfunction]
#[allow(clippy::needless_pass_by_value)] // pyo3 takes a Python sequence as a Vec
fn empty_entry_name(key: &str, shape: Vec<u64>) -> Option<String> {
    cuda_ipc::set::names::empty_entry_name(key, &shape)
}

/// `_core.alias_entry_name(index, key)`: the entry name that says `key`
/// is the tensor of entry `index`.
#[pyfunction(name = "alias_entry_name")]
fn py_alias_entry_name(index: usize, key: &str) -> String {
    alias_entry_name(index, key)
}

/// Registers the entry-name functions and prefixes.
pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("RESERVED_PREFIX", RESERVED)?;
    m.add("EMPTY_PREFIX", EMPTY_PREFIX)?;
    m.add("ALIAS_PREFIX", ALIAS_PREFIX)?;
    m.add("MAX_SET_NAME_LEN", MAX_SET_NAME_LEN)?;
    m.add_function(wrap_pyfunction!(entry_role, m)?)?;
    m.add_function(wrap_pyfunction!(empty_entry_name, m)?)?;
    m.add_function(wrap_pyfunction!(py_alias_entry_name, m)?)?;
    Ok(())
}
