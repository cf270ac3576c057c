//! A lease held by every view of what it covers.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use crate::buffer::{Hold, Mapping};
use crate::channel::{Client, Notice};
use crate::error::{Error, Result};

use super::lock;

/// Notices that arrived for a lease other than the one being waited on.
pub(super) type Pending = Mutex<HashMap<u64, VecDeque<Notice>>>;

/// A lease, held by every view of what it covers and released to the
/// channel when the last of them is gone (or by an explicit release).
pub(super) struct LeaseGuard {
    lease: u64,
    name: String,
    client: Weak<Client>,
    pending: Weak<Pending>,
    /// The mappings the lease covers, whose streams are waited for before
    /// the lease ends.
    mappings: Mutex<Vec<Arc<dyn Mapping>>>,
    released: AtomicBool,
}

impl std::fmt::Debug for LeaseGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseGuard")
            .field("lease", &self.lease)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Hold for LeaseGuard {}

impl LeaseGuard {
    pub(super) fn new(
        client: &Arc<Client>,
        pending: &Arc<Pending>,
        lease: u64,
        name: String,
        mappings: Vec<Arc<dyn Mapping>>,
    ) -> Arc<Self> {
        Arc::new(LeaseGuard {
            lease,
            name,
            client: Arc::downgrade(client),
            pending: Arc::downgrade(pending),
            mappings: Mutex::new(mappings),
            released: AtomicBool::new(false),
        })
    }

    /// Fails with [`Error::ViewsAlive`] when views other than `own` hold the lease.
    pub(super) fn check_no_views(self: &Arc<Self>, own: usize) -> Result<()> {
        // Only views hold strong references, and new views are made only
        // from existing ones, so the count can't grow while we hold none
        // but `own`.
        let views = Arc::strong_count(self).saturating_sub(own);
        if views > 0 {
            return Err(Error::ViewsAlive {
                name: self.name.clone(),
                lease: self.lease,
                views,
            });
        }
        Ok(())
    }

    /// Ends the lease once: waits for the streams the views used, drops the
    /// mappings (unmapped if no other lease shares them), then tells the
    /// publisher. The lease is released even when a wait failed (the first
    /// failure is returned).
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
        drop(mappings);
        if let Some(pending) = self.pending.upgrade() {
            lock(&pending).remove(&self.lease);
        }
        // Without the client the connection is closed, and the publisher
        // has released the lease already.
        if let Some(client) = self.client.upgrade() {
            client.release(self.lease)?;
        }
        waited
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        // The last view is gone. Errors cannot be raised from drop.
        if let Err(e) = self.end() {
            tracing::warn!(lease = self.lease, name = %self.name, error = %e, "releasing a lease failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use serde_json::json;

    use super::*;
    use crate::channel::{ClientConfig, Server, ServerConfig};

    /// A real server and client over a socket in a temporary directory, and
    /// a lease on the entry "x".
    fn leased() -> (tempfile::TempDir, Server, Arc<Client>, u64) {
        let dir = tempfile::tempdir().unwrap();
        let server = Server::bind(ServerConfig::new(dir.path().join("s.sock"))).unwrap();
        server.publish("x", json!({}), Vec::new()).unwrap();
        let client = Arc::new(Client::connect(server.path(), ClientConfig::default()).unwrap());
        let lease = client.attach("x").unwrap().lease;
        assert_eq!(server.leases().len(), 1);
        (dir, server, client, lease)
    }

    #[test]
    fn the_last_view_releases_the_lease() {
        let (_dir, server, client, lease) = leased();
        let pending = Arc::new(Pending::default());
        lock(&pending).insert(lease, VecDeque::new());
        let guard = LeaseGuard::new(&client, &pending, lease, "x".into(), Vec::new());
        let views: Vec<_> = (0..3).map(|_| guard.clone()).collect();
        drop(guard);
        drop(views[..2].to_vec());
        assert_eq!(server.leases().len(), 1, "a view is still alive");
        drop(views);
        assert!(server.leases().is_empty(), "{:?}", server.leases());
        assert!(
            lock(&pending).is_empty(),
            "notices of the lease are dropped"
        );
    }

    #[test]
    fn an_explicit_release_refuses_while_views_live() {
        let (_dir, server, client, lease) = leased();
        let pending = Arc::new(Pending::default());
        let guard = LeaseGuard::new(&client, &pending, lease, "x".into(), Vec::new());
        let view = guard.clone();
        let e = guard.check_no_views(1).unwrap_err();
        assert!(
            matches!(&e, Error::ViewsAlive { views: 1, lease: l, .. } if *l == lease),
            "{e}"
        );
        assert!(e.to_string().contains("1 other view"), "{e}");
        assert_eq!(server.leases().len(), 1);
        drop(view);
        guard.check_no_views(1).unwrap();
        guard.end().unwrap();
        assert!(server.leases().is_empty());
        // Ended once: the drop that follows does not release again.
        drop(guard);
        assert!(client.is_alive());
    }

    #[test]
    fn a_lease_outliving_its_client_ends_quietly() {
        let (_dir, server, client, lease) = leased();
        let pending = Arc::new(Pending::default());
        let guard = LeaseGuard::new(&client, &pending, lease, "x".into(), Vec::new());
        drop(client);
        drop(pending);
        guard.end().unwrap();
        drop(guard);
        // The server notices the closed connection on its own.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !server.leases().is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(server.leases().is_empty());
    }
}
