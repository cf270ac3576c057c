//! The library's [`Error`] as a Python exception of `cuda_ipc.errors`.
//!
//! The classes are defined in Python (so that they can inherit from both
//! `CudaIpcError` and a built-in such as `ValueError` or `TimeoutError`);
//! this module picks the class for an error and fills its attributes. The
//! message is the error's one sentence, the same the command-line tool
//! prints after `cuda-ipc: error:`.

use std::sync::{Mutex, PoisonError};

use cuda_ipc::{Error, ErrorKind};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

/// The class name in `cuda_ipc.errors` of an error kind.
fn kind_class(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::Unavailable => "Unavailable",
        ErrorKind::InvalidInput => "InvalidInput",
        ErrorKind::Peer => "PeerGone",
        ErrorKind::Timeout => "Timeout",
        _ => "Failed",
    }
}

/// The name of an error kind as Python code sees it (`CudaIpcError.kind`).
pub(crate) fn kind_name(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::Unavailable => "unavailable",
        ErrorKind::InvalidInput => "invalid_input",
        ErrorKind::Peer => "peer",
        ErrorKind::Timeout => "timeout",
        _ => "failed",
    }
}

/// Builds the Python exception for `e`.
pub(crate) fn to_py(py: Python<'_>, e: &Error) -> PyErr {
    match build(py, e) {
        Ok(err) => err,
        // The errors module could not be imported (a broken install): the
        // message still gets through.
        Err(_) => PyRuntimeError::new_err(e.to_string()),
    }
}

fn build(py: Python<'_>, e: &Error) -> PyResult<PyErr> {
    let errors = py.import("cuda_ipc.errors")?;
    let kind = e.kind();
    let mut attrs: Vec<(&str, Py<PyAny>)> = Vec::new();
    let class = match e {
        Error::DriverNotFound { .. } | Error::DriverTooOld { .. } => "DriverNotFound",
        Error::NoDevice { .. } => "NoDevice",
        Error::Unsupported { .. } => "Unsupported",
        Error::Descriptor { field, reason } => {
            attrs.push(("field", field.into_pyobject(py)?.into_any().unbind()));
            attrs.push(("reason", reason.into_pyobject(py)?.into_any().unbind()));
            "DescriptorError"
        }
        Error::Channel(cuda_ipc::channel::ChannelError::Remote { code, .. }) => {
            attrs.push(("code", code.into_pyobject(py)?.into_any().unbind()));
            "ServiceError"
        }
        Error::Torch(reason) => {
            attrs.push(("reason", reason.into_pyobject(py)?.into_any().unbind()));
            "TorchRecordError"
        }
        Error::Driver {
            call,
            code,
            name,
            hint,
            ..
        } => {
            attrs.push(("call", call.into_pyobject(py)?.into_any().unbind()));
            attrs.push(("code", code.into_pyobject(py)?.into_any().unbind()));
            attrs.push(("name", name.into_pyobject(py)?.into_any().unbind()));
            attrs.push(("hint", hint.into_pyobject(py)?.into_any().unbind()));
            match kind {
                ErrorKind::Unavailable => "DriverUnavailable",
                ErrorKind::InvalidInput => "DriverInvalidInput",
                ErrorKind::Peer => "DriverPeerGone",
                ErrorKind::Timeout => "DriverTimeout",
                _ => "DriverError",
            }
        }
        Error::SameProcess => {
            // What the driver answers, for callers that test the code.
            attrs.push((
                "call",
                "cuIpcOpenMemHandle".into_pyobject(py)?.into_any().unbind(),
            ));
            attrs.push(("code", 201i32.into_pyobject(py)?.into_any().unbind()));
            attrs.push((
                "name",
                "CUDA_ERROR_INVALID_CONTEXT"
                    .into_pyobject(py)?
                    .into_any()
                    .unbind(),
            ));
            "SameProcess"
        }
        _ => kind_class(kind),
    };
    let value = errors.getattr(class)?.call1((e.to_string(),))?;
    value.setattr("kind", kind_name(kind))?;
    for (k, v) in attrs {
        value.setattr(k, v)?;
    }
    Ok(PyErr::from_value(value))
}

/// `Result<T, Error>` into `PyResult<T>`.
pub(crate) trait IntoPyResult<T> {
    /// The error, if any, as its Python exception.
    fn py(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for cuda_ipc::Result<T> {
    fn py(self) -> PyResult<T> {
        self.map_err(|e| Python::attach(|py| to_py(py, &e)))
    }
}

/// A mutex's guard; a poisoned mutex (a panic while it was held) is used
/// as it is.
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The error for a use of a closed object.
pub(crate) fn closed_error(what: &'static str, then: &str) -> PyErr {
    Python::attach(|py| {
        to_py(
            py,
            &Error::InvalidArgument {
                what,
                reason: format!("it is closed or released; {then}"),
            },
        )
    })
}
