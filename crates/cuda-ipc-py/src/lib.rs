//! `cuda_ipc._core`: the Python extension module of cuda-ipc.
//!
//! Every rule and every driver call is the Rust library's; the Python
//! package `cuda_ipc` (python/ in the repository) adds the torch and CuPy
//! conversions. Built with maturin from python/pyproject.toml.

mod alloc;
mod args;
mod codec;
mod dlpack;
mod errors;
mod exchange;
mod export;
mod keep;
mod mapping;
mod peers;
mod phases;
mod runs;
mod service;
mod sets;
mod state_dict;
mod torch_c;

use pyo3::prelude::*;

/// Whether the CUDA driver loads here (`libcuda.so.1`, CUDA 13.0 or newer,
/// and `CUDA_IPC_DISABLE_DRIVER` unset).
#[pyfunction]
fn driver_available() -> bool {
    cuda_ipc::driver::load().is_ok()
}

/// Loads the driver and returns its CUDA version as `(major, minor)`;
/// raises `DriverNotFound` with what to check when it cannot.
#[pyfunction]
fn driver_version() -> PyResult<(i32, i32)> {
    use errors::IntoPyResult;
    let v = cuda_ipc::driver::load().py()?;
    Ok((v.major(), v.minor()))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("DISABLE_DRIVER_ENV", cuda_ipc::driver::DISABLE_ENV)?;
    m.add_function(wrap_pyfunction!(driver_available, m)?)?;
    m.add_function(wrap_pyfunction!(driver_version, m)?)?;
    codec::register(m)?;
    mapping::register(m)?;
    export::register(m)?;
    exchange::register(m)?;
    sets::register(m)?;
    runs::register(m)?;
    alloc::register(m)?;
    #[cfg(feature = "test-hooks")]
    dlpack::register(m)?;
    torch_c::register(m)?;
    state_dict::register(m)?;
    service::register(m)?;
    phases::register(m)?;
    Ok(())
}
