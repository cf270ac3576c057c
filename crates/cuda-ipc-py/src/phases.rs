//! `_core._last_phases(call)`: the phases of the last run of `call` on
//! this thread (`cuda_ipc::phases`), `[(phase, µs)]`: the extension's bulk
//! calls (`publish_state_dict`, `attach_set`, `attach_state_dict`,
//! `update_set`, `wait_update`) and `Subscriber(...)` (`subscriber`), and
//! the library's calls under them (`core.publish_set`, `core.attach_set`,
//! `core.update_set`, and `device.open` the first time a process uses a
//! device). `bench/attach_parts.py`, `bench/cuda_ipc_share.py` and
//! `bench/first_attach.py` print them.

use pyo3::prelude::*;

pub(crate) use cuda_ipc::phases::Phases;

/// `[(phase, µs)]` of the last run of `call` on this thread; empty before
/// its first run.
#[pyfunction]
#[pyo3(name = "_last_phases")]
fn last_phases(call: &str) -> Vec<(&'static str, f64)> {
    cuda_ipc::phases::last(call)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(last_phases, m)?)
}
