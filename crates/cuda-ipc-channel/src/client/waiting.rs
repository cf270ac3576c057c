//! How a call waits for its answer: the request and the guard that forgets
//! it ([`Pending`]), sending (through the ring when granted, else on the
//! socket), and the one reader at a time that reads the socket (or the
//! rings) until what it waits for comes, filing everything else it
//! receives for the threads it concerns.

use std::os::fd::OwnedFd;
use std::sync::MutexGuard;
use std::time::Instant;

use super::Client;
use super::demux::{Dead, State};
use super::shm::Batch;
use crate::notices::{is_notice, is_ring_request};
use crate::socket::{RecvLimits, recv_message, send_message};
use crate::wire::Message;
use crate::{ChannelError, lock};

/// How many messages a call reads past its deadline, at most.
const MAX_LATE_READS: usize = 64;

/// Forgets a request when its caller stops waiting, however it stops.
pub(super) struct Pending<'a> {
    client: &'a Client,
    pub(super) id: u64,
    pub(super) deadline: Instant,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        let mut st = lock(&self.client.state);
        st.waiting.remove(&self.id);
        // Leases granted in answers nobody took go back to the server.
        if let Some(left) = st.responses.remove(&self.id) {
            for (m, _fds) in left {
                if let Message::Attached { lease, .. } | Message::RingAttached { lease, .. } = m {
                    st.rings.remove(&lease);
                    st.orphans.push(lease);
                }
            }
        }
        let orphans = std::mem::take(&mut st.orphans);
        drop(st);
        self.client.release_quietly(orphans);
    }
}

impl Client {
    /// Sends a request and registers its id; the returned guard forgets it.
    pub(super) fn request(
        &self,
        make: impl FnOnce(u64) -> Message,
        ring_name: Option<&str>,
    ) -> Result<Pending<'_>, ChannelError> {
        let id = {
            let mut st = lock(&self.state);
            if let Some(d) = &st.dead {
                return Err(d.error());
            }
            let id = st.next_id();
            st.waiting.insert(id, ring_name.map(str::to_owned));
            id
        };
        let pending = Pending {
            client: self,
            id,
            deadline: crate::deadline_in(self.timeout),
        };
        self.send(&make(id))?;
        Ok(pending)
    }

    /// Sends an attach of the entry `name` (checked by the caller).
    pub(super) fn request_attach(&self, name: &str) -> Result<Pending<'_>, ChannelError> {
        self.request(
            |id| Message::Attach {
                id,
                name: name.into(),
            },
            None,
        )
    }

    /// Waits for the next answer to a request.
    pub(super) fn response(
        &self,
        p: &Pending<'_>,
        what: &str,
    ) -> Result<(Message, Vec<OwnedFd>), ChannelError> {
        self.wait_for(p.deadline, what, self.limits, |st| st.take_response(p.id))
    }

    /// Sends one message (without descriptors) within the request timeout:
    /// a request through the ring when the server granted it and it fits
    /// (with the count of socket messages sent before it), else on the
    /// socket.
    pub(super) fn send(&self, message: &Message) -> Result<(), ChannelError> {
        let mut sent = lock(&self.write);
        if let Some(shm) = self.shm.as_ref().filter(|s| s.requests)
            && is_ring_request(message)
        {
            match shm.request(*sent, message) {
                Ok(true) => {
                    lock(&self.state).stats.shm_requests += 1;
                    return Ok(());
                }
                // No room: the socket, in order by the count.
                Ok(false) => {}
                Err(e) => {
                    self.broken(&e);
                    return Err(e);
                }
            }
        }
        send_message(
            &self.stream,
            message,
            &[],
            Some(crate::deadline_in(self.timeout)),
        )
        .map_err(|e| {
            // A message cut in half leaves the stream unusable. (After
            // PeerGone, reading still delivers what the server sent last.)
            if matches!(e, ChannelError::Protocol { .. } | ChannelError::Io { .. }) {
                self.broken(&e);
            }
            e
        })?;
        *sent += 1;
        Ok(())
    }

    /// Marks the connection unusable after `e`, and wakes the waiters.
    pub(super) fn broken(&self, e: &ChannelError) {
        let mut st = lock(&self.state);
        if st.dead.is_none() {
            st.dead = Some(Dead::Protocol(e.to_string()));
        }
        drop(st);
        self.filed.notify_all();
    }

    /// Gives leases back without waiting for the answers.
    pub(super) fn release_quietly(&self, leases: Vec<u64>) {
        for lease in leases {
            let id = {
                let mut st = lock(&self.state);
                st.forget(lease);
                if st.dead.is_some() {
                    return;
                }
                st.next_id()
            };
            // Nobody waits for id, so the answer is dropped when it comes.
            let _ = self.send(&Message::Release { id, lease });
        }
    }

    /// Waits until `take` finds what it looks for in the state, reading the
    /// socket (if no other thread is) until `deadline`. Messages that have
    /// already arrived are always read before giving up, so a zero timeout
    /// polls without blocking.
    pub(super) fn wait_for<T>(
        &self,
        deadline: Instant,
        what: &str,
        limits: RecvLimits,
        mut take: impl FnMut(&mut State) -> Option<T>,
    ) -> Result<T, ChannelError> {
        let started = Instant::now();
        // Whether a read of ours found nothing more before the deadline.
        let mut drained = false;
        // Messages read past the deadline: a few that had arrived are still
        // taken, but a server that keeps sending cannot hold us.
        let mut late = 0;
        let mut st = lock(&self.state);
        loop {
            if let Some(v) = take(&mut st) {
                return Ok(v);
            }
            if let Some(d) = &st.dead {
                return Err(d.error());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            // Another thread is reading: it files what arrives.
            if st.reading {
                if left.is_zero() {
                    return Err(timeout(what, started));
                }
                st = self
                    .filed
                    .wait_timeout(st, left)
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .0;
                continue;
            }
            if left.is_zero() && (drained || late >= MAX_LATE_READS) {
                return Err(timeout(what, started));
            }
            if left.is_zero() {
                late += 1;
            }
            st.reading = true;
            drop(st);
            // Past the deadline this still takes messages that have arrived.
            let received = match &self.shm {
                Some(shm) => self.receive_shm(shm, deadline, limits),
                None => match recv_message(&self.stream, Some(deadline), limits) {
                    Ok((m, fds)) => Batch {
                        messages: vec![(m, fds, false)],
                        error: None,
                    },
                    Err(e) => Batch {
                        messages: Vec::new(),
                        error: Some(e),
                    },
                },
            };
            drained = matches!(received.error, Some(ChannelError::Timeout { .. }));
            st = self.file(received);
        }
    }

    /// Files what the reader received, steps down as reader, and wakes
    /// the other waiters.
    pub(super) fn file(&self, received: Batch) -> MutexGuard<'_, State> {
        let mut st = lock(&self.state);
        st.reading = false;
        for (message, fds, via_ring) in received.messages {
            if is_notice(&message) {
                if via_ring {
                    st.stats.shm_notices += 1;
                } else {
                    st.stats.socket_notices += 1;
                }
            } else if via_ring {
                st.stats.shm_replies += 1;
            }
            st.dispatch(message, fds);
        }
        match received.error {
            None | Some(ChannelError::Timeout { .. }) => {}
            Some(e) => {
                if st.dead.is_none() {
                    st.dead = Some(Dead::from_error(e));
                }
            }
        }
        self.filed.notify_all();
        if st.orphans.is_empty() {
            return st;
        }
        let orphans = std::mem::take(&mut st.orphans);
        drop(st);
        self.release_quietly(orphans);
        lock(&self.state)
    }
}

/// The timeout error for `what`, waited for since `started`.
fn timeout(what: &str, started: Instant) -> ChannelError {
    ChannelError::Timeout {
        what: what.to_owned(),
        after: started.elapsed(),
    }
}
