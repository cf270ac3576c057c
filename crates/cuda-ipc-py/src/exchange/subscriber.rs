//! The subscriber's methods: `Subscriber` (list, attach, attach sets and
//! rings, close).

use std::sync::{Arc, Mutex};

use cuda_ipc::exchange::{Endpoint, Reconnect, Subscriber, SubscriberConfig};
use cuda_ipc::memory::DeviceMemory;
use cuda_ipc::{Access, Result};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use super::attachment::Attachment;
use super::rings::{Ring, RingShared};
use crate::args::duration;
use crate::errors::{IntoPyResult, lock};
use crate::keep::Keep;
use crate::mapping::Layout;
use crate::peers::PySubscriber;

#[pymethods]
impl PySubscriber {
    /// Connects to the publisher at `endpoint` (a name or a path); requests
    /// time out after `timeout` seconds. With `read_only`, everything this
    /// subscriber attaches is mapped read-only (VMM memory only).
    /// `reconnect`: whether it connects again when the publisher's process
    /// ends (`None`: when the publisher says another process serves after
    /// it, as the weight service under its keeper does).
    #[new]
    #[pyo3(signature = (endpoint, *, device=crate::args::Ordinal(0), timeout=5.0, allow_uids=Vec::new(), read_only=false, reconnect=None))]
    fn new(
        py: Python<'_>,
        endpoint: &str,
        device: crate::args::Ordinal,
        timeout: f64,
        allow_uids: Vec<crate::args::Uid>,
        read_only: bool,
        reconnect: Option<bool>,
    ) -> PyResult<Self> {
        let reconnect = match reconnect {
            None => Reconnect::IfPublisherRestarts,
            Some(true) => Reconnect::Always,
            Some(false) => Reconnect::Never,
        };
        let timeout = duration(Some(timeout)).py()?;
        crate::args::check_endpoint(py, endpoint)?;
        let allow_uids = crate::args::uids(allow_uids);
        let (sub, dev) = py
            .detach(|| -> Result<_> {
                let mut phases = crate::phases::Phases::start("subscriber");
                let dev = crate::mapping::device(device.0)?;
                phases.mark("device");
                let config = SubscriberConfig::default()
                    .with_timeout(timeout)
                    .with_allow_uids(allow_uids)
                    .with_access(Access::read_only_if(read_only))
                    .with_reconnect(reconnect);
                let sub = Subscriber::connect(&dev, Endpoint::from(endpoint), config)?;
                phases.mark("connect");
                Ok((sub, dev))
            })
            .py()?;
        Ok(PySubscriber {
            inner: Mutex::new(Some(Arc::new(sub))),
            device: dev,
        })
    }

    /// Saves the current version of the service's set `name` as the
    /// safetensors file `path` (a directory: the file named after the set
    /// in it), from this process (`cuda_ipc::service::save`); what it did
    /// as JSON text.
    #[pyo3(signature = (name, path, *, overwrite=false, streams=None, staging=None))]
    fn save_set(
        &self,
        py: Python<'_>,
        name: &str,
        path: &str,
        overwrite: bool,
        streams: Option<usize>,
        staging: Option<u64>,
    ) -> PyResult<String> {
        let s = self.get()?;
        let defaults = cuda_ipc::saver::SaveOptions::default();
        let options = defaults
            .clone()
            .with_overwrite(overwrite)
            .with_streams(streams.unwrap_or(defaults.streams))
            .with_piece_size(staging.unwrap_or(defaults.piece_size));
        let device = self.device.clone();
        py.detach(|| -> Result<String> {
            let path = std::path::Path::new(path);
            let saved = cuda_ipc::service::save(&s, &device, name, path, &options, &mut |_, _| {})?;
            Ok(saved.to_json().to_string())
        })
        .py()
    }

    /// The names published now.
    fn list(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        let s = self.get()?;
        py.detach(|| s.list()).py()
    }

    /// Calls `method` of the publisher's call handler (a service's) with
    /// `body_json` on this subscriber's connection, waiting up to `timeout`
    /// seconds (`None`: the subscriber's timeout); the answer as JSON text.
    #[pyo3(signature = (method, body_json, timeout=None))]
    fn call(
        &self,
        py: Python<'_>,
        method: &str,
        body_json: &str,
        timeout: Option<f64>,
    ) -> PyResult<String> {
        let s = self.get()?;
        let timeout = timeout.map(|t| duration(Some(t))).transpose().py()?;
        let body = crate::service::body(body_json).py()?;
        py.detach(|| s.call(method, &body, timeout).map(|v| v.to_string()))
            .py()
    }

    /// Whether the publisher is still there (does not block, does not
    /// connect again).
    fn is_alive(&self) -> PyResult<bool> {
        Ok(self.get()?.is_alive())
    }

    /// Whether it connects again when the publisher's process ends.
    #[getter]
    fn reconnects(&self) -> PyResult<bool> {
        Ok(self.get()?.reconnects())
    }

    /// Makes sure the connection is up: connects again if it ended, takes
    /// back the leases of what it holds where the publisher still serves
    /// it; what it did as JSON text (`connected`, `retaken`,
    /// `old_versions`, `not_retaken`, `chunks`, `chunks_unleased`).
    fn reconnect(&self, py: Python<'_>) -> PyResult<String> {
        let s = self.get()?;
        let done = py.detach(|| s.reconnect()).py()?;
        Ok(serde_json::json!({
            "connected": done.connected,
            "retaken": done.retaken,
            "old_versions": done.old_versions,
            "not_retaken": done.not_retaken,
            "chunks": done.chunks,
            "chunks_unleased": done.chunks_unleased,
        })
        .to_string())
    }

    /// Steps aside from the service's set `name` for a write in place
    /// (`cuda_ipc::service::step_aside`: the mappings must sleep already;
    /// a reconnect steps aside again on the new connection until
    /// `come_back`); the service's answer as JSON text.
    fn step_aside(&self, py: Python<'_>, name: &str) -> PyResult<String> {
        let s = self.get()?;
        py.detach(|| {
            cuda_ipc::service::step_aside(&s, name)
                .map(|a| cuda_ipc::service::admin::encode(&a).to_string())
        })
        .py()
    }

    /// Waits up to `timeout` seconds for the in-place write of the
    /// service's set `name` to end (with `next`: for the next version),
    /// then wakes every mapping (`cuda_ipc::service::come_back`); the
    /// service's answer as JSON text.
    #[pyo3(signature = (name, *, next=false, timeout=600.0))]
    fn come_back(&self, py: Python<'_>, name: &str, next: bool, timeout: f64) -> PyResult<String> {
        let s = self.get()?;
        let timeout = duration(Some(timeout)).py()?;
        py.detach(|| {
            if next {
                cuda_ipc::service::come_back_next(&s, name, timeout)
            } else {
                cuda_ipc::service::come_back(&s, name, timeout)
            }
            .map(|a| cuda_ipc::service::admin::encode(&a).to_string())
        })
        .py()
    }

    /// How many mappings this subscriber opened (cache misses).
    #[getter]
    fn opens(&self) -> PyResult<u64> {
        Ok(self.get()?.opens())
    }

    /// Attaches to the buffer published as `name`: a lease, the memory
    /// mapped, the publisher's event waited for.
    fn attach(&self, py: Python<'_>, name: &str) -> PyResult<Attachment> {
        let sub = self.get()?;
        let attached = py
            .detach(|| -> Result<_> {
                let a = sub.attach::<u8>(name)?;
                a.buffer().synchronize()?;
                Ok(a)
            })
            .py()?;
        let d = attached.descriptor().clone();
        let layout = Layout::of(attached.buffer(), &d);
        let read_only = attached.read_only();
        Ok(Attachment {
            name: attached.name().to_owned(),
            lease: attached.lease(),
            keep: Mutex::new(Some(Keep::new(attached.buffer().clone()))),
            attached: Mutex::new(Some(Arc::new(attached))),
            subscriber: sub,
            layout,
            descriptor: d,
            read_only,
        })
    }

    /// Attaches the set published as `name`: one lease for the whole set,
    /// each chunk mapped once, the publisher's event (or fence) waited for.
    /// With `read_only` (or when the publisher serves the set to read-only
    /// readers) the chunks are mapped read-only: VMM memory only.
    #[pyo3(signature = (name, *, read_only=false))]
    fn attach_set(
        &self,
        py: Python<'_>,
        name: &str,
        read_only: bool,
    ) -> PyResult<crate::sets::SetAttachment> {
        crate::sets::attach_set(self, py, name, read_only)
    }

    /// Unmaps the cached arena chunks that no set or buffer holds any more
    /// (so that the publisher may trim them).
    fn drop_idle_mappings(&self, py: Python<'_>) -> PyResult<()> {
        let s = self.get()?;
        py.detach(|| s.drop_idle_mappings());
        Ok(())
    }

    /// `(count, bytes)` of the arena chunks this subscriber keeps mapped.
    fn cached_mappings(&self) -> PyResult<(usize, u64)> {
        Ok(self.get()?.cached_mappings())
    }

    /// Unmaps every mapping, keeping addresses and leases; `(mappings,
    /// bytes)` put to sleep. Refused (`InvalidInput`) while tensors,
    /// views, state dicts, attachments or rings of this subscriber are
    /// alive, unless `unchecked`: the caller then promises that nothing
    /// touches them until `wake()` returns (a kernel, copy or CUDA graph on
    /// them faults and poisons this process's CUDA context).
    #[pyo3(signature = (*, unchecked=false))]
    #[allow(unsafe_code)]
    fn sleep(&self, py: Python<'_>, unchecked: bool) -> PyResult<(usize, u64)> {
        let s = self.get()?;
        let done = py
            .detach(|| {
                if unchecked {
                    // SAFETY: Python has no `unsafe`: `unchecked=True` is
                    // the caller's promise of `sleep_unchecked`'s contract,
                    // as this method and `cuda_ipc.Subscriber.sleep` say.
                    unsafe { s.sleep_unchecked() }
                } else {
                    s.sleep()
                }
            })
            .py()?;
        Ok((done.mappings, done.bytes))
    }

    /// Maps every sleeping mapping again at its addresses; `(mappings,
    /// bytes)` woken.
    fn wake(&self, py: Python<'_>) -> PyResult<(usize, u64)> {
        let s = self.get()?;
        let done = py.detach(|| s.wake()).py()?;
        Ok((done.mappings, done.bytes))
    }

    /// Whether any of its mappings sleeps.
    #[getter]
    fn asleep(&self) -> PyResult<bool> {
        Ok(self.get()?.asleep())
    }

    /// `[(base, bytes), ...]` of the mappings asleep now, in address order.
    fn sleeping_ranges(&self) -> PyResult<Vec<(u64, u64)>> {
        Ok(self.get()?.sleeping_ranges())
    }

    /// Subscribes to the ring `name` (every slot mapped once).
    fn attach_ring(&self, py: Python<'_>, name: &str) -> PyResult<Ring> {
        let sub = self.get()?;
        let ring = py.detach(|| sub.attach_ring::<u8>(name)).py()?;
        Ok(Ring {
            shared: Arc::new(RingShared {
                subscriber: sub,
                ring: Mutex::new(Some(Arc::new(ring))),
            }),
            name: name.to_owned(),
            device: self.device.clone(),
            timeout: Mutex::new(None),
        })
    }

    /// Disconnects (leases still held by attachments or tensors end when
    /// they die). Safe to call twice.
    fn close(&self, py: Python<'_>) {
        let s = lock(&self.inner).take();
        py.detach(move || drop(s));
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> bool {
        self.close(py);
        false
    }
}
