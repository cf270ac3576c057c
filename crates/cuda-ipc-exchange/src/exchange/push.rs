//! Push, not pull: sets handed to the subscribers of a stream as they are
//! published, for hand-offs where the producer knows who takes what (KV
//! cache blocks from a prefill process to a decode process).
//!
//! A pull attach pays a request to the publisher's server thread and its
//! answer. A push pays neither: [`Publisher::push_set`] has the server
//! grant every subscriber of the stream a lease on the set and tell it,
//! through the connection's shared-memory ring where there is one
//! ([`Server::push`](crate::channel::Server::push)), so
//! [`Subscriber::next_pushed_set`] reads the record, uses the chunk
//! mappings it keeps and waits on the set's event or fence: no system
//! call but the wake-up.
//!
//! ```text
//! producer                                  consumer
//! publish_stream("kv")                      let s = subscribe("kv")
//! publish_set("block.7", ..)
//! push_set("block.7", "kv")  ── notice ──▶  next_pushed_set(&s, timeout)  (a SetAttachment)
//! ```
//!
//! # What a push does not carry
//! No descriptors: a pushed set whose chunks this subscriber has not mapped
//! yet has them fetched as a pull attach does (once per chunk), and one
//! whose fence it has not mapped yet is attached again by name, once (a
//! pull), which maps the fence for the pushes after it.
//!
//! # Bounds, and a consumer that does not take
//! A subscriber holds at most [`PUSH_LIMIT`] leases pushed through one
//! subscription at once, taken or not, until it releases them: one that
//! never takes what is pushed costs the producer at most that many leases
//! (and the memory of the sets they keep), and is skipped (in
//! [`PushReport::skipped`]) until it releases some; a push never waits on
//! a subscriber. [`Subscriber::unsubscribe`] releases what was pushed and
//! not taken; a [`Stream`] dropped instead ends its subscription and
//! leaves what was pushed and not taken held until the connection ends
//! (at most [`PUSH_LIMIT`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::channel::{self, ChannelError, Notice, PushReport, PushedEntry};
use crate::error::{Error, Result};
use crate::phases::Phases;

use super::lease::{LeaseGuard, LeaseId};
use super::link::Connection;
use super::lock;
use super::set_attachment::SetAttachment;
use super::set_book::is_set_meta;
use super::{Publisher, Subscriber, SyncMode, sync};

/// The most leases a subscriber holds pushed through one subscription.
pub const PUSH_LIMIT: usize = 64;

/// The metadata key of a stream entry.
const STREAM_KEY: &str = "stream";

/// A subscription to a stream ([`Subscriber::subscribe`]): its lease on
/// the stream's entry, released when it drops (or by
/// [`Subscriber::unsubscribe`], which also releases what was pushed and not
/// taken).
#[derive(Debug)]
pub struct Stream {
    name: String,
    lease: u64,
    guard: Arc<LeaseGuard>,
}

impl Stream {
    /// The stream's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The lease the subscription holds on the stream's entry (what the
    /// publisher's pushes go through).
    pub fn lease(&self) -> u64 {
        self.lease
    }
}

impl Publisher {
    /// Publishes a stream called `name`: an entry with no memory that
    /// subscribers attach ([`Subscriber::subscribe`]) to be pushed sets.
    ///
    /// # Errors
    /// The channel's refusals of the name (taken, invalid).
    pub fn publish_stream(&self, name: &str) -> Result<()> {
        self.server
            .publish(name, json!({ STREAM_KEY: true }), Vec::new())?;
        Ok(())
    }

    /// Pushes the published set `name` to every subscriber of the stream
    /// `stream` (see the module docs): each is granted a lease and told,
    /// unless it holds [`PUSH_LIMIT`] pushed leases already. Never waits on
    /// a subscriber.
    ///
    /// # Errors
    /// [`ChannelError::NotFound`] when `name` or `stream` is not published.
    pub fn push_set(&self, name: &str, stream: &str) -> Result<PushReport> {
        Ok(self.server.push(name, stream, PUSH_LIMIT)?)
    }
}

impl Subscriber {
    /// Subscribes to the publisher's stream `stream`: what it pushes from
    /// now on comes with [`next_pushed_set`](Self::next_pushed_set).
    ///
    /// # Errors
    /// [`ChannelError::NotFound`] when no such stream is published; an
    /// [`Error::InvalidArgument`] when `stream` is an entry of another kind.
    pub fn subscribe(&self, stream: &str) -> Result<Stream> {
        self.on_link(true, |conn| {
            let a = conn.client.attach(stream)?;
            if a.meta.get(STREAM_KEY) != Some(&Value::Bool(true)) {
                let _ = conn.client.release(a.lease);
                return Err(Error::arg(
                    "stream",
                    format!("{stream:?} is not a stream (Publisher::publish_stream makes one)"),
                ));
            }
            let lease = LeaseId {
                id: a.lease,
                epoch: conn.epoch,
            };
            Ok(Stream {
                name: a.name.clone(),
                lease: a.lease,
                guard: LeaseGuard::new(&self.link, &self.pending, lease, a.name, Vec::new()),
            })
        })
    }

    /// The next set pushed to `stream`, attached: its record read, its
    /// chunks mapped (from the cache), its event or fence waited on as a
    /// pull attach's are. Waits up to `timeout` for one.
    ///
    /// # Errors
    /// [`ChannelError::Timeout`]; [`ChannelError::Unpublished`] when the
    /// stream is unpublished; [`ChannelError::PeerGone`]; a pushed entry
    /// that is not a set (its lease released); an attach's errors.
    pub fn next_pushed_set(&self, stream: &Stream, timeout: Duration) -> Result<SetAttachment> {
        let deadline = crate::channel::deadline_in(timeout);
        // A stream ends with its connection: not taken back.
        let conn = self.link.now();
        stream.guard.current_on(&conn)?;
        loop {
            let notice = self.next_notice(&conn, stream.lease, deadline)?;
            match notice {
                Notice::Updated { data, .. } => {
                    // A plain update of the stream has nothing to take.
                    if let Some(pushed) = PushedEntry::from_notice(&data) {
                        return self.open_pushed(&conn, pushed?);
                    }
                }
                Notice::Unpublished => {
                    return Err(ChannelError::Unpublished {
                        name: stream.name.clone(),
                        lease: stream.lease,
                    }
                    .into());
                }
                other => {
                    return Err(ChannelError::Protocol {
                        reason: format!("a notice this version does not know: {other:?}"),
                    }
                    .into());
                }
            }
        }
    }

    /// Ends the subscription: releases every lease pushed to it and not
    /// taken (received or not yet: waits up to the subscriber's timeout
    /// for the notices in flight), then the stream's lease. Returns how
    /// many pushed leases it released.
    ///
    /// # Errors
    /// The releases' ([`ChannelError::PeerGone`] is none: the connection's
    /// end released them).
    pub fn unsubscribe(&self, stream: Stream) -> Result<usize> {
        let mut released = 0;
        let conn = self.link.now();
        // Whatever the client has received for the stream, filed or not
        // (nothing once its connection has ended).
        while stream.guard.current_on(&conn).is_ok()
            && let Ok(n) = self.next_notice(&conn, stream.lease, Instant::now())
        {
            if let Notice::Updated { data, .. } = n
                && let Some(Ok(p)) = PushedEntry::from_notice(&data)
            {
                match conn.client.release(p.lease) {
                    Ok(()) | Err(ChannelError::PeerGone) => released += 1,
                    Err(e) => return Err(e.into()),
                }
            }
        }
        let Stream { guard, .. } = stream;
        guard.end()?;
        Ok(released)
    }

    /// The next notice on `lease`: filed for it already, or from the
    /// client by `deadline` (filing those of other leases).
    fn next_notice(&self, conn: &Connection, lease: u64, deadline: Instant) -> Result<Notice> {
        loop {
            if let Some(n) = lock(&self.pending)
                .get_mut(&lease)
                .and_then(std::collections::VecDeque::pop_front)
            {
                return Ok(n);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let u = conn.client.next_update(left)?;
            if u.lease == lease {
                return Ok(u.notice);
            }
            lock(&self.pending)
                .entry(u.lease)
                .or_default()
                .push_back(u.notice);
        }
    }

    /// Attaches a pushed set locally. Its fence, when it has one this
    /// subscriber has not mapped, is left out where the event serves
    /// (`SyncMode::Auto` or `Event`); where only the fence serves, or the
    /// local attach fails without it, the set is attached once by name (a
    /// pull, which maps the fence for the pushes after it) and the pushed
    /// lease goes.
    fn open_pushed(&self, conn: &Connection, pushed: PushedEntry) -> Result<SetAttachment> {
        let mut phases = Phases::start("core.next_pushed_set");
        if !is_set_meta(&pushed.meta) {
            let _ = conn.client.release(pushed.lease);
            return Err(Error::arg(
                "pushed entry",
                format!("{:?} is not a set; only sets are pushed", pushed.name),
            ));
        }
        let mut without_fence = pushed.meta.clone();
        let fence = sync::take_set_fence(&mut without_fence)?;
        let mapped = fence
            .as_ref()
            .is_some_and(|f| lock(&self.fences).contains_key(&f.block.id()));
        let event_serves = matches!(self.sync, SyncMode::Auto | SyncMode::Event);
        let name = pushed.name.clone();
        let mut a: channel::Attachment = pushed.into_attachment();
        if fence.is_none() || mapped {
            return self.open_set(conn, a, self.access, &mut phases);
        }
        if event_serves {
            a.meta = without_fence;
            if let Ok(set) = self.open_set(conn, a, self.access, &mut phases) {
                return Ok(set);
            }
        } else {
            let _ = conn.client.release(a.lease);
        }
        let pulled = conn.client.attach(&name)?;
        phases.mark("pull");
        self.open_set(conn, pulled, self.access, &mut phases)
    }
}
