//! A lease held by every view of what it covers.
//!
//! The guard holds the connection that carries the lease (the
//! subscriber's [`Link`], and through it the channel client): a
//! [`Subscriber`](super::Subscriber) dropped while views live leaves the
//! connection open, and so the lease held, until the last view is gone.
//! Its drop never waits: the release is retired to the
//! [reaper](crate::reaper) until the streams the views used have finished,
//! then the mappings are undone and the lease is given back without
//! waiting for the publisher's answer.
//!
//! A lease is taken on one connection ([`LeaseId`]: its id and the
//! connection's epoch). When a reconnecting subscriber connects again
//! (`reconnect.rs`), a set's lease is taken back on the new connection
//! where the publisher still serves the version held ([`Standing::Held`]
//! with the new id), or the guard says what became of it; a lease of an
//! ended connection is never released on another (its id means nothing
//! there).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::channel::{ChannelError, Notice};
use crate::error::{Error, Result};
use crate::memory::buffer::{Hold, Mapping};
use crate::set::SetRecord;

use super::link::{Connection, Link};
use super::lock;
use super::sync::Waiter;

/// How long an explicit release waits for views already dropped to finish
/// going before it refuses.
const SETTLE_BEFORE_REFUSING: std::time::Duration = std::time::Duration::from_secs(10);

/// Notices that arrived for a lease other than the one being waited on.
pub(super) type Pending = Mutex<HashMap<u64, VecDeque<Notice>>>;

/// A lease: its id and the epoch of the connection it was taken on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct LeaseId {
    pub(super) id: u64,
    pub(super) epoch: u64,
}

/// What became of a lease after its connection ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Standing {
    /// Held on the connection now.
    Held,
    /// Not taken back (yet): its connection ended, and the reconnect
    /// could not take it back for now (the publisher's refusal: `code`,
    /// `message`), or has not tried. Tried again at the next operation.
    Missing(Option<(String, String)>),
    /// The publisher serves another version under the name now: the one
    /// held stays mapped, without a lease.
    Replaced,
    /// Nothing is published under the name any more (or the lease is not
    /// one a reconnect takes back: rings, streams, single buffers).
    Gone,
}

/// Where the lease is now.
#[derive(Debug)]
struct Now {
    lease: LeaseId,
    /// How its holder waits for the publisher's work (sets and
    /// attachments): the new publisher's event or fence once taken back.
    waiter: Option<Waiter>,
    /// What a reconnect found (only for a lease of an ended connection).
    found: Standing,
    /// The last update's version waited for.
    version: u64,
}

/// A lease, held by every view of what it covers and released to the
/// channel when the last of them is gone (or by an explicit release).
pub(super) struct LeaseGuard {
    name: String,
    /// The connection: kept open while any view holds the lease.
    link: Arc<Link>,
    pending: Arc<Pending>,
    /// The mappings the lease covers, whose streams are waited for before
    /// the lease ends.
    mappings: Mutex<Vec<Arc<dyn Mapping>>>,
    released: AtomicBool,
    now: Mutex<Now>,
    /// The record of the set version held, for a reconnect to take the
    /// lease back by name; `None`: not taken back.
    record: Option<Arc<SetRecord>>,
}

impl std::fmt::Debug for LeaseGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseGuard")
            .field("lease", &self.lease())
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Hold for LeaseGuard {}

impl LeaseGuard {
    /// A guard of `lease` on `name`, over `mappings`; not taken back by a
    /// reconnect, no waiter.
    pub(super) fn new(
        link: &Arc<Link>,
        pending: &Arc<Pending>,
        lease: LeaseId,
        name: String,
        mappings: Vec<Arc<dyn Mapping>>,
    ) -> Arc<Self> {
        Self::with(link, pending, lease, name, mappings, None, None)
    }

    /// [`LeaseGuard::new`] with how its holder waits, and (a set attached
    /// by name) the record of the version held, which a reconnect takes
    /// the lease back for.
    pub(super) fn with(
        link: &Arc<Link>,
        pending: &Arc<Pending>,
        lease: LeaseId,
        name: String,
        mappings: Vec<Arc<dyn Mapping>>,
        waiter: Option<Waiter>,
        record: Option<Arc<SetRecord>>,
    ) -> Arc<Self> {
        Arc::new(LeaseGuard {
            name,
            link: link.clone(),
            pending: pending.clone(),
            mappings: Mutex::new(mappings),
            released: AtomicBool::new(false),
            now: Mutex::new(Now {
                lease,
                waiter,
                found: Standing::Held,
                version: 0,
            }),
            record,
        })
    }

    /// The entry's name.
    pub(super) fn name(&self) -> &str {
        &self.name
    }

    /// The lease now.
    pub(super) fn lease(&self) -> LeaseId {
        lock(&self.now).lease
    }

    /// How the holder waits now.
    pub(super) fn waiter(&self) -> Option<Waiter> {
        lock(&self.now).waiter.clone()
    }

    /// The record a reconnect takes the lease back for, if any.
    pub(super) fn record(&self) -> Option<&Arc<SetRecord>> {
        self.record.as_ref()
    }

    /// Whether the lease was released (or is being).
    pub(super) fn released(&self) -> bool {
        self.released.load(Ordering::Acquire)
    }

    /// What the lease is now: held on the connection whose epoch is
    /// `epoch`, or what a reconnect found.
    pub(super) fn standing(&self, epoch: u64) -> Standing {
        let now = lock(&self.now);
        if now.lease.epoch == epoch {
            Standing::Held
        } else if self.record.is_none() {
            Standing::Gone
        } else if now.found == Standing::Held {
            Standing::Missing(None)
        } else {
            now.found.clone()
        }
    }

    /// The lease's id on `conn`, for a holder that cannot be taken back
    /// (a ring, a stream): [`ChannelError::PeerGone`] once the connection
    /// it was taken on has ended and another is `conn`.
    pub(super) fn current_on(&self, conn: &Connection) -> Result<u64> {
        let lease = self.lease();
        if lease.epoch == conn.epoch {
            Ok(lease.id)
        } else {
            Err(ChannelError::PeerGone.into())
        }
    }

    /// Taken back as `lease`, its holder waiting with `waiter`. `false`
    /// when the guard was released meanwhile: the caller releases `lease`.
    pub(super) fn taken_back(&self, lease: LeaseId, waiter: Waiter) -> bool {
        let mut now = lock(&self.now);
        if self.released() {
            return false;
        }
        now.lease = lease;
        now.waiter = Some(waiter);
        now.found = Standing::Held;
        true
    }

    /// What a reconnect found, for a lease it did not take back.
    pub(super) fn found(&self, standing: Standing) {
        lock(&self.now).found = standing;
    }

    /// Notes the update `version` as waited for; returns it.
    pub(super) fn updated(&self, version: u64) -> u64 {
        lock(&self.now).version = version;
        version
    }

    /// The version to report for a version replaced while no connection
    /// heard of it: one past the last update waited for.
    pub(super) fn replaced_version(&self) -> u64 {
        lock(&self.now).version + 1
    }

    /// Fails with [`Error::ViewsAlive`] when views other than `own` hold the
    /// lease (an explicit release: it may wait). Views dropped just before
    /// may still be on their way out (memory handed to PyTorch lets go of
    /// them after a barrier on the reaper's thread): those are waited for,
    /// within the reaper's settle time.
    pub(super) fn check_no_views(self: &Arc<Self>, own: usize) -> Result<()> {
        // Only views hold strong references, and new views are made only
        // from existing ones, so the count can't grow while we hold none
        // but `own`.
        let views = views_left(
            || Arc::strong_count(self).saturating_sub(own),
            crate::reaper::retiring,
            || {
                crate::reaper::settle(SETTLE_BEFORE_REFUSING);
            },
        );
        if views > 0 {
            return Err(Error::ViewsAlive {
                name: self.name.clone(),
                lease: self.lease().id,
                views,
            });
        }
        Ok(())
    }

    /// Ends the lease now, waiting (an explicit release): waits for the
    /// streams the views used, undoes the mappings (unless another lease
    /// shares them), then tells the publisher and waits for its answer
    /// (within the connection's timeout). The lease is released even when
    /// a wait failed (the first failure is returned). A connection that is
    /// gone has ended the lease already.
    pub(super) fn end(&self) -> Result<()> {
        if self.released.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let mappings = std::mem::take(&mut *lock(&self.mappings));
        let mut waited = Ok(());
        for m in &mappings {
            let r = m.used_streams().synchronize_all();
            if waited.is_ok() {
                waited = r;
            }
        }
        crate::reaper::work_done(|| drop(mappings));
        // Read after `released` is set: a reconnect that takes the lease
        // back from here on gives it up itself.
        let lease = self.lease();
        let released = release_on(&self.link, &self.pending, lease, true);
        match released {
            Ok(()) | Err(ChannelError::PeerGone) => waited,
            Err(e) => Err(e.into()),
        }
    }
}

/// Releases `lease` on the connection now, if it was taken there (one of
/// an ended connection ended with it), waiting for the answer or not;
/// then forgets its notices.
pub(super) fn release_on(
    link: &Link,
    pending: &Pending,
    lease: LeaseId,
    wait: bool,
) -> std::result::Result<(), ChannelError> {
    let now = link.now();
    if now.epoch != lease.epoch {
        return Ok(());
    }
    let released = if wait {
        now.client.release(lease.id)
    } else {
        now.client.release_nowait(lease.id)
    };
    // After the release: the client drops notices for a lease it no
    // longer holds, so none can queue here again.
    lock(pending).remove(&lease.id);
    released
}

/// How many views are left once those on their way out have gone: counts
/// them (`count`), and when some are left and the reaper still has steps
/// (`retiring`), waits for it (`settle`); then counts again. The second
/// count is taken in every case: a view counted while the reaper was
/// dropping it may be gone by the time `retiring` looks (the reaper drops
/// what a step holds, then counts the step done), and the first count is
/// stale then.
fn views_left(
    count: impl Fn() -> usize,
    retiring: impl FnOnce() -> usize,
    settle: impl FnOnce(),
) -> usize {
    if count() == 0 {
        return 0;
    }
    if retiring() > 0 {
        settle();
    }
    count()
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        // The last view is gone. Nothing waits here: the release is retired
        // until the streams the views used have finished the work queued so
        // far; then the mappings are undone (they are done with, so at
        // once) and the publisher is told, without waiting for its answer.
        if self.released.load(Ordering::Acquire) {
            return;
        }
        let mappings = std::mem::take(&mut *lock(&self.mappings));
        let (link, pending, lease) = (self.link.clone(), self.pending.clone(), self.lease());
        crate::memory::buffer::retire_after_uses(mappings, "releasing a lease", move |mappings| {
            crate::reaper::work_done(|| drop(mappings));
            match release_on(&link, &pending, lease, false) {
                Ok(()) | Err(ChannelError::PeerGone) => {}
                Err(e) => tracing::warn!(lease = lease.id, error = %e, "releasing a lease failed"),
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use serde_json::json;

    use super::*;
    use crate::channel::{Client, ClientConfig, Server, ServerConfig};
    use crate::exchange::link::Reconnect;

    /// A real server and a subscriber's link to it over a socket in a
    /// temporary directory, and a lease on the entry "x".
    fn leased() -> (tempfile::TempDir, Server, Arc<Link>, LeaseId) {
        let dir = tempfile::tempdir().unwrap();
        let server = Server::bind(ServerConfig::new(dir.path().join("s.sock"))).unwrap();
        server.publish("x", json!({}), Vec::new()).unwrap();
        let client = Arc::new(Client::connect(server.path(), ClientConfig::default()).unwrap());
        let lease = client.attach("x").unwrap().lease;
        assert_eq!(server.leases().len(), 1);
        let link = Link::over(
            server.path().to_owned(),
            ClientConfig::default(),
            Reconnect::Always,
            client,
        );
        (
            dir,
            server,
            Arc::new(link),
            LeaseId {
                id: lease,
                epoch: 0,
            },
        )
    }

    /// Waits up to 5 s for the server to hold no lease.
    fn no_leases(server: &Server) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !server.leases().is_empty() {
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        true
    }

    #[test]
    fn the_last_view_releases_the_lease_without_waiting() {
        let (_dir, server, link, lease) = leased();
        let pending = Arc::new(Pending::default());
        lock(&pending).insert(lease.id, VecDeque::new());
        let guard = LeaseGuard::new(&link, &pending, lease, "x".into(), Vec::new());
        let views: Vec<_> = (0..3).map(|_| guard.clone()).collect();
        drop(guard);
        drop(views[..2].to_vec());
        assert!(crate::reaper::settle(Duration::from_secs(5)));
        assert_eq!(server.leases().len(), 1, "a view is still alive");
        drop(views);
        assert!(crate::reaper::settle(Duration::from_secs(5)));
        assert!(no_leases(&server), "{:?}", server.leases());
        assert!(
            lock(&pending).is_empty(),
            "notices of the lease are dropped"
        );
        assert!(link.is_alive(), "the connection stays for the subscriber");
    }

    #[test]
    fn an_explicit_release_refuses_while_views_live() {
        let (_dir, server, link, lease) = leased();
        let pending = Arc::new(Pending::default());
        let guard = LeaseGuard::new(&link, &pending, lease, "x".into(), Vec::new());
        let view = guard.clone();
        let e = guard.check_no_views(1).unwrap_err();
        assert!(
            matches!(&e, Error::ViewsAlive { views: 1, lease: l, .. } if *l == lease.id),
            "{e}"
        );
        assert!(e.to_string().contains("1 other view"), "{e}");
        assert_eq!(server.leases().len(), 1);
        drop(view);
        guard.check_no_views(1).unwrap();
        guard.end().unwrap();
        assert!(
            server.leases().is_empty(),
            "an explicit release waits for the answer"
        );
        // Ended once: the drop that follows does not release again.
        drop(guard);
        assert!(crate::reaper::settle(Duration::from_secs(5)));
        assert!(link.is_alive());
    }

    #[test]
    fn a_view_gone_between_the_count_and_the_reapers_look_is_not_counted() {
        // The race: the first count sees a view the reaper is dropping; by
        // the time `retiring` looks the step is done (0 left), so nothing
        // is settled, and the count must be taken again.
        let counts = std::cell::Cell::new(0);
        let count = || {
            counts.set(counts.get() + 1);
            usize::from(counts.get() == 1)
        };
        let settled = std::cell::Cell::new(false);
        assert_eq!(views_left(count, || 0, || settled.set(true)), 0);
        assert_eq!(counts.get(), 2, "counted again after the reaper's look");
        assert!(!settled.get(), "nothing was retiring: no wait");
        // Still held after the wait: refused with the second count.
        let settled = std::cell::Cell::new(false);
        assert_eq!(views_left(|| 2, || 1, || settled.set(true)), 2);
        assert!(settled.get(), "views on the reaper are waited for");
        // None at first: neither the reaper nor a second count is asked.
        assert_eq!(views_left(|| 0, || unreachable!(), || unreachable!()), 0);
    }

    #[test]
    fn an_explicit_release_never_refuses_views_the_reaper_has_just_dropped() {
        // Views let go of on the reaper's thread (as PyTorch's tensors'
        // are), each just before the check: whatever the interleaving, the
        // check must not count one that is gone.
        let (_dir, server, link, lease) = leased();
        let pending = Arc::new(Pending::default());
        let guard = LeaseGuard::new(&link, &pending, lease, "x".into(), Vec::new());
        for i in 0..2000 {
            let view = guard.clone();
            crate::reaper::soon("a view let go of", move || drop(view));
            if let Err(e) = guard.check_no_views(1) {
                panic!("round {i}: {e}");
            }
        }
        guard.end().unwrap();
        assert!(server.leases().is_empty());
    }

    #[test]
    fn a_view_keeps_the_connection_after_the_subscriber_lets_go() {
        let (_dir, server, link, lease) = leased();
        let pending = Arc::new(Pending::default());
        let view = LeaseGuard::new(&link, &pending, lease, "x".into(), Vec::new());
        // The subscriber's own references go; the view's lease must stay.
        drop(link);
        drop(pending);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            server.leases().len(),
            1,
            "the lease ended with the subscriber"
        );
        drop(view);
        assert!(crate::reaper::settle(Duration::from_secs(5)));
        assert!(no_leases(&server), "{:?}", server.leases());
    }

    #[test]
    fn a_view_dropped_after_the_publisher_is_gone_ends_quietly() {
        let (_dir, server, link, lease) = leased();
        let pending = Arc::new(Pending::default());
        let view = LeaseGuard::new(&link, &pending, lease, "x".into(), Vec::new());
        drop(server);
        let deadline = Instant::now() + Duration::from_secs(5);
        while link.is_alive() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        let t = Instant::now();
        drop(view);
        assert!(t.elapsed() < Duration::from_millis(50));
        assert!(crate::reaper::settle(Duration::from_secs(5)));
    }

    #[test]
    fn a_lease_of_an_ended_connection_is_never_released_on_the_next() {
        let (dir, server, link, lease) = leased();
        let pending = Arc::new(Pending::default());
        let guard = LeaseGuard::new(&link, &pending, lease, "x".into(), Vec::new());
        let path = server.path().to_owned();
        drop(server);
        let deadline = Instant::now() + Duration::from_secs(5);
        while link.is_alive() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        // Another server on the socket, where the new connection holds a
        // lease with the old one's id.
        let again = Server::bind(ServerConfig::new(&path)).unwrap();
        again.publish("x", json!({}), Vec::new()).unwrap();
        let _one = link.connect_again(Duration::from_secs(5)).unwrap();
        let taken = link.client().attach("x").unwrap().lease;
        assert_eq!(taken, lease.id, "the same id on the new connection");
        assert_eq!(guard.standing(link.epoch()), Standing::Gone);
        assert!(matches!(
            guard.current_on(&link.now()),
            Err(Error::Channel(ChannelError::PeerGone))
        ));
        guard.end().unwrap();
        drop(guard);
        assert!(crate::reaper::settle(Duration::from_secs(5)));
        assert_eq!(again.leases().len(), 1, "the new connection's lease stays");
        drop(dir);
    }
}
