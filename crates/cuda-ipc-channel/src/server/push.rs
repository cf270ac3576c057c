//! Push: an entry handed to a stream's subscribers with a lease each,
//! granted by the server at once, so that a subscriber takes it without
//! asking.
//!
//! A stream is an entry like any other (a metadata-only one does); its
//! subscribers are the clients holding a lease on it. [`Server::push`]
//! grants each of them a new lease on the pushed entry and tells it, as an
//! [`Update`](crate::Notice::Updated) on its stream lease whose notice is
//! `{"pushed": {"lease": L, "name": N, "meta": M}}` ([`PushedEntry`](crate::PushedEntry)):
//! the lease is held from that moment, and counted against the client as
//! any other. The notice carries no descriptors, so it takes the
//! shared-memory path where the connection has one: a subscriber gets an
//! entry with one write to shared memory and one wake-up, no request and
//! no answer. Whatever needs descriptors (a mapping the subscriber has not
//! made yet) it asks for as ever.
//!
//! # Bounds
//! A subscriber holds at most `limit` leases pushed through one stream
//! lease at once (taken or not, until it releases them): a subscriber that
//! never takes what is pushed costs the pusher at most `limit` leases (and
//! the entries they keep), and is skipped ([`PushReport::skipped`]) until
//! it releases some; the connection's own lease limit holds too. Nothing
//! a subscriber does makes a push wait: a notice it does not read fills
//! its own queue, whose limits end its own connection.
//!
//! # Releases
//! A pushed lease is released as any other: by the subscriber, or when its
//! connection ends. A subscriber that stops taking (drops its stream)
//! releases what it was pushed and did not take; the pushes in flight at
//! that moment are held until its connection ends, at most `limit`.

use serde_json::Value;

use crate::wire::{Message, PUSHED_KEY};
use crate::{ChannelError, lock};

use super::Server;
use super::state::Body;

/// What [`Server::push`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PushReport {
    /// The leases granted, one per subscriber told.
    pub leases: Vec<u64>,
    /// Subscribers skipped (their stream lease), each at its bound or at
    /// its connection's lease limit.
    pub skipped: Vec<u64>,
}

impl Server {
    /// Pushes the published entry `name` to every subscriber of the stream
    /// `stream` (every client holding a lease on the entry published as
    /// `stream`): each is granted a lease on it and told (see the module
    /// docs), unless it holds `limit` pushed leases of that stream lease
    /// already or its connection is at its lease limit. Never blocks on
    /// clients.
    ///
    /// # Errors
    /// [`ChannelError::NotFound`] when `name` or `stream` is not
    /// published (nothing is pushed), [`ChannelError::ShutDown`];
    /// [`ChannelError::InvalidArgument`] when either is a ring.
    pub fn push(&self, name: &str, stream: &str, limit: usize) -> Result<PushReport, ChannelError> {
        let mut guard = lock(&self.shared.state);
        let st = &mut *guard;
        let eid = st.published_id(name)?;
        let sid = st.published_id(stream)?;
        let (Some(entry), Some(stream_entry)) = (st.entries.get(&eid), st.entries.get(&sid)) else {
            return Err(ChannelError::NotFound { name: name.into() });
        };
        if !matches!(entry.body, Body::Plain { .. })
            || !matches!(stream_entry.body, Body::Plain { .. })
        {
            return Err(ChannelError::arg(
                "entry",
                "rings are not pushed, nor pushed through: push plain entries to a plain stream",
            ));
        }
        let meta = Value::clone(&entry.meta);
        let subscribers: Vec<u64> = stream_entry.leases.iter().copied().collect();
        let mut report = PushReport::default();
        for via in subscribers {
            let Some(conn_id) = st.leases.get(&via).map(|l| l.conn) else {
                continue;
            };
            let Some(conn) = st.conns.get(&conn_id).cloned() else {
                continue;
            };
            let held = st.by_conn.get(&conn_id).map_or(0, |ls| {
                ls.iter()
                    .filter(|l| st.leases.get(l).is_some_and(|l| l.via == Some(via)))
                    .count()
            });
            if held >= limit || st.leases_of(conn_id) >= self.shared.max_leases {
                report.skipped.push(via);
                continue;
            }
            let lease = st.grant_lease(eid, &conn);
            if let Some(l) = st.leases.get_mut(&lease) {
                l.via = Some(via);
            }
            let version = match st.entries.get_mut(&sid).map(|e| &mut e.body) {
                Some(Body::Plain { version, .. }) => {
                    *version += 1;
                    *version
                }
                _ => 0,
            };
            let notice = serde_json::json!({
                PUSHED_KEY: {"lease": lease, "name": name, "meta": meta.clone()}
            });
            conn.push(
                Message::Update {
                    lease: via,
                    name: stream.into(),
                    version,
                    notice,
                },
                Vec::new(),
                self.shared.max_queued,
            );
            report.leases.push(lease);
        }
        Ok(report)
    }
}
