//! Arguments checked where they enter from Python, before anything is
//! loaded or allocated, so that a bad one is an `InvalidInput` (a
//! `CudaIpcError`, also a `ValueError`) with the library's kind of sentence,
//! never pyo3's `OverflowError` or `TypeError`, and never "no driver" for a
//! mistake the command-line tool reports as bad input (exit 2).

use std::time::Duration;

use cuda_ipc::channel;
use cuda_ipc::descriptor::{Dtype, Mechanism};
use cuda_ipc::exchange::Endpoint;
use cuda_ipc::{Error, Result};
use pyo3::exceptions::PyOverflowError;
use pyo3::prelude::*;
use pyo3::types::PyBool;

use crate::errors::to_py;

/// A CUDA device ordinal (`device=`): a non-negative `int`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ordinal(pub usize);

impl FromPyObject<'_, '_> for Ordinal {
    type Error = PyErr;
    fn extract(obj: Borrowed<'_, '_, PyAny>) -> PyResult<Self> {
        whole(
            obj,
            "device",
            "a device ordinal: 0, 1, ... (`cuda_ipc.device_count()` says how many)",
        )
        .map(Ordinal)
    }
}

/// A user id (an element of `allow_uids=`): an `int` from 0 to 2**32 - 2.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Uid(pub u32);

impl FromPyObject<'_, '_> for Uid {
    type Error = PyErr;
    fn extract(obj: Borrowed<'_, '_, PyAny>) -> PyResult<Self> {
        let uid: u32 = whole(
            obj,
            "allow_uids",
            "a user id: 0 to 4294967294 (`os.getuid()` gives yours)",
        )?;
        if uid == u32::MAX {
            // (uid_t)-1 means "no user" to the kernel.
            return Err(invalid(
                obj.py(),
                "allow_uids",
                "4294967295 is (uid_t)-1, which names no user; expected a user id: 0 to \
                 4294967294 (`os.getuid()` gives yours)"
                    .into(),
            ));
        }
        Ok(Uid(uid))
    }
}

/// A non-negative whole-number argument of a method, checked as
/// [`Ordinal`] is: `$ty(pub $inner)` named `$what` in errors.
macro_rules! whole_argument {
    ($(#[$doc:meta])* $ty:ident($inner:ty), $what:literal, $expected:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug)]
        pub(crate) struct $ty(pub $inner);

        impl FromPyObject<'_, '_> for $ty {
            type Error = PyErr;
            fn extract(obj: Borrowed<'_, '_, PyAny>) -> PyResult<Self> {
                whole(obj, $what, $expected).map($ty)
            }
        }
    };
}

whole_argument!(
    /// A size in bytes (`nbytes=`).
    Nbytes(u64),
    "nbytes",
    "a size in bytes: 1 or more"
);
whole_argument!(
    /// A ring's number of slots (`slots=`).
    Slots(usize),
    "slots",
    "a number of slots: 1 or more"
);
whole_argument!(
    /// A ring slot's size in bytes (`slot_bytes=`).
    SlotBytes(usize),
    "slot_bytes",
    "a size in bytes: 1 or more"
);
whole_argument!(
    /// An index into a set's entries (`index=`).
    Index(usize),
    "index",
    "an entry index: 0, 1, ... (len(record[\"entries\"]) of them)"
);

/// The user ids of `allow_uids=`.
pub(crate) fn uids(list: Vec<Uid>) -> Vec<u32> {
    list.into_iter().map(|u| u.0).collect()
}

/// Checks `endpoint` as the channel will read it (a path if it contains a
/// `/`, else a name in the private socket directory): a name as `cuda-ipc
/// serve --socket` and `attach --socket` check it.
pub(crate) fn check_endpoint(py: Python<'_>, endpoint: &str) -> PyResult<()> {
    if let Endpoint::Name(name) = Endpoint::from(endpoint)
        && let Err(err) = channel::validate_socket_name(&name)
    {
        let reason = match err {
            channel::ChannelError::InvalidName { reason, .. } => reason,
            other => other.to_string(),
        };
        return Err(invalid(
            py,
            "endpoint",
            format!(
                "{} is not a socket name: {reason}; or give a path containing a /",
                cuda_ipc::units::shorten(&name, 40)
            ),
        ));
    }
    Ok(())
}

/// The `InvalidInput` exception for argument `what`.
fn invalid(py: Python<'_>, what: &'static str, reason: String) -> PyErr {
    to_py(py, &Error::InvalidArgument { what, reason })
}

/// A whole number (an `int`, or anything with `__index__`) in `T`'s range;
/// `expected` says what is accepted.
fn whole<T: TryFrom<i64>>(
    obj: Borrowed<'_, '_, PyAny>,
    what: &'static str,
    expected: &str,
) -> PyResult<T> {
    let py = obj.py();
    let shown = || {
        let repr = obj
            .repr()
            .map_or_else(|_| "the value".into(), |r| r.to_string());
        match repr.char_indices().nth(40) {
            Some((cut, _)) => format!("{}...", &repr[..cut]),
            None => repr,
        }
    };
    if obj.is_instance_of::<PyBool>() {
        return Err(invalid(
            py,
            what,
            format!("{} is a bool, not {expected}", shown()),
        ));
    }
    let n = match obj.extract::<i64>() {
        Ok(n) => n,
        Err(e) if e.is_instance_of::<PyOverflowError>(py) => {
            return Err(invalid(
                py,
                what,
                format!("{} is too large; expected {expected}", shown()),
            ));
        }
        Err(_) => {
            let kind = obj
                .get_type()
                .name()
                .map_or_else(|_| "value".into(), |n| n.to_string());
            return Err(invalid(
                py,
                what,
                format!("{} is a {kind}, not {expected}", shown()),
            ));
        }
    };
    if n < 0 {
        return Err(invalid(
            py,
            what,
            format!("{n} is negative; expected {expected}"),
        ));
    }
    T::try_from(n).map_err(|_| invalid(py, what, format!("{n} is too large; expected {expected}")))
}

/// A timeout in seconds; `None` is a year (a wait without end, that a
/// deadline computation cannot overflow).
pub(crate) fn duration(seconds: Option<f64>) -> Result<Duration> {
    match seconds {
        None => Ok(Duration::from_secs(365 * 86_400)),
        Some(s) if s.is_finite() && (0.0..=1e9).contains(&s) => Ok(Duration::from_secs_f64(s)),
        Some(s) => Err(Error::InvalidArgument {
            what: "timeout",
            reason: format!("{s} is not a number of seconds between 0 and 1e9"),
        }),
    }
}

/// A sharing mechanism by name; `None` or `auto`: the best here.
pub(crate) fn mechanism(name: Option<&str>) -> Result<Option<Mechanism>> {
    name.filter(|n| *n != "auto").map(str::parse).transpose()
}

/// An element type by its descriptor, NumPy or PyTorch name (`torch.`
/// prefix allowed).
pub(crate) fn dtype(name: &str) -> Result<Dtype> {
    let name = name.strip_prefix("torch.").unwrap_or(name);
    name.parse::<Dtype>()
        .or_else(|_| cuda_ipc::torch::dtype_from_torch(name))
}
