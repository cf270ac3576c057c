//! One client connection and its writer: queued replies, the writer thread.

use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use rustix::net::{Shutdown, shutdown};
use serde_json::Value;

use crate::notices::{encode_binary_record, encode_record, is_notice, is_ring_reply};
use crate::socket::{Ucred, encode_checked, send_bytes, try_send_bytes, unread_by_peer};
use crate::wire::Message;
use crate::{ChannelError, lock};

use super::{FINAL_SEND_TIMEOUT, error_frame};

/// What a subscriber is sent about a slot when it subscribes: fixed for the
/// ring's life, shared with the connections still sending it.
pub(super) struct SlotSource {
    pub(super) meta: Value,
    pub(super) fds: Vec<OwnedFd>,
}

/// A connection's reader takes no new request while this many bytes of
/// answers wait to be sent to it.
pub(super) const WINDOW_BYTES: usize = 64 * 1024;

/// The first pause of a writer waiting for its client to take the
/// descriptors already sent ([`Conn::wait_fd_room`]).
const FD_ROOM_FIRST_PAUSE: Duration = Duration::from_micros(20);
/// The longest pause while the client may just be slow.
const FD_ROOM_PAUSE: Duration = Duration::from_millis(5);
/// After this long without the client taking its descriptors...
const FD_ROOM_PATIENCE: Duration = Duration::from_millis(100);
/// ... the pauses grow to this: 128 connections that read nothing, each
/// polled every 5 ms until the send timeout, took 37 % of a core of the
/// 2-core development machine (the hostile-peers example's no-read).
const FD_ROOM_SLOW_PAUSE: Duration = Duration::from_millis(50);

/// The pause after `last`, having waited `waited`: doubling, up to
/// [`FD_ROOM_PAUSE`] for [`FD_ROOM_PATIENCE`], then up to
/// [`FD_ROOM_SLOW_PAUSE`].
fn fd_room_pause(last: Duration, waited: Duration) -> Duration {
    let cap = if waited < FD_ROOM_PATIENCE {
        FD_ROOM_PAUSE
    } else {
        FD_ROOM_SLOW_PAUSE
    };
    (last * 2).min(cap)
}

/// A wire message waiting for the writer thread, encoded, with the
/// descriptors that go with its first byte (none once its start went).
pub(super) struct Outgoing {
    pub(super) bytes: Vec<u8>,
    pub(super) fds: Vec<OwnedFd>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum OutState {
    /// Accepting messages.
    Open,
    /// Send what is queued, then stop.
    Draining,
    /// Stop now; the queue is cleared.
    Closed,
}

/// The slot messages of a ring subscription still to send: made one at a
/// time as the client takes them, so that a subscriber that does not read
/// pins no more duplicated descriptors than one message carries.
pub(super) struct SlotFeed {
    /// The `attach_ring` request.
    pub(super) id: u64,
    pub(super) lease: u64,
    pub(super) sources: Arc<[SlotSource]>,
    /// The next slot to send.
    pub(super) next: usize,
}

pub(super) struct Outbox {
    pub(super) queue: VecDeque<Outgoing>,
    /// Ring subscriptions whose slot messages are still to be made.
    pub(super) feed: VecDeque<SlotFeed>,
    pub(super) state: OutState,
    /// The writer thread is sending a message it took from the queue.
    pub(super) sending: bool,
    /// Bytes queued, and in the message being sent.
    pub(super) bytes: usize,
    /// Descriptors queued, and in the message being sent (our duplicates).
    pub(super) fds: usize,
    /// Descriptors sent since the client was last seen to have received
    /// everything.
    pub(super) unread_fds: usize,
    /// Socket messages put in the stream so far (queued, sent, or made
    /// from the feed): the count a shared-memory record carries (see
    /// [`notices`](crate::notices)).
    pub(super) pushed: u64,
    /// The ring that carries notices to the client, when it asked for it.
    pub(super) shm: Option<cuda_ipc_shm::Sender>,
    /// The client was granted requests through the rings: answers without
    /// descriptors may go through `shm` too.
    pub(super) ring_replies: bool,
}

impl Outbox {
    pub(super) fn new() -> Outbox {
        Outbox {
            queue: VecDeque::new(),
            feed: VecDeque::new(),
            state: OutState::Open,
            sending: false,
            bytes: 0,
            fds: 0,
            unread_fds: 0,
            pushed: 0,
            shm: None,
            ring_replies: false,
        }
    }

    /// Puts a notice already in binary form (`record`, its count still to
    /// be written) in the client's ring, if the connection is open, has a
    /// ring with room, and nothing waits for the socket: whether it went.
    fn ring_binary_locked(&mut self, mut record: Vec<u8>) -> Result<bool, ChannelError> {
        if self.state != OutState::Open || !self.flushed() {
            return Ok(false);
        }
        let Some(tx) = self.shm.as_mut() else {
            return Ok(false);
        };
        record[..8].copy_from_slice(&self.pushed.to_le_bytes());
        tx.send(&record).map_err(crate::notices::shm_error)
    }

    /// Puts a notice (`bytes`, a wire message) in the client's ring, if it
    /// has one with room: whether it went.
    fn ring(&mut self, bytes: &[u8]) -> Result<bool, ChannelError> {
        let Some(tx) = self.shm.as_mut() else {
            return Ok(false);
        };
        let record = encode_record(self.pushed, bytes);
        tx.send(&record).map_err(crate::notices::shm_error)
    }

    /// Whether nothing waits to be written to the socket: every message
    /// counted in `pushed` is in the kernel's hands.
    fn flushed(&self) -> bool {
        self.queue.is_empty() && !self.sending && self.feed.is_empty()
    }
}

/// What one connection may hold.
#[derive(Clone, Copy)]
pub(super) struct ConnLimits {
    /// Messages queued before the client is cut off as stuck.
    pub(super) max_queued: usize,
    /// Bytes queued before the client is cut off as stuck.
    pub(super) max_queued_bytes: usize,
    /// Descriptors in flight to the client.
    pub(super) max_unread_fds: usize,
    /// How long the client may leave a message (or its descriptors) unread.
    pub(super) send_timeout: Duration,
}

pub(super) struct Conn {
    pub(super) id: u64,
    pub(super) stream: UnixStream,
    pub(super) cred: Ucred,
    pub(super) limits: ConnLimits,
    pub(super) out: Mutex<Outbox>,
    pub(super) out_ready: Condvar,
    /// When the client last sent a request (or connected).
    pub(super) active: Mutex<Instant>,
}

/// The request id a reply answers, for the error that replaces a reply
/// too long to send.
fn request_id(message: &Message) -> Option<u64> {
    match message {
        Message::Listing { id, .. }
        | Message::Attached { id, .. }
        | Message::Released { id }
        | Message::RingAttached { id, .. }
        | Message::RingSlot { id, .. }
        | Message::Pong { id } => Some(*id),
        Message::Error { id, .. } => *id,
        _ => None,
    }
}

impl Conn {
    /// Sends a notice through the client's ring in binary form, if it has
    /// one (see [`Outbox::ring_binary_locked`]): `Some(true)` if it went,
    /// `Some(false)` if the connection failed, `None` if it must go on the
    /// socket (then `notice` is cleared if the ring was tried: what did not
    /// fit in binary goes as JSON on the socket, not in the ring).
    fn ring_binary(&self, message: &Message, notice: &mut bool) -> Option<bool> {
        let record = encode_binary_record(0, message)?;
        *notice = false;
        let mut out = lock(&self.out);
        match out.ring_binary_locked(record) {
            Ok(true) => Some(true),
            Ok(false) => None,
            Err(e) => {
                drop(out);
                self.send_failed(&e);
                Some(false)
            }
        }
    }

    /// Sends a message: at once from the calling thread when nothing is
    /// queued or being sent and the socket takes it without waiting (no
    /// thread hop), else through the writer thread's queue. A client with
    /// too many unread messages or bytes is disconnected. Returns whether
    /// the message was sent or queued. A reply too long for the wire is
    /// replaced by an error answering the same request.
    // Callers build the message for this call; it is theirs no longer.
    #[allow(clippy::needless_pass_by_value)]
    // One path per outcome, in order; splitting it would spread the lock.
    #[allow(clippy::too_many_lines)]
    pub(super) fn push(&self, message: Message, fds: Vec<OwnedFd>, _max_queued: usize) -> bool {
        let mut notice = fds.is_empty() && is_notice(&message);
        if notice && let Some(sent) = self.ring_binary(&message, &mut notice) {
            return sent;
        }
        // An answer may take the ring too, if the client was granted it.
        let reply = fds.is_empty() && is_ring_reply(&message);
        let encoded = {
            let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(AsFd::as_fd).collect();
            encode_checked(&message, &borrowed)
        };
        let (bytes, fds, notice) = match encoded {
            Ok(bytes) => (bytes, fds, notice),
            Err(ChannelError::Wire(e)) => {
                tracing::warn!(
                    pid = self.cred.pid,
                    error = %e,
                    kind = message.type_name(),
                    "a reply does not fit in a wire message; answering with an error"
                );
                let error = error_frame(
                    request_id(&message),
                    "reply_too_large",
                    format!(
                        "the {:?} answer does not fit in a wire message: {e}",
                        message.type_name()
                    ),
                );
                match encode_checked(&error, &[]) {
                    Ok(bytes) => (bytes, Vec::new(), false),
                    Err(e) => {
                        self.send_failed(&e);
                        return false;
                    }
                }
            }
            Err(e) => {
                self.send_failed(&e);
                return false;
            }
        };
        let mut out = lock(&self.out);
        if out.state != OutState::Open {
            return false;
        }
        // Through the ring only once every earlier socket message is in
        // the kernel's hands, with their count (see `crate::notices`).
        if (notice || (reply && out.ring_replies)) && out.flushed() {
            match out.ring(&bytes) {
                Ok(true) => return true,
                // No ring, full, or too long: the socket, in order.
                Ok(false) => {}
                Err(e) => {
                    drop(out);
                    self.send_failed(&e);
                    return false;
                }
            }
        }
        out.pushed += 1;
        if out.queue.is_empty() && !out.sending && self.fd_room(&mut out, fds.len()) {
            // Under the lock, so that no other message can start meanwhile.
            let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(AsFd::as_fd).collect();
            match try_send_bytes(&self.stream, &bytes, &borrowed) {
                Ok(0) => {}
                Ok(sent) => {
                    out.unread_fds += fds.len();
                    if sent == bytes.len() {
                        return true;
                    }
                    let rest = bytes[sent..].to_vec();
                    out.bytes += rest.len();
                    out.queue.push_back(Outgoing {
                        bytes: rest,
                        fds: Vec::new(),
                    });
                    drop(out);
                    self.out_ready.notify_all();
                    return true;
                }
                Err(e) => {
                    drop(out);
                    self.send_failed(&e);
                    return false;
                }
            }
        }
        if out.queue.len() >= self.limits.max_queued
            || out.bytes + bytes.len() > self.limits.max_queued_bytes
        {
            tracing::warn!(
                pid = self.cred.pid,
                uid = self.cred.uid,
                queued = out.queue.len(),
                bytes = out.bytes,
                "disconnecting a client that does not read its socket"
            );
            out.queue.clear();
            out.state = OutState::Closed;
            drop(out);
            self.out_ready.notify_all();
            let _ = shutdown(&self.stream, Shutdown::Both);
            return false;
        }
        out.bytes += bytes.len();
        out.fds += fds.len();
        out.queue.push_back(Outgoing { bytes, fds });
        drop(out);
        self.out_ready.notify_all();
        true
    }

    /// Whether `count` more descriptors may go to the client now: within
    /// the limit of descriptors in flight, or the client has received
    /// everything sent so far (which resets the count).
    fn fd_room(&self, out: &mut Outbox, count: usize) -> bool {
        if count == 0 || out.unread_fds + count <= self.limits.max_unread_fds {
            return true;
        }
        if unread_by_peer(&self.stream).is_ok_and(|n| n == 0) {
            out.unread_fds = 0;
            return true;
        }
        false
    }

    /// How many of the descriptors we sent the client may still wait in
    /// its receive queue: 0 once `SIOCOUTQ` says it has received (or, by
    /// closing its socket, discarded) everything.
    pub(super) fn unread_fds(&self) -> usize {
        let mut out = lock(&self.out);
        if out.unread_fds > 0 && unread_by_peer(&self.stream).is_ok_and(|n| n == 0) {
            out.unread_fds = 0;
        }
        out.unread_fds
    }

    /// Whether the connection holds nothing in transit: nothing queued or
    /// being sent, no slot messages to make, no descriptors unread.
    pub(super) fn quiet(&self) -> bool {
        let out = lock(&self.out);
        out.queue.is_empty() && out.feed.is_empty() && !out.sending && out.unread_fds == 0
    }

    /// Queues the slot messages of a new ring subscription.
    pub(super) fn feed(&self, feed: SlotFeed) {
        let mut out = lock(&self.out);
        if out.state == OutState::Open {
            out.feed.push_back(feed);
        }
        drop(out);
        self.out_ready.notify_all();
    }

    /// Logs a failed send (unless the client simply went away) and stops
    /// the connection: a message may have been cut in half.
    pub(super) fn send_failed(&self, e: &ChannelError) {
        if !matches!(e, ChannelError::PeerGone) {
            tracing::warn!(
                pid = self.cred.pid,
                uid = self.cred.uid,
                error = %e,
                "disconnecting a client that could not be sent a message"
            );
        }
        self.abort();
    }

    /// Lets the writer send `last` (if any) and stop; drops queued messages.
    /// Only the first call counts.
    pub(super) fn finish(&self, last: Option<Message>) {
        let mut out = lock(&self.out);
        // Once draining, the final message is already queued: a second
        // finish (the session ending after an eviction) must not drop it.
        if out.state == OutState::Open {
            out.queue.clear();
            out.feed.clear();
            out.bytes = 0;
            out.fds = 0;
            if let Some(bytes) = last.and_then(|m| encode_checked(&m, &[]).ok()) {
                out.pushed += 1;
                out.queue.push_back(Outgoing {
                    bytes,
                    fds: Vec::new(),
                });
            }
            out.state = OutState::Draining;
        }
        drop(out);
        self.out_ready.notify_all();
    }

    /// Waits until the client has room for the answer to another request:
    /// fewer than `limit` messages and [`WINDOW_BYTES`] bytes queued, and
    /// none of our duplicated descriptors (nor slot messages to make)
    /// waiting for it; or the connection
    /// stops. (A client that never reads is cut off by the writer's send
    /// timeout, which ends this wait.)
    pub(super) fn wait_for_room(&self, limit: usize) {
        let mut out = lock(&self.out);
        while out.state == OutState::Open
            && (out.queue.len() >= limit
                || out.bytes >= WINDOW_BYTES
                || out.fds > 0
                || !out.feed.is_empty())
        {
            out = self
                .out_ready
                .wait(out)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }

    /// Whether the connection is still served (not closing or closed).
    pub(super) fn open(&self) -> bool {
        lock(&self.out).state == OutState::Open
    }

    /// Stops the connection now: the writer stops, and the reader sees end
    /// of file.
    pub(super) fn abort(&self) {
        let mut out = lock(&self.out);
        out.queue.clear();
        out.feed.clear();
        out.bytes = 0;
        out.fds = 0;
        out.state = OutState::Closed;
        drop(out);
        self.out_ready.notify_all();
        let _ = shutdown(&self.stream, Shutdown::Both);
    }

    /// Waits (polling: the kernel signals no event for it) until the client
    /// has received enough descriptors for `count` more to go, or `deadline`.
    /// The first polls come after 20 µs: a subscriber taking a ring's slot
    /// messages reads them as fast as they come, and waited 4 x 200 µs or
    /// more for a 64-slot ring when polling began at 200 µs. The pauses
    /// then lengthen ([`fd_room_pause`]), so that a client that reads
    /// nothing costs little until the send timeout cuts it off.
    fn wait_fd_room(&self, count: usize, deadline: Instant) -> bool {
        let began = Instant::now();
        let mut pause = FD_ROOM_FIRST_PAUSE;
        loop {
            {
                let mut out = lock(&self.out);
                if out.state == OutState::Closed {
                    return false;
                }
                if self.fd_room(&mut out, count) {
                    return true;
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            std::thread::sleep(pause.min(deadline - now));
            pause = fd_room_pause(pause, began.elapsed());
        }
    }

    /// The next slot message of a ring subscription, made now: its
    /// descriptors duplicated, counted as queued. A duplication that fails
    /// (this process is out of descriptors) answers the subscription with
    /// an error instead, and its remaining slots are dropped.
    fn next_slot(out: &mut Outbox) -> Option<Outgoing> {
        let feed = out.feed.front_mut()?;
        let (id, lease, i) = (feed.id, feed.lease, feed.next);
        let source = &feed.sources[i];
        feed.next += 1;
        let dups: Result<Vec<OwnedFd>, std::io::Error> =
            source.fds.iter().map(OwnedFd::try_clone).collect();
        let message = match dups {
            Ok(fds) => (
                Message::RingSlot {
                    id,
                    lease,
                    slot: i as u32,
                    meta: source.meta.clone(),
                    fds: fds.len() as u16,
                },
                fds,
            ),
            Err(e) => {
                feed.next = feed.sources.len();
                (
                    error_frame(
                        Some(id),
                        "io",
                        format!(
                            "the server cannot duplicate the descriptors of slot {i} for this \
                             subscription: {e}; try again later"
                        ),
                    ),
                    Vec::new(),
                )
            }
        };
        let done = feed.next >= feed.sources.len();
        if done {
            out.feed.pop_front();
        }
        let (message, fds) = message;
        let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(AsFd::as_fd).collect();
        let (bytes, fds) = match encode_checked(&message, &borrowed) {
            Ok(bytes) => (bytes, fds),
            Err(e) => {
                // Cannot happen for a slot's checked metadata; answer
                // rather than stall the subscription.
                if !done {
                    out.feed.pop_front();
                }
                let error = error_frame(
                    Some(id),
                    "reply_too_large",
                    format!("slot {i} of this ring cannot be sent: {e}"),
                );
                (encode_checked(&error, &[]).ok()?, Vec::new())
            }
        };
        out.bytes += bytes.len();
        out.fds += fds.len();
        out.pushed += 1;
        Some(Outgoing { bytes, fds })
    }

    /// Sends notices through `ring` from now on, and answers without
    /// descriptors too if `replies` (see `crate::notices`).
    pub(super) fn set_notice_ring(&self, ring: cuda_ipc_shm::Sender, replies: bool) {
        let mut out = lock(&self.out);
        out.shm = Some(ring);
        out.ring_replies = replies;
    }

    /// The writer thread's loop; with a `meter`, the processor time it
    /// spends is charged to the client's user, and it sleeps while that
    /// user is in debt (see [`CpuBudget`](super::CpuBudget)).
    pub(super) fn write_loop(&self, mut meter: Option<super::stall::CpuMeter>) {
        let send_timeout = self.limits.send_timeout;
        loop {
            if let Some(m) = meter.as_mut() {
                m.charge_and_wait(|| self.open());
            }
            let (next, draining) = {
                let mut out = lock(&self.out);
                loop {
                    // The queue first: what waits there was pushed before
                    // the feed's next slot could be made (a subscription's
                    // `ring_attached` answer, which must come before its
                    // slots, or the rest of a message sent in part).
                    if let Some(o) = out.queue.pop_front() {
                        out.sending = true;
                        break (o, out.state == OutState::Draining);
                    }
                    if out.state == OutState::Open
                        && let Some(o) = Self::next_slot(&mut out)
                    {
                        out.sending = true;
                        break (o, false);
                    }
                    if out.state != OutState::Open {
                        return;
                    }
                    out = self
                        .out_ready
                        .wait(out)
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                }
            };
            let timeout = if draining {
                send_timeout.min(FINAL_SEND_TIMEOUT)
            } else {
                send_timeout
            };
            let deadline = crate::deadline_in(timeout);
            let sent = if next.fds.is_empty() || self.wait_fd_room(next.fds.len(), deadline) {
                let fds: Vec<BorrowedFd<'_>> = next.fds.iter().map(AsFd::as_fd).collect();
                send_bytes(&self.stream, &next.bytes, &fds, Some(deadline))
            } else {
                Err(ChannelError::Timeout {
                    what: "the client to receive the descriptors already sent to it".into(),
                    after: timeout,
                })
            };
            {
                let mut out = lock(&self.out);
                out.sending = false;
                out.bytes = out.bytes.saturating_sub(next.bytes.len());
                out.fds = out.fds.saturating_sub(next.fds.len());
                if sent.is_ok() {
                    out.unread_fds += next.fds.len();
                }
            }
            // The reader may be waiting for room.
            self.out_ready.notify_all();
            if let Err(e) = sent {
                self.send_failed(&e);
                return;
            }
            // `next` drops here: our duplicates of the descriptors close; the
            // client has its own.
        }
    }
}

#[cfg(test)]
mod fd_room_tests {
    use super::*;

    #[test]
    fn descriptor_room_is_polled_soon_then_seldom() {
        // From 20 µs, doubling: 40, 80, ... up to 5 ms while the client
        // may just be slow.
        let mut pause = FD_ROOM_FIRST_PAUSE;
        let mut waited = Duration::ZERO;
        let mut pauses = Vec::new();
        while waited < FD_ROOM_PATIENCE {
            waited += pause;
            pause = fd_room_pause(pause, waited);
            pauses.push(pause);
        }
        assert_eq!(pauses[0], Duration::from_micros(40));
        assert_eq!(pauses[7], Duration::from_micros(5120).min(FD_ROOM_PAUSE));
        // The last one was chosen once the patience was over.
        let (_, patient) = pauses.split_last().unwrap();
        assert!(patient.iter().all(|p| *p <= FD_ROOM_PAUSE), "{pauses:?}");
        // About 100 ms of it takes a few dozen polls, not thousands.
        assert!(pauses.len() < 40, "{} polls", pauses.len());
        // Past the patience, up to 50 ms: a client that reads nothing costs
        // about 100 polls over the 5 s send timeout instead of 1,000.
        let mut polls = 0;
        while waited < Duration::from_secs(5) {
            waited += pause;
            pause = fd_room_pause(pause, waited);
            polls += 1;
        }
        assert_eq!(pause, FD_ROOM_SLOW_PAUSE);
        assert!((95..=110).contains(&polls), "{polls} polls");
    }
}
