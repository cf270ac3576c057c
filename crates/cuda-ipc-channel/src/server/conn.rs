//! One client connection and its writer: queued replies, the writer thread.

use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use rustix::net::{Shutdown, shutdown};

use crate::socket::{Ucred, send_bytes, send_message, try_send_message};
use crate::wire::Message;
use crate::{ChannelError, lock};

use super::FINAL_SEND_TIMEOUT;

/// What waits for the writer thread.
pub(super) enum Outgoing {
    /// A frame, with the descriptors it carries.
    Frame { message: Message, fds: Vec<OwnedFd> },
    /// The end of a frame whose start (and descriptors) already went.
    Rest(Vec<u8>),
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum OutState {
    /// Accepting frames.
    Open,
    /// Send what is queued, then stop.
    Draining,
    /// Stop now; the queue is cleared.
    Closed,
}

pub(super) struct Outbox {
    pub(super) queue: VecDeque<Outgoing>,
    pub(super) state: OutState,
    /// The writer thread is sending a frame it took from the queue.
    pub(super) sending: bool,
}

pub(super) struct Conn {
    pub(super) id: u64,
    pub(super) stream: UnixStream,
    pub(super) cred: Ucred,
    pub(super) out: Mutex<Outbox>,
    pub(super) out_ready: Condvar,
}

impl Conn {
    /// Sends a frame: at once from the calling thread when nothing is
    /// queued or being sent and the socket takes it without waiting (no
    /// thread hop), else through the writer thread's queue. A client with
    /// too many unread frames is disconnected. Returns whether the frame
    /// was sent or queued.
    pub(super) fn push(&self, message: Message, fds: Vec<OwnedFd>, max_queued: usize) -> bool {
        let mut out = lock(&self.out);
        if out.state != OutState::Open {
            return false;
        }
        if out.queue.is_empty() && !out.sending {
            // Under the lock, so that no other frame can start meanwhile.
            let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(AsFd::as_fd).collect();
            match try_send_message(&self.stream, &message, &borrowed) {
                Ok((bytes, sent)) if sent == bytes.len() => return true,
                Ok((bytes, 0)) => drop(bytes),
                Ok((mut bytes, sent)) => {
                    bytes.drain(..sent);
                    out.queue.push_back(Outgoing::Rest(bytes));
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
        if out.queue.len() >= max_queued {
            tracing::warn!(
                pid = self.cred.pid,
                uid = self.cred.uid,
                queued = out.queue.len(),
                "disconnecting a client that does not read its socket"
            );
            out.queue.clear();
            out.state = OutState::Closed;
            drop(out);
            self.out_ready.notify_all();
            let _ = shutdown(&self.stream, Shutdown::Both);
            return false;
        }
        out.queue.push_back(Outgoing::Frame { message, fds });
        drop(out);
        self.out_ready.notify_all();
        true
    }

    /// Logs a failed send (unless the client simply went away) and stops
    /// the connection: a frame may have been cut in half.
    pub(super) fn send_failed(&self, e: &ChannelError) {
        if !matches!(e, ChannelError::PeerGone) {
            tracing::warn!(
                pid = self.cred.pid,
                uid = self.cred.uid,
                error = %e,
                "disconnecting a client that could not be sent a frame"
            );
        }
        self.abort();
    }

    /// Lets the writer send `last` (if any) and stop; drops queued frames.
    pub(super) fn finish(&self, last: Option<Message>) {
        let mut out = lock(&self.out);
        out.queue.clear();
        if out.state == OutState::Open {
            if let Some(message) = last {
                out.queue.push_back(Outgoing::Frame {
                    message,
                    fds: Vec::new(),
                });
            }
            out.state = OutState::Draining;
        }
        drop(out);
        self.out_ready.notify_all();
    }

    /// Waits until fewer than `limit` frames are queued, or the connection
    /// stops. (A client that never reads is cut off by the writer's send
    /// timeout, which ends this wait.)
    pub(super) fn wait_for_room(&self, limit: usize) {
        let mut out = lock(&self.out);
        while out.state == OutState::Open && out.queue.len() >= limit {
            out = self
                .out_ready
                .wait(out)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }

    /// Stops the connection now: the writer stops, and the reader sees end
    /// of file.
    pub(super) fn abort(&self) {
        let mut out = lock(&self.out);
        out.queue.clear();
        out.state = OutState::Closed;
        drop(out);
        self.out_ready.notify_all();
        let _ = shutdown(&self.stream, Shutdown::Both);
    }

    /// The writer thread's loop.
    pub(super) fn write_loop(&self, send_timeout: Duration) {
        loop {
            let (next, draining) = {
                let mut out = lock(&self.out);
                loop {
                    if let Some(o) = out.queue.pop_front() {
                        out.sending = true;
                        // The reader may be waiting for room.
                        self.out_ready.notify_all();
                        break (o, out.state == OutState::Draining);
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
            let deadline = Some(Instant::now() + timeout);
            let sent = match &next {
                Outgoing::Frame { message, fds } => {
                    let fds: Vec<BorrowedFd<'_>> = fds.iter().map(AsFd::as_fd).collect();
                    send_message(&self.stream, message, &fds, deadline)
                }
                Outgoing::Rest(bytes) => send_bytes(&self.stream, bytes, &[], deadline),
            };
            lock(&self.out).sending = false;
            if let Err(e) = sent {
                self.send_failed(&e);
                return;
            }
            // `next` drops here: our duplicates of the descriptors close; the
            // client has its own.
        }
    }
}
