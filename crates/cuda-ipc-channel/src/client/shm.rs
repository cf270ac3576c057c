//! The client's end of shared-memory notices (see [`crate::notices`]):
//! reading the socket and the notice ring in the server's order, and
//! acking through the ack ring.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use cuda_ipc_shm::{Ready, Receiver, Sender};

use crate::notices::{
    client_rings, decode_record, encode_binary_record, encode_record, is_notice, is_ring_reply,
    shm_error,
};
use crate::socket::{RecvLimits, recv_message};
use crate::wire::{Message, encode_message};
use crate::{ChannelError, lock};

use super::Client;

/// The client's two rings.
pub(super) struct ClientShm {
    /// Taken by the thread that reads (the one with `State::reading`).
    pub(super) reader: Mutex<NoticeReader>,
    /// Acks, and requests when granted; any thread.
    pub(super) acks: Mutex<Sender>,
    /// The server granted requests (and their answers) through the rings.
    pub(super) requests: bool,
}

impl ClientShm {
    pub(super) fn new(acks: Sender, notices: Receiver, requests: bool) -> ClientShm {
        ClientShm {
            reader: Mutex::new(NoticeReader {
                rx: notices,
                // The welcome.
                received: 1,
                pending: None,
                buf: Vec::new(),
            }),
            acks: Mutex::new(acks),
            requests,
        }
    }
}

/// The notice ring and where the socket is, in the server's count.
pub(super) struct NoticeReader {
    rx: Receiver,
    /// Socket messages received, the welcome included.
    received: u64,
    /// A record taken from the ring that waits for more socket messages
    /// (its count, its message).
    pending: Option<(u64, Message)>,
    buf: Vec<u8>,
}

/// What one turn of reading brought, in the server's order: each message
/// with its descriptors and whether it came through the ring; then the
/// error that ended the turn, if any (a timeout included).
pub(super) struct Batch {
    pub(super) messages: Vec<(Message, Vec<OwnedFd>, bool)>,
    pub(super) error: Option<ChannelError>,
}

impl NoticeReader {
    /// The next record: the pending one, else one from the ring (which
    /// carries answers too when `replies`: requests were granted).
    fn next_record(&mut self, replies: bool) -> Result<Option<(u64, Message)>, ChannelError> {
        if let Some(p) = self.pending.take() {
            return Ok(Some(p));
        }
        if !self.rx.recv(&mut self.buf).map_err(shm_error)? {
            return Ok(None);
        }
        let (after, message) = decode_record(&self.buf, crate::MAX_PAYLOAD)?;
        let allowed = is_notice(&message) || (replies && is_ring_reply(&message));
        if !allowed {
            let carries = if replies {
                "notices and answers without descriptors"
            } else {
                "only notices"
            };
            return Err(ChannelError::protocol(format!(
                "a {:?} message came through the shared-memory ring, which carries {carries}",
                message.type_name()
            )));
        }
        Ok(Some((after, message)))
    }

    /// Moves the records that follow at most `upto` socket messages into
    /// `out`, in order; the first that follows more waits as pending.
    /// `replies`: as for [`NoticeReader::next_record`].
    fn take_upto(
        &mut self,
        replies: bool,
        upto: u64,
        out: &mut Vec<(Message, Vec<OwnedFd>, bool)>,
    ) -> Result<(), ChannelError> {
        // At most a ring's worth: a server that writes as fast as we read
        // cannot keep us here.
        for _ in 0..crate::NOTICE_RING_BYTES / 8 {
            let Some((after, message)) = self.next_record(replies)? else {
                return Ok(());
            };
            if after > upto {
                self.pending = Some((after, message));
                return Ok(());
            }
            out.push((message, Vec::new(), true));
        }
        Ok(())
    }
}

impl Client {
    /// One turn of reading with shared-memory notices: the records that
    /// may be filed now, or else the next socket message (after the
    /// records counted before it), waiting until `deadline` by spinning for
    /// `limits.spin`, then sleeping on the ring's wake-up socket and the socket
    /// together (a server that dies wakes us at once).
    pub(super) fn receive_shm(
        &self,
        shm: &ClientShm,
        deadline: Instant,
        limits: RecvLimits,
    ) -> Batch {
        let mut r = lock(&shm.reader);
        let mut batch = Batch {
            messages: Vec::new(),
            error: None,
        };
        loop {
            let received = r.received;
            if let Err(e) = r.take_upto(shm.requests, received, &mut batch.messages) {
                batch.error = Some(e);
                return batch;
            }
            if !batch.messages.is_empty() {
                return batch;
            }
            // A record waits for the socket: only the socket can help.
            if r.pending.is_none() {
                match r
                    .rx
                    .wait(limits.spin, Some(deadline), Some(self.stream.as_fd()))
                {
                    Ok(Ready::Ring) => continue,
                    Ok(Ready::Timeout) => {
                        batch.error = Some(ChannelError::Timeout {
                            what: "a message from the peer".into(),
                            after: Duration::ZERO,
                        });
                        return batch;
                    }
                    Ok(_) => {}
                    Err(e) => {
                        batch.error = Some(shm_error(e));
                        return batch;
                    }
                }
            }
            let limits = RecvLimits {
                spin: Duration::ZERO,
                ..limits
            };
            match recv_message(&self.stream, Some(deadline), limits) {
                Ok((message, fds)) => {
                    // The records sent before this message come first.
                    let taken = r.take_upto(shm.requests, received, &mut batch.messages);
                    r.received += 1;
                    batch.messages.push((message, fds, false));
                    batch.error = taken.err();
                    return batch;
                }
                Err(e @ ChannelError::Timeout { .. }) => {
                    batch.error = Some(e);
                    return batch;
                }
                Err(e) => {
                    // The server is gone: what it put in the ring still counts.
                    let _ = r.take_upto(shm.requests, u64::MAX, &mut batch.messages);
                    batch.error = Some(e);
                    return batch;
                }
            }
        }
    }
}

impl ClientShm {
    /// Sends an ack through the ring: `Ok(true)` if it went, `Ok(false)` if
    /// the ring has no room (send it on the socket).
    pub(super) fn ack(&self, ack: &Message) -> Result<bool, ChannelError> {
        let record = match encode_binary_record(0, ack) {
            Some(record) => record,
            None => encode_record(0, &encode_message(ack, 0)?),
        };
        lock(&self.acks).send(&record).map_err(shm_error)
    }

    /// Sends a request through the ring after `after` socket messages:
    /// `Ok(true)` if it went, `Ok(false)` if the ring has no room (send it
    /// on the socket).
    pub(super) fn request(&self, after: u64, request: &Message) -> Result<bool, ChannelError> {
        let record = encode_record(after, &encode_message(request, 0)?);
        lock(&self.acks).send(&record).map_err(shm_error)
    }

    /// The rings the server's `welcome` granted (`capacity`: bytes a ring,
    /// `fds`: its descriptors; `requests`: requests through them too), if
    /// it granted them; an error if it granted them (or requests) unasked
    /// or they are unusable.
    pub(super) fn granted(
        asked: bool,
        capacity: Option<u32>,
        requests: bool,
        fds: Vec<OwnedFd>,
    ) -> Result<Option<ClientShm>, ChannelError> {
        let Some(capacity) = capacity else {
            if requests {
                return Err(ChannelError::protocol(
                    "the server granted requests through shared memory without its rings",
                ));
            }
            return Ok(None);
        };
        if !asked {
            return Err(ChannelError::protocol(
                "the server granted shared-memory notices this client did not ask for",
            ));
        }
        let (acks, notices) = client_rings(fds, capacity)?;
        Ok(Some(ClientShm::new(acks, notices, requests)))
    }
}
