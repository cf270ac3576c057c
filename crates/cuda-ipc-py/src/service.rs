//! The weight service's calls from Python (`cuda_ipc.service`): a call
//! on a new connection for the admin functions (`load`, `ls`, `stats`,
//! `drop`: no driver, no device), and on a subscriber's own connection for
//! a writer (`Subscriber.call`, in `exchange/subscriber.rs`: the session's
//! lock is that connection). Bodies and answers travel as JSON text; the
//! service's refusals are `cuda_ipc.errors.ServiceError` with its `code`.

use cuda_ipc::Result;
use cuda_ipc::channel::{Client, ClientConfig};
use cuda_ipc::exchange::Endpoint;
use pyo3::prelude::*;

use crate::args::{Uid, duration, uids};
use crate::errors::IntoPyResult;

/// Parses a call's body (JSON text).
pub(crate) fn body(text: &str) -> Result<serde_json::Value> {
    serde_json::from_str(text).map_err(|e| cuda_ipc::Error::InvalidArgument {
        what: "call body",
        reason: format!("not JSON: {e}"),
    })
}

/// Calls `method` of the service at `endpoint` with `body` (JSON text) on
/// a connection of its own, waiting up to `timeout` seconds; returns the
/// answer as JSON text.
#[pyfunction]
#[pyo3(signature = (endpoint, method, body_json, *, timeout=5.0, allow_uids=Vec::new()))]
fn service_call(
    py: Python<'_>,
    endpoint: &str,
    method: &str,
    body_json: &str,
    timeout: Option<f64>,
    allow_uids: Vec<Uid>,
) -> PyResult<String> {
    crate::args::check_endpoint(py, endpoint)?;
    let timeout = duration(timeout).py()?;
    let body = body(body_json).py()?;
    let allow = uids(allow_uids);
    py.detach(|| -> Result<String> {
        let path = Endpoint::from(endpoint).path()?;
        let mut config = ClientConfig::default().with_timeout(timeout.min(CONNECT_TIMEOUT));
        config.allowed_server_uids.extend(allow);
        let client = Client::connect(path, config)?;
        Ok(client.call_within(method, &body, timeout)?.to_string())
    })
    .py()
}

/// How long connecting waits, whatever the call's timeout (a load's is
/// minutes).
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Registers this module's function.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(service_call, m)?)
}
