//! Demultiplexing: one reader at a time hands each incoming wire message to
//! the request or queue it belongs to.

use std::collections::{HashMap, HashSet, VecDeque};
use std::os::fd::OwnedFd;

use crate::ChannelError;
use crate::wire::{Message, WireError};

use super::types::{FrameNotice, Notice, Update};

/// The code of the error filed for an answer whose descriptors this
/// process could not take (`EMFILE`).
pub(super) const OUT_OF_DESCRIPTORS: &str = "out_of_descriptors";

/// Why a connection is over; turns back into an error for every later call.
pub(super) enum Dead {
    Gone,
    Protocol(String),
    Frame(WireError),
    Remote {
        code: String,
        message: String,
    },
    Io {
        context: String,
        kind: std::io::ErrorKind,
        text: String,
    },
}

impl Dead {
    pub(super) fn from_error(e: ChannelError) -> Dead {
        match e {
            // A message cut short by end of file means the server went away
            // while sending (it was killed, or it cut us off as too slow).
            ChannelError::PeerGone | ChannelError::Wire(WireError::Truncated { .. }) => Dead::Gone,
            ChannelError::Wire(f) => Dead::Frame(f),
            ChannelError::Protocol { reason } => Dead::Protocol(reason),
            ChannelError::Remote { code, message } => Dead::Remote { code, message },
            ChannelError::Io { context, source } => Dead::Io {
                context,
                kind: source.kind(),
                text: source.to_string(),
            },
            other => Dead::Protocol(other.to_string()),
        }
    }

    pub(super) fn error(&self) -> ChannelError {
        match self {
            Dead::Gone => ChannelError::PeerGone,
            Dead::Protocol(reason) => ChannelError::Protocol {
                reason: reason.clone(),
            },
            Dead::Frame(f) => ChannelError::Wire(f.clone()),
            Dead::Remote { code, message } => ChannelError::Remote {
                code: code.clone(),
                message: message.clone(),
            },
            Dead::Io {
                context,
                kind,
                text,
            } => ChannelError::Io {
                context: context.clone(),
                source: std::io::Error::new(*kind, text.clone()),
            },
        }
    }
}

pub(super) struct RingQueue {
    pub(super) name: String,
    pub(super) slot_count: u32,
    pub(super) frames: VecDeque<FrameNotice>,
    pub(super) ended: bool,
    /// Why the producer ended the subscription, if it did.
    pub(super) evicted: Option<String>,
    /// The producer skipped this subscriber: the last withdrawn frame and
    /// why; reported once by `next_frame`.
    pub(super) lagged: Option<(u64, String)>,
}

impl RingQueue {
    /// The producer gave up on this subscriber's acks: withdraws the frames
    /// up to `stale_through` (their slots may be refilled already) and
    /// records why, for `next_frame` to report.
    fn late(&mut self, stale_through: u64, evicted: bool, reason: String) {
        self.frames.retain(|f| f.seq > stale_through);
        if evicted {
            self.ended = true;
            self.evicted = Some(reason);
        } else {
            self.lagged = Some((stale_through, reason));
        }
    }
}

#[derive(Default)]
pub(super) struct State {
    /// Whether a thread is reading the socket now.
    pub(super) reading: bool,
    pub(super) last_id: u64,
    /// Requests whose callers still wait, with the ring name for `attach_ring`.
    pub(super) waiting: HashMap<u64, Option<String>>,
    pub(super) responses: HashMap<u64, VecDeque<(Message, Vec<OwnedFd>)>>,
    pub(super) updates: VecDeque<Update>,
    pub(super) rings: HashMap<u64, RingQueue>,
    /// The plain-entry leases this client holds: notices about any other
    /// lease are dropped, so that a server cannot fill our memory with them.
    pub(super) held: HashSet<u64>,
    /// Leases granted to requests whose callers gave up: to release.
    pub(super) orphans: Vec<u64>,
    pub(super) dead: Option<Dead>,
    /// Notices and acks by path (the path itself is filled in by
    /// `Client::notice_stats`).
    pub(super) stats: super::NoticeStats,
}

impl State {
    pub(super) fn next_id(&mut self) -> u64 {
        self.last_id += 1;
        self.last_id
    }

    /// Forgets a lease this client released: its ring queue, and the
    /// notices about it not yet taken.
    pub(super) fn forget(&mut self, lease: u64) {
        self.rings.remove(&lease);
        self.held.remove(&lease);
        self.updates.retain(|u| u.lease != lease);
    }

    pub(super) fn take_response(&mut self, id: u64) -> Option<(Message, Vec<OwnedFd>)> {
        let queue = self.responses.get_mut(&id)?;
        let r = queue.pop_front();
        if queue.is_empty() {
            self.responses.remove(&id);
        }
        r
    }

    /// Files the error for an answer whose descriptors the kernel dropped
    /// because this process is at its open-file limit (see
    /// `recv_message`); a lease it granted goes back.
    fn descriptors_lost(&mut self, message: &Message) {
        let (Message::Attached { id, lease, .. } | Message::RingSlot { id, lease, .. }) = message
        else {
            return;
        };
        if matches!(message, Message::Attached { .. }) {
            self.orphans.push(*lease);
        }
        let error = Message::Error {
            id: Some(*id),
            code: OUT_OF_DESCRIPTORS.into(),
            message: message.type_name().into(),
            details: serde_json::json!({ "expected": message.fd_count() }),
        };
        self.dispatch(error, Vec::new());
    }

    /// Files one message from the server where it belongs.
    pub(super) fn dispatch(&mut self, message: Message, fds: Vec<OwnedFd>) {
        if fds.len() < message.fd_count() {
            return self.descriptors_lost(&message);
        }
        match message {
            Message::Update { lease, .. } | Message::Unpublished { lease, .. }
                if !self.held.contains(&lease) && !self.rings.contains_key(&lease) =>
            {
                tracing::debug!(
                    lease,
                    "dropped a notice about a lease this client does not hold"
                );
            }
            Message::Update {
                lease,
                name,
                version,
                notice,
            } => self.updates.push_back(Update {
                lease,
                name,
                notice: Notice::Updated {
                    version,
                    data: notice,
                },
            }),
            Message::RingFrame {
                lease,
                slot,
                seq,
                notice,
            } => {
                // Frames for a released ring are dropped.
                if let Some(q) = self.rings.get_mut(&lease) {
                    q.frames.push_back(FrameNotice {
                        lease,
                        slot,
                        seq,
                        notice,
                    });
                }
            }
            Message::RingLate {
                lease,
                stale_through,
                evicted,
                reason,
            } => {
                if let Some(q) = self.rings.get_mut(&lease) {
                    q.late(stale_through, evicted, reason);
                }
            }
            Message::Unpublished { lease, name } => match self.rings.get_mut(&lease) {
                Some(q) => q.ended = true,
                None => self.updates.push_back(Update {
                    lease,
                    name,
                    notice: Notice::Unpublished,
                }),
            },
            Message::Error {
                id: None,
                code,
                message,
                ..
            } => {
                self.dead = Some(Dead::Remote { code, message });
            }
            Message::Listing { id, .. }
            | Message::Attached { id, .. }
            | Message::Released { id }
            | Message::RingAttached { id, .. }
            | Message::RingSlot { id, .. }
            | Message::Pong { id }
            | Message::Reply { id, .. }
            | Message::Error { id: Some(id), .. } => self.file_response(id, message, fds),
            other => {
                self.dead = Some(Dead::Protocol(format!(
                    "the server sent a {:?} message, which only clients send or which \
                     belongs to the handshake",
                    other.type_name()
                )));
            }
        }
    }

    /// Files an answer to request `id` for its caller (or releases the
    /// lease it grants when nobody waits for it any more).
    fn file_response(&mut self, id: u64, message: Message, fds: Vec<OwnedFd>) {
        let Some(ring_name) = self.waiting.get(&id) else {
            // Its caller gave up; a lease granted to it goes back.
            if let Message::Attached { lease, .. } | Message::RingAttached { lease, .. } = message {
                self.orphans.push(lease);
            }
            return;
        };
        if let Message::Attached { lease, .. } = &message {
            self.held.insert(*lease);
        }
        if let Message::RingAttached { lease, slots, .. } = &message {
            self.rings.insert(
                *lease,
                RingQueue {
                    name: ring_name.clone().unwrap_or_default(),
                    slot_count: *slots,
                    frames: VecDeque::new(),
                    ended: false,
                    evicted: None,
                    lagged: None,
                },
            );
        }
        self.responses
            .entry(id)
            .or_default()
            .push_back((message, fds));
    }
}

/// The error for an answer of the wrong type: the server's error message, or
/// a protocol violation.
pub(super) fn unexpected(message: Message, expected: &str, name: &str) -> ChannelError {
    match message {
        Message::Error { code, .. } if code == "not_found" => {
            ChannelError::NotFound { name: name.into() }
        }
        // Filed by this client (see `State::dispatch`), not sent by the server.
        Message::Error {
            code,
            message,
            details,
            ..
        } if code == OUT_OF_DESCRIPTORS => ChannelError::OutOfDescriptors {
            kind: Message::TYPES
                .iter()
                .find(|t| **t == message)
                .copied()
                .unwrap_or("attached"),
            expected: details
                .get("expected")
                .and_then(serde_json::Value::as_u64)
                .unwrap_or(0) as usize,
            limit: rustix::process::getrlimit(rustix::process::Resource::Nofile)
                .current
                .map_or_else(|| "unlimited".to_owned(), |n| n.to_string()),
        },
        Message::Error { code, message, .. } => ChannelError::Remote { code, message },
        other => ChannelError::protocol(format!(
            "expected a {expected:?} message from the server, got {:?}",
            other.type_name()
        )),
    }
}
