//! The weight service (`cuda-ipc serve --service`, issue 26): a long-running
//! [`Publisher`] that owns what it loads, serves it as sets by name, and
//! keeps it when any client exits or is killed.
//!
//! - [`catalog`]: the bookkeeping, no GPU: sets by name, per-uid quotas in
//!   bytes, the rules for loading and dropping.
//! - [`admin`]: the methods clients call over the channel and their
//!   bodies, shared with `cuda-ipc load`, `ls`, `stats` and `drop`.
//! - [`Service`]: a publisher with read-only readers, the catalog, and the
//!   channel's call handler that answers the methods.
//! - [`Writer`]: a writer's session, from its side: open, write into the
//!   staging version mapped read-write, commit or abort (the service's
//!   side is described in its `write` module: one writer per set, a second
//!   copy while it writes, readers moved by an update notice).
//!
//! Readers attach the sets as any publisher's
//! ([`Subscriber::attach_set`](crate::exchange::Subscriber::attach_set),
//! `cuda-ipc attach --set`), read-only. A set's memory is the service's:
//! a reader's lease ends with its connection; a loader's exit changes
//! nothing. The service loads a checkpoint itself, from a path, as its own
//! uid ([`loader::load_checkpoint`](crate::loader::load_checkpoint)), so
//! the file must be readable by that uid; for a caller of another uid,
//! only files it owns or anyone may read (`not_readable` otherwise: a
//! caller cannot have the service read for it what it could not read
//! itself), decided on the descriptor the service reads, before a byte of
//! it is read (the `access` module). A load may take one tensor-parallel
//! rank's shard instead ([`admin::TpRequest`]), held as the set
//! [`shard_name`]`(set, rank, world)`: one service per GPU, each holding
//! its ranks' shards (docs/SERVICE.md, "Tensor parallel").
//!
//! # Threads
//! Calls run on the channel's connection threads: a load holds up only the
//! connection that asked for it. The catalog is behind one lock, never held
//! across a load or a wait.

mod access;
pub mod admin;
pub mod catalog;
mod config;
mod dispatch;
mod held;
#[cfg(test)]
mod hostile_tests;
mod in_place;
pub mod layout;
mod listing;
mod persist;
pub(crate) mod readers;
#[doc(hidden)]
pub use readers::readers_book_round_trip;
mod saved;
mod stop;
mod write;
mod writer;

use std::collections::{BTreeSet, HashMap};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use crate::channel::{CallError, CallHandler};
use crate::checkpoint::PlanOptions;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::exchange::{Endpoint, Publisher, PublisherConfig};
use crate::keep::Store;
use crate::loader::load_plan_until;

use admin::{
    AbortAnswer, AbortRequest, CommitAnswer, CommitRequest, DropAnswer, DropRequest, LoadAnswer,
    LoadRequest, LsAnswer, OpenWriteAnswer, OpenWriteRequest, StatsAnswer,
};
pub use catalog::{Catalog, CatalogError, Holder, Loaded, Quotas, SetInfo, UidUsage, WriterId};
pub use config::ServiceConfig;
use dispatch::{Ops, bad_request};
use held::Held;
pub use in_place::{come_back, come_back_next, step_aside};
pub use persist::Restored;
pub use saved::{SET_KEY, Saved, SavedLoad, VERSION_KEY, file_name_for, save};
pub use writer::Writer;

pub use crate::checkpoint::shard_name;

/// What [`Service::shutdown`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShutdownReport {
    /// Every set dropped, in name order.
    pub dropped: Vec<SetInfo>,
    /// The readers that still held leases when the grace ran out, by set.
    pub held_at_timeout: Vec<(String, Holder)>,
    /// How long it waited for readers.
    pub waited: Duration,
}

/// The largest call body the service accepts: a new set's layout travels
/// in `open_write` (the channel's message limit, 1 MiB).
const MAX_CALL_BYTES: u32 = crate::channel::MAX_PAYLOAD;

struct Inner {
    publisher: Publisher,
    device: Device,
    load_defaults: PlanOptions,
    catalog: Mutex<Catalog>,
    /// The current version of each set, kept until it is dropped or
    /// replaced.
    held: Mutex<HashMap<String, Held>>,
    /// The staging versions of write sessions, by set.
    staging: Mutex<HashMap<String, write::Staging>>,
    /// Versions no longer current that readers keep, until their last
    /// reader lets go (the catalog's retired versions).
    retired: Mutex<Vec<write::Kept>>,
    /// Set at shutdown: loads in progress stop at their next piece.
    stop_loads: AtomicBool,
    /// Where the chunks and the catalog are kept across restarts.
    keeping: Mutex<persist::Keeping>,
    /// Readers that stepped aside for in-place writes, and the condition
    /// their waits (the writer's, `back`) wait on.
    aside: Mutex<in_place::Aside>,
    aside_cv: Condvar,
    /// Who holds which sets, kept for the next serving process, and the
    /// readers of the one before that have not connected again.
    readers: Arc<Mutex<readers::Readers>>,
    /// Set by the `shutdown` method.
    stop_asked: Mutex<bool>,
    stop_cv: Condvar,
}

/// The weight service (see the module docs).
pub struct Service {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service")
            .field("path", &self.path())
            .finish_non_exhaustive()
    }
}

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Service {
    /// Binds the service's socket on `device` and starts answering calls:
    /// a [`Publisher`] with read-only readers (an arena of vmm chunks).
    ///
    /// # Errors
    /// The loader options' ([`PlanOptions::validate`]) and
    /// [`Publisher::bind`]'s.
    pub fn start(
        device: &Device,
        endpoint: impl Into<Endpoint>,
        config: ServiceConfig,
    ) -> Result<Service> {
        Ok(Self::start_kept(device, endpoint, config, Store::none())?.0)
    }

    /// [`start`](Self::start) with a store that keeps the weights through
    /// the serving process's death ([`crate::keep`]): first serves again
    /// what `store` handed back (the sets of the process before, at their
    /// versions, from the same device memory), then answers calls, and
    /// from then on sends the store every chunk and catalog change. With
    /// [`Store::none`] it is `start`.
    ///
    /// # Errors
    /// `start`'s, and taking back what the store handed over.
    pub fn start_kept(
        device: &Device,
        endpoint: impl Into<Endpoint>,
        config: ServiceConfig,
        mut store: Store,
    ) -> Result<(Service, Restored)> {
        config.load.validate()?;
        // The handler is the server's from its first connection; calls wait
        // (on their own connection's thread) until the sets kept through a
        // restart are served again.
        let slot: Arc<OnceLock<Weak<Inner>>> = Arc::new(OnceLock::new());
        let closed = Arc::clone(&slot);
        let calls = Arc::clone(&slot);
        let readers = Arc::new(Mutex::new(readers::Readers::new()));
        let book = Arc::clone(&readers);
        let mut handler = CallHandler::new(move |ctx, method, body| {
            let Some(inner) = calls.wait().upgrade() else {
                return Err(CallError::new("stopping", "the service is stopping"));
            };
            let caller = WriterId {
                pid: ctx.peer.pid,
                uid: ctx.peer.uid,
                connection: ctx.connection,
            };
            dispatch::dispatch(&*inner, caller, method, body)
        })
        .on_close(move |connection| {
            if let Some(inner) = closed.get().and_then(Weak::upgrade) {
                inner.connection_closed(connection);
            }
        });
        if store.is_kept() {
            // Written before the holder hears of its lease: a restart knows
            // every reader that may map a set.
            handler = handler.on_lease(move |e| {
                locked(&book).lease(e.granted, e.name, e.pid, e.uid);
            });
        }
        let mut publisher_config = PublisherConfig::default()
            .with_read_only_readers(true)
            .with_max_request_bytes(MAX_CALL_BYTES)
            .with_allow_uids(config.allow_uids.iter().copied())
            .with_call_handler(handler)
            // Under a keeper, another process serves after this one, from
            // the same memory: readers connect again and take their leases
            // back (`Reconnect::IfPublisherRestarts`).
            .with_restarts(store.is_kept())
            // Nobody is served before what was kept is served again: a
            // client that connects meanwhile (an upgrade, a restart) waits
            // in the backlog rather than finding a set missing.
            .with_accept_held(true);
        // The socket of the process before: clients that connected while
        // none served wait in its backlog.
        if let Some(listener) = store.take_socket() {
            publisher_config = publisher_config.with_listener(listener);
        }
        let publisher = Publisher::bind(device, endpoint, publisher_config)?;
        if store.is_kept() && !store.holds(crate::keep::image::SOCKET_NAME) {
            let kept = publisher
                .server()
                .listener()
                .map_err(Error::from)
                .and_then(|fd| {
                    store
                        .put(crate::keep::image::SOCKET_NAME, fd.as_fd())
                        .map_err(|e| Error::Io {
                            context: "cannot keep the listening socket".into(),
                            source: e,
                        })
                });
            if let Err(e) = kept {
                tracing::warn!(error = %e, "the listening socket is not kept: clients are refused while the service restarts");
            }
        }
        let uid = rustix::process::geteuid().as_raw();
        let quotas = catalog::quotas_or_default(config.quotas, || Ok(device.memory_info()?.1))?;
        let inner = Arc::new(Inner {
            publisher,
            device: device.clone(),
            load_defaults: config.load,
            catalog: Mutex::new(Catalog::new(uid, quotas)),
            held: Mutex::new(HashMap::new()),
            staging: Mutex::new(HashMap::new()),
            retired: Mutex::new(Vec::new()),
            stop_loads: AtomicBool::new(false),
            keeping: Mutex::new(persist::Keeping::new(store)),
            aside: Mutex::new(in_place::Aside::default()),
            aside_cv: Condvar::new(),
            readers,
            stop_asked: Mutex::new(false),
            stop_cv: Condvar::new(),
        });
        let restored = match inner.restore() {
            Ok(r) => r,
            Err(e) => {
                // Calls that wait for the service get `stopping`.
                let _ = slot.set(Weak::new());
                return Err(e);
            }
        };
        inner.keep_readers();
        inner.persist();
        let _ = slot.set(Arc::downgrade(&inner));
        inner.publisher.server().start_accepting();
        tracing::info!(path = %inner.publisher.path().display(), sets = restored.sets.len(), "service serving");
        if let Err(e) = locked(&inner.keeping).store.ready() {
            tracing::warn!(error = %e, "cannot tell the store that the service serves");
        }
        Ok((Service { inner }, restored))
    }

    /// The socket path clients connect to.
    pub fn path(&self) -> &Path {
        self.inner.publisher.path()
    }

    /// The publisher underneath.
    pub fn publisher(&self) -> &Publisher {
        &self.inner.publisher
    }

    /// Loads a checkpoint for `uid` (what the `load` method does).
    ///
    /// # Errors
    /// The refusals of [`CatalogError`] and the loader's, as the caller
    /// sees them.
    pub fn load(
        &self,
        uid: u32,
        request: &LoadRequest,
    ) -> std::result::Result<LoadAnswer, CallError> {
        self.inner.load(uid, request)
    }

    /// What the service holds (the `ls` method).
    pub fn ls(&self) -> LsAnswer {
        self.inner.ls()
    }

    /// Per-uid use and totals (the `stats` method).
    pub fn stats(&self) -> StatsAnswer {
        self.inner.stats()
    }

    /// Drops a set for `caller` (the `drop` method).
    ///
    /// # Errors
    /// The refusals of [`Catalog::check_drop`].
    pub fn drop_set(
        &self,
        caller: u32,
        request: &DropRequest,
    ) -> std::result::Result<DropAnswer, CallError> {
        self.inner.drop_set(caller, request)
    }

    /// Waits up to `timeout` for a `shutdown` call; returns whether one came.
    pub fn wait_for_shutdown_call(&self, timeout: Duration) -> bool {
        let asked = locked(&self.inner.stop_asked);
        let (asked, _) = self
            .inner
            .stop_cv
            .wait_timeout_while(asked, timeout, |a| !*a)
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *asked
    }

    /// Stops: loads nothing more and stops the loads in progress (at their
    /// next piece; each gives its memory back and answers `load_failed`),
    /// hides every set from new readers (its readers get an `Unpublished`
    /// notice), waits up to `grace` for the readers' leases to end, then
    /// drops every set and gives the memory back. Readers still holding
    /// leases then keep what they mapped. With no reader holding on it
    /// returns within about a second whatever loads were running.
    pub fn shutdown(self, grace: Duration) -> ShutdownReport {
        let inner = &self.inner;
        inner.forget_kept();
        locked(&inner.catalog).stop();
        inner.aside_cv.notify_all();
        inner.stop_loads.store(true, Ordering::SeqCst);
        let sessions: Vec<(String, String)> = locked(&inner.catalog)
            .write_sessions()
            .map(|s| (s.set.clone(), s.staging.clone()))
            .collect();
        for (set, entry) in sessions {
            locked(&inner.catalog).abort_any(&set);
            inner.discard_staging(&set, &entry);
        }
        let (held, waited) = stop::wait_for_readers(&**inner, grace, Duration::from_millis(20));
        let mut catalog = locked(&inner.catalog);
        let names: Vec<String> = catalog.sets().map(|s| s.name.clone()).collect();
        let dropped: Vec<SetInfo> = names.iter().filter_map(|n| catalog.remove(n)).collect();
        drop(catalog);
        locked(&inner.held).clear();
        inner.publisher.reap();
        if let Err(e) = inner.publisher.trim() {
            tracing::debug!(error = %e, "trim at shutdown");
        }
        // A call still running holds the service: let it finish here, so
        // that the publisher is never dropped on a connection thread (its
        // shutdown joins those threads).
        let calls = Instant::now();
        while Arc::strong_count(&self.inner) > 1 && calls.elapsed() < CALLS_AT_SHUTDOWN {
            std::thread::sleep(Duration::from_millis(10));
        }
        if Arc::strong_count(&self.inner) > 1 {
            tracing::warn!("a call is still running at shutdown; the publisher is left to exit");
            std::mem::forget(Arc::clone(&self.inner));
        }
        ShutdownReport {
            dropped,
            held_at_timeout: held,
            waited,
        }
    }
}

/// How long [`Service::shutdown`] waits for calls still running: a load
/// stops at its next piece, and one still opening its checkpoint (bounded
/// by the reader's limits) is refused at its size check; a call that
/// takes longer is left to the process's exit, so that a stop never waits
/// on a client's load.
const CALLS_AT_SHUTDOWN: Duration = Duration::from_secs(1);

/// A library error as a caller sees it.
fn call_error(code: &str, e: &Error) -> CallError {
    CallError::new(code, e.to_string())
}

fn refused(e: &CatalogError) -> CallError {
    CallError::new(e.code(), e.to_string())
}

impl Inner {
    fn holders(&self, name: &str) -> Vec<Holder> {
        self.publisher
            .leases()
            .into_iter()
            .filter(|l| l.name == name)
            .map(|l| Holder {
                pid: l.pid,
                uid: l.uid,
            })
            .collect()
    }
}

impl Ops for Inner {
    fn load(&self, uid: u32, r: &LoadRequest) -> std::result::Result<LoadAnswer, CallError> {
        r.validate().map_err(bad_request)?;
        // A tensor-parallel shard goes into the set named after it.
        let (set, shard) = r.target().map_err(bad_request)?;
        let r = &LoadRequest { set, ..r.clone() };
        // The old versions' holders as they are now: what the quotas count.
        self.sweep_retired();
        let mut options = self.load_defaults.clone();
        if let Some(s) = r.streams {
            options = options.with_streams(s);
        }
        if let Some(s) = r.staging {
            options = options.with_piece_size(s);
        }
        options
            .validate()
            .map_err(|e| bad_request(format!("streams or staging: {e}")))?;
        if locked(&self.catalog).is_stopping() {
            return Err(refused(&CatalogError::Stopping));
        }
        // A set of this name dropped with force lives on while readers hold it.
        let held = self.holders(&r.set);
        if !held.is_empty() && locked(&self.catalog).get(&r.set).is_none() {
            return Err(CallError::new(
                "leased",
                format!(
                    "a dropped set {:?} is still held by {}; the name is free once they release                      it (or exit); or choose another name",
                    r.set,
                    catalog::holders_text(&held)
                ),
            ));
        }
        let path = PathBuf::from(&r.path);
        let service_uid = locked(&self.catalog).service_uid();
        // The quota (and the name) before the work: asked once the files'
        // sizes are known, before any header is parsed.
        let room = access::room_for(&self.catalog, uid, &r.set);
        let ckpt = access::open_for(uid, service_uid, &path, &room)?;
        crate::loader::check_publishable(&ckpt).map_err(|e| call_error("checkpoint", &e))?;
        let plan = match &shard {
            Some(s) => ckpt.plan_shard(&options, s),
            None => ckpt.plan(&options),
        }
        .map_err(|e| call_error("checkpoint", &e))?;
        let ticket = locked(&self.catalog)
            .admit(uid, &r.set, plan.total_bytes())
            .map_err(|e| refused(&e))?;
        tracing::info!(set = %r.set, uid, path = %path.display(), bytes = plan.total_bytes(), "loading");
        let loaded = load_plan_until(
            &self.publisher,
            &ckpt,
            &plan,
            &mut |_, _| {},
            &self.stop_loads,
        )
        .and_then(|l| l.publish(&self.publisher, &r.set).map(|()| l));
        let loaded = match loaded {
            Ok(l) => l,
            Err(e) => {
                locked(&self.catalog).cancel(ticket);
                self.publisher.reap();
                return Err(call_error("load_failed", &e));
            }
        };
        let report = loaded.report().clone();
        let info = locked(&self.catalog)
            .commit(
                ticket,
                Loaded::new(
                    report.payload_bytes,
                    report.tensors,
                    ckpt.path().display().to_string(),
                ),
            )
            .clone();
        locked(&self.held).insert(r.set.clone(), Held::loaded(loaded));
        self.persist();
        tracing::info!(set = %r.set, uid, version = info.version, s = report.elapsed.as_secs_f64(), "loaded");
        Ok(LoadAnswer {
            set: info.name,
            version: info.version,
            path: info.loaded_from,
            files: report.files,
            tensors: report.tensors,
            bytes: report.payload_bytes,
            allocated: info.bytes,
            streams: report.streams,
            load_s: report.elapsed.as_secs_f64(),
            gb_per_s: report.gb_per_s(),
        })
    }

    fn ls(&self) -> LsAnswer {
        self.ls_answer()
    }

    fn stats(&self) -> StatsAnswer {
        self.sweep_retired();
        let memory = self.device.memory_info().ok();
        let catalog = locked(&self.catalog);
        // Leases on sets, and on old versions readers still keep.
        let names: BTreeSet<&str> = catalog
            .sets()
            .map(|s| s.name.as_str())
            .chain(catalog.retired().iter().map(|r| r.set.as_str()))
            .collect();
        let leases = self
            .publisher
            .leases()
            .iter()
            .filter(|l| names.contains(l.name.as_str()))
            .count();
        StatsAnswer {
            pid: std::process::id(),
            service_uid: catalog.service_uid(),
            default_quota: catalog.quotas().default,
            uids: catalog.usage(),
            sets: catalog.sets().count(),
            total_bytes: catalog.total_bytes(),
            loads_in_progress: catalog.loads_in_progress(),
            leases,
            device_free: memory.map(|m| m.0),
            device_total: memory.map(|m| m.1),
            stopping: catalog.is_stopping(),
        }
    }

    fn drop_set(&self, caller: u32, r: &DropRequest) -> std::result::Result<DropAnswer, CallError> {
        self.sweep_retired();
        let holders = self.holders(&r.set);
        let mut catalog = locked(&self.catalog);
        catalog
            .check_drop(caller, &r.set, &holders, r.force)
            .map_err(|e| refused(&e))?;
        // A forced drop of a set being written ends the write.
        let session = catalog.abort_any(&r.set);
        // Hidden first, so that no new reader attaches; forgotten after.
        self.publisher
            .unpublish_set(&r.set, None)
            .map_err(|e| call_error("drop_failed", &e))?;
        // Readers that hold it keep its memory: it stays in the books,
        // charged to them, until they let go (the catalog's "Holding").
        let holding = self.holders(&r.set);
        let info = catalog.drop_set(&r.set, &holding);
        drop(catalog);
        if let (Some(info), false) = (&info, holding.is_empty()) {
            locked(&self.retired).push(write::Kept::dropped(&r.set, info.version));
        }
        if let Some(s) = session {
            self.discard_staging(&s.set, &s.staging);
        }
        let loaded = locked(&self.held).remove(&r.set);
        drop(loaded);
        self.publisher.server().allow_attaches(&r.set);
        {
            let mut aside = locked(&self.aside);
            aside.forget_set(&r.set);
            self.aside_changed(&aside);
        }
        self.persist();
        self.publisher.reap();
        if let Err(e) = self.publisher.trim() {
            tracing::debug!(error = %e, "trim after a drop");
        }
        self.sweep_retired();
        tracing::info!(set = %r.set, caller, forced = !holders.is_empty(), "dropped");
        Ok(DropAnswer {
            set: r.set.clone(),
            bytes: info.map_or(0, |i| i.bytes),
            held_by: holders,
        })
    }

    fn service_uid(&self) -> u32 {
        locked(&self.catalog).service_uid()
    }

    fn ask_stop(&self) {
        *locked(&self.stop_asked) = true;
        self.stop_cv.notify_all();
    }

    fn open_write(
        &self,
        caller: WriterId,
        r: &OpenWriteRequest,
    ) -> std::result::Result<OpenWriteAnswer, CallError> {
        Inner::open_write(self, caller, r)
    }

    fn commit(
        &self,
        caller: WriterId,
        r: &CommitRequest,
    ) -> std::result::Result<CommitAnswer, CallError> {
        Inner::commit(self, caller, r)
    }

    fn abort(
        &self,
        caller: WriterId,
        r: &AbortRequest,
    ) -> std::result::Result<AbortAnswer, CallError> {
        Inner::abort(self, caller, r)
    }

    fn aside(
        &self,
        caller: WriterId,
        r: &admin::AsideRequest,
    ) -> std::result::Result<admin::AsideAnswer, CallError> {
        Inner::aside(self, caller, r)
    }

    fn back(
        &self,
        caller: WriterId,
        r: &admin::BackRequest,
    ) -> std::result::Result<admin::BackAnswer, CallError> {
        Inner::back(self, caller, r)
    }
    fn reconnected(&self, caller: WriterId, pending: &[String]) -> admin::ReconnectedAnswer {
        let left = {
            let mut readers = locked(&self.readers);
            readers.reconnected(caller.pid, caller.uid, pending);
            readers.orphans().len()
        };
        self.aside_cv.notify_all();
        admin::ReconnectedAnswer {
            not_reconnected: left,
        }
    }
}

impl stop::Stopping for Inner {
    fn set_names(&self) -> Vec<String> {
        locked(&self.catalog)
            .sets()
            .map(|s| s.name.clone())
            .collect()
    }

    fn hide(&self, name: &str) {
        if let Err(e) = self.publisher.unpublish_set(name, None) {
            tracing::warn!(set = %name, error = %e, "cannot hide a set at shutdown");
        }
    }

    fn holders_of(&self, names: &BTreeSet<String>) -> Vec<(String, Holder)> {
        self.publisher
            .leases()
            .into_iter()
            .filter(|l| names.contains(&l.name))
            .map(|l| {
                let holder = Holder {
                    pid: l.pid,
                    uid: l.uid,
                };
                (l.name, holder)
            })
            .collect()
    }

    fn loads_in_progress(&self) -> usize {
        locked(&self.catalog).loads_in_progress()
    }
}
